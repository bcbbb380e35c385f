"""The one place every layer multiplies by a weight.

``linear(x, w, b)`` computes ``y = x Wᵀ + b`` with the weight in PyTorch / Hugging Face
layout ``W: (out_features, in_features)``. The multiplication dispatches on the type of
``w`` through `weight_matmul`, a `functools.singledispatch` function: a plain array is
a dense matmul; `entrenar.quant.QuantizedWeight` and `entrenar.lora.LoRAWeight`
register their own rules (dequantize block by block; ``x Wᵀ + s (x Aᵀ) Bᵀ``), so LoRA,
QLoRA and quantized models need no change to model code.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp


@functools.singledispatch
def weight_matmul(w: Any, x: jax.Array) -> jax.Array:
    """Return ``x Wᵀ`` for a dense weight ``w: (out, in)`` and ``x: (..., in)``.

    The weight is cast to ``x``'s dtype, so ``x`` sets the compute precision (mixed
    precision: parameters in float32, compute in bfloat16, or the other way round).
    Other weight node types register their own implementation with
    ``@weight_matmul.register(NodeType)``.
    """
    w = jnp.asarray(w)
    return jnp.einsum("...i,oi->...o", x, w.astype(x.dtype))  # (..., out)


def linear(x: jax.Array, w: Any, b: jax.Array | None = None) -> jax.Array:
    """Affine map ``y = x Wᵀ + b``.

    Args:
        x: inputs, shape ``(..., in)``.
        w: weight ``(out, in)``: an array or a registered weight node.
        b: optional bias ``(out,)``.

    Returns:
        ``(..., out)`` in ``x``'s dtype.

    Example:
        >>> import jax.numpy as jnp
        >>> linear(jnp.ones((2, 3)), jnp.ones((4, 3)), jnp.arange(4.0)).tolist()
        [[3.0, 4.0, 5.0, 6.0], [3.0, 4.0, 5.0, 6.0]]
    """
    y = weight_matmul(w, x)  # (..., out)
    if b is not None:
        y = y + jnp.asarray(b).astype(y.dtype)
    return y


__all__ = ["linear", "weight_matmul"]
