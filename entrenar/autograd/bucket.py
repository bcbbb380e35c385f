"""Shape buckets: one compiled program serves every shape of a graph in a size range.

XLA compiles for static shapes, so an eager loop whose shapes change every step (a
notebook trying sizes, variable-length data) would compile one program per step. When
a graph structure keeps arriving with new shapes (`entrenar.autograd.engine` decides),
each *varying* size ``s`` is padded up to a bucket ``P = bucket_size(s)`` (16, 24,
32, 48, 64, ...: at most 1.5x the size above 16) and the true sizes become a runtime
input ``sz``. One program per bucket then serves all sizes in it.

Correctness: every op with a padding rule (`Op.pad`) computes, on the valid region
(index < true size on every padded axis), exactly what it computes unpadded:

* ``"elementwise"``: inputs are broadcast to the padded output shape, then masked
  (``where(valid, x, 0)``); the valid region of the output depends only on the valid
  region of the inputs.
* ``"sum"``, ``"mean"``, ``"max"``: reduce with ``where=valid`` (``jnp.mean``'s count is
  the number of valid elements; ``max`` starts from the dtype's lowest value).
* ``"matmul"``: both operands masked to 0, so padded terms add 0 to each dot product.
* ``"transpose"``: permutes the valid region with the axes.
* ``"take"`` (``x[ids]``, integer ``ids``, ``x`` unpadded): padded ids are masked to 0.

Gradients: the target is masked too, so the cotangent arriving at every padded
position is exactly 0 and each masking ``where`` stops whatever the padded region
produces (even ``0·∞``) before a sum over a broadcast axis could mix it into the valid
region. Hence the valid region of every gradient equals the unpadded gradient (up to
summation order inside reductions). Graphs with an op without a rule (reshape, slicing,
the functional layer's ops unless they declare one) are compiled for their exact shapes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


class Unsupported(Exception):
    """This program cannot run in a bucket (caught by the engine: exact compile)."""


MIN_BUCKET = 16  # sizes 3..16 share one bucket: padding tiny arrays costs nothing


def bucket_size(s: int) -> int:
    """The padded size for true size ``s``: 16, 24, 32, 48, 64, ... (<= 1.5x ``s``).

    Sizes 1 and 2 are never padded (1 broadcasts); 3 to 16 share the first bucket.

    Example:
        >>> [bucket_size(s) for s in (1, 2, 3, 16, 17, 25, 100, 1000)]
        [1, 2, 16, 16, 24, 32, 128, 1024]
    """
    if s <= 2:
        return s
    if s <= MIN_BUCKET:
        return MIN_BUCKET
    p = 1 << (s - 1).bit_length()  # the next power of two >= s
    return 3 * p // 4 if 3 * p // 4 >= s else p


def _shape(sig: Any) -> tuple[int, ...]:
    return () if isinstance(sig, type) else sig.shape


def dims(in_avals: Sequence[Any], out_avals: Sequence[Any]) -> tuple[int, ...]:
    """Every axis size of a program's inputs and instruction outputs, in order."""
    return tuple(d for a in (*in_avals, *out_avals) for d in _shape(a))


class Plan:
    """How to run one program padded: the bucket key, padded inputs, true sizes."""

    __slots__ = ("in_specs", "ins", "key", "out_info", "seen", "sz")

    def __init__(self, key: tuple, ins: list[Any], sz: np.ndarray, in_specs, out_info):
        self.key = key
        self.ins = ins
        self.sz = sz
        self.in_specs = in_specs  # per input slot: per axis, size index or -1
        self.out_info = out_info  # per instruction: (spec, padded shape, dtype)
        self.seen: Any = None  # the engine's record of this structure


