"""Merging skills: QLoRA fine-tunes of SmolLM2 on different tasks, merged three ways.

    python examples/merge_skills.py [--tasks iso_dates,time24,initials] [--steps 40]
                                    [--work runs/merge-skills] [--out FILE] [--quick]
                                    [--methods ties,...] [--sets 2,3] [--reuse]

1. Fine-tune SmolLM2-135M-Instruct (its Q4_1 GGUF) once per task with the main job's
   run (`examples/configs/smollm2-qlora.yaml`: QLoRA on the attention projections,
   adapter + Q8_0 GGUF exported), each on its task's ``train.jsonl`` (seeded scripts
   in ``examples/data/<task>/``), and score each fine-tune on every task's held-out
   split: exact match of greedy chat replies (`entrenar.chat.exact_match`).
2. Merge the first two fine-tunes (and all three, when three tasks are given;
   ``--sets`` picks which) with each method, through (a) their adapters
   (`entrenar.merge.merge_adapters`),
   (b) the folded float models (``W + Δ_i`` against the dequantized base), and
   (c) their exported Q8_0 GGUFs against the Q4_1 base GGUF, as they are
   (``quantized="keep"``) and with the task vector taken on the file's grid
   (``"correct"``, the default); ``"refuse"`` refuses files whose difference from
   the base is mostly re-quantization noise (each file's figures are in the table's
   notes).
3. Write the table of held-out exact match per task, method and path, with each
   task's share of its single-task score, to ``--out``
   (default ``benchmarks/results/merge_skills.md``).

With ``--reuse`` the fine-tunes already in ``--work`` are taken as they are, and so
are their single-task scores (``--work/scores.json``), so that a long run can be
split into chunks (``--methods``, ``--sets``) that each score only their merges.

``--quick`` runs the same steps on a tiny random Llama with SmolLM2's tokenizer and
chat template (3 training steps, 8 held-out records per task): the plumbing in
seconds, for the tests; its scores mean nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import shutil
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import jax

from entrenar import data, io, lora, merge, nn, quant
from entrenar.chat import ChatModel, exact_match
from entrenar.merge.run import build_plan, files_recipe, merged_refs, open_model
from entrenar.runs import train_from_yaml

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
CONFIG = os.path.join(HERE, "configs", "smollm2-qlora.yaml")
TASKS = ("iso_dates", "time24", "initials")
METHODS: dict[str, dict[str, Any]] = {
    "linear": {},
    "task_arithmetic": {},
    "ties": {"density": 0.5},
    "dare_ties": {"density": 0.5},
}
"""The methods merged, with the issue's settings (TIES at density 0.5)."""


def task_file(task: str, split: str) -> str:
    return os.path.join(HERE, "data", task, f"{split}.jsonl")


def tiny_base(folder: str) -> str:
    """A tiny random Llama (Q4_1) with SmolLM2's tokenizer and chat template."""
    cfg = nn.LlamaConfig(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_layers=2,
        num_heads=2, num_kv_heads=1, max_position_embeddings=256,
        tie_word_embeddings=True,
    )  # fmt: skip
    path = os.path.join(folder, "tiny-q4_1.gguf")
    io.save_llama_gguf(
        path, cfg, cfg.init(jax.random.key(0)), source=io.smollm2_path(),
        tensor_type="Q4_1", embedding_type="Q8_0",
    )  # fmt: skip
    return path


def fine_tune(
    task: str, base: str, work: str, steps: int, reuse: bool = False
) -> dict[str, str]:
    """Train the main job's QLoRA run on ``task``: its adapter and Q8_0 GGUF.

    With ``reuse``, an earlier run's files in ``work/task`` are taken as they are.
    """
    out = os.path.join(work, task)
    files = {"adapter": os.path.join(out, "adapter"),
             "gguf": os.path.join(out, "model.gguf")}  # fmt: skip
    if reuse and all(os.path.exists(f) for f in files.values()):
        print(f"  {task}: reusing {out}")
        return files
    if os.path.isfile(os.path.join(out, "model.gguf")):  # an earlier run
        shutil.rmtree(out)
    overrides = {
        "model.path": base,
        "data.train": task_file(task, "train"),
        "training.max_steps": steps,
        "training.output_dir": out,
        "export.formats": ["adapter", "gguf"],
    }
    t = time.perf_counter()
    run = train_from_yaml(CONFIG, overrides, progress=False)
    took = time.perf_counter() - t
    loss = run.metrics["train_loss"]
    print(f"  {task}: {run.metrics['steps']} steps, loss {loss:.4f} ({took:.0f} s)")
    return {"adapter": run.files["adapter"], "gguf": run.files["gguf"]}


