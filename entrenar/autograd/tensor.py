"""`Tensor`: an array that records the operations applied to it.

A tensor is either a **leaf** (made from data; ``requires_grad=True`` marks a
parameter whose ``.grad`` backward fills) or the **output of an operation** (it holds a
`Node` and is computed lazily, see `entrenar.autograd.engine`). Its value is a
``jax.Array`` (``.data``); gradients are ``jax.Array``s of the same shape.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from entrenar.autograd import engine
from entrenar.autograd import ops as _ops
from entrenar.autograd.tape import Node, TensorBase, get_tape, is_grad_enabled
from entrenar.errors import DTypeError, ShapeError, TapeError


def _to_value(data: Any, dtype: Any = None) -> Any:
    """Host or device array for ``data`` with a canonical JAX dtype."""
    if isinstance(data, Tensor):
        data = data.data
    if isinstance(data, jax.Array):  # includes tracers
        return data if dtype is None else data.astype(dtype)
    arr = np.asarray(data, dtype=dtype)
    canonical = jax.dtypes.canonicalize_dtype(arr.dtype)
    if arr.dtype != canonical:
        arr = arr.astype(canonical)
    return arr


class Tensor(TensorBase):
    """A shaped array with an autograd tape.

    Args:
        data: a list, number, numpy array, jax array (or tracer) or Tensor.
        requires_grad: record operations on this tensor so that `backward` fills
            its ``.grad``.
        dtype: optional dtype to convert to (default: the data's, with float64
            becoming float32 unless JAX's x64 mode is on).

    Example:
        >>> from entrenar.autograd import Tensor, backward
        >>> x = Tensor([3.0], requires_grad=True)
        >>> y = x * x
        >>> backward(y)
        >>> x.grad.tolist()
        [6.0]
    """

    __slots__ = (
        "__weakref__",
        "_aval",
        "_live_uses",
        "_node",
        "_pending",
        "_requires_grad",
        "_value",
        "grad",
    )
    __array_priority__ = 1000  # numpy defers to Tensor's reflected operators

    def __init__(self, data: Any, requires_grad: bool = False, dtype: Any = None):
        value = _to_value(data, dtype)
        self._init(value, None, requires_grad)

    def _init(
        self, value: Any, node: Node | None, requires_grad: bool, aval: Any = None
    ) -> None:
        self._value = value
        self._node = node
        self._aval = aval if aval is not None else _ops.Aval.of(value)
        self._live_uses = 0
        self._pending: Any = None
        self._requires_grad = bool(requires_grad)
        self.grad: Any = None
        if requires_grad:
            self._check_differentiable()

    def _check_differentiable(self) -> None:
        if not _ops.is_inexact(self.dtype):
            raise TapeError(
                f"only floating-point tensors can require grad, got {self.dtype}; "
                "pass dtype=jnp.float32"
            )

    @classmethod
    def _wrap(cls, value: Any, requires_grad: bool = False) -> Tensor:
        t = cls.__new__(cls)
        t._init(value, None, requires_grad)
        return t

    @classmethod
    def _lazy(cls, node: Node, aval: Any, requires_grad: bool) -> Tensor:
        t = cls.__new__(cls)
        t._init(None, node, requires_grad, aval)
        return t

    # ---- constructors ----------------------------------------------------------
    @classmethod
    def from_vec(cls, values: Sequence[float], requires_grad: bool = False) -> Tensor:
        """A 1-D float32 tensor from a list of numbers (Rust's ``Tensor::from_vec``)."""
        return cls._wrap(np.asarray(values, np.float32).reshape(-1), requires_grad)

    @classmethod
    def zeros(
        cls, shape: int | Sequence[int], requires_grad: bool = False, dtype: Any = None
    ) -> Tensor:
        """A tensor of zeros (float32 by default)."""
        return cls(np.zeros(shape, dtype or np.float32), requires_grad)

    @classmethod
    def ones(
        cls, shape: int | Sequence[int], requires_grad: bool = False, dtype: Any = None
    ) -> Tensor:
        """A tensor of ones (float32 by default)."""
        return cls(np.ones(shape, dtype or np.float32), requires_grad)

    @classmethod
    def randn(
        cls,
        shape: int | Sequence[int],
        *,
        key: jax.Array,
        requires_grad: bool = False,
        dtype: Any = jnp.float32,
    ) -> Tensor:
        """Standard normal samples drawn with an explicit ``key``."""
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        return cls(jax.random.normal(key, shape, dtype), requires_grad)

    # ---- properties ------------------------------------------------------------
    @property
    def shape(self) -> tuple[int, ...]:
        """The shape, known without computing the value."""
        return self._aval.shape

    @property
    def dtype(self) -> np.dtype:
        """The element dtype."""
        return self._aval.dtype

    @property
    def ndim(self) -> int:
        """Number of dimensions."""
        return len(self._aval.shape)

    @property
    def size(self) -> int:
        """Number of elements."""
        return math.prod(self._aval.shape)

    @property
    def is_leaf(self) -> bool:
        """True for tensors made from data (not by an operation)."""
        return self._node is None

    @property
    def data(self) -> jax.Array:
        """The value as a ``jax.Array`` (computed on first access)."""
        if self._value is None:
            self._value = engine.evaluate(self)
        if not isinstance(self._value, jax.Array):
            self._value = jnp.asarray(self._value)
        return self._value

    @data.setter
    def data(self, value: Any) -> None:
        if self._node is not None:
            raise TapeError(
                "cannot assign .data of a tensor computed by an operation "
                f"({self._node.op.name}); assign to a leaf, or use .detach() first"
            )
        if self.requires_grad and self._live_uses > 0:
            raise TapeError(
                f"cannot change the data of a tensor that requires grad (shape "
                f"{self.shape}) while {self._live_uses} recorded operation(s) still "
                "need it: call backward() first, build that graph under no_grad(), "
                "or drop the tensors that hold it"
            )
        new = _to_value(value)
        self._value = new
        self._aval = _ops.Aval.of(new)

    def numpy(self) -> np.ndarray:
        """The value as a numpy array."""
        if self._value is None:
            self._value = engine.evaluate(self)
        return np.asarray(self._value)

    def item(self) -> float | int | bool:
        """The value of a one-element tensor as a Python number."""
        if self.size != 1:
            raise ShapeError(
                f"item() needs a tensor with one element, got shape {self.shape}"
            )
        return self.numpy().reshape(()).item()

    def tolist(self) -> Any:
        """The value as nested Python lists."""
        return self.numpy().tolist()

    def zero_grad(self) -> None:
        """Forget the accumulated gradient (``.grad`` becomes None)."""
        self.grad = None

    def backward(self, grad: Any = None, *, retain_graph: bool = False) -> None:
        """``entrenar.backward(self, grad, retain_graph=...)``, PyTorch's spelling.

        Accumulates ``∂self/∂x`` into ``x.grad`` for every leaf ``x`` that requires
        grad; see `entrenar.autograd.backward`.
        """
        # backward.py imports this module; import it when first called.
        from entrenar.autograd.backward import backward

        backward(self, grad, retain_graph=retain_graph)

    def detach(self) -> Tensor:
        """A tensor with the same value, cut from the graph (no grad flows back)."""
        if self._node is None:
            return Tensor._wrap(self._value)
        return apply_op(_ops.STOP_GRADIENT, self)._as_constant()

    def _as_constant(self) -> Tensor:
        self._requires_grad = False
        if self._node is not None:
            self._node.unrecord()
        return self

    @property
    def requires_grad(self) -> bool:
        """Whether `backward` differentiates with respect to this tensor.

        Setting it is `requires_grad_`: checked, and without effect on operations
        recorded before (as in PyTorch).
        """
        return self._requires_grad

    @requires_grad.setter
    def requires_grad(self, flag: bool) -> None:
        self.requires_grad_(flag)

    def requires_grad_(self, flag: bool = True) -> Tensor:
        """Set ``requires_grad`` on a leaf, in place; returns the tensor.

        Operations recorded before keep treating the tensor as they recorded it (a
        constant stays a constant of those graphs). A tensor computed from tensors
        that do not require grad becomes a leaf holding its value, as in PyTorch
        (``w = (Tensor.randn(s, key=k) * 0.02).requires_grad_()``). Raises
        `TapeError` for an integer tensor, for turning off the flag of a tensor
        computed by a recorded operation (use `detach`), and while recorded
        operations still use the tensor.
        """
        flag = bool(flag)
        if flag == self._requires_grad:
            return self
        if self._node is not None:
            if self._requires_grad:
                raise TapeError(
                    "requires_grad can be turned off on leaf tensors only; for a "
                    f"tensor computed by {self._node.op.name!r} use .detach()"
                )
            self._check_differentiable()
            self._value = self.data  # computed from constants: now a leaf
            self._node = None
        if self._live_uses > 0:
            raise TapeError(
                "cannot change requires_grad of a tensor that recorded operations "
                "still use; call backward() first"
            )
        if flag:
            self._check_differentiable()
        self._requires_grad = flag
        return self

    def astype(self, dtype: Any) -> Tensor:
        """Convert to ``dtype`` (differentiable between float dtypes)."""
        return apply_op(_ops.ASTYPE, self, dtype=np.dtype(dtype))

    def __repr__(self) -> str:
        grad = ", requires_grad=True" if self.requires_grad else ""
        op = f", op={self._node.op.name}" if self._node is not None else ""
        if self._value is None:
            body = f"<lazy {self.dtype}{list(self.shape)}>"
        else:
            try:
                body = np.array2string(
                    np.asarray(self._value), precision=4, threshold=20, separator=", "
                )
            except Exception:  # tracers
                body = f"<traced {self.dtype}{list(self.shape)}>"
        return f"Tensor({body}, shape={self.shape}, dtype={self.dtype}{grad}{op})"

    def _repr_html_(self) -> str:
        """Jupyter's view: shape, dtype, gradient state, the values and ``.grad``."""
        import html

        def values(x: Any) -> str:
            try:
                text = np.array2string(
                    np.asarray(x), precision=4, threshold=50, separator=", "
                )
            except Exception:  # tracers
                text = "<traced>"
            return f"<pre style='margin:0'>{html.escape(text)}</pre>"

        facts = [f"shape {self.shape}", f"dtype {self.dtype}"]
        if self.requires_grad:
            facts.append("requires_grad")
        if self._node is not None:
            facts.append(f"op {self._node.op.name}")
        body = "<i>lazy</i>" if self._value is None else values(self._value)
        rows = f"<tr><th>value</th><td style='text-align:left'>{body}</td></tr>"
        if getattr(self, "grad", None) is not None:
            grad = values(self.grad)
            rows += f"<tr><th>grad</th><td style='text-align:left'>{grad}</td></tr>"
        return f"<b>Tensor</b> {html.escape(', '.join(facts))}<table>{rows}</table>"

    def __len__(self) -> int:
        if not self.shape:
            raise TypeError("len() of a 0-d tensor")
        return self.shape[0]

    def __bool__(self) -> bool:
        return bool(self.item())

    def __float__(self) -> float:
        return float(self.item())

    def __int__(self) -> int:
        return int(self.item())

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        arr = self.numpy()
        return arr if dtype is None else arr.astype(dtype)

    # ---- operators --------------------------------------------------------------
    def __add__(self, o: Any) -> Tensor:
        return apply_op(_ops.ADD, self, o)

    def __radd__(self, o: Any) -> Tensor:
        return apply_op(_ops.ADD, o, self)

    def __sub__(self, o: Any) -> Tensor:
        return apply_op(_ops.SUB, self, o)

    def __rsub__(self, o: Any) -> Tensor:
        return apply_op(_ops.SUB, o, self)

    def __mul__(self, o: Any) -> Tensor:
        return apply_op(_ops.MUL, self, o)

    def __rmul__(self, o: Any) -> Tensor:
        return apply_op(_ops.MUL, o, self)

    def __truediv__(self, o: Any) -> Tensor:
        return apply_op(_ops.DIV, self, o)

    def __rtruediv__(self, o: Any) -> Tensor:
        return apply_op(_ops.DIV, o, self)

    def __pow__(self, o: Any) -> Tensor:
        return apply_op(_ops.POW, self, o)

    def __rpow__(self, o: Any) -> Tensor:
        return apply_op(_ops.POW, o, self)

    def __matmul__(self, o: Any) -> Tensor:
        return apply_op(_ops.MATMUL, self, o)

    def __rmatmul__(self, o: Any) -> Tensor:
        return apply_op(_ops.MATMUL, o, self)

    def __neg__(self) -> Tensor:
        return apply_op(_ops.NEG, self)

    def __lt__(self, o: Any) -> Tensor:
        return apply_op(_ops.LT, self, o)

    def __le__(self, o: Any) -> Tensor:
        return apply_op(_ops.LE, self, o)

    def __gt__(self, o: Any) -> Tensor:
        return apply_op(_ops.GT, self, o)

    def __ge__(self, o: Any) -> Tensor:
        return apply_op(_ops.GE, self, o)

    def __eq__(self, o: Any) -> Any:
        """Elementwise ``==`` (a bool tensor, as in PyTorch); ``t == None`` is False."""
        return NotImplemented if o is None else apply_op(_ops.EQ, self, o)

    def __ne__(self, o: Any) -> Any:
        """Elementwise ``!=`` (a bool tensor); ``t != None`` is True."""
        return NotImplemented if o is None else apply_op(_ops.NE, self, o)

    __hash__ = object.__hash__  # by identity, as PyTorch's tensors

    # ---- in place: x += y ------------------------------------------------------------
    def _inplace(self, op: _ops.Op, o: Any, sym: str) -> Tensor:
        """``self {sym}= o``: PyTorch's in-place update where the tape allows it.

        A leaf whose result needs no recording (under `no_grad`, or nothing
        requires grad) is updated in place (``with no_grad(): w -= lr * w.grad``),
        keeping its shape and dtype; a leaf that requires grad cannot be changed in
        grad mode (`TapeError`, as in PyTorch). Any other tensor is replaced by the
        result (the name is rebound; the recorded graph is unchanged).
        """
        if self._node is None and self._requires_grad and is_grad_enabled():
            raise TapeError(
                f"a leaf tensor that requires grad (shape {self.shape}) cannot be "
                f"changed in place (x {sym}= ...) while operations are recorded: "
                f"update it under no_grad() (with no_grad(): w {sym}= ...) or with "
                "an optimizer's step()"
            )
        out = apply_op(op, self, o)
        if self._node is not None or out.requires_grad:
            return out
        if out.shape != self.shape:
            raise ShapeError(
                f"in-place x {sym}= y gives shape {out.shape}, not x's {self.shape}: "
                f"an in-place update cannot broadcast x; write x = x {sym} y"
            )
        value = out.data
        if value.dtype != self.dtype:
            if not np.can_cast(value.dtype, self.dtype, "same_kind"):
                raise DTypeError(
                    f"in-place x {sym}= y gives {value.dtype}, which x ({self.dtype}) "
                    f"cannot hold; write x = x {sym} y, or convert x with astype"
                )
            value = value.astype(self.dtype)
        self.data = value  # TapeError while recorded operations still need self
        return self

    def __iadd__(self, o: Any) -> Tensor:
        return self._inplace(_ops.ADD, o, "+")

    def __isub__(self, o: Any) -> Tensor:
        return self._inplace(_ops.SUB, o, "-")

    def __imul__(self, o: Any) -> Tensor:
        return self._inplace(_ops.MUL, o, "*")

    def __itruediv__(self, o: Any) -> Tensor:
        return self._inplace(_ops.DIV, o, "/")

    def __ipow__(self, o: Any) -> Tensor:
        return self._inplace(_ops.POW, o, "**")

    def __getitem__(self, index: Any) -> Tensor:
        items = index if isinstance(index, tuple) else (index,)
        # index tensors are constants: their values (checked, masks made integer)
        items = tuple(it.data if isinstance(it, Tensor) else it for it in items)
        spec, arrays = _ops.encode_index(items, self.shape)
        return apply_op(_ops.GETITEM, self, *arrays, spec=spec)

    def __iter__(self) -> Iterator[Tensor]:
        """The sub-tensors along the first axis, ``self[0], self[1], ...``."""
        if not self.shape:
            raise TypeError("iteration over a 0-d tensor")
        return (self[i] for i in range(self.shape[0]))

    # ---- methods mirroring the functional API -------------------------------------
    def sum(self, axis: Any = None, keepdims: bool = False) -> Tensor:
        """Sum over ``axis`` (all axes by default)."""
        return apply_op(_ops.SUM, self, axis=_ops._axis(axis), keepdims=keepdims)

    def mean(self, axis: Any = None, keepdims: bool = False) -> Tensor:
        """Mean over ``axis`` (all axes by default)."""
        return apply_op(_ops.MEAN, self, axis=_ops._axis(axis), keepdims=keepdims)

    def max(self, axis: Any = None, keepdims: bool = False) -> Tensor:
        """Maximum over ``axis``; ties share the gradient equally (as jax.grad)."""
        return apply_op(_ops.MAX, self, axis=_ops._axis(axis), keepdims=keepdims)

    def reshape(self, *shape: Any) -> Tensor:
        """Reshape (one ``-1`` allowed)."""
        if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
            shape = tuple(shape[0])
        return apply_op(_ops.RESHAPE, self, shape=tuple(int(s) for s in shape))

    def transpose(self, *axes: int) -> Tensor:
        """Permute axes (reverse them when none are given)."""
        if len(axes) == 1 and isinstance(axes[0], (tuple, list)):
            axes = tuple(axes[0])
        return apply_op(_ops.TRANSPOSE, self, axes=tuple(axes) or None)

    @property
    def T(self) -> Tensor:
        """The transpose (axes reversed)."""
        return self.transpose()

    def exp(self) -> Tensor:
        """Elementwise e^x."""
        return apply_op(_ops.EXP, self)

    def log(self) -> Tensor:
        """Elementwise natural logarithm."""
        return apply_op(_ops.LOG, self)

    def sqrt(self) -> Tensor:
        """Elementwise square root."""
        return apply_op(_ops.SQRT, self)

    def tanh(self) -> Tensor:
        """Elementwise tanh."""
        return apply_op(_ops.TANH, self)

    def abs(self) -> Tensor:
        """Elementwise absolute value."""
        return apply_op(_ops.ABS, self)


def apply_op(op: _ops.Op, *args: Any, **static: Any) -> Any:
    """Record ``op(*args, **static)`` and return its (lazy) output tensor.

    The output's shape and dtype come from `entrenar.autograd.ops.infer` (so a shape
    error surfaces here); its value is computed when first read. Under `no_grad`
    nothing is recorded: the op runs at once and the result is a plain leaf that does
    not require grad.
    """
    static_t = tuple(sorted(static.items())) if static else ()
    aval = _ops.infer(op, static_t, args)
    if not is_grad_enabled():
        vals = [a.data if isinstance(a, Tensor) else a for a in args]
        return Tensor._wrap(op.fn(*vals, **static), requires_grad=False)
    requires = False
    snaps = []
    for a in args:
        if isinstance(a, Tensor):
            requires = requires or a.requires_grad
            snaps.append(a._value if a._node is None else None)
        else:
            snaps.append(None)
    requires = requires and _ops.is_inexact(aval.dtype)
    node = Node(op, static_t, args, tuple(snaps), get_tape() if requires else None)
    return Tensor._lazy(node, aval, requires_grad=requires)


def as_tensor(x: Any) -> Tensor:
    """``x`` if it is a Tensor, else a constant Tensor holding it."""
    return x if isinstance(x, Tensor) else Tensor(x)


__all__ = ["Tensor", "apply_op", "as_tensor"]
