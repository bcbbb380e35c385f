"""A quantized matmul that never holds the dense weight: blocks of rows in a loop.

For ``w: (out, in)`` quantized (NF4 with or without double quantization, int8, int4,
llama.cpp's Q8_0 / Q4_0 / Q4_1) and inputs ``x: (n, in)``, the product is taken
``R`` output rows at a time:

    ``y[:, bR:(b+1)R] = x Ŵ_bᵀ``,   ``Ŵ_b = dequantize(w[bR:(b+1)R])``  (``R × in``)

in a loop over the ``out / R`` blocks that writes each block's columns of ``y`` in
place, and its input gradient ``C`` input columns at a time (``C`` whole
quantization blocks),

    ``dx[:, cC:(c+1)C] = g Ŵ[:, cC:(c+1)C]``,

decoding each block again rather than keeping it. So a compiled step holds one
block of the weight (``R × in`` or ``out × C`` values, at most a quarter of it) and
no float32 buffer the size of ``y`` or ``dx``, where the dense path
(`entrenar.quant.linear`'s whole dequantization) holds the matrix: on a GPU, with
batches of thousands of rows, the transient dense copy of every projection in
every step. At Llama-3-8B's ``down_proj`` (4096 x 14336, NF4) with 8192 bfloat16
input rows, XLA:CPU's compiled temporaries: 121 MB dense / 102 MB blocked for the
product, 537 MB / 155 MB for its input gradient (the dense weight is 117 MB).

Inputs enter the products in ``matmul_dtype`` (bfloat16: the blocks are decoded
straight to it) with float32 accumulation, as `entrenar.nn.lowp_matmul` does; the
result is in ``x``'s dtype. A frozen base (QLoRA) gets no gradient; a
differentiated one gets ``dŴ = gᵀ x`` pulled back through the dequantization, as
the dense path computes.

`entrenar.quant.linear.quantized_matmul` takes this path off the CPU (`use_blocked`);
on the CPU the dense path and the native NF4 kernel stay.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from entrenar.errors import ShapeError
from entrenar.quant.api import dequantize
from entrenar.quant.nf4 import block_scales
from entrenar.quant.weight import QuantizedWeight

BLOCK_VALUES = 1 << 23
"""Most weight values decoded at a time (16 MiB in bfloat16)."""

MIN_BLOCKS = 4
"""Fewest blocks a matrix is cut into (so at most a quarter of it is ever decoded)."""


def rows_within(out: int, fan_in: int, max_values: int) -> int:
    """The largest divisor ``R`` of ``out`` with ``R · fan_in <= max_values``, or 1.

    A divisor, so every block of ``R`` rows of an ``(out, fan_in)`` matrix has the
    same shape.

    >>> rows_within(12, 10, 45)
    4
    """
    rows = max(1, min(out, max_values // fan_in))
    while out % rows:
        rows -= 1
    return rows


def block_rows(out: int, fan_in: int, max_values: int = BLOCK_VALUES) -> int:
    """Rows per block ``R``, the largest divisor of ``out`` that fits.

    Fits: ``R · in <= max_values`` and ``R <= out / MIN_BLOCKS`` (1 at least).

    >>> block_rows(4096, 14336)
    512
    >>> block_rows(14336, 4096)
    2048
    """
    return rows_within(out, fan_in, min(max_values, out // MIN_BLOCKS * fan_in))


def use_blocked(w: Any) -> bool:
    """Whether `quantized_matmul` takes the blocked path for ``w`` here.

    Off the CPU, for a matrix (a layer's slice of a stacked weight) quantized in
    blocks along its rows.
    """
    return (
        jax.default_backend() != "cpu"
        and isinstance(w, QuantizedWeight)
        and w.ndim == 2
        and w.granularity == "block"
    )


def blocked_matmul(
    w: QuantizedWeight,
    x: jax.Array,
    matmul_dtype: str | None = None,
    *,
    rows: int | None = None,
) -> jax.Array:
    """``x Ŵᵀ`` for ``w: (out, in)``, ``x: (..., in)``, ``rows`` rows decoded at a time.

    Args:
        w: a 2-d block-quantized weight.
        x: inputs; the result has their dtype.
        matmul_dtype: None (products in ``x``'s dtype) or ``"bfloat16"`` /
            ``"float16"`` (float32 accumulation).
        rows: rows per block; default `block_rows`. Must divide ``out``.

    Returns:
        ``(..., out)``.

    Raises:
        ShapeError: ``w`` is not a 2-d block-quantized matrix, its input size is
            not ``x``'s, or ``rows`` does not divide its rows.
    """
    if w.ndim != 2 or w.granularity != "block":
        raise ShapeError(
            f"blocked_matmul takes a block-quantized matrix (out, in), got shape "
            f"{w.shape} ({w.granularity}); index a stacked weight per layer first"
        )
    out, fan_in = w.shape
    if x.shape[-1] != fan_in:
        raise ShapeError(f"x has {x.shape[-1]} features, the weight takes {fan_in}")
    rows = block_rows(out, fan_in) if rows is None else int(rows)
    if rows < 1 or out % rows:
        raise ShapeError(f"rows={rows} must divide the weight's {out} rows")
    dtype = np.dtype(jnp.dtype(matmul_dtype or x.dtype))
    xs = x.reshape(-1, fan_in)  # (n, in)
    y = _product(_resolved(w), xs, rows, dtype)  # (n, out)
    return y.reshape(*x.shape[:-1], out)


def _resolved(w: QuantizedWeight) -> QuantizedWeight:
    """``w`` with double quantization undone (its int8 groups span row blocks)."""
    if not w.double_quant:
        return w
    return dataclasses.replace(
        w, scales=block_scales(w), scale_scales=None, scale_offset=None
    )


def block_cols(
    out: int, fan_in: int, block_size: int, max_values: int = BLOCK_VALUES
) -> int:
    """Input columns per block ``C`` of the input gradient: whole quantization blocks.

    The largest multiple of ``block_size`` dividing ``fan_in`` with ``out · C <=
    max_values`` and ``C <= fan_in / MIN_BLOCKS`` (one quantization block at least).

    >>> block_cols(4096, 14336, 64)
    2048
    """
    blocks = fan_in // block_size  # quantization blocks per row
    per = max(1, min(max_values // (out * block_size), blocks // MIN_BLOCKS))
    while blocks % per:
        per -= 1
    return per * block_size


def _rows_of(w: QuantizedWeight, start: Any, rows: int) -> QuantizedWeight:
    """Rows ``[start, start + rows)`` of every leaf (codes, scales, offsets)."""

    def take(a: Any) -> Any:
        return None if a is None else jax.lax.dynamic_slice_in_dim(a, start, rows, 0)

    return dataclasses.replace(
        w, codes=take(w.codes), scales=take(w.scales), offsets=take(w.offsets)
    )


def _cols_of(w: QuantizedWeight, block: Any, cols: int) -> QuantizedWeight:
    """Input columns ``[block C, (block + 1) C)`` of every leaf.

    Each leaf gives the same share of its last axis (``C`` whole quantization
    blocks, so codes, scales and offsets agree).
    """
    fan_in = w.shape[1]

    def take(a: Any) -> Any:
        if a is None:
            return None
        size = a.shape[-1] * cols // fan_in
        return jax.lax.dynamic_slice_in_dim(a, block * size, size, 1)

    return dataclasses.replace(
        w, codes=take(w.codes), scales=take(w.scales), offsets=take(w.offsets)
    )


def _forward(w: QuantizedWeight, xs: jax.Array, rows: int, dtype: Any) -> jax.Array:
    """``y[:, bR:(b+1)R] = x Ŵ_bᵀ`` written into ``y`` block by block (in place)."""
    n, out = xs.shape[0], w.shape[0]
    xd = xs.astype(dtype)

    def body(b: Any, y: jax.Array) -> jax.Array:
        wb = dequantize(_rows_of(w, b * rows, rows), dtype)  # (R, in)
        yb = jnp.einsum("ni,ri->nr", xd, wb, preferred_element_type=jnp.float32)
        return jax.lax.dynamic_update_slice_in_dim(y, yb.astype(y.dtype), b * rows, 1)

    y0 = jnp.zeros((n, out), xs.dtype)
    return jax.lax.fori_loop(0, out // rows, body, y0)  # (n, out)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _product(w: QuantizedWeight, xs: jax.Array, rows: int, dtype: Any) -> jax.Array:
    """``xs Ŵᵀ``: ``(n, in) -> (n, out)``, ``rows`` rows of ``Ŵ`` at a time."""
    return _forward(w, xs, rows, dtype)


def _primal(tree: Any) -> tuple[Any, bool]:
    """The values of a tree of `CustomVJPPrimal` and whether any is perturbed."""
    is_primal = lambda v: isinstance(v, jax.custom_derivatives.CustomVJPPrimal)  # noqa: E731
    leaves = jax.tree_util.tree_leaves(tree, is_leaf=is_primal)
    perturbed = any(getattr(v, "perturbed", False) for v in leaves)
    values = jax.tree_util.tree_map(lambda v: v.value, tree, is_leaf=is_primal)
    return values, perturbed


def _product_fwd(w: Any, xs: Any, rows: int, dtype: Any) -> tuple[jax.Array, Any]:
    wv, w_perturbed = _primal(w)
    xv = xs.value
    # the residual is the packed weight; x only when the weight needs dŴ
    return _forward(wv, xv, rows, dtype), (wv, xv if w_perturbed else None)


def _product_bwd(rows: int, dtype: Any, res: Any, g: jax.Array) -> Any:
    w, xs = res
    out, fan_in = w.shape
    n = g.shape[0]
    gl = g.astype(dtype)
    cols = block_cols(out, fan_in, w.block_size)

    def body(c: Any, dx: jax.Array) -> jax.Array:  # dx[:, cC:(c+1)C] = g Ŵ[:, cols]
        wc = dequantize(_cols_of(w, c, cols), dtype)  # (out, C)
        dxc = jnp.einsum("no,oc->nc", gl, wc, preferred_element_type=jnp.float32)
        return jax.lax.dynamic_update_slice_in_dim(
            dx, dxc.astype(dx.dtype), c * cols, 1
        )

    dx0 = jnp.zeros((n, fan_in), g.dtype)  # g has y's dtype, which is x's
    dx = jax.lax.fori_loop(0, fan_in // cols, body, dx0)  # (n, in)
    if xs is None:  # a frozen base: no gradient
        return None, dx
    dwd = jnp.einsum(
        "no,ni->oi", gl, xs.astype(dtype), preferred_element_type=jnp.float32
    )  # (out, in): the dense gradient only when the weight is trained
    _, pull = jax.vjp(lambda v: dequantize(v, jnp.float32), w)
    (dw,) = pull(dwd)
    return dw, dx


_product.defvjp(_product_fwd, _product_bwd, symbolic_zeros=True)


__all__ = [
    "BLOCK_VALUES",
    "MIN_BLOCKS",
    "block_rows",
    "blocked_matmul",
    "rows_within",
    "use_blocked",
]
