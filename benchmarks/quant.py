"""Quantized weights: forward time and memory against float32, in one run.

1. A (4096 x 4096) linear layer, ``y = x Wᵀ`` with ``x: (batch, 4096)``, jitted, with
   float32 weights (the peer) and with NF4 / NF4+DQ / int8 / Q4_0 weights that are
   dequantized inside the jitted computation (`entrenar.nn.linear`). Reported: median
   forward time and stored weight bytes, each as a ratio to float32.
2. The seed's table: base-weight memory of a BERT-base-sized stack (12 layers of
   768 x 768) in float32 and 4-bit formats, counted from the stored arrays.

Usage: ``python benchmarks/quant.py [--batch 16] [--repeats 10]``
"""

from __future__ import annotations

import argparse
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np
from finetune_step import cpu_model  # a sibling script (benchmarks/ is on sys.path)

import entrenar.nn
from entrenar.quant import dequantize, memory_report, quantize

KB = 1024


def median_time(fn, *args, repeats: int) -> float:
    jax.block_until_ready(fn(*args))  # compile + warm up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def linear_4096(batch: int, repeats: int) -> list[str]:
    key_w, key_x = jax.random.split(jax.random.key(0))
    w = jax.random.normal(key_w, (4096, 4096), jnp.float32) * 0.02
    x = jax.random.normal(key_x, (batch, 4096), jnp.float32)
    f = jax.jit(entrenar.nn.linear)
    t_dense = median_time(f, x, w, repeats=repeats)
    b_dense = memory_report(w).bytes
    rows = [
        f"| float32 (peer) | {b_dense / KB / KB:.1f} | 1.000 | "
        f"{t_dense * 1e3:.2f} | 1.00 | 0 |"
    ]
    variants = [
        ("nf4", {}),
        ("nf4 + DQ", {"double_quant": True}),
        ("int4", {"scheme": "int4"}),
        ("int8 per-channel", {"scheme": "int8", "granularity": "channel"}),
        ("q4_0 (llama.cpp)", {"scheme": "q4_0"}),
    ]
    # the form before the few-rows block path: the whole matrix dequantized, then x Wᵀ
    whole = jax.jit(lambda x, q: x @ dequantize(q, x.dtype).T)
    for name, kw in variants:
        kw = dict(kw)
        q = quantize(w, kw.pop("scheme", "nf4"), **kw)
        for label, fn in ((name, f), (f"{name}, whole matrix dequantized", whole)):
            if fn is whole and name not in ("nf4 + DQ", "int4"):
                continue
            t = median_time(fn, x, q, repeats=repeats)
            err = float(jnp.max(jnp.abs(fn(x, q) - f(x, w))))
            stored = entrenar.nn.nbytes(q)
            rows.append(
                f"| {label} | {stored / KB / KB:.2f} | {stored / b_dense:.3f} | "
                f"{t * 1e3:.2f} | {t / t_dense:.2f} | {err:.3g} |"
            )
    head = [
        f"### Linear 4096 x 4096, x: ({batch}, 4096), median of {repeats}",
        "",
        "| weights | MiB | memory ratio | forward ms | time ratio | max abs err |",
        "|---|---|---|---|---|---|",
    ]
    return head + rows


def seed_table() -> list[str]:
    w = jax.random.normal(jax.random.key(1), (12, 768, 768), jnp.float32) * 0.02
    dense = memory_report(w).bytes
    nb = 768 // 64
    # The seed stored one 4-bit code per byte plus a float32 scale per 64 values.
    unpacked = 12 * 768 * 768 + 12 * 768 * nb * 4
    rows = [("float32", dense), ("4-bit codes unpacked (1 byte each) + f32 scales",
                                 unpacked)]  # fmt: skip
    for name, scheme, kw in [
        ("int4 packed", "int4", {}),
        ("nf4 packed", "nf4", {}),
        ("nf4 packed + double quantization", "nf4", {"double_quant": True}),
    ]:
        rows.append((name, memory_report(quantize(w, scheme, **kw)).bytes))
    out = [
        "### Seed table: 12 layers of 768 x 768 (BERT-base-sized), base weights",
        "",
        "Seed claimed: float32 27,648 KB vs 4-bit 8,352 KB (69.8% saved).",
        "",
        "| storage | KB | bits/param | saved vs float32 |",
        "|---|---|---|---|",
    ]
    n = 12 * 768 * 768
    for name, b in rows:
        saved = 100 * (1 - b / dense)
        out.append(f"| {name} | {b / KB:,.1f} | {8 * b / n:.3f} | {saved:.1f}% |")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    dev = jax.devices()[0]
    print(f"jax {jax.__version__} on {dev.platform} ({dev.device_kind}), "
          f"{cpu_model() or platform.machine()}\n")  # fmt: skip
    print("\n".join(seed_table()))
    print()
    print("\n".join(linear_4096(args.batch, args.repeats)))


if __name__ == "__main__":
    main()
