"""Peak memory of ``entrenar merge`` of two 1.1B models: whole in memory vs streamed.

Three Hugging Face folders of TinyLlama-1.1B's shape (SmolLM2's vocabulary,
bfloat16, 2 shards; `benchmarks/load_memory.py` writes the base): the base and two
copies with independent Gaussian noise (std 0.002, a tenth of the weights' scale)
on every tensor. Each contestant runs

    entrenar merge A B --base BASE --method ties --density 0.5 -o OUT

(a Hugging Face folder out) in a fresh process, and reports the wall time and the
peak resident memory (``VmHWM``: JAX's buffers and the mapped files' pages
included):

- ``before``: the command as of ``--before`` (a git worktree of the commit before
  streaming): every merged leaf kept, then the model serialized and written;
- ``after``: the command now: each leaf merged, written and released in file order
  (`entrenar.merge.run.merge_streamed`).

The two output files are compared byte for byte (sha256).

Usage: ``python benchmarks/merge_streaming.py --base-folder DIR --work DIR
--before WORKTREE [--write-md benchmarks/results/scale.md]``
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import subprocess
import sys
import time
from typing import Any

import numpy as np

CHILD = """
import sys, time
from entrenar.cli import cli
t = time.perf_counter()
try:
    cli(sys.argv[1:], standalone_mode=False)
finally:
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            print("PEAK", int(line.split()[1]) * 1024, time.perf_counter() - t)
"""


def perturbed_copy(base: str, out: str, seed: int, std: float = 0.002) -> None:
    """``base`` (a bf16 folder) plus noise of std ``std``, one shard at a time."""
    import ml_dtypes

    from entrenar.io.safetensors_io import read_safetensors, save_safetensors

    os.makedirs(out, exist_ok=True)
    rng = np.random.default_rng(seed)
    for name in sorted(os.listdir(base)):
        src = os.path.join(base, name)
        if not name.endswith(".safetensors"):
            with open(src, "rb") as f, open(os.path.join(out, name), "wb") as g:
                g.write(f.read())
            continue
        tensors, meta = read_safetensors(src)
        shard = {}
        for k, v in tensors.items():
            noise = rng.standard_normal(v.shape, np.float32) * std
            shard[k] = (v.astype(np.float32) + noise).astype(ml_dtypes.bfloat16)
        save_safetensors(shard, os.path.join(out, name), meta)
        del shard, tensors


def sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()


def run(where: str, base: str, a: str, b: str, out: str) -> dict[str, float]:
    """One ``entrenar merge`` in a fresh process run from ``where``'s code."""
    args = ["merge", a, b, "--base", base, "--method", "ties", "--density", "0.5"]
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    res = subprocess.run(
        [sys.executable, "-c", CHILD, *args, "-o", out],
        cwd=where, env=env, capture_output=True, text=True, check=True,
    )  # fmt: skip
    line = [x for x in res.stdout.splitlines() if x.startswith("PEAK")][-1]
    _, peak, secs = line.split()
    return {"peak": float(peak), "seconds": float(secs)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base-folder", required=True, help="the bf16 TinyLlama folder")
    ap.add_argument("--work", required=True, help="where the copies and outputs go")
    ap.add_argument("--before", required=True, help="worktree of the code before")
    ap.add_argument("--write-md", default=None)
    args = ap.parse_args()
    base = os.path.abspath(args.base_folder)
    a, b = (os.path.join(args.work, x) for x in ("a", "b"))
    for seed, folder in ((1, a), (2, b)):
        if not os.path.exists(os.path.join(folder, "config.json")):
            perturbed_copy(base, folder, seed)
    size = sum(
        os.path.getsize(os.path.join(base, f))
        for f in os.listdir(base)
        if f.endswith(".safetensors")
    )
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    load = [os.getloadavg()]
    result: dict[str, dict[str, Any]] = {}
    for label, where in (("before", args.before), ("after", here)):
        out = os.path.join(args.work, f"merged-{label}")
        result[label] = run(where, base, a, b, out)
        result[label]["sha256"] = sha256(os.path.join(out, "model.safetensors"))
        load.append(os.getloadavg())
        print(label, json.dumps(result[label]), flush=True)
    same = result["before"]["sha256"] == result["after"]["sha256"]
    cpu = "?"
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    gb = 1e9
    lines = [
        "",
        "## Streaming merge",
        "",
        "`python benchmarks/merge_streaming.py --base-folder "
        f"{args.base_folder} --work {args.work} --before {args.before}` "
        f"({time.strftime('%Y-%m-%d')}, {cpu}, {platform.machine()}, load "
        f"{load[0][0]:.1f} before, {load[-1][0]:.1f} after): `entrenar merge A B "
        "--base BASE --method ties --density 0.5 -o OUT` of three TinyLlama-1.1B-"
        f"shaped bfloat16 folders ({size / gb:.2f} GB each, 2 shards), a folder out.",
        "",
        "| | peak RSS (GB) | wall (s) |",
        "|---|---|---|",
    ]
    for label in ("before", "after"):
        r = result[label]
        lines.append(f"| {label} | {r['peak'] / gb:.2f} | {r['seconds']:.0f} |")
    lines += [
        "",
        f"Peak after / before: {result['after']['peak'] / result['before']['peak']:.2f}"
        f"; one model is {size / gb:.2f} GB. Output files byte-identical: {same}.",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.write_md:
        with open(args.write_md, "a") as f:
            f.write(text)


if __name__ == "__main__":
    main()
