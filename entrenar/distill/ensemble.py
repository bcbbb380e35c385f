"""Distillation from several teachers at once: one target from weighted teachers.

For teachers ``i = 1..K`` with logits ``t_i`` and weights ``w_i`` (normalised to sum
to 1), the soft target at temperature ``T`` is

- ``mode="probs"`` (default): ``p = Σ_i w_i softmax(t_i / T)``, the mixture of the
  teachers' tempered distributions;
- ``mode="logits"``: ``p = softmax((Σ_i w_i t_i) / T)``, the distribution of the
  averaged logits (a product of experts, sharper where the teachers agree).

Either is written as *ensemble logits* ``e`` with ``softmax(e / T) = p`` (for probs,
``e = T · log p``), so the loss is `distillation_loss` on ``e`` unchanged:
``α T² KL(p ‖ softmax(s/T)) + (1 − α) CE(s, y)``. With identical teachers both modes
give the single teacher's loss.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from entrenar.distill.logits import distillation_loss
from entrenar.errors import ConfigError, ShapeError
from entrenar.nn.losses import IGNORE_INDEX, Reduction

MODES = ("probs", "logits")


@dataclasses.dataclass(frozen=True)
class EnsembleDistiller:
    """A weighted ensemble of teachers as one soft target.

    Attributes:
        weights: one non-negative weight per teacher (normalised to sum to 1).
        temperature: ``T > 0`` for the soft targets.
        mode: "probs" averages the tempered distributions, "logits" the logits.

    Example:
        >>> ens = EnsembleDistiller((1.0, 1.0), temperature=1.0)
        >>> t = jnp.log(jnp.array([[0.5, 0.5, 0.0], [0.5, 0.0, 0.5]]))
        >>> jax.nn.softmax(ens.teacher_logits(t[:, None])).round(3).tolist()
        [[0.5, 0.25, 0.25]]
    """

    weights: tuple[float, ...]
    temperature: float = 2.0
    mode: str = "probs"

    def __post_init__(self) -> None:
        object.__setattr__(self, "weights", tuple(float(w) for w in self.weights))
        w = self.weights
        if not w or min(w) < 0 or sum(w) <= 0:
            raise ConfigError(
                f"ensemble weights must be non-negative with a positive sum, got {w}"
            )
        if not self.temperature > 0:
            raise ConfigError(
                f"ensemble temperature must be > 0, got {self.temperature}"
            )
        if self.mode not in MODES:
            raise ConfigError(f"ensemble mode {self.mode!r} is not one of {MODES}")

    @property
    def normalized_weights(self) -> tuple[float, ...]:
        """The weights divided by their sum."""
        total = sum(self.weights)
        return tuple(w / total for w in self.weights)

    def teacher_logits(self, teacher_logits: Sequence[jax.Array] | jax.Array) -> Any:
        """Ensemble logits ``e`` with ``softmax(e / T)`` the ensemble's target.

        Args:
            teacher_logits: ``K`` arrays ``(..., C)``, or one array ``(K, ..., C)``.

        Returns:
            ``(..., C)`` float32, without gradient to the teachers.
        """
        stacked = jnp.stack([jnp.asarray(t) for t in teacher_logits]).astype(
            jnp.float32
        )  # (K, ..., C)
        if stacked.shape[0] != len(self.weights):
            raise ShapeError(
                f"the ensemble has {len(self.weights)} weights but got "
                f"{stacked.shape[0]} teachers' logits"
            )
        stacked = jax.lax.stop_gradient(stacked)
        w = jnp.asarray(self.normalized_weights, jnp.float32)
        w = w.reshape((-1,) + (1,) * (stacked.ndim - 1))  # (K, 1, ..., 1)
        if self.mode == "logits":
            return jnp.sum(w * stacked, axis=0)  # (..., C)
        t = jnp.float32(self.temperature)
        logp = jax.nn.log_softmax(stacked / t, axis=-1)  # (K, ..., C)
        # log Σ_i w_i p_i; zero weights contribute exactly nothing
        log_mix = jax.scipy.special.logsumexp(logp, axis=0, b=w)  # (..., C)
        return t * log_mix

    def __call__(
        self,
        student_logits: jax.Array,
        teacher_logits: Sequence[jax.Array] | jax.Array,
        labels: jax.Array | None,
        alpha: float,
        *,
        ignore_index: int = IGNORE_INDEX,
        reduction: Reduction = "mean",
        where: jax.Array | None = None,
    ) -> jax.Array:
        """`distillation_loss` of the student against the ensemble's target."""
        return distillation_loss(
            student_logits,
            self.teacher_logits(teacher_logits),
            labels,
            self.temperature,
            alpha,
            ignore_index=ignore_index,
            reduction=reduction,
            where=where,
        )


__all__ = ["MODES", "EnsembleDistiller"]
