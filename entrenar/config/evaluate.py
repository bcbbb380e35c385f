"""Evaluate a trained model on data: loss and accuracy (tabular) or perplexity (text).

Chat data also gets the task metric, the exact match of greedy replies
(`entrenar.chat.exact_match`).

A tabular model file written by `train_from_yaml` stores its feature columns, target
and normalisation (``custom["tabular"]``), so evaluating it on a new file applies the
same preprocessing as training did.
"""

from __future__ import annotations

import math
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from entrenar import chat, nn
from entrenar import data as data_lib
from entrenar.config.models import BuiltModel, load_built
from entrenar.config.summary import validate
from entrenar.errors import ConfigError
from entrenar.nn import losses
from entrenar.train import causal_lm_loss_fn


def _tabular(built: BuiltModel, path: str, task: str | None) -> dict[str, Any]:
    tab = built.custom.get("tabular")
    if not isinstance(tab, dict) or "features" not in tab:
        raise ConfigError(
            f"{built.source}: the model file does not store its feature columns "
            "(custom.tabular); evaluate it through its training config"
        )
    recs = data_lib.load_records(path)
    x = data_lib.to_arrays(recs, {"x": list(tab["features"])})["x"]
    if "mean" in tab:
        x = (x - np.asarray(tab["mean"], np.float32)) / np.asarray(
            tab["std"], np.float32
        )
    y = data_lib.to_arrays(recs, {"y": tab["target"]}, dtype=np.float64)["y"]
    out = np.asarray(jax.jit(built.config.apply)(built.params, jnp.asarray(x)))
    n_out = out.shape[-1]
    regression = task == "regression" or (task is None and n_out == 1)
    if regression:
        err = out[:, 0] - y
        return {"examples": len(y), "mse": float(np.mean(err**2)),
                "mae": float(np.mean(np.abs(err)))}  # fmt: skip
    labels = y.astype(np.int32)
    loss = losses.cross_entropy(jnp.asarray(out), jnp.asarray(labels))
    acc = float(np.mean(np.argmax(out, axis=-1) == labels))
    return {"examples": len(y), "eval_loss": float(loss), "accuracy": acc}


def _text(built: BuiltModel, path: str, fmt: Any, seq_len: int) -> dict[str, Any]:
    if built.tokenizer is None:
        raise ConfigError(f"{built.source}: no tokenizer to read {path} with")
    seq_len = min(seq_len, nn.context_length(built.config) or seq_len)
    loader = data_lib.lm_loader(
        path, built.tokenizer, format=fmt, seq_len=seq_len, batch_size=4,
        shuffle=False,
    )  # fmt: skip
    loss_fn = jax.jit(lambda p, b: causal_lm_loss_fn(built.config)(p, b, key=None))
    total = weight = 0.0
    loader.set_epoch(0)
    for batch in loader:
        loss, m = loss_fn(built.params, batch)
        w = float(m["loss_weight"])
        total, weight = total + float(loss) * w, weight + w
    if weight == 0:
        raise ConfigError(f"{path}: no token to evaluate on")
    mean = total / weight
    out: dict[str, Any] = {
        "tokens": int(weight),
        "eval_loss": mean,
        "perplexity": math.exp(mean),
    }
    if fmt == "chat":  # the task metric: greedy replies reproduced exactly
        session = chat.ChatModel(built.config, built.params, built.tokenizer)
        em = chat.exact_match(session, data_lib.load_records(path))
        out |= {"exact_match": em.accuracy, "examples": em.total}
    return out


def data_format(path: str) -> str:
    """``chat``, ``prompt_completion`` or ``text``, from the first record's fields."""
    recs = data_lib.load_records(path)
    first = recs[0] if len(recs) else {}
    if "messages" in first:
        return "chat"
    if "prompt" in first and "completion" in first:
        return "prompt_completion"
    return "text"


def evaluate_model(
    model: str, data: str, *, fmt: str = "auto", seq_len: int = 512,
    task: str | None = None,
) -> dict[str, Any]:  # fmt: skip
    """Metrics of a model file on a data file (see the module docstring).

    ``fmt`` ``"auto"`` reads a language model's data as chat (records with
    ``messages``), prompt-completion (``prompt`` and ``completion``) or text.
    """
    built = load_built(model)
    if built.is_lm:
        return _text(built, data, data_format(data) if fmt == "auto" else fmt, seq_len)
    return _tabular(built, data, task)


def evaluate_config(
    config: str, *, data: str | None = None, model: str | None = None
) -> dict[str, Any]:
    """Metrics of a run's trained model on its validation data (or ``data``)."""
    spec = validate(config)
    assert spec.data is not None
    path = data or spec.data.validation
    if path is None:
        raise ConfigError(
            "data.validation: the config names no validation file; pass --data FILE"
        )
    if model is None:
        out = spec.training.output_dir
        found = [
            os.path.join(out, name)
            for name in ("model.safetensors", "model.gguf", "hf", "model.json")
            if os.path.exists(os.path.join(out, name))
        ]
        if not found:
            raise ConfigError(
                f"{out}: no trained model; run `entrenar train {config}` first or "
                "pass --model"
            )
        model = found[0]
    fmt = "auto" if spec.data.format in ("auto", "tabular") else spec.data.format
    return evaluate_model(
        model, path, fmt=fmt, seq_len=spec.data.seq_len, task=spec.data.task
    )


__all__ = ["evaluate_config", "evaluate_model"]
