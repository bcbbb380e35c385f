"""`entrenar.nn.linear` for `QuantizedWeight`: dequantize inside the computation.

Registered with `entrenar.nn.weight_matmul`, so any model that multiplies through
`entrenar.nn.linear` runs on quantized weights unchanged. Under `jax.jit` the blocks
are dequantized to ``x.dtype`` inside the compiled computation; only the packed codes
and scales live in memory between calls. With ``matmul_dtype="bfloat16"`` the blocks
are dequantized straight to bfloat16 and multiplied by `entrenar.nn.lowp_matmul`
(float32 accumulation); its backward pass dequantizes again instead of keeping the
dense matrix, so under a layer scan only one layer's dense matrix exists at a time.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from entrenar.nn.linear import lowp_matmul, weight_matmul
from entrenar.quant.api import dequantize
from entrenar.quant.weight import QuantizedWeight


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
    return jnp.einsum("...i,oi->...o", x, dequantize(w, x.dtype))  # (..., out)


__all__ = ["dequantized", "quantized_matmul"]
