"""Preference fine-tuning: DPO and its variants, as TRL's ``DPOTrainer`` computes it.

Protocol: the loss is a pure function of per-sequence log-probabilities::

    loss, metrics = dpo_loss(π_c, π_r, ref_c, ref_r, beta=β, loss_type="sigmoid")
         # mean over pairs of −log σ(β((π_c − ref_c) − (π_r − ref_r)))

`sequence_logps` sums a language model's log-probabilities over each row's
completion tokens; `make_dpo_loss_fn` packs a model into the conventions'
``loss_fn(params, batch, *, key) -> (loss, metrics)`` on ``(B, 2, T)`` preference
batches, its reference the same tree with the LoRA adapters off
(`without_adapters`) or log-probabilities precomputed with the starting params
(`reference_logps`). Math: specs/preference.md.
"""

from entrenar.preference.loss import (
    LOSS_TYPES,
    NORMALISED,
    LossType,
    check_dpo_settings,
    dpo_loss,
)
from entrenar.preference.loss_fn import (
    BATCH_KEYS,
    Reference,
    has_adapters,
    make_dpo_loss_fn,
    reference_logps,
    sequence_logps,
    without_adapters,
)

__all__ = [
    "BATCH_KEYS",
    "LOSS_TYPES",
    "NORMALISED",
    "LossType",
    "Reference",
    "check_dpo_settings",
    "dpo_loss",
    "has_adapters",
    "make_dpo_loss_fn",
    "reference_logps",
    "sequence_logps",
    "without_adapters",
]
