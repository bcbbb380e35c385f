"""A language model's completion log-probabilities and the Trainer's DPO loss.

A preference batch holds ``B`` pairs, each row the prompt followed by the chosen
(index 0) or the rejected (index 1) completion, padded on the right to one length
``T`` (`entrenar.data.collate_preference`, TRL's ``DataCollatorForPreference``):

- ``input_ids``, ``attention_mask``, ``completion_mask``: ``(B, 2, T)``;
- optionally ``ref_chosen_logps``, ``ref_rejected_logps``: ``(B,)``, the
  reference's log-probabilities computed before training (TRL's
  ``precompute_ref_log_probs``; `reference_logps`).

The pairs stay together along the batch axis, so the Trainer's micro-batches
(``grad_accum``) split pairs, never a pair's halves. Inside the loss chosen and
rejected go through the model as one batch of ``2B`` rows (TRL's concatenated
forward), and the log-probability of a row is
``Σ_t completion_mask[t] log softmax(z_{t-1})[ids_t]`` (the logits at ``t − 1``
predict token ``t``; `entrenar.nn.losses.chunked_causal_lm_loss`, so the
``(2B, T, V)`` logits are never whole).

The reference (`make_dpo_loss_fn`'s ``reference``):

- ``"adapters"``: the same tree with every `entrenar.lora.LoRAWeight` replaced by
  its base (`without_adapters`): LoRA and QLoRA with no second model in memory,
  as TRL does for a PEFT model with ``ref_model=None``. Its forward runs in the
  same step under ``stop_gradient``.
- ``"precomputed"``: the batch's ``ref_*_logps`` (full fine-tuning: the starting
  model's, from `reference_logps` before the first step).
"""

from __future__ import annotations

from typing import Any, Literal

import jax
import jax.numpy as jnp

from entrenar import lora
from entrenar.errors import ConfigError, ShapeError, UnsupportedError
from entrenar.lora import LoRAWeight
from entrenar.nn.losses import IGNORE_INDEX, chunked_causal_lm_loss
from entrenar.preference.loss import check_dpo_settings, dpo_loss
from entrenar.types import Params, PyTree

Reference = Literal["adapters", "precomputed"]
BATCH_KEYS = ("input_ids", "attention_mask", "completion_mask")


def without_adapters(params: Params) -> Params:
    """``params`` with each `LoRAWeight` replaced by its (frozen) base weight."""
    return jax.tree_util.tree_map(
        lambda x: x.base if isinstance(x, LoRAWeight) else x,
        params,
        is_leaf=lambda x: isinstance(x, LoRAWeight),
    )


def has_adapters(params: Params) -> bool:
    """Whether ``params`` holds any `LoRAWeight`."""
    leaves = jax.tree_util.tree_leaves(
        params, is_leaf=lambda x: isinstance(x, LoRAWeight)
    )
    return any(isinstance(x, LoRAWeight) for x in leaves)


def adapters_off(params: Params) -> Params:
    """The reference of ``reference='adapters'``: ``params`` without their adapters.

    Gradient-stopped. Raises `ConfigError` when ``params`` hold no `LoRAWeight`
    (full fine-tuning has no adapters to turn off: precompute the reference).
    """
    if not has_adapters(params):
        raise ConfigError(
            "reference='adapters' needs LoRA adapters in the params; for "
            "full fine-tuning use reference='precomputed'"
        )
    return jax.lax.stop_gradient(without_adapters(params))


def sequence_logps(
    model: Any,
    params: Params,
    input_ids: jax.Array,
    attention_mask: jax.Array,
    completion_mask: jax.Array,
) -> jax.Array:
    """``(N,)`` summed log-probabilities of each row's completion tokens.

    ``input_ids``, ``attention_mask``, ``completion_mask``: ``(N, T)``; ``model`` a
    Llama-style config (``features`` and ``output_weight``).
    """
    ids = jnp.asarray(input_ids)  # (N, T)
    mask = jnp.asarray(attention_mask, bool)  # (N, T)
    labels = jnp.where(jnp.asarray(completion_mask, bool), ids, IGNORE_INDEX)
    nll = chunked_causal_lm_loss(
        model.features(params, ids, mask=mask),  # (N, T, D)
        model.output_weight(params),  # (V, D)
        labels, "none", loss_mask=mask, matmul_dtype=model.matmul_dtype,
        softcap=model.final_logit_softcapping,
    )  # fmt: skip  # (N, T-1), zero where not counted
    return -jnp.sum(nll, axis=-1)


