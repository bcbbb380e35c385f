"""NormalFloat4 (NF4) with optional double quantization (Dettmers et al., 2023).

QLoRA's NF4 code has 16 values: the quantiles of a standard normal distribution,
scaled to ``[-1, 1]``, with an exact zero (8 positive, 7 negative values). A block of
``B`` values (default 64) is stored as its absmax ``s = max|x|`` and the codes
``q_i = argmin_k |x_i / s - NF4[k]|``; the value is ``x̂_i = s · NF4[q_i]``.

Double quantization (DQ) quantizes the float32 block scales too: per matrix (the last
two axes of the scales) their mean ``μ`` is subtracted, the centred scales are cut into
groups of 256, and each group is stored as int8 codes ``c = round(127 (s - μ) / a)``
with ``a`` the group's absmax (float32). Bits per parameter::

    without DQ: 4 + 32 / B                       = 4.5     (B = 64)
    with DQ:    4 + 8 / B + 32 / (256 B) (+ μ)   ≈ 4.127

(bitsandbytes uses its dynamic 8-bit map for the second level; entrenar uses linear
int8, which costs the same bits.)

Quantizing float32 or bfloat16 runs the native kernel ``entrenar/kernels/
nf4_quantize.cc`` where `entrenar.native` says it runs: from JAX as a custom call
(traced or eager), and on numpy buffers through `quantize_nf4_host`, a plain C call
with no XLA program (what a streaming load uses: no compile at a first load). Both
entries run the same C++, so a load's nodes equal `entrenar.quant.quantize`'s bit
for bit under the same policy. Against the pure-JAX path (`_nf4_blocks`) the kernel
agrees to float32 rounding: DQ's mean ``μ`` is a float64 sum rounded once (XLA sums
in float32, in an order of its own), so ``μ`` may differ by an ulp or two, and with
it the DQ scales and the codes of values that sit on a decision threshold; without
DQ the nodes are the same bits.
"""

from __future__ import annotations

import ctypes
import functools
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from entrenar import native
from entrenar.errors import ShapeError
from entrenar.nn.host_arrays import host_buffer
from entrenar.quant.weight import (
    QuantizedWeight,
    check_blocks,
    check_finite,
    pack_nibbles,
    unpack_nibbles,
    validated_blocks,
)

NF4_CODE = np.array(
    [
        -1.0,
        -0.6961928009986877,
        -0.5250730514526367,
        -0.39491748809814453,
        -0.28444138169288635,
        -0.18477343022823334,
        -0.09105003625154495,
        0.0,
        0.07958029955625534,
        0.16093020141124725,
        0.24611230194568634,
        0.33791524171829224,
        0.44070982985687256,
        0.5626170039176941,
        0.7229568362236023,
        1.0,
    ],
    dtype=np.float32,
)
"""The 16 NF4 values (QLoRA, Appendix E; bitsandbytes ``create_normal_map``)."""

DQ_GROUP = 256
"""First-level scales per second-level scale in double quantization."""

_MIDPOINTS = (NF4_CODE[1:] + NF4_CODE[:-1]) / 2  # decision thresholds, (15,)


def _dq_axes(ndim: int) -> int:
    """Number of trailing scale axes that form one DQ matrix (2, or 1 for vectors)."""
    return min(ndim, 2)