def plan(prog: Any, ref_dims: tuple[int, ...]) -> Plan | None:
    """Pad the sizes of ``prog`` that differ from ``ref_dims`` (same structure).

    Returns None when nothing would be padded or an op has no applicable rule.
    """
    instrs, in_avals, out_avals = prog.instrs, prog.in_avals, prog.out_avals
    if not instrs or any(op.pad is None for op, _, _ in instrs):
        return None
    cur = dims(in_avals, out_avals)
    varying = sorted({c for c, r in zip(cur, ref_dims) if c != r and c > 2})
    if not varying:
        return None
    index = {s: j for j, s in enumerate(varying)}

    def spec(sig: Any) -> tuple[int, ...]:
        return tuple(index.get(d, -1) for d in _shape(sig))

    def padded(shape: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(bucket_size(d) if d in index else d for d in shape)

    in_specs = [spec(a) for a in in_avals]
    out_info = [(spec(a), padded(a.shape), a.dtype) for a in out_avals]
    for op, static, slots in instrs:
        if op.pad == "take":
            x_spec = in_specs[slots[0]] if slots[0] >= 0 else out_info[-1 - slots[0]][0]
            if static != (("spec", (("array", 0),)),) or any(j >= 0 for j in x_spec):
                return None
    ins: list[Any] = []
    sig_key: list[Any] = []
    for v, a, sp in zip(prog.inputs, in_avals, in_specs):
        if any(j >= 0 for j in sp):
            if not (jnp.issubdtype(a.dtype, jnp.number) or a.dtype == jnp.bool_):
                return None  # e.g. PRNG keys: no zero to pad with
            v = pad_like(v, padded(a.shape))
        ins.append(v)
        sig_key.append(
            a if isinstance(a, type) else (padded(a.shape), a.dtype, a.weak_type)
        )
    key = (
        tuple(instrs),
        tuple(sig_key),
        tuple(in_specs),
        tuple(out_info),
        len(varying),
        tuple(prog.diff_slots),
    )
    return Plan(key, ins, np.asarray(varying, np.int32), in_specs, out_info)


def unpad(value: Any, true_shape: tuple[int, ...]) -> jax.Array:
    """The valid region of a padded result, as a device array (sliced on the host)."""
    if tuple(value.shape) == tuple(true_shape):
        return value
    host = np.asarray(value)[tuple(slice(0, d) for d in true_shape)]
    return jax.device_put(host)


def pad_like(value: Any, shape: tuple[int, ...]) -> np.ndarray:
    """``value`` zero-padded at the end of each axis to ``shape`` (on the host)."""
    arr = np.asarray(value)
    return np.pad(arr, [(0, p - d) for d, p in zip(arr.shape, shape)])


def _mask(shape: tuple[int, ...], spec: Sequence[int], sz: Any) -> Any:
    """Boolean array of ``shape``: True where every padded axis is below its size."""
    m = None
    for ax, j in enumerate(spec):
        if j >= 0:
            a = jax.lax.broadcasted_iota(jnp.int32, shape, ax) < sz[j]
            m = a if m is None else m & a
    return m


def _zero(x: Any, m: Any) -> Any:
    return jnp.where(m, x, jnp.zeros_like(x))


def _lowest(dtype: Any) -> Any:
    if jnp.issubdtype(dtype, jnp.inexact):
        return -jnp.inf
    if dtype == jnp.bool_:
        return False
    return jnp.iinfo(dtype).min


def _apply(op: Any, static: tuple, args: list[Any], specs, out_spec, out_shape, sz):
    kw = dict(static)
    kind = op.pad
    if kind == "elementwise":
        m = _mask(out_shape, out_spec, sz)
        if m is not None:
            args = [
                _zero(a if a.shape == out_shape else jnp.broadcast_to(a, out_shape), m)
                for a in args
            ]
        return op.fn(*args, **kw)
    if kind in ("sum", "mean", "max"):
        x = args[0]
        m = _mask(x.shape, specs[0], sz)
        if m is None:
            return op.fn(x, **kw)
        axis, keepdims = kw["axis"], kw["keepdims"]
        if kind == "sum":
            return jnp.sum(x, axis, keepdims=keepdims, where=m)
        if kind == "mean":
            return jnp.mean(x, axis, keepdims=keepdims, where=m)
        return jnp.max(x, axis, keepdims=keepdims, where=m, initial=_lowest(x.dtype))
    if kind == "matmul":
        a, b = (
            _zero(v, _mask(v.shape, s, sz)) if any(j >= 0 for j in s) else v
            for v, s in zip(args, specs)
        )
        return op.fn(a, b, **kw)
    if kind == "take":
        x, ids = args
        m = _mask(ids.shape, specs[1], sz)
        return op.fn(x, ids if m is None else _zero(ids, m), **kw)
    if kind == "transpose":
        return op.fn(*args, **kw)
    raise Unsupported(f"no padding rule {kind!r} for op {op.name}")


def run(
    instrs: Sequence[tuple], in_specs, out_info, ins: Sequence[Any], sz: Any
) -> Any:
    """Replay a program on padded inputs (traced inside `jax.jit`); returns the target.

    ``in_specs`` and ``out_info`` come from the `Plan`. The target's padded region is
    zeroed, so a cotangent of ones is 0 there.
    """
    outs: list[Any] = []
    out_spec: tuple[int, ...] = ()
    for (op, static, slots), (out_spec, shape, dtype) in zip(instrs, out_info):
        args = [ins[s] if s >= 0 else outs[-1 - s] for s in slots]
        specs = [in_specs[s] if s >= 0 else out_info[-1 - s][0] for s in slots]
        out = _apply(op, static, args, specs, out_spec, shape, sz)
        if out.shape != shape or out.dtype != dtype:  # a rule that does not fit
            raise Unsupported(f"{op.name}: got {out.dtype}{out.shape}, want {shape}")
        outs.append(out)
    m = _mask(outs[-1].shape, out_spec, sz)
    return outs[-1] if m is None else _zero(outs[-1], m)


__all__ = [
    "Plan",
    "Unsupported",
    "bucket_size",
    "dims",
    "pad_like",
    "plan",
    "run",
    "unpad",
]
