"""Operations on tensors: what an op is, its output's shape, the math and shape ops.

Each operation is an `Op`: a name and a pure jnp function ``fn(*arrays, **static)``.
Its backward rule is ``jax.vjp`` of that function; the engine applies it to the whole
recorded graph at once (see `entrenar.autograd.engine`). Calling an op
(`entrenar.autograd.apply_op`) records a node whose output shape and dtype
`infer` gives with `jax.eval_shape` (cached per op, static parameters and input
shapes), so shape errors surface at the line that caused them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from entrenar.autograd.tape import TensorBase
from entrenar.errors import ConfigError, ShapeError


class Op:
    """A named pure function over arrays; its vjp is its backward rule.

    ``pad`` names the op's padding rule (`entrenar.autograd.bucket`): how it runs on
    arrays padded to a shape bucket without changing its valid region, or None.
    """

    __slots__ = ("fn", "name", "pad")

    def __init__(self, name: str, fn: Callable[..., Any], pad: str | None = None):
        self.name = name
        self.fn = fn
        self.pad = pad

    def __repr__(self) -> str:
        return f"Op({self.name})"


class Aval(NamedTuple):
    """Shape, dtype and weak-typedness of a value (a light `jax.ShapeDtypeStruct`)."""

    shape: tuple[int, ...]
    dtype: np.dtype
    weak_type: bool = False

    @classmethod
    def of(cls, value: Any) -> Aval:
        """The aval of an array or tracer."""
        return cls(
            tuple(np.shape(value)),
            value.dtype,  # a numpy dtype, or JAX's extended dtypes (PRNG keys)
            bool(getattr(value, "weak_type", False)),
        )


_AVAL_CACHE: dict[tuple, Aval] = {}


def _sig(a: Any) -> Any:
    if isinstance(a, TensorBase):
        return a._aval
    if isinstance(a, (bool, int, float)):
        return type(a)
    return Aval.of(a)


def _abstract(sig: Any) -> Any:
    # What eval_shape receives for an argument: a Python scalar of the same type
    # (keeps weak typing), or a ShapeDtypeStruct.
    if isinstance(sig, type):
        return sig(1)
    return jax.ShapeDtypeStruct(sig.shape, sig.dtype, weak_type=sig.weak_type)


_DTYPES: dict[tuple, tuple[Any, bool]] = {}  # (op, static, ranks and dtypes) -> dtype


def _rule_shape(op: Op, static: tuple, sigs: Sequence[Any]) -> tuple[int, ...] | None:
    """The output shape of an op with a padding rule, without tracing.

    None when the rule does not say or the arguments do not fit (then
    `jax.eval_shape` decides, and raises the error).
    """
    shapes: list[tuple[int, ...]] = [
        () if isinstance(s, type) else s.shape for s in sigs
    ]
    kw = dict(static)
    try:
        if op.pad == "elementwise":
            return tuple(np.broadcast_shapes(*shapes))
        if op.pad in ("sum", "mean", "max") and len(shapes) == 1:
            return _reduced(shapes[0], kw["axis"], kw["keepdims"], op.pad == "max")
        if op.pad == "matmul" and min(len(shapes[0]), len(shapes[1])) >= 2:
            a, b = shapes
            if a[-1] == b[-2]:  # (..., m, k) @ (..., k, n) -> (..., m, n)
                return (*np.broadcast_shapes(a[:-2], b[:-2]), a[-2], b[-1])
        if op.pad == "take" and kw["spec"] == (("array", 0),) and shapes[0]:
            return (*shapes[1], *shapes[0][1:])
        if op.pad == "transpose":
            axes = kw["axes"] or tuple(reversed(range(len(shapes[0]))))
            if sorted(axes) == list(range(len(shapes[0]))):
                return tuple(shapes[0][a] for a in axes)
    except ValueError:  # shapes that do not broadcast
        return None
    return None


def _reduced(shape: tuple[int, ...], axis: Any, keep: bool, nonempty: bool) -> Any:
    nd = len(shape)
    axes = (
        tuple(range(nd))
        if axis is None
        else axis
        if isinstance(axis, tuple)
        else (axis,)
    )
    if not all(isinstance(a, (int, np.integer)) and -nd <= a < nd for a in axes):
        return None
    red = {int(a) % nd for a in axes}
    if len(red) != len(axes) or (nonempty and any(shape[a] == 0 for a in red)):
        return None
    return tuple(
        1 if i in red else d for i, d in enumerate(shape) if keep or i not in red
    )


def infer(op: Op, static: tuple, args: Sequence[Any]) -> Aval:
    """Output shape and dtype of ``op`` on ``args`` (cached).

    Ops with a padding rule (elementwise, reductions, matmul, transpose, take) at a
    new shape get their shape from the rule and reuse the dtype `jax.eval_shape` found
    for the same dtypes and ranks (their dtype does not depend on the sizes), so a
    loop over new sizes does not trace every op again.
    """
    sigs = [_sig(a) for a in args]
    key = (op, static, tuple(sigs))
    out = _AVAL_CACHE.get(key)
    if out is not None:
        return out
    shape = _rule_shape(op, static, sigs) if op.pad is not None else None
    dkey = (
        op,
        static,
        tuple(
            s if isinstance(s, type) else (len(s.shape), s.dtype, s.weak_type)
            for s in sigs
        ),
    )
    dtype = _DTYPES.get(dkey) if shape is not None else None
    if shape is not None and dtype is not None:
        out = Aval(shape, *dtype)
    else:
        out = _eval_shape(op, static, sigs)
        if shape == out.shape:
            if len(_DTYPES) > 65536:
                _DTYPES.clear()
            _DTYPES[dkey] = (out.dtype, out.weak_type)
    if len(_AVAL_CACHE) > 65536:
        _AVAL_CACHE.clear()
    _AVAL_CACHE[key] = out
    return out


def _eval_shape(op: Op, static: tuple, sigs: Sequence[Any]) -> Aval:
    kwargs = dict(static)
    try:
        sds = jax.eval_shape(
            lambda *xs: op.fn(*xs, **kwargs), *[_abstract(s) for s in sigs]
        )
    except (TypeError, ValueError, IndexError) as e:
        shapes = ", ".join(
            s.__name__ if isinstance(s, type) else f"{s.dtype}{list(s.shape)}"
            for s in sigs
        )
        raise ShapeError(
            f"{op.name}({shapes}"
            + (f"; {', '.join(f'{k}={v!r}' for k, v in static)}" if static else "")
            + f") is invalid: {e}"
        ) from None
    if not isinstance(sds, jax.ShapeDtypeStruct):
        raise ShapeError(f"{op.name} must return one array, got {type(sds)}")
    return Aval.of(sds)


_INEXACT: dict[Any, bool] = {}


def is_inexact(dtype: Any) -> bool:
    """Whether ``dtype`` is a float or complex dtype (cached: it is asked per op)."""
    r = _INEXACT.get(dtype)
    if r is None:
        r = _INEXACT[dtype] = bool(jnp.issubdtype(dtype, jnp.inexact))
    return r


PAD_RULES = ("elementwise", "sum", "mean", "max", "matmul", "transpose", "take")


def defop(name: str, fn: Callable[..., Any], *, pad: str | None = None) -> Op:
    """Define an operation from a pure jnp function (its backward is its vjp).

    Args:
        name: shown in errors and reprs.
        fn: ``fn(*arrays, **static) -> array``, pure jnp.
        pad: optional padding rule (one of `PAD_RULES`, see `entrenar.autograd.bucket`);
            ``"elementwise"`` suits any op whose output element depends only on the
            input elements at the same (broadcast) position. Ops without one are
            compiled for their exact shapes.
    """
    if pad is not None and pad not in PAD_RULES:
        raise ConfigError(
            f"defop({name!r}): pad must be one of {PAD_RULES}, got {pad!r}"
        )
    return Op(name, fn, pad)


# ---- elementwise arithmetic (numpy broadcasting) -------------------------------
ADD = defop("add", jnp.add, pad="elementwise")
SUB = defop("sub", jnp.subtract, pad="elementwise")
MUL = defop("mul", jnp.multiply, pad="elementwise")
DIV = defop("div", jnp.divide, pad="elementwise")
POW = defop("pow", jnp.power, pad="elementwise")
NEG = defop("neg", jnp.negative, pad="elementwise")
MATMUL = defop("matmul", jnp.matmul, pad="matmul")
EQ = defop("eq", jnp.equal, pad="elementwise")
NE = defop("ne", jnp.not_equal, pad="elementwise")
LT = defop("lt", jnp.less, pad="elementwise")
LE = defop("le", jnp.less_equal, pad="elementwise")
GT = defop("gt", jnp.greater, pad="elementwise")
GE = defop("ge", jnp.greater_equal, pad="elementwise")
EXP = defop("exp", jnp.exp, pad="elementwise")
LOG = defop("log", jnp.log, pad="elementwise")
SQRT = defop("sqrt", jnp.sqrt, pad="elementwise")


@jax.custom_jvp
def _abs_real(x: jax.Array) -> jax.Array:
    return jnp.abs(x)


_abs_real.defjvp(lambda xs, ts: (jnp.abs(xs[0]), jnp.sign(xs[0]) * ts[0]))


def _abs(x: jax.Array) -> jax.Array:
    """|x|; for real x the gradient is sign(x), 0 at 0 (PyTorch's; jnp.abs's is 1)."""
    return _abs_real(x) if jnp.issubdtype(x.dtype, jnp.floating) else jnp.abs(x)


ABS = defop("abs", _abs, pad="elementwise")
TANH = defop("tanh", jnp.tanh, pad="elementwise")
WHERE = defop("where", jnp.where, pad="elementwise")
STOP_GRADIENT = defop("stop_gradient", jax.lax.stop_gradient, pad="elementwise")
ASTYPE = defop("astype", lambda x, *, dtype: x.astype(dtype), pad="elementwise")


# ---- reductions -----------------------------------------------------------------
def _axis(axis: int | Sequence[int] | None) -> int | tuple[int, ...] | None:
    if isinstance(axis, Sequence):
        return tuple(axis)
    return axis


SUM = defop(
    "sum", lambda x, *, axis, keepdims: jnp.sum(x, axis, keepdims=keepdims), pad="sum"
)
MEAN = defop(
    "mean",
    lambda x, *, axis, keepdims: jnp.mean(x, axis, keepdims=keepdims),
    pad="mean",
)
MAX = defop(
    "max", lambda x, *, axis, keepdims: jnp.max(x, axis, keepdims=keepdims), pad="max"
)


# ---- shape ops --------------------------------------------------------------------
RESHAPE = defop("reshape", lambda x, *, shape: jnp.reshape(x, shape))
TRANSPOSE = defop(
    "transpose", lambda x, *, axes: jnp.transpose(x, axes), pad="transpose"
)
CONCATENATE = defop("concatenate", lambda *xs, axis: jnp.concatenate(xs, axis))
STACK = defop("stack", lambda *xs, axis: jnp.stack(xs, axis))


def encode_index(
    index: Any, shape: tuple[int, ...] | None = None
) -> tuple[tuple, list[Any]]:
    """Split an index into a hashable spec and its array parts (dynamic inputs).

    With ``shape`` (the indexed tensor's), the index is checked as PyTorch checks it:
    an integer, or a known integer array, out of range for its axis is a `ShapeError`
    (JAX would clamp it silently), and a known boolean mask ``m`` over axes of the
    same sizes becomes the integer arrays ``m.nonzero()`` (numpy's meaning of
    ``x[m]``). A boolean mask known only inside `jax.jit` is refused: the result's
    shape would depend on its values.
    """
    items = index if isinstance(index, tuple) else (index,)
    spec: list[Any] = []
    arrays: list[Any] = []
    masks: dict[int, tuple[int, ...]] = {}  # spec position of a mask's first array
    for it in items:
        if isinstance(it, slice):
            spec.append(("slice", it.start, it.stop, it.step))
        elif isinstance(it, (bool, np.bool_)):
            raise ShapeError(f"a bool index ({it!r}) is not supported; use where()")
        elif it is None or it is Ellipsis or isinstance(it, (int, np.integer)):
            spec.append(int(it) if isinstance(it, np.integer) else it)
        elif isinstance(it, (TensorBase, np.ndarray, jax.Array, list)):
            arr: Any = it if isinstance(it, (TensorBase, jax.Array)) else np.asarray(it)
            if shape is not None and arr.dtype == np.bool_:
                traced = isinstance(arr, (TensorBase, jax.core.Tracer))
                if traced or arr.ndim == 0:
                    raise ShapeError(
                        "x[mask] needs a boolean mask of at least one axis whose "
                        f"values are known; got {arr.dtype}{list(arr.shape)}"
                        + (" inside jax.jit" if traced else "")
                        + ": use where(mask, x, 0) instead"
                    )
                masks[len(spec)] = tuple(arr.shape)
                for ids in np.nonzero(np.asarray(arr)):
                    spec.append(("array", len(arrays)))
                    arrays.append(ids)
                continue
            spec.append(("array", len(arrays)))
            arrays.append(arr)
        else:
            raise ShapeError(f"unsupported index {it!r} of type {type(it).__name__}")
    if shape is not None:
        _check_index(spec, arrays, masks, items, shape)
    return tuple(spec), arrays


def _check_index(
    spec: list[Any],
    arrays: list[Any],
    masks: dict[int, tuple[int, ...]],
    items: tuple,
    shape: tuple[int, ...],
) -> None:
    """Raise `ShapeError` for an index that does not fit ``shape`` (PyTorch's check)."""
    nd = len(shape)
    used = sum(s is not None and s is not Ellipsis for s in spec)
    if used > nd:
        raise ShapeError(
            f"too many indices for a tensor of shape {shape}: {items!r} indexes "
            f"{used} axes"
        )
    if spec.count(Ellipsis) > 1:
        raise ShapeError(f"an index can have only one ellipsis (...), got {items!r}")
    ax = 0
    for i, s in enumerate(spec):
        if s is None:
            continue
        if s is Ellipsis:
            ax += nd - used
            continue
        if i in masks and shape[ax : ax + len(masks[i])] != masks[i]:
            raise ShapeError(
                f"a boolean mask of shape {masks[i]} does not fit axes {ax}.."
                f"{ax + len(masks[i]) - 1} of a tensor of shape {shape}"
            )
        lo = hi = s if isinstance(s, int) else None
        if isinstance(s, tuple) and s[0] == "array":
            arr = arrays[s[1]]
            # a traced index (inside jax.jit) cannot be checked
            if not isinstance(arr, (TensorBase, jax.core.Tracer)) and np.issubdtype(
                arr.dtype, np.integer
            ):
                host = np.asarray(arr)
                if host.size:
                    lo, hi = int(host.min()), int(host.max())
        size = shape[ax]
        if lo is not None and hi is not None and (lo < -size or hi >= size):
            bad = lo if lo < -size else hi
            raise ShapeError(
                f"index {bad} is out of range for axis {ax} of size {size} (tensor "
                f"shape {shape}); valid indices are {-size}..{size - 1}"
            )
        ax += 1


def _decode_index(spec: tuple, arrays: Sequence[Any]) -> tuple:
    out: list[Any] = []
    for s in spec:
        if isinstance(s, tuple) and s[0] == "slice":
            out.append(slice(s[1], s[2], s[3]))
        elif isinstance(s, tuple) and s[0] == "array":
            out.append(arrays[s[1]])
        else:
            out.append(s)
    return tuple(out)


GETITEM = defop(  # padded as "take" only for x[int_array] (see bucket.plan)
    "getitem", lambda x, *arrays, spec: x[_decode_index(spec, arrays)], pad="take"
)