def double_quantize(s: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Quantize float32 block scales ``(*lead, rows, nb)`` to int8 codes.

    Returns:
        ``(codes int8 (*lead, rows, nb), group absmax float32 (*lead, G),
        mean float32 (*lead,))`` with ``G = ceil(rows · nb / 256)``.
    """
    k = _dq_axes(s.ndim)
    lead, n = s.shape[: s.ndim - k], int(np.prod(s.shape[s.ndim - k :]))
    flat = s.reshape(*lead, n)  # (*lead, n)
    mean = jnp.mean(flat, axis=-1)  # (*lead,)
    groups = -(-n // DQ_GROUP)
    c = jnp.pad(
        flat - mean[..., None], [(0, 0)] * len(lead) + [(0, groups * DQ_GROUP - n)]
    )
    c = c.reshape(*lead, groups, DQ_GROUP)  # (*lead, G, 256)
    a = jnp.max(jnp.abs(c), axis=-1)  # (*lead, G)
    inv = jnp.where(a == 0, jnp.float32(0), jnp.float32(127) / jnp.where(a == 0, 1, a))
    codes = jnp.clip(jnp.round(c * inv[..., None]), -127, 127).astype(jnp.int8)
    codes = codes.reshape(*lead, groups * DQ_GROUP)[..., :n].reshape(s.shape)
    return codes, a, mean


def double_dequantize(codes: jax.Array, a: jax.Array, mean: jax.Array) -> jax.Array:
    """Float32 block scales from `double_quantize`'s output, clamped at 0."""
    k = _dq_axes(codes.ndim)
    lead, n = codes.shape[: codes.ndim - k], int(np.prod(codes.shape[codes.ndim - k :]))
    groups = a.shape[-1]
    c = codes.reshape(*lead, n).astype(jnp.float32)
    c = jnp.pad(c, [(0, 0)] * len(lead) + [(0, groups * DQ_GROUP - n)])
    c = c.reshape(*lead, groups, DQ_GROUP) * (a / jnp.float32(127))[..., None]
    s = c.reshape(*lead, groups * DQ_GROUP)[..., :n] + mean[..., None]
    return jnp.maximum(s, 0).reshape(codes.shape)  # (*lead, rows, nb)


def block_scales(q: QuantizedWeight) -> jax.Array:
    """The first-level block scales of ``q``, double quantization undone if used."""
    if q.double_quant:
        return double_dequantize(q.scales, q.scale_scales, q.scale_offset)
    return q.scales


def quantize_nf4(
    w: Any, *, block_size: int = 64, double_quant: bool = False
) -> QuantizedWeight:
    """Quantize ``w: (*lead, cols)`` to NF4 blocks along the last axis.

    A stack of matrices ``w: (*stack, rows, cols)`` (a layer-stacked leaf ``(L, out,
    in)``) is quantized one matrix at a time (`jax.lax.map` over the flattened stack
    axes): each matrix goes through the same computation as on its own, so quantizing
    the stack equals quantizing each layer ``w[i]`` and stacking the nodes, bit for
    bit. (Double quantization's per-matrix mean ``μ`` is a float32 sum whose last bit
    depends on the reduction's order, which XLA chooses per shape: one reduction over
    ``(L, n)`` and ``L`` over ``(n,)`` differ. Defining the stack per matrix makes a
    load that quantizes layer by layer give the node that quantizing the whole leaf
    gives, and holds one matrix's temporaries at a time.)

    Raises:
        ShapeError: ``cols`` is not a multiple of ``block_size``.
        QuantizationError: ``w`` holds NaN or Inf (checked when ``w`` is concrete).
    """
    return quantize_nf4_checked(w, block_size=block_size, double_quant=double_quant)[0]


def quantize_nf4_checked(
    w: Any, *, block_size: int = 64, double_quant: bool = False
) -> tuple[QuantizedWeight, jax.Array]:
    """`quantize_nf4` and whether every value of ``w`` is finite (a bool scalar).

    The check costs no pass of its own: the block absmax is taken of ``|x|`` with
    NaN replaced by +inf (``s`` is unchanged for finite blocks; XLA's fused
    reduce-max on the CPU may drop a NaN, never an infinity), so ``w`` is finite
    exactly when every ``s`` is. (A separate ``all(isfinite(w))`` took a quarter
    of a compiled quantize call of a (5632, 2048) layer.)
    """
    dtype = np.dtype(jnp.asarray(w).dtype)
    if np.size(w) and native.use("nf4_quantize", dtype):
        check_blocks(tuple(np.shape(w)), block_size, "nf4")
        check_finite(w, "nf4")
        return _native_quantize(jnp.asarray(w), block_size, double_quant)
    return _quantize_jax(w, block_size, double_quant)


def _quantize_jax(
    w: Any, block_size: int, double_quant: bool
) -> tuple[QuantizedWeight, jax.Array]:
    """The pure-JAX `quantize_nf4_checked` (the kernel's twin)."""
    dtype = np.dtype(jnp.asarray(w).dtype)
    x = validated_blocks(w, block_size, "nf4")  # (*lead, nb, B)
    if x.ndim > 3:  # (*stack, rows, nb, B): one matrix at a time
        stack = x.shape[:-3]
        flat = x.reshape(-1, *x.shape[-3:])  # (S, rows, nb, B)
        parts = jax.lax.map(lambda m: _nf4_blocks(m, double_quant), flat)
        codes, scales, a, mean, finite = jax.tree_util.tree_map(
            lambda p: p.reshape(*stack, *p.shape[1:]), parts
        )
        finite = jnp.all(finite)  # ()
    else:
        codes, scales, a, mean, finite = _nf4_blocks(x, double_quant)
    return _nf4_node(codes, scales, a, mean, block_size, dtype), finite


def _nf4_node(
    codes: Any, scales: Any, a: Any, mean: Any, block_size: int, dtype: Any
) -> QuantizedWeight:
    """The NF4 node of ``codes``, ``scales`` and (with DQ) their ``a`` and ``mean``."""
    return QuantizedWeight(
        codes, scales, None, a, mean, scheme="nf4", block_size=block_size, dtype=dtype
    )


def _nf4_blocks(
    x: jax.Array, double_quant: bool
) -> tuple[jax.Array, jax.Array, jax.Array | None, jax.Array | None, jax.Array]:
    """NF4 of float32 blocks ``x: (*lead, nb, B)`` (one matrix, or a vector).

    Returns:
        ``(packed codes uint8 (*lead, nb·B/2), scales, DQ absmax or None, DQ mean or
        None, finite)``; scales are float32 ``(*lead, nb)``, or `double_quantize`'s
        int8 codes with its absmax ``(G,)`` and mean ``()`` (a matrix); ``finite``
        whether every value of ``x`` is (``()`` bool).
    """
    big = jnp.where(jnp.isnan(x), jnp.float32(jnp.inf), jnp.abs(x))  # NaN -> inf
    s = jnp.max(big, axis=-1)  # (*lead, nb): max|x|, inf where a value is not finite
    finite = jnp.all(jnp.isfinite(s))  # ()
    if double_quant:
        scales, a, mean = double_quantize(s)
        s = double_dequantize(scales, a, mean)  # code against the scales we store
    else:
        scales, a, mean = s, None, None
    inv = jnp.where(s == 0, jnp.float32(0), 1 / jnp.where(s == 0, 1, s))
    y = x * inv[..., None]  # in [-1, 1] (slightly beyond with DQ)
    q = jnp.sum(y[..., None] > jnp.asarray(_MIDPOINTS), axis=-1)  # (*lead, nb, B)
    return pack_nibbles(q), scales, a, mean, finite


def _matrices(shape: tuple[int, ...]) -> tuple[int, int, int]:
    """``(S, R, K)``: ``(*lead, K)`` as S matrices of R rows (a vector: one row).

    The matrices are those DQ takes its mean over (`_dq_axes`): the last two axes,
    every leading axis a stack.
    """
    cols = shape[-1]
    rows = shape[-2] if len(shape) >= 2 else 1
    return int(np.prod(shape[:-2], dtype=np.int64)), rows, cols


def _dq_groups(rows: int, nb: int) -> int:
    return -(-rows * nb // DQ_GROUP)


@functools.partial(jax.custom_jvp, nondiff_argnums=(1, 2))
def _native_quantize(
    w: jax.Array, block_size: int, double_quant: bool
) -> tuple[QuantizedWeight, jax.Array]:
    """`quantize_nf4_checked` by the kernel's custom call (module docstring).

    Differentiated as the JAX path is (`_native_jvp`): a custom call has no
    derivative of its own.
    """
    dtype = np.dtype(w.dtype)
    s, r, k = _matrices(w.shape)
    nb = k // block_size
    stack = w.shape[:-2]  # the DQ arrays' leading axes
    name = f"entrenar_nf4_quantize{'_dq' if double_quant else ''}"
    codes_t = jax.ShapeDtypeStruct((s, r, k // 2), jnp.uint8)
    finite_t = jax.ShapeDtypeStruct((s,), jnp.uint8)
    if double_quant:
        g = _dq_groups(r, nb)
        outs: tuple[jax.ShapeDtypeStruct, ...] = (
            codes_t,
            jax.ShapeDtypeStruct((s, r, nb), jnp.int8),
            jax.ShapeDtypeStruct((s, g), jnp.float32),
            jax.ShapeDtypeStruct((s,), jnp.float32),
            finite_t,
        )
    else:
        outs = (codes_t, jax.ShapeDtypeStruct((s, r, nb), jnp.float32), finite_t)
    call = jax.ffi.ffi_call(
        f"{name}_{NATIVE_DTYPES[dtype.name]}", outs, vmap_method="sequential"
    )
    res = call(w.reshape(s, r, k), jnp.asarray(_MIDPOINTS))
    lead = w.shape[:-1]
    codes = res[0].reshape(*lead, k // 2)  # (*lead, K/2)
    scales = res[1].reshape(*lead, nb)  # (*lead, nb)
    a = res[2].reshape(*stack, -1) if double_quant else None  # (*stack, G)
    mean = res[3].reshape(stack) if double_quant else None  # (*stack,)
    node = _nf4_node(codes, scales, a, mean, block_size, dtype)
    return node, jnp.all(res[-1] != 0)


@_native_quantize.defjvp
def _native_jvp(
    block_size: int, double_quant: bool, primals: Any, tangents: Any
) -> tuple[Any, Any]:
    """The kernel's values; the tangents of the JAX path (`_quantize_jax`)."""
    out = _native_quantize(primals[0], block_size, double_quant)
    _, dout = jax.jvp(
        lambda w: _quantize_jax(w, block_size, double_quant), primals, tangents
    )
    return out, dout


def quantize_nf4_host(
    w: np.ndarray,
    *,
    block_size: int = 64,
    double_quant: bool = False,
    dtype: Any = None,
    threads: int | None = None,
    out: QuantizedWeight | None = None,
) -> tuple[QuantizedWeight, bool] | None:
    """`quantize_nf4_checked` of a host array by a plain call of the native kernel.

    No XLA program runs (nothing to compile or dispatch): the kernel's C function
    reads ``w`` where it lies (a memory-mapped file's view, say) and writes the
    node's arrays into page-aligned numpy buffers (`entrenar.nn.host_arrays`), which
    JAX takes without a copy. The node equals what `quantize_nf4_checked` gives for
    ``w`` (cast to ``dtype``) under the same kernel policy, bit for bit: the custom
    call runs the same C++.

    Args:
        w: float32 or bfloat16 ``(*lead, cols)``, C-contiguous.
        block_size: values per block.
        double_quant: quantize the block scales too.
        dtype: the node's dtype (what ``w`` stands for: bfloat16 values loaded as
            float32 are quantized from the bfloat16 bytes); default ``w``'s.
        threads: threads the kernel may use (default: the CPUs, when the work is
            big enough to pay for them).
        out: a node of C-contiguous numpy arrays of the result's shapes and dtypes
            (views of a stacked leaf's arrays) to write the result into; it is
            returned. Default: new page-aligned buffers.

    Returns:
        ``(node of numpy arrays, whether every value of w is finite)``, or None where
        the kernel does not run (policy ``"jax"``, no compiler, another dtype): the
        caller then takes the JAX path.

    Raises:
        ShapeError: ``cols`` is not a multiple of ``block_size``.
    """
    w = np.asarray(w)
    lib = native.library("nf4_quantize", w.dtype) if w.size else None
    if lib is None:
        return None
    check_blocks(w.shape, block_size, "nf4")
    s, r, k = _matrices(w.shape)
    nb = k // block_size
    lead, stack = w.shape[:-1], w.shape[:-2]
    x = np.ascontiguousarray(w)  # (S·R, K) rows, as stored
    codes = _output(out, "codes", (*lead, k // 2), np.uint8)  # (*lead, K/2)
    a = mean = None
    if double_quant:
        scales = _output(out, "scales", (*lead, nb), np.int8)  # DQ codes
        a = _output(out, "scale_scales", (*stack, _dq_groups(r, nb)), np.float32)
        mean = _output(out, "scale_offset", stack, np.float32)  # (*stack,)
        scratch = np.empty((s * r * nb,), np.float32)  # the float32 block scales
    else:
        scales = scratch = _output(out, "scales", (*lead, nb), np.float32)
    finite = np.zeros((s,), np.uint8)  # (S,) one flag per matrix
    mid = np.ascontiguousarray(_MIDPOINTS, np.float32)
    failed = _host_entry(lib)(
        x.ctypes.data, int(x.dtype != np.float32), s, r, k, block_size,
        int(double_quant), mid.ctypes.data, codes.ctypes.data, scratch.ctypes.data,
        scales.ctypes.data if double_quant else None,
        None if a is None else a.ctypes.data,
        None if mean is None else mean.ctypes.data, finite.ctypes.data,
        threads or _cpus(),
    )  # fmt: skip
    if failed:
        raise ShapeError(f"NF4: the kernel refused the shape {w.shape}")
    dtype = np.dtype(x.dtype if dtype is None else dtype)
    return _nf4_node(codes, scales, a, mean, block_size, dtype), bool(finite.all())


def _output(
    out: QuantizedWeight | None, key: str, shape: tuple[int, ...], dtype: Any
) -> np.ndarray:
    """``out``'s array ``key`` (checked: the kernel writes it), or a new buffer."""
    if out is None:
        return host_buffer(shape, dtype)
    a = getattr(out, key)
    if not (
        isinstance(a, np.ndarray)
        and a.shape == tuple(shape)
        and a.dtype == np.dtype(dtype)
        and a.flags.c_contiguous
        and a.flags.writeable
    ):
        raise ShapeError(
            f"NF4 host quantize: out.{key} must be a writable C-contiguous numpy "
            f"array {np.dtype(dtype).name}{tuple(shape)}, got "
            f"{getattr(a, 'dtype', type(a).__name__)}{getattr(a, 'shape', '')}"
        )
    return a


@functools.cache
def _host_entry(lib: ctypes.CDLL) -> Any:
    """``EntrenarNf4QuantizeHost`` of ``lib`` with its signature (set once)."""
    fn = lib.EntrenarNf4QuantizeHost
    fn.argtypes = _HOST_ARGTYPES
    fn.restype = ctypes.c_int
    return fn


def _cpus() -> int:
    """CPUs this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


_P, _I32, _I64 = ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64
_HOST_ARGTYPES: list[Any] = [_P, _I32, _I64, _I64, _I64, _I64, _I32, *[_P] * 7, _I32]
"""``EntrenarNf4QuantizeHost``'s arguments (entrenar/kernels/nf4_quantize.cc)."""


def dequantize_nf4(q: QuantizedWeight, dtype: Any) -> jax.Array:
    """Values ``s · NF4[code]`` of an NF4 node, ``(*lead, cols)`` in ``dtype``.

    To float32 or bfloat16 this runs the native kernel
    ``entrenar/kernels/nf4_dequantize.cc`` where it can be built (`entrenar.native`;
    a table permute per 16 codes instead of XLA's gather, 5-7x faster at SmolLM2's
    shapes); its values are the JAX path's bit for bit, and so is its gradient
    (a custom VJP through the JAX path).
    """
    dtype = np.dtype(dtype)
    if native.use("nf4_dequantize", dtype):
        return _native_dequantize(q, dtype)
    return _dequantize_jax(q, dtype)


NATIVE_DTYPES = {"float32": "f32", "bfloat16": "bf16"}
"""Output dtypes of the native NF4 dequantizer (custom-call target suffixes)."""


def _dequantize_jax(q: QuantizedWeight, dtype: Any) -> jax.Array:
    s = block_scales(q)
    codes = unpack_nibbles(q.codes, q.block_size)  # (*lead, nb, B)
    x = jnp.asarray(NF4_CODE)[codes] * s.astype(jnp.float32)[..., None]
    return x.reshape(*x.shape[:-2], -1).astype(dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _native_dequantize(q: QuantizedWeight, dtype: Any) -> jax.Array:
    cols = q.codes.shape[-1] * 2
    rows = int(np.prod(q.codes.shape[:-1]))  # leading axes folded into rows
    scales = block_scales(q).astype(jnp.float32).reshape(rows, cols // q.block_size)
    call = jax.ffi.ffi_call(
        f"entrenar_nf4_dequantize_{NATIVE_DTYPES[np.dtype(dtype).name]}",
        jax.ShapeDtypeStruct((rows, cols), dtype),
        vmap_method="sequential",
    )
    out = call(q.codes.reshape(rows, cols // 2), scales, jnp.asarray(NF4_CODE))
    return out.reshape(*q.codes.shape[:-1], cols)  # (*lead, cols)


def _native_fwd(q: QuantizedWeight, dtype: Any) -> tuple[jax.Array, Any]:
    return _native_dequantize(q, dtype), q


def _native_bwd(dtype: Any, q: QuantizedWeight, g: jax.Array) -> Any:
    _, pull = jax.vjp(lambda q: _dequantize_jax(q, dtype), q)
    return pull(g)


_native_dequantize.defvjp(_native_fwd, _native_bwd)


__all__ = [
    "DQ_GROUP",
    "NF4_CODE",
    "block_scales",
    "dequantize_nf4",
    "double_dequantize",
    "double_quantize",
    "quantize_nf4",
    "quantize_nf4_checked",
    "quantize_nf4_host",
]
