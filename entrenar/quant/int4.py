"""Symmetric blockwise 4-bit integers (``int4``): absmax scale per block, codes -7..7.

Each block of ``B`` values along the last axis (default 64) stores a float32 scale
``d = max|x| / 7`` and codes ``q = clip(round(x / d), -7, 7)``; the value is
``x̂ = d q``, so ``|x - x̂| <= d / 2``. Codes are stored offset by 8 (``q + 8`` in
``[1, 15]``) and packed two a byte: 4 + 32 / B bits per value (4.5 for B = 64).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from entrenar.quant.weight import (
    QuantizedWeight,
    pack_nibbles,
    quotient,
    unpack_nibbles,
    validated_blocks,
)


def quantize_int4(w: Any, *, block_size: int = 64) -> QuantizedWeight:
    """Quantize ``w: (*lead, cols)`` to symmetric int4 blocks along the last axis.

    Raises:
        ShapeError: ``cols`` is not a multiple of ``block_size``.
        QuantizationError: ``w`` holds NaN or Inf (checked when ``w`` is concrete).
    """
    dtype = np.dtype(jnp.asarray(w).dtype)
    x = validated_blocks(w, block_size, "int4")  # (*lead, nb, B)
    d = quotient(jnp.max(jnp.abs(x), axis=-1), 7)  # (*lead, nb)
    inv = jnp.where(d == 0, jnp.float32(0), 1 / jnp.where(d == 0, 1, d))
    q = jnp.clip(jnp.round(x * inv[..., None]), -7, 7) + 8  # (*lead, nb, B) in [1, 15]
    return QuantizedWeight(
        pack_nibbles(q), d, scheme="int4", block_size=block_size, dtype=dtype
    )


def dequantize_int4(q: QuantizedWeight, dtype: Any) -> jax.Array:
    """Values ``d (code - 8)`` of an int4 node, ``(*lead, cols)`` in ``dtype``."""
    codes = unpack_nibbles(q.codes, q.block_size).astype(jnp.float32) - 8
    x = codes * q.scales.astype(jnp.float32)[..., None]  # (*lead, nb, B)
    return x.reshape(*x.shape[:-2], -1).astype(dtype)


__all__ = ["dequantize_int4", "quantize_int4"]
