"""The bridge from LoRA to `entrenar.quant`: quantize bases, dequantize for merges."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from entrenar import quant
from entrenar.errors import ShapeError
from entrenar.nn.bf16_weight import Bfloat16Weight


def quantize_base(w: Any, scheme: str, name: str) -> Any:
    """``w`` as a `QuantizedWeight` (NF4 with double quantization); kept if already."""
    if quant.is_quantized(w):
        return w
    try:
        return quant.quantize(w, scheme, double_quant=scheme == "nf4")
    except ShapeError as e:
        raise ShapeError(f"QLoRA cannot quantize the base of {name!r}: {e}") from e


def to_dense(w: Any) -> jax.Array:
    """A weight as a dense array (quantized nodes dequantized, bfloat16 ones read)."""
    if isinstance(w, Bfloat16Weight):
        return w.value()
    return quant.dequantize(w) if quant.is_quantized(w) else jnp.asarray(w)


is_quantized = quant.is_quantized
requantize_like = quant.quantize_like  # every option of the node, int8 modes included

__all__ = ["is_quantized", "quantize_base", "requantize_like", "to_dense"]
