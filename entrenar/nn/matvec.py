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

Activations (`set_activations`, `activations`, ``ENTRENAR_DECODE_ACTIVATIONS``):
``"float32"`` (the default) multiplies ``x`` as given, so the product equals ``x``
times the dequantized matrix to float32 rounding. ``"int8"`` rounds each 32-value
block of ``x`` to 8-bit integers with its own scale, ``e_b = max|x_b| / 127``,
``x̂_b = e_b·round(x_b / e_b)``, and multiplies Q8_0 / Q4_0 / Q4_1 blocks by integer
dot products, as llama.cpp does (``kernels/int8_dot.h``): the product is
``x̂ Ŵᵀ`` to float32 rounding, off from ``x Ŵᵀ`` by at most
``Σ_b (e_b / 2)·Σ_j |Ŵ_bj|`` a row, and several times fewer instructions a weight.
It applies to those three formats only (K-quants and 16-bit weights keep float32
activations), and only where the kernel runs (few rows, float32, native).

The process setting (`set_activations`) drops compiled functions when it changes.
`traced_activations` instead chooses for the kernel calls traced inside it, for a
jitted function that takes the choice as a static argument (so its compilations are
kept apart): `entrenar.nn.generate`'s ``decode_activations``.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math
import os
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from entrenar import native
from entrenar.errors import ConfigError

FEW_ROWS = 64
"""Input rows up to which the kernel multiplies (decoding: batch x new tokens)."""

Q_TYPES = {"q8_0": 0, "q4_0": 1, "q4_1": 2}
"""Block formats ``entrenar_q_matvec`` decodes (32 values a block), and their code."""

GGML_TYPES = {"Q4_K": 0, "Q5_K": 1, "Q6_K": 2, "BF16": 3, "F16": 4}
"""Row formats ``entrenar_ggml_matvec`` decodes, and their code in the kernel."""

ACTIVATIONS = ("float32", "int8")
"""How the kernel multiplies Q8_0 / Q4_0 / Q4_1 blocks by ``x`` (`set_activations`)."""

_ACTIVATIONS = "float32"
_TRACED: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "entrenar_decode_activations", default=None
)  # traced_activations' choice, over _ACTIVATIONS while set


def set_activations(kind: str) -> None:
    """Multiply Q8_0 / Q4_0 / Q4_1 blocks by ``x`` as ``kind``: float32 or int8.

    ``"int8"``: ``x`` rounded per 32-block to 8 bits (see the module docstring);
    compiled functions traced before are dropped (`jax.clear_caches`), as they hold
    the other choice.

    Raises:
        ConfigError: ``kind`` is not one of `ACTIVATIONS`.
    """
    global _ACTIVATIONS
    check_activations(kind, "ENTRENAR_DECODE_ACTIVATIONS or set_activations")
    if kind != _ACTIVATIONS:
        jax.clear_caches()  # traces made under the other choice are stale
        _ACTIVATIONS = kind


def check_activations(kind: str, where: str) -> str:
    """``kind`` if it is one of `ACTIVATIONS`; ``where`` names the setting.

    Raises:
        ConfigError: another value.
    """
    if kind not in ACTIVATIONS:
        raise ConfigError(
            f"decode activations {kind!r} ({where}): choose one of "
            f"{', '.join(ACTIVATIONS)}"
        )
    return kind


def current_activations() -> str:
    """The activations a kernel call traced now uses (see `traced_activations`)."""
    return _TRACED.get() or _ACTIVATIONS


@contextlib.contextmanager
def traced_activations(kind: str | None) -> Iterator[None]:
    """Kernel calls traced inside the block use ``kind`` (None: the process setting).

    Unlike `activations`, nothing compiled is dropped, so use it only inside a
    function whose compilations are keyed by ``kind``: a jitted function taking it
    as a static argument (`entrenar.nn.generate.decode_step`). `matvec` passes the
    choice to its custom VJP as a static argument too, so JAX's trace caches keep
    the two apart.

    Raises:
        ConfigError: ``kind`` is not None nor one of `ACTIVATIONS`.
    """
    if kind is not None:
        check_activations(kind, "decode_activations")
    token = _TRACED.set(kind)
    try:
        yield
    finally:
        _TRACED.reset(token)


@contextlib.contextmanager
def activations(kind: str) -> Iterator[None]:
    """`set_activations` ``kind`` inside the ``with`` block, the previous one after."""
    before = _ACTIVATIONS
    set_activations(kind)
    try:
        yield
    finally:
        set_activations(before)


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


def _layer(layer: jax.Array | None) -> jax.Array:
    """The kernel's ``layer`` operand: int32 ``()``, 0 for an unstacked weight."""
    return jnp.zeros((), jnp.int32) if layer is None else jnp.asarray(layer, jnp.int32)


