"""A stacked GGUF weight whose layers have different ggml types: `MixedGGMLWeight`.

llama.cpp's mixes give one kind of tensor different types in different layers:
Q4_K_M stores ``attn_v`` and ``ffn_down`` as Q6_K in the layers ``use_more_bits``
picks (16 of Llama-3-8B's 32) and Q4_K in the others; a row that is not whole
256-value super-blocks falls back to a 32-value type (Q8_0 for Q6_K). A layer scan
wants one array per leaf with the layers on axis 0, so every layer gets the widest
type's room, and each layer's bytes are kept packed as stored at the start of it::

    data: uint8 (L, rows, row_bytes_max)   data[l].reshape(-1)[: rows * n_l]: layer
                                           l's GGUF bytes (row r at r * n_l, n_l its
                                           type's row bytes); the rest zeros
    kind: int32 (L,)                       layer l's type is types[kind[l]]

Packed, a narrower layer's unused room is one contiguous run of bytes at its end,
never written: the loader allocates the buffer zeroed by the kernel (``calloc`` of
fresh pages), so those pages are not resident (Q4_K_M's ``ffn_down`` of Llama-3-8B:
1.30 GB resident, as the file, of 1.54 GB addressed). The scan slices both, and each
layer decodes its rows with its own type's decoder (`jax.lax.switch` on ``kind``),
block by block as `entrenar.quant.GGMLWeight` does: the values are
`gguf.quants`' exactly, never the whole matrix at once, and the frozen base gets no
gradient. Types: the K-quants, BF16, F16 (`kquant.FORMATS`) and Q8_0, Q4_0, Q4_1
(32-value blocks ``d[, m], codes``: ``x = d q``, ``d (q - 8)``, ``d q + m`` with
``q`` the low nibbles then the high).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from entrenar.errors import FormatError, ShapeError
from entrenar.nn.linear import weight_matmul
from entrenar.nn.weight_node import (
    STATIC,
    logical_dtype,
    logical_shape,
    register_weight_node,
    to_dense,
)
from entrenar.quant.blocked import rows_within
from entrenar.quant.kquant import FORMATS, Format, _f16, _i8

Array = Any


def _nibbles(qs: Array) -> Array:
    """``(n, 16)`` bytes -> ``(n, 32)`` codes: the low nibbles, then the high."""
    xp = np if isinstance(qs, np.ndarray) else jnp
    return xp.concatenate([qs & 15, qs >> 4], axis=-1).astype(np.float32)


def q8_0(b: Array) -> Array:
    """Q8_0 blocks ``(n, 34)`` -> float32 ``(n, 32)``: ``d q``."""
    return _f16(b[:, 0:2])[:, None] * _i8(b[:, 2:34]).astype(np.float32)


def q4_0(b: Array) -> Array:
    """Q4_0 blocks ``(n, 18)`` -> float32 ``(n, 32)``: ``d (q - 8)``."""
    return _f16(b[:, 0:2])[:, None] * (_nibbles(b[:, 2:18]) - 8)


def q4_1(b: Array) -> Array:
    """Q4_1 blocks ``(n, 20)`` -> float32 ``(n, 32)``: ``d q + m``."""
    d, m = _f16(b[:, 0:2])[:, None], _f16(b[:, 2:4])[:, None]
    return d * _nibbles(b[:, 4:20]) + m


ROW_FORMATS: dict[str, Format] = {
    **FORMATS,
    "Q8_0": Format(32, 34, q8_0),
    "Q4_0": Format(32, 18, q4_0),
    "Q4_1": Format(32, 20, q4_1),
}
"""The ggml types a `MixedGGMLWeight` layer may have, by name."""


def row_bytes(ggml_type: str, cols: int) -> int:
    """Bytes of one row of ``cols`` values in ``ggml_type``."""
    fmt = ROW_FORMATS[ggml_type]
    return cols // fmt.block_size * fmt.type_size


def decode_rows(
    flat: Array, kind: Array, types: tuple[str, ...], cols: int, index: Array, rows: int
) -> jax.Array:
    """Rows ``[index * rows, (index + 1) * rows)`` of one layer of ``types[kind]``.

    ``flat`` is the layer's room as bytes ``(rows_all * row_bytes_max,)``; its GGUF
    bytes are packed at the start, so block ``index`` of a layer of type ``t`` is the
    ``rows * n_t`` bytes at ``index * rows * n_t`` (``n_t = row_bytes(t, cols)``).
    ``kind`` is a traced int32 scalar: `jax.lax.switch` runs its type's decoder.
    Returns float32 ``(rows, cols)``.
    """

    def branch(t: str) -> Any:
        fmt, size = ROW_FORMATS[t], rows * row_bytes(t, cols)

        def decode(flat: jax.Array, index: jax.Array) -> jax.Array:
            raw = jax.lax.dynamic_slice_in_dim(flat, index * size, size)  # (size,)
            values = fmt.decode(raw.reshape(-1, fmt.type_size))  # (blocks, bs)
            return values.reshape(rows, cols)

        return decode

    return jax.lax.switch(kind, [branch(t) for t in types], flat, index)


def decode_layer(
    data: Array, kind: Array, types: tuple[str, ...], cols: int
) -> jax.Array:
    """One layer's room ``(rows, row_bytes_max)`` of ``types[kind]`` -> values."""
    index = jnp.int32(0)  # the whole layer: one block of every row
    return decode_rows(data.reshape(-1), kind, types, cols, index, data.shape[-2])


