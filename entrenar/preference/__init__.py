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

GRPO (online RL, Shao et al. 2024, as TRL's ``GRPOTrainer``): `group_advantages`
of sampled completions' rewards, `grpo_loss` of per-token log-probabilities
(`token_logps`), `make_grpo_loss_fn` for the Trainer on `pack_completions`
batches, and the online loop `GRPO` (`entrenar.preference.grpo_run`).
"""

from entrenar.preference.grpo import (
    GRPO_LOSS_TYPES,
    SCALE_REWARDS,
    check_grpo_settings,
    group_advantages,
    grpo_loss,
)
from entrenar.preference.grpo_fn import (
    GRPO_BATCH_KEYS,
    make_grpo_loss_fn,
    pack_completions,
    token_logps,
)
from entrenar.preference.grpo_run import (
    GRPO,
    GRPOSettings,
    RewardSpec,
    builtin_reward,
    completion_metrics,
    reward_metrics,
)
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
    "GRPO",
    "GRPO_BATCH_KEYS",
    "GRPO_LOSS_TYPES",
    "LOSS_TYPES",
    "NORMALISED",
    "SCALE_REWARDS",
    "GRPOSettings",
    "LossType",
    "Reference",
    "RewardSpec",
    "builtin_reward",
    "check_dpo_settings",
    "check_grpo_settings",
    "completion_metrics",
    "dpo_loss",
    "group_advantages",
    "grpo_loss",
    "has_adapters",
    "make_dpo_loss_fn",
    "make_grpo_loss_fn",
    "pack_completions",
    "reference_logps",
    "reward_metrics",
    "sequence_logps",
    "token_logps",
    "without_adapters",
]
