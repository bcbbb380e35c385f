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

An NF4 weight with float32 inputs on that path goes through the native kernel
``entrenar/kernels/nf4_matmul.cc`` where it can be built (`entrenar.native`): it
decodes each row's codes in registers (AVX-512: 16 values per table permute) and
multiplies them at once, so the dense matrix is never written: about 1.2-1.3x the
float32 matmul at 4096 x 4096, batch 16. Its gradient is the block path's
(a custom VJP), so training through it is unchanged.

A `GGMLWeight` (a GGUF K-quant, BF16 or F16 tensor kept as stored) is always
multiplied block by block: `GGML_BLOCK_VALUES` values of whole rows are decoded and
used while in cache, in the forward pass (``y = x Ŵᵀ`` one block of output columns at
a time) and in the backward pass (``dx = g Ŵ`` summed over the blocks); the frozen
base gets no gradient, and no dense matrix is kept between the passes.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from entrenar import native
from entrenar.errors import ShapeError
from entrenar.nn.linear import lowp_matmul, weight_matmul
from entrenar.quant import blocked, matvec
from entrenar.quant.api import dequantize
from entrenar.quant.kquant import GGMLWeight, decode_rows
from entrenar.quant.nf4 import NF4_CODE, block_scales
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
    result in ``x``'s dtype). Off the CPU a matrix is multiplied block by block
    (`entrenar.quant.blocked`: no dense copy of the weight in the step).
    """
    if blocked.use_blocked(w):
        return blocked.blocked_matmul(w, x, matmul_dtype)
    if matmul_dtype is not None:
        return lowp_matmul(x, w, matmul_dtype, dequantized)
    if matvec.applies(w, x):  # Q8_0 / Q4_0 / Q4_1, few rows: the native kernel
        return matvec.matvec(w, x, _jax_matmul)
    if _native_nf4(w, x, math.prod(x.shape[:-1])):
        return _native_matmul(w, x)
    return _jax_matmul(w, x)


def _jax_matmul(w: QuantizedWeight, x: jax.Array) -> jax.Array:
    """``x Ŵᵀ`` in JAX: block by block with few rows, else the whole matrix."""
    rows = _block_rows(w, math.prod(x.shape[:-1]))
    if rows:
        return _blockwise_matmul(w, x, rows)
    return jnp.einsum("...i,oi->...o", x, dequantize(w, x.dtype))  # (..., out)


def _block_rows(w: QuantizedWeight, n_inputs: int) -> int:
    """Output rows per block for the few-rows path, or 0 when it does not apply."""
    if n_inputs > FEW_ROWS or w.ndim != 2 or w.granularity != "block":
        return 0
    out, fan_in = w.shape
    rows = blocked.rows_within(out, fan_in, BLOCK_VALUES)
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


def _native_nf4(w: QuantizedWeight, x: jax.Array, n: int) -> bool:
    """The kernel applies: few rows, 2-d NF4 blocks dividing 512, then `native.use`."""
    return (
        n <= FEW_ROWS
        and w.ndim == 2
        and w.granularity == "block"
        and w.scheme == "nf4"
        and w.block_size % 2 == 0
        and 512 % w.block_size == 0
        and native.use("nf4_matmul", x)
    )


@jax.custom_vjp
def _nf4_native_product(w: QuantizedWeight, xs: jax.Array) -> jax.Array:
    """``xs Ŵᵀ``: ``(n, in) -> (n, out)`` through the native kernel."""
    out = jax.ShapeDtypeStruct((xs.shape[0], w.shape[0]), jnp.float32)
    call = jax.ffi.ffi_call("entrenar_nf4_matmul", out, vmap_method="sequential")
    scales = block_scales(w).astype(jnp.float32)  # (out, in / B)
    return call(xs, w.codes, scales, jnp.asarray(NF4_CODE))


def _nf4_fwd(w: QuantizedWeight, xs: jax.Array) -> tuple[jax.Array, Any]:
    return _nf4_native_product(w, xs), (w, xs)


def _nf4_bwd(res: Any, g: jax.Array) -> Any:
    w, xs = res  # the gradient of the JAX path, which computes the same product
    _, pull = jax.vjp(_jax_matmul, w, xs)
    return pull(g)


_nf4_native_product.defvjp(_nf4_fwd, _nf4_bwd)


def _native_matmul(w: QuantizedWeight, x: jax.Array) -> jax.Array:
    y = _nf4_native_product(w, x.reshape(-1, w.shape[1]))  # (n, out)
    return y.reshape(*x.shape[:-1], w.shape[0])


GGML_BLOCK_VALUES = 1 << 18
"""Values of a `GGMLWeight` decoded at a time (1 MiB in float32, about L2-sized)."""


@weight_matmul.register(GGMLWeight)
def ggml_matmul(
    w: GGMLWeight, x: jax.Array, matmul_dtype: str | None = None
) -> jax.Array:
    """``x Ŵᵀ`` for ``w: (out, in)``, ``x: (..., in)``, decoding blocks of rows.

    ``Ŵ`` is decoded in ``x``'s dtype, or in ``matmul_dtype`` (then float32
    accumulation). The result has ``x``'s dtype.

    Raises:
        ShapeError: ``w`` is not a matrix (index a stacked weight per layer first).
    """
    if w.ndim != 2:
        raise ShapeError(
            f"a GGMLWeight multiplies as a matrix (out, in), got {w.shape}: index "
            f"a stacked weight per layer (scan over layers) first"
        )
    if matmul_dtype is None and matvec.applies(w, x):  # few rows: the native kernel
        return matvec.matvec(w, x, _ggml_jax)
    out, fan_in = w.shape
    dtype = jnp.dtype(matmul_dtype or x.dtype)
    xs = x.reshape(-1, fan_in)  # (n, in)
    y = _ggml_product(w, xs, _ggml_rows(out, fan_in), dtype)  # (n, out)
    return y.reshape(*x.shape[:-1], out)


def _ggml_jax(w: GGMLWeight, xs: jax.Array) -> jax.Array:
    """``xs Ŵᵀ`` ``(n, in) -> (n, out)`` by the blocked JAX path, in ``xs``'s dtype."""
    out, fan_in = w.shape
    return _ggml_product(w, xs, _ggml_rows(out, fan_in), jnp.dtype(xs.dtype))


