"""Peak memory and time of loading a 1.1B model: the whole-file load vs streaming.

Writes (once) a randomly initialised Hugging Face folder of TinyLlama-1.1B's shape
(22 layers, width 2048, MLP 5632, 32 heads, 4 KV heads) with SmolLM2's vocabulary
(49152, as issue 31 measured), bfloat16 safetensors in 2 shards, then loads it in a
fresh subprocess per case and reports the wall time and the peak resident memory
(``VmHWM`` of ``/proc/self/status``: JAX's CPU buffers and the mapped files' pages
included):

- ``whole``: ``load_hf_folder(..., stream=False)``, the load before streaming: every
  tensor stacked, cast, then (NF4) quantized;
- ``stream``: ``load_hf_folder(...)``, tensor by tensor into the final tree.

Targets: float32 and bfloat16 leaves, and a QLoRA run's NF4 bases
(`entrenar.runs.models.base_quantizer`; rank 16 on q/k/v/o as in the issue, and on
every linear layer); with ``--cases gguf-float32,gguf-keep-q8_0``, a Q8_0 GGUF of the
same model (`load_llama_gguf`, dequantized or kept). Each case hashes its tree, so the
table also says whether the two loads gave the same bytes. The file read alone
(``readinto`` of every shard, from the page cache) is the floor of the time.

Usage: ``python benchmarks/load_memory.py [--dir /tmp/entrenar-load-memory]
[--cases float32,bfloat16,nf4-qkvo,nf4-all] [--write-md benchmarks/results/scale.md]``
(``--layers 2`` for a quick check).
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

import numpy as np
from machine import cpu_name, peak_rss
from scale_models import shard_groups

CASES = {
    "float32": ("float32", None),
    "bfloat16": ("bfloat16", None),
    "nf4-qkvo": ("float32", ["q_proj", "k_proj", "v_proj", "o_proj"]),
    "nf4-all": ("float32", "all-linear"),
    "gguf-float32": ("float32", None),
    "gguf-keep-q8_0": ("float32", None),
}
"""Case -> (the load's dtype, the LoRA targets whose bases are NF4, or None). The
``gguf-`` cases load a Q8_0 GGUF of the same model (written from the folder once):
dequantized to float32, or its projections kept as Q8_0 (``keep_quantized``)."""
DEFAULT_CASES = "float32,bfloat16,nf4-qkvo,nf4-all"

TINYLLAMA = dict(
    vocab_size=49152, hidden_size=2048, intermediate_size=5632, num_layers=22,
    num_heads=32, num_kv_heads=4, max_position_embeddings=2048, rope_theta=10000.0,
    rms_norm_eps=1e-5, tie_word_embeddings=False,
)  # fmt: skip
LLAMA2_7B = dict(
    vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_layers=32,
    num_heads=32, num_kv_heads=32, max_position_embeddings=4096, rope_theta=10000.0,
    rms_norm_eps=1e-5, tie_word_embeddings=False,
)  # fmt: skip
SHAPES = {"tinyllama": TINYLLAMA, "llama2-7b": LLAMA2_7B}
"""``--shape`` -> the model's sizes (Llama-2-7B: 6.74B parameters, 13.5 GB of bf16)."""


def write_folder(
    folder: str,
    layers: int,
    shard_bytes: int = 1_300_000_000,
    shape: dict[str, Any] = TINYLLAMA,
) -> None:
    """The random bfloat16 folder, written shard by shard (never the whole model)."""
    import ml_dtypes

    from entrenar import nn
    from entrenar.io.safetensors_io import save_safetensors
    from entrenar.nn.hf_names import per_layer_shapes

    config = nn.LlamaConfig(**(shape | {"num_layers": layers}))
    shapes = per_layer_shapes(config)
    rng = np.random.default_rng(0)
    groups = shard_groups(sorted(shapes), shapes, shard_bytes)
    os.makedirs(folder, exist_ok=True)
    weight_map = {}
    for i, group in enumerate(groups):
        file = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        tensors = {}
        for name in group:
            scale = 1.0 if name.endswith("norm.weight") else 0.02
            a = rng.standard_normal(shapes[name], np.float32) * scale
            tensors[name] = a.astype(ml_dtypes.bfloat16)
        save_safetensors(tensors, os.path.join(folder, file), {"format": "pt"})
        weight_map |= {name: file for name in group}
        del tensors
    arch = nn.architecture_of(config)
    hf = arch.to_hf(config) | {"torch_dtype": "bfloat16"}
    index = {"metadata": {}, "weight_map": weight_map}
    for name, value in (("config.json", hf), ("model.safetensors.index.json", index)):
        with open(os.path.join(folder, name), "w") as f:
            json.dump(value, f, indent=2)


def gguf_path(folder: str) -> str:
    return folder.rstrip("/") + "-q8_0.gguf"


def write_gguf(folder: str) -> None:
    """The folder as a Q8_0 GGUF (embeddings too), as llama.cpp's converter writes."""
    from entrenar import io

    config, params = io.load_hf_llama(folder, dtype="float32")
    io.save_llama_gguf(gguf_path(folder), config, params, tensor_type="Q8_0")


def measure(folder: str, case: str, stream: bool) -> dict[str, Any]:
    """One load in this process: seconds, peak and growth of RSS, tree bytes, hash."""
    import jax

    from entrenar import io, lora
    from entrenar.runs.models import base_quantizer

    def status(key: str) -> int:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
        return 0

    dtype, targets = CASES[case]
    quantize = None
    if targets is not None:
        config = lora.LoRAConfig(rank=16, targets=targets, quantize_base="nf4")
        quantize = base_quantizer(config)
    before = status("VmRSS")
    t0 = time.perf_counter()
    if case.startswith("gguf-"):
        _, params, _ = io.load_llama_gguf(
            gguf_path(folder), keep_quantized=case.endswith("keep-q8_0"), stream=stream
        )
    else:
        _, params = io.load_hf_folder(
            folder, dtype=dtype, quantize=quantize, stream=stream
        )
    jax.block_until_ready(params)
    seconds = time.perf_counter() - t0
    peak = status("VmHWM")
    digest = hashlib.sha256()
    leaves = jax.tree_util.tree_leaves(params)
    for leaf in leaves:
        digest.update(np.ascontiguousarray(leaf).view(np.uint8).data)
    return {
        "seconds": seconds,
        "peak": peak,
        "growth": peak - before,
        "before": before,
        "tree": sum(x.nbytes for x in leaves),
        "sha256": digest.hexdigest()[:16],
    }


RUN_YAML = """\
name: tinyllama-shape-qlora
model: {{path: {folder}, tokenizer: {tokenizer}}}
data: {{train: {data}, format: chat, batch_size: 8, seq_len: 72}}
lora:
  {{rank: 16, alpha: 32, targets: [q_proj, k_proj, v_proj, o_proj], quantize_base: nf4}}
optimizer: {{name: adamw, lr: 0.002}}
training: {{max_steps: {steps}, log_every: 1, seed: 0, output_dir: {out}}}
export: {{formats: [adapter]}}
"""
"""The issue's measured run: QLoRA rank 16 on q/k/v/o, batch 8 x 72, SmolLM2's
tokenizer, the ISO-dates chat data (``examples/data/iso_dates``)."""


def measure_run(folder: str, steps: int, how: str) -> dict[str, Any]:
    """A QLoRA run of ``steps`` in this process: its peak RSS, after and before.

    Peaks after `prepare` (load, adapters, data) and after training and the
    adapter's save. ``whole`` runs as before streaming: the whole-file load, the
    bases quantized by `lora.apply` afterwards.
    """
    import functools

    from entrenar import io
    from entrenar.config.summary import validate
    from entrenar.runs import models
    from entrenar.runs import run as run_mod

    if how == "whole":
        models.io.load_hf_folder = functools.partial(io.load_hf_folder, stream=False)
        run_mod.base_quantizer = lambda lora: None  # type: ignore[assignment]
    data = os.path.join(os.path.dirname(__file__), "..", "examples", "data")
    out, yaml = f"{folder}-run-{how}", f"{folder}-run-{how}.yaml"
    shutil.rmtree(out, ignore_errors=True)  # a fresh run, not a resumed one
    with open(yaml, "w") as f:
        f.write(
            RUN_YAML.format(
                folder=folder, tokenizer=io.smollm2_path(), steps=steps, out=out,
                data=os.path.abspath(os.path.join(data, "iso_dates", "train.jsonl")),
            )
        )  # fmt: skip
    t0 = time.perf_counter()
    spec = validate(yaml)
    prep = run_mod.prepare(spec)
    prepared, prepare_s = peak_rss(), time.perf_counter() - t0
    res = run_mod._train(spec, prep, resume=None, progress=False)
    return {
        "prepare_s": prepare_s,
        "prepare_peak": prepared,
        "run_s": time.perf_counter() - t0,
        "run_peak": peak_rss(),
        "loss": res.metrics.get("train_loss"),
    }


def read_seconds(folder: str) -> tuple[float, int]:
    """Seconds to read every shard's bytes (``readinto`` one reused buffer)."""
    files = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))
    buf = bytearray(64 << 20)
    total = 0
    t0 = time.perf_counter()
    for name in files:
        with open(os.path.join(folder, name), "rb", buffering=0) as f:
            while n := f.readinto(buf):
                total += n
    return time.perf_counter() - t0, total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default="/tmp/entrenar-load-memory")
    ap.add_argument("--cases", default=DEFAULT_CASES, help=f"of {', '.join(CASES)}")
    ap.add_argument("--layers", type=int, default=22, help="fewer for a quick check")
    ap.add_argument("--write-md", default=None, help="append the table to this file")
    ap.add_argument("--write-gguf", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument(
        "--write-only", default=None, choices=sorted(SHAPES),
        help="write DIR/<shape>-bf16 (every layer of that shape) and stop",
    )  # fmt: skip
    ap.add_argument("--run-child", default=None, help=argparse.SUPPRESS)
    ap.add_argument(
        "--qlora-steps", type=int, default=0,
        help="also time a QLoRA run of this many steps (RUN_YAML), whole vs stream",
    )  # fmt: skip
    ap.add_argument("--measure", nargs=2, metavar=("CASE", "STREAM"), default=None)
    args = ap.parse_args()
    if args.write_only:
        shape = SHAPES[args.write_only]
        out = os.path.join(args.dir, f"{args.write_only}-bf16")
        if not os.path.exists(os.path.join(out, "config.json")):
            write_folder(out, shape["num_layers"], shape=shape)
        print(out)
        return
    folder = os.path.join(args.dir, f"tinyllama-shape-{args.layers}-layers-bf16")
    if args.write_gguf:  # a child: the GGUF, without the parent holding the model
        write_gguf(folder)
        return
    if args.run_child:  # a child: one QLoRA run
        print(json.dumps(measure_run(folder, args.qlora_steps, args.run_child)))
        return
    if args.measure:  # a child: one load
        case, stream = args.measure
        print(json.dumps(measure(folder, case, stream == "stream")))
        return
    if not os.path.exists(os.path.join(folder, "config.json")):
        t0 = time.perf_counter()
        write_folder(folder, args.layers)
        print(f"wrote {folder} in {time.perf_counter() - t0:.0f} s", flush=True)
    if "gguf-" in args.cases and not os.path.exists(gguf_path(folder)):
        t0 = time.perf_counter()
        subprocess.run(
            [sys.executable, __file__, "--dir", args.dir,
             "--layers", str(args.layers), "--write-gguf"],
            check=True, env=dict(os.environ, JAX_PLATFORMS="cpu"),
        )  # fmt: skip
        print(f"wrote {gguf_path(folder)} in {time.perf_counter() - t0:.0f} s")
    read_s, nbytes = read_seconds(folder)
    read_s, nbytes = read_seconds(folder)  # the second from the page cache
    load = os.getloadavg()
    rows = []
    for case in args.cases.split(","):
        got = {}
        for how in ("whole", "stream"):
            res = subprocess.run(
                [sys.executable, __file__, "--dir", args.dir,
                 "--layers", str(args.layers), "--measure", case, how],
                capture_output=True, text=True, check=True,
                env=dict(os.environ, JAX_PLATFORMS="cpu"),
            )  # fmt: skip
            got[how] = json.loads(res.stdout.strip().splitlines()[-1])
            print(case, how, got[how], flush=True)
        rows.append((case, got))
    runs = {}
    for how in ("whole", "stream") if args.qlora_steps else ():
        res = subprocess.run(
            [sys.executable, __file__, "--dir", args.dir, "--layers", str(args.layers),
             "--qlora-steps", str(args.qlora_steps), "--run-child", how],
            capture_output=True, text=True, check=True,
            env=dict(os.environ, JAX_PLATFORMS="cpu"),
        )  # fmt: skip
        runs[how] = json.loads(res.stdout.strip().splitlines()[-1])
        print("qlora run", how, runs[how], flush=True)
    load_after = os.getloadavg()
    lines = [
        f"Files: {nbytes / 1e9:.2f} GB of bfloat16 in 2 shards, read in {read_s:.1f} s "
        f"(page cache). CPU: {cpu_name()}, {os.cpu_count()} cores; load average "
        f"{load[0]:.1f} before, {load_after[0]:.1f} after.",
        "",
        "| target | load | time (s) | peak RSS (GB) | growth (GB) | final tree (GB) "
        "| same tree |",
        "|---|---|---|---|---|---|---|",
    ]
    for case, got in rows:
        same = got["whole"]["sha256"] == got["stream"]["sha256"]
        for how in ("whole", "stream"):
            r = got[how]
            lines.append(
                f"| {case} | {how} | {r['seconds']:.1f} | {r['peak'] / 1e9:.2f} | "
                f"{r['growth'] / 1e9:.2f} | {r['tree'] / 1e9:.2f} | "
                f"{'yes' if same else 'NO'} |"
            )
    if runs:
        lines += [
            "",
            f"QLoRA run of {args.qlora_steps} steps (`RUN_YAML`):",
            "",
            "| load | prepare (s) | peak after prepare (GB) | run (s) "
            "| peak of the run (GB) | loss |",
            "|---|---|---|---|---|---|",
        ]
        for how, r in runs.items():
            lines.append(
                f"| {how} | {r['prepare_s']:.1f} | {r['prepare_peak'] / 1e9:.2f} | "
                f"{r['run_s']:.1f} | {r['run_peak'] / 1e9:.2f} | {r['loss']:.6f} |"
            )
    table = "\n".join(lines)
    print(table)
    if args.write_md:
        with open(args.write_md, "a") as f:
            f.write(table + "\n")


if __name__ == "__main__":
    main()