def decode_block(w: MixedGGMLWeight, index: Array, rows: int) -> jax.Array:
    """Rows ``[index * rows, (index + 1) * rows)`` of the one layer ``w`` -> float32."""
    return decode_rows(w.data.reshape(-1), w.kind, w.types, w.cols, index, rows)


_FLOAT32 = np.dtype(np.float32)


@register_weight_node
@dataclasses.dataclass(frozen=True)
class MixedGGMLWeight:
    """A frozen stacked GGUF tensor whose layers have different ggml types.

    Attributes:
        data: uint8 ``(*lead, rows, row_bytes_max)``: each layer's room; its
            GGUF bytes packed at the start (`decode_rows`), then zeros.
        kind: int32 ``(*lead,)``: each layer's index into ``types``.
        types: the ggml types (keys of `ROW_FORMATS`) (static).
        cols: values per row (GGUF ``ne[0]``) (static).
        dtype: the dtype `to_dense` gives (static; float32 by default).
    """

    data: Any
    kind: Any
    types: tuple[str, ...] = dataclasses.field(default=(), metadata=STATIC)
    cols: int = dataclasses.field(default=0, metadata=STATIC)
    dtype: Any = dataclasses.field(default=_FLOAT32, metadata=STATIC)

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", np.dtype(self.dtype))

    @property
    def shape(self) -> tuple[int, ...]:
        """Logical shape ``(*lead, rows, cols)``."""
        return (*(int(s) for s in self.data.shape[:-1]), self.cols)

    @property
    def ndim(self) -> int:
        """Number of axes of the logical tensor."""
        return len(self.shape)

    @property
    def ggml_type(self) -> str:
        """The types joined by ``+`` (``"Q4_K+Q6_K"``), for reports."""
        return "+".join(self.types)

    def __getitem__(self, index: Any) -> MixedGGMLWeight:
        """Index the leading (layer) axes."""
        return jax.tree_util.tree_map(lambda a: a[index], self)

    def __repr__(self) -> str:
        return f"MixedGGMLWeight(shape={self.shape}, types={self.types})"


@functools.partial(jax.jit, static_argnums=1)
def _dense(w: MixedGGMLWeight, dtype: np.dtype) -> jax.Array:
    lead = w.data.shape[:-2]
    data = w.data.reshape(-1, *w.data.shape[-2:])  # (layers, rows, row_bytes_max)
    kind = jnp.asarray(w.kind).reshape(-1)

    def one(pair: tuple[jax.Array, jax.Array]) -> jax.Array:
        return decode_layer(pair[0], pair[1], w.types, w.cols).astype(dtype)

    return jax.lax.map(one, (data, kind)).reshape(*lead, -1, w.cols)


def dequantize_mixed(w: MixedGGMLWeight, dtype: Any = None) -> jax.Array:
    """The values of ``w`` (each layer as `gguf.quants.dequantize` gives it)."""
    return _dense(w, np.dtype(w.dtype if dtype is None else dtype))


logical_shape.register(MixedGGMLWeight, lambda w: w.shape)
logical_dtype.register(MixedGGMLWeight, lambda w: w.dtype)
to_dense.register(MixedGGMLWeight, dequantize_mixed)


def mixed_ggml_weight(
    layers: list[tuple[np.ndarray, str]], shape: tuple[int, ...]
) -> MixedGGMLWeight:
    """A `MixedGGMLWeight` of ``shape = (L, rows, cols)`` from each layer's bytes.

    ``layers[l] = (raw uint8, ggml type)``. For tests and small tensors; the GGUF
    loader fills the padded buffer layer by layer instead.

    Raises:
        FormatError: a type not in `ROW_FORMATS`, or bytes of the wrong size.
    """
    n_layers, rows, cols = (int(s) for s in shape)
    types = tuple(sorted({t for _, t in layers}))
    widest = max(row_bytes(t, cols) for t in check_types(types, cols))
    data = np.zeros((n_layers, rows, widest), np.uint8)
    for i, (raw, t) in enumerate(layers):
        n = row_bytes(t, cols)
        if raw.size != rows * n:
            raise FormatError(
                f"layer {i}: {t} of shape {(rows, cols)} needs {rows * n} bytes, "
                f"got {raw.size}"
            )
        data[i].reshape(-1)[: rows * n] = raw.reshape(-1)  # packed, then zeros
    kind = np.array([types.index(t) for _, t in layers], np.int32)
    return MixedGGMLWeight(jnp.asarray(data), jnp.asarray(kind), types, cols)


