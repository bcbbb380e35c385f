"""`quantize` and `dequantize`: one entry point over every scheme, and tree versions.

Both are pure and jittable (the scheme and its options are static). Called eagerly,
each compiles to one XLA program per scheme, options and shape (cached), which also
checks for NaN/Inf (raised after it returns); under an outer `jax.jit` the values
are unknown at trace time and the check is skipped.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from entrenar.errors import QuantizationError, ShapeError
from entrenar.nn.bf16_weight import rounds_tied_head
from entrenar.nn.hf_names import stacked_split
from entrenar.nn.layers import embedding_rows
from entrenar.nn.weight_node import to_dense
from entrenar.quant.ggml import check_float16, dequantize_ggml, quantize_ggml
from entrenar.quant.int4 import dequantize_int4, quantize_int4
from entrenar.quant.int8 import dequantize_int8, quantize_int8
from entrenar.quant.nf4 import block_scales, dequantize_nf4, quantize_nf4_checked
from entrenar.quant.weight import SCHEMES, QuantizedWeight, check_finite
from entrenar.tree import key_path_str
from entrenar.types import PyTree

_DEQUANTIZE: dict[str, Callable[[QuantizedWeight, Any], jax.Array]] = {
    "int4": dequantize_int4,
    "nf4": dequantize_nf4,
    "int8": dequantize_int8,
    "q8_0": dequantize_ggml,
    "q4_0": dequantize_ggml,
    "q4_1": dequantize_ggml,
}


def quantize(
    w: Any,
    scheme: str = "nf4",
    *,
    block_size: int = 64,
    double_quant: bool = False,
    symmetric: bool = True,
    granularity: str = "block",
    axis: int = -2,
) -> QuantizedWeight:
    """Quantize ``w: (*lead, cols)`` with blocks along the last axis.

    Args:
        w: a float array (any leading axes: rows, stacked layers).
        scheme: ``"nf4"``, ``"int4"``, ``"int8"``, or a llama.cpp block format
            ``"q8_0"``, ``"q4_0"``, ``"q4_1"`` (fixed 32-value blocks, bit-exact with
            llama.cpp's reference quantizer).
        block_size: values per block (``nf4``, ``int4``, block-wise ``int8``).
        double_quant: ``nf4`` only: quantize the block scales too (QLoRA's DQ).
        symmetric: ``int8`` only: int8 codes around 0, else uint8 with zero points.
        granularity: ``int8`` only: ``"block"``, ``"channel"`` or ``"tensor"``.
        axis: ``int8`` per-channel only: the channel axis.

    Returns:
        A new `QuantizedWeight`; ``w`` is not modified.

    Raises:
        QuantizationError: unknown scheme, ``w`` not real floating point (integers,
            booleans, complex), or NaN/Inf in a concrete ``w``.
        ShapeError: the last axis does not split into whole blocks, or ``w`` has
            no values (a zero-sized axis).

    Example:
        >>> import jax.numpy as jnp
        >>> q = quantize(jnp.linspace(-1.0, 1.0, 128).reshape(2, 64), "int4")
        >>> q.codes.shape, q.scales.shape, float(dequantize(q)[1, -1])
        ((2, 32), (2, 1), 1.0)
    """
    if scheme not in SCHEMES:
        raise QuantizationError(f"unknown scheme {scheme!r}; expected one of {SCHEMES}")
    if not hasattr(w, "dtype"):  # nested lists of numbers
        w = jnp.asarray(w)
    dtype = np.dtype(w.dtype)
    if not jnp.issubdtype(dtype, jnp.floating):
        raise QuantizationError(
            f"quantize takes real floating-point weights, got {dtype} values; cast "
            "them to float32 first if they are weights"
        )
    if 0 in np.shape(w):
        raise ShapeError(
            f"cannot quantize an array of shape {tuple(np.shape(w))} to {scheme}: it "
            "holds no values; leave an empty array unquantized"
        )
    q, finite = _quantize(
        w, scheme, block_size, double_quant, symmetric, granularity, axis
    )
    if not isinstance(finite, jax.core.Tracer) and not bool(finite):
        check_finite(w, scheme)  # raises, naming the first NaN/Inf
    if scheme in ("q8_0", "q4_0", "q4_1"):
        check_float16(q.scales, q.offsets, scheme)
    return q


@functools.partial(jax.jit, static_argnums=(1, 2, 3, 4, 5, 6))
def _quantize(
    w: Any,
    scheme: str,
    block_size: int,
    double_quant: bool,
    symmetric: bool,
    granularity: str,
    axis: int,
) -> tuple[QuantizedWeight, jax.Array]:
    """`quantize` as one compiled program per scheme, options and shape.

    Returns the node and whether every value of ``w`` is finite (a bool scalar),
    checked in the same program: a quantize call (say one per layer of a streaming
    load) costs one dispatch, not three.
    """
    if scheme == "nf4":  # finite from the block absmaxes it computes anyway
        return quantize_nf4_checked(w, block_size=block_size, double_quant=double_quant)
    finite = jnp.all(jnp.isfinite(w))  # () bool
    if scheme == "int4":
        return quantize_int4(w, block_size=block_size), finite
    if scheme == "int8":
        q = quantize_int8(
            w,
            symmetric=symmetric,
            granularity=granularity,
            axis=axis,
            block_size=block_size,
        )
        return q, finite
    return quantize_ggml(w, scheme), finite


def dequantize(q: QuantizedWeight, dtype: Any = None) -> jax.Array:
    """The values a `QuantizedWeight` stands for, ``q.shape`` in ``dtype``.

    Args:
        q: the node.
        dtype: output dtype (default: the dtype ``q`` was quantized from).
    """
    if q.scheme not in _DEQUANTIZE:
        raise QuantizationError(
            f"unknown scheme {q.scheme!r}; expected one of {SCHEMES}"
        )
    return _dequantize(q, np.dtype(q.dtype if dtype is None else dtype))


@functools.partial(jax.jit, static_argnums=1)
def _dequantize(q: QuantizedWeight, dtype: np.dtype) -> jax.Array:
    return _DEQUANTIZE[q.scheme](q, dtype)


to_dense.register(QuantizedWeight, dequantize)


def map_rows(q: QuantizedWeight, fn: Callable[[Any], Any]) -> QuantizedWeight:
    """``q`` with ``fn`` applied to each array indexed by the table's rows.

    The codes, the first-level block scales (double quantization undone:
    `block_scales`; its int8 groups span rows) and the offsets each go through
    ``fn`` (None passes through it too); the DQ arrays are dropped. ``fn`` picks or
    reshapes rows along axis 0, so the node still dequantizes to ``fn`` of the rows.
    """
    return dataclasses.replace(
        q,
        codes=fn(q.codes),
        scales=fn(block_scales(q)),
        offsets=fn(q.offsets),
        scale_scales=None,
        scale_offset=None,
    )


@embedding_rows.register(QuantizedWeight)
def quantized_rows(q: QuantizedWeight, tokens: jax.Array) -> jax.Array:
    """Rows ``tokens: (...)`` of the table ``q: (V, D)``, dequantized -> ``(..., D)``.

    ``Ŵ[t] = dequantize(q)[t]`` bit for bit, but only the looked-up rows of the codes
    ``(..., D / 2)`` or ``(..., D)``, scales ``(..., D / B)`` and offsets are gathered
    and dequantized, never the whole table: a GGUF's Q4_0 embedding of Llama-3-8B's
    vocabulary stays 0.3 GB instead of 2.1 GB in float32. Double-quantized NF4
    scales are resolved for the whole table first (`block_scales`, ``V·D / B``
    values: their int8 groups of 256 span rows); per-channel and per-tensor int8
    scales (size-1 axes) broadcast. An id outside ``[0, V)`` gives a NaN row, as
    `entrenar.nn.embedding` documents for a plain table (``jnp.take``'s fill mode,
    negative ids from ``-V`` wrapping). The table is frozen in a LoRA step (its codes
    are integers); jittable.
    """
    if q.ndim != 2:
        raise ShapeError(
            f"an embedding table is (V, D), got a QuantizedWeight of shape {q.shape}"
        )
    v, d = q.shape
    if tokens.size == 0:  # no rows (a reshape of -1 cannot size them)
        return jnp.zeros((*tokens.shape, d), q.dtype)

    def rows(a: Any) -> Any:  # (V, k) -> (..., k); a broadcast (1, k) stays one row
        if a is None:
            return None
        if a.shape[0] == v:
            return jnp.take(a, tokens, axis=0)  # (..., k)
        return a.reshape((1,) * tokens.ndim + tuple(a.shape[1:]))  # (1.., k)

    out = dequantize(map_rows(q, rows))  # (..., D)
    missing = jnp.isnan(jnp.take(jnp.zeros((v,), jnp.float32), tokens, axis=0))
    return jnp.where(missing[..., None], jnp.asarray(jnp.nan, out.dtype), out)


# a tied QuantizedWeight embedding trained under bfloat16 matmuls: the head rounded
# once (a TiedEmbedding), as the float32 table it replaces had it
rounds_tied_head.register(QuantizedWeight, lambda table: True)


def quantize_like(w: Any, like: QuantizedWeight) -> QuantizedWeight:
    """Quantize ``w`` with every option of ``like`` (scheme, block, DQ, int8 mode).

    Useful to requantize a merged or updated weight in its original format.

    Example:
        >>> import jax.numpy as jnp
        >>> q = quantize(jnp.ones((4, 8)), "int8", granularity="channel", axis=-1)
        >>> quantize_like(2 * jnp.ones((4, 8)), q).scales.shape
        (1, 8)
    """
    axis = -2
    if like.granularity == "channel":  # the one scale axis of the matrix kept whole
        axis = -1 if like.scales.shape[-1] == like.shape[-1] > 1 else -2
    return quantize(
        w,
        like.scheme,
        block_size=like.block_size,
        double_quant=like.double_quant,
        symmetric=like.offsets is None,
        granularity=like.granularity,
        axis=axis,
    )


def is_quantized(x: Any) -> bool:
    """Whether ``x`` is a `QuantizedWeight` (an ``is_leaf`` for tree functions)."""
    return isinstance(x, QuantizedWeight)


def quantizable(x: Any, block: int, *, lead_axes: int = 0) -> bool:
    """Whether `quantize_params` quantizes leaf ``x`` by default.

    A non-empty floating array with at least two axes after its ``lead_axes``
    (a layer stack's axis: a norm's ``(L, D)`` stack is a vector in each layer)
    whose last axis splits into blocks of ``block`` values.

    >>> w = jnp.ones((4, 64))
    >>> quantizable(w, 64), quantizable(w, 64, lead_axes=1)
    (True, False)
    """
    return (
        np.ndim(x) - lead_axes >= 2
        and np.size(x) > 0
        and bool(jnp.issubdtype(jnp.asarray(x).dtype, jnp.floating))
        and np.shape(x)[-1] % block == 0
    )


def _is_norm(name: str) -> bool:
    """Whether the leaf at dotted path ``name`` is a norm's gain (``*norm.weight``).

    Most are vectors; Cohere's per-head q/k norm gains are ``(H, d)`` matrices.

    >>> _is_norm("model.layers.self_attn.q_norm.weight"), _is_norm("lm_head.weight")
    (True, False)
    """
    module, _, _ = name.rpartition(".")
    return module.rpartition(".")[2].endswith("norm")


def layer_axes(name: str) -> int:
    """Leading layer axes of the leaf at the dotted path ``name``: 1 in a layer stack.

    A leaf under a stacked key (``model.layers.*``, GPT-2's ``transformer.h.*``:
    `entrenar.nn.STACKED_KEYS` not followed by a layer index) has a leading layer
    axis (specs/conventions.md; `entrenar.nn.hf_names.stacked_split`).

    >>> layer_axes("model.layers.input_layernorm.weight")
    1
    >>> layer_axes("model.layers.0.input_layernorm.weight"), layer_axes("lm_head.w")
    (0, 0)
    """
    return int(stacked_split(name) is not None)


def quantize_params(
    params: PyTree,
    scheme: str = "nf4",
    *,
    predicate: Callable[[str, Any], bool] | None = None,
    **options: Any,
) -> PyTree:
    """A new tree whose selected weights are `QuantizedWeight` nodes.

    By default every non-empty floating leaf with at least two axes whose last axis
    splits into whole blocks is quantized (weights, not biases or norms: a
    ``*norm.weight`` stays, whatever its shape); in a layer
    stack (`layer_axes`) the axes are counted per layer, so a stacked norm ``(L, D)``
    stays as it is and a projection ``(L, out, in)`` is quantized.
    ``predicate(name, leaf)`` (``name`` the dotted path) chooses instead.

    Example:
        >>> import jax.numpy as jnp
        >>> p = quantize_params({"w": jnp.ones((4, 64)), "b": jnp.ones(4)}, "int4")
        >>> type(p["w"]).__name__, p["b"].shape
        ('QuantizedWeight', (4,))
    """
    block = 32 if scheme in ("q8_0", "q4_0", "q4_1") else options.get("block_size", 64)
    if scheme == "int8" and options.get("granularity", "block") != "block":
        block = 1

    select = predicate or (
        lambda name, x: (
            quantizable(x, block, lead_axes=layer_axes(name)) and not _is_norm(name)
        )
    )

    def rule(path: tuple[Any, ...], x: Any) -> Any:
        if is_quantized(x) or not select(key_path_str(path), x):
            return x
        return quantize(x, scheme, **options)

    return jax.tree_util.tree_map_with_path(rule, params, is_leaf=is_quantized)


def dequantize_params(params: PyTree, dtype: Any = None) -> PyTree:
    """A new tree with every `QuantizedWeight` replaced by its dense values."""
    return jax.tree_util.tree_map(
        lambda x: dequantize(x, dtype) if is_quantized(x) else x,
        params,
        is_leaf=is_quantized,
    )


__all__ = [
    "dequantize",
    "dequantize_params",
    "is_quantized",
    "layer_axes",
    "map_rows",
    "quantizable",
    "quantize",
    "quantize_like",
    "quantize_params",
    "quantized_rows",
]
