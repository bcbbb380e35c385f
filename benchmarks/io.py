"""Loading SmolLM2-135M's GGUF into params, beside reading the same bytes raw.

Measured in one run, median of ``--repeats``:

1. raw read: the file's bytes into memory (``f.read()``), the physical floor;
2. header: `entrenar.io.read_gguf` (metadata, 49k-token vocabulary, tensor infos);
3. peer: the ``gguf`` package (``GGUFReader`` + ``gguf.quants.dequantize`` of every
   tensor, llama.cpp's dequantization in numpy), float32 numpy arrays;
4. entrenar: `load_llama_gguf` dequantized to float32 jax arrays (q/k un-permuted,
   layers stacked), and with ``keep_quantized=True`` (Q4_1/Q8_0 kept as
   `QuantizedWeight`).

Usage: ``python benchmarks/io.py [--repeats 3]``
"""

from __future__ import annotations

import argparse
import os
import platform
import time

import jax
import numpy as np

from entrenar.io import load_llama_gguf, read_gguf, smollm2_path


def median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def raw_read(path: str) -> int:
    with open(path, "rb") as f:
        return len(f.read())


def gguf_peer(path: str) -> int:
    import gguf

    r = gguf.GGUFReader(path)
    out = [gguf.quants.dequantize(t.data, t.tensor_type) for t in r.tensors]
    return len(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    path = smollm2_path()
    mb = os.path.getsize(path) / 2**20
    print(
        f"# {os.path.basename(path)} ({mb:.1f} MiB), {platform.machine()}, "
        f"jax {jax.__version__}, {os.cpu_count()} CPUs, median of {args.repeats}"
    )
    rows = [
        ("raw read of the file (floor)", lambda: raw_read(path)),
        ("entrenar read_gguf (header + vocab)", lambda: read_gguf(path).version),
        ("peer: gguf GGUFReader + dequantize all", lambda: gguf_peer(path)),
        ("entrenar load_llama_gguf -> float32", lambda: load_llama_gguf(path)[1]),
        (
            "entrenar load_llama_gguf keep_quantized",
            lambda: load_llama_gguf(path, keep_quantized=True)[1],
        ),
    ]
    raw_read(path)  # warm the page cache
    times = {name: median_time(fn, args.repeats) for name, fn in rows}
    base, peer = times[rows[0][0]], times[rows[2][0]]
    print("| step | seconds | x raw read | x peer |")
    print("|---|---|---|---|")
    for name, t in times.items():
        print(f"| {name} | {t:.3f} | {t / base:.1f} | {t / peer:.2f} |")


if __name__ == "__main__":
    main()
