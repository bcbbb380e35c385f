"""A ``grpo:`` run: online RL from YAML (`entrenar.preference.GRPO`).

The model and its adapters are built as for any run (`entrenar.runs.models`,
``lora:``); the records of ``data.train`` are prompts (``prompt``: a text or a
message list, rendered with the model's chat template) with the columns the
rewards read; ``grpo.rewards`` are built-in rewards only
(`entrenar.preference.builtin_reward`: no code is read from a file). Each of the
``training.max_steps`` steps samples, scores and steps (specs/preference.md);
metrics.jsonl gets one line per step with TRL's names, reward.png plots the mean
reward, and ``export`` writes the adapter / model files as for any run. With
``data.validation`` (prompt records too) the run evaluates every
``training.eval_every`` steps (default: after its last step): `GRPO.evaluate`,
the rewards of sampled completions as TRL's ``eval_reward``... lines.

Checkpoints are the Trainer's (`entrenar.train.checkpoint.Checkpointer`, every
``training.checkpoint_every`` steps and at the end, ``keep_checkpoints`` kept):
the trained params, optimizer state, step and key, and in the meta what else the
next step depends on (`GRPO.state_dict`: the prompt order and the history; the
sampling key is a function of the seed and the step). ``--resume latest``
restores them, drops metrics.jsonl's lines past the checkpoint and continues as
the uninterrupted run.
"""

from __future__ import annotations

import dataclasses
import json
import os
import warnings
from typing import Any

import jax

from entrenar import data as data_lib
from entrenar.config.spec import TrainSpec
from entrenar.config.summary import as_dict
from entrenar.errors import ConfigError
from entrenar.io import atomic_write
from entrenar.optim.learning_rate import refresh_lr
from entrenar.preference import GRPO
from entrenar.runs.build import apply_lora, build_optimizer
from entrenar.runs.export import write_outputs
from entrenar.runs.models import base_quantizer, build_model, tokenizer_ref
from entrenar.train.checkpoint import Checkpointer, resolve_resume
from entrenar.train.metrics import MetricsWriter


def _prompt_records(path: str, key: str) -> list[dict[str, Any]]:
    records = [dict(r) for r in data_lib.load_records(path)]
    if not records or "prompt" not in records[0]:
        raise ConfigError(
            f"{key}: a GRPO run reads records with a prompt (a text or a message "
            f"list) and the columns its rewards read; {path} has "
            f"{sorted(records[0]) if records else 'no records'}"
        )
    return records


def validation_prompts(spec: TrainSpec) -> list[dict[str, Any]] | None:
    """``data.validation``'s prompt records (None: the run does not evaluate)."""
    assert spec.data is not None
    v = spec.data.validation
    return None if v is None else _prompt_records(v, "data.validation")


def prepare_grpo(spec: TrainSpec) -> tuple[Any, GRPO, list[dict[str, Any]]]:
    """The built model, the `GRPO` loop and the prompt records of a ``grpo`` run."""
    assert spec.model is not None and spec.data is not None and spec.grpo is not None
    key = jax.random.key(spec.training.seed)
    built = build_model(spec.model, key=jax.random.fold_in(key, 0),
                        quantize=base_quantizer(spec.lora))  # fmt: skip
    spec.check_architecture(built.architecture)
    params, trainable = built.params, None
    if spec.lora is not None and spec.lora.enabled:
        params = apply_lora(spec, params, jax.random.fold_in(key, 1))
        trainable = "lora"
    records = _prompt_records(spec.data.train, "data.train")
    steps = int(spec.training.max_steps or 0)
    g = spec.grpo
    run = GRPO(
        built.config, params, build_optimizer(spec, steps), built.tokenizer,
        (), dataclasses.replace(g, grad_accum=spec.training.grad_accum),
        trainable=trainable, seed=spec.training.seed,
    )  # fmt: skip
    return built, run, records


