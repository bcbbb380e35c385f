"""`QuantizedWeight`: a quantized tensor as a registered pytree node.

The node keeps the tensor's structure with blocks along the **last axis**: codes
``(*lead, cols)`` for 8-bit schemes or ``(*lead, cols // 2)`` uint8 for 4-bit schemes
(two codes a byte), and scales ``(*lead, cols // block)``. Leading axes (rows, stacked
layers) are ordinary array axes, so `jax.lax.scan` or indexing slices a stacked
``QuantizedWeight`` per layer like any array. The scheme, block size and original dtype
are static aux data; the logical shape is derived from the arrays.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from entrenar.errors import QuantizationError, ShapeError
from entrenar.nn.weight_node import (
    STATIC,
    logical_dtype,
    logical_shape,
    nbytes,
    register_weight_node,
)

FOUR_BIT = frozenset({"int4", "nf4", "q4_0", "q4_1"})
"""Schemes that pack two 4-bit codes into each byte."""

SCHEMES = ("int4", "nf4", "int8", "q8_0", "q4_0", "q4_1")
"""Every scheme `entrenar.quant.quantize` accepts."""


_FLOAT32 = np.dtype(np.float32)


@register_weight_node
@dataclasses.dataclass(frozen=True)
class QuantizedWeight:
    """A quantized tensor: codes, scales and (where needed) offsets.

    Attributes:
        codes: uint8 ``(*lead, cols // 2)`` for 4-bit schemes (within each block of
            ``block_size`` values, byte ``j`` holds value ``j`` in its low nibble and
            value ``j + block_size // 2`` in its high nibble, llama.cpp's layout);
            int8 ``(*lead, cols)`` (uint8 for asymmetric int8) for 8-bit schemes.
        scales: per-block scales ``(*lead, cols // block_size)`` (float32, or float16
            for the llama.cpp formats, or int8 codes when NF4 scales are double
            quantized); per-tensor / per-channel int8 scales keep the tensor's rank
            with size-1 axes where they broadcast.
        offsets: zero points (asymmetric int8, uint8) or block minima (``q4_1``,
            float16), shaped like ``scales``; ``None`` for symmetric schemes.
        scale_scales: double quantization only: float32 second-level scales, one per
            256 first-level scales, ``(*lead2, groups)``.
        scale_offset: double quantization only: float32 mean of the first-level
            scales per matrix, ``(*lead2,)``.
        scheme: one of `SCHEMES` (static).
        block_size: values per block along the last axis (static); for per-tensor /
            per-channel int8 the length of the last axis.
        dtype: the original dtype, the default of `entrenar.quant.dequantize`
            (static).
        granularity: ``"block"``, ``"channel"`` or ``"tensor"`` (static; only int8
            uses the last two).
    """

    codes: Any
    scales: Any
    offsets: Any = None
    scale_scales: Any = None
    scale_offset: Any = None
    scheme: str = dataclasses.field(default="nf4", metadata=STATIC)
    block_size: int = dataclasses.field(default=64, metadata=STATIC)
    dtype: Any = dataclasses.field(default=_FLOAT32, metadata=STATIC)
    granularity: str = dataclasses.field(default="block", metadata=STATIC)

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", np.dtype(self.dtype))

    @property
    def shape(self) -> tuple[int, ...]:
        """Logical shape of the tensor this node stands for."""
        lead, last = tuple(self.codes.shape[:-1]), int(self.codes.shape[-1])
        return (*lead, last * 2 if self.scheme in FOUR_BIT else last)

    @property
    def ndim(self) -> int:
        """Number of axes of the logical tensor."""
        return len(self.shape)

    @property
    def size(self) -> int:
        """Number of values of the logical tensor."""
        return int(np.prod(self.shape))

    @property
    def double_quant(self) -> bool:
        """Whether the block scales are themselves quantized (NF4 + DQ)."""
        return self.scale_scales is not None

    def __getitem__(self, index: Any) -> QuantizedWeight:
        """Index the leading axes (e.g. one layer of a stacked weight)."""
        return jax.tree_util.tree_map(lambda a: a[index], self)

    def __repr__(self) -> str:
        return (
            f"QuantizedWeight(shape={self.shape}, scheme={self.scheme!r}, "
            f"block_size={self.block_size}, dtype={np.dtype(self.dtype).name}"
            f"{', double_quant' if self.double_quant else ''})"
        )

    def _repr_html_(self) -> str:
        """Jupyter's view: format, shape, and bytes against the same float32 array."""
        import html

        n, stored = int(np.prod(self.shape)), nbytes(self)
        f32 = 4 * n
        rows = [
            ("scheme", self.scheme + (" + double quant" if self.double_quant else "")),
            ("shape", str(self.shape)),
            ("block size", str(self.block_size)),
            ("dtype (dequantized)", np.dtype(self.dtype).name),
            ("stored", f"{stored:,} bytes = {8 * stored / max(n, 1):.2f} "
             f"bits/param ({stored / max(f32, 1):.3f}x float32)"),
        ]  # fmt: skip
        cells = "".join(
            f"<tr><th style='text-align:left'>{k}</th>"
            f"<td style='text-align:left'>{html.escape(v)}</td></tr>"
            for k, v in rows
        )
        return f"<b>QuantizedWeight</b><table>{cells}</table>"


logical_shape.register(QuantizedWeight, lambda q: q.shape)
logical_dtype.register(QuantizedWeight, lambda q: q.dtype)


def check_finite(w: Any, scheme: str) -> None:
    """Raise `QuantizationError` if a concrete ``w`` holds NaN or Inf.

    Under `jax.jit` the values are unknown and the check is skipped.
    """
    if isinstance(w, jax.core.Tracer):
        return
    if bool(jnp.all(jnp.isfinite(jnp.asarray(w)))):  # reduced where w lives
        return
    bad = ~np.isfinite(np.asarray(w, dtype=np.float32))
    if bad.any():
        n = int(bad.sum())
        raise QuantizationError(
            f"cannot quantize to {scheme!r}: the tensor of shape {np.shape(w)} holds "
            f"{n} NaN/Inf value(s) (first at index "
            f"{tuple(int(i) for i in np.argwhere(bad)[0])}); fix or mask them first"
        )


def check_blocks(shape: tuple[int, ...], block_size: int, scheme: str) -> None:
    """Raise `ShapeError` unless the last axis splits into whole blocks."""
    if len(shape) < 1:
        raise ShapeError(f"cannot quantize a scalar to {scheme!r}; give an array")
    if block_size <= 0 or shape[-1] % block_size:
        raise ShapeError(
            f"{scheme!r} quantizes blocks of {block_size} values along the last axis, "
            f"but the tensor has shape {shape}: pad the last axis to a multiple of "
            f"{block_size} or choose another block_size"
        )
    if scheme in FOUR_BIT and block_size % 2:
        raise ShapeError(f"4-bit scheme {scheme!r} needs an even block_size")


def as_float(w: Any) -> jax.Array:
    """``w`` as a float32 JAX array (the precision every quantizer computes in)."""
    return jnp.asarray(w).astype(jnp.float32)


def to_blocks(x: jax.Array, block_size: int) -> jax.Array:
    """Reshape ``(*lead, cols)`` to ``(*lead, cols // block, block)``."""
    return x.reshape(*x.shape[:-1], x.shape[-1] // block_size, block_size)


def validated_blocks(w: Any, block_size: int, scheme: str) -> jax.Array:
    """``w: (*lead, cols)`` as float32 blocks ``(*lead, cols // block, block)``.

    Raises:
        ShapeError: ``cols`` is not a multiple of ``block_size``.
        QuantizationError: ``w`` holds NaN or Inf (checked when ``w`` is concrete).
    """
    check_blocks(tuple(np.shape(w)), block_size, scheme)
    check_finite(w, scheme)
    return to_blocks(as_float(w), block_size)


def quotient(x: jax.Array, k: float) -> jax.Array:
    """``x / k`` rounded once, as C's ``x / k`` in float32 (and PyTorch's observers).

    XLA's algebraic simplifier turns a division by a constant or a broadcast scalar
    into a product with its float32 reciprocal (``x * 0.0666666701`` for ``x / 15``),
    which differs from the quotient by an ulp for 63% of ``x`` (4.5% for 127, 55%
    for 7, 64% for 255); the codes of values on a rounding boundary (grid data)
    follow that ulp through ``id = 1 / d``. A divisor array behind an optimization
    barrier is neither.
    """
    divisor = jax.lax.optimization_barrier(jnp.full(x.shape, k, jnp.float32))
    return x / divisor


def pack_nibbles(q: jax.Array) -> jax.Array:
    """Pack 4-bit codes ``(*lead, nb, block)`` into bytes ``(*lead, nb * block // 2)``.

    Byte ``j`` of a block holds code ``j`` (low nibble) and ``j + block // 2`` (high).
    """
    half = q.shape[-1] // 2
    q = q.astype(jnp.uint8)
    packed = q[..., :half] | (q[..., half:] << jnp.uint8(4))  # (*lead, nb, block/2)
    return packed.reshape(*packed.shape[:-2], -1)


def unpack_nibbles(codes: jax.Array, block_size: int) -> jax.Array:
    """Inverse of `pack_nibbles`: uint8 codes ``(*lead, nb, block)`` in ``[0, 15]``."""
    c = to_blocks(codes, block_size // 2)  # (*lead, nb, block/2)
    return jnp.concatenate([c & jnp.uint8(15), c >> jnp.uint8(4)], axis=-1)


__all__ = [
    "FOUR_BIT",
    "SCHEMES",
    "QuantizedWeight",
    "as_float",
    "check_blocks",
    "check_finite",
    "pack_nibbles",
    "quotient",
    "to_blocks",
    "unpack_nibbles",
    "validated_blocks",
]
