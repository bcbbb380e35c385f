"""MXFP4: the OCP microscaling 4-bit float format of gpt-oss's expert weights.

OCP "Microscaling Formats (MX) Specification" v1.0, 2023. A block of 32 values
shares one E8M0 scale (a byte ``e``: ``2^(e - 127)``); each value is an FP4 E2M1
code (1 sign, 2 exponent, 1 mantissa bits), two codes to a byte::

    code  0..7 -> +{0, 0.5, 1, 1.5, 2, 3, 4, 6},  8..15 -> the same, negative
    w = E2M1[code] · 2^(e - 127)

Every such value is a bfloat16 (8 exponent bits, and E2M1's 1 mantissa bit), so
dequantizing to bfloat16 or float32 is exact (barring scales below 2^-126).

Two byte layouts:

- Hugging Face (the Hub's gpt-oss files, transformers' ``convert_moe_packed_tensors``):
  ``*_blocks (..., G, 16)`` uint8 and ``*_scales (..., G)`` uint8; byte ``j`` of a
  block holds value ``2j`` in its low nibble and ``2j + 1`` in its high nibble; the
  ``G`` blocks of 32 make the last axis ``32 G``.
- GGML (llama.cpp's ``GGML_TYPE_MXFP4``, type 39): 17-byte blocks, the scale byte
  first, then 16 bytes whose low nibbles are values ``0..15`` and high nibbles
  ``16..31`` (as Q4_0). llama.cpp's table is E2M1 doubled with the scale halved
  (``2^(e - 128)``): the same values, but for ``e = 255`` (NaN in the MX
  specification), where ggml's stays finite; `dequantize_ggml` computes ggml's.

`quantize_ggml` is the GGML layout's quantizer (the GGUF writer's MXFP4 experts,
`entrenar.io.save_llama_gguf`), byte for byte ggml's ``quantize_row_mxfp4_ref`` and
gguf-py's ``gguf.quants.quantize(x, GGMLQuantizationType.MXFP4)``.

It sits in `entrenar.nn` (below `entrenar.quant` in the layers, specs/conventions.md)
because a family reads it: gpt-oss's `from_hf_tensors` decodes the Hub's experts
(`entrenar.nn.gpt_oss`); it is a pure NumPy codec.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import ml_dtypes
import numpy as np

from entrenar.errors import FormatError, QuantizationError

E2M1 = np.array(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
     -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
    np.float32,
)  # fmt: skip
"""The 16 FP4 E2M1 values by code."""

BLOCK = 32
"""Values per MXFP4 block (one E8M0 scale)."""
_CHUNK = 1 << 16
"""Blocks quantized at a time by the quantizers (bounds their temporaries)."""
MAX_SCALE = 252
"""Largest E8M0 scale byte `dequantize_hf` reads: ``6 · 2^125`` is the largest
finite product in float32; 253 and 254 overflow it for the larger codes, and 255 is
the MX specification's NaN (no trained weight is near ``2^126``)."""


def _scale(e: np.ndarray) -> np.ndarray:
    """E8M0 bytes ``(...)`` as float32 ``2^(e - 127)``."""
    return np.ldexp(np.float32(1.0), e.astype(np.int32) - 127).astype(np.float32)


_PAIRS = np.stack([E2M1[np.arange(256) & 0x0F], E2M1[np.arange(256) >> 4]], -1)
"""A byte's two values, ``(256, 2)`` float32: low nibble first (the HF layout)."""


def dequantize_hf(blocks: Any, scales: Any, dtype: Any = np.float32) -> np.ndarray:
    """Hugging Face MXFP4 ``blocks (..., G, 16)``, ``scales (..., G)``: ``(..., 32G)``.

    The values of transformers' ``convert_moe_packed_tensors`` before its final
    transpose (that is, in the ``(out, in)`` layout the blocks are stored in).
    One table lookup per byte (`_PAIRS`) and one product per value, in float32; to
    bfloat16 by keeping the upper 16 bits, exact for these values (a bfloat16's
    8 exponent bits, and 2 significant bits at most). About 40 M values a second
    on one contended CPU core (gpt-oss-20b's 19 G expert values: minutes).

    Raises:
        FormatError: shapes that do not pair, bytes that are not uint8, or a scale
            byte above `MAX_SCALE` (the values would be NaN or infinite).
    """
    b, s = np.asarray(blocks), np.asarray(scales)
    if b.dtype != np.uint8 or s.dtype != np.uint8:
        raise FormatError(
            f"MXFP4 blocks and scales must be uint8, got {b.dtype} and {s.dtype}"
        )
    if b.ndim < 2 or b.shape[-1] != BLOCK // 2 or b.shape[:-1] != s.shape:
        raise FormatError(
            f"MXFP4 blocks {b.shape} and scales {s.shape} do not pair: blocks are "
            f"(..., G, {BLOCK // 2}) bytes and scales (..., G)"
        )
    top = int(s.max()) if s.size else 0
    if top > MAX_SCALE:
        raise FormatError(
            f"MXFP4 scales hold the byte {top}: E8M0 255 is NaN (MX v1.0) and 253 "
            "or 254 overflow float32 (weights of 2^126 and more); the checkpoint is "
            f"corrupt (scales must be at most {MAX_SCALE})"
        )
    out = _PAIRS[b]  # (..., G, 16, 2) float32
    out *= _scale(s)[..., None, None]
    out = out.reshape(*b.shape[:-2], -1)  # (..., 32 G)
    if np.dtype(dtype) == np.dtype(ml_dtypes.bfloat16):  # exact: the upper half
        return (out.view(np.uint32) >> 16).astype(np.uint16).view(ml_dtypes.bfloat16)
    return out.astype(dtype, copy=False)


