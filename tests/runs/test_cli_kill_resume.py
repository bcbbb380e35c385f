"""SIGKILL ``entrenar train CONFIG`` (a step, a checkpoint write, the export), resume.

Each run is a subprocess of tests/runs/killable_cli.py (the ``entrenar`` command
with hooks that announce its steps and can stop it mid-checkpoint or mid-export).
A run killed and continued with ``--resume latest`` must end as the uninterrupted
run: every exported file (model, adapter, GGUF, Hugging Face folder, quantized
copy) byte-identical, the final checkpoint's arrays (parameters, optimizer state,
key) and metadata (history, evaluations, best step, early-stopping counter) equal,
the same ``metrics.jsonl`` (but the measured tokens/s), the same checkpoints kept,
and nothing left over from the killed run (no temporary file, no duplicated line).
"""

from __future__ import annotations

import itertools
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from config_cases import REPO, WINE, WORDS, write

from entrenar import io, nn

SCRIPT = Path(__file__).with_name("killable_cli.py")
pytestmark = pytest.mark.slow


def run(config, *args, kill_at=None, env=None, resume=True):
    """``entrenar train CONFIG ARGS`` in a subprocess, killed at a line.

    SIGKILL at 'STEP kill_at' or 'HANG'. Returns (stdout lines, return code or None
    when killed, stderr).
    """
    environ = dict(os.environ, JAX_PLATFORMS="cpu", **(env or {}))
    cmd = [sys.executable, str(SCRIPT), "train", str(config), "--no-progress", *args]
    if resume:
        cmd += ["--resume", "latest"]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=environ, cwd=REPO,
    )  # fmt: skip
    lines, deadline, killed = [], time.monotonic() + 300, False
    try:
        for line in proc.stdout:
            lines.append(line.strip())
            if lines[-1] in (f"STEP {kill_at}", "HANG"):
                proc.kill()  # SIGKILL: no cleanup, no flush, no atexit
                killed = True
                break
            assert time.monotonic() < deadline, "the training subprocess hung"
    finally:
        proc.kill()
        _, err = proc.communicate()
    return lines, (None if killed else proc.returncode), err


def steps_run(lines):
    return [int(x.split()[1]) for x in lines if x.startswith("STEP ")]


# ---------------------------------------------------------------- comparison
def files_of(out):
    """{relative path: bytes} of every file a run wrote but its checkpoints."""
    out = Path(out)
    found = {}
    for p in sorted(out.rglob("*")):
        rel = p.relative_to(out).as_posix()
        if p.is_file() and not rel.startswith("checkpoints/"):
            found[rel] = p.read_bytes()
    return found


MEASURED = ("tokens_per_s", "step_time")
"""Figures of the clock (a GRPO step's step_time), not of the run."""


def normalise(rel, data, out):
    """What may differ between two equal runs: their folder, the measured speed."""
    text_like = rel.endswith((".json", ".jsonl"))
    if not text_like:
        return data
    text = data.decode().replace(str(Path(out).parent), "RUN")
    if rel == "metrics.jsonl":
        rows = [json.loads(x) for x in text.splitlines()]
        for r in rows:
            for k in MEASURED:
                r.pop(k, None)
        return rows
    return json.loads(text)


def checkpoint_state(out, step):
    """The arrays and metadata of checkpoint ``step``, read as stored (numpy)."""
    import orbax.checkpoint as ocp

    folder = Path(out) / "checkpoints" / str(step)
    with ocp.StandardCheckpointer() as ck:
        state = ck.restore(folder / "state")
    meta = json.loads((folder / "meta" / "metadata").read_text())
    meta.get("config", {}).pop("output_dir", None)
    return state, meta


