"""The native few-row product ``y = x Ŵᵀ`` from a weight's stored bytes (decoding).

Generating a token reads every weight once, so its speed is the speed of reading the
weights. For ``n <=`` `FEW_ROWS` float32 input rows, the native kernel
``entrenar/kernels/ggml_matvec.cc`` decodes each weight row's bytes in registers and
multiplies them at once. This module is the kernel's plumbing, shared by every stored
format: a format says whether the kernel reads it (`kernel_reads`) and how to call it
(`kernel_call`), registered beside the format (`Bfloat16Weight` in
`entrenar.nn.bf16_weight`; `QuantizedWeight` and `GGMLWeight` in
`entrenar.quant.matvec`). The gradient is the pure-JAX product's (a custom VJP), so
a few-row step through a frozen base is unchanged.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from entrenar import native

FEW_ROWS = 64
"""Input rows up to which the kernel multiplies (decoding: batch x new tokens)."""

Q_TYPES = {"q8_0": 0, "q4_0": 1, "q4_1": 2}
"""Block formats ``entrenar_q_matvec`` decodes (32 values a block), and their code."""

GGML_TYPES = {"Q4_K": 0, "Q5_K": 1, "Q6_K": 2, "BF16": 3, "F16": 4}
"""Row formats ``entrenar_ggml_matvec`` decodes, and their code in the kernel."""

Fallback = Callable[[Any, jax.Array], jax.Array]
"""The pure-JAX product ``(w, xs (n, in)) -> (n, out)`` a kernel call stands for."""


@functools.singledispatch
def kernel_reads(w: Any) -> bool:
    """Whether the kernel reads ``w``'s format (any shape; `applies` checks more)."""
    return False


@functools.singledispatch
def kernel_call(w: Any, xs: jax.Array) -> jax.Array:
    """The custom call for ``w``'s format: ``xs (n, in)`` float32 -> ``(n, out)``."""
    raise TypeError(f"the ggml_matvec kernel does not read {type(w).__name__}")


def ggml_rows_call(data: jax.Array, ggml_type: str, xs: jax.Array) -> jax.Array:
    """``xs Ŵᵀ``, ``Ŵ``'s rows stored as ggml ``ggml_type`` bytes ``data (out, b)``."""
    out = jax.ShapeDtypeStruct((xs.shape[0], data.shape[0]), jnp.float32)
    call = jax.ffi.ffi_call("entrenar_ggml_matvec", out, vmap_method="sequential")
    return call(xs, data, type=np.int32(GGML_TYPES[ggml_type]))


def q_blocks_call(
    scheme: str,
    codes: jax.Array,
    scales: jax.Array,
    offsets: jax.Array | None,
    xs: jax.Array,
) -> jax.Array:
    """``xs Ŵᵀ`` for Q8_0 / Q4_0 / Q4_1 blocks: ``Ŵ = d·q``, ``d·(q − 8)``, ``d·q + m``.

    ``codes (out, in)``, ``scales`` and ``offsets`` (Q4_1 only) one per 32 values,
    passed as float16 as the GGUF stores them.
    """
    out = jax.ShapeDtypeStruct((xs.shape[0], codes.shape[0]), jnp.float32)
    call = jax.ffi.ffi_call("entrenar_q_matvec", out, vmap_method="sequential")
    offsets = scales if offsets is None else offsets  # unread unless Q4_1
    return call(
        xs,
        codes,
        scales.astype(jnp.float16),
        offsets.astype(jnp.float16),
        type=np.int32(Q_TYPES[scheme]),
    )


def applies(w: Any, x: jax.Array) -> bool:
    """The kernel computes ``x Ŵᵀ``: a 2-d readable ``w``, few float32 rows, native."""
    return (
        kernel_reads(w)
        and w.ndim == 2
        and math.prod(x.shape[:-1]) <= FEW_ROWS
        and jnp.dtype(x.dtype) == jnp.float32
        and native.use("ggml_matvec", x)
    )


def matvec(w: Any, x: jax.Array, fallback: Fallback) -> jax.Array:
    """``x Ŵᵀ`` through the native kernel: ``x: (..., in)``, ``w: (out, in)``.

    Call only where `applies` holds. ``fallback(w, xs)``: the pure-JAX product
    ``(n, in) -> (n, out)`` the caller would run otherwise; the gradient is its
    gradient (for a decoded block path: no dense matrix in the backward pass).
    """
    out, fan_in = w.shape
    y = _product(w, x.reshape(-1, fan_in), fallback)  # (n, out)
    return y.reshape(*x.shape[:-1], out)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _product(w: Any, xs: jax.Array, fallback: Fallback) -> jax.Array:
    return kernel_call(w, xs)


def _fwd(w: Any, xs: jax.Array, fallback: Fallback) -> tuple[jax.Array, Any]:
    return kernel_call(w, xs), (w, xs)


def _bwd(fallback: Fallback, res: Any, g: jax.Array) -> Any:
    w, xs = res  # the pure-JAX path computes the same product: its gradient
    _, pull = jax.vjp(fallback, w, xs)
    return pull(g)


_product.defvjp(_fwd, _bwd)


__all__ = [
    "FEW_ROWS",
    "GGML_TYPES",
    "Q_TYPES",
    "applies",
    "ggml_rows_call",
    "kernel_call",
    "kernel_reads",
    "matvec",
    "q_blocks_call",
]
