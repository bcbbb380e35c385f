"""ggml tensor types: block sizes and numpy dequantization.

A ggml tensor of type ``T`` stores each row (``ne[0]`` elements, the last numpy axis)
as ``ne[0] / block_size`` blocks of ``type_size`` bytes. The formats, as in ggml's
``ggml-quants.c`` (``d``, ``m``, ``dmin`` are little-endian float16):

- ``Q8_0`` (32 values, 34 B): ``d, q[32] int8``; ``x = d·q``.
- ``Q4_0`` (32, 18 B): ``d, qs[16]``; value ``j < 16`` is the low nibble of ``qs[j]``,
  value ``j + 16`` its high nibble; ``x = d·(q − 8)``.
- ``Q4_1`` (32, 20 B): ``d, m, qs[16]`` as Q4_0; ``x = d·q + m``.
- ``Q5_0``/``Q5_1`` (32, 22/24 B): as Q4_0/Q4_1 plus ``qh`` (uint32) holding bit 4 of
  value ``j`` in bit ``j``; ``x = d·(q − 16)`` / ``x = d·q + m``.
- ``MXFP4`` (32, 17 B): ``e`` (E8M0), ``qs[16]`` as Q4_0's nibbles, each an FP4
  E2M1 code; ``x = E2M1[q]·2^(e − 127)`` (`entrenar.nn.mxfp4`: gpt-oss's experts).
- ``Q2_K`` ... ``Q6_K`` (256 values a super-block), ``BF16``, ``F16``: the decoders
  of `entrenar.quant.kquant` (formats documented there), which the in-graph
  dequantization of a kept `entrenar.quant.GGMLWeight` shares.

All functions take the raw bytes of whole rows and return float32 values;
`dequantize_ggml_into` writes them into a caller's float32 buffer instead, a chunk of
blocks at a time (no float32 temporary of the tensor; Q8_0/Q4_0/Q4_1 and the float
types written in place, two numpy threads).
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from typing import NamedTuple

import numpy as np

from entrenar.errors import FormatError, UnsupportedError
from entrenar.nn import host_arrays, mxfp4
from entrenar.quant import kquant
from entrenar.quant.ggml import block_tails
from entrenar.threads import shared_pool


class GGMLType(NamedTuple):
    """One ggml tensor type: its id in GGUF files, name and block geometry."""

    id: int
    name: str
    block_size: int
    type_size: int


_TYPES = [
    GGMLType(0, "F32", 1, 4),
    GGMLType(1, "F16", 1, 2),
    GGMLType(2, "Q4_0", 32, 18),
    GGMLType(3, "Q4_1", 32, 20),
    GGMLType(6, "Q5_0", 32, 22),
    GGMLType(7, "Q5_1", 32, 24),
    GGMLType(8, "Q8_0", 32, 34),
    GGMLType(10, "Q2_K", 256, 84),
    GGMLType(11, "Q3_K", 256, 110),
    GGMLType(12, "Q4_K", 256, 144),
    GGMLType(13, "Q5_K", 256, 176),
    GGMLType(14, "Q6_K", 256, 210),
    GGMLType(15, "Q8_K", 256, 292),
    GGMLType(24, "I8", 1, 1),
    GGMLType(25, "I16", 1, 2),
    GGMLType(26, "I32", 1, 4),
    GGMLType(27, "I64", 1, 8),
    GGMLType(28, "F64", 1, 8),
    GGMLType(30, "BF16", 1, 2),
    GGMLType(39, "MXFP4", 32, 17),
]
GGML_TYPES: dict[int, GGMLType] = {t.id: t for t in _TYPES}
"""Every ggml type id entrenar can size, keyed by id."""
GGML_TYPE_IDS: dict[str, int] = {t.name: t.id for t in _TYPES}
"""Type ids keyed by name (``"Q4_1" -> 3``)."""


def ggml_type(type_id: int) -> GGMLType:
    """Return the `GGMLType` of ``type_id``.

    Raises:
        FormatError: unknown type id.

    >>> ggml_type(3)
    GGMLType(id=3, name='Q4_1', block_size=32, type_size=20)
    """
    t = GGML_TYPES.get(int(type_id))
    if t is None:
        raise FormatError(f"unknown ggml tensor type id {type_id}")
    return t


def row_bytes(type_id: int, n: int) -> int:
    """Bytes of one row of ``n`` values (``n`` must be a whole number of blocks).

    >>> row_bytes(8, 64)
    68
    """
    t = ggml_type(type_id)
    if n % t.block_size:
        raise FormatError(
            f"row length {n} is not a multiple of {t.name}'s block size {t.block_size}"
        )
    return n // t.block_size * t.type_size


def _f16(b: np.ndarray) -> np.ndarray:
    """Little-endian float16 from ``(..., 2)`` uint8 to float32 ``(...)``."""
    return np.ascontiguousarray(b).view("<f2")[..., 0].astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """``(n, k)`` bytes -> ``(n, 2k)`` codes: all low nibbles, then all high nibbles."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _q8_0(b: np.ndarray) -> np.ndarray:
    d = _f16(b[:, 0:2])[:, None]  # (n, 1)
    return d * b[:, 2:].view(np.int8).astype(np.float32)  # (n, 32)


