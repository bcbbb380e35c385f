"""`trainable_report`: trainable and frozen parameters and the bytes they take."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax

from entrenar.lora.weight import LoRAWeight
from entrenar.nn.weight_node import is_weight_node, logical_shape, nbytes
from entrenar.types import Params


def _count(x: Any) -> tuple[int, int]:
    """``(parameters, bytes)`` of one leaf or weight node (arrays or shape structs).

    A weight node (``QuantizedWeight``) counts its logical values as parameters and
    the bytes of every array it stores.
    """
    if x is None:
        return 0, 0
    return math.prod(logical_shape(x)), nbytes(x)


@dataclasses.dataclass(frozen=True)
class TrainableReport:
    """Parameter counts and stored bytes of an adapted tree.

    Attributes:
        trainable_params: values in the adapters ``A``, ``B``.
        frozen_params: logical values of every other weight (a quantized base counts
            ``out · in`` values).
        trainable_bytes: bytes of the adapters.
        frozen_bytes: bytes of everything else, as stored (packed codes, scales).
    """

    trainable_params: int
    frozen_params: int
    trainable_bytes: int
    frozen_bytes: int

    @property
    def total_params(self) -> int:
        """All parameters."""
        return self.trainable_params + self.frozen_params

    @property
    def total_bytes(self) -> int:
        """All bytes."""
        return self.trainable_bytes + self.frozen_bytes

    @property
    def trainable_fraction(self) -> float:
        """``trainable_params / total_params``."""
        return self.trainable_params / max(self.total_params, 1)

    @property
    def frozen_bits_per_param(self) -> float:
        """Stored bits per frozen parameter (32 for float32, ~4.13 for NF4 + DQ)."""
        return 8.0 * self.frozen_bytes / max(self.frozen_params, 1)

    def __str__(self) -> str:
        return (
            f"trainable params: {self.trainable_params:,} || all params: "
            f"{self.total_params:,} || trainable%: {100 * self.trainable_fraction:.4f}"
            f"\ntrainable bytes: {self.trainable_bytes:,} || frozen bytes: "
            f"{self.frozen_bytes:,} ({self.frozen_bits_per_param:.3f} bits/param)"
        )


def trainable_report(params: Params) -> TrainableReport:
    """Count trainable (adapter) and frozen parameters and bytes.

    Works on arrays and on ``jax.ShapeDtypeStruct`` trees (``jax.eval_shape`` of
    ``lora.apply``), so a large model can be sized without allocating it. Dropout
    keys are not parameters and are not counted. With per-layer ranks the
    parameters are the real ones, ``Σ_i r_i (in + out)`` (as PEFT counts them),
    and the bytes are those stored, padding included (specs/lora.md).

    Example:
        >>> import jax.numpy as jnp
        >>> w = LoRAWeight(jnp.zeros((4, 3)), jnp.zeros((2, 3)), jnp.zeros((4, 2)),
        ...                alpha=4, rank=2)
        >>> r = trainable_report({"w": w, "b": jnp.zeros(4)})
        >>> r.trainable_params, r.frozen_params, r.trainable_bytes, r.frozen_bytes
        (14, 16, 56, 64)
    """
    tp = fp = tb = fb = 0
    for x in jax.tree_util.tree_leaves(params, is_leaf=is_weight_node):
        if isinstance(x, LoRAWeight):
            for part in (x.a, x.b, x.magnitude):  # DoRA's m counts (None: 0)
                n, b = _count(part)
                tp, tb = tp + n, tb + b
            tp -= _padding(x)
            n, b = _count(x.base)
        else:
            n, b = _count(x)
        fp, fb = fp + n, fb + b
    return TrainableReport(tp, fp, tb, fb)


def _padding(x: LoRAWeight) -> int:
    """Entries of ``A`` and ``B`` past each layer's rank (zero with per-layer ranks)."""
    if not x.per_layer:
        return 0
    ref = x.a if x.a is not None else x.b
    out, fan_in = x.shape[-2], x.shape[-1]
    if ref is None:
        return 0
    return sum(x.rank - r for r in x.real_ranks()) * (
        (fan_in if x.a is not None else 0) + (out if x.b is not None else 0)
    )


__all__ = ["TrainableReport", "trainable_report"]
