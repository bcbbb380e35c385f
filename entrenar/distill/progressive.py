"""Progressive layer-wise distillation: student hidden states matched to the teacher's.

Chosen pairs ``(i_k, j_k)``, ``k = 0..P-1``, ordered from lower to upper layers, match
the student's hidden state ``h^s_{i_k}`` to the teacher's ``h^t_{j_k}`` (FitNets,
Romero et al., 2015; TinyBERT, Jiao et al., 2020). When the widths differ, a learned
projection ``W_k: (D_t, D_s)`` maps the student's state first, ``u = h^s W_kᵀ``
(its parameters are part of the trainable tree, ``params["projection"]["k"]``).
Per pair, averaged over the counted positions::

    mse:     ℓ_k = mean_d (u_d − h^t_d)²
    cosine:  ℓ_k = 1 − ⟨u, h^t⟩ / (‖u‖ ‖h^t‖)

The schedule moves up the pairs: at step ``n`` the stage is
``m = min(n // stage_steps, P − 1)``; with ``cumulative`` the pairs ``k ≤ m`` are
active, otherwise only ``k = m`` (the lower layers are learnt first, as in progressive
knowledge transfer, Sun et al., 2020). The hidden term is the mean of the active pairs'
losses, and the total loss is ``logit_loss + β · hidden``.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from entrenar.errors import ConfigError, ShapeError
from entrenar.nn.init import xavier_uniform
from entrenar.nn.linear import linear
from entrenar.nn.losses import mse, reduce_loss
from entrenar.types import Params, PRNGKey

HIDDEN_LOSSES = ("mse", "cosine")


def _float(x: Any) -> jax.Array:
    """``x`` as float32, or float64 when it already is (as in `entrenar.nn.losses`)."""
    x = jnp.asarray(x)
    return x if x.dtype == jnp.float64 else x.astype(jnp.float32)


@dataclasses.dataclass(frozen=True)
class ProgressiveDistiller:
    """Hidden-state matching with a lower-to-upper schedule.

    Attributes:
        student_layers: indices into the student's hidden states (strictly
            increasing), e.g. ``(1, 2)``.
        teacher_layers: as many indices into the teacher's hidden states
            (increasing), e.g. ``(10, 20)``.
        loss: "mse" or "cosine".
        stage_steps: steps spent on each stage before the next pair joins.
        cumulative: keep the lower pairs active once the schedule moved on.
        weight: ``β``, the hidden term's weight next to the logit loss.

    Example:
        >>> pd = ProgressiveDistiller((1, 2), (2, 4), stage_steps=100)
        >>> pd.pair_weights(150).tolist()
        [1.0, 1.0]
    """

    student_layers: tuple[int, ...]
    teacher_layers: tuple[int, ...]
    loss: str = "mse"
    stage_steps: int = 100
    cumulative: bool = True
    weight: float = 1.0

    def __post_init__(self) -> None:
        s = tuple(int(i) for i in self.student_layers)
        t = tuple(int(i) for i in self.teacher_layers)
        object.__setattr__(self, "student_layers", s)
        object.__setattr__(self, "teacher_layers", t)
        if not s or len(s) != len(t):
            raise ConfigError(
                f"progressive distillation needs as many student layers {s} as "
                f"teacher layers {t}, at least one"
            )
        for name, idx in (("student_layers", s), ("teacher_layers", t)):
            if min(idx) < 0 or any(b <= a for a, b in itertools.pairwise(idx)):
                raise ConfigError(
                    f"{name} {idx} must be non-negative and strictly increasing "
                    "(the schedule goes from lower to upper layers)"
                )
        if self.loss not in HIDDEN_LOSSES:
            raise ConfigError(
                f"hidden-state loss {self.loss!r} is not one of {HIDDEN_LOSSES}"
            )
        if int(self.stage_steps) < 1:
            raise ConfigError(f"stage_steps must be >= 1, got {self.stage_steps}")
        if not self.weight >= 0:
            raise ConfigError(f"hidden-state weight must be >= 0, got {self.weight}")

    @property
    def num_pairs(self) -> int:
        """``P``, the number of matched pairs."""
        return len(self.student_layers)

    def stage(self, step: Any) -> jax.Array:
        """``min(step // stage_steps, P − 1)`` (int32; ``step`` may be traced)."""
        n = jnp.asarray(step, jnp.int32)
        return jnp.minimum(n // jnp.int32(self.stage_steps), self.num_pairs - 1)

    def pair_weights(self, step: Any) -> jax.Array:
        """``(P,)`` float32: 1 for the pairs active at ``step``, else 0."""
        k = jnp.arange(self.num_pairs, dtype=jnp.int32)
        m = self.stage(step)
        active = k <= m if self.cumulative else k == m
        return active.astype(jnp.float32)

    def init_projection(
        self,
        student_widths: Sequence[int],
        teacher_widths: Sequence[int],
        *,
        key: PRNGKey,
    ) -> Params:
        """Projections for the pairs whose widths differ, ``{"k": {"weight": ...}}``.

        Args:
            student_widths: the width of each of the student's hidden states.
            teacher_widths: the width of each of the teacher's hidden states.
            key: for the Xavier-uniform initialisation.
        """
        out: dict[str, Any] = {}
        for k, (i, j) in enumerate(zip(self.student_layers, self.teacher_layers)):
            for name, idx, widths in (
                ("student", i, student_widths),
                ("teacher", j, teacher_widths),
            ):
                if idx >= len(widths):
                    raise ConfigError(
                        f"{name} layer {idx} is out of range: the {name} has "
                        f"{len(widths)} hidden states (0..{len(widths) - 1})"
                    )
            ds, dt = int(student_widths[i]), int(teacher_widths[j])
            if ds != dt:
                w = xavier_uniform((dt, ds), key=jax.random.fold_in(key, k))
                out[str(k)] = {"weight": w}  # (D_t, D_s)
        return out

    def pair_losses(
        self,
        student_hidden: Any,
        teacher_hidden: Any,
        projection: Params,
        *,
        where: jax.Array | None = None,
        reduction: str = "mean",
    ) -> jax.Array:
        """``(P,)``: each pair's loss, averaged over the counted positions (float32).

        Args:
            student_hidden: indexable by layer (a tuple of arrays or an array
                ``(L + 1, ..., D_s)``); each state ``(..., D_s)``.
            teacher_hidden: likewise, ``(..., D_t)``; no gradient reaches it.
            projection: from `init_projection` (``{}`` when all widths agree).
            where: optional bool over the states' leading axes, False to leave a
                position out (padding).
            reduction: "mean" over the counted positions, or "sum" (a
                micro-batch's part of a mean over a whole batch).
        """
        losses = []
        for k, (i, j) in enumerate(zip(self.student_layers, self.teacher_layers)):
            hs = _float(student_hidden[i])  # (..., D_s)
            ht = jax.lax.stop_gradient(_float(teacher_hidden[j])).astype(hs.dtype)
            if str(k) in projection:
                hs = linear(hs, projection[str(k)]["weight"])  # (..., D_t)
            if hs.shape != ht.shape:
                raise ShapeError(
                    f"pair {k}: student hidden state {i} {tuple(hs.shape)} and teacher "
                    f"hidden state {j} {tuple(ht.shape)} do not match; widths that "
                    "differ need init_projection"
                )
            mask = None
            if where is not None:
                mask = jnp.broadcast_to(jnp.asarray(where, bool), hs.shape[:-1])
            if self.loss == "mse":
                per_pos = jnp.mean(mse(hs, ht, "none"), axis=-1)  # (...)
            else:
                eps = jnp.asarray(1e-8, hs.dtype)
                dot = jnp.sum(hs * ht, axis=-1)
                norms = jnp.linalg.norm(hs, axis=-1) * jnp.linalg.norm(ht, axis=-1)
                per_pos = 1.0 - dot / jnp.maximum(norms, eps)  # (...)
            losses.append(reduce_loss(per_pos, reduction, where=mask))
        return jnp.stack(losses)  # (P,)

    def hidden_loss(
        self,
        student_hidden: Any,
        teacher_hidden: Any,
        projection: Params,
        step: Any,
        *,
        where: jax.Array | None = None,
        reduction: str = "mean",
    ) -> jax.Array:
        """The scheduled hidden term: mean of the active pairs' losses at ``step``.

        ``reduction``: of each pair's loss over the positions (`pair_losses`).
        """
        per_pair = self.pair_losses(
            student_hidden, teacher_hidden, projection, where=where,
            reduction=reduction,
        )  # fmt: skip
        w = self.pair_weights(step).astype(per_pair.dtype)  # (P,)
        return jnp.sum(w * per_pair) / jnp.maximum(jnp.sum(w), 1.0)


__all__ = ["HIDDEN_LOSSES", "ProgressiveDistiller"]
