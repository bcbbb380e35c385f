"""Adam with 8-bit block-wise moments: `scale_by_adam_8bit` (bitsandbytes' Adam8bit).

Dettmers, Lewis, Shleifer & Zettlemoyer (2022), "8-bit Optimizers via Block-wise
Quantization" (arXiv:2110.02861). Each moment of a leaf of ``n`` values is stored as
``n`` uint8 codes plus one float32 ``absmax`` per block of ``B = 256`` consecutive
values (the flattened leaf; the last block may be short)::

    stored:      codes[i] ∈ [0, 256),  absmax[b]            (b = i // B)
    dequantize:  x[i] = map[codes[i]] · absmax[b]
    quantize:    absmax[b] = max_{i ∈ b} |x[i]|,
                 codes[i]  = argmin_k |map[k] − x[i] / absmax[b]|   (ties: lower k)

``map`` is the dynamic (tree) quantization map (Dettmers 2016, arXiv:1511.04561;
`dynamic_map`, equal to ``bitsandbytes.functional.create_dynamic_map``): signed for
``m``, unsigned for ``v``. Each step dequantizes, takes Adam's step in float32 from the
new moments, and quantizes the new moments. Leaves under ``min_8bit_size`` values
(bitsandbytes' 4096) keep float32 moments. State: 2 bytes per value plus 8 bytes per
block, against 8 for float32 Adam.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from entrenar import native
from entrenar.optim.base import (
    GradientTransformation,
    TransformApplyFn,
    apply_updates,
    safe_increment,
)
from entrenar.optim.masking import Mask, resolve_mask
from entrenar.optim.transforms import adam_bias_corrections, adam_rule
from entrenar.types import OptState, Params, Updates

BLOCK_SIZE = 256
"""Values per block (bitsandbytes' blockwise optimizers, ``Optimizer2State``)."""

MIN_8BIT_SIZE = 4096
"""Leaves with fewer values keep float32 moments (bitsandbytes' ``min_8bit_size``)."""


class Blockwise8bit(NamedTuple):
    """One moment of one leaf, 8-bit: ``x = map[codes] · absmax[block]``."""

    codes: jax.Array  # uint8, the leaf's shape
    absmax: jax.Array  # (ceil(n / BLOCK_SIZE),) float32


class ScaleByAdam8bitState(NamedTuple):
    """State of `scale_by_adam_8bit`.

    ``mu``/``nu`` hold a `Blockwise8bit` per large leaf, a float32 array per small one.
    """

    count: jax.Array  # type: ignore[assignment]  # () int32, steps taken
    mu: Any  # like params; leaves Blockwise8bit (signed map) or float32
    nu: Any  # like params; leaves Blockwise8bit (unsigned map) or float32


def _linspace_f32(start: float, stop: float, num: int) -> np.ndarray:
    """``torch.linspace(start, stop, num, dtype=float32)`` value for value.

    PyTorch's CPU kernel: ``step = (stop − start)/(num − 1)`` in float32; the first
    half is ``start + i·step``, the second ``stop − (num − 1 − i)·step``, each a
    fused multiply-add (one rounding: exact in float64, then rounded to float32).
    """
    f = np.float32
    step = np.float64((f(stop) - f(start)) / f(num - 1))
    i = np.arange(num, dtype=np.float64)
    low = np.float64(f(start)) + i * step
    high = np.float64(f(stop)) - (num - 1 - i) * step
    return np.where(i < num // 2, low, high).astype(f)


@functools.cache
def dynamic_map(signed: bool = True) -> np.ndarray:
    """The 8-bit dynamic (tree) quantization map: 256 sorted float32 values.

    Signed: in ``[-1, 1]``; unsigned: in ``[0, 1]``.

    bitsandbytes' ``create_dynamic_map(signed, max_exponent_bits=7, total_bits=8)``:
    for decade ``i = 0..6`` the midpoints of ``linspace(0.1, 1, 2^i + 1)`` (signed,
    and their negatives) or of ``linspace(0.1, 1, 2^{i+1} + 1)`` (unsigned), times
    ``10^{i−6}``; then 0 and 1; the unsigned map pads with zeros to 256 entries
    (equal to bitsandbytes' map bit for bit: tests/optim/test_optim_adam8bit.py).

    >>> m = dynamic_map(True)
    >>> m.shape, float(m[-1]), float(m[0]) < -0.99
    ((256,), 1.0, True)
    """
    data: list[np.ndarray] = []
    for i in range(7):
        items = 2**i + 1 if signed else 2 ** (i + 1) + 1
        b = _linspace_f32(0.1, 1.0, items)
        means = (b[:-1] + b[1:]) / np.float32(2.0)
        scaled = (np.float32(10.0 ** (i - 6)) * means).astype(np.float32)
        data += [scaled, -scaled] if signed else [scaled]
    data.append(np.array([0.0, 1.0], np.float32))
    values = np.concatenate(data)
    values = np.concatenate([values, np.zeros(256 - values.size, np.float32)])
    return np.sort(values).astype(np.float32)


@functools.cache
def _thresholds(signed: bool) -> np.ndarray:
    """``T_k``: the least float32 above the exact midpoint of ``map[k], map[k+1]``.

    For float32 ``y``: ``y`` is nearer ``map[k+1]`` than ``map[k]`` (ties: ``map[k]``)
    iff ``y ≥ T_k``, so the nearest code is ``#{k : T_k ≤ y}``: exact round-to-nearest
    with float32 comparisons only (the midpoints are exact in float64).
    """
    m = dynamic_map(signed).astype(np.float64)
    mid = (m[:-1] + m[1:]) / 2.0  # (255,) exact
    t = mid.astype(np.float32)
    up = np.nextafter(t, np.float32(np.inf))
    return np.where(t.astype(np.float64) > mid, t, up).astype(np.float32)


_CELL_SHIFT = 15
_CELL0 = 0x407FFFFF >> _CELL_SHIFT  # the cell of -1.0 (its ordered key)
_CELLS = (0xBF800000 >> _CELL_SHIFT) - _CELL0 + 1  # to 1.0: 65026


@functools.cache
def _cells(signed: bool) -> np.ndarray:
    """Per cell of the float32 line in ``[-1, 1]``, the count of thresholds below.

    int32 ``(65026,)``: the thresholds at or below the cell's least value.
    A cell is a run of floats sharing sign, exponent and the top 8 mantissa bits
    (relative width 2^-8, under the maps' smallest relative gap between thresholds,
    0.53%): it holds at most one threshold (checked), so the nearest code of ``y``
    is ``cells[cell(y)] + (T[that] ≤ y)``.
    """
    keys = (np.arange(_CELLS, dtype=np.uint64) + _CELL0) << _CELL_SHIFT
    keys = keys.astype(np.uint32)  # the least ordered key of each cell
    bits = np.where(keys >= 0x80000000, keys ^ 0x80000000, ~keys).astype(np.uint32)
    counts = np.searchsorted(_thresholds(signed), bits.view(np.float32), "right")
    assert np.diff(counts).max() <= 1  # one comparison finishes every count
    return counts.astype(np.int32)


def nearest_codes(y: jax.Array, signed: bool) -> jax.Array:
    """The dynamic map's nearest code of each float32 ``y`` in ``[-1, 1]``, int32.

    ``#{k : T_k ≤ y}`` (`_thresholds`: exact round-to-nearest, ties to the lower
    code) from the cell table (`_cells`) and one comparison: two gathers a value.
    The floats are ordered as integers (negative ones bit-flipped) to find the cell.

    >>> nearest_codes(jnp.array([-1.0, 0.0, 0.5, 1.0]), signed=True).tolist()
    [0, 127, 219, 255]
    """
    bits = jax.lax.bitcast_convert_type(y, jnp.uint32)
    sign = jnp.uint32(0x80000000)
    key = jnp.where(bits >= sign, ~bits, bits ^ sign)  # ordered as the floats
    cell = jnp.clip((key >> _CELL_SHIFT).astype(jnp.int32) - _CELL0, 0, _CELLS - 1)
    k = jnp.asarray(_cells(signed))[cell]
    t = jnp.asarray(np.append(_thresholds(signed), np.float32(np.inf)))
    return k + (t[k] <= y).astype(jnp.int32)


def quantize_blocks(
    x: jax.Array, signed: bool, block_size: int = BLOCK_SIZE
) -> Blockwise8bit:
    """``x`` (any shape, float32) as `Blockwise8bit` codes of the dynamic map.

    A block of zeros gets ``absmax = 0`` and the code of 0 (dequantized: 0). The
    signed map's extremes are ``-0.99297`` and ``1``, so ``-absmax`` comes back
    ``0.7%`` short (as in bitsandbytes).

    >>> q = quantize_blocks(jnp.array([0.5, -1.0, 0.0]), signed=True)
    >>> [round(x, 4) for x in dequantize_blocks(q, signed=True).tolist()]
    [0.5008, -0.993, 0.0]
    """
    n = x.size
    blocks = -(-n // block_size)
    flat = jnp.pad(x.reshape(-1), (0, blocks * block_size - n))
    flat = flat.reshape(blocks, block_size)  # (blocks, B)
    absmax = jnp.max(jnp.abs(flat), axis=1)  # (blocks,)
    scale = jnp.where(absmax > 0, absmax, 1.0)[:, None]
    normed = flat / scale  # (blocks, B) in [-1, 1]
    codes = (
        nearest_codes(normed, signed).astype(jnp.uint8).reshape(-1)[:n].reshape(x.shape)
    )
    return Blockwise8bit(codes, absmax.astype(jnp.float32))


def dequantize_blocks(
    q: Blockwise8bit, signed: bool, block_size: int = BLOCK_SIZE
) -> jax.Array:
    """The float32 values ``map[codes] · absmax[block]`` of `quantize_blocks`."""
    shape, n = q.codes.shape, q.codes.size
    blocks = q.absmax.shape[0]
    values = jnp.asarray(dynamic_map(signed))[q.codes.reshape(-1)]  # (n,)
    values = jnp.pad(values, (0, blocks * block_size - n))
    values = values.reshape(blocks, block_size) * q.absmax[:, None]
    return values.reshape(-1)[:n].reshape(shape)


def _zero_moment(p: Any, min_8bit_size: int, block_size: int) -> Any:
    if p.size < min_8bit_size:
        return jnp.zeros(p.shape, jnp.float32)
    blocks = -(-p.size // block_size)
    return Blockwise8bit(
        jnp.zeros(p.shape, jnp.uint8), jnp.zeros((blocks,), jnp.float32)
    )


def adam8bit_rule(
    g: jax.Array,
    m: Any,
    v: Any,
    bc1: jax.Array,
    bc2: jax.Array,
    b1: float,
    b2: float,
    eps: float,
    block_size: int = BLOCK_SIZE,
) -> tuple[jax.Array, Any, Any]:
    """One leaf of `scale_by_adam_8bit`: ``(u, m', v')`` (float32 ``u``)."""
    g = g.astype(jnp.float32)
    if not isinstance(m, Blockwise8bit):  # a small leaf: float32 Adam
        return adam_rule(g, m, v, bc1, bc2, b1, b2, eps, 0.0)
    m_old = dequantize_blocks(m, signed=True, block_size=block_size)
    v_old = dequantize_blocks(v, signed=False, block_size=block_size)
    u, m_new, v_new = adam_rule(g, m_old, v_old, bc1, bc2, b1, b2, eps, 0.0)
    return (
        u,
        quantize_blocks(m_new, signed=True, block_size=block_size),
        quantize_blocks(v_new, signed=False, block_size=block_size),
    )


def scale_by_adam_8bit(
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    *,
    block_size: int = BLOCK_SIZE,
    min_8bit_size: int = MIN_8BIT_SIZE,
) -> GradientTransformation:
    r"""Adam's direction with 8-bit block-wise moments (Dettmers et al., 2022).

    .. math::
        m_t = β_1 \mathrm{deq}(q^m_{t-1}) + (1-β_1) g_t,\quad
        v_t = β_2 \mathrm{deq}(q^v_{t-1}) + (1-β_2) g_t^2

        u_t = \frac{m_t / (1-β_1^t)}{\sqrt{v_t / (1-β_2^t)} + ε},\qquad
        q^m_t = \mathrm{quant}_{signed}(m_t),\; q^v_t = \mathrm{quant}_{unsigned}(v_t)

    in float32: ``u_t`` uses the new moments before they are rounded to 8 bits (as
    bitsandbytes' kernels do). Leaves under ``min_8bit_size`` values keep float32
    ``m, v`` (then this is `scale_by_adam`). See the module's docstring for
    ``quant``/``deq``.

    Args:
        b1: decay of the first moment.
        b2: decay of the second moment.
        eps: added to the denominator outside the square root.
        block_size: values per absmax block.
        min_8bit_size: leaves with fewer values keep float32 moments.

    Example:
        >>> tx = scale_by_adam_8bit()
        >>> s = tx.init({"w": jnp.zeros((64, 64)), "b": jnp.zeros(64)})
        >>> s.mu["w"].codes.dtype, s.mu["w"].absmax.shape, s.mu["b"].dtype
        (dtype('uint8'), (16,), dtype('float32'))
    """

    def init(params: Params) -> ScaleByAdam8bitState:
        zero = functools.partial(
            _zero_moment, min_8bit_size=min_8bit_size, block_size=block_size
        )
        return ScaleByAdam8bitState(
            count=jnp.zeros([], jnp.int32),
            mu=jax.tree_util.tree_map(zero, params),
            nu=jax.tree_util.tree_map(zero, params),
        )

    def update(
        updates: Updates, state: OptState, params: Params | None = None
    ) -> tuple[Updates, OptState]:
        del params
        count = safe_increment(state.count)
        bc1, bc2 = adam_bias_corrections(count, b1, b2)  # () each
        g_leaves, treedef = jax.tree_util.tree_flatten(updates)
        m_leaves = treedef.flatten_up_to(state.mu)  # type: ignore[attr-defined]
        v_leaves = treedef.flatten_up_to(state.nu)  # type: ignore[attr-defined]
        outs = [
            adam8bit_rule(g, m, v, bc1, bc2, b1, b2, eps, block_size)
            for g, m, v in zip(g_leaves, m_leaves, v_leaves)
        ]
        u, mu, nu = (
            jax.tree_util.tree_unflatten(treedef, [o[i] for o in outs])
            for i in range(3)
        )
        return u, ScaleByAdam8bitState(count=count, mu=mu, nu=nu)

    return GradientTransformation(init, update)


@functools.cache
def _kernel_tables() -> np.ndarray:
    """The kernel's ``maps`` operand, float32 ``(1024,)``.

    ``map_s, map_u, T_s, T_u``, the thresholds padded with +inf to 256.
    """
    inf = np.array([np.inf], np.float32)
    maps = [dynamic_map(True), dynamic_map(False)]
    return np.concatenate([*maps, _thresholds(True), inf, _thresholds(False), inf])


@functools.cache
def _kernel_cells() -> np.ndarray:
    """The kernel's ``cells`` operand: `_cells` of the signed map, then unsigned."""
    return np.concatenate([_cells(True), _cells(False)])


def _leaf_native(
    p: jax.Array, g: jax.Array, m: Blockwise8bit, v: Blockwise8bit, h: jax.Array
) -> tuple[jax.Array, Blockwise8bit, Blockwise8bit]:
    """``entrenar/kernels/adamw8bit.cc``: θ and the four state arrays in place.

    ``h``: ``(1-β1, β1, 1-β2, β2, 1-β1^t, 1-β2^t, ε, λ, -η_t)`` float32.
    """
    sds = jax.ShapeDtypeStruct
    codes, blocks = sds(p.shape, jnp.uint8), sds(m.absmax.shape, jnp.float32)
    call = jax.ffi.ffi_call(
        "entrenar_adamw8bit",
        (sds(p.shape, jnp.float32), codes, blocks, codes, blocks),
        input_output_aliases={0: 0, 2: 1, 3: 2, 4: 3, 5: 4},
    )
    tables, cells = jnp.asarray(_kernel_tables()), jnp.asarray(_kernel_cells())
    state = (m.codes, m.absmax, v.codes, v.absmax)
    p_new, cm, am, cv, av = call(p, g, *state, h, tables, cells)
    return p_new, Blockwise8bit(cm, am), Blockwise8bit(cv, av)


def adam8bit_apply(
    b1: float,
    b2: float,
    eps: float,
    weight_decay: float,
    mask: Mask | None,
    decay: GradientTransformation | None,
    rate: GradientTransformation,
    block_size: int = BLOCK_SIZE,
) -> TransformApplyFn:
    """The ``apply`` of the chains ``(adam_8bit, [decay,] rate)``: one pass a leaf.

    A float32 8-bit leaf (blocks of 256) goes through the native kernel
    ``entrenar/kernels/adamw8bit.cc`` when `entrenar.native.use` allows; every other
    leaf through `adam8bit_rule`, the decay, the rate and `apply_updates` (the
    chain's operations: bit for bit the chain). The kernel equals the JAX path to
    float32 rounding (tests/optim/test_optim_adam8bit.py).

    Args:
        b1: ``β_1``.
        b2: ``β_2``.
        eps: ``ε``.
        weight_decay: ``λ`` (0 for `adam_8bit`).
        mask: the decay mask, as in `entrenar.optim.adamw`.
        decay: the chain's `add_decayed_weights` piece (None: the chain has none).
        rate: the chain's `scale_by_learning_rate` piece.
        block_size: values per absmax block.
    """

    def apply(
        grads: Updates, state: OptState, params: Params
    ) -> tuple[Params, OptState]:
        if decay is None:
            adam_s, rate_s = state
        else:
            adam_s, decay_s, rate_s = state
            _, decay_s = decay.update(grads, decay_s, params)  # pure: only its state
        count = safe_increment(adam_s.count)
        c1, c2 = adam_bias_corrections(count, b1, b2)  # () 1 - β1^t, 1 - β2^t
        neg_lr, rate_s = rate.update(jnp.ones((), jnp.float32), rate_s)  # () -η_t
        decayed = (
            jax.tree_util.tree_map(lambda _: True, params)
            if mask is None or decay is None
            else resolve_mask(mask, params)
        )

        def leaf(p: Any, g: Any, m: Any, v: Any, d: bool) -> tuple[Any, Any, Any]:
            wd = weight_decay if d and decay is not None else 0.0
            if (
                isinstance(m, Blockwise8bit)
                and block_size == BLOCK_SIZE
                and p.shape == g.shape
                and native.use("adamw8bit", p, g)
            ):
                f = jnp.float32
                h = [f(1 - b1), f(b1), f(1 - b2), f(b2), c1, c2, f(eps), f(wd)]
                return _leaf_native(p, g, m, v, jnp.stack([*h, neg_lr]))
            u, m_new, v_new = adam8bit_rule(g, m, v, c1, c2, b1, b2, eps, block_size)
            if wd:
                u = u + wd * jnp.asarray(p).astype(u.dtype)
            return apply_updates(p, u * neg_lr.astype(u.dtype)), m_new, v_new

        p_leaves, treedef = jax.tree_util.tree_flatten(params)
        up_to = treedef.flatten_up_to  # type: ignore[attr-defined]
        outs = [
            leaf(*xs)
            for xs in zip(
                p_leaves,
                up_to(grads),
                up_to(adam_s.mu),
                up_to(adam_s.nu),
                up_to(decayed),
                strict=True,
            )
        ]
        new_p, mu, nu = (
            jax.tree_util.tree_unflatten(treedef, [o[i] for o in outs])
            for i in range(3)
        )
        adam_s = ScaleByAdam8bitState(count=count, mu=mu, nu=nu)
        if decay is None:
            return new_p, (adam_s, rate_s)
        return new_p, (adam_s, decay_s, rate_s)

    return apply


__all__ = [
    "BLOCK_SIZE",
    "MIN_8BIT_SIZE",
    "Blockwise8bit",
    "ScaleByAdam8bitState",
    "adam8bit_apply",
    "adam8bit_rule",
    "dequantize_blocks",
    "dynamic_map",
    "nearest_codes",
    "quantize_blocks",
    "scale_by_adam_8bit",
]
