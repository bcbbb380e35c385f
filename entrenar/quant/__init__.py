"""Quantization: 4-bit and 8-bit formats as pytree nodes, QAT and PTQ.

Protocol: ``quantize(w, scheme) -> QuantizedWeight`` and ``dequantize(q) -> array`` are
pure and jittable; a `QuantizedWeight` is a pytree node holding packed codes and
scales with blocks along the last axis, so it stacks, slices and scans like an array,
and `entrenar.nn.linear` multiplies by it directly. ``from_ggml`` / ``to_ggml``
convert the llama.cpp formats (Q8_0, Q4_0, Q4_1) to and from GGUF bytes bit for bit.
"""

from entrenar.quant import linear as _linear  # registers nn.weight_matmul
from entrenar.quant.api import (
    dequantize,
    dequantize_params,
    is_quantized,
    quantize,
    quantize_params,
)
from entrenar.quant.ggml import from_ggml, to_ggml
from entrenar.quant.nf4 import NF4_CODE
from entrenar.quant.weight import SCHEMES, QuantizedWeight

del _linear

__all__ = [
    "NF4_CODE",
    "SCHEMES",
    "QuantizedWeight",
    "dequantize",
    "dequantize_params",
    "from_ggml",
    "is_quantized",
    "quantize",
    "quantize_params",
    "to_ggml",
]