def _float32_blocks(
    w: Any, name: str
) -> tuple[tuple[int, ...], Iterator[tuple[slice, np.ndarray]]]:
    """``w``'s shape and its float32 blocks ``(n, 32)``, ``_CHUNK`` at a time.

    Raises:
        FormatError: a last axis that is not a multiple of 32.
        QuantizationError: (as the chunks are taken) NaN or Inf, or values beyond
            float32's range, in ``w``.
    """
    a = np.asarray(w)
    if a.ndim == 0 or a.shape[-1] % BLOCK:
        raise FormatError(
            f"{name}: MXFP4 needs a last axis multiple of {BLOCK}, got {a.shape}"
        )
    with np.errstate(over="ignore"):
        flat = np.asarray(a, np.float32).reshape(-1, BLOCK)  # (n, 32)

    def chunks() -> Iterator[tuple[slice, np.ndarray]]:
        for s in range(0, flat.shape[0], _CHUNK):
            x = flat[s : s + _CHUNK]
            if not np.isfinite(x).all():
                raise QuantizationError(
                    f"{name} holds NaN or Inf (or values beyond float32's range); "
                    "cannot write MXFP4"
                )
            yield slice(s, s + _CHUNK), x

    return a.shape, chunks()


_HF_MIDPOINTS = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], np.float32)
"""Midpoints of the E2M1 magnitudes ``0, 0.5, 1, 1.5, 2, 3, 4, 6``."""


