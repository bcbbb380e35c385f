"""The bridge from LoRA to `entrenar.quant`: quantize bases, dequantize for merges."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from entrenar import quant
from entrenar.errors import ShapeError


def quantize_base(w: Any, scheme: str, name: str) -> Any:
    """``w`` as a `QuantizedWeight` (NF4 with double quantization); kept if already."""
    if quant.is_quantized(w):
        return w
    try:
        return quant.quantize(w, scheme, double_quant=scheme == "nf4")
    except ShapeError as e:
        raise ShapeError(f"QLoRA cannot quantize the base of {name!r}: {e}") from e


def to_dense(w: Any) -> jax.Array:
    """A weight as a dense array (quantized nodes are dequantized)."""
    return quant.dequantize(w) if quant.is_quantized(w) else jnp.asarray(w)


def requantize_like(w: jax.Array, like: Any) -> Any:
    """Quantize ``w`` like ``like``: same scheme, block size, double quantization."""
    return quant.quantize(
        w, like.scheme, block_size=like.block_size, double_quant=like.double_quant
    )


is_quantized = quant.is_quantized

__all__ = ["is_quantized", "quantize_base", "requantize_like", "to_dense"]
