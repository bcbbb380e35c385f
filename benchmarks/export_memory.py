"""Peak memory of exporting a QLoRA fine-tune of a 1.1B model: whole fold vs streaming.

Loads the TinyLlama-1.1B-shape folder `load_memory.py` writes (bfloat16, SmolLM2's
vocabulary) with NF4 bases on every linear layer (`base_quantizer`, QLoRA rank 16),
gives every adapter a random ``B`` (a trained adapter), then, in a fresh subprocess
per case, writes what a run's ``export: {formats: [gguf, hf]}`` writes: a Q8_0 GGUF
through `lora.save_folded_gguf` and a Hugging Face folder.

- ``whole``: as before streaming: ``lora.fold`` of the whole tree, dequantized
  (`quant.dequantize_params`), then both writers on the dense tree;
- ``stream``: both writers on the tree as it is (each layer folded as written).

Reported: the peak RSS (``VmHWM``) of the export alone (reset after the load with
``/proc/self/clear_refs``), the tree's bytes, and whether the two cases wrote the
same files (SHA-256 of every file).

Usage: ``python benchmarks/export_memory.py [--dir /tmp/entrenar-load-memory]
[--layers 22] [--cases stream,whole]`` (the ``whole`` case needs about 6 GB).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))


def measure(folder: str, how: str, out: str) -> dict[str, Any]:
    """Load, then export ``how``; peak RSS of the export, seconds, file hashes."""
    import jax

    from entrenar import io, lora, quant
    from entrenar.runs.models import base_quantizer

    config = lora.LoRAConfig(
        rank=16, alpha=32, targets="all-linear", quantize_base="nf4"
    )
    info, params = io.load_hf_folder(
        folder, dtype="bfloat16", quantize=base_quantizer(config)
    )
    p = lora.apply(params, config, key=jax.random.key(0), quantize="nf4")

    def trained(x: Any) -> Any:
        if not isinstance(x, lora.LoRAWeight):
            return x
        b = jax.random.normal(jax.random.key(1), x.b.shape, x.b.dtype) * 0.01
        return x.replace(b=b)

    p = jax.block_until_ready(
        jax.tree_util.tree_map(
            trained, p, is_leaf=lambda x: isinstance(x, lora.LoRAWeight)
        )
    )
    tree = sum(x.nbytes for x in jax.tree_util.tree_leaves(p))
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := the current RSS: measure the export alone
    before = _status("VmRSS")
    t0 = time.perf_counter()
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    gguf, hf = os.path.join(out, "model.gguf"), os.path.join(out, "hf")
    if how == "whole":
        kept = lora.fold_retention(p, "Q8_0")
        dense = quant.dequantize_params(lora.fold(p))
        io.save_llama_gguf(gguf, info.config, dense, tensor_type="Q8_0")
        io.save_hf_folder(hf, info.config, dense)
    else:
        kept = lora.save_folded_gguf(gguf, info.config, p, tensor_type="Q8_0")
        io.save_hf_folder(hf, info.config, p)
    seconds = time.perf_counter() - t0
    peak = _status("VmHWM")
    files = {}
    for root, _, names in os.walk(out):
        for name in sorted(names):
            path = os.path.join(root, name)
            with open(path, "rb") as f:
                files[os.path.relpath(path, out)] = hashlib.file_digest(
                    f, "sha256"
                ).hexdigest()[:16]
    return {
        "seconds": seconds,
        "peak": peak,
        "growth": peak - before,
        "before": before,
        "tree": tree,
        "kept": kept.kept,
        "bytes": sum(os.path.getsize(os.path.join(r, n)) for r, _, ns in os.walk(out)
                     for n in ns),
        "files": files,
    }  # fmt: skip


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default="/tmp/entrenar-load-memory")
    ap.add_argument("--layers", type=int, default=22)
    ap.add_argument("--cases", default="stream,whole")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    folder = os.path.join(args.dir, f"tinyllama-shape-{args.layers}-layers-bf16")
    if args.child:
        out = f"{folder}-export-{args.child}"
        print(json.dumps(measure(folder, args.child, out)))
        return
    if not os.path.exists(os.path.join(folder, "config.json")):
        subprocess.run(
            [sys.executable, os.path.join(HERE, "load_memory.py"), "--dir", args.dir,
             "--layers", str(args.layers), "--cases", "bfloat16"],
            check=True,
        )  # fmt: skip
    load = os.getloadavg()
    got = {}
    for how in args.cases.split(","):
        res = subprocess.run(
            [sys.executable, __file__, "--dir", args.dir, "--layers",
             str(args.layers), "--child", how],
            capture_output=True, text=True, check=True,
            env=dict(os.environ, JAX_PLATFORMS="cpu"),
        )  # fmt: skip
        got[how] = json.loads(res.stdout.strip().splitlines()[-1])
        print(how, {k: v for k, v in got[how].items() if k != "files"}, flush=True)
    after = os.getloadavg()
    same = len({json.dumps(r["files"], sort_keys=True) for r in got.values()}) == 1
    print(f"load average {load[0]:.1f} before, {after[0]:.1f} after")
    print("| export | time (s) | peak RSS of the export (GB) | growth (GB) | tree (GB) "
          "| files (GB) | Q8_0 kept |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for how, r in got.items():
        print(
            f"| {how} | {r['seconds']:.1f} | {r['peak'] / 1e9:.2f} | "
            f"{r['growth'] / 1e9:.2f} | {r['tree'] / 1e9:.2f} | "
            f"{r['bytes'] / 1e9:.2f} | {r['kept']:.6f} |"
        )
    print("same files:", "yes" if same else "NO")


if __name__ == "__main__":
    main()
