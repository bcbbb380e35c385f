"""Loss functions for entrenar's models, on the batch keys of specs/conventions.md.

- Language models (`entrenar.nn.Llama`, `entrenar.nn.GPT2`): the causal LM loss on
  ``input_ids`` with ``labels`` (default: the input ids), ``attention_mask``
  (padding: neither attended to nor counted) and, for Llama, ``segment_ids`` and
  ``positions`` of packed rows (Llama's through
  `entrenar.nn.losses.chunked_causal_lm_loss`: the ``(B, T, V)`` logits are never
  whole); a mixture of experts with ``output_router_logits`` adds
  ``router_aux_loss_coef`` times the routers' load-balancing loss
  (`entrenar.nn.moe.load_balancing_loss`, as transformers). The loss is the mean
  over counted next-token targets (with
  ``segment_ids``, never a packed document's first token: `segment_labels`, also
  when the labels default to the input ids) and reports their number as
  ``loss_weight`` (so accumulation and evaluation
  average over tokens, not over batches).
- Any other model with ``apply(params, x, *, key=None)`` (`entrenar.nn.MLP`): the
  ``TrainConfig.loss`` named in ``entrenar.nn.losses.LOSSES`` between
  ``apply(params, batch["x"])`` and ``batch["y"]``, a mean over the batch, with
  ``loss_weight`` the number of rows (of targets not ignored, for cross-entropy),
  so that a short last batch counts for what it holds.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from entrenar import lora
from entrenar.errors import ConfigError, ShapeError
from entrenar.nn.gpt2 import GPT2Config
from entrenar.nn.llama import LlamaConfig
from entrenar.nn.losses import (
    IGNORE_INDEX,
    LOSSES,
    causal_lm_loss,
    chunked_causal_lm_loss,
    segment_labels,
)
from entrenar.nn.moe import load_balancing_loss
from entrenar.train.step import LossFn
from entrenar.types import Params, PyTree


def _need(batch: PyTree, keys: tuple[str, ...], what: str) -> None:
    missing = [k for k in keys if k not in batch]
    if missing:
        raise ShapeError(
            f"{what} batches need the keys {list(keys)}; this batch lacks {missing} "
            f"(it has {sorted(batch)})"
        )


def causal_lm_loss_fn(model: Any) -> LossFn:
    """``loss_fn(params, batch, *, key)`` for a Llama or GPT-2 config."""
    is_llama = isinstance(model, LlamaConfig)
    routed = is_llama and model.num_experts > 0 and model.output_router_logits

    def loss_fn(params: Params, batch: PyTree, *, key: Any) -> Any:
        _need(batch, ("input_ids",), "language-model")
        tokens = jnp.asarray(batch["input_ids"])  # (B, T)
        labels = jnp.asarray(batch.get("labels", tokens))  # (B, T)
        mask = batch.get("attention_mask")
        kwargs: dict[str, Any] = {"mask": mask}
        if is_llama:
            kwargs.update(
                segment_ids=batch.get("segment_ids"), positions=batch.get("positions")
            )
            if model.router_jitter_noise:  # Mixtral's training jitter
                kwargs["key"] = key
            if kwargs["segment_ids"] is not None:  # no target across documents
                labels = segment_labels(labels, kwargs["segment_ids"])
        elif "segment_ids" in batch:
            raise ShapeError("GPT-2 does not take packed rows (segment_ids); use Llama")
        else:
            kwargs["key"] = key
        if key is not None:
            params = lora.with_dropout_keys(params, key=key)
        aux = None
        if is_llama:  # the head's logits a chunk of tokens at a time, never whole
            features = model.features(
                params, tokens, **kwargs, return_router_logits=routed
            )
            if routed:  # (B, T, D), (L, B T, E)
                features, router = features
                aux = load_balancing_loss(router, model.num_experts_per_tok, mask)
            total = chunked_causal_lm_loss(
                features,  # (B, T, D)
                model.output_weight(params),  # (V, D)
                labels, "sum", loss_mask=mask, matmul_dtype=model.matmul_dtype,
                softcap=model.final_logit_softcapping,
            )  # fmt: skip
        else:
            logits = model.apply(params, tokens, **kwargs)  # (B, T, V)
            total = causal_lm_loss(logits, labels, "sum", loss_mask=mask)
        counted = labels[:, 1:] != IGNORE_INDEX  # (B, T-1)
        if mask is not None:
            counted = counted & jnp.asarray(mask, bool)[:, 1:]
        n = jnp.sum(counted).astype(jnp.float32)
        loss = total / jnp.maximum(n, 1.0)
        if aux is not None:  # transformers: loss + router_aux_loss_coef * aux_loss
            loss = loss + model.router_aux_loss_coef * aux.astype(loss.dtype)
        return loss, {"loss_weight": n}

    return loss_fn


def supervised_loss_fn(model: Any, loss: str = "mse") -> LossFn:
    """``loss_fn(params, batch, *, key)``: ``LOSSES[loss](apply(params, x), y)``."""
    if loss not in LOSSES or loss in ("causal_lm", "kl_divergence"):
        raise ConfigError(
            f"loss {loss!r} does not fit (x, y) batches; use one of "
            f"{sorted(set(LOSSES) - {'causal_lm', 'kl_divergence'})}"
        )
    fn = LOSSES[loss]

    def loss_fn(params: Params, batch: PyTree, *, key: Any) -> Any:
        _need(batch, ("x", "y"), "supervised")
        y = jnp.asarray(batch["y"])  # (B, ...)
        pred = model.apply(params, jnp.asarray(batch["x"]), key=key)
        if loss == "cross_entropy":  # the mean is over the targets not ignored
            n = jnp.sum(y != IGNORE_INDEX).astype(jnp.float32)
        else:  # the mean is over all of y's entries, B times as many as one row's
            n = jnp.asarray(y.shape[0], jnp.float32)
        return fn(pred, y), {"loss_weight": n}

    return loss_fn


def loss_for_model(model: Any, loss: str = "mse") -> LossFn:
    """The loss function the Trainer uses for ``model`` (see the module docstring)."""
    if isinstance(model, (LlamaConfig, GPT2Config)):
        return causal_lm_loss_fn(model)
    if hasattr(model, "apply"):
        return supervised_loss_fn(model, loss)
    raise ConfigError(
        f"Trainer needs a loss function loss_fn(params, batch, *, key) or a model "
        f"with .apply; got {type(model).__name__}"
    )


def with_compute_dtype(loss_fn: LossFn, dtype: str | None) -> LossFn:
    """``loss_fn`` on params whose float leaves are cast to ``dtype`` (None: as is)."""
    if dtype is None:
        return loss_fn
    dt = jnp.dtype(dtype)

    def cast(x: Any) -> Any:
        if isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jnp.floating):
            return x.astype(dt)
        return x

    @functools.wraps(loss_fn)  # keeps its signature (a `step` keyword, say)
    def wrapped(params: Params, batch: PyTree, *, key: Any, **kwargs: Any) -> Any:
        return loss_fn(jax.tree_util.tree_map(cast, params), batch, key=key, **kwargs)

    return wrapped


__all__ = [
    "causal_lm_loss_fn",
    "loss_for_model",
    "supervised_loss_fn",
    "with_compute_dtype",
]
