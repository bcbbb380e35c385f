"""Decoding products from the weights as stored: ``y = x Ŵᵀ`` for few input rows.

Generating one token reads every weight once, so its speed is the speed of reading
the weights: float32 moves 32 bits a value, Q8_0 8.5, Q4_1 5. XLA:CPU cannot
multiply by blocks it must first decode without writing them out (the JAX paths of
`entrenar.quant.linear` decode a block of rows, then multiply), so for ``n <=``
`FEW_ROWS` input rows in float32 the native kernel ``entrenar/kernels/ggml_matvec.cc``
decodes each row's bytes in registers and multiplies them at once:

- `QuantizedWeight` Q8_0 / Q4_0 / Q4_1 (``Ŵ = d·q``, ``d·(q − 8)``, ``d·q + m``);
- `GGMLWeight` Q4_K / Q5_K / Q6_K / BF16 / F16 (ggml's ``dequantize_row_*``);
- `Bfloat16Weight` (``Ŵ`` = the bfloat16 values, widened exactly) when the product
  is float32 (``matmul_dtype=None``).

The values decoded are the dequantizers' own, so the product equals ``x`` times the
dequantized float32 matrix to float32 rounding (only the order of the sums differs).
`entrenar.native` decides whether the kernel runs (``native.use("ggml_matvec")``);
elsewhere the pure-JAX paths compute the same product. The gradient is the
dequantized product's (a custom VJP), so a few-row training step through a frozen
base is unchanged.

For a model whose output head is its (tied) embedding, `quantize_tied_head` keeps the
head as Q8_0 (`QuantizedTiedEmbedding`): llama.cpp multiplies by the GGUF's stored
``token_embd`` (Q8_0 in SmolLM2's files), where a float32 head reads 4x the bytes —
for SmolLM2-135M the head is a fifth of the model's values.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from entrenar import native
from entrenar.nn.bf16_weight import Bfloat16Weight, TiedEmbedding
from entrenar.nn.linear import weight_matmul
from entrenar.nn.weight_node import (
    logical_dtype,
    logical_shape,
    register_weight_node,
    to_dense,
)
from entrenar.quant.api import dequantize
from entrenar.quant.ggml import quantize_ggml
from entrenar.quant.kquant import GGMLWeight, decode_rows
from entrenar.quant.weight import QuantizedWeight
from entrenar.tree import key_path_str

FEW_ROWS = 64
"""Input rows up to which the kernel multiplies (decoding: batch x new tokens)."""

Q_TYPES = {"q8_0": 0, "q4_0": 1, "q4_1": 2}
"""`QuantizedWeight` schemes the kernel reads, and their code in the kernel."""

GGML_TYPES = {"Q4_K": 0, "Q5_K": 1, "Q6_K": 2, "BF16": 3, "F16": 4}
"""`GGMLWeight` types the kernel reads, and their code in the kernel."""

Stored = QuantizedWeight | GGMLWeight | Bfloat16Weight
Fallback = Callable[[Any, jax.Array], jax.Array]
"""The pure-JAX product ``(w, xs (n, in)) -> (n, out)`` a kernel call stands for."""


def supported(w: Any) -> bool:
    """Whether the kernel reads ``w``'s format (any shape; `applies` checks more)."""
    if isinstance(w, QuantizedWeight):
        return w.scheme in Q_TYPES and w.granularity == "block" and w.block_size == 32
    if isinstance(w, GGMLWeight):
        return w.ggml_type in GGML_TYPES
    return isinstance(w, Bfloat16Weight)


def applies(w: Any, x: jax.Array) -> bool:
    """The kernel computes ``x Ŵᵀ``: a 2-d supported ``w``, few float32 rows, native."""
    return (
        supported(w)
        and w.ndim == 2
        and math.prod(x.shape[:-1]) <= FEW_ROWS
        and jnp.dtype(x.dtype) == jnp.float32
        and native.use("ggml_matvec", x)
    )


def matvec(w: Stored, x: jax.Array, fallback: Fallback) -> jax.Array:
    """``x Ŵᵀ`` through the native kernel: ``x: (..., in)``, ``w: (out, in)``.

    Call only where `applies` holds (the dispatch in `entrenar.quant.linear` and
    `entrenar.nn.bf16_weight` does). ``fallback(w, xs)``: the pure-JAX product
    ``(n, in) -> (n, out)`` the caller would run otherwise; the gradient is its
    gradient (for a decoded block path: no dense matrix in the backward pass).
    """
    out, fan_in = w.shape
    y = _product(w, x.reshape(-1, fan_in), fallback)  # (n, out)
    return y.reshape(*x.shape[:-1], out)