def train_grpo(
    spec: TrainSpec, *, resume: str | None = None, progress: bool = True
) -> dict[str, Any]:
    """Train (from a checkpoint with ``resume``), then write the exports.

    Returns ``{"files": ..., "metrics": ...}``.

    Raises:
        ConfigError: a fresh run in a folder holding another run's checkpoints.
        FormatError, CheckpointError: a checkpoint that does not fit this run.
    """
    built, run, records = prepare_grpo(spec)
    valid = validation_prompts(spec)
    out_dir, t = spec.output_dir, spec.training
    os.makedirs(out_dir, exist_ok=True)
    steps, every = int(t.max_steps or 0), max(1, t.log_every)
    ckpt = Checkpointer(os.path.join(out_dir, "checkpoints"), keep=t.keep_checkpoints)
    try:
        if resume is None:
            _refuse_older_run(ckpt, out_dir)
        else:
            _resume(spec, run, ckpt, resume, len(records))
        writer = MetricsWriter(out_dir)
        writer.truncate_after(run.steps_taken)  # a killed run's lines after it
        last_saved = first = run.steps_taken

        def log(m: dict[str, float]) -> None:
            nonlocal last_saved
            step = int(m["step"])
            writer.write(m)
            if step == first + 1:  # as the Trainer's runs (this config, resumed too)
                _write_config(spec)
            if progress and (step % every == 0 or step == steps):
                line = f"step {step}/{steps} reward {m['reward']:.4f}"
                print(f"{line} loss {m['loss']:.4g} ({m['step_time']:.1f} s)",
                      flush=True)  # fmt: skip
            due = step == steps if t.eval_every is None else step % t.eval_every == 0
            if valid is not None and due:
                record = {"step": step, **run.evaluate(valid, step)}
                run.eval_history.append(record)
                writer.write(record, prefix="eval")
                if progress:
                    print(f"step {step}/{steps} eval_reward "
                          f"{record['eval_reward']:.4f}", flush=True)  # fmt: skip
            if t.checkpoint_every is not None and step % t.checkpoint_every == 0:
                ckpt.save(run.state, _meta(spec, run))
                last_saved = step

        run.train(records, max(steps - run.steps_taken, 0), log=log)
        if last_saved != run.steps_taken or not ckpt.steps():
            ckpt.save(run.state, _meta(spec, run))
        writer.close()
    finally:
        ckpt.close()
    hist = run.history
    extra: dict[str, Any] = {}
    tokenizer = (spec.model.tokenizer if spec.model else None) or built.tokenizer_source
    if tokenizer:
        extra["tokenizer"] = tokenizer_ref(tokenizer, os.path.join(out_dir, "model"))
    metrics = {"steps": len(hist), "reward_first": hist[0]["reward"],
               "reward_last": hist[-1]["reward"]}  # fmt: skip
    if run.eval_history:
        metrics["eval_reward"] = run.eval_history[-1]["eval_reward"]
    files = write_outputs(spec, built, run.params, out_dir, extra=extra,
                          report=metrics)  # fmt: skip
    files["metrics"] = os.path.join(out_dir, "metrics.jsonl")
    files["checkpoints"] = os.path.join(out_dir, "checkpoints")
    files |= _plot(hist, os.path.join(out_dir, "reward.png"))
    return {"files": files, "metrics": metrics}


def _meta(spec: TrainSpec, run: GRPO) -> dict[str, Any]:
    """A checkpoint's meta: `GRPO.state_dict` and the settings a resume compares."""
    return {**run.state_dict(), "prompts_per_step": run.settings.prompts_per_step,
            "grad_accum": spec.training.grad_accum}  # fmt: skip


def _refuse_older_run(ckpt: Checkpointer, out_dir: str) -> None:
    """A fresh run may not write over another run's checkpoints (as the Trainer)."""
    last = ckpt.latest_step()
    if last is not None:
        raise ConfigError(
            f"output_dir {out_dir!r} holds checkpoints of another run (up to step "
            f"{last}): continue it with `entrenar train --resume latest`, or give a "
            f"new training.output_dir, or delete {ckpt.directory!r}"
        )


def _resume(
    spec: TrainSpec, run: GRPO, ckpt: Checkpointer, resume: str, count: int
) -> None:
    """Restore the state and the prompt order of the checkpoint ``resume`` names.

    ``latest`` without a checkpoint is a fresh start. A changed seed or
    ``grad_accum`` is warned about (the run goes on, unlike an uninterrupted one).
    """
    folder, step = resolve_resume(resume, spec.output_dir)
    own = ckpt.directory == os.path.abspath(folder)
    source = ckpt if own else Checkpointer(folder, read_only=True)
    try:
        if resume == "latest" and source.latest_step() is None:
            return
        state, meta = source.restore(run.state, step)
    finally:
        if not own:
            source.close()
    opt_state = refresh_lr(run.optimizer, state.opt_state, state.trainable)
    run.state = state._replace(opt_state=opt_state)
    run.load_state_dict(meta, count)
    now = {"seed": spec.training.seed, "grad_accum": spec.training.grad_accum}
    changed = {k: (meta.get(k), v) for k, v in now.items() if meta.get(k) != v}
    if changed:
        warnings.warn(
            f"resuming with a config that differs from the checkpoint's in "
            f"{changed} (saved, now): the run will not match an uninterrupted one",
            stacklevel=3,
        )


def _write_config(spec: TrainSpec) -> None:
    """``config.json``: the validated config, which ``--resume`` compares with."""
    with atomic_write(os.path.join(spec.output_dir, "config.json"), "w") as f:
        json.dump(as_dict(spec), f, indent=2, default=str)


def _plot(hist: list[dict[str, float]], path: str) -> dict[str, str]:
    """reward.png, the mean reward per step, when matplotlib is installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return {}
    fig, ax = plt.subplots(figsize=(6, 3.5))
    steps = [m["step"] for m in hist]
    ax.plot(steps, [m["reward"] for m in hist], label="reward")
    for k in sorted(
        k for k in hist[0] if k.startswith("rewards/") and k.endswith("/mean")
    ):
        ax.plot(steps, [m[k] for m in hist], label=k[len("rewards/") : -len("/mean")],
                alpha=0.7)  # fmt: skip
    ax.set_xlabel("step")
    ax.set_ylabel("mean reward")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return {"reward_plot": path}


__all__ = ["prepare_grpo", "train_grpo"]