def ggml_rows_call(
    data: jax.Array, ggml_type: str, xs: jax.Array, layer: jax.Array | None = None
) -> jax.Array:
    """``xs Ŵᵀ``, ``Ŵ``'s rows stored as ggml ``ggml_type`` bytes ``data (out, b)``.

    ``data (L, out, b)`` with ``layer`` (int32 ``()``): layer ``layer``'s rows,
    read in place (no copy of the slice).
    """
    out = jax.ShapeDtypeStruct((xs.shape[0], data.shape[-2]), jnp.float32)
    call = jax.ffi.ffi_call("entrenar_ggml_matvec", out, vmap_method="sequential")
    return call(xs, data, _layer(layer), type=np.int32(GGML_TYPES[ggml_type]))


def q_blocks_call(
    scheme: str,
    codes: jax.Array,
    scales: jax.Array,
    offsets: jax.Array | None,
    xs: jax.Array,
    layer: jax.Array | None = None,
) -> jax.Array:
    """``xs Ŵᵀ`` for Q8_0 / Q4_0 / Q4_1 blocks: ``Ŵ = d·q``, ``d·(q − 8)``, ``d·q + m``.

    ``codes (out, in)``, ``scales`` and ``offsets`` (Q4_1 only) one per 32 values,
    passed as float16 as the GGUF stores them. With int8 activations
    (`set_activations`), ``x̂ Ŵᵀ``: ``x`` rounded per 32-block to 8 bits.
    Stacked ``codes (L, out, ·)``, ``scales``, ``offsets (L, out, in/32)`` with
    ``layer`` (int32 ``()``): layer ``layer``, read in place.
    """
    out = jax.ShapeDtypeStruct((xs.shape[0], codes.shape[-2]), jnp.float32)
    call = jax.ffi.ffi_call("entrenar_q_matvec", out, vmap_method="sequential")
    offsets = scales if offsets is None else offsets  # unread unless Q4_1
    return call(
        xs,
        codes,
        scales.astype(jnp.float16),
        offsets.astype(jnp.float16),
        _layer(layer),
        type=np.int32(Q_TYPES[scheme]),
        int8_x=np.int32(current_activations() == "int8"),
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
    kind = current_activations()  # static: JAX's caches of _product key on it
    y = _product(w, x.reshape(-1, fan_in), fallback, kind)  # (n, out)
    return y.reshape(*x.shape[:-1], out)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _product(w: Any, xs: jax.Array, fallback: Fallback, kind: str) -> jax.Array:
    with traced_activations(kind):
        return kernel_call(w, xs)


def _fwd(w: Any, xs: jax.Array, fallback: Fallback, kind: str) -> tuple[jax.Array, Any]:
    with traced_activations(kind):
        return kernel_call(w, xs), (w, xs)


def _bwd(fallback: Fallback, kind: str, res: Any, g: jax.Array) -> Any:
    w, xs = res  # the pure-JAX path computes the same product: its gradient
    _, pull = jax.vjp(fallback, w, xs)
    return pull(g)


_product.defvjp(_fwd, _bwd)


@functools.singledispatch
def layer_of(w: Any, index: jax.Array) -> Any:
    """Layer ``index`` of the stacked weight ``w (L, out, in)`` read in place, or None.

    A format the kernel reads registers a node holding the whole stack and
    ``index`` (`entrenar.quant.matvec.StackedLayer`); None: slice as usual.
    """
    return None


def layer_params(stack: Any, index: jax.Array) -> Any:
    """Layer ``index`` of the stacked layer parameters ``stack`` (leaves ``(L, ...)``).

    What ``jax.lax.scan`` over ``stack`` would give layer ``index``, except that a
    weight the kernel reads, directly under dict keys, becomes a view of the stack
    (`layer_of`): a custom call cannot read a slice of its operand, so a scan's
    slice of such a weight is a copy of its bytes (every layer's weights copied
    every decoding step); the view passes the whole stack and ``index`` instead.
    """

    def pick(path: Any, leaf: Any) -> Any:
        if (
            kernel_reads(leaf)
            and leaf.ndim == 3
            and all(isinstance(k, jax.tree_util.DictKey) for k in path)
        ):
            view = layer_of(leaf, index)
            if view is not None:
                return view
        return jax.tree_util.tree_map(
            lambda a: jax.lax.dynamic_index_in_dim(a, index, 0, keepdims=False), leaf
        )

    return jax.tree_util.tree_map_with_path(pick, stack, is_leaf=kernel_reads)


set_activations(os.environ.get("ENTRENAR_DECODE_ACTIVATIONS", "float32").strip())

__all__ = [
    "ACTIVATIONS",
    "FEW_ROWS",
    "GGML_TYPES",
    "Q_TYPES",
    "activations",
    "applies",
    "check_activations",
    "current_activations",
    "ggml_rows_call",
    "kernel_call",
    "kernel_reads",
    "layer_of",
    "layer_params",
    "matvec",
    "q_blocks_call",
    "set_activations",
    "traced_activations",
]
