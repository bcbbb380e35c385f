"""AdamW against 8-bit AdamW (`optim.adamw_8bit`) on SmolLM2-135M's shapes.

Two measurements, each a jitted step with the trained parameters and the optimizer
state donated, the two optimizers interleaved repetition by repetition (rotating
which goes first) so machine noise hits both alike:

- ``optimizer``: `optim.apply_gradients` alone on the parameters of
  ``LlamaConfig.smollm2_135m(num_layers=--layers)`` (every leaf trained, a fixed
  gradient): AdamW's native one-pass kernel (entrenar/kernels/adamw.cc) against the
  8-bit one (entrenar/kernels/adamw8bit.cc);
- ``full_step``: full fine-tuning, forward + backward + the update, batch
  ``--batch`` x ``--seq`` tokens, chunked causal-LM loss.

Reported: median milliseconds per step, the ratio 8-bit / float, and the bytes of
optimizer state. Prints one JSON document.

    python benchmarks/optim_8bit.py [--layers 30] [--full-layers 4] [--reps 5]
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time
from typing import Any

import jax

from entrenar import optim
from entrenar.nn import LlamaConfig
from entrenar.nn import losses as nn_losses
from entrenar.tree import tree_bytes, tree_size


def _timed(steps: dict[str, Any], carries: dict[str, Any], reps: int) -> dict:
    """Median seconds of each named step, interleaved with a rotating order."""
    times: dict[str, list[float]] = {k: [] for k in steps}
    names = list(steps)
    for name in names:  # compile and warm up
        carries[name] = steps[name](*carries[name])
        jax.block_until_ready(carries[name])
    for r in range(reps):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            t0 = time.perf_counter()
            carries[name] = steps[name](*carries[name])
            jax.block_until_ready(carries[name])
            times[name].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def optimizer_only(layers: int, reps: int) -> dict[str, Any]:
    """`apply_gradients` alone on SmolLM2-135M's parameters."""
    cfg = LlamaConfig.smollm2_135m(num_layers=layers)
    params = cfg.init(jax.random.key(0))
    grads = jax.tree_util.tree_map(lambda x: 1e-3 * jax.numpy.ones_like(x), params)
    steps, carries, state_bytes = {}, {}, {}
    for name, tx in (
        ("adamw", optim.adamw(1e-4)),
        ("adamw_8bit", optim.adamw_8bit(1e-4)),
    ):
        state = tx.init(params)
        state_bytes[name] = tree_bytes(state)

        @functools.partial(jax.jit, donate_argnums=(0, 1))
        def step(p: Any, s: Any, tx: Any = tx) -> Any:
            return optim.apply_gradients(tx, grads, s, p)

        steps[name] = step
        carries[name] = (jax.tree_util.tree_map(jax.numpy.copy, params), state)
    t = _timed(steps, carries, reps)
    return {
        "parameters": tree_size(params),
        "ms": {k: round(v * 1e3, 2) for k, v in t.items()},
        "ratio_8bit": round(t["adamw_8bit"] / t["adamw"], 3),
        "state_bytes": state_bytes,
    }


def full_step(layers: int, batch: int, seq: int, reps: int) -> dict[str, Any]:
    """Forward, backward and update of every parameter (full fine-tuning)."""
    cfg = LlamaConfig.smollm2_135m(num_layers=layers)
    params = cfg.init(jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(2), (batch, seq), 0, cfg.vocab_size)

    def loss_of(p: Any) -> jax.Array:
        feats = cfg.features(p, tokens)
        return nn_losses.chunked_causal_lm_loss(
            feats, cfg.output_weight(p), tokens, chunk=128
        )

    steps, carries = {}, {}
    for name, tx in (
        ("adamw", optim.adamw(1e-4)),
        ("adamw_8bit", optim.adamw_8bit(1e-4)),
    ):

        @functools.partial(jax.jit, donate_argnums=(0, 1))
        def step(p: Any, s: Any, tx: Any = tx) -> Any:
            grads = jax.grad(loss_of)(p)
            return optim.apply_gradients(tx, grads, s, p)

        steps[name] = step
        carries[name] = (
            jax.tree_util.tree_map(jax.numpy.copy, params),
            tx.init(params),
        )
    t = _timed(steps, carries, reps)
    return {
        "parameters": tree_size(params),
        "tokens": batch * seq,
        "ms": {k: round(v * 1e3, 1) for k, v in t.items()},
        "ratio_8bit": round(t["adamw_8bit"] / t["adamw"], 3),
    }


def main() -> None:
    """The command line; prints the JSON document."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=30, help="optimizer-only model")
    ap.add_argument("--full-layers", type=int, default=4, help="full step's model")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args()
    out = {
        "device": str(jax.devices()[0]),
        "optimizer": optimizer_only(a.layers, a.reps),
        "full_step": full_step(a.full_layers, a.batch, a.seq, a.reps),
    }
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
