"""The bridge from LoRA to `entrenar.quant`: quantize bases, requantize merges."""

from __future__ import annotations

from typing import Any

from entrenar import quant
from entrenar.errors import ShapeError
from entrenar.lora.config import BASE_BLOCK
from entrenar.quant.ggml_mixed import MixedGGMLWeight
from entrenar.quant.weight import check_blocks


def quantize_base(w: Any, scheme: str, name: str) -> Any:
    """``w`` as a `QuantizedWeight` (NF4 with double quantization).

    Kept as it is when already quantized: a `QuantizedWeight`, or a GGUF base kept in
    its file's type (`entrenar.quant.GGMLWeight`: Q4_K, Q6_K, BF16, ...; a
    `MixedGGMLWeight`: layers of different types, as llama.cpp's Q4_K_M).
    """
    if quant.is_quantized(w) or isinstance(w, (quant.GGMLWeight, MixedGGMLWeight)):
        return w
    try:
        return quant.quantize(
            w, scheme, block_size=BASE_BLOCK, double_quant=scheme == "nf4"
        )
    except ShapeError as e:
        raise ShapeError(f"QLoRA cannot quantize the base of {name!r}: {e}") from e


def divides(shape: tuple[int, ...], scheme: str) -> bool:
    """Whether `quantize_base` splits a weight of ``shape`` into whole blocks."""
    try:
        check_blocks(shape, BASE_BLOCK, scheme)
    except ShapeError:
        return False
    return True


is_quantized = quant.is_quantized
requantize_like = quant.quantize_like  # every option of the node, int8 modes included

__all__ = ["divides", "is_quantized", "quantize_base", "requantize_like"]
