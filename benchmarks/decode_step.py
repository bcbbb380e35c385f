"""One decoding step of SmolLM2-135M at several cache lengths (issue 37).

`entrenar.nn.generate.decode_step` (the compiled step `nn.generate_stream` runs per
token, cache donated) on SmolLM2-135M-Instruct's Q4_1 GGUF loaded with
`load_llama_gguf(keep_quantized=True)` and its tied head kept as Q8_0
(`quantize_tied_head`), batch 1, greedy, the cache starting at position
``S - steps - 4`` (every step attends to nearly ``S`` keys). Each cache length ``S``
is compiled and warmed up (3 steps), then timed over ``--steps`` steps; the median is
printed with the CPU and the load average before and after. Run it in two checkouts
(before / after a change) in one window to compare: what a step costs beyond the
weights' read grows with ``S`` (attention, and whatever copies of the cache the
program makes). ``--logprobs K`` times the step that also returns the chosen token's
log-probability and its ``K`` likeliest alternatives (`entrenar.nn.StepLogprobs`:
computed for 0 or 20); without it, the default step.

Usage: ``python benchmarks/decode_step.py [--lengths 128 512 2048] [--steps 10]
[--logprobs K]``
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax.numpy as jnp
from machine import cpu_name, load


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[128, 512, 2048])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--logprobs", type=int, default=None)
    args = parser.parse_args()

    from entrenar import io
    from entrenar.nn.generate import StepLogprobs, decode_step
    from entrenar.nn.sampling import Sampling
    from entrenar.quant.matvec import quantize_tied_head

    print(f"CPU: {cpu_name()}; logprobs {args.logprobs}; load before: {load()}")
    cfg, params, _ = io.load_llama_gguf(io.smollm2_path(), keep_quantized=True)
    params = quantize_tied_head(params)
    sampling = Sampling(0.0, None, None, None, None)
    top = None if args.logprobs is None else StepLogprobs(args.logprobs).computed
    for s in args.lengths:
        start = jnp.int32(s - args.steps - 4)  # 3 warm-up steps + timed ones fit
        cache = cfg.init_cache(1, s)._replace(pos=start)  # (L, 1, S, KV, d)
        tok = jnp.ones((1,), jnp.int32)

        def step(cache, tok=tok):
            nxt, cache, _, _, _ = decode_step(
                cfg, params, tok, cache, None, jnp.zeros((1,), bool), None,
                jnp.int32(1), sampling.values(), jnp.zeros((0,), jnp.int32),
                jnp.int32(0), structure=sampling.structure(), logprobs=top,
            )  # fmt: skip
            nxt.block_until_ready()
            return cache

        for _ in range(3):
            cache = step(cache)
        times = []
        for _ in range(args.steps):
            t0 = time.perf_counter()
            cache = step(cache)
            times.append(time.perf_counter() - t0)
        med = statistics.median(times) * 1e3
        print(f"S={s}: median {med:.2f} ms/step (min {min(times) * 1e3:.2f})")
    print(f"load after: {load()}")


if __name__ == "__main__":
    main()
