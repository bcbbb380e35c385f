"""Knowledge distillation: a student learns from a frozen teacher's soft targets.

Protocol: losses are pure functions of logits (and hidden states)::

    loss = distillation_loss(student_logits, teacher_logits, labels, T, alpha)
         # α T² KL(softmax(t/T) ‖ softmax(s/T)) + (1 − α) CE(s, y)

`DistillationLoss` binds ``T`` and ``α``; `EnsembleDistiller` turns several teachers
into one target (averaged probabilities or logits); `ProgressiveDistiller` adds
hidden-state matching (MSE or cosine, learned projections when widths differ) that
moves from lower to upper layers. `make_distill_loss_fn` packs a student and a frozen
teacher into the conventions' ``loss_fn(params, batch, *, key) -> (loss, metrics)``
for the Trainer or any jitted loop. Math: specs/distillation.md.
"""

from entrenar.distill.ensemble import MODES, EnsembleDistiller
from entrenar.distill.logits import (
    DistillationLoss,
    distillation_loss,
    distillation_terms,
    soft_targets,
)
from entrenar.distill.loss_fn import (
    TRAINABLE,
    DistillLossFn,
    hidden_widths,
    make_distill_loss_fn,
)
from entrenar.distill.progressive import HIDDEN_LOSSES, ProgressiveDistiller

__all__ = [
    "HIDDEN_LOSSES",
    "MODES",
    "TRAINABLE",
    "DistillLossFn",
    "DistillationLoss",
    "EnsembleDistiller",
    "ProgressiveDistiller",
    "distillation_loss",
    "distillation_terms",
    "hidden_widths",
    "make_distill_loss_fn",
    "soft_targets",
]