def assert_same_run(a, b):
    fa, fb = files_of(a), files_of(b)
    assert sorted(fa) == sorted(fb), "files differ"
    assert "result.json" in fa
    for rel in fa:
        if rel in ("loss.png", "reward.png"):
            continue  # a picture of metrics.jsonl, compared below
        assert normalise(rel, fa[rel], a) == normalise(rel, fb[rel], b), rel
    rows = normalise("metrics.jsonl", fa["metrics.jsonl"], a)
    steps = [(r["step"], any(k.startswith("eval_") for k in r)) for r in rows]
    assert len(steps) == len(set(steps)), "a metrics.jsonl line is duplicated"
    ca = sorted(os.listdir(Path(a) / "checkpoints"))
    assert ca == sorted(os.listdir(Path(b) / "checkpoints"))
    assert not [n for n in ca if not n.isdigit()], ca  # no temporary folder left
    last = max(int(n) for n in ca)
    (sa, ma), (sb, mb) = checkpoint_state(a, last), checkpoint_state(b, last)
    la, lb = jax.tree_util.tree_leaves(sa), jax.tree_util.tree_leaves(sb)
    assert len(la) == len(lb) > 3
    for x, y in zip(la, lb):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))  # bit for bit
    for m in (ma, mb):
        for r in m["history"] + m.get("window", []):
            for k in MEASURED:
                r.pop(k, None)
    assert ma == mb


