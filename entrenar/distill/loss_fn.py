"""A training loss function that runs a frozen teacher and the student in one step.

``make_distill_loss_fn(student, teacher, teacher_params, ...)`` returns a
`DistillLossFn`: ``loss_fn(params, batch, *, key) -> (loss, metrics)`` (the
conventions' signature, so the Trainer or any jitted loop runs it) over the tree::

    {"student": ..., "teacher": ... (a list for an ensemble), "projection": {...}}

built by ``loss_fn.init(student_params, key=...)``. The teacher is part of the params
(a jitted step takes it as an argument; closed over, XLA would fold its weights into the
program as constants) but it is frozen: its output passes through ``stop_gradient``, so
no backward pass runs through it, and ``loss_fn.trainable`` / ``loss_fn.split`` keep it
out of the optimizer. Its weights may be any weight nodes (`QuantizedWeight`,
`LoRAWeight`): the forward pass dispatches on them.

Batches follow the conventions: ``{"x", "y"}`` for classification (``y`` integer, -100
to skip), or ``{"input_ids", "labels", "attention_mask", "segment_ids",
"positions"}`` for causal language modelling (``labels`` aligned with the inputs,
shifted here: position ``t`` predicts ``labels[t + 1]``). Progressive distillation
needs the step, from the ``step`` keyword or ``batch["step"]``.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from entrenar.distill.ensemble import EnsembleDistiller
from entrenar.distill.logits import DistillationLoss, distillation_terms
from entrenar.distill.progressive import ProgressiveDistiller
from entrenar.errors import ConfigError
from entrenar.nn.losses import IGNORE_INDEX, segment_labels
from entrenar.types import Params, PRNGKey

TRAINABLE = ("student", "projection")


def hidden_widths(model: Any) -> tuple[int, ...]:
    """Width of each hidden state ``model.apply(..., return_hidden=True)`` returns.

    `entrenar.nn.MLP`: ``sizes[:-1]``; Llama-style configs: ``hidden_size`` for the
    embeddings and each of the ``num_layers`` layers.
    """
    sizes = getattr(model, "sizes", None)
    if sizes is not None:
        return tuple(int(s) for s in sizes[:-1])
    if hasattr(model, "hidden_size") and hasattr(model, "num_layers"):
        return (int(model.hidden_size),) * (int(model.num_layers) + 1)
    raise ConfigError(
        f"cannot tell the hidden-state widths of {type(model).__name__}; use an "
        "entrenar.nn MLP or LlamaConfig, or build the projection yourself with "
        "ProgressiveDistiller.init_projection"
    )


def _accepts(fn: Any, name: str) -> bool:
    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


@dataclasses.dataclass(frozen=True, eq=False)
class DistillLossFn:
    """``loss_fn(params, batch, *, key) -> (loss, metrics)`` for distillation.

    Build it with `make_distill_loss_fn`. Metrics: ``loss``, ``kl`` (the soft term
    before ``α T²``), ``ce`` (hard labels), ``loss_weight`` (the number of counted
    positions, by which the Trainer weighs batches) and, with a progressive
    distiller, ``hidden`` (the scheduled hidden-state term).

    Attributes:
        student: the student model (``apply(params, inputs, ...)``).
        teachers: the teacher model(s); one, or several for an ensemble.
        logit_loss: temperature, alpha and ignore_index.
        ensemble: how several teachers combine (None for one teacher).
        progressive: hidden-state matching (None for logits only).
        teacher_params: the frozen teacher params `init` puts in the tree.
    """

    student: Any
    teachers: tuple[Any, ...]
    logit_loss: DistillationLoss
    ensemble: EnsembleDistiller | None = None
    progressive: ProgressiveDistiller | None = None
    teacher_params: Any = dataclasses.field(default=None, repr=False)

    # ---------------------------------------------------------------- params
    def init(self, student_params: Params, *, key: PRNGKey) -> Params:
        """The whole tree: student, frozen teacher and (progressive) projections."""
        params: dict[str, Any] = {
            "student": student_params,
            "teacher": self.teacher_params,
        }
        if self.progressive is not None:
            params["projection"] = self.progressive.init_projection(
                hidden_widths(self.student), hidden_widths(self.teachers[0]), key=key
            )
        return params

    @staticmethod
    def trainable(name: str, leaf: Any) -> bool:
        """Optimizer mask predicate (`entrenar.optim.freeze`): all but the teacher."""
        return name.split(".", 1)[0] in TRAINABLE

    @staticmethod
    def split(params: Params) -> tuple[Params, Params]:
        """``(trainable, frozen)``: student and projections vs the teacher."""
        trainable = {k: v for k, v in params.items() if k in TRAINABLE}
        frozen = {k: v for k, v in params.items() if k not in TRAINABLE}
        return trainable, frozen

    @staticmethod
    def combine(trainable: Params, frozen: Params) -> Params:
        """Inverse of `split`."""
        return {**frozen, **trainable}

    # ----------------------------------------------------------------- apply
    def _forward(
        self, model: Any, params: Params, inputs: jax.Array, kwargs: dict[str, Any]
    ) -> tuple[jax.Array, Any]:
        hidden = self.progressive is not None
        out = model.apply(params, inputs, **kwargs, return_hidden=hidden)
        return out if hidden else (out, None)

    def _prepare(
        self, batch: Mapping[str, Any]
    ) -> tuple[jax.Array, jax.Array, dict[str, Any], bool]:
        """``(inputs, labels, model kwargs, causal)`` of a batch."""
        if "input_ids" in batch:
            inputs = jnp.asarray(batch["input_ids"])  # (B, T)
            labels = jnp.asarray(batch.get("labels", inputs))  # (B, T)
            kwargs: dict[str, Any] = {}
            if "attention_mask" in batch:
                kwargs["mask"] = jnp.asarray(batch["attention_mask"], bool)
            for name in ("segment_ids", "positions"):
                if name in batch:
                    kwargs[name] = jnp.asarray(batch[name])
            if "segment_ids" in kwargs:  # no target across packed documents
                labels = segment_labels(
                    labels, kwargs["segment_ids"],
                    ignore_index=self.logit_loss.ignore_index,
                )  # fmt: skip
            return inputs, labels, kwargs, True
        if "x" in batch and "y" in batch:
            return jnp.asarray(batch["x"]), jnp.asarray(batch["y"]), {}, False
        raise ConfigError(
            f"a distillation batch needs 'x' and 'y' (classification) or "
            f"'input_ids' (language modelling); got keys {sorted(batch)}"
        )

    def _targets(
        self, labels: jax.Array, where: Any, causal: bool
    ) -> tuple[jax.Array, Any, jax.Array]:
        """``(labels, where, counted)`` of the logit terms (shifted when causal)."""
        if causal:  # position t predicts labels[t + 1]
            labels, where = labels[:, 1:], None if where is None else where[:, 1:]
        else:
            where = None
        counted = labels != self.logit_loss.ignore_index
        return labels, where, counted if where is None else counted & where

    def counts(self, batch: Mapping[str, Any]) -> dict[str, jax.Array]:
        """What the terms are means over, from the batch alone (float32).

        ``targets``: the positions the logit terms count (labelled, unmasked,
        shifted); ``positions``: those the hidden term counts (unmasked: the
        attention mask's ones, else every token or example). The train step gives
        a micro-batch these counts of the whole batch as ``totals``
        (`entrenar.train.step.takes_totals`).
        """
        inputs, labels, kwargs, causal = self._prepare(batch)
        where = kwargs.get("mask")
        *_, counted = self._targets(labels, where, causal)
        if where is not None:
            positions = jnp.sum(where)
        else:  # a state per token (B, T) or per example (B, ...features)
            positions = jnp.asarray(inputs.size if causal else inputs.shape[0])
        return {
            "targets": jnp.sum(counted).astype(jnp.float32),
            "positions": positions.astype(jnp.float32),
        }

    def __call__(
        self,
        params: Params,
        batch: Mapping[str, Any],
        *,
        key: PRNGKey | None = None,
        step: Any = None,
        totals: Mapping[str, Any] | None = None,
    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        """The distillation loss of ``batch`` and its metrics.

        Each term is a sum over what it counts divided by its count (`counts`):
        ``(α T² ΣKL + (1 − α) ΣCE) / targets + β Σhidden / positions``.

        Args:
            params: the tree from `init`.
            batch: ``{"x", "y"}`` or ``{"input_ids", "labels", ...}``.
            key: dropout key for the student (the teacher runs without dropout).
            step: the training step (progressive schedule); else ``batch["step"]``.
            totals: `counts` of the whole batch this one is a micro-batch of; the
                loss and metrics are then this batch's shares of the whole batch's
                (they add up over the micro-batches). None: ``counts(batch)``.
        """
        if self.progressive is not None:
            step = batch.get("step") if step is None else step
            if step is None:
                raise ConfigError(
                    "progressive distillation needs the training step: pass "
                    "loss_fn(params, batch, key=key, step=step) or batch['step']"
                )
        inputs, labels, kwargs, causal = self._prepare(batch)
        own = self.counts(batch)
        totals = own if totals is None else totals
        teacher_tree = jax.lax.stop_gradient(params["teacher"])
        t_trees = teacher_tree if self.ensemble is not None else [teacher_tree]
        t_out = [
            self._forward(m, p, inputs, kwargs) for m, p in zip(self.teachers, t_trees)
        ]
        s_kwargs = dict(kwargs)
        if key is not None and _accepts(self.student.apply, "key"):
            s_kwargs["key"] = key
        s_logits, s_hidden = self._forward(
            self.student, params["student"], inputs, s_kwargs
        )
        if self.ensemble is not None:
            t_logits = self.ensemble.teacher_logits([lg for lg, _ in t_out])
        else:
            t_logits = t_out[0][0]
        where = kwargs.get("mask")
        if causal:  # position t predicts labels[t + 1]
            s_lg, t_lg = s_logits[:, :-1], t_logits[:, :-1]
        else:
            s_lg, t_lg = s_logits, t_logits
        lab, lg_where, _ = self._targets(labels, where, causal)
        lg = self.logit_loss
        kl, ce = distillation_terms(
            s_lg, t_lg, lab, lg.temperature, "sum",
            ignore_index=lg.ignore_index, where=lg_where,
        )  # fmt: skip
        per_target = 1.0 / jnp.maximum(jnp.asarray(totals["targets"], kl.dtype), 1.0)
        kl, ce = kl * per_target, ce * per_target
        a, temp = lg.alpha, lg.temperature
        loss = (
            jnp.asarray(a * temp**2, kl.dtype) * kl + jnp.asarray(1 - a, ce.dtype) * ce
        )
        metrics = {"kl": kl, "ce": ce}
        if self.progressive is not None:
            hidden = self.progressive.hidden_loss(
                s_hidden, t_out[0][1], params["projection"], step, where=where,
                reduction="sum",
            )  # fmt: skip
            count = jnp.asarray(totals["positions"], hidden.dtype)
            hidden = hidden / jnp.maximum(count, 1.0)
            loss = loss + jnp.asarray(self.progressive.weight, loss.dtype) * hidden
            metrics["hidden"] = hidden
        metrics["loss"] = loss
        # the Trainer weighs evaluation batches (and micro-batches) by it
        metrics["loss_weight"] = own["targets"]
        return loss, metrics


def make_distill_loss_fn(
    student: Any,
    teacher: Any,
    teacher_params: Params,
    *,
    temperature: float = 2.0,
    alpha: float = 0.5,
    ignore_index: int = IGNORE_INDEX,
    ensemble_weights: Sequence[float] | None = None,
    ensemble_mode: str = "probs",
    progressive: ProgressiveDistiller | Mapping[str, Any] | None = None,
) -> DistillLossFn:
    """A `DistillLossFn` from plain values (what a YAML config holds).

    Args:
        student: the student model (an `entrenar.nn` model config).
        teacher: the teacher model, or a sequence of them for an ensemble.
        teacher_params: its params (frozen; may be quantized or LoRA-adapted), or a
            sequence matching ``teacher``.
        temperature: ``T`` of the soft targets.
        alpha: weight of the soft term.
        ignore_index: label value that counts in no term.
        ensemble_weights: one weight per teacher (default: equal).
        ensemble_mode: "probs" or "logits" (see `EnsembleDistiller`).
        progressive: a `ProgressiveDistiller` or the mapping of its fields.

    Example:
        >>> from entrenar.nn import MLP
        >>> t, s = MLP((4, 16, 3)), MLP((4, 8, 3))
        >>> loss_fn = make_distill_loss_fn(s, t, t.init(jax.random.key(0)))
        >>> params = loss_fn.init(s.init(jax.random.key(1)), key=jax.random.key(2))
        >>> batch = {"x": jnp.ones((2, 4)), "y": jnp.array([0, 2])}
        >>> loss, metrics = loss_fn(params, batch, key=jax.random.key(3))
        >>> sorted(metrics)
        ['ce', 'kl', 'loss', 'loss_weight']
    """
    logit_loss = DistillationLoss(temperature, alpha, ignore_index)
    if isinstance(teacher, (list, tuple)):
        if not isinstance(teacher_params, (list, tuple)) or len(teacher_params) != len(
            teacher
        ):
            raise ConfigError(
                f"{len(teacher)} teachers need a list of as many teacher params"
            )
        weights = ensemble_weights or (1.0,) * len(teacher)
        if len(weights) != len(teacher):
            raise ConfigError(
                f"{len(weights)} ensemble weights for {len(teacher)} teachers"
            )
        ensemble: EnsembleDistiller | None = EnsembleDistiller(
            tuple(weights), temperature, ensemble_mode
        )
        teachers, teacher_params = tuple(teacher), list(teacher_params)
    else:
        if ensemble_weights is not None:
            raise ConfigError("ensemble_weights need a list of teachers")
        ensemble, teachers = None, (teacher,)
    if isinstance(progressive, Mapping):
        progressive = ProgressiveDistiller(**progressive)
    if progressive is not None and ensemble is not None:
        raise ConfigError(
            "progressive (hidden-state) distillation takes one teacher, not an ensemble"
        )
    return DistillLossFn(
        student, teachers, logit_loss, ensemble, progressive, teacher_params
    )


__all__ = ["TRAINABLE", "DistillLossFn", "hidden_widths", "make_distill_loss_fn"]
