"""Llama (SmolLM2-135M shape) forward+backward: compile time vs depth, throughput.

Prints, all measured in this run:
  * compile time of a jitted forward+backward for 2 and 30 layers (layers run with
    jax.lax.scan, so the 30-layer program is not 15x larger);
  * forward+backward tokens/s of the 30-layer model (with --remat also with
    per-layer rematerialisation);
  * achieved FLOP/s as a fraction of a large jnp.dot's FLOP/s (the machine's own
    matmul rate, the physical limit).

Usage: python benchmarks/models.py [--batch 2] [--seq 32] [--steps 2] [--remat]
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import jax
import jax.numpy as jnp

from entrenar.nn import LlamaConfig
from entrenar.nn.losses import causal_lm_loss


def matmul_flops_per_s(n: int = 2048, reps: int = 5) -> float:
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32)
    b = jax.random.normal(jax.random.key(1), (n, n), jnp.float32)
    f = jax.jit(jnp.dot)
    f(a, b).block_until_ready()
    t0 = time.perf_counter()
    for _ in range(reps):
        f(a, b).block_until_ready()
    return 2 * n**3 * reps / (time.perf_counter() - t0)


def train_flops(c: LlamaConfig, batch: int, seq: int) -> float:
    """Matmul FLOPs of one forward+backward (3x forward), attention included."""
    d, i, v, n = c.hidden_size, c.intermediate_size, c.vocab_size, c.num_layers
    qd, kvd = c.num_heads * c.hd, c.num_kv_heads * c.hd
    per_token = 2 * (n * (d * qd + 2 * d * kvd + qd * d + 3 * d * i) + v * d)
    attention = 2 * 2 * seq * qd * n  # q·k and p·v over all (masked) keys
    return 3.0 * batch * seq * (per_token + attention)


def loss_fn(c: LlamaConfig):
    def loss(params, tokens):
        return causal_lm_loss(c.apply(params, tokens), tokens)  # logits (B, T, V)

    return jax.jit(jax.value_and_grad(loss))


def compile_seconds(c: LlamaConfig, tokens: jax.Array):
    params = jax.eval_shape(c.init, jax.random.key(0))
    step = loss_fn(c)
    t0 = time.perf_counter()
    compiled = step.lower(params, tokens).compile()
    return time.perf_counter() - t0, compiled


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--remat", action="store_true", help="also time remat=True")
    args = ap.parse_args()
    b, t = args.batch, args.seq
    tokens = jax.random.randint(jax.random.key(1), (b, t + 1), 0, 49152, jnp.int32)
    print(f"backend {jax.default_backend()}, batch {b}, seq {t}")

    peak = matmul_flops_per_s()
    print(f"jnp.dot 2048^3 float32: {peak / 1e9:.1f} GFLOP/s")

    base = LlamaConfig.smollm2_135m()
    compile_seconds(dataclasses.replace(base, num_layers=1), tokens)  # warm-up
    c2, _ = compile_seconds(dataclasses.replace(base, num_layers=2), tokens)
    c30, compiled = compile_seconds(base, tokens)
    print(f"compile fwd+bwd  2 layers: {c2:.2f} s")
    print(f"compile fwd+bwd 30 layers: {c30:.2f} s  (ratio {c30 / c2:.2f}x)")

    params = base.init(jax.random.key(0))
    for remat in (False, True) if args.remat else (False,):
        c = dataclasses.replace(base, remat=remat)
        fn = compiled if not remat else compile_seconds(c, tokens)[1]
        jax.block_until_ready(fn(params, tokens))  # warm-up
        t0 = time.perf_counter()
        for _ in range(args.steps):
            jax.block_until_ready(fn(params, tokens))
        dt = (time.perf_counter() - t0) / args.steps
        flops = train_flops(base, b, t)
        print(
            f"fwd+bwd 30 layers remat={remat!s:5}: {dt * 1e3:.0f} ms/step, "
            f"{b * t / dt:.0f} tokens/s, {flops / dt / 1e9:.1f} GFLOP/s = "
            f"{flops / dt / peak:.2f} of jnp.dot"
        )


if __name__ == "__main__":
    main()
