"""Quantization: 4-bit and 8-bit formats as pytree nodes, QAT and PTQ.

Protocol: ``quantize(w, scheme) -> QuantizedWeight`` and ``dequantize(q) -> array`` are
pure and jittable; a `QuantizedWeight` is a pytree node holding packed codes and
scales with blocks along the last axis, so it stacks, slices and scans like an array,
and `entrenar.nn.linear` multiplies by it directly. ``from_ggml`` / ``to_ggml``
convert the llama.cpp formats (Q8_0, Q4_0, Q4_1) to and from GGUF bytes bit for bit;
GGUF's K-quants, BF16 and F16 stay as stored in a `GGMLWeight` (frozen bases).
``fake_quant`` (straight-through gradients) serves QAT; ``calibrate`` / ``ptq`` serve
post-training quantization; ``memory_report`` counts bytes as stored.
"""

from entrenar.quant import ggml_head as _ggml_head  # registers nn.losses.head_nll
from entrenar.quant import linear as _linear  # registers nn.weight_matmul
from entrenar.quant.api import (
    dequantize,
    dequantize_params,
    is_quantized,
    quantize,
    quantize_like,
    quantize_params,
)
from entrenar.quant.ggml import from_ggml, to_ggml
from entrenar.quant.kquant import GGMLWeight
from entrenar.quant.nf4 import NF4_CODE
from entrenar.quant.ptq import Range, calibrate, ptq
from entrenar.quant.qat import fake_quant, fake_quant_range, round_ste
from entrenar.quant.report import MemoryReport, bits_per_param, memory_report
from entrenar.quant.weight import SCHEMES, QuantizedWeight

del _ggml_head, _linear

__all__ = [
    "NF4_CODE",
    "SCHEMES",
    "GGMLWeight",
    "MemoryReport",
    "QuantizedWeight",
    "Range",
    "bits_per_param",
    "calibrate",
    "dequantize",
    "dequantize_params",
    "fake_quant",
    "fake_quant_range",
    "from_ggml",
    "is_quantized",
    "memory_report",
    "ptq",
    "quantize",
    "quantize_like",
    "quantize_params",
    "round_ste",
    "to_ggml",
]
