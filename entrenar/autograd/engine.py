"""Turning a recorded graph into one pure function, compiling it, and running it.

Eager mode is lazy: an operation on tensors records a `Node` and infers its output
shape, but computes nothing. When a value is needed (``.data``, ``.item()``) or
``backward`` is called, the graph below the target is linearised into a `Program`: a
list of instructions ``(op, static, argument slots)`` over input slots (leaf values and
constants). The program's structure (instructions, input shapes and dtypes, which inputs
are differentiated) is its cache key, and
each program runs as one `jax.jit`-compiled function cached by that key. A
notebook-style loop that repeats the same step therefore costs one compiled call per
evaluation instead of one dispatch per operation. (Running a new structure op by op
first was measured to be slower: eager JAX compiles every primitive for every new
shape, about 3x the time of compiling the whole program once.) When a structure's
evaluation has been followed by ``backward`` before, evaluating it again computes the
value and the gradients in the same compiled call (the forward pass is not run twice),
and ``backward`` then only accumulates them.

Inside `jax.jit` the same code runs on tracers; the compiled program is inlined into the
caller's computation, so the result is what ``jax.grad`` of the same function gives.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp

from entrenar.autograd import ops as _ops
from entrenar.errors import TapeError

if TYPE_CHECKING:
    from entrenar.autograd.tensor import Tensor

# key -> compiled function; bounded so a stream of distinct graphs cannot grow memory.
_CACHE_SIZE = 512
_compiled: collections.OrderedDict[tuple, Callable] = collections.OrderedDict()
stats: collections.Counter[str] = (
    collections.Counter()
)  # "eager", "compiled", "compiles", "fused" (for tests)


class Program:
    """A linearised graph: inputs, instructions and the slot of the target."""

    __slots__ = ("diff_slots", "diff_tensors", "inputs", "instrs", "key", "nodes")

    def __init__(self) -> None:
        self.inputs: list[Any] = []  # values of input slots
        self.instrs: list[tuple] = []  # (op, static, arg slots)
        self.diff_slots: list[int] = []  # input slots differentiated by backward
        self.diff_tensors: list[Tensor] = []  # the leaves owning those slots
        self.nodes: list[Any] = []  # recorded nodes walked (freed after backward)
        self.key: tuple = ()


def _scalar_sig(v: Any) -> Any:
    return type(v) if isinstance(v, (bool, int, float, complex)) else _ops.Aval.of(v)


def build(target: Tensor, *, for_grad: bool) -> Program:
    """Linearise the graph below ``target`` (iterative post-order walk).

    A tensor is recomputed from its node when it has no value yet, or when it requires
    grad (so gradients flow through it); otherwise its value is an input slot. Leaves
    are read through the value recorded with each node, except the leaves being
    differentiated (the gradient's variables). Slots: inputs are numbered 0, 1, ...;
    instruction outputs -1, -2, ...
    """
    tensor_type = _ops.TENSOR_TYPE
    prog = Program()
    inputs, instrs, nodes = prog.inputs, prog.instrs, prog.nodes
    slot_of: dict[int, int] = {}  # id(tensor) or id(snapshot value) -> slot
    sigs: list[Any] = []

    stack: list[tuple[Any, bool]] = [(target, False)]
    while stack:
        t, expanded = stack.pop()
        if id(t) in slot_of:
            continue
        node = t._node
        if node is None or (t._value is not None and not t.requires_grad):
            diff = for_grad and node is None and t.requires_grad
            slot_of[id(t)] = len(inputs)
            if diff:
                prog.diff_slots.append(len(inputs))
                prog.diff_tensors.append(t)
            inputs.append(t._value)
            sigs.append((t._aval, diff))
            continue
        if for_grad and node.freed:
            raise TapeError(
                "backward through a graph that was already freed (op "
                f"{node.op.name!r}, output shape {t.shape}): a previous backward() "
                "released it; pass retain_graph=True to the first backward() to "
                "differentiate twice"
            )
        if not expanded:
            stack.append((t, True))
            for a, snap in zip(node.args, node.snaps):
                if isinstance(a, tensor_type) and (
                    snap is None or (for_grad and a.requires_grad)
                ):
                    stack.append((a, False))
            continue
        arg_slots = []
        for a, snap in zip(node.args, node.snaps):
            if not isinstance(a, tensor_type):  # a constant array or Python scalar
                arg_slots.append(len(inputs))
                inputs.append(a)
                sigs.append(_scalar_sig(a))
            elif snap is None or (for_grad and a.requires_grad):
                arg_slots.append(slot_of[id(a)])
            else:  # a constant leaf, as recorded
                slot = slot_of.get(id(snap))
                if slot is None:
                    slot = slot_of[id(snap)] = len(inputs)
                    inputs.append(snap)
                    sigs.append(a._aval if snap is a._value else _scalar_sig(snap))
                arg_slots.append(slot)
        slot_of[id(t)] = -1 - len(instrs)
        instrs.append((node.op, node.static, tuple(arg_slots)))
        if node.tape is not None:
            nodes.append(node)
    prog.key = (tuple(instrs), tuple(sigs))
    return prog


def _run(instrs: Sequence[tuple], ins: Sequence[Any]) -> Any:
    """Replay a program: the pure function the graph denotes."""
    if not instrs:
        return ins[0]
    outs: list[Any] = []
    for op, static, slots in instrs:
        args = [ins[s] if s >= 0 else outs[-1 - s] for s in slots]
        outs.append(op.fn(*args, **dict(static)))
    return outs[-1]


def _make_forward(prog: Program) -> Callable:
    instrs = prog.instrs

    def forward(ins: list[Any]) -> Any:
        return _run(instrs, ins)

    return forward


def _make_grad(prog: Program) -> Callable:
    instrs, diff_slots = prog.instrs, tuple(prog.diff_slots)

    def value_and_grads(ins: list[Any], seed: Any) -> tuple[Any, list[Any]]:
        def f(diff_vals: list[Any]) -> Any:
            full = list(ins)
            for s, v in zip(diff_slots, diff_vals):
                full[s] = v
            return _run(instrs, full)

        out, vjp = jax.vjp(f, [ins[s] for s in diff_slots])
        cot = jnp.ones_like(out) if seed is None else jnp.asarray(seed, out.dtype)
        (grads,) = vjp(cot)
        return out, grads

    return value_and_grads


def _compiled_fn(prog: Program, kind: str, make: Callable) -> Callable:
    """The jitted ``make(prog)``, compiled once per (kind, structure) and cached."""
    key = (kind, prog.key)
    fn = _compiled.get(key)
    if fn is None:
        fn = jax.jit(make(prog))
        _compiled[key] = fn
        stats["compiles"] += 1
        if len(_compiled) > _CACHE_SIZE:
            _compiled.popitem(last=False)
    return fn


def evaluate(t: Tensor) -> Any:
    """Compute the value of a lazy tensor.

    When this graph's structure has been differentiated before (its gradient program
    is compiled), a backward pass is expected to follow: the gradients are computed in
    the same call and kept for `backward`.
    """
    prog = None
    if t.requires_grad and t.size == 1:
        try:
            prog = build(t, for_grad=True)
        except TapeError:  # part of the graph was freed: a plain forward is fine
            prog = None
        grad_fn = prog and prog.instrs and _compiled.get(("grad", prog.key))
        if grad_fn:
            assert prog is not None
            out, grads = grad_fn(prog.inputs, None)
            stats["fused"] += 1
            t._pending = (grads, prog.diff_tensors, prog.nodes)
            return out
    if prog is None:
        prog = build(t, for_grad=False)
    return _compiled_fn(prog, "forward", _make_forward)(prog.inputs)


def backward(t: Tensor, seed: Any = None, *, retain_graph: bool = False) -> None:
    """Accumulate d(t)/d(leaf) (times ``seed``) into ``.grad`` of every leaf."""
    pending = t._pending
    t._pending = None
    if pending is not None and seed is None:
        grads, tensors, nodes = pending
    else:
        prog = build(t, for_grad=True)
        tensors, nodes = prog.diff_tensors, prog.nodes
        out, grads = _compiled_fn(prog, "grad", _make_grad)(prog.inputs, seed)
        if t._value is None:
            t._value = out
    for leaf, g in zip(tensors, grads):
        leaf.grad = g if leaf.grad is None else leaf.grad + g
    if not retain_graph:
        for node in nodes:
            node.free()


def clear_caches() -> None:
    """Forget every compiled program (for tests and memory pressure)."""
    _compiled.clear()
    stats.clear()
