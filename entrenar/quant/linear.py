"""`entrenar.nn.linear` for `QuantizedWeight`: dequantize inside the computation.

Registered with `entrenar.nn.weight_matmul`, so any model that multiplies through
`entrenar.nn.linear` runs on quantized weights unchanged. Under `jax.jit` the blocks
are dequantized to ``x.dtype`` inside the compiled computation; only the packed codes
and scales live in memory between calls. With ``matmul_dtype="bfloat16"`` the blocks
are dequantized straight to bfloat16 and multiplied by `entrenar.nn.lowp_matmul`
(float32 accumulation); its backward pass dequantizes again instead of keeping the
dense matrix, so under a layer scan only one layer's dense matrix exists at a time.

With few input rows (generation, small batches) the matmul is limited by the decode,
not the arithmetic, and a whole dequantized matrix (64 MiB for 4096 x 4096 float32)
is written to memory only to be read back once. There the weight is dequantized and
multiplied in blocks of output rows (`BLOCK_VALUES` values at a time), each block
used while it is in cache: NF4 with double quantization at 4096 x 4096, batch 16,
takes about 4x the float32 matmul instead of 8x (``benchmarks/quant.py``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp

from entrenar.nn.linear import lowp_matmul, weight_matmul
from entrenar.quant.api import dequantize
from entrenar.quant.nf4 import block_scales
from entrenar.quant.weight import QuantizedWeight

FEW_ROWS = 64
"""Input rows up to which a 2-d quantized weight is multiplied block by block."""

BLOCK_VALUES = 1 << 21
"""Weight values dequantized at a time on the few-rows path (8 MiB in float32)."""


def dequantized(w: QuantizedWeight, dtype: Any) -> jax.Array:
    """``dequantize(w, dtype)``: the materializer `lowp_matmul` calls."""
    return dequantize(w, dtype)


@weight_matmul.register(QuantizedWeight)
def quantized_matmul(
    w: QuantizedWeight, x: jax.Array, matmul_dtype: str | None = None
) -> jax.Array:
    """``x Ŵᵀ`` with ``Ŵ = dequantize(w)``; ``x: (..., in)``.

    ``Ŵ`` is in ``x``'s dtype, or in ``matmul_dtype`` (then float32 accumulation,
    result in ``x``'s dtype).
    """
    if matmul_dtype is not None:
        return lowp_matmul(x, w, matmul_dtype, dequantized)
    rows = _block_rows(w, math.prod(x.shape[:-1]))
    if rows:
        return _blockwise_matmul(w, x, rows)
    return jnp.einsum("...i,oi->...o", x, dequantize(w, x.dtype))  # (..., out)


def _block_rows(w: QuantizedWeight, n_inputs: int) -> int:
    """Output rows per block for the few-rows path, or 0 when it does not apply."""
    if n_inputs > FEW_ROWS or w.ndim != 2 or w.granularity != "block":
        return 0
    out, fan_in = w.shape
    rows = max(1, BLOCK_VALUES // fan_in)
    while out % rows:  # a divisor of ``out``, so every block has the same shape
        rows -= 1
    return rows if rows < out else 0  # one block: the plain path is the same


def _blockwise_matmul(w: QuantizedWeight, x: jax.Array, rows: int) -> jax.Array:
    """``x Ŵᵀ`` dequantizing ``rows`` output rows of ``w: (out, in)`` at a time."""
    out, fan_in = w.shape
    scales = block_scales(w)  # DQ resolved once: its int8 groups span blocks

    def split(a: Any) -> Any:  # (out, k) -> (out / rows, rows, k)
        return None if a is None else a.reshape(out // rows, rows, *a.shape[1:])

    blocks = dataclasses.replace(
        w,
        codes=split(w.codes),
        scales=split(scales),
        offsets=split(w.offsets),
        scale_scales=None,
        scale_offset=None,
    )
    xs = x.reshape(-1, fan_in)  # (n, in)

    def block_product(b: QuantizedWeight) -> jax.Array:
        return xs @ dequantize(b, x.dtype).T  # (n, rows)

    y = jax.lax.map(block_product, blocks)  # (out / rows, n, rows)
    return jnp.moveaxis(y, 0, 1).reshape(*x.shape[:-1], out)  # (..., out)


__all__ = ["BLOCK_VALUES", "FEW_ROWS", "dequantized", "quantized_matmul"]
