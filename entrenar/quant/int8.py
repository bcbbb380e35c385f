"""8-bit integers: symmetric or asymmetric, per tensor, per channel or per block.

A group of values (a block of ``B`` along the last axis, a channel, or a whole matrix)
shares one float32 scale::

    symmetric:   d = max|x| / 127,            q = clip(round(x / d), -127, 127)  (int8)
                 x̂ = d q
    asymmetric:  lo = min(min x, 0), hi = max(max x, 0), d = (hi - lo) / 255,
                 z = clip(round(-lo / d), 0, 255),
                 q = clip(round(x / d) + z, 0, 255)                             (uint8)
                 x̂ = d (q - z)

(the asymmetric range always contains 0, so zero is exact: PyTorch's ``quint8``).
In both cases ``|x - x̂| <= d / 2``. ``1 / d`` is 0 when ``d == 0``.

Granularity: ``"block"`` (scales ``(*lead, cols // B)``), ``"channel"`` (one scale per
index of ``axis``: the reduction runs over the other of the last two axes, scales keep
the tensor's rank with size-1 axes) or ``"tensor"`` (one scale per matrix, i.e. per
index of any leading axes, so stacked layers keep their own scales; a leading channel
axis therefore means ``"tensor"``).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from entrenar.errors import ConfigError, ShapeError
from entrenar.quant.weight import (
    QuantizedWeight,
    as_float,
    check_blocks,
    check_finite,
    quotient,
)

GRANULARITIES = ("block", "channel", "tensor")


def _reduce_axes(
    shape: tuple[int, ...], granularity: str, axis: int
) -> tuple[int, ...]:
    """Axes that share one scale for per-channel / per-tensor quantization."""
    ndim = len(shape)
    matrix = tuple(range(max(ndim - 2, 0), ndim))
    if granularity == "tensor":
        return matrix
    if ndim < 2:
        raise ShapeError(f"per-channel int8 needs a matrix, got shape {shape}")
    ax = axis + ndim if axis < 0 else axis
    if not 0 <= ax < ndim:
        raise ShapeError(f"channel axis {axis} is out of range for shape {shape}")
    return tuple(a for a in matrix if a != ax)


def quantize_int8(
    w: Any,
    *,
    symmetric: bool = True,
    granularity: str = "channel",
    axis: int = -2,
    block_size: int = 64,
) -> QuantizedWeight:
    """Quantize ``w`` to 8-bit integers.

    Args:
        w: tensor ``(*lead, cols)``.
        symmetric: int8 codes around 0, else uint8 codes with a zero point.
        granularity: ``"block"``, ``"channel"`` or ``"tensor"``.
        axis: the channel axis for ``"channel"`` (default ``-2``, the output rows of
            a ``(out, in)`` weight).
        block_size: values per block for ``"block"``.

    Raises:
        ConfigError: unknown granularity.
        ShapeError: blocks or axis that do not fit the shape.
        QuantizationError: ``w`` holds NaN or Inf (checked when ``w`` is concrete).
    """
    if granularity not in GRANULARITIES:
        raise ConfigError(
            f"int8 granularity must be one of {GRANULARITIES}, got {granularity!r}"
        )
    dtype = np.dtype(jnp.asarray(w).dtype)
    shape = tuple(np.shape(w))
    x = as_float(w)
    if granularity == "block":
        check_blocks(shape, block_size, "int8")
        x = x.reshape(*shape[:-1], shape[-1] // block_size, block_size)
        axes: tuple[int, ...] = (x.ndim - 1,)
    else:
        axes = _reduce_axes(shape, granularity, axis)
        block_size = shape[-1]
        if len(axes) == 2:  # a leading channel axis: one scale per matrix
            granularity = "tensor"
    check_finite(w, "int8")
    if symmetric:
        d = quotient(jnp.max(jnp.abs(x), axis=axes, keepdims=True), 127)
        inv = jnp.where(d == 0, jnp.float32(0), 1 / jnp.where(d == 0, 1, d))
        q = jnp.clip(jnp.round(x * inv), -127, 127).astype(jnp.int8)
        z = None
    else:
        lo = jnp.minimum(jnp.min(x, axis=axes, keepdims=True), 0)
        hi = jnp.maximum(jnp.max(x, axis=axes, keepdims=True), 0)
        d = quotient(hi - lo, 255)
        inv = jnp.where(d == 0, jnp.float32(0), 1 / jnp.where(d == 0, 1, d))
        zf = jnp.clip(jnp.round(-lo / jnp.where(d == 0, 1, d)), 0, 255)  # 0 if d=0
        q = jnp.clip(jnp.round(x * inv) + zf, 0, 255).astype(jnp.uint8)
        z = zf.astype(jnp.uint8)
    if granularity == "block":  # drop the block axis: (*lead, cols), (*lead, nb)
        q = q.reshape(shape)
        d = d[..., 0]
        z = None if z is None else z[..., 0]
    return QuantizedWeight(
        q,
        d,
        z,
        scheme="int8",
        block_size=block_size,
        dtype=dtype,
        granularity=granularity,
    )


def dequantize_int8(q: QuantizedWeight, dtype: Any) -> jax.Array:
    """Values ``d (q - z)`` of an int8 node, ``q.shape`` in ``dtype``."""
    codes = q.codes.astype(jnp.float32)
    d = q.scales.astype(jnp.float32)
    z = None if q.offsets is None else q.offsets.astype(jnp.float32)
    if q.granularity == "block":  # (*lead, nb, B) against (*lead, nb, 1)
        codes = codes.reshape(*codes.shape[:-1], -1, q.block_size)
        d = d[..., None]
        z = None if z is None else z[..., None]
    x = (codes if z is None else codes - z) * d
    return x.reshape(q.codes.shape).astype(dtype)


__all__ = ["GRANULARITIES", "dequantize_int8", "quantize_int8"]
