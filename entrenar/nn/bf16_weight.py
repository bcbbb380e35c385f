"""Frozen weights stored once in bfloat16, for bfloat16 matmuls.

A frozen weight that only feeds bfloat16 products (``matmul_dtype="bfloat16"``, see
`entrenar.nn.linear`) need not stay float32 and be rounded again at every step: in a
LoRA step of SmolLM2's shape those roundings are about a tenth of the work.
`to_bfloat16_weights(frozen)` rounds the selected matrices once (to nearest, ties to
even), which halves their memory, and `linear` reads them as they are:

    W16 = round_bf16(W)      y = (bf16(x) · W16ᵀ)_f32      dx = (bf16(g) · W16)_f32

the same values the float32 weight gives under ``matmul_dtype="bfloat16"``, so the
results do not change (only W's float32 copy is gone: a float32 product,
``matmul_dtype=None``, uses the rounded values).

The values are kept as their 16-bit patterns in a ``uint16`` array, not as a
``bfloat16`` array, for two reasons:

- XLA:CPU normalizes a ``dynamic-slice`` of a bfloat16 array inside a loop to
  float32, and then hoists a float32 copy of the whole layer stack out of the layer
  scan (``f32[L, out, in] convert(...)``), rounding it back layer by layer: slower
  than keeping float32 weights. A ``uint16`` slice is taken as it is.
- An integer leaf is never differentiated (``jax.grad`` refuses it), which is what
  a frozen weight is.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from entrenar.nn import matvec
from entrenar.nn.linear import lowp_matmul, weight_matmul
from entrenar.nn.weight_node import (
    is_weight_node,
    logical_dtype,
    logical_shape,
    register_weight_node,
    to_dense,
)
from entrenar.tree import key_path_str

DEFAULT_WEIGHTS = re.compile(r"(_proj|lm_head)\.weight(\.base)?$")
"""Names `to_bfloat16_weights` converts by default: Llama's projections (a LoRA
weight's frozen ``base`` included) and an untied ``lm_head`` (a plain bfloat16
array, `_rounded_head`); not embeddings (read by index, in float32) nor norms."""


@register_weight_node
@dataclasses.dataclass(frozen=True)
class Bfloat16Weight:
    """A frozen weight ``(*lead, out, in)`` held as bfloat16 bit patterns.

    Attributes:
        bits: ``uint16`` array, the bfloat16 values' bits.

    Example:
        >>> import jax.numpy as jnp
        >>> w = Bfloat16Weight.from_array(jnp.array([[1.0, 1.00390625]]))
        >>> w.value().tolist(), w.shape
        ([[1.0, 1.0]], (1, 2))
    """

    bits: Any

    @classmethod
    def from_array(cls, w: Any) -> Bfloat16Weight:
        """Round ``w`` to bfloat16 (nearest, ties to even) and keep its bits.

        A bfloat16 JAX array on one CPU device is not copied: its bits are a
        ``uint16`` view of the same buffer (XLA's eager bitcast would copy it).
        """
        if _viewable(w):
            return cls(jax.device_put(np.asarray(w).view(np.uint16)))
        w16 = jnp.asarray(w).astype(jnp.bfloat16)
        return cls(jax.lax.bitcast_convert_type(w16, jnp.uint16))

    def value(self) -> jax.Array:
        """The weight as a bfloat16 array."""
        return jax.lax.bitcast_convert_type(jnp.asarray(self.bits), jnp.bfloat16)

    @property
    def shape(self) -> tuple[int, ...]:
        """The weight's shape."""
        return tuple(int(s) for s in self.bits.shape)

    @property
    def ndim(self) -> int:
        """Number of axes."""
        return len(self.shape)

    @property
    def dtype(self) -> Any:
        """bfloat16, the dtype of `value`."""
        return jnp.dtype(jnp.bfloat16)


def _viewable(w: Any) -> bool:
    """Whether ``w`` is a concrete bfloat16 array in one CPU device's memory."""
    if not isinstance(w, jax.Array) or isinstance(w, jax.core.Tracer):
        return False
    if w.dtype != jnp.bfloat16 or w.is_deleted():
        return False
    devices = w.devices()
    return len(devices) == 1 and next(iter(devices)).platform == "cpu"


@weight_matmul.register(Bfloat16Weight)
def _bf16_matmul(
    w: Bfloat16Weight, x: jax.Array, matmul_dtype: str | None = None
) -> jax.Array:
    """``x Wᵀ``: bfloat16 products with float32 accumulation, or in ``x``'s dtype."""
    if matmul_dtype is not None:
        return lowp_matmul(x, w, matmul_dtype)  # W = to_dense(w), bfloat16
    if matvec.applies(w, x):  # few float32 rows: read the bfloat16 bits as stored
        return matvec.matvec(w, x, _bf16_dense_matmul)
    return _bf16_dense_matmul(w, x)


def _bf16_dense_matmul(w: Bfloat16Weight, x: jax.Array) -> jax.Array:
    """``x Wᵀ`` by the dense rule: ``W`` cast to ``x``'s dtype."""
    return weight_matmul(w.value(), x)


matvec.kernel_reads.register(Bfloat16Weight, lambda w: True)


@matvec.kernel_call.register(Bfloat16Weight)
def _bf16_kernel_call(w: Bfloat16Weight, xs: jax.Array) -> jax.Array:
    """The kernel reads the bits as BF16 rows (little-endian bytes)."""
    bits = jnp.asarray(w.bits)  # (out, in) uint16
    data = jax.lax.bitcast_convert_type(bits, jnp.uint8).reshape(w.shape[0], -1)
    return matvec.ggml_rows_call(data, "BF16", xs)


@register_weight_node
@dataclasses.dataclass(frozen=True)
class TiedEmbedding:
    """A frozen embedding that is also the output head (tied), read two ways.

    Token lookups read ``table`` in float32, as they would the plain array; the head
    ``x Wᵀ`` under bfloat16 matmuls reads ``head_t = round_bf16(W)ᵀ`` ``(D, V)``,
    kept once instead of a bfloat16 copy of the whole ``(V, D)`` table made at every
    step. Stored transposed because XLA:CPU runs ``dz · W`` over a 49,152-row ``W``
    (the head's input gradient) at about 600 GFLOP/s from ``(V, D)`` and 1,000 from
    ``(D, V)``; the logits ``x · W`` run alike from either (AMX, bfloat16 with float32
    accumulation). A plain bfloat16 array, unlike `Bfloat16Weight`'s bits: it is read
    whole, never sliced in a loop, and XLA:CPU copies a ``uint16`` -> bfloat16
    bitcast of it (57 MB for SmolLM2) at every step.

    The table may be a weight node kept as stored (a GGUF's Q8_0 ``token_embd``
    as a `entrenar.quant.QuantizedWeight`, see `rounds_tied_head`): lookups then
    decode only their rows, and ``head_t`` rounds its dequantized values.

    Without the copy (``head_t`` None, a bfloat16 array's node when
    `to_bfloat16_weights` is given ``tied_head_copy=False``:
    `entrenar.nn.LlamaConfig.tied_head_copy`), the head reads the
    table itself ``(V, D)``: the same logits and gradients, no ``(D, V)`` copy
    (2.82 GB of Gemma-3-27B's 262,208 x 5,376 table), the head's input gradient at
    XLA:CPU's slower ``(V, D)`` speed. A float32 table keeps its copy (reading it
    whole would round it to a bfloat16 temporary of the same size at every step).

    Attributes:
        table: the embedding ``(V, D)``, float, or a weight node.
        head_t: bfloat16 ``(D, V)``, ``round_bf16(table)ᵀ``, or None (the head is
            the table).
    """

    table: Any
    head_t: Any

    @classmethod
    def from_array(cls, table: Any) -> TiedEmbedding:
        """Keep ``table`` (an array or a weight node) and its rounded head."""
        table = table if is_weight_node(table) else jnp.asarray(table)
        head = jnp.asarray(to_dense(table)).T.astype(jnp.bfloat16)  # (D, V)
        return cls(table, head)

    @property
    def transposed(self) -> bool:
        """Whether the head is held transposed (``head_t``), not read from ``table``."""
        return self.head_t is not None

    def head_value(self) -> jax.Array:
        """``round_bf16(W)ᵀ`` ``(D, V)`` as a bfloat16 array (needs ``head_t``)."""
        return jnp.asarray(self.head_t)

    @property
    def shape(self) -> tuple[int, ...]:
        """The table's shape ``(V, D)``."""
        return tuple(int(s) for s in self.table.shape)

    @property
    def ndim(self) -> int:
        """2."""
        return len(self.shape)

    @property
    def dtype(self) -> Any:
        """The table's dtype."""
        return self.table.dtype


logical_shape.register(Bfloat16Weight, lambda w: w.shape)
logical_shape.register(TiedEmbedding, lambda w: w.shape)
logical_dtype.register(Bfloat16Weight, lambda w: w.dtype)
logical_dtype.register(TiedEmbedding, lambda w: w.dtype)
to_dense.register(Bfloat16Weight, Bfloat16Weight.value)
to_dense.register(TiedEmbedding, lambda w: to_dense(w.table))


@functools.singledispatch
def rounds_tied_head(table: Any) -> bool:
    """Whether `to_bfloat16_weights` rounds the tied embedding node ``table``'s head.

    True: ``table`` becomes a `TiedEmbedding`, its head rounded to bfloat16 once.
    False by default: a node type with a head rule of its own keeps it (a GGUF
    K-quant `entrenar.quant.GGMLWeight` decodes the head block by block in the
    loss, holding no dense copy). `entrenar.quant` registers True for
    `entrenar.quant.QuantizedWeight`: a kept Q8_0/Q4_0/Q4_1 ``token_embd`` is
    then read as the float32 table it replaces was (the same head, the same rows).
    """
    return False


def _tied_head(w: TiedEmbedding, dtype: Any) -> jax.Array:
    if not w.transposed:  # the table itself
        return jnp.asarray(w.table).astype(dtype)  # (V, D)
    return w.head_value().T.astype(dtype)  # (V, D)


@weight_matmul.register(TiedEmbedding)
def _tied_matmul(
    w: TiedEmbedding, x: jax.Array, matmul_dtype: str | None = None
) -> jax.Array:
    """``x Wᵀ`` (logits): the rounded head under bfloat16 matmuls, else the table."""
    if matmul_dtype is not None:
        return lowp_matmul(x, w, matmul_dtype, _tied_head)
    return weight_matmul(w.table, x)


def _rounded_head(w: Any) -> jax.Array:
    """An untied ``lm_head`` ``(V, D)`` rounded to a plain bfloat16 array.

    Not `Bfloat16Weight`'s ``uint16`` bits: the head is read whole, never sliced in
    the layer scan, and XLA:CPU copies a ``uint16`` -> bfloat16 bitcast of it at
    every step (`TiedEmbedding.head_t`'s reason): 1.56 GB of Qwen2.5-32B's
    152,064 x 5,120 head in the step's temporaries. A head that already is bfloat16
    is kept as it is (the same memory).
    """
    return jnp.asarray(w, jnp.bfloat16)


def to_bfloat16_weights(
    params: Any,
    predicate: Callable[[str, Any], bool] | None = None,
    *,
    tied_embedding: str | None = None,
    tied_head_copy: bool = True,
) -> Any:
    """Replace the frozen matrices ``predicate`` selects by `Bfloat16Weight` nodes.

    Meant for the frozen half of a split tree (`entrenar.lora.split`), used with
    ``matmul_dtype="bfloat16"``: each selected weight is rounded once instead of at
    every step, and takes half the memory. A weight that already is a bfloat16
    array on one CPU device becomes a node over the same memory
    (`Bfloat16Weight.from_array`), so a bfloat16 model's frozen half is not held
    twice by the Trainer, which keeps the half it was given beside this one.

    Args:
        params: a parameter tree (``None`` leaves are kept).
        predicate: ``fn(dotted_name, leaf) -> bool`` over floating leaves of two or
            more axes; by default the names `DEFAULT_WEIGHTS` matches.
        tied_embedding: the dotted name of an embedding that is also the output
            head (``"model.embed_tokens.weight"`` for a tied Llama); it becomes a
            `TiedEmbedding` (a float array, or a weight node `rounds_tied_head`
            accepts).
        tied_head_copy: False: a bfloat16 array's `TiedEmbedding` holds no
            transposed head (``head_t`` None; a float32 array's or a weight
            node's head is rounded as with True).

    Returns:
        A new tree; the input is not modified.

    Example:
        >>> import jax.numpy as jnp
        >>> p = {"q_proj": {"weight": jnp.ones((4, 3))}, "norm": jnp.ones(3)}
        >>> type(to_bfloat16_weights(p)["q_proj"]["weight"]).__name__
        'Bfloat16Weight'
    """

    def tie(path: Any, leaf: Any) -> Any:  # a tied embedding kept as a weight node
        if key_path_str(path) == tied_embedding and rounds_tied_head(leaf):
            return TiedEmbedding.from_array(leaf)
        return leaf

    if tied_embedding is not None:
        params = jax.tree_util.tree_map_with_path(tie, params, is_leaf=is_weight_node)

    def convert(path: Any, leaf: Any) -> Any:
        if not isinstance(leaf, jax.Array | np.ndarray):
            return leaf
        if leaf.ndim < 2 or not jnp.issubdtype(leaf.dtype, jnp.floating):
            return leaf
        name = key_path_str(path)
        if name == tied_embedding and not tied_head_copy and leaf.dtype == jnp.bfloat16:
            return TiedEmbedding(jnp.asarray(leaf), None)  # the head is the table
        if name == tied_embedding:
            return TiedEmbedding.from_array(leaf)
        chosen = (
            predicate(name, leaf)
            if predicate is not None
            else DEFAULT_WEIGHTS.search(name) is not None
        )
        if chosen and leaf.ndim == 2 and name.endswith("lm_head.weight"):
            return _rounded_head(leaf)
        return Bfloat16Weight.from_array(leaf) if chosen else leaf

    tied = lambda x: isinstance(x, TiedEmbedding)  # noqa: E731  (kept whole)
    return jax.tree_util.tree_map_with_path(convert, params, is_leaf=tied)


__all__ = [
    "DEFAULT_WEIGHTS",
    "Bfloat16Weight",
    "TiedEmbedding",
    "rounds_tied_head",
    "to_bfloat16_weights",
]