def _rows(batch: PyTree) -> tuple[jax.Array, ...]:
    """The batch's ``(B, 2, T)`` arrays as ``(2B, T)``: all chosen, then rejected."""
    missing = [k for k in BATCH_KEYS if k not in batch]
    if missing:
        raise ShapeError(
            f"preference batches need the keys {list(BATCH_KEYS)}; this batch lacks "
            f"{missing} (it has {sorted(batch)})"
        )
    out = []
    for k in BATCH_KEYS:
        x = jnp.asarray(batch[k])
        if x.ndim != 3 or x.shape[1] != 2:
            raise ShapeError(f"preference batch {k!r} must be (B, 2, T), got {x.shape}")
        out.append(jnp.concatenate([x[:, 0], x[:, 1]], axis=0))  # (2B, T)
    return tuple(out)


def refuse_router_jitter(model: Any, method: str) -> None:
    """Raise `UnsupportedError` for a model with Mixtral's ``router_jitter_noise``.

    transformers jitters the MoE input of a model in training mode (TRL's policy
    forward); entrenar applies it in causal-LM training only
    (`entrenar.train.causal_lm_loss_fn`), not in ``method``'s forward passes.
    """
    noise = getattr(model, "router_jitter_noise", 0.0)
    if noise:
        raise UnsupportedError(
            f"{method} does not apply LlamaConfig.router_jitter_noise ({noise}); "
            "set it to 0 (config.json's router_jitter_noise) to train with "
            f"{method}, or train this model with the causal-LM loss, which applies it"
        )


def make_dpo_loss_fn(
    model: Any,
    *,
    beta: float = 0.1,
    loss_type: str = "sigmoid",
    label_smoothing: float = 0.0,
    reference: Reference = "adapters",
    disable_dropout: bool = True,
) -> Any:
    """``loss_fn(params, batch, *, key) -> (loss, metrics)`` of DPO for the Trainer.

    ``metrics`` holds TRL's (`entrenar.preference.dpo_loss`) and ``loss_weight``,
    the number of pairs ``B`` (micro-batches and evaluation average over pairs).
    ``disable_dropout`` (TRL's default, which sets every dropout of the model,
    LoRA's included, to 0): the adapters' dropout is off; with False it acts on
    the policy's forward only (the reference has no adapters).
    """
    check_dpo_settings(beta, loss_type, label_smoothing)
    refuse_router_jitter(model, "DPO")
    if reference not in ("adapters", "precomputed"):
        raise ConfigError(
            f"reference must be 'adapters' or 'precomputed', got {reference!r}"
        )

    def loss_fn(params: Params, batch: PyTree, *, key: Any) -> Any:
        ids, mask, completion = _rows(batch)  # (2B, T) each
        b = ids.shape[0] // 2
        if reference == "precomputed":
            if "ref_chosen_logps" not in batch or "ref_rejected_logps" not in batch:
                raise ShapeError(
                    "reference='precomputed' needs ref_chosen_logps and "
                    "ref_rejected_logps in each batch (entrenar.preference."
                    "reference_logps)"
                )
            ref_c = jnp.asarray(batch["ref_chosen_logps"], jnp.float32)  # (B,)
            ref_r = jnp.asarray(batch["ref_rejected_logps"], jnp.float32)
        else:
            base = adapters_off(params)
            ref = sequence_logps(model, base, ids, mask, completion)  # (2B,)
            ref_c, ref_r = ref[:b], ref[b:]
        policy_params = params
        if key is not None and not disable_dropout:
            policy_params = lora.with_dropout_keys(params, key=key)
        logps = sequence_logps(model, policy_params, ids, mask, completion)  # (2B,)
        n = jnp.sum(jnp.asarray(completion, jnp.float32), axis=-1)  # (2B,)
        loss, metrics = dpo_loss(
            logps[:b], logps[b:], ref_c, ref_r,
            beta=beta, loss_type=loss_type, label_smoothing=label_smoothing,
            chosen_tokens=n[:b], rejected_tokens=n[b:],
        )  # fmt: skip
        return loss, {**metrics, "loss_weight": jnp.asarray(b, jnp.float32)}

    return loss_fn


def reference_logps(
    model: Any, params: Params, batch: PyTree
) -> tuple[jax.Array, jax.Array]:
    """The ``(B,)`` log-probabilities of a batch's chosen and rejected completions.

    Run once per batch with the starting params before training, they are the
    ``ref_chosen_logps`` / ``ref_rejected_logps`` of ``reference="precomputed"``.
    """
    ids, mask, completion = _rows(batch)
    logps = sequence_logps(model, params, ids, mask, completion)  # (2B,)
    b = ids.shape[0] // 2
    return logps[:b], logps[b:]


__all__ = [
    "BATCH_KEYS",
    "Reference",
    "adapters_off",
    "has_adapters",
    "make_dpo_loss_fn",
    "reference_logps",
    "refuse_router_jitter",
    "sequence_logps",
    "without_adapters",
]
