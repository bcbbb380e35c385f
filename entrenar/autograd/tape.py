"""The tape: which operations are recorded, and the nodes that record them.

State lives in two `contextvars.ContextVar`s (the only global state in entrenar), so
threads and asyncio tasks each see their own tape and grad mode:

* ``_GRAD_ENABLED``: whether new operations are recorded (`no_grad` turns it off).
* ``_TAPE``: the current `Tape`, which counts the live recorded `Node`s.

A `Node` is one recorded operation: the op, its static parameters, its arguments
(tensors or constants) and, for leaf tensors, a snapshot of their value at record time.
Nodes are owned by the tensors they produce, so a graph nobody can reach any more
disappears from the tape by itself.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from entrenar.autograd.ops import Op


class TensorBase:
    """The base of `entrenar.autograd.Tensor`, its only subclass.

    The modules below ``tensor.py`` (``ops``, ``engine``) must tell a recorded tensor
    from a constant array; they test ``isinstance(x, TensorBase)``, which needs no
    import of ``tensor.py`` (which imports them).
    """

    __slots__ = ()
    # what ops and the engine read (declared for the type checker; Tensor's slots)
    _aval: Any  # ops.Aval: shape, dtype, weak type
    _value: Any  # the array, or None while not computed
    requires_grad: bool


class Node:
    """One recorded operation ``out = op.fn(*args, **static)``.

    Attributes:
        op: the operation (name and pure jnp function).
        static: hashable ``((name, value), ...)`` keyword parameters.
        args: positional arguments: `Tensor` or constant (array / Python scalar).
        snaps: for each argument that is a leaf tensor, its value when recorded
            (so later changes to a constant input cannot alter this graph); ``None``
            for other arguments.
        tape: the `Tape` the node is recorded on, or None when it is not recorded
            (grad mode off, or no input requires grad). Recorded nodes pin their
            grad-requiring leaves: their data cannot change until the node is freed.
        pins: for each argument, whether it was a leaf that required grad when the
            node was recorded. Backward differentiates exactly these leaves (a leaf
            that requires grad only later is a constant of this graph, as recorded).
        freed: set by ``backward(..., retain_graph=False)`` or when the node is
            garbage-collected; a freed node cannot be differentiated again.
    """

    __slots__ = ("args", "freed", "op", "pins", "snaps", "static", "tape")

    def __init__(
        self,
        op: Op,
        static: tuple[tuple[str, Any], ...],
        args: tuple[Any, ...],
        snaps: tuple[Any, ...],
        tape: Tape | None,
    ):
        self.op = op
        self.static = static
        self.args = args
        self.snaps = snaps
        self.tape = tape
        self.freed = False
        self.pins = tuple(
            tape is not None and s is not None and a.requires_grad
            for a, s in zip(args, snaps)
        )
        if tape is not None:
            tape._live += 1
            for a, pinned in zip(args, self.pins):
                if pinned:
                    a._live_uses += 1

    @property
    def recorded(self) -> bool:
        """Whether the node is on a tape."""
        return self.tape is not None

    def free(self) -> None:
        """Release this node: its pinned leaves may be modified again."""
        if self.freed:
            return
        self.freed = True
        if self.tape is not None:
            self.tape._live -= 1
            for a, pinned in zip(self.args, self.pins):
                if pinned:
                    a._live_uses -= 1

    def unrecord(self) -> None:
        """Take the node off its tape (its output no longer requires grad)."""
        self.free()
        self.freed = False
        self.tape = None
        self.pins = (False,) * len(self.args)  # its leaves are read as recorded

    def __del__(self) -> None:
        try:
            self.free()
        except Exception:  # pragma: no cover - interpreter shutdown
            pass


class Tape:
    """The recording context: counts the live recorded nodes.

    The nodes themselves are owned by the tensors they produce (a graph nobody can
    reach disappears, and leaves the tape, by itself); ``len(tape)`` is the number of
    recorded nodes not yet freed by a backward pass.
    """

    __slots__ = ("_live",)

    def __init__(self) -> None:
        self._live = 0

    def __len__(self) -> int:
        return self._live


_GRAD_ENABLED: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "entrenar_grad_enabled", default=True
)
_TAPE: contextvars.ContextVar[Tape | None] = contextvars.ContextVar(
    "entrenar_tape", default=None
)


def get_tape() -> Tape:
    """The tape of the current context (created on first use)."""
    tape = _TAPE.get()
    if tape is None:
        tape = Tape()
        _TAPE.set(tape)
    return tape


def is_grad_enabled() -> bool:
    """Whether operations are currently recorded for differentiation."""
    return _GRAD_ENABLED.get()


@contextlib.contextmanager
def no_grad() -> Iterator[None]:
    """Record nothing inside the block; results do not require grad.

    Example:
        >>> from entrenar.autograd import Tensor
        >>> w = Tensor([1.0, 2.0], requires_grad=True)
        >>> with no_grad():
        ...     y = w * 2.0
        >>> y.requires_grad
        False
    """
    token = _GRAD_ENABLED.set(False)
    try:
        yield
    finally:
        _GRAD_ENABLED.reset(token)


@contextlib.contextmanager
def enable_grad() -> Iterator[None]:
    """Record operations inside the block, even within `no_grad`."""
    token = _GRAD_ENABLED.set(True)
    try:
        yield
    finally:
        _GRAD_ENABLED.reset(token)


__all__ = ["Node", "Tape", "enable_grad", "get_tape", "is_grad_enabled", "no_grad"]