def _q4_0(b: np.ndarray) -> np.ndarray:
    d = _f16(b[:, 0:2])[:, None]
    return d * (_nibbles(b[:, 2:]).astype(np.float32) - 8.0)


def _q4_1(b: np.ndarray) -> np.ndarray:
    d, m = _f16(b[:, 0:2])[:, None], _f16(b[:, 2:4])[:, None]
    return d * _nibbles(b[:, 4:]).astype(np.float32) + m


def _high_bits32(qh: np.ndarray) -> np.ndarray:
    """``(n, 4)`` bytes of a little-endian uint32 -> ``(n, 32)`` bit 4 values (0/16)."""
    bits = np.unpackbits(qh, axis=-1, bitorder="little")  # (n, 32), bit j at j
    return bits.astype(np.uint8) << 4


def _q5_0(b: np.ndarray) -> np.ndarray:
    d = _f16(b[:, 0:2])[:, None]
    q = _nibbles(b[:, 6:]) | _high_bits32(b[:, 2:6])
    return d * (q.astype(np.float32) - 16.0)


def _q5_1(b: np.ndarray) -> np.ndarray:
    d, m = _f16(b[:, 0:2])[:, None], _f16(b[:, 2:4])[:, None]
    q = _nibbles(b[:, 8:]) | _high_bits32(b[:, 4:8])
    return d * q.astype(np.float32) + m


def _mxfp4(b: np.ndarray) -> np.ndarray:
    """MXFP4 blocks ``b: (n, 17)`` -> ``(n, 32)`` (`entrenar.nn.mxfp4`)."""
    return mxfp4.dequantize_ggml(b, (b.shape[0], 32))


