"""A ``grpo:`` run: online RL from YAML (`entrenar.preference.GRPO`).

The model and its adapters are built as for any run (`entrenar.runs.models`,
``lora:``); the records of ``data.train`` are prompts (``prompt``: a text or a
message list, rendered with the model's chat template) with the columns the
rewards read; ``grpo.rewards`` are built-in rewards only
(`entrenar.preference.builtin_reward`: no code is read from a file). Each of the
``training.max_steps`` steps samples, scores and steps (specs/preference.md);
metrics.jsonl gets one line per step with TRL's names, reward.png plots the mean
reward, and ``export`` writes the adapter / model files as for any run. No
checkpoints or resume yet.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import jax

from entrenar import data as data_lib
from entrenar.config.spec import TrainSpec
from entrenar.errors import ConfigError
from entrenar.preference import GRPO
from entrenar.runs.build import apply_lora, build_optimizer
from entrenar.runs.export import write_outputs
from entrenar.runs.models import base_quantizer, build_model, tokenizer_ref


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
    records = [dict(r) for r in data_lib.load_records(spec.data.train)]
    if not records or "prompt" not in records[0]:
        raise ConfigError(
            f"data.train: a GRPO run reads records with a prompt (a text or a "
            f"message list) and the columns its rewards read; {spec.data.train} "
            f"has {sorted(records[0]) if records else 'no records'}"
        )
    steps = int(spec.training.max_steps or 0)
    g = spec.grpo
    run = GRPO(
        built.config, params, build_optimizer(spec, steps), built.tokenizer,
        (), dataclasses.replace(g, grad_accum=spec.training.grad_accum),
        trainable=trainable, seed=spec.training.seed,
    )  # fmt: skip
    return built, run, records


def train_grpo(spec: TrainSpec, *, progress: bool = True) -> dict[str, Any]:
    """Train, then write the exports; ``{"files": ..., "metrics": ...}``."""
    built, run, records = prepare_grpo(spec)
    out_dir = spec.output_dir
    os.makedirs(out_dir, exist_ok=True)
    metrics_path = os.path.join(out_dir, "metrics.jsonl")
    if os.path.exists(metrics_path):
        os.remove(metrics_path)
    steps = int(spec.training.max_steps or 0)
    every = max(1, spec.training.log_every)

    def log(m: dict[str, float]) -> None:
        if progress and (m["step"] % every == 0 or m["step"] == steps):
            line = f"step {int(m['step'])}/{steps} reward {m['reward']:.4f}"
            print(f"{line} loss {m['loss']:.4g} ({m['step_time']:.1f} s)", flush=True)

    hist = run.train(records, steps, metrics_path=metrics_path, log=log)
    extra: dict[str, Any] = {}
    tokenizer = (spec.model.tokenizer if spec.model else None) or built.tokenizer_source
    if tokenizer:
        extra["tokenizer"] = tokenizer_ref(tokenizer, os.path.join(out_dir, "model"))
    metrics = {"steps": len(hist), "reward_first": hist[0]["reward"],
               "reward_last": hist[-1]["reward"]}  # fmt: skip
    files = write_outputs(spec, built, run.params, out_dir, extra=extra,
                          report=metrics)  # fmt: skip
    files["metrics"] = metrics_path
    files |= _plot(hist, os.path.join(out_dir, "reward.png"))
    return {"files": files, "metrics": metrics}


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
