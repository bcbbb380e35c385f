"""Evaluate a trained model on data: loss and accuracy (tabular) or perplexity (text).

Chat data also gets the task metric, the exact match of greedy replies
(`entrenar.chat.exact_match`), and its loss is the loss on the assistant's replies.
`compare_models` scores a fine-tune and its base on the same rows (before/after).

A tabular model file written by `train_from_yaml` stores its feature columns, target
and normalisation (``custom["tabular"]``), so evaluating it on a new file applies the
same preprocessing as training did.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from entrenar import chat, lora, nn
from entrenar import data as data_lib
from entrenar.config.summary import validate
from entrenar.errors import ConfigError
from entrenar.nn import losses
from entrenar.runs.inference import decoding_params
from entrenar.runs.models import BuiltModel, base_quantizer, build_model, load_built
from entrenar.train import causal_lm_loss_fn

Log = Callable[[str], None]
"""Takes one line of progress (``entrenar quantize`` prints them on stderr)."""


def _tabular(built: BuiltModel, path: str, task: str | None) -> dict[str, Any]:
    tab = built.custom.get("tabular")
    if not isinstance(tab, dict) or "features" not in tab:
        raise ConfigError(
            f"{built.source}: the model file does not store its feature columns "
            "(custom.tabular); evaluate it through its training config"
        )
    recs = data_lib.load_records(path)
    arrays = data_lib.to_arrays(recs, {"x": list(tab["features"])})
    if "mean" in tab:
        data_lib.standardize(arrays, None, tab)  # as in training
    y = data_lib.to_arrays(recs, {"y": tab["target"]}, dtype=np.float64)["y"]
    x = jnp.asarray(arrays["x"])
    out = np.asarray(jax.jit(built.config.apply)(built.params, x))
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


@functools.partial(jax.jit, static_argnames=("model",))
def _batch_loss(model: Any, params: Any, batch: Any) -> tuple[jax.Array, jax.Array]:
    """Summed-over-tokens loss and token count of one batch (compiled once a model)."""
    loss, metrics = causal_lm_loss_fn(model)(params, batch, key=None)
    weight = metrics["loss_weight"]
    return loss * weight, weight


def _row_length(
    recs: data_lib.Records, built: BuiltModel, fmt: Any, seq_len: int,
    fields: dict[str, str],
) -> int:  # fmt: skip
    """``seq_len`` cut to the longest document (a multiple of 8), not padded past it.

    Rows of 512 tokens for conversations of 60 cost eight times the work for the
    same loss: no document is longer than the row either way.
    """
    limit = min(seq_len, nn.context_length(built.config) or seq_len)
    docs = data_lib.encode_records(recs, built.tokenizer, format=fmt, fields=fields)
    longest = max((len(ids) for ids, _ in docs), default=1)
    return min(limit, -(-longest // 8) * 8)


def _loss_sums(
    built: BuiltModel, loader: data_lib.TextLoader, *, bar: bool
) -> tuple[float, float]:
    """The loss summed over the loader's labelled tokens, and their number.

    ``bar``: a progress bar over the batches on a terminal (tqdm's own test).
    """
    loader.set_epoch(0)
    total = weight = 0.0
    batches = tqdm(loader, desc="loss", unit="batch", leave=False,
                   disable=None if bar else True)  # fmt: skip
    for batch in batches:
        loss, w = _batch_loss(built.config, built.params, batch)
        total, weight = total + float(loss), weight + float(w)
    return total, weight


def _text(
    built: BuiltModel, path: str, fmt: Any, seq_len: int, log: Log | None,
    generate: bool = False, batch_size: int = 16,
    decode_activations: str | None = None, fields: dict[str, str] | None = None,
) -> dict[str, Any]:  # fmt: skip
    if built.tokenizer is None:
        raise ConfigError(f"{built.source}: no tokenizer to read {path} with")
    recs = data_lib.load_records(path)
    names = {**FIELDS, **(fields or {})}
    fmt = record_format(recs, names) if fmt == "auto" else fmt
    if generate and fmt != "chat":
        raise ConfigError(f"{path}: --generate scores chat data, not {fmt}")
    if fmt == "chat" and not getattr(built.tokenizer, "chat_template", None):
        raise ConfigError(
            f"{path} is chat data, and {built.source or 'the model'} has no chat "
            "template to render it with; evaluate a model whose tokenizer has one, "
            "or prompt-completion or text data"
        )
    row = _row_length(recs, built, fmt, seq_len, names)
    loader = data_lib.lm_loader(
        recs, built.tokenizer, format=fmt, seq_len=row, batch_size=8, shuffle=False,
        fields=names,
    )  # fmt: skip
    if log is not None:  # the model and the data read: the long part begins
        log(f"evaluating {built.source or 'the model'} on {path}")
        n = len(loader)
        log(
            f"  loss of {len(recs)} records ({n} batch{'es' * (n != 1)}, rows of {row})"
        )
    total, weight = _loss_sums(built, loader, bar=log is not None)
    if weight == 0:
        raise ConfigError(f"{path}: no token to evaluate on")
    mean = total / weight
    out: dict[str, Any] = {
        "tokens": int(weight),
        "eval_loss": mean,
        "perplexity": math.exp(mean),
    }
    if fmt == "chat":  # the task metric: greedy replies reproduced exactly
        if log is not None:
            how = f"decoded, batches of {batch_size}" if generate else "one pass"
            log(f"  exact match of the greedy replies to {len(recs)} conversations "
                f"({how})")  # fmt: skip
        session = chat.ChatModel(built.config, built.params, built.tokenizer,
                                 decode_activations=decode_activations)  # fmt: skip
        if names["messages"] != "messages":  # exact_match reads "messages"
            recs = data_lib.Records(
                [{"messages": recs.value(i, names["messages"], (list, tuple))}
                 for i in range(len(recs))],
                recs.source, recs.row_numbers, recs.unit,
            )  # fmt: skip
        em = chat.exact_match(session, recs, batch_size=batch_size, generate=generate)
        out |= {"exact_match": em.accuracy, "examples": em.total}
    return out


FIELDS = {"text": "text", "prompt": "prompt", "completion": "completion",
          "messages": "messages"}  # fmt: skip
"""The record field of each role, unless a run's ``data:`` renames them."""


def record_format(recs: data_lib.Records, fields: dict[str, str] | None = None) -> str:
    """``chat``, ``prompt_completion`` or ``text``, from the first record's fields.

    ``fields`` renames them (a run's ``data.text_field``, ...); as training reads
    ``data.format: auto`` (`entrenar.data.detect_record_format`).
    """
    return data_lib.detect_record_format(recs, {**FIELDS, **(fields or {})})


def evaluate_built(
    built: BuiltModel, data: str, *, fmt: str = "auto", seq_len: int = 512,
    task: str | None = None, log: Log | None = None, generate: bool = False,
    batch_size: int = 16, decode_activations: str | None = None,
    fields: dict[str, str] | None = None,
) -> dict[str, Any]:  # fmt: skip
    """Metrics of a loaded model on a data file (see `evaluate_model`).

    ``log``: a function that takes one line per stage of a language model's
    evaluation, once its data is read (and turns on a progress bar over the batches,
    on a terminal); a tabular model takes a moment and says nothing.
    """
    if built.is_lm:
        return _text(built, data, fmt, seq_len, log, generate, batch_size,
                     decode_activations, fields)  # fmt: skip
    return _tabular(built, data, task)


def evaluate_model(
    model: str, data: str, *, fmt: str = "auto", seq_len: int = 512,
    task: str | None = None, log: Log | None = None, generate: bool = False,
    batch_size: int = 16, keep_quantized: bool = False,
    decode_activations: str | None = None, fields: dict[str, str] | None = None,
) -> dict[str, Any]:  # fmt: skip
    """Metrics of a model file on a data file (see the module docstring).

    ``fmt`` ``"auto"`` reads a language model's data as chat (records with
    ``messages``), prompt-completion (``prompt`` and ``completion``) or text. A
    language model's rows are as long as the longest document (at most ``seq_len``
    and the model's context). Chat data's exact match comes from one teacher-forced
    pass, or with ``generate`` from decoding the replies, ``batch_size`` at a time
    (`entrenar.chat.exact_match`). ``keep_quantized``: a GGUF's quantized weights
    kept as stored, a tied head read as Q8_0 as ``entrenar generate`` and ``chat``
    read it (`entrenar.runs.inference.decoding_params`); ``decode_activations``: how
    the decoding multiplies them (`entrenar.chat.ChatModel`); ``fields``: the record
    field of each role (``{"messages": "conversation"}``, a run's ``data.*_field``).
    """
    built = load_built(model, keep_quantized=keep_quantized)
    built = dataclasses.replace(built, params=decoding_params(built, keep_quantized))
    return evaluate_built(built, data, fmt=fmt, seq_len=seq_len, task=task, log=log,
                          generate=generate, batch_size=batch_size,
                          decode_activations=decode_activations,
                          fields=fields)  # fmt: skip


def compare_models(
    base: str, model: str, data: str, *, fmt: str = "auto", seq_len: int = 512,
    log: Log | None = None,
) -> dict[str, dict[str, Any]]:  # fmt: skip
    """``{"base": metrics, "model": metrics}`` of two model files on the same data.

    The metrics of a fine-tune before (``base``) and after (``model``): the same
    rows, format and lengths for both.
    """
    options: dict[str, Any] = dict(fmt=fmt, seq_len=seq_len, log=log)
    return {
        "base": evaluate_model(base, data, **options),
        "model": evaluate_model(model, data, **options),
    }


def evaluate_config(
    config: str, *, data: str | None = None, model: str | None = None
) -> dict[str, Any]:
    """Metrics of a run's trained model on its validation data (or ``data``).

    The trained model is ``model``, else the first of the run's model.safetensors,
    model.gguf, hf/ and model.json, else (a run that exported only its adapter) the
    run's base as it trained (a QLoRA base quantized) with ``adapter/`` attached.
    """
    spec = validate(config)
    assert spec.data is not None
    path = data or spec.data.validation
    if path is None:
        raise ConfigError(
            "data.validation: the config names no validation file; pass --data FILE"
        )
    if model is None:
        out = spec.output_dir
        found = [
            os.path.join(out, name)
            for name in ("model.safetensors", "model.gguf", "hf", "model.json")
            if os.path.exists(os.path.join(out, name))
        ]
        adapter = os.path.join(out, "adapter")
        if not found and spec.model is not None and os.path.isdir(adapter):
            return evaluate_built(
                _adapted_base(spec, adapter), path, fmt=_format(spec),
                seq_len=spec.data.seq_len, task=spec.data.task,
                fields=spec.data.fields,
            )  # fmt: skip
        if not found:
            raise ConfigError(
                f"{out}: no trained model; run `entrenar train {config}` first or "
                "pass --model"
            )
        model = found[0]
    return evaluate_model(
        model, path, fmt=_format(spec), seq_len=spec.data.seq_len,
        task=spec.data.task, fields=spec.data.fields,
    )  # fmt: skip


def _format(spec: Any) -> str:
    """The data format `evaluate_model` reads a run's data in."""
    return "auto" if spec.data.format in ("auto", "tabular") else spec.data.format


def _adapted_base(spec: Any, adapter: str) -> BuiltModel:
    """The run's base model as it trained, with the PEFT ``adapter`` attached."""
    built = build_model(
        spec.model,
        key=jax.random.key(spec.training.seed),
        quantize=base_quantizer(spec.lora),  # QLoRA: the base the adapter learned on
    )
    wrapper = getattr(built.config, "hf_wrapper", None)
    params = lora.load_adapter(adapter, built.params, wrapper=wrapper)
    return dataclasses.replace(built, params=params)


__all__ = [
    "FIELDS",
    "Log",
    "compare_models",
    "evaluate_built",
    "evaluate_config",
    "evaluate_model",
    "record_format",
]