def _call(w: Stored, xs: jax.Array) -> jax.Array:
    """The custom call: ``xs (n, in)`` float32 -> ``(n, out)`` float32."""
    out = jax.ShapeDtypeStruct((xs.shape[0], w.shape[0]), jnp.float32)
    if isinstance(w, QuantizedWeight):
        call = jax.ffi.ffi_call("entrenar_q_matvec", out, vmap_method="sequential")
        offsets = w.scales if w.offsets is None else w.offsets  # unread unless Q4_1
        return call(
            xs,
            w.codes,
            w.scales.astype(jnp.float16),
            offsets.astype(jnp.float16),
            type=np.int32(Q_TYPES[w.scheme]),
        )
    if isinstance(w, Bfloat16Weight):  # the bits as BF16 bytes, little-endian
        bits = jnp.asarray(w.bits)  # (out, in) uint16
        data = jax.lax.bitcast_convert_type(bits, jnp.uint8).reshape(w.shape[0], -1)
        kind = GGML_TYPES["BF16"]
    else:
        data, kind = w.data, GGML_TYPES[w.ggml_type]
    call = jax.ffi.ffi_call("entrenar_ggml_matvec", out, vmap_method="sequential")
    return call(xs, data, type=np.int32(kind))


def dense(w: Stored, dtype: Any) -> jax.Array:
    """``Ŵ`` in ``dtype``: the values the kernel multiplies by."""
    if isinstance(w, QuantizedWeight):
        return dequantize(w, dtype)
    if isinstance(w, GGMLWeight):
        return decode_rows(w.data, w.ggml_type).astype(dtype)
    return w.value().astype(dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _product(w: Stored, xs: jax.Array, fallback: Fallback) -> jax.Array:
    return _call(w, xs)


def _fwd(w: Stored, xs: jax.Array, fallback: Fallback) -> tuple[jax.Array, Any]:
    return _call(w, xs), (w, xs)


def _bwd(fallback: Fallback, res: Any, g: jax.Array) -> Any:
    w, xs = res  # the pure-JAX path computes the same product: its gradient
    _, pull = jax.vjp(fallback, w, xs)
    return pull(g)


_product.defvjp(_fwd, _bwd)


@register_weight_node
@dataclasses.dataclass(frozen=True)
class QuantizedTiedEmbedding(TiedEmbedding):
    """A tied embedding whose output head is read quantized (decoding).

    Token lookups read ``table`` (float, as the plain array); the head
    ``logits = x Ŵᵀ`` reads ``head_t``, here a `QuantizedWeight` ``(V, D)`` (not
    transposed, unlike `TiedEmbedding`'s bfloat16 head), through `matvec` when it
    applies.

    Attributes:
        table: the embedding ``(V, D)``, float.
        head_t: `QuantizedWeight` ``(V, D)`` of ``table``.
    """

    @classmethod
    def from_array(cls, table: Any, scheme: str = "q8_0") -> QuantizedTiedEmbedding:
        """Keep ``table`` and its head in ``scheme`` (q8_0, q4_0 or q4_1)."""
        table = jnp.asarray(table)
        return cls(table, quantize_ggml(table, scheme))

    def head_value(self) -> jax.Array:
        """The head's values ``(V, D)`` in the table's dtype."""
        return dequantize(self.head_t, self.table.dtype)


logical_shape.register(QuantizedTiedEmbedding, lambda w: w.shape)
logical_dtype.register(QuantizedTiedEmbedding, lambda w: w.dtype)
to_dense.register(QuantizedTiedEmbedding, lambda w: w.table)


@weight_matmul.register(QuantizedTiedEmbedding)
def _head_matmul(
    w: QuantizedTiedEmbedding, x: jax.Array, matmul_dtype: str | None = None
) -> jax.Array:
    """Logits ``x Ŵᵀ`` from the quantized head (`entrenar.quant.linear`'s rules)."""
    if matmul_dtype is None:
        return weight_matmul(w.head_t, x)  # (..., V)
    return weight_matmul(w.head_t, x, matmul_dtype)


def quantize_tied_head(
    params: Any, name: str = "model.embed_tokens.weight", scheme: str = "q8_0"
) -> Any:
    """``params`` with the tied embedding ``name`` read as a ``scheme`` head.

    For decoding a model with tied embeddings (SmolLM2, Gemma): the embedding
    ``(V, D)`` becomes a `QuantizedTiedEmbedding`. A Q8_0 ``token_embd`` that
    `entrenar.io.load_llama_gguf` dequantized is quantized back to the same bytes
    (``d = max|x| / 127`` recovers the stored scale exactly, and ``x / d`` its
    integers), so the head then multiplies by the file's values, as llama.cpp does.

    Raises:
        KeyError: ``params`` has no leaf ``name``.
    """
    found = False

    def convert(path: Any, leaf: Any) -> Any:
        nonlocal found
        if key_path_str(path) != name:
            return leaf
        found = True
        table = leaf.table if isinstance(leaf, TiedEmbedding) else leaf
        return QuantizedTiedEmbedding.from_array(table, scheme)

    out = jax.tree_util.tree_map_with_path(
        convert, params, is_leaf=lambda x: isinstance(x, TiedEmbedding)
    )
    if not found:
        raise KeyError(f"quantize_tied_head: params have no leaf {name!r}")
    return out


__all__ = [
    "FEW_ROWS",
    "GGML_TYPES",
    "Q_TYPES",
    "QuantizedTiedEmbedding",
    "applies",
    "dense",
    "matvec",
    "quantize_tied_head",
    "supported",
]
