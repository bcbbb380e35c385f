"""Per-token completion log-probabilities and the Trainer's GRPO loss.

A GRPO batch holds ``B = P·G`` sampled completions, each row its prompt followed by
the completion, padded on the right to one length ``T`` (`pack_completions`):

- ``input_ids``, ``attention_mask``, ``completion_mask``: ``(B, T)``;
- ``advantages``: ``(B,)`` (`entrenar.preference.group_advantages`);
- optionally ``old_logps`` ``(B, T − 1)``: the sampling policy's per-token
  log-probabilities when a generation is trained on more than once (TRL's
  ``num_iterations > 1``); without them ``π_old`` is the policy itself, detached;
- optionally ``ref_logps`` ``(B, T − 1)``: the reference's, computed before the
  step (``reference="precomputed"``; full fine-tuning with ``β > 0``).

Per-token arrays are aligned with the predictions: index ``t`` holds
``log softmax(z_t / τ)[ids_{t+1}]`` (``τ`` the sampling temperature, which TRL
divides the logits by when it scores), counted where ``completion_mask[t + 1]``.
TRL pads prompts on the left; rotary models see only relative positions, so a row
packed from the left scores the same.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from entrenar.errors import ConfigError, ShapeError
from entrenar.nn.linear import linear
from entrenar.nn.losses import IGNORE_INDEX, chunked_causal_lm_loss
from entrenar.preference.grpo import check_grpo_settings, grpo_loss
from entrenar.preference.loss_fn import (
    Reference,
    adapters_off,
    refuse_router_jitter,
)
from entrenar.types import Params, PyTree

GRPO_BATCH_KEYS = ("input_ids", "attention_mask", "completion_mask", "advantages")


def pack_completions(
    prompts: Sequence[Sequence[int]],
    completions: Sequence[Sequence[int]],
    pad_id: int,
    length: int | None = None,
) -> dict[str, np.ndarray]:
    """Rows ``prompt + completion`` padded on the right.

    ``input_ids``, ``attention_mask``, ``completion_mask``, each ``(B, T)``, ``T``
    the longest row (or ``length``).
    """
    if len(prompts) != len(completions):
        raise ShapeError(
            f"{len(prompts)} prompts for {len(completions)} completions; repeat each "
            "prompt once per completion"
        )
    longest = max((len(p) + len(c) for p, c in zip(prompts, completions)), default=0)
    t = longest if length is None else length
    if t < longest:
        raise ShapeError(f"length {t} is shorter than the longest row ({longest})")
    b = len(prompts)
    ids = np.full((b, t), pad_id, np.int32)
    mask = np.zeros((b, t), np.int32)
    comp = np.zeros((b, t), np.int32)
    for i, (p, c) in enumerate(zip(prompts, completions)):
        n, m = len(p), len(c)
        ids[i, : n + m] = [*p, *c]
        mask[i, : n + m] = 1
        comp[i, n : n + m] = 1
    return {"input_ids": ids, "attention_mask": mask, "completion_mask": comp}


def _tempered_features(model: Any, params: Params, ids: jax.Array, mask: jax.Array,
                       temperature: float) -> jax.Array:  # fmt: skip
    """``features / τ``: ``(h / τ) Wᵀ = z / τ`` for a linear head."""
    h = model.features(params, ids, mask=mask)  # (B, T, D)
    if temperature == 1.0:
        return h
    if getattr(model, "final_logit_softcapping", None) is not None:
        raise ConfigError(
            "GRPO with temperature != 1 divides the logits after the softcap; "
            "models with final_logit_softcapping are not supported there yet"
        )
    return h / jnp.asarray(temperature, h.dtype)


def _logps_from_features(
    model: Any,
    params: Params,
    h: jax.Array,
    ids: jax.Array,
    mask: jax.Array,
    completion: jax.Array,
) -> jax.Array:
    labels = jnp.where(completion, ids, IGNORE_INDEX)
    nll = chunked_causal_lm_loss(
        h, model.output_weight(params), labels, "none", loss_mask=mask,
        matmul_dtype=model.matmul_dtype,
        softcap=getattr(model, "final_logit_softcapping", None),
    )  # fmt: skip  # (B, T-1), zero where not counted
    return -nll


def token_logps(
    model: Any,
    params: Params,
    input_ids: jax.Array,
    attention_mask: jax.Array,
    completion_mask: jax.Array,
    temperature: float = 1.0,
) -> jax.Array:
    """``(B, T − 1)`` log-probabilities of each completion token (0 elsewhere).

    ``log softmax(z_t / τ)[ids_{t+1}]``; ``model`` a Llama-style config
    (``features``, ``output_weight``).
    """
    ids = jnp.asarray(input_ids)
    mask = jnp.asarray(attention_mask, bool)
    completion = jnp.asarray(completion_mask, bool)
    h = _tempered_features(model, params, ids, mask, temperature)
    return _logps_from_features(model, params, h, ids, mask, completion)


def _entropies(model: Any, params: Params, h: jax.Array) -> jax.Array:
    """``(B, T − 1)`` entropies of the (tempered) next-token distributions.

    One row's ``(T, V)`` logits at a time.
    """
    w = model.output_weight(params)

    def row(hr: jax.Array) -> jax.Array:
        z = linear(hr[:-1], w, matmul_dtype=model.matmul_dtype).astype(jnp.float32)
        logp = jax.nn.log_softmax(z, axis=-1)  # (T-1, V)
        return -jnp.sum(jnp.exp(logp) * logp, axis=-1)

    return jax.lax.map(row, jax.lax.stop_gradient(h))


def make_grpo_loss_fn(
    model: Any,
    *,
    beta: float = 0.0,
    epsilon: float = 0.2,
    epsilon_high: float | None = None,
    loss_type: str = "dapo",
    temperature: float = 1.0,
    max_completion_length: int | None = None,
    reference: Reference = "adapters",
    use_bias_correction_kl: bool = True,
) -> Any:
    """``loss_fn(params, batch, *, key) -> (loss, metrics)`` of GRPO for the Trainer.

    The metrics are TRL's (`entrenar.preference.grpo_loss`, and ``entropy``: the
    token mean of the policy's tempered entropies) and ``loss_weight``: the
    completion tokens for ``dapo`` (micro-batches then add up to the batch's token
    mean, as TRL's ``num_items_in_batch``), 1 otherwise (TRL divides each
    micro-batch's loss by the number of micro-batches). ``reference``: with
    ``beta > 0``, ``"adapters"`` scores with the LoRA adapters off (as DPO),
    ``"precomputed"`` reads the batch's ``ref_logps``.
    """
    check_grpo_settings(beta=beta, epsilon=epsilon, epsilon_high=epsilon_high,
                        loss_type=loss_type,
                        max_completion_length=max_completion_length)  # fmt: skip
    refuse_router_jitter(model, "GRPO")
    if reference not in ("adapters", "precomputed"):
        raise ConfigError(
            f"reference must be 'adapters' or 'precomputed', got {reference!r}"
        )
    if not temperature > 0:
        raise ConfigError(f"temperature must be > 0, got {temperature}")

    def loss_fn(params: Params, batch: PyTree, *, key: Any) -> Any:
        del key  # TRL's GRPO keeps dropout as the model has it; entrenar's is off
        missing = [k for k in GRPO_BATCH_KEYS if k not in batch]
        if missing:
            raise ShapeError(
                f"GRPO batches need the keys {list(GRPO_BATCH_KEYS)}; this batch "
                f"lacks {missing} (it has {sorted(batch)})"
            )
        ids = jnp.asarray(batch["input_ids"])  # (B, T)
        mask = jnp.asarray(batch["attention_mask"], bool)
        completion = jnp.asarray(batch["completion_mask"], bool)
        if ids.ndim != 2 or mask.shape != ids.shape or completion.shape != ids.shape:
            raise ShapeError(
                f"GRPO input_ids, attention_mask, completion_mask must be one (B, T) "
                f"shape; got {ids.shape}, {mask.shape}, {completion.shape}"
            )
        h = _tempered_features(model, params, ids, mask, temperature)  # (B, T, D)
        logps = _logps_from_features(model, params, h, ids, mask, completion)
        token_mask = completion[:, 1:]  # (B, T-1)
        ref = None
        if beta != 0.0:
            if reference == "precomputed":
                if "ref_logps" not in batch:
                    raise ShapeError(
                        "reference='precomputed' with beta > 0 needs ref_logps "
                        "(B, T-1) in each batch"
                    )
                ref = jnp.asarray(batch["ref_logps"], logps.dtype)
            else:
                base = adapters_off(params)
                ref = token_logps(model, base, ids, mask, completion, temperature)
        old = batch.get("old_logps")
        loss, metrics = grpo_loss(
            logps, old, ref, batch["advantages"], token_mask,
            beta=beta, epsilon=epsilon, epsilon_high=epsilon_high,
            loss_type=loss_type, max_completion_length=max_completion_length,
            use_bias_correction_kl=use_bias_correction_kl,
        )  # fmt: skip
        m = token_mask.astype(jnp.float32)
        ent = _entropies(model, params, h)  # (B, T-1)
        metrics["entropy"] = jnp.sum(ent * m) / jnp.maximum(jnp.sum(m), 1.0)
        weight = jnp.sum(m) if loss_type == "dapo" else jnp.float32(1.0)
        return loss, {**metrics, "loss_weight": weight}

    return loss_fn


__all__ = [
    "GRPO_BATCH_KEYS",
    "make_grpo_loss_fn",
    "pack_completions",
    "token_logps",
]
