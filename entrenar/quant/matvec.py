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
base is unchanged. The kernel's plumbing (`applies`, `matvec`) is
`entrenar.nn.matvec`'s; this module registers the quantized formats with it.

For a model whose output head is its (tied) embedding, `quantize_tied_head` keeps the
head as Q8_0 (`QuantizedTiedEmbedding`): llama.cpp multiplies by the GGUF's stored
``token_embd`` (Q8_0 in SmolLM2's files), where a float32 head reads 4x the bytes —
for SmolLM2-135M the head is a fifth of the model's values.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from entrenar.nn.bf16_weight import Bfloat16Weight, TiedEmbedding
from entrenar.nn.linear import weight_matmul
from entrenar.nn.matvec import (
    FEW_ROWS,
    GGML_TYPES,
    Q_TYPES,
    applies,
    ggml_rows_call,
    kernel_call,
    kernel_reads,
    layer_of,
    matvec,
    q_blocks_call,
)
from entrenar.nn.weight_node import (
    is_weight_node,
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

Stored = QuantizedWeight | GGMLWeight | Bfloat16Weight


def supported(w: Any) -> bool:
    """Whether the kernel reads ``w``'s format (any shape; `applies` checks more)."""
    return kernel_reads(w)


@kernel_reads.register(QuantizedWeight)
def _reads_quantized(w: QuantizedWeight) -> bool:
    return w.scheme in Q_TYPES and w.granularity == "block" and w.block_size == 32


@kernel_reads.register(GGMLWeight)
def _reads_ggml(w: GGMLWeight) -> bool:
    return w.ggml_type in GGML_TYPES


@kernel_call.register(QuantizedWeight)
def _call_quantized(w: QuantizedWeight, xs: jax.Array) -> jax.Array:
    return q_blocks_call(w.scheme, w.codes, w.scales, w.offsets, xs)


@kernel_call.register(GGMLWeight)
def _call_ggml(w: GGMLWeight, xs: jax.Array) -> jax.Array:
    return ggml_rows_call(w.data, w.ggml_type, xs)


@register_weight_node
@dataclasses.dataclass(frozen=True)
class StackedLayer:
    """Layer ``index`` of a stacked ``QuantizedWeight`` / ``GGMLWeight`` (decoding).

    Built inside a layer scan by `entrenar.nn.matvec.layer_params`: the kernel
    reads layer ``index`` of ``stack`` in place; any other product multiplies by
    `layer` (the slice, as the scan would have cut it).

    Attributes:
        stack: the weight ``(L, out, in)``.
        index: int32 ``()``, the layer.
    """

    stack: QuantizedWeight | GGMLWeight
    index: jax.Array

    @property
    def shape(self) -> tuple[int, ...]:
        """``(out, in)``."""
        return tuple(self.stack.shape[1:])

    @property
    def ndim(self) -> int:
        """2."""
        return len(self.shape)

    @property
    def dtype(self) -> Any:
        """The stack's logical dtype."""
        return self.stack.dtype

    def layer(self) -> QuantizedWeight | GGMLWeight:
        """The layer's own weight (its arrays sliced out of the stack's)."""
        return jax.tree_util.tree_map(
            lambda a: jax.lax.dynamic_index_in_dim(a, self.index, 0, keepdims=False),
            self.stack,
        )


logical_shape.register(StackedLayer, lambda w: w.shape)
logical_dtype.register(StackedLayer, lambda w: w.dtype)
to_dense.register(StackedLayer, lambda w: to_dense(w.layer()))
kernel_reads.register(StackedLayer, lambda w: True)


@layer_of.register(QuantizedWeight)
@layer_of.register(GGMLWeight)
def _layer_of(w: QuantizedWeight | GGMLWeight, index: jax.Array) -> StackedLayer:
    return StackedLayer(w, index)


@kernel_call.register(StackedLayer)
def _call_stacked(w: StackedLayer, xs: jax.Array) -> jax.Array:
    s = w.stack
    if isinstance(s, QuantizedWeight):
        return q_blocks_call(s.scheme, s.codes, s.scales, s.offsets, xs, w.index)
    return ggml_rows_call(s.data, s.ggml_type, xs, w.index)


def _stacked_jax(w: StackedLayer, xs: jax.Array) -> jax.Array:
    return weight_matmul(w.layer(), xs)  # (n, out)


@weight_matmul.register(StackedLayer)
def _stacked_matmul(
    w: StackedLayer, x: jax.Array, matmul_dtype: str | None = None
) -> jax.Array:
    """``x Ŵᵀ``: the kernel on the stack in place where it applies, else the slice's."""
    if matmul_dtype is None and applies(w, x):
        return matvec(w, x, _stacked_jax)
    if matmul_dtype is None:
        return weight_matmul(w.layer(), x)
    return weight_matmul(w.layer(), x, matmul_dtype)


def dense(w: Stored, dtype: Any) -> jax.Array:
    """``Ŵ`` in ``dtype``: the values the kernel multiplies by."""
    if isinstance(w, QuantizedWeight):
        return dequantize(w, dtype)
    if isinstance(w, GGMLWeight):
        return decode_rows(w.data, w.ggml_type).astype(dtype)
    return w.value().astype(dtype)


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
        """Keep ``table`` (an array or a weight node) and its head in ``scheme``.

        ``scheme``: q8_0, q4_0 or q4_1; a node's head quantizes its dequantized
        values.
        """
        table = table if is_weight_node(table) else jnp.asarray(table)
        return cls(table, quantize_ggml(to_dense(table), scheme))

    def head_value(self) -> jax.Array:
        """The head's values ``(V, D)`` in the table's dtype."""
        return dequantize(self.head_t, self.table.dtype)


logical_shape.register(QuantizedTiedEmbedding, lambda w: w.shape)
logical_dtype.register(QuantizedTiedEmbedding, lambda w: w.dtype)
to_dense.register(QuantizedTiedEmbedding, lambda w: to_dense(w.table))


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

    An embedding kept as stored (``load_llama_gguf(keep_quantized=True)``) that the
    kernel reads (`supported`: a Q8_0, Q4_0 or Q4_1 `QuantizedWeight`, a
    `GGMLWeight` of `GGML_TYPES`) is left as it is, whatever ``scheme``: it is
    already the head in the file's own type, as llama.cpp multiplies a tied head
    (``token_embd`` in its stored type, Q4_0/Q4_1 included), and its bytes are
    not copied. Any other node's head is its dequantized values in ``scheme``.

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
        if is_weight_node(table) and supported(table) and table.ndim == 2:
            return table  # the stored head, read in its own type
        return QuantizedTiedEmbedding.from_array(table, scheme)

    out = jax.tree_util.tree_map_with_path(convert, params, is_leaf=is_weight_node)
    if not found:
        raise KeyError(f"quantize_tied_head: params have no leaf {name!r}")
    return out


__all__ = [
    "FEW_ROWS",
    "GGML_TYPES",
    "Q_TYPES",
    "QuantizedTiedEmbedding",
    "StackedLayer",
    "applies",
    "dense",
    "matvec",
    "quantize_tied_head",
    "supported",
]
