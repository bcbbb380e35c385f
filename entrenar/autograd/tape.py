"""The tape: which operations are recorded, and the nodes that record them.

State lives in two `contextvars.ContextVar`s (the only global state in entrenar), so
threads and asyncio tasks each see their own tape and grad mode:

* ``_GRAD_ENABLED``: whether new operations are recorded (`no_grad` turns it off).
* ``_TAPE``: the current `Tape`, a weak registry of live `Node`s in creation (that is,
  topological) order.

A `Node` is one recorded operation: the op, its static parameters, its arguments
(tensors or constants) and, for leaf tensors, a snapshot of their value at record time.
Nodes are owned by the tensors they produce; the tape only holds weak references, so a
graph nobody can reach any more disappears from the tape by itself.
"""

from __future__ import annotations

import contextlib
import contextvars
import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from entrenar.autograd.ops import Op
    from entrenar.autograd.tensor import Tensor


class Node:
    """One recorded operation ``out = op.fn(*args, **static)``.

    Attributes:
        op: the operation (name and pure jnp function).
        static: hashable ``((name, value), ...)`` keyword parameters.
        args: positional arguments: `Tensor` or constant (array / Python scalar).
        snaps: for each argument that is a leaf tensor, its value when recorded
            (so later changes to a constant input cannot alter this graph); ``None``
            for other arguments.
        recorded: whether the node is on the tape (grad mode was on and an input
            requires grad); recorded nodes pin their grad-requiring leaves.
        freed: set by ``backward(..., retain_graph=False)``; a freed node cannot be
            differentiated (or evaluated) again.
    """

    __slots__ = ("__weakref__", "args", "freed", "op", "recorded", "snaps", "static")

    def __init__(
        self,
        op: Op,
        static: tuple[tuple[str, Any], ...],
        args: tuple[Any, ...],
        snaps: tuple[Any, ...],
        recorded: bool,
    ):
        self.op = op
        self.static = static
        self.args = args
        self.snaps = snaps
        self.recorded = recorded
        self.freed = False
        if recorded:
            for a in args:
                if _is_pinned_leaf(a):
                    a._live_uses += 1

    def free(self) -> None:
        """Release this node: its pinned leaves may be modified again."""
        if self.freed:
            return
        self.freed = True
        if self.recorded:
            for a in self.args:
                if _is_pinned_leaf(a):
                    a._live_uses -= 1

    def __del__(self) -> None:
        try:
            self.free()
        except Exception:  # pragma: no cover - interpreter shutdown
            pass


def _is_pinned_leaf(a: Any) -> bool:
    # A leaf that requires grad: changing its data would invalidate the gradient.
    return getattr(a, "_node", 1) is None and getattr(a, "requires_grad", False)


class Tape:
    """Weak registry of the live recorded nodes, in creation order."""

    def __init__(self) -> None:
        self._nodes: weakref.WeakValueDictionary[int, Node] = (
            weakref.WeakValueDictionary()
        )
        self._count = 0

    def record(self, node: Node) -> None:
        """Add ``node`` to the tape."""
        self._nodes[self._count] = node
        self._count += 1

    def live_nodes(self) -> list[Node]:
        """Recorded nodes not yet freed by a backward pass, oldest first."""
        return [n for _, n in sorted(self._nodes.items()) if not n.freed]

    def clear(self) -> None:
        """Free every node on the tape (as ``backward`` does for its graph)."""
        for n in list(self._nodes.values()):
            n.free()
        self._nodes.clear()

    def __len__(self) -> int:
        return len(self.live_nodes())


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


def pinned(t: Tensor) -> bool:
    """Whether a live recorded node still needs the data of leaf tensor ``t``."""
    return t._live_uses > 0


__all__ = ["Node", "Tape", "enable_grad", "get_tape", "is_grad_enabled", "no_grad"]