def _hf_blocks(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Finite float32 blocks ``x: (n, 32)`` -> HF ``(blocks (n, 16), scales (n,))``."""
    amax = np.abs(x).max(-1)  # (n,)
    with np.errstate(divide="ignore"):
        e = np.ceil(np.log2(np.where(amax > 0, amax / np.float32(6.0), 1.0)))
    e = np.clip(e + 127, 0, 254).astype(np.uint8)  # (n,)
    scaled = np.abs(x) / _scale(e)[:, None]  # (n, 32), |w| / 2^(e - 127)
    mag = np.zeros(x.shape, np.uint8)  # index into 0, 0.5, 1, 1.5, 2, 3, 4, 6
    for m in _HF_MIDPOINTS:
        mag += scaled > m  # a tie keeps the lower code
    codes = np.where((x < 0) & (mag > 0), mag | 8, mag).astype(np.uint8)  # (n, 32)
    return codes[:, 0::2] | (codes[:, 1::2] << 4), e


def quantize_hf(w: Any, name: str = "tensor") -> tuple[np.ndarray, np.ndarray]:
    """``w (..., K)`` (``K`` a multiple of 32) as Hugging Face ``(blocks, scales)``.

    Each block's scale is the smallest power of two with ``max |w| / scale <= 6``
    (no value clips; the rounding-up scale rule of transformers' MXFP4 quantizer),
    each value the nearest E2M1 code (a tie to the smaller magnitude; zero as
    code 0, never -0's code 8). Values already MXFP4 (`dequantize_hf`'s) come
    back as the same values. Quantized ``_CHUNK`` blocks at a time, so the
    temporaries stay small beside ``w`` (a gpt-oss-20b layer's experts).

    Args:
        w: values, any float dtype (converted to float32).
        name: the tensor, for the error.

    Raises:
        FormatError: a last axis that is not a multiple of 32.
        QuantizationError: NaN or Inf (or values beyond float32) in ``w``.
    """
    shape, chunks = _float32_blocks(w, name)
    n = math.prod(shape) // BLOCK
    blocks, scales = np.empty((n, BLOCK // 2), np.uint8), np.empty(n, np.uint8)
    for at, x in chunks:
        blocks[at], scales[at] = _hf_blocks(x)
    groups = (*shape[:-1], shape[-1] // BLOCK)
    return blocks.reshape(*groups, BLOCK // 2), scales.reshape(groups)


def dequantize_ggml(raw: Any, shape: tuple[int, ...], dtype: Any = np.float32) -> Any:
    """GGML MXFP4 bytes (17-byte blocks, module docstring) -> ``shape`` values.

    Raises:
        FormatError: a byte count that is not ``17 · size / 32``.
    """
    size = int(np.prod(shape))
    data = np.frombuffer(np.asarray(raw).tobytes(), np.uint8)
    if size % BLOCK or data.size != size // BLOCK * 17:
        raise FormatError(
            f"MXFP4 data of {data.size} bytes does not hold shape {shape} "
            f"({size // BLOCK} blocks of 17 bytes)"
        )
    blocks = data.reshape(-1, 17)
    e, q = blocks[:, 0], blocks[:, 1:]  # (n,), (n, 16)
    out = np.empty((blocks.shape[0], BLOCK), np.float32)
    out[:, :16] = E2M1[q & 0x0F]
    out[:, 16:] = E2M1[q >> 4]
    out *= 2  # ggml's doubled table and halved scale: e = 255 stays finite
    half = np.ldexp(np.float32(1.0), e.astype(np.int32) - 128).astype(np.float32)
    out *= half[:, None]
    return out.reshape(shape).astype(dtype, copy=False)


_MIDPOINTS = np.array([0.5, 1.5, 2.5, 3.5, 5.0, 7.0, 10.0], np.float32)
"""Midpoints of ggml's doubled E2M1 magnitudes ``0, 1, 2, 3, 4, 6, 8, 12``."""
_ABOVE = np.array([1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0], np.float32)
"""The doubled magnitude above each of `_MIDPOINTS`."""


def _ggml_blocks(x: np.ndarray) -> np.ndarray:
    """Finite float32 blocks ``x: (n, 32)`` -> GGML MXFP4 bytes ``(n, 17)``."""
    amax = np.abs(x).max(-1)  # (n,)
    with np.errstate(divide="ignore"):
        # float32 log2, as ggml's log2f and gguf-py's np.log2 of float32 compute it
        k = np.floor(np.log2(np.where(amax > 0, amax, np.float32(1))))
    e = np.where(amax > 0, k.astype(np.int32) - 2 + 127, 0)
    e = np.maximum(e, 0)  # amax < 2^-125: the smallest scale (module docs, no wrap)
    d = np.ldexp(np.float32(1.0), e - 128).astype(np.float32)[:, None]  # (n, 1)
    ax = np.abs(x)
    mag = np.zeros(x.shape, np.uint8)  # index into 0, 1, 2, 3, 4, 6, 8, 12
    with np.errstate(over="ignore"):
        for m, up in zip(_MIDPOINTS, _ABOVE, strict=True):
            # m·d is exact; a tie (ax == m·d) keeps the lower code; a code whose
            # value overflows float32 (8 and 12 at e = 253) is never taken, as
            # ggml's infinite error for it
            mag += (ax > m * d) & np.isfinite(up * d)
    codes = np.where((x < 0) & (mag > 0), mag | 8, mag).astype(np.uint8)  # (n, 32)
    out = np.empty((x.shape[0], 17), np.uint8)
    out[:, 0] = e
    out[:, 1:] = codes[:, :16] | (codes[:, 16:] << 4)  # Q4_0's nibbles
    return out


def quantize_ggml(w: Any, name: str = "tensor") -> np.ndarray:
    """``w (..., K)`` (``K`` a multiple of 32) as GGML MXFP4 bytes ``(..., K/32·17)``.

    ggml's ``quantize_row_mxfp4_ref`` (OCP MX v1.0's scale rule), vectorized: each
    32-value block (of float32 values, as ggml quantizes) gets the E8M0 exponent
    ``e = floor(log2(amax)) - 2 + 127`` (``log2`` in float32; 0 for an all-zero
    block), each value the nearest of the doubled E2M1 codes times
    ``d = 2^(e - 128)``, a tie going to the first code in the table's order (the
    smaller magnitude; zero as code 0, never -0's code 8). The nearest code is
    found by comparing ``|x|`` with the codes' midpoints times ``d`` (exact
    products), which picks the code ggml's rounded errors pick (every error that
    decides is computed exactly: Sterbenz's lemma on neighbouring codes).

    Where ggml's ``uint8_t`` exponent would wrap: finite float32 values give
    ``e <= 253`` (253 for ``amax`` within float32's log2 rounding of ``2^128``,
    where the codes 4 and 6 would overflow float32 and, as in ggml, are not
    taken: such values become ``1.5 · 2^127``), so the top of E8M0 (255, NaN in
    the MX specification) is never reached; values beyond float32's range are
    refused with NaN and Inf. A block with ``0 < amax < 2^-125`` gives
    ``e < 0``, which ggml and gguf-py wrap (a scale near ``2^100``), and which
    this clamps to ``e = 0``: the smallest scale, each value the nearest code
    times ``2^-128`` (off by ``2^-128`` at most: the block stays within its range,
    below ``2^-125``, rather than turning into ``2^100``-sized values).

    Args:
        w: values, any float dtype (converted to float32).
        name: the tensor, for the error.

    Raises:
        FormatError: a last axis that is not a multiple of 32.
        QuantizationError: NaN or Inf (or values beyond float32) in ``w``.
    """
    shape, chunks = _float32_blocks(w, name)
    out = np.empty((math.prod(shape) // BLOCK, 17), np.uint8)
    for at, x in chunks:
        out[at] = _ggml_blocks(x)
    return out.reshape(*shape[:-1], -1)


__all__ = [
    "BLOCK",
    "E2M1",
    "MAX_SCALE",
    "dequantize_ggml",
    "dequantize_hf",
    "quantize_ggml",
    "quantize_hf",
]