def _ggml_rows(out: int, fan_in: int) -> int:
    """Rows per block: the largest divisor of ``out`` within `GGML_BLOCK_VALUES`."""
    return blocked.rows_within(out, fan_in, GGML_BLOCK_VALUES)


def _row_blocks(w: GGMLWeight, rows: int) -> jax.Array:
    """``w.data (out, row_bytes)`` -> ``(out / rows, rows, row_bytes)``."""
    return w.data.reshape(-1, rows, w.data.shape[-1])


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _ggml_product(w: GGMLWeight, xs: jax.Array, rows: int, dtype: Any) -> jax.Array:
    """``xs Ŵᵀ``: ``(n, in) -> (n, out)`` in ``xs``'s dtype, ``rows`` rows at a time.

    ``Ŵ`` and ``xs`` enter the products in ``dtype``, accumulated in float32.
    """
    xd = xs.astype(dtype)

    def block(data: jax.Array) -> jax.Array:  # (rows, row_bytes) -> (n, rows)
        wb = decode_rows(data, w.ggml_type).astype(dtype)  # (rows, in)
        return jnp.einsum("ni,ri->nr", xd, wb, preferred_element_type=jnp.float32)

    y = jax.lax.map(block, _row_blocks(w, rows))  # (out / rows, n, rows)
    return jnp.moveaxis(y, 0, 1).reshape(xs.shape[0], -1).astype(xs.dtype)


def _ggml_fwd(w: GGMLWeight, xs: jax.Array, rows: int, dtype: Any) -> Any:
    return _ggml_product(w, xs, rows, dtype), w


def _ggml_bwd(rows: int, dtype: Any, res: Any, g: jax.Array) -> Any:
    w = res
    n, fan_in = g.shape[0], w.shape[1]
    gb = jnp.moveaxis(g.reshape(n, -1, rows), 1, 0).astype(dtype)  # (out/rows, n, rows)

    def step(dx: jax.Array, pair: tuple[jax.Array, jax.Array]) -> Any:
        data, gk = pair  # (rows, row_bytes), (n, rows)
        wb = decode_rows(data, w.ggml_type).astype(dtype)  # (rows, in)
        dx = dx + jnp.einsum("nr,ri->ni", gk, wb, preferred_element_type=jnp.float32)
        return dx, None

    dx0 = jnp.zeros((n, fan_in), jnp.float32)
    dx, _ = jax.lax.scan(step, dx0, (_row_blocks(w, rows), gb))  # (n, in)
    frozen = jax.tree_util.tree_map(
        lambda a: np.zeros(a.shape, jax.dtypes.float0), w
    )  # the base is frozen: no gradient
    return frozen, dx.astype(g.dtype)  # g has the dtype of y, which is x's


_ggml_product.defvjp(_ggml_fwd, _ggml_bwd)


__all__ = [
    "BLOCK_VALUES",
    "FEW_ROWS",
    "GGML_BLOCK_VALUES",
    "dequantized",
    "ggml_matmul",
    "quantized_matmul",
]
