"""`entrenar.nn.linear` for `QuantizedWeight`: dequantize inside the computation.

Registered with `entrenar.nn.weight_matmul`, so any model that multiplies through
`entrenar.nn.linear` runs on quantized weights unchanged. Under `jax.jit` the blocks
are dequantized to ``x.dtype`` inside the compiled computation; only the packed codes
and scales live in memory between calls.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from entrenar.nn.linear import weight_matmul
from entrenar.quant.api import dequantize
from entrenar.quant.weight import QuantizedWeight


@weight_matmul.register(QuantizedWeight)
def quantized_matmul(w: QuantizedWeight, x: jax.Array) -> jax.Array:
    """``x Ŵᵀ`` with ``Ŵ = dequantize(w)`` in ``x``'s dtype; ``x: (..., in)``."""
    return jnp.einsum("...i,oi->...o", x, dequantize(w, x.dtype))  # (..., out)


__all__ = ["quantized_matmul"]
