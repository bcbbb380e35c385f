"""llama.cpp block formats Q8_0, Q4_0, Q4_1, bit-compatible with GGUF.

Each format cuts the last axis into blocks of 32 values (GGUF's ``ne[0]`` is the row
length, so blocks never cross rows). A block stores a float16 scale ``d`` (and for
Q4_1 a float16 minimum ``m``) followed by the codes; `from_ggml` and `to_ggml`
convert between GGUF's interleaved bytes and a `QuantizedWeight` without touching a
bit. The quantizers reproduce llama.cpp's reference quantizers
(``quantize_row_q*_ref`` in ``ggml-quants.c``)::

    Q8_0: d = max|x| / 127,     q = round_half_away(x / d) ∈ [-127, 127],  x̂ = d q
    Q4_0: d = x[argmax|x|] / -8, q = min(15, trunc(x / d + 8.5)),        x̂ = d (q - 8)
    Q4_1: d = (max - min) / 15,  q = min(15, trunc((x - min) / d + 0.5)), x̂ = d q + m

where ``1 / d`` is taken as 0 when ``d == 0`` and ``d``, ``m`` are rounded to float16.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from entrenar.errors import FormatError, QuantizationError
from entrenar.quant.kquant import FORMATS, GGMLWeight, ggml_weight
from entrenar.quant.weight import (
    QuantizedWeight,
    pack_nibbles,
    quotient,
    to_blocks,
    unpack_nibbles,
    validated_blocks,
)

QK = 32
"""Values per block in Q8_0, Q4_0 and Q4_1."""

BLOCK_BYTES = {"Q8_0": 2 + QK, "Q4_0": 2 + QK // 2, "Q4_1": 4 + QK // 2}
"""Bytes per 32-value block as stored in GGUF."""

HEAD_BYTES = {"Q8_0": 2, "Q4_0": 2, "Q4_1": 4}
"""Bytes before a block's codes: float16 ``d`` (and Q4_1's float16 ``m``)."""


def block_tails(blocks: np.ndarray, at: int, out: np.ndarray) -> np.ndarray:
    """Bytes ``at:`` of each block ``blocks (..., size)`` into ``out (..., size - at)``.

    Each block's tail moves as one opaque numpy item (``V16``, ``V32``): one strided
    copy loop over the blocks, not a loop call per 16-byte row. ``blocks``' last
    axis must be contiguous; ``out`` (uint8, C-contiguous rows) is returned.
    """
    item = f"V{blocks.shape[-1] - at}"  # a block's tail as one item
    out.view(item)[..., 0] = blocks[..., at:].view(item)[..., 0]  # (...)
    return out


def split_blocks(
    blocks: np.ndarray,
    kind: str,
    codes: np.ndarray,
    d: np.ndarray,
    m: np.ndarray | None = None,
) -> None:
    """Write Q8_0 / Q4_0 / Q4_1 ``blocks`` into their `QuantizedWeight` fields.

    ``blocks (..., nb, BLOCK_BYTES[kind])`` uint8 as stored; ``codes (..., nb,
    BLOCK_BYTES - HEAD_BYTES)`` uint8 receives each block's code bytes, ``d (..., nb)``
    float16 its scale and, for Q4_1, ``m (..., nb)`` float16 its offset.

    The code bytes move by `block_tails` (ten times faster on a layer than a copy
    of the byte columns).
    """
    if blocks.strides[-1] != 1:  # a block's bytes must lie side by side
        blocks = np.ascontiguousarray(blocks)
    block_tails(blocks, HEAD_BYTES[kind], codes)  # (..., nb, width)
    d[...] = blocks[..., 0:2].view("<f2")[..., 0]  # (..., nb)
    if m is not None:
        m[...] = blocks[..., 2:4].view("<f2")[..., 0]


def _inverse(d: jax.Array) -> jax.Array:
    """``1 / d``, or 0 where ``d == 0`` (llama.cpp's ``id = d ? 1/d : 0``)."""
    safe = jnp.where(d == 0, jnp.float32(1), d)
    return jnp.where(d == 0, jnp.float32(0), jnp.float32(1) / safe)


def _rounded_product(x: jax.Array, y: jax.Array) -> jax.Array:
    """``x · y`` rounded to float32 before the caller adds to it, as C's ``x*id + 8.5``.

    XLA:CPU lets LLVM fuse a product and a following sum into one FMA (one
    rounding), so ``trunc(x·id + 8.5)`` fell on the other side of an integer where
    the rounded product sits on it (grid data: 4 of 1280 Q4_0 rows differed from
    gguf's bytes). A select between the two keeps them apart; the quantizers reject
    NaN, so mapping it to 0 changes nothing they return.
    """
    p = x * y
    return jnp.where(jnp.isnan(p), jnp.float32(0), p)


def _round_half_away(v: jax.Array) -> jax.Array:
    """C's ``roundf``: round half away from zero, exactly (as gguf's ``np_roundf``)."""
    a = jnp.abs(v)
    floored = jnp.floor(a)
    return jnp.sign(v) * (floored + jnp.floor(2 * (a - floored)))


def check_float16(scales: jax.Array, offsets: Any, scheme: str) -> None:
    """Raise if a concrete block scale (or minimum) overflowed float16 to Inf."""
    for a in (scales, offsets):
        if a is None or isinstance(a, jax.core.Tracer):
            continue
        bad = ~np.isfinite(np.asarray(a, np.float32))
        if bad.any():
            raise QuantizationError(
                f"{scheme!r} stores block scales as float16 (max 65504): "
                f"{int(bad.sum())} block(s) overflow, first at block index "
                f"{tuple(int(i) for i in np.argwhere(bad)[0])}; rescale the tensor "
                f"or use a scheme with float32 scales (nf4, int4, int8)"
            )


def quantize_ggml(w: Any, scheme: str) -> QuantizedWeight:
    """Quantize ``w: (*lead, cols)`` to ``"q8_0"``, ``"q4_0"`` or ``"q4_1"``.

    Gives the same codes and float16 scales as llama.cpp's reference quantizer.

    Raises:
        ShapeError: ``cols`` is not a multiple of 32.
        QuantizationError: ``w`` holds NaN or Inf, or values so large that a block
            scale overflows float16 (llama.cpp would store Inf); checked when ``w``
            is concrete.
    """
    dtype = np.dtype(jnp.asarray(w).dtype)
    x = validated_blocks(w, QK, scheme)  # (*lead, nb, 32)
    offsets = None
    if scheme == "q8_0":
        d = quotient(jnp.max(jnp.abs(x), axis=-1, keepdims=True), 127)
        codes = _round_half_away(x * _inverse(d)).astype(jnp.int8)
        codes = codes.reshape(*codes.shape[:-2], -1)  # (*lead, cols)
    elif scheme == "q4_0":
        imax = jnp.argmax(jnp.abs(x), axis=-1, keepdims=True)
        d = jnp.take_along_axis(x, imax, axis=-1) / jnp.float32(-8)
        q = jnp.trunc(_rounded_product(x, _inverse(d)) + jnp.float32(8.5))
        codes = pack_nibbles(jnp.clip(q, 0, 15))  # (*lead, cols // 2)
    elif scheme == "q4_1":
        lo = jnp.min(x, axis=-1, keepdims=True)
        d = quotient(jnp.max(x, axis=-1, keepdims=True) - lo, 15)
        q = jnp.trunc(_rounded_product(x - lo, _inverse(d)) + jnp.float32(0.5))
        codes = pack_nibbles(jnp.clip(q, 0, 15))
        offsets = lo[..., 0].astype(jnp.float16)  # (*lead, nb)
    else:
        raise QuantizationError(f"not a llama.cpp block format: {scheme!r}")
    scales = d[..., 0].astype(jnp.float16)  # (*lead, nb)
    check_float16(scales, offsets, scheme)
    return QuantizedWeight(
        codes, scales, offsets, scheme=scheme, block_size=QK, dtype=dtype
    )


def dequantize_ggml(q: QuantizedWeight, dtype: Any) -> jax.Array:
    """Values of a Q8_0 / Q4_0 / Q4_1 node, as llama.cpp's dequantizers compute them."""
    d = q.scales.astype(jnp.float32)[..., None]  # (*lead, nb, 1)
    if q.scheme == "q8_0":
        x = to_blocks(q.codes, QK).astype(jnp.float32) * d
    elif q.scheme == "q4_0":
        x = d * (unpack_nibbles(q.codes, QK).astype(jnp.float32) - jnp.float32(8))
    else:
        m = q.offsets.astype(jnp.float32)[..., None]
        x = d * unpack_nibbles(q.codes, QK).astype(jnp.float32) + m
    return x.reshape(*x.shape[:-2], -1).astype(dtype)  # (*lead, cols)


def from_ggml(
    raw: np.ndarray, ggml_type: str, shape: tuple[int, ...]
) -> QuantizedWeight | GGMLWeight:
    """A weight node from a tensor's bytes as stored in GGUF, bit for bit.

    Q8_0, Q4_0 and Q4_1 become a `QuantizedWeight`; the K-quants (Q2_K ... Q6_K),
    BF16 and F16 a `GGMLWeight` holding the bytes as they are.

    Args:
        raw: the tensor's bytes (uint8, any shape; read as a flat buffer).
        ggml_type: ``"Q8_0"``, ``"Q4_0"``, ``"Q4_1"`` or a key of
            `entrenar.quant.kquant.FORMATS` (case-insensitive).
        shape: the tensor's shape in row-major numpy order, ``(*lead, cols)`` with
            ``cols`` = GGUF ``ne[0]``.

    Raises:
        FormatError: unknown type, ``cols`` not a multiple of 32, or ``raw`` of the
            wrong length or dtype (checked before anything is allocated).

    Example:
        >>> import numpy as np
        >>> block = np.concatenate([np.float16(0.5).reshape(1).view(np.uint8),
        ...                         np.arange(32, dtype=np.int8).view(np.uint8)])
        >>> q = from_ggml(block, "Q8_0", (1, 32))
        >>> q.shape, float(dequantize_ggml(q, np.float32)[0, 3])
        ((1, 32), 1.5)
    """
    kind = str(ggml_type).upper()
    if kind in FORMATS:
        return ggml_weight(raw, kind, shape)
    if kind not in BLOCK_BYTES:
        raise FormatError(
            f"GGML type {ggml_type!r} is not one entrenar.quant keeps quantized; "
            f"expected one of {sorted([*BLOCK_BYTES, *FORMATS])} (dequantize other "
            f"types on load)"
        )
    shape = tuple(int(s) for s in shape)
    if len(shape) < 1 or any(s <= 0 for s in shape) or shape[-1] % QK:
        raise FormatError(
            f"{kind} tensor of shape {shape}: the row length (GGUF ne[0], the last "
            f"numpy axis) must be a positive multiple of {QK}"
        )
    raw = np.asarray(raw)
    if raw.dtype != np.uint8:
        raise FormatError(f"{kind} tensor bytes must be uint8, got {raw.dtype}")
    n_blocks = int(np.prod(shape)) // QK
    expected = n_blocks * BLOCK_BYTES[kind]
    if raw.size != expected:
        raise FormatError(
            f"{kind} tensor of shape {shape} needs {n_blocks} blocks x "
            f"{BLOCK_BYTES[kind]} bytes = {expected} bytes, got {raw.size}: the file "
            f"is truncated or the shape/type is wrong"
        )
    lead, nb = shape[:-1], shape[-1] // QK
    blocks = raw.reshape(*lead, nb, BLOCK_BYTES[kind])  # (*lead, nb, bytes)
    codes = np.empty((*lead, nb, BLOCK_BYTES[kind] - HEAD_BYTES[kind]), np.uint8)
    d = np.empty((*lead, nb), np.float16)
    m = np.empty((*lead, nb), np.float16) if kind == "Q4_1" else None
    split_blocks(blocks, kind, codes, d, m)
    return QuantizedWeight(
        _put((codes.view(np.int8) if kind == "Q8_0" else codes).reshape(*lead, -1)),
        _put(d),
        None if m is None else _put(m),
        scheme=kind.lower(),
        block_size=QK,
        dtype=np.dtype(np.float32),
    )


def _put(a: np.ndarray) -> jax.Array:
    """A host array as a JAX array by a plain transfer, no program compiled.

    (``jnp.asarray`` of a strided view compiles a copy per shape.)
    """
    return jax.device_put(np.ascontiguousarray(a))


def to_ggml(q: QuantizedWeight | GGMLWeight) -> tuple[np.ndarray, str]:
    """GGUF bytes of a Q8_0 / Q4_0 / Q4_1 node or a `GGMLWeight`.

    Returns ``(raw uint8 (n_bytes,), ggml_type)``: the exact inverse of `from_ggml`.

    Raises:
        QuantizationError: the node uses another scheme (quantize to one of the
            llama.cpp formats first, or write it dequantized).
    """
    if isinstance(q, GGMLWeight):
        return np.asarray(q.data, np.uint8).reshape(-1), q.ggml_type
    if q.scheme not in ("q8_0", "q4_0", "q4_1"):
        raise QuantizationError(
            f"to_ggml writes q8_0/q4_0/q4_1 nodes, got scheme {q.scheme!r}: "
            f"requantize with quantize(w, scheme='q4_0') or store it dequantized"
        )
    kind = q.scheme.upper()
    lead = q.shape[:-1]
    nb = q.shape[-1] // QK
    parts = [np.asarray(q.scales, np.float16).reshape(*lead, nb, 1).view(np.uint8)]
    if kind == "Q4_1":
        parts.append(
            np.asarray(q.offsets, np.float16).reshape(*lead, nb, 1).view(np.uint8)
        )
    codes = np.asarray(q.codes)
    parts.append(codes.reshape(*lead, nb, -1).view(np.uint8))
    return np.concatenate(parts, axis=-1).reshape(-1), kind


__all__ = [
    "BLOCK_BYTES",
    "HEAD_BYTES",
    "QK",
    "block_tails",
    "check_float16",
    "dequantize_ggml",
    "from_ggml",
    "quantize_ggml",
    "split_blocks",
    "to_ggml",
]
