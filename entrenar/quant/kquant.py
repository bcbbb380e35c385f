"""GGUF's K-quant and 16-bit float tensors kept as stored: `GGMLWeight`.

A `GGMLWeight` holds a tensor's bytes exactly as the GGUF file stores them, one row
(GGUF ``ne[0]`` values, the last numpy axis) after another: ``data`` is uint8
``(*lead, rows, row_bytes)`` and the ggml type is static. Each row is a whole number
of blocks (``super-blocks'' of 256 values for the K-quants, one value for BF16/F16),
so rows can be permuted, sliced and stacked in their bytes. The decoders below are
written once over the array namespace (numpy or `jax.numpy`): `entrenar.io`'s numpy
loader and the node's in-graph dequantization run the same formulas, which are
`gguf.quants`' (llama.cpp's ``dequantize_row_*``), float32 operation for operation:

- ``Q2_K`` (84 B): ``scales[16], qs[64], d, dmin``; 16 sub-blocks of 16,
  ``x = (d·(sc & 15))·q − dmin·(sc >> 4)`` with 2-bit ``q``.
- ``Q3_K`` (110 B): ``hmask[32], qs[64], scales[12], d``; 16 sub-blocks of 16 with
  6-bit scales ``s − 32``; ``x = (d·s)·(q_lo − 4·(1 − hbit))``.
- ``Q4_K`` (144 B): ``d, dmin, scales[12], qs[128]``; 8 sub-blocks of 32 with 6-bit
  scale ``sc`` and min ``mn``; ``x = (d·sc)·q − dmin·mn``.
- ``Q5_K`` (176 B): Q4_K plus ``qh[32]`` (bit ``s`` of ``qh[l]`` is bit 4 of value
  ``l`` of sub-block ``s``) before ``qs``.
- ``Q6_K`` (210 B): ``ql[128], qh[64], scales[16] int8, d``; 16 sub-blocks of 16,
  ``x = (d·sc)·(q − 32)`` with 4 low bits from ``ql`` and 2 high from ``qh``.
- ``BF16``: the high half of a float32; ``F16``: IEEE half.

``d``, ``dmin`` are little-endian float16. The matmul (`entrenar.quant.linear`)
decodes a block of rows at a time, never the whole matrix.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from entrenar.errors import FormatError
from entrenar.nn.layers import embedding_rows
from entrenar.nn.weight_node import (
    STATIC,
    logical_dtype,
    logical_shape,
    register_weight_node,
    to_dense,
)

Array = Any  # numpy or JAX array: the decoders run on both


def _xp(a: Array) -> Any:
    return np if isinstance(a, np.ndarray) else jnp


def _le(b: Array, dtype: Any) -> Array:
    """Little-endian values from bytes ``(..., k)``, ``k`` = itemsize -> ``(...)``."""
    if isinstance(b, np.ndarray):
        return np.ascontiguousarray(b).view(np.dtype(dtype).newbyteorder("<"))[..., 0]
    return jax.lax.bitcast_convert_type(b, dtype)


def _f16(b: Array) -> Array:
    """float16 ``(..., 2)`` bytes as float32 ``(...)``."""
    return _le(b, np.float16).astype(np.float32)


def _i8(b: Array) -> Array:
    """uint8 bytes read as int8 (same shape)."""
    if isinstance(b, np.ndarray):
        return b.view(np.int8)
    return jax.lax.bitcast_convert_type(b, jnp.int8)


def _wide(b: Array, shape: tuple[int, ...]) -> Array:
    """Bytes of ``shape`` for cutting bit fields: int32 in JAX, uint8 in numpy.

    The same integers: XLA's CPU code vectorizes int32 shifts (uint8 ones run 3-5x
    slower), numpy's uint8 ones are fastest. Signed steps happen in float32, where
    these small integers are exact.
    """
    if isinstance(b, np.ndarray):
        return b.reshape(shape)
    return b.astype(np.int32).reshape(shape)


def _fields(x: Array, shifts: list[int], mask: int, axis: int) -> Array:
    """``(x >> s) & mask`` for each shift, laid along ``axis`` (size 1 in ``x``).

    Scalar shifts, joined: XLA's CPU code vectorizes these, where shifts by a
    broadcast array of amounts run 3-5x slower.
    """
    return _xp(x).concatenate([(x >> s) & mask for s in shifts], axis=axis)


def _k_scales(s: Array) -> tuple[Array, Array]:
    """Q4_K/Q5_K's 12 scale bytes ``(n, 12)`` -> 6-bit scales and mins, ``(n, 8)``.

    Sub-block ``j < 4``: ``sc = s[j] & 63``, ``mn = s[j+4] & 63``; ``j >= 4``:
    ``sc = (s[j+4] & 15) | (s[j-4] >> 6) << 4``,
    ``mn = (s[j+4] >> 4) | (s[j] >> 6) << 4``.
    """
    xp = _xp(s)
    lo, mid, hi = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = xp.concatenate([lo & 63, (hi & 15) | ((lo >> 6) << 4)], axis=-1)
    mn = xp.concatenate([mid & 63, (hi >> 4) | ((mid >> 6) << 4)], axis=-1)
    return sc.astype(np.float32), mn.astype(np.float32)


# The decoders keep each value's position as axes, (n, ..., 16 or 32), and give
# the per-sub-block factors size-1 axes, so nothing is reshaped before the last
# step: value i of a block sits at the row-major index of its axes.


def q2_k(b: Array) -> Array:
    """Q2_K blocks ``(n, 84)`` -> float32 ``(n, 256)``."""
    n = b.shape[0]
    sc = _wide(b[:, 0:16], (n, 16))  # sub-block 8h + 2k + s: half h, field k, s
    d, dmin = _f16(b[:, 80:82])[:, None], _f16(b[:, 82:84])[:, None]
    dl = (d * (sc & 15).astype(np.float32)).reshape(n, 2, 4, 2, 1)
    ml = (dmin * (sc >> 4).astype(np.float32)).reshape(n, 2, 4, 2, 1)
    qs = _wide(b[:, 16:80], (n, 2, 1, 2, 16))
    q = _fields(qs, [0, 2, 4, 6], 3, axis=2).astype(np.float32)  # (n, 2, 4, 2, 16)
    return (dl * q - ml).reshape(n, 256)


def q3_k(b: Array) -> Array:
    """Q3_K blocks ``(n, 110)`` -> float32 ``(n, 256)``."""
    n = b.shape[0]
    d = _f16(b[:, 108:110])[:, None]
    low = _fields(_wide(b[:, 96:104], (n, 1, 8)), [0, 4], 15, axis=1)  # (n, 2, 8)
    high = _fields(_wide(b[:, 104:108], (n, 1, 4)), [0, 2, 4, 6], 3, axis=1)
    sc = low.reshape(n, 16) | (high.reshape(n, 16) << 4)  # 6 bits
    dl = (d * (sc.astype(np.float32) - 32)).reshape(n, 2, 4, 2, 1)
    ql = _fields(_wide(b[:, 32:96], (n, 2, 1, 2, 16)), [0, 2, 4, 6], 3, axis=2)
    qh = _fields(_wide(b[:, 0:32], (n, 1, 2, 16)), list(range(8)), 1, axis=1)
    minus = ((qh.reshape(n, 2, 4, 2, 16) ^ 1) << 2).astype(np.float32)  # bit 0: 4
    return (dl * (ql.astype(np.float32) - minus)).reshape(n, 256)


def q4_k(b: Array) -> Array:
    """Q4_K blocks ``(n, 144)`` -> float32 ``(n, 256)``."""
    n = b.shape[0]
    d, dmin = _f16(b[:, 0:2])[:, None], _f16(b[:, 2:4])[:, None]
    sc, mn = _k_scales(_wide(b[:, 4:16], (n, 12)))  # (n, 8): sub-block 2c + j
    qs = _wide(b[:, 16:144], (n, 4, 1, 32))
    q = _fields(qs, [0, 4], 15, axis=2).astype(np.float32)  # (n, 4, 2, 32): c, j
    x = (d * sc).reshape(n, 4, 2, 1) * q - (dmin * mn).reshape(n, 4, 2, 1)
    return x.reshape(n, 256)


def q5_k(b: Array) -> Array:
    """Q5_K blocks ``(n, 176)`` -> float32 ``(n, 256)``."""
    n = b.shape[0]
    d, dmin = _f16(b[:, 0:2])[:, None], _f16(b[:, 2:4])[:, None]
    sc, mn = _k_scales(_wide(b[:, 4:16], (n, 12)))
    ql = _fields(_wide(b[:, 48:176], (n, 4, 1, 32)), [0, 4], 15, axis=2)
    qh = _fields(_wide(b[:, 16:48], (n, 1, 32)), list(range(8)), 1, axis=1)
    q = (ql | (qh.reshape(n, 4, 2, 32) << 4)).astype(np.float32)  # (n, 4, 2, 32)
    x = (d * sc).reshape(n, 4, 2, 1) * q - (dmin * mn).reshape(n, 4, 2, 1)
    return x.reshape(n, 256)


def q6_k(b: Array) -> Array:
    """Q6_K blocks ``(n, 210)`` -> float32 ``(n, 256)``."""
    n = b.shape[0]
    sc = _i8(b[:, 192:208]).astype(np.float32)  # (n, 16)
    d = _f16(b[:, 208:210])[:, None]
    dl = (d * sc).reshape(n, 2, 2, 2, 2, 1)
    # Value 128h + 32k + 16s + l, quarter k = 2k2 + c: nibble k2 of ql byte
    # 64h + 32c + 16s + l, bits 2k..2k+1 of qh byte 32h + 16s + l.
    ql = _fields(_wide(b[:, 0:128], (n, 2, 1, 2, 2, 16)), [0, 4], 15, axis=2)
    qh = _fields(_wide(b[:, 128:192], (n, 2, 1, 2, 16)), [0, 2, 4, 6], 3, axis=2)
    q = (ql | (qh.reshape(n, 2, 2, 2, 2, 16) << 4)).astype(np.float32) - 32
    return (dl * q).reshape(n, 256)  # q: (n, h, k2, c, s, l)


def bf16(b: Array) -> Array:
    """BF16 ``(n, 2)`` bytes -> float32 ``(n, 1)``: the bits shifted up by 16."""
    u = _le(b, np.uint16).astype(np.uint32) << 16  # (n,)
    if isinstance(u, np.ndarray):
        return u.view(np.float32)[:, None]
    return jax.lax.bitcast_convert_type(u, jnp.float32)[:, None]


def f16(b: Array) -> Array:
    """F16 ``(n, 2)`` bytes -> float32 ``(n, 1)``."""
    return _f16(b)[:, None]


class Format(NamedTuple):
    """One ggml type a `GGMLWeight` keeps: values and bytes per block, decoder."""

    block_size: int
    type_size: int
    decode: Callable[[Array], Array]


FORMATS: dict[str, Format] = {
    "Q2_K": Format(256, 84, q2_k),
    "Q3_K": Format(256, 110, q3_k),
    "Q4_K": Format(256, 144, q4_k),
    "Q5_K": Format(256, 176, q5_k),
    "Q6_K": Format(256, 210, q6_k),
    "BF16": Format(1, 2, bf16),
    "F16": Format(1, 2, f16),
}
"""The ggml types `GGMLWeight` keeps as stored, by name."""


def decode_rows(data: Array, ggml_type: str) -> Array:
    """Rows of bytes ``(*lead, rows, row_bytes)`` -> float32 ``(*lead, rows, cols)``."""
    fmt = FORMATS[ggml_type]
    lead, row_bytes = tuple(data.shape[:-1]), int(data.shape[-1])
    values = fmt.decode(data.reshape(-1, fmt.type_size))  # (blocks, block_size)
    return values.reshape(*lead, row_bytes // fmt.type_size * fmt.block_size)


_FLOAT32 = np.dtype(np.float32)


@register_weight_node
@dataclasses.dataclass(frozen=True)
class GGMLWeight:
    """A frozen GGUF tensor in its file format (K-quants, BF16, F16).

    Attributes:
        data: uint8 ``(*lead, rows, row_bytes)``: each row's blocks as GGUF stores
            them (``row_bytes = cols / block_size * type_size``).
        ggml_type: a key of `FORMATS` (static).
        dtype: the dtype `to_dense` gives (static; float32 by default).
    """

    data: Any
    ggml_type: str = dataclasses.field(default="Q4_K", metadata=STATIC)
    dtype: Any = dataclasses.field(default=_FLOAT32, metadata=STATIC)

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", np.dtype(self.dtype))

    @property
    def shape(self) -> tuple[int, ...]:
        """Logical shape ``(*lead, rows, cols)``."""
        fmt = FORMATS[self.ggml_type]
        *lead, row_bytes = (int(s) for s in self.data.shape)
        return (*lead, row_bytes // fmt.type_size * fmt.block_size)

    @property
    def ndim(self) -> int:
        """Number of axes of the logical tensor."""
        return len(self.shape)

    def __getitem__(self, index: Any) -> GGMLWeight:
        """Index the leading axes (e.g. one layer of a stacked weight)."""
        return jax.tree_util.tree_map(lambda a: a[index], self)

    def __repr__(self) -> str:
        return f"GGMLWeight(shape={self.shape}, ggml_type={self.ggml_type!r})"


@functools.partial(jax.jit, static_argnums=1)
def _dense(w: GGMLWeight, dtype: np.dtype) -> jax.Array:
    return decode_rows(w.data, w.ggml_type).astype(dtype)


def dequantize_node(w: GGMLWeight, dtype: Any = None) -> jax.Array:
    """The values of ``w`` (as `gguf.quants.dequantize` gives them), in ``dtype``."""
    return _dense(w, np.dtype(w.dtype if dtype is None else dtype))


logical_shape.register(GGMLWeight, lambda w: w.shape)
logical_dtype.register(GGMLWeight, lambda w: w.dtype)
to_dense.register(GGMLWeight, dequantize_node)


@embedding_rows.register(GGMLWeight)
def embedding_lookup(w: GGMLWeight, tokens: jax.Array) -> jax.Array:
    """Rows ``tokens: (...)`` of the table ``w: (V, D)``, decoded -> ``(..., D)``.

    Only the looked-up rows' bytes are gathered and decoded (``(..., row_bytes)``
    uint8), never the whole table: Llama-3-8B's Q4_K embedding stays 0.3 GB instead
    of 2.1 GB in float32. The values are the rows of `to_dense` exactly. The table is
    frozen (its bytes get no gradient); an id outside ``[0, V)`` gives row 0's
    clamp-free garbage rather than `jnp.take`'s NaN, so check ids upstream.
    """
    rows = jnp.take(w.data, tokens, axis=0, mode="clip")  # (..., row_bytes)
    return decode_rows(rows, w.ggml_type).astype(w.dtype)  # (..., D)


def ggml_weight(raw: np.ndarray, ggml_type: str, shape: tuple[int, ...]) -> GGMLWeight:
    """A `GGMLWeight` of ``shape`` (numpy order) from a tensor's GGUF bytes.

    Raises:
        FormatError: not a type of `FORMATS`, a row that is not whole blocks, or
            ``raw`` of the wrong size or dtype.

    Example:
        >>> w = ggml_weight(np.array([0, 63, 0, 192], np.uint8), "BF16", (1, 2))
        >>> w.shape, to_dense(w).tolist()  # bits 0x3f00, 0xc000
        ((1, 2), [[0.5, -2.0]])
    """
    kind = str(ggml_type).upper()
    fmt = FORMATS.get(kind)
    if fmt is None:
        raise FormatError(f"GGMLWeight keeps {sorted(FORMATS)}, not {ggml_type!r}")
    shape = tuple(int(s) for s in shape)
    if len(shape) < 1 or any(s <= 0 for s in shape) or shape[-1] % fmt.block_size:
        raise FormatError(
            f"{kind} tensor of shape {shape}: the row length (GGUF ne[0], the last "
            f"numpy axis) must be a positive multiple of {fmt.block_size}"
        )
    raw = np.asarray(raw)
    if raw.dtype != np.uint8:
        raise FormatError(f"{kind} tensor bytes must be uint8, got {raw.dtype}")
    row_bytes = shape[-1] // fmt.block_size * fmt.type_size
    want = int(np.prod(shape[:-1], dtype=np.int64)) * row_bytes
    if raw.size != want:
        raise FormatError(
            f"{kind} tensor of shape {shape} needs {want} bytes, got {raw.size}: the "
            f"file is truncated or the shape/type is wrong"
        )
    return GGMLWeight(jnp.asarray(raw.reshape(*shape[:-1], row_bytes)), kind)


__all__ = [
    "FORMATS",
    "Format",
    "GGMLWeight",
    "decode_rows",
    "dequantize_node",
    "embedding_lookup",
    "ggml_weight",
]