# ---------------------------------------------------------------- the runs
@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """Small number-words files, a 2-layer Llama GGUF of their vocabulary."""
    folder = tmp_path_factory.mktemp("data")
    lines = (WORDS / "train.jsonl").read_text().splitlines()
    (folder / "train.jsonl").write_text("\n".join(lines[:48]) + "\n")
    (folder / "valid.jsonl").write_text("\n".join(lines[100:116]) + "\n")
    cfg = nn.LlamaConfig(
        vocab_size=320, hidden_size=64, intermediate_size=128, num_layers=2,
        num_heads=4, num_kv_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    io.save_llama_gguf(folder / "tiny.gguf", cfg, cfg.init(jax.random.key(0)))
    io.save_llama_gguf(folder / "other.gguf", cfg, cfg.init(jax.random.key(1)))
    recs = [json.loads(x) for x in lines[:33]]  # pairs: the next row's answer loses
    pairs = [
        {"prompt": a["prompt"], "chosen": a["completion"], "rejected": b["completion"]}
        for a, b in itertools.pairwise(recs)
    ]
    (folder / "pairs.jsonl").write_text("".join(json.dumps(p) + "\n" for p in pairs))
    (folder / "prompts.jsonl").write_text("\n".join(lines[:5]) + "\n")  # GRPO's
    return folder


def words_data(folder, **extra):
    return {
        "train": str(folder / "train.jsonl"),
        "validation": str(folder / "valid.jsonl"),
        "format": "prompt_completion",
        "batch_size": 4,
        "seq_len": 24,
        **extra,
    }


def gpt2_doc(folder, out):
    """Full fine-tuning of a from-scratch GPT-2, by epochs, shuffled, with dropout."""
    return {
        "model": {
            "architecture": "gpt2",
            "tokenizer": str(WORDS / "tokenizer.gguf"),
            "config": {
                "vocab_size": 320,
                "n_positions": 64,
                "n_embd": 32,
                "n_layer": 2,
                "n_head": 2,
                "dropout": 0.1,
            },
        },
        "data": words_data(folder),
        "optimizer": {"name": "adamw", "lr": 0.01},
        "scheduler": {"name": "warmup_cosine_decay", "warmup_steps": 2},
        "training": {
            "epochs": 4,
            "grad_accum": 2,
            "eval_every": 2,
            "checkpoint_every": 1,
            "keep_checkpoints": 2,
            "log_every": 1,
            "seed": 1,
            "early_stopping": {"patience": 2, "min_delta": 0.25},
            "output_dir": str(out),
        },
        "quantization": {"scheme": "int8"},
        "export": {"formats": ["safetensors", "json"]},
    }


def llama_doc(folder, out, quantize_base="none"):
    """LoRA (or QLoRA) on a GGUF, packed rows, by max_steps, every export."""
    return {
        "model": {
            "path": str(folder / "tiny.gguf"),
            "tokenizer": str(WORDS / "tokenizer.gguf"),
        },
        "data": words_data(folder, packing=True),
        "lora": {
            "rank": 2,
            "alpha": 4,
            "targets": ["q_proj", "v_proj"],
            "dropout": 0.1,
            "quantize_base": quantize_base,
        },
        "optimizer": {"name": "adamw", "lr": 0.01},
        "scheduler": {"name": "linear", "warmup_steps": 2, "end_value": 0.0},
        "training": {
            "max_steps": 8,
            "grad_accum": 2,
            "eval_every": 3,
            "checkpoint_every": 2,
            "keep_checkpoints": 3,
            "log_every": 1,
            "seed": 2,
            "output_dir": str(out),
        },
        "quantization": {"scheme": "q8_0"},
        "export": {
            "formats": ["adapter", "safetensors", "gguf", "hf"],
            "gguf_type": "F32",
        },
    }


def distill_doc(folder, out):
    """The wine student distilled from the shipped teacher, by epochs."""
    return {
        "model": {"architecture": "mlp", "config": {"sizes": [13, 8, 3]}},
        "distillation": {
            "teacher": str(REPO / "examples" / "models" / "wine-mlp.safetensors"),
            "temperature": 2.0,
            "alpha": 0.7,
        },
        "data": {
            "train": str(WINE / "train.parquet"),
            "validation": str(WINE / "validation.parquet"),
            "format": "tabular",
            "target": "cultivar",
            "batch_size": 32,
        },
        "optimizer": {"name": "adam", "lr": 0.01},
        "training": {"epochs": 3, "seed": 0, "log_every": 1, "output_dir": str(out)},
        "export": {"formats": ["safetensors"]},
    }


def best_doc(folder, out):
    """The LoRA run exporting its best evaluation (``training.export_best``).

    Adam at a constant 3.0 without warm-up, evaluated every step: the eval loss is
    lowest at step 6 (5.648) and rises after (5.651, 5.650). One checkpoint kept
    besides the best, written every 4 steps: step 6's is there for export_best.
    """
    doc = llama_doc(folder, out)
    del doc["scheduler"]
    doc["optimizer"]["lr"] = 3.0
    doc["training"].update(
        eval_every=1, checkpoint_every=4, keep_checkpoints=1, export_best=True
    )
    return doc


def dpo_doc(folder, out, lora=False):
    """DPO on pairs of number words, full fine-tuning or QLoRA with dropout.

    Full fine-tuning's reference log-probabilities are precomputed from the GGUF;
    QLoRA's reference is the model with its adapters off: the NF4 bases.
    """
    doc = llama_doc(folder, out, "nf4" if lora else "none")
    doc["data"] = {"train": str(folder / "pairs.jsonl"), "batch_size": 4,
                   "seq_len": 24}  # fmt: skip
    doc["preference"] = {"beta": 0.5, "loss_type": "ipo" if lora else "sigmoid",
                         "disable_dropout": False}  # fmt: skip
    doc["training"] |= {"eval_every": None, "checkpoint_every": 1}
    doc["training"]["max_steps"] = 6
    doc.pop("quantization")
    doc["export"] = {"formats": ["adapter"] if lora else ["safetensors"]}
    if not lora:
        doc.pop("lora")
    return doc


def grpo_doc(folder, out):
    """GRPO on QLoRA adapters: 2 of 5 prompts x 4 samples a step, β = 0.04.

    The third step takes the last prompt of the first shuffle and the first of the
    second; a checkpoint every 2 steps (2 kept); linear warm-up and decay; the
    rewards of the 5 prompts' samples evaluated every 3 steps.
    """
    doc = llama_doc(folder, out, "nf4")
    doc["data"] = {"train": str(folder / "prompts.jsonl"),
                   "validation": str(folder / "prompts.jsonl")}  # fmt: skip
    doc["lora"].pop("dropout")
    doc["grpo"] = {
        "num_generations": 4, "prompts_per_step": 2, "max_completion_length": 5,
        "beta": 0.04, "temperature": 0.9, "loss_type": "grpo",
        "rewards": [{"type": "contains", "column": "completion"},
                    {"type": "regex", "pattern": "e", "weight": 0.5}],
    }  # fmt: skip
    doc["training"] = {"max_steps": 7, "checkpoint_every": 2, "keep_checkpoints": 2,
                       "log_every": 1, "seed": 3, "eval_every": 3,
                       "output_dir": str(out)}  # fmt: skip
    doc.pop("quantization")
    doc["export"] = {"formats": ["adapter", "safetensors"]}
    return doc


def gpt2_8bit_doc(folder, out):
    """`gpt2_doc` with 8-bit AdamW: uint8 moments in the checkpoints."""
    return gpt2_doc(folder, out) | {"optimizer": {"name": "adamw_8bit", "lr": 0.01}}


EXPORTS = ("adapter", "safetensors", "gguf", "hf", "quantized")
DOCS = {
    "gpt2_8bit": gpt2_8bit_doc,
    "best": best_doc,
    "gpt2": gpt2_doc,
    "lora": llama_doc,
    "qlora": lambda folder, out: llama_doc(folder, out, "nf4"),
    "distill": distill_doc,
    "dpo": dpo_doc,
    "dpo_lora": lambda folder, out: dpo_doc(folder, out, lora=True),
    "grpo": grpo_doc,
}


def config(data, tmp, kind, name):
    """``tmp/name/run.yaml`` writing to ``tmp/name/out``.

    One file name for every run: the model files record it.
    """
    (tmp / name).mkdir()
    out = tmp / name / "out"
    return write(tmp / name / "run.yaml", DOCS[kind](data, out)), out


@pytest.fixture(scope="module")
def uninterrupted(data, tmp_path_factory):
    """``uninterrupted(kind)``: the output folder of the run never killed."""
    done = {}

    def get(kind):
        if kind not in done:
            cfg, out = config(data, tmp_path_factory.mktemp(kind), kind, "run")
            _, rc, err = run(cfg, resume=False)
            assert rc == 0, err
            done[kind] = out
        return done[kind]

    return get


def killed(cfg, *, kill_at=None, env=None, resume=True):
    """Run until killed at ``kill_at`` or at a hook's 'HANG'; the lines printed."""
    lines, rc, err = run(cfg, kill_at=kill_at, env=env, resume=resume)
    assert rc is None, (lines[-3:], err[-2000:])
    return lines


def finish(cfg):
    lines, rc, err = run(cfg)
    assert rc == 0, (lines[-3:], err[-2000:])
    return lines


def test_full_fine_tuning_killed_at_a_step_and_mid_checkpoint(
    data, uninterrupted, tmp_path
):
    """GPT-2 trained from scratch, killed at a step, resumed, killed mid-checkpoint.

    4 shuffled epochs of 5 steps, dropout, grad_accum 2, warm-up + cosine, an
    evaluation every 2 steps, early stopping (patience 2, stops at step 20: its
    counter crosses the kills), a checkpoint every step (2 kept), a quantized copy.
    """
    full = uninterrupted("gpt2")
    rng = random.Random()
    a = rng.randint(2, 13)
    # evaluations 14 and 18 do not improve by min_delta: the checkpoint restored
    # after the second kill (b - 1) holds bad_evals = 1
    b = rng.choice((15, 16, 19, 20))
    cfg, out = config(data, tmp_path, "gpt2", "run")
    assert steps_run(killed(cfg, kill_at=a, resume=False))[-1] == a
    lines = killed(cfg, env={"HANG_AT_CHECKPOINT": str(b)})
    assert steps_run(lines)[0] == a and lines[-1] == "HANG", (a, b)
    assert f"{b}.orbax-checkpoint-tmp" in os.listdir(out / "checkpoints")
    assert steps_run(finish(cfg))[0] == b, (a, b)  # step b is trained again
    assert_same_run(full, out)
    meta = checkpoint_state(out, b - 1)[1] if b - 1 > 18 else None
    assert meta is None or meta["bad_evals"] == 1
    result = json.loads((out / "result.json").read_text())["metrics"]
    assert result["stopped_early"] and result["steps"] == 20


def test_adamw_8bit_killed_at_a_step(data, uninterrupted, tmp_path):
    """The 8-bit optimizer state (codes and absmax) resumes bit for bit."""
    full = uninterrupted("gpt2_8bit")
    a = random.Random().randint(2, 13)
    cfg, out = config(data, tmp_path, "gpt2_8bit", "run")
    assert steps_run(killed(cfg, kill_at=a, resume=False))[-1] == a
    assert steps_run(finish(cfg))[0] == a, a  # step a is trained again
    assert_same_run(full, out)
    state, _ = checkpoint_state(out, 20)
    codes = [x for x in jax.tree_util.tree_leaves(state) if x.dtype == np.uint8]
    assert len(codes) >= 4  # m and v of wte and the MLPs


def test_lora_killed_before_checksums_and_mid_export(data, uninterrupted, tmp_path):
    """LoRA killed between a checkpoint's rename and its checksums, then exporting.

    LoRA (dropout 0.1) on a GGUF, packed rows, 8 steps, linear warm-up and decay,
    every export. A resume on another base GGUF is refused.
    """
    full = uninterrupted("lora")
    rng = random.Random()
    c, kind = rng.choice((2, 4, 6)), rng.choice(EXPORTS)
    cfg, out = config(data, tmp_path, "lora", "run")
    killed(cfg, env={"HANG_AT_CHECKSUMS": str(c)}, resume=False)
    assert not (out / "checkpoints" / str(c) / "checksums.json").exists()
    other = write(
        tmp_path / "other.yaml",
        {**llama_doc(data, out), "model": {"path": str(data / "other.gguf")}},
    )
    _, rc, err = run(other)
    assert rc == 2 and "model.path" in err and "Put the values back" in err, err
    lines = killed(cfg, env={"HANG_IN_EXPORT": kind})
    assert steps_run(lines)[0] == c + 1, (c, kind)  # restored, unverified
    assert steps_run(finish(cfg)) == [], (c, kind)
    assert_same_run(full, out)


def test_qlora_killed_at_a_step_and_mid_export(data, uninterrupted, tmp_path):
    """QLoRA (NF4 bases) as the LoRA run, killed after a checkpoint, then exporting."""
    full = uninterrupted("qlora")
    rng = random.Random()
    a, kind = rng.randint(3, 7), rng.choice(EXPORTS)
    cfg, out = config(data, tmp_path, "qlora", "run")
    killed(cfg, kill_at=a, resume=False)
    lines = killed(cfg, env={"HANG_IN_EXPORT": kind})
    # STEP a is printed before step a's checkpoint: the last is the even step < a
    assert steps_run(lines)[0] == (a - 1) // 2 * 2 + 1, (a, kind)
    finish(cfg)
    assert_same_run(full, out)


def test_distillation_killed_before_its_first_checkpoint(data, uninterrupted, tmp_path):
    """Distillation killed before its first checkpoint, then while exporting.

    The wine student, by epochs (checkpoints at each epoch's end): the first kill
    leaves no checkpoint, a fresh start (no line of metrics.jsonl twice).
    """
    full = uninterrupted("distill")
    a = random.Random().randint(1, 3)
    cfg, out = config(data, tmp_path, "distill", "run")
    killed(cfg, kill_at=a, resume=False)
    assert not [n for n in os.listdir(out / "checkpoints") if n.isdigit()], a
    lines = killed(cfg, env={"HANG_IN_EXPORT": "safetensors"})
    assert steps_run(lines)[:1] == [1], a
    finish(cfg)
    assert_same_run(full, out)


@pytest.mark.parametrize("first", ["step", "best_checkpoint"])
def test_export_best_killed_at_a_step_and_mid_export(
    data, uninterrupted, tmp_path, first
):
    """The best checkpoint survives a kill; the resumed run exports it the same.

    Killed at a step (before or after the best evaluation, step 6) or while writing
    the best's checkpoint, then in an export: every exported file as the
    uninterrupted run's, the parameters of step 6, and checkpoint 6 kept past
    keep_checkpoints: 1.
    """
    full = uninterrupted("best")
    result = json.loads((full / "result.json").read_text())["metrics"]
    best = result["best_step"]  # 6 or 7: their eval losses differ in the 5th digit
    assert best == result["exported_step"] and 2 <= best < 8, result
    kept = sorted({str(best), "8"})
    assert sorted(os.listdir(full / "checkpoints")) == kept
    rng = random.Random()
    a, kind = rng.randint(2, 7), rng.choice(EXPORTS)
    cfg, out = config(data, tmp_path, "best", "run")
    if first == "step":
        killed(cfg, kill_at=a, resume=False)
    else:
        killed(cfg, env={"HANG_AT_CHECKPOINT": str(best)}, resume=False)
        tmp = f"{best}.orbax-checkpoint-tmp"
        assert tmp in " ".join(os.listdir(out / "checkpoints"))
    killed(cfg, env={"HANG_IN_EXPORT": kind})
    finish(cfg)
    assert_same_run(full, out)
    assert sorted(os.listdir(out / "checkpoints")) == kept, (a, kind)


def test_dpo_killed_at_a_step_and_mid_checkpoint(data, uninterrupted, tmp_path):
    """DPO, full fine-tuning: killed at a step, resumed, killed mid-checkpoint.

    The reference log-probabilities are computed again from the starting GGUF at
    each resume (never from the checkpoint), so the run ends as the uninterrupted.
    """
    full = uninterrupted("dpo")
    rng = random.Random()
    a, b = rng.randint(1, 3), rng.randint(4, 6)
    cfg, out = config(data, tmp_path, "dpo", "run")
    assert steps_run(killed(cfg, kill_at=a, resume=False))[-1] == a
    lines = killed(cfg, env={"HANG_AT_CHECKPOINT": str(b)})
    assert steps_run(lines)[0] == a and lines[-1] == "HANG", (a, b)
    assert steps_run(finish(cfg))[0] == b, (a, b)
    assert_same_run(full, out)
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert all("rewards/margins" in r for r in rows if "loss" in r)


def test_dpo_qlora_killed_at_a_step(data, uninterrupted, tmp_path):
    """DPO (IPO) on QLoRA adapters with dropout, killed at a step, then exporting."""
    full = uninterrupted("dpo_lora")
    a = random.Random().randint(1, 5)
    cfg, out = config(data, tmp_path, "dpo_lora", "run")
    killed(cfg, kill_at=a, resume=False)
    lines = killed(cfg, env={"HANG_IN_EXPORT": "adapter"})
    assert steps_run(lines)[0] == a, a  # STEP a printed before its checkpoint
    finish(cfg)
    assert_same_run(full, out)


def test_grpo_killed_at_a_step_mid_checkpoint_and_mid_export(
    data, uninterrupted, tmp_path
):
    """GRPO (QLoRA) killed at a step, mid-checkpoint, then mid-export, resumed.

    The resumed run samples what the uninterrupted one sampled (the sampling key of
    a step, the prompt order across the reshuffle): metrics.jsonl (rewards,
    completion lengths, loss, kl, evaluations), the adapter, the model and the
    final checkpoint match bit for bit. A resume with another reward list is refused.
    """
    full = uninterrupted("grpo")
    rows = [json.loads(x) for x in (full / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 3, 4, 5, 6, 6, 7]
    assert [r["step"] for r in rows if "eval_reward" in r] == [3, 6]
    steps = [r for r in rows if "loss" in r]
    assert len({r["reward"] for r in steps}) > 2 and any(r["kl"] for r in steps)
    rng = random.Random()
    a = rng.randint(1, 5)
    b = rng.choice([s for s in (2, 4, 6) if s > a])
    cfg, out = config(data, tmp_path, "grpo", "run")
    assert steps_run(killed(cfg, kill_at=a, resume=False))[-1] == a
    lines = killed(cfg, env={"HANG_AT_CHECKPOINT": str(b)})
    # STEP a is printed before step a's checkpoint: the last is the even step < a
    assert steps_run(lines)[0] == (a - 1) // 2 * 2 + 1 and lines[-1] == "HANG"
    lines = killed(cfg, env={"HANG_IN_EXPORT": rng.choice(["adapter", "safetensors"])})
    assert steps_run(lines)[0] == b - 1, (a, b)  # checkpoint b was never renamed in
    doc = grpo_doc(data, out)
    doc["grpo"]["rewards"] = doc["grpo"]["rewards"][:1]
    _, rc, err = run(write(tmp_path / "other.yaml", doc))
    assert rc == 2 and "grpo.rewards" in err and "Put the values back" in err, err
    assert steps_run(finish(cfg)) == [], (a, b)
    assert_same_run(full, out)