def scores(chat: ChatModel, params: Any, held: Mapping[str, list]) -> dict[str, int]:
    """Held-out exact matches per task of ``chat`` with ``params``."""
    c = dataclasses.replace(chat, params=params)
    return {t: exact_match(c, recs).correct for t, recs in held.items()}


def plan_of(method: str, n: int) -> merge.Plan:
    """The `merge.Plan` ``entrenar merge`` builds for ``n`` models."""
    names = [f"m{i}" for i in range(n)]
    recipe = files_recipe(names, method, base="base", **METHODS[method])
    return build_plan(recipe, merged_refs(recipe))


def merges(
    method: str,
    combo: Sequence[str],
    tuned: Mapping[str, dict[str, str]],
    base_gguf: str,
    params_q: Any,
    work: str,
    reports: Mapping[str, merge.NoiseReport],
) -> Iterator[tuple[str, Any]]:
    """``(path, merged params)`` of every path in turn (or the refusal's message).

    One merged model at a time: the scores are taken before the next is merged.
    """
    plan = plan_of(method, len(combo))
    adapted = [lora.load_adapter(tuned[t]["adapter"], params_q) for t in combo]
    yield "adapters", merge.merge_adapters(plan, adapted)
    dense_base = quant.dequantize_params(params_q)
    folded = merge.merge_trees(
        plan,
        None if plan.kind == "linear" else dense_base,
        [lora.fold(a) for a in adapted],
    )
    del dense_base, adapted
    yield "folded float", folded
    del folded
    alone = os.path.join(work, "gguf-alone")  # no adapter beside: the grid path
    os.makedirs(alone, exist_ok=True)
    files = []
    for t in combo:
        f = os.path.join(alone, f"{t}.gguf")
        if not os.path.exists(f):
            shutil.copyfile(tuned[t]["gguf"], f)
        files.append(f)
    for policy in ("keep", "correct"):
        model = merge.merge_files(
            files, method, base=base_gguf, quantized=policy, **METHODS[method]
        )
        yield f"GGUF ({policy})", model.params
        del model
    flagged = [reports[t] for t in combo if reports[t].flagged]
    yield (
        "GGUF (refuse)",
        (
            f"refused: {merge.noise.better_path(flagged[0])}"
            if flagged
            else "not flagged: merged as with keep"
        ),
    )