def check_types(types: tuple[str, ...], cols: int) -> tuple[str, ...]:
    """``types`` if each is a `ROW_FORMATS` type whose blocks divide ``cols``.

    Raises:
        FormatError: naming the type and what it needs.
    """
    for t in types:
        fmt = ROW_FORMATS.get(t)
        if fmt is None:
            raise FormatError(f"MixedGGMLWeight keeps {sorted(ROW_FORMATS)}, not {t!r}")
        if cols % fmt.block_size:
            raise FormatError(
                f"{t} rows of {cols} values: the row length must be a multiple of "
                f"{fmt.block_size}"
            )
    return types


BLOCK_VALUES = 1 << 18
"""Values decoded at a time (1 MiB in float32), as `GGML_BLOCK_VALUES`."""


@weight_matmul.register(MixedGGMLWeight)
def mixed_matmul(
    w: MixedGGMLWeight, x: jax.Array, matmul_dtype: str | None = None
) -> jax.Array:
    """``x Ŵᵀ`` for one layer ``w: (out, in)``, ``x: (..., in)``, by blocks of rows.

    ``Ŵ`` is decoded in ``x``'s dtype, or in ``matmul_dtype`` (then float32
    accumulation). The result has ``x``'s dtype.

    Raises:
        ShapeError: ``w`` is stacked (index it per layer: the model's layer scan does).
    """
    if w.ndim != 2:
        raise ShapeError(
            f"a MixedGGMLWeight multiplies one layer (out, in), got {w.shape}: index "
            f"the stacked weight per layer (scan over layers) first"
        )
    out, fan_in = w.shape
    rows = rows_within(out, fan_in, BLOCK_VALUES)
    dtype = jnp.dtype(matmul_dtype or x.dtype)
    xs = x.reshape(-1, fan_in)  # (n, in)
    y = _product(w, xs, rows, dtype)  # (n, out)
    return y.reshape(*x.shape[:-1], out)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _product(w: MixedGGMLWeight, xs: jax.Array, rows: int, dtype: Any) -> jax.Array:
    """``xs Ŵᵀ``: ``(n, in) -> (n, out)``, ``rows`` rows of ``Ŵ`` decoded at a time."""
    xd = xs.astype(dtype)
    blocks = jnp.arange(w.shape[0] // rows, dtype=jnp.int32)  # (out / rows,)

    def block(index: jax.Array) -> jax.Array:  # -> (n, rows)
        wb = decode_block(w, index, rows).astype(dtype)  # (rows, in)
        return jnp.einsum("ni,ri->nr", xd, wb, preferred_element_type=jnp.float32)

    y = jax.lax.map(block, blocks)  # (out / rows, n, rows)
    return jnp.moveaxis(y, 0, 1).reshape(xs.shape[0], -1).astype(xs.dtype)


def _fwd(w: MixedGGMLWeight, xs: jax.Array, rows: int, dtype: Any) -> Any:
    return _product(w, xs, rows, dtype), w


def _bwd(rows: int, dtype: Any, w: MixedGGMLWeight, g: jax.Array) -> Any:
    n, fan_in = g.shape[0], w.cols
    gb = jnp.moveaxis(g.reshape(n, -1, rows), 1, 0).astype(dtype)  # (out/rows, n, rows)
    blocks = jnp.arange(gb.shape[0], dtype=jnp.int32)  # (out / rows,)

    def step(dx: jax.Array, pair: tuple[jax.Array, jax.Array]) -> Any:
        index, gk = pair  # (), (n, rows)
        wb = decode_block(w, index, rows).astype(dtype)  # (rows, in)
        dx = dx + jnp.einsum("nr,ri->ni", gk, wb, preferred_element_type=jnp.float32)
        return dx, None

    dx0 = jnp.zeros((n, fan_in), jnp.float32)
    dx, _ = jax.lax.scan(step, dx0, (blocks, gb))  # (n, in)
    frozen = jax.tree_util.tree_map(
        lambda a: np.zeros(a.shape, jax.dtypes.float0), w
    )  # the base is frozen: no gradient
    return frozen, dx.astype(g.dtype)


_product.defvjp(_fwd, _bwd)


__all__ = [
    "ROW_FORMATS",
    "MixedGGMLWeight",
    "check_types",
    "decode_block",
    "decode_layer",
    "decode_rows",
    "dequantize_mixed",
    "mixed_ggml_weight",
    "mixed_matmul",
    "row_bytes",
]
