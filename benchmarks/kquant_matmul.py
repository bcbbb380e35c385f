"""GGUF K-quant bases kept as stored: the blocked matmul against float32.

A (2048 x 2048) weight in each ggml type `entrenar.quant.GGMLWeight` keeps (random
valid blocks), ``y = x Wᵀ`` with ``x: (batch, 2048)`` through `entrenar.nn.linear`,
jitted: the forward alone and the forward plus the input-gradient (``dx = g W``, as
a QLoRA step needs), each as a ratio to the same on the dense float32 matrix of the
same values (timed alternately with it, medians). The
blocked path decodes `GGML_BLOCK_VALUES` values of whole rows at a time, never the
whole matrix. The load average is printed with the results: on shared cores it
moves the ratios.

Usage: ``python benchmarks/kquant_matmul.py [--batch 16 512] [--repeats 10]
[--block-values 262144]``
"""

from __future__ import annotations

import argparse
import os
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np

import entrenar.nn
from entrenar.nn.weight_node import nbytes, to_dense
from entrenar.quant import from_ggml
from entrenar.quant import linear as qlinear
from entrenar.quant.kquant import FORMATS

N = 2048
HALF_AT = {"Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2)}
HALF_AT["Q6_K"] = (208,)


def node(kind: str, rng: np.random.Generator):
    """A (2048, 2048) node of ``kind``: random bytes with small finite scales."""
    fmt = FORMATS[kind]
    if fmt.block_size == 1:  # BF16 / F16: the float bits of small values
        w = (rng.standard_normal((N, N)) * 0.02).astype(np.float32)
        raw = (w.view(np.uint32) >> 16).astype(np.uint16) if kind == "BF16" else w
        raw = raw.astype(np.float16) if kind == "F16" else raw
        return from_ggml(raw.view(np.uint8), kind, (N, N))
    raw = rng.integers(0, 256, (N, N // 256, fmt.type_size), np.uint8)
    for at in HALF_AT[kind]:
        half = (rng.standard_normal(raw.shape[:2]) * 2e-5).astype(np.float16)
        raw[..., at : at + 2] = half[..., None].view(np.uint8)
    return from_ggml(raw, kind, (N, N))


def paired_times(f, args_f, h, args_h, repeats: int) -> tuple[float, float]:
    """Median times of ``f(*args_f)`` and ``h(*args_h)``, run alternately.

    Alternating keeps both in the same window of the shared machine's load.
    """
    jax.block_until_ready(f(*args_f))  # compile + warm up
    jax.block_until_ready(h(*args_h))
    tf, th = [], []
    for _ in range(repeats):
        for fn, args, out in ((f, args_f, tf), (h, args_h, th)):
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*args))
            out.append(time.perf_counter() - t0)
    return float(np.median(tf)), float(np.median(th))


def forward(x, w):
    return entrenar.nn.linear(x, w)


def forward_and_input_grad(x, w, g):
    y, pull = jax.vjp(lambda x: entrenar.nn.linear(x, w), x)
    return y, pull(g)[0]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, nargs="+", default=[16, 512])
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--block-values", type=int, default=qlinear.GGML_BLOCK_VALUES)
    p.add_argument("--types", nargs="+", default=["Q4_K", "Q5_K", "Q6_K", "BF16"])
    args = p.parse_args()
    qlinear.GGML_BLOCK_VALUES = args.block_values
    rng = np.random.default_rng(0)
    f_fwd, f_bwd = jax.jit(forward), jax.jit(forward_and_input_grad)
    load = os.getloadavg()
    print(
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"jax {jax.__version__}, weight {N}x{N}, block {args.block_values} values, "
        f"load {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}"
    )
    print(
        "| type | MiB (f32 16.0) | batch | fwd f32 ms | fwd ms | fwd / f32 | "
        "fwd+dx f32 ms | fwd+dx ms | fwd+dx / f32 |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    nodes = {kind: node(kind, rng) for kind in args.types}
    for batch in args.batch:
        x = jnp.asarray(rng.standard_normal((batch, N)), jnp.float32)
        g = jnp.asarray(rng.standard_normal((batch, N)), jnp.float32)
        for kind, w in nodes.items():
            dense = to_dense(w)  # the peer: the same values as a float32 matrix
            t_f, tf = paired_times(f_fwd, (x, dense), f_fwd, (x, w), args.repeats)
            t_b, tb = paired_times(f_bwd, (x, dense, g), f_bwd, (x, w, g), args.repeats)
            print(
                f"| {kind} | {nbytes(w) / 2**20:.1f} | {batch} | {t_f * 1e3:.2f} | "
                f"{tf * 1e3:.2f} | **{tf / t_f:.2f}** | {t_b * 1e3:.2f} | "
                f"{tb * 1e3:.2f} | **{tb / t_b:.2f}** |"
            )
    load = os.getloadavg()
    print(f"load after: {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}")


if __name__ == "__main__":
    main()