def percent(got: int, single: int) -> str:
    """``got`` as a share of ``single`` (one decimal: 63/79 is 79.7%, not 80%)."""
    return f"{got / single:.1%}" if single else "-"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", default=",".join(TASKS))
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--work", default=os.path.join("runs", "merge-skills"))
    parser.add_argument("--out", help="the table's Markdown file")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument(
        "--methods", default=",".join(METHODS), help="of " + ", ".join(METHODS)
    )
    parser.add_argument(
        "--sets",
        help="merge the first 2 fine-tunes, all 3, or both (2,3; the default with "
        "three tasks, 2 with two)",
    )
    parser.add_argument(
        "--reuse",
        action="store_true",
        help="take the fine-tunes already in --work, and their single-task scores",
    )
    args = parser.parse_args()
    tasks = args.tasks.split(",")
    methods = args.methods.split(",")
    args.sets = args.sets or ("2,3" if len(tasks) > 2 else "2")
    sets = sorted({int(k) for k in args.sets.split(",")})
    if not set(sets) <= {2, 3} or max(sets) > len(tasks):
        parser.error(f"--sets {args.sets}: 2 and/or 3, at most as many as --tasks")
    os.makedirs(args.work, exist_ok=True)
    t_start = time.perf_counter()
    base_gguf = tiny_base(args.work) if args.quick else io.smollm2_path()
    steps = 3 if args.quick else args.steps
    n_held = 8 if args.quick else None
    held = {t: list(data.load_records(task_file(t, "heldout")))[:n_held] for t in tasks}
    out_md = args.out or (
        os.path.join(args.work, "merge_skills.md")
        if args.quick
        else os.path.join(ROOT, "benchmarks", "results", "merge_skills.md")
    )

    print(f"== fine-tuning {os.path.basename(base_gguf)} on {', '.join(tasks)}")
    tuned = {t: fine_tune(t, base_gguf, args.work, steps, args.reuse) for t in tasks}

    chat = ChatModel.from_gguf(base_gguf)
    _, params_q, _ = io.load_llama_gguf(base_gguf, keep_quantized=True)
    rows: list[tuple[str, str, str, dict[str, int] | str]] = []
    cache = os.path.join(args.work, "scores.json")  # unmerged models' scores
    key = ",".join(  # the held-out sizes and the fine-tunes' times: not stale
        f"{t}:{len(held[t])}:{os.path.getmtime(tuned[t]['adapter']):.0f}" for t in tasks
    )
    known: dict[str, dict[str, int]] = {}
    if args.reuse and os.path.exists(cache):
        with open(cache) as f:
            known = json.load(f).get(key, {})
    if "base" not in known:
        known["base"] = scores(chat, chat.params, held)
    rows.append(("-", "base model", "-", known["base"]))
    single: dict[str, int] = {}
    for t in tasks:
        if t not in known:
            adapted = lora.load_adapter(tuned[t]["adapter"], params_q)
            known[t] = scores(chat, adapted, held)
        single[t] = known[t][t]
        rows.append(("-", f"{t} alone", "adapter", known[t]))
        print(f"  {t} alone: {known[t]}")
    with io.atomic_write(cache, "w") as f:
        json.dump({key: known}, f)
    base_leaves = open_model(merge.ModelRef(base_gguf)).leaves
    reports = {}
    for t in tasks:
        f = tuned[t]["gguf"]
        reports[t] = merge.requantization_noise(
            f, base_leaves, open_model(merge.ModelRef(f)).leaves
        )
        print(f"  {reports[t].describe()}: flagged {reports[t].flagged}")
    del base_leaves
    combos = [tasks[:k] for k in sets]
    for combo in combos:
        print(f"== merging {' + '.join(combo)}")
        for method in methods:
            for path, got in merges(
                method, combo, tuned, base_gguf, params_q, args.work, reports
            ):
                result = got if isinstance(got, str) else scores(
                    chat, got, {t: held[t] for t in combo})  # fmt: skip
                rows.append((" + ".join(combo), method, path, result))
                print(f"  {method:16s} {path:16s} {result}")

    n = {t: len(r) for t, r in held.items()}
    lines = [
        "# Merging skills: QLoRA fine-tunes of SmolLM2-135M merged three ways",
        "",
        f"`python examples/merge_skills.py --tasks {','.join(tasks)} --steps {steps}"
        f" --methods {','.join(methods)} --sets {args.sets}"
        f"{' --reuse' if args.reuse else ''}{' --quick' if args.quick else ''}` "
        f"on {platform.machine()}, "
        f"{time.strftime('%Y-%m-%d')}, {time.perf_counter() - t_start:.0f} s wall. "
        f"Base: `{os.path.basename(base_gguf)}`. Held-out exact match of greedy chat "
        "replies (correct / records), and in brackets the share of the task's "
        "single fine-tune score.",
        "",
        "| merged | method | path | " + " | ".join(tasks) + " |",
        "|---|---|---|" + "---|" * len(tasks),
    ]
    for combo, method, path, result in rows:
        if isinstance(result, str):
            cells = [result] + [""] * (len(tasks) - 1)
        else:
            merged = combo != "-"
            cells = [
                ""
                if t not in result
                else f"{result[t]}/{n[t]}"
                + (f" ({percent(result[t], single[t])})" if merged else "")
                for t in tasks
            ]
        lines.append(f"| {combo} | {method} | {path} | " + " | ".join(cells) + " |")
    lines += ["", "Re-quantization noise of each exported GGUF against the base "
              "(`entrenar.merge.requantization_noise`):", ""]  # fmt: skip
    lines += [f"- {r.describe()}; flagged: {r.flagged}" for r in reports.values()]
    os.makedirs(os.path.dirname(os.path.abspath(out_md)), exist_ok=True)
    with io.atomic_write(out_md, "w") as md:
        md.write("\n".join(lines) + "\n")
    print(f"== table: {out_md} ({time.perf_counter() - t_start:.0f} s)")


if __name__ == "__main__":
    main()
