"""Operations on tensors: how a call is recorded, and the basic math and shape ops.

Each operation is an `Op`: a name and a pure jnp function ``fn(*arrays, **static)``.
Its backward rule is ``jax.vjp`` of that function; the engine applies it to the whole
recorded graph at once (see `entrenar.autograd.engine`). Calling an op records a node
and infers the output's shape and dtype with `jax.eval_shape` (cached per op, static
parameters and input shapes), so shape errors surface at the line that caused them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from entrenar.autograd.tape import Node, get_tape, is_grad_enabled
from entrenar.errors import ShapeError


class Op:
    """A named pure function over arrays; its vjp is its backward rule."""

    __slots__ = ("fn", "name")

    def __init__(self, name: str, fn: Callable[..., Any]):
        self.name = name
        self.fn = fn

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
    if isinstance(a, TENSOR_TYPE):
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


def infer(op: Op, static: tuple, args: Sequence[Any]) -> Aval:
    """Output shape and dtype of ``op`` on ``args`` (cached)."""
    sigs = [_sig(a) for a in args]
    key = (op, static, tuple(sigs))
    out = _AVAL_CACHE.get(key)
    if out is None:
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
        out = Aval.of(sds)
        if len(_AVAL_CACHE) > 65536:
            _AVAL_CACHE.clear()
        _AVAL_CACHE[key] = out
    return out


_INEXACT: dict[Any, bool] = {}
TENSOR_TYPE: Any = None  # entrenar.autograd.tensor.Tensor, set when that module loads


def _is_inexact(dtype: Any) -> bool:
    r = _INEXACT.get(dtype)
    if r is None:
        r = _INEXACT[dtype] = bool(jnp.issubdtype(dtype, jnp.inexact))
    return r


def apply(op: Op, *args: Any, **static: Any) -> Any:
    """Record ``op(*args, **static)`` and return its (lazy) output tensor.

    Under `no_grad` nothing is recorded: the op runs at once and the result is a
    plain leaf that does not require grad.
    """
    tensor = TENSOR_TYPE
    static_t = tuple(sorted(static.items())) if static else ()
    aval = infer(op, static_t, args)
    if not is_grad_enabled():
        vals = [a.data if isinstance(a, tensor) else a for a in args]
        return tensor._wrap(op.fn(*vals, **static), requires_grad=False)
    requires = False
    snaps = []
    for a in args:
        if isinstance(a, tensor):
            requires = requires or a.requires_grad
            snaps.append(a._value if a._node is None else None)
        else:
            snaps.append(None)
    requires = requires and _is_inexact(aval.dtype)
    node = Node(op, static_t, args, tuple(snaps), get_tape() if requires else None)
    return tensor._lazy(node, aval, requires_grad=requires)


def defop(name: str, fn: Callable[..., Any]) -> Op:
    """Define an operation from a pure jnp function (its backward is its vjp)."""
    return Op(name, fn)


# ---- elementwise arithmetic (numpy broadcasting) -------------------------------
ADD = defop("add", jnp.add)
SUB = defop("sub", jnp.subtract)
MUL = defop("mul", jnp.multiply)
DIV = defop("div", jnp.divide)
POW = defop("pow", jnp.power)
NEG = defop("neg", jnp.negative)
MATMUL = defop("matmul", jnp.matmul)
LT = defop("lt", jnp.less)
LE = defop("le", jnp.less_equal)
GT = defop("gt", jnp.greater)
GE = defop("ge", jnp.greater_equal)
EXP = defop("exp", jnp.exp)
LOG = defop("log", jnp.log)
SQRT = defop("sqrt", jnp.sqrt)
ABS = defop("abs", jnp.abs)
TANH = defop("tanh", jnp.tanh)
WHERE = defop("where", jnp.where)
STOP_GRADIENT = defop("stop_gradient", jax.lax.stop_gradient)
ASTYPE = defop("astype", lambda x, *, dtype: x.astype(dtype))


# ---- reductions -----------------------------------------------------------------
def _axis(axis: int | Sequence[int] | None) -> int | tuple[int, ...] | None:
    if isinstance(axis, Sequence):
        return tuple(axis)
    return axis


SUM = defop("sum", lambda x, *, axis, keepdims: jnp.sum(x, axis, keepdims=keepdims))
MEAN = defop("mean", lambda x, *, axis, keepdims: jnp.mean(x, axis, keepdims=keepdims))
MAX = defop("max", lambda x, *, axis, keepdims: jnp.max(x, axis, keepdims=keepdims))


# ---- shape ops --------------------------------------------------------------------
RESHAPE = defop("reshape", lambda x, *, shape: jnp.reshape(x, shape))
TRANSPOSE = defop("transpose", lambda x, *, axes: jnp.transpose(x, axes))
CONCATENATE = defop("concatenate", lambda *xs, axis: jnp.concatenate(xs, axis))
STACK = defop("stack", lambda *xs, axis: jnp.stack(xs, axis))


def _encode_index(index: Any) -> tuple[tuple, list[Any]]:
    """Split an index into a hashable spec and its array parts (dynamic inputs)."""
    items = index if isinstance(index, tuple) else (index,)
    spec: list[Any] = []
    arrays: list[Any] = []
    for it in items:
        if isinstance(it, slice):
            spec.append(("slice", it.start, it.stop, it.step))
        elif it is None or it is Ellipsis or isinstance(it, (int, np.integer)):
            spec.append(int(it) if isinstance(it, np.integer) else it)
        elif isinstance(it, (TENSOR_TYPE, np.ndarray, jax.Array, list)):
            arr = it if isinstance(it, TENSOR_TYPE) else np.asarray(it)
            spec.append(("array", len(arrays)))
            arrays.append(arr)
        else:
            raise ShapeError(f"unsupported index {it!r} of type {type(it).__name__}")
    return tuple(spec), arrays


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


GETITEM = defop("getitem", lambda x, *arrays, spec: x[_decode_index(spec, arrays)])


def getitem(x: Any, index: Any) -> Any:
    """``x[index]``: ints, slices, None, Ellipsis and integer/bool arrays."""
    spec, arrays = _encode_index(index)
    return apply(GETITEM, x, *arrays, spec=spec)
