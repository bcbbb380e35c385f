"""The one place every layer multiplies by a weight.

``linear(x, w, b)`` computes ``y = x Wᵀ + b`` with the weight in PyTorch / Hugging Face
layout ``W: (out_features, in_features)``. The multiplication dispatches on the type of
``w`` through `weight_matmul`, a `functools.singledispatch` function: a plain array is
a dense matmul; `entrenar.quant.QuantizedWeight` and `entrenar.lora.LoRAWeight`
register their own rules (dequantize block by block; ``x Wᵀ + s (x Aᵀ) Bᵀ``), so LoRA,
QLoRA and quantized models need no change to model code.

Mixed precision (``matmul_dtype="bfloat16"``): `lowp_matmul` casts ``x`` and ``W`` to
bfloat16, accumulates the products in float32 and returns ``x``'s dtype, in the
forward pass and in its custom backward pass (``dx = g W`` with bfloat16 inputs and
float32 accumulation; ``dW`` only when ``W`` is differentiated). On CPUs with AMX
(Intel Sapphire Rapids and later) XLA:CPU runs such dots on the AMX tiles, 5-6x the
float32 rate; elsewhere they are correct, only not faster.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from entrenar.errors import ConfigError
from entrenar.native import cpu_flags
from entrenar.nn.weight_node import to_dense

MATMUL_DTYPES = ("bfloat16", "float16")
"""Low-precision input dtypes `lowp_matmul` accepts (accumulation is float32)."""

Materialize = Callable[[Any, Any], jax.Array]


def check_matmul_dtype(name: str | None, field: str = "matmul_dtype") -> None:
    """Raise `ConfigError` unless ``name`` is None or one of `MATMUL_DTYPES`."""
    if name is not None and name not in MATMUL_DTYPES:
        raise ConfigError(
            f"{field} must be None or one of {MATMUL_DTYPES}, got {name!r}"
        )


BF16_CPU_FLAGS = ("amx_bf16", "avx512_bf16")
"""CPU feature flags under which XLA:CPU runs bfloat16 dots faster than float32."""


def auto_matmul_dtype() -> str | None:
    """The faster matmul dtype here: ``"bfloat16"`` or None (float32).

    bfloat16 on an accelerator, or on a CPU that lists one of `BF16_CPU_FLAGS` in
    ``/proc/cpuinfo`` (Intel Sapphire Rapids and later; AMD Zen 4 and later); None
    elsewhere, where bfloat16 dots are emulated and no faster than float32.
    """
    if jax.default_backend() != "cpu":
        return "bfloat16"
    flags = cpu_flags()
    return "bfloat16" if any(x in flags for x in BF16_CPU_FLAGS) else None


def dense_weight(w: Any, dtype: Any) -> jax.Array:
    """``to_dense(w)`` cast to ``dtype`` (the default `lowp_matmul` materializer)."""
    return jnp.asarray(to_dense(w)).astype(dtype)


def _dot_lowp(x: jax.Array, w: jax.Array, dtype: Any) -> jax.Array:
    """``x Wᵀ``, inputs in ``dtype``, float32 accumulation; ``(..., out)`` float32."""
    return jnp.einsum(
        "...i,oi->...o",
        x.astype(dtype),
        w.astype(dtype),
        preferred_element_type=jnp.float32,
    )


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _lowp(x: jax.Array, w: Any, dtype: Any, materialize: Materialize) -> jax.Array:
    return _dot_lowp(x, materialize(w, dtype), dtype).astype(x.dtype)  # (..., out)


def _perturbed(tree: Any) -> bool:
    leaves = jax.tree_util.tree_leaves(
        tree, is_leaf=lambda v: isinstance(v, jax.custom_derivatives.CustomVJPPrimal)
    )
    return any(getattr(v, "perturbed", False) for v in leaves)


def _value(tree: Any) -> Any:
    return jax.tree_util.tree_map(
        lambda v: v.value,
        tree,
        is_leaf=lambda v: isinstance(v, jax.custom_derivatives.CustomVJPPrimal),
    )


def _lowp_fwd(x: Any, w: Any, dtype: Any, materialize: Materialize) -> Any:
    xv, wv = x.value, _value(w)
    y = _lowp(xv, wv, dtype, materialize)
    # The residual is the weight node as given (for a scanned stack, the slice of the
    # stack itself, which scan forwards rather than copies); dense/dequantized
    # matrices are rebuilt in the backward pass. x is kept only when W needs dW.
    x_res = xv if _perturbed(w) else None
    return y, (x_res, wv)


def _lowp_bwd(dtype: Any, materialize: Materialize, res: Any, g: jax.Array) -> Any:
    x, w = res
    wd = materialize(w, dtype)  # (out, in)
    gl = g.astype(dtype)
    dx = jnp.einsum("...o,oi->...i", gl, wd, preferred_element_type=jnp.float32)
    dx = dx.astype(g.dtype)  # (..., in), g has x's dtype
    if x is None:
        return dx, None
    dwd = jnp.einsum(
        "...o,...i->oi", gl, x.astype(dtype), preferred_element_type=jnp.float32
    )  # (out, in)
    # pulled back through the float32 materialization: dW is not rounded to dtype
    _, pull = jax.vjp(lambda v: materialize(v, jnp.float32), w)
    (dw,) = pull(dwd)
    return dx, dw


_lowp.defvjp(_lowp_fwd, _lowp_bwd, symbolic_zeros=True)


def lowp_matmul(
    x: jax.Array,
    w: Any,
    matmul_dtype: str,
    materialize: Materialize = dense_weight,
) -> jax.Array:
    """``x Wᵀ`` with inputs in ``matmul_dtype`` and float32 accumulation.

    ``W = materialize(w, matmul_dtype)`` (`dense_weight` for an array; a quantized
    node passes its dequantizer, so the dense matrix exists only inside the
    computation, and is rebuilt in the backward pass rather than stored). The
    custom VJP keeps the precision in the backward pass, ``dx = g W`` (inputs in
    ``matmul_dtype``, float32 accumulation), and computes ``dW = gᵀ x`` (pulled back
    through ``materialize``) only when ``w`` is differentiated: a frozen weight
    costs one matmul in the backward pass, not two.

    Args:
        x: ``(..., in)`` inputs, any float dtype; the result has this dtype.
        w: the weight ``(out, in)`` or a node ``materialize`` understands.
        matmul_dtype: one of `MATMUL_DTYPES`.
        materialize: ``(w, dtype) -> (out, in)`` array; must be hashable (a
            module-level function).

    Returns:
        ``(..., out)`` in ``x``'s dtype.

    Example:
        >>> import jax.numpy as jnp
        >>> lowp_matmul(jnp.ones((2, 3)), jnp.ones((4, 3)), "bfloat16").dtype
        dtype('float32')
    """
    check_matmul_dtype(matmul_dtype)
    return _lowp(x, w, np.dtype(jnp.dtype(matmul_dtype)), materialize)


@functools.singledispatch
def weight_matmul(w: Any, x: jax.Array, matmul_dtype: str | None = None) -> jax.Array:
    """Return ``x Wᵀ`` for a dense weight ``w: (out, in)`` and ``x: (..., in)``.

    With ``matmul_dtype=None`` the weight is cast to ``x``'s dtype, so ``x`` sets the
    compute precision. With ``matmul_dtype="bfloat16"`` the product runs through
    `lowp_matmul` (bfloat16 inputs, float32 accumulation, result in ``x``'s dtype).
    Other weight node types register their own implementation with
    ``@weight_matmul.register(NodeType)``, taking the same arguments.
    """
    if matmul_dtype is not None:
        return lowp_matmul(x, w, matmul_dtype)
    w = jnp.asarray(w)
    return jnp.einsum("...i,oi->...o", x, w.astype(x.dtype))  # (..., out)


def linear(
    x: jax.Array,
    w: Any,
    b: jax.Array | None = None,
    *,
    matmul_dtype: str | None = None,
) -> jax.Array:
    """Affine map ``y = x Wᵀ + b``.

    Args:
        x: inputs, shape ``(..., in)``.
        w: weight ``(out, in)``: an array or a registered weight node.
        b: optional bias ``(out,)``.
        matmul_dtype: None (compute in ``x``'s dtype) or ``"bfloat16"`` /
            ``"float16"``: matmul inputs in that dtype, float32 accumulation, in the
            forward and the backward pass (`lowp_matmul`).

    Returns:
        ``(..., out)`` in ``x``'s dtype.

    Example:
        >>> import jax.numpy as jnp
        >>> linear(jnp.ones((2, 3)), jnp.ones((4, 3)), jnp.arange(4.0)).tolist()
        [[3.0, 4.0, 5.0, 6.0], [3.0, 4.0, 5.0, 6.0]]
    """
    if matmul_dtype is None:
        y = weight_matmul(w, x)  # (..., out)
    else:
        y = weight_matmul(w, x, matmul_dtype)
    if b is not None:
        y = y + jnp.asarray(b).astype(y.dtype)
    return y


__all__ = [
    "BF16_CPU_FLAGS",
    "MATMUL_DTYPES",
    "auto_matmul_dtype",
    "check_matmul_dtype",
    "dense_weight",
    "linear",
    "lowp_matmul",
    "weight_matmul",
]