def _plain(dtype: str):
    def f(b: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(b).view(dtype).astype(np.float32)

    return f


_DEQUANT = {
    0: _plain("<f4"),
    1: kquant.f16,
    30: kquant.bf16,
    8: _q8_0,
    2: _q4_0,
    3: _q4_1,
    6: _q5_0,
    7: _q5_1,
    10: kquant.q2_k,
    11: kquant.q3_k,
    12: kquant.q4_k,
    13: kquant.q5_k,
    14: kquant.q6_k,
    39: _mxfp4,
}
DEQUANTIZABLE: tuple[str, ...] = tuple(GGML_TYPES[i].name for i in _DEQUANT)
"""Names of the ggml types `dequantize_ggml` supports."""


def _blocks(
    raw: np.ndarray, type_id: int, shape: tuple[int, ...]
) -> tuple[GGMLType, np.ndarray | None]:
    """The type and ``raw``'s blocks ``(n_blocks, type_size)`` (None: no values).

    Checks that the type decodes and that ``raw`` holds exactly the bytes of
    ``shape``'s rows (`dequantize_ggml`'s Raises).
    """
    t = ggml_type(type_id)
    if t.id not in _DEQUANT:
        raise UnsupportedError(
            f"cannot dequantize ggml type {t.name}; "
            f"supported: {', '.join(DEQUANTIZABLE)}"
        )
    n = int(np.prod(shape, dtype=np.int64)) if shape else 1
    rows = n // shape[-1] if shape and shape[-1] else 0
    want = rows * row_bytes(t.id, shape[-1]) if shape else t.type_size
    raw = np.asarray(raw, dtype=np.uint8).reshape(-1)
    if raw.size != want:
        raise FormatError(
            f"{t.name} tensor of shape {shape} needs {want} bytes, got {raw.size}"
        )
    if n == 0:
        return t, None
    return t, raw.reshape(-1, t.type_size)


def dequantize_ggml(
    raw: np.ndarray, type_id: int, shape: tuple[int, ...]
) -> np.ndarray:
    """Decode the raw bytes of a ggml tensor into float32 of ``shape`` (numpy order).

    Args:
        raw: uint8 bytes of the tensor, ``prod(shape[:-1]) * row_bytes`` long.
        type_id: ggml type id (see `GGML_TYPES`).
        shape: numpy shape; the last axis is ggml's ``ne[0]``, the row.

    Returns:
        float32 array of ``shape``.

    Raises:
        FormatError: ``raw`` has the wrong size for ``shape`` and the type.
        UnsupportedError: a type `dequantize_ggml` cannot decode (see `DEQUANTIZABLE`).

    >>> dequantize_ggml(np.array([0, 60, 0, 192], np.uint8), 1, (2,)).tolist()  # F16
    [1.0, -2.0]
    """
    t, blocks = _blocks(raw, type_id, shape)
    if blocks is None:
        return np.zeros(shape, np.float32)
    fn = _DEQUANT[t.id]
    with np.errstate(invalid="ignore", over="ignore"):  # corrupt scales give inf/nan
        return fn(blocks).reshape(shape)


CHUNK_VALUES = 1 << 20
"""Values `dequantize_ggml_into` decodes at a time (4 MiB of float32 output: a
SmolLM2-135M embedding populated and decoded in 50 ms on 2 threads, 55-62 ms in
chunks of 1 MiB)."""

THREADS = 2
"""Numpy threads of `dequantize_ggml_into` (its ufunc loops release the GIL)."""


LOW_NIBBLES = np.uint64(0x0F0F0F0F0F0F0F0F)
"""The low nibble of each byte of a 64-bit word."""


def _scale(b: np.ndarray, at: int) -> np.ndarray:
    """Float16 at byte ``at`` of each block ``b: (n, bytes)``, as float32 ``(n, 1)``."""
    return b[:, at : at + 2].view("<f2")[:, :1].astype(np.float32)  # (n, 1)


def _packed(b: np.ndarray, at: int) -> np.ndarray:
    """Bytes ``at:`` of each block ``b: (n, bytes)``, gathered contiguous ``(n, k)``.

    One strided copy loop over the blocks (`entrenar.quant.ggml.block_tails`).
    """
    return block_tails(b, at, np.empty((b.shape[0], b.shape[1] - at), np.uint8))


def _nibble_codes(b: np.ndarray, at: int) -> np.ndarray:
    """The 32 4-bit codes of each block ``b: (n, at + 16)``, uint8 ``(n, 32)``.

    Code ``j < 16`` is the low nibble of byte ``at + j``, code ``j + 16`` its high
    nibble; computed on 64-bit words (8 bytes a lane), written a half block at a
    time.
    """
    words = _packed(b, at).view(np.uint64)  # (n, 2)
    q = np.empty((b.shape[0], 2), "V16")  # (n, [low 16 | high 16])
    q[:, 0] = (words & LOW_NIBBLES).view("V16")[:, 0]
    q[:, 1] = ((words >> np.uint64(4)) & LOW_NIBBLES).view("V16")[:, 0]
    return q.view(np.uint8)  # (n, 32)


def _q8_0_into(b: np.ndarray, out: np.ndarray) -> None:
    """Q8_0 blocks ``b: (n, 34)`` into ``out: (n, 32)`` float32: ``d·q``."""
    np.copyto(out, _packed(b, 2).view(np.int8), casting="unsafe")  # q exactly
    np.multiply(out, _scale(b, 0), out=out)  # (n, 32) · (n, 1)


def _q4_0_into(b: np.ndarray, out: np.ndarray) -> None:
    """Q4_0 blocks ``b: (n, 18)`` into ``out: (n, 32)``: ``d·(q − 8)``."""
    q = _nibble_codes(b, 2).view(np.int8)  # (n, 32)
    q -= 8  # q − 8 in [-8, 7]
    np.copyto(out, q, casting="unsafe")  # exact small integers
    np.multiply(out, _scale(b, 0), out=out)  # d · (q − 8), as `_q4_0` rounds it


def _q4_1_into(b: np.ndarray, out: np.ndarray) -> None:
    """Q4_1 blocks ``b: (n, 20)`` into ``out: (n, 32)``: ``d·q + m``."""
    np.copyto(out, _nibble_codes(b, 4), casting="unsafe")  # q exactly
    np.multiply(out, _scale(b, 0), out=out)
    np.add(out, _scale(b, 2), out=out)


def _plain_into(dtype: str) -> Callable[[np.ndarray, np.ndarray], None]:
    def f(b: np.ndarray, out: np.ndarray) -> None:
        np.copyto(out, np.ascontiguousarray(b).view(dtype), casting="unsafe")

    return f


def _bf16_into(b: np.ndarray, out: np.ndarray) -> None:
    """BF16 ``b: (n, 2)`` into ``out: (n, 1)``: the 16 bits above 16 zero bits."""
    bits = out.view(np.uint32)  # (n, 1)
    np.left_shift(np.ascontiguousarray(b).view("<u2"), 16, out=bits, dtype=np.uint32)


_INTO: dict[int, Callable[[np.ndarray, np.ndarray], None]] = {
    0: _plain_into("<f4"),
    1: _plain_into("<f2"),
    30: _bf16_into,
    8: _q8_0_into,
    2: _q4_0_into,
    3: _q4_1_into,
}


def _pool() -> concurrent.futures.ThreadPoolExecutor:
    return shared_pool("ggml-dequant", THREADS)


def dequantize_ggml_into(
    raw: np.ndarray, type_id: int, out: np.ndarray, *, populate: bool = False
) -> np.ndarray:
    """`dequantize_ggml` written into ``out``, float32 of the tensor's shape.

    The same values bit for bit, decoded `CHUNK_VALUES` at a time (whole blocks)
    by `THREADS` numpy threads: Q8_0, Q4_0, Q4_1, F32, F16 and BF16 straight into
    ``out``, the other types through a float32 temporary of one chunk. A load fills
    a leaf's host buffer this way without a float32 copy of the tensor.

    Args:
        raw: uint8 bytes of the tensor, ``prod(out.shape[:-1]) * row_bytes`` long.
        type_id: ggml type id (see `GGML_TYPES`).
        out: a C-contiguous float32 array of the tensor's numpy shape.
        populate: fault in each chunk's pages of ``out`` just before decoding it,
            on the thread that decodes it (`entrenar.nn.host_arrays.populate`): for
            a fresh, lazily zeroed ``out``, the page faults spread over the threads
            and each chunk is written while its zeroed lines are still cached.

    Returns:
        ``out``.

    Raises:
        FormatError: ``raw`` has the wrong size for ``out``'s shape and the type, or
            ``out`` is not C-contiguous float32.
        UnsupportedError: a type `dequantize_ggml` cannot decode.
    """
    if out.dtype != np.float32 or not out.flags.c_contiguous:
        raise FormatError(
            f"dequantize_ggml_into writes C-contiguous float32, got {out.dtype} "
            f"(contiguous: {out.flags.c_contiguous})"
        )
    t, blocks = _blocks(raw, type_id, out.shape)
    if blocks is None:
        return out
    dest = out.reshape(-1, t.block_size)  # (n_blocks, block_size)
    into = _INTO.get(t.id)
    fn = _DEQUANT[t.id]
    step = max(1, CHUNK_VALUES // t.block_size)  # blocks a chunk

    def chunk(start: int) -> None:
        b, o = blocks[start : start + step], dest[start : start + step]
        if populate:
            host_arrays.populate(o)
        with np.errstate(invalid="ignore", over="ignore"):  # corrupt scales: inf/nan
            if into is not None:
                into(b, o)
            else:
                o[...] = fn(b).reshape(o.shape)  # one chunk's float32 temporary

    starts = range(0, blocks.shape[0], step)
    if len(starts) == 1:
        chunk(0)
    else:
        list(_pool().map(chunk, starts))  # re-raises a chunk's error
    return out


__all__ = [
    "CHUNK_VALUES",
    "DEQUANTIZABLE",
    "GGML_TYPES",
    "GGML_TYPE_IDS",
    "GGMLType",
    "dequantize_ggml",
    "dequantize_ggml_into",
    "ggml_type",
    "row_bytes",
]
