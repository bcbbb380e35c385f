"""The distillation loss on logits (Hinton, Vinyals & Dean, 2015).

With temperature ``T``, mixing weight ``α``, student logits ``s``, teacher logits ``t``
and hard labels ``y``, for each counted position::

    p = softmax(t / T)        q = softmax(s / T)
    L = α · T² · KL(p ‖ q) + (1 − α) · CE(s, y)

``KL(p ‖ q) = Σ_c p_c (log p_c − log q_c)`` and ``CE(s, y) = −log softmax(s)[y]`` (at
temperature 1). The ``T²`` factor keeps the soft term's gradient, which scales as
``1/T²``, comparable across temperatures. Both terms come from `entrenar.nn.losses`
(stable log-softmax, float32 compute) and are averaged over the same positions: those
whose label is not ``ignore_index`` and where ``where`` is True. Gradients reach the
student only; the teacher's logits are wrapped in ``stop_gradient``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from entrenar.errors import ConfigError, ShapeError
from entrenar.nn.losses import IGNORE_INDEX, Reduction, cross_entropy, kl_divergence


def soft_targets(logits: jax.Array, temperature: float = 1.0) -> jax.Array:
    """``softmax(logits / T)`` along the last axis, in float32.

    >>> [round(float(p), 3) for p in soft_targets(jnp.array([2.0, 1.0, 0.1]), 3.0)]
    [0.445, 0.319, 0.236]
    """
    _check_temperature(temperature)
    z = jnp.asarray(logits, jnp.float32)
    return jax.nn.softmax(z / jnp.float32(temperature), axis=-1)


def _check_temperature(temperature: float) -> None:
    if not (isinstance(temperature, (int, float)) and temperature > 0):
        raise ConfigError(f"distillation temperature must be > 0, got {temperature!r}")


def _check_alpha(alpha: float) -> None:
    if not (isinstance(alpha, (int, float)) and 0.0 <= alpha <= 1.0):
        raise ConfigError(f"distillation alpha must lie in [0, 1], got {alpha!r}")


def _valid(
    logits: jax.Array, labels: jax.Array | None, ignore_index: int, where: Any
) -> jax.Array:
    """Bool ``logits.shape[:-1]``: the positions both terms count."""
    valid = jnp.ones(logits.shape[:-1], bool)
    if labels is not None:
        valid = valid & (jnp.asarray(labels) != ignore_index)
    if where is not None:
        valid = valid & jnp.broadcast_to(jnp.asarray(where, bool), valid.shape)
    return valid


def distillation_terms(
    student_logits: jax.Array,
    teacher_logits: jax.Array,
    labels: jax.Array | None,
    temperature: float,
    reduction: Reduction = "mean",
    *,
    ignore_index: int = IGNORE_INDEX,
    where: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """The two terms ``(KL(p ‖ q), CE(s, y))`` before weighting, reduced alike.

    ``labels=None`` gives a zero CE term (distillation on unlabelled data).
    See `distillation_loss` for the arguments.
    """
    _check_temperature(temperature)
    if tuple(student_logits.shape) != tuple(teacher_logits.shape):
        raise ShapeError(
            f"student logits {tuple(student_logits.shape)} and teacher logits "
            f"{tuple(teacher_logits.shape)} must have the same shape (same classes / "
            "vocabulary)"
        )
    # one compute dtype for both (a float32 teacher may teach a float64 student)
    dtypes = (jnp.asarray(student_logits).dtype, jnp.asarray(teacher_logits).dtype)
    dtype = jnp.float64 if jnp.dtype(jnp.float64) in dtypes else jnp.float32
    student_logits = jnp.asarray(student_logits, dtype)
    teacher_logits = jax.lax.stop_gradient(jnp.asarray(teacher_logits, dtype))
    valid = _valid(student_logits, labels, ignore_index, where)  # (...)
    kl = kl_divergence(
        student_logits, teacher_logits, temperature, reduction, where=valid
    )
    if labels is None:
        return kl, jnp.zeros_like(kl)
    ce = cross_entropy(
        student_logits, labels, reduction, ignore_index=ignore_index, where=valid
    )
    return kl, ce


def distillation_loss(
    student_logits: jax.Array,
    teacher_logits: jax.Array,
    labels: jax.Array | None,
    temperature: float,
    alpha: float,
    *,
    ignore_index: int = IGNORE_INDEX,
    reduction: Reduction = "mean",
    where: jax.Array | None = None,
) -> jax.Array:
    """``α · T² · KL(softmax(t/T) ‖ softmax(s/T)) + (1 − α) · CE(s, y)``.

    Args:
        student_logits: ``(..., C)``, differentiated.
        teacher_logits: ``(..., C)``, treated as constants (``stop_gradient``).
        labels: integer ``(...)`` hard targets, ``ignore_index`` where no loss is
            counted (padding, prompts); None only with ``alpha = 1``.
        temperature: ``T > 0``.
        alpha: weight ``α ∈ [0, 1]`` of the soft (teacher) term.
        ignore_index: label value to leave out of both terms.
        reduction: "mean" over the counted positions, "sum", or "none" (``(...)``,
            zero where not counted).
        where: optional bool ``(...)``, False to leave a position out.

    Returns:
        The loss in float32 (float64 for float64 inputs).

    Example:
        >>> s = jnp.array([[2.0, 1.0, 0.1]])
        >>> float(distillation_loss(s, s, None, temperature=3.0, alpha=1.0))
        0.0
    """
    _check_alpha(alpha)
    if labels is None and alpha != 1.0:
        raise ConfigError(
            f"distillation without labels needs alpha = 1 (got alpha={alpha}): the "
            "hard-label term needs labels"
        )
    kl, ce = distillation_terms(
        student_logits,
        teacher_logits,
        labels,
        temperature,
        reduction,
        ignore_index=ignore_index,
        where=where,
    )
    soft = jnp.asarray(alpha * temperature**2, kl.dtype)
    return soft * kl + jnp.asarray(1.0 - alpha, ce.dtype) * ce


@dataclasses.dataclass(frozen=True)
class DistillationLoss:
    """`distillation_loss` with its temperature and mixing weight bound (the book's).

    Attributes:
        temperature: ``T > 0``; 1 is plain softmax, larger values soften both
            distributions (Hinton et al. used 1 to 20; 2 to 5 is common).
        alpha: weight ``α ∈ [0, 1]`` of the soft term; ``1 − α`` goes to the labels.
        ignore_index: label value that counts in neither term.

    Example:
        >>> loss = DistillationLoss(temperature=2.0, alpha=0.5)
        >>> s, t = jnp.zeros((4, 10)), jnp.ones((4, 10))
        >>> round(float(loss(s, t, jnp.arange(4))), 4)  # uniform vs uniform: CE/2
        1.1513
    """

    temperature: float = 2.0
    alpha: float = 0.5
    ignore_index: int = IGNORE_INDEX

    def __post_init__(self) -> None:
        _check_temperature(self.temperature)
        _check_alpha(self.alpha)

    def __call__(
        self,
        student_logits: jax.Array,
        teacher_logits: jax.Array,
        labels: jax.Array | None,
        *,
        reduction: Reduction = "mean",
        where: jax.Array | None = None,
    ) -> jax.Array:
        """The loss for these logits and labels (see `distillation_loss`)."""
        return distillation_loss(
            student_logits,
            teacher_logits,
            labels,
            self.temperature,
            self.alpha,
            ignore_index=self.ignore_index,
            reduction=reduction,
            where=where,
        )

    def terms(
        self,
        student_logits: jax.Array,
        teacher_logits: jax.Array,
        labels: jax.Array | None,
        *,
        where: jax.Array | None = None,
    ) -> tuple[jax.Array, jax.Array]:
        """The mean ``(KL, CE)`` terms, for logging."""
        return distillation_terms(
            student_logits,
            teacher_logits,
            labels,
            self.temperature,
            ignore_index=self.ignore_index,
            where=where,
        )


__all__ = [
    "DistillationLoss",
    "distillation_loss",
    "distillation_terms",
    "soft_targets",
]
