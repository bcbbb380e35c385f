"""Turning a recorded graph into one pure function, compiling it, and running it.

Eager mode is lazy: an operation on tensors records a `Node` and infers its output
shape, but computes nothing. When a value is needed (``.data``, ``.item()``) or
``backward`` is called, the graph below the target is linearised into a `Program`: a
list of instructions ``(op, static, argument slots)`` over input slots (leaf values and
constants). The program's structure (instructions, input shapes and dtypes, which inputs
are differentiated) is its cache key, and each program runs as one `jax.jit`-compiled
function kept in a bounded least-recently-used cache (`entrenar.autograd.cache`). A
notebook-style loop that repeats the same step therefore costs one compiled call per
evaluation instead of one dispatch per operation. When a structure's evaluation has
been followed by ``backward`` before, evaluating it again computes the value and the
gradients in the same compiled call (the forward pass is not run twice), and
``backward`` then only accumulates them.

Changing shapes: a structure met at ``SHAPES_BEFORE_BUCKETING`` distinct shapes that
arrives with yet another one runs padded to a shape bucket (`entrenar.autograd.bucket`),
so a loop over new sizes compiles once per bucket instead of once per size. (Running a
new shape op by op instead was measured slower still: eager JAX compiles every
primitive for every new shape.) A bucketed shape that repeats ``PROMOTE_AFTER`` times
in a row is compiled for its exact shape.

Inside `jax.jit` the same code runs on tracers; the compiled program is inlined into the
caller's computation, so the result is what ``jax.grad`` of the same function gives.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp

from entrenar.autograd import bucket as _bucket
from entrenar.autograd import ops as _ops
from entrenar.autograd.cache import programs as _programs
from entrenar.autograd.tape import TensorBase
from entrenar.errors import TapeError

if TYPE_CHECKING:
    from entrenar.autograd.tensor import Tensor

SHAPES_BEFORE_BUCKETING = 2  # exact-shape programs per structure before buckets
PROMOTE_AFTER = 32  # a bucketed shape seen this many times in a row gets its own
_HISTORY_SIZE = 1024  # structures remembered (bounded like the program cache)

# counters shared with the cache: "hits", "misses", "evictions", "compiles", "fused",
# "bucketed" (cache_info() reports them; tests read them)
stats = _programs.counts


class _Seen:
    """What the engine remembers of one structure (kind, shape-free key)."""

    __slots__ = ("exact", "last", "no_bucket", "ref", "streak")

    def __init__(self, ref: tuple[int, ...]):
        self.ref = ref  # axis sizes of the first shape met (bucket.dims)
        self.exact = 1  # shapes compiled exactly
        self.last: tuple = ()  # the last exact key run in a bucket, and how often
        self.streak = 0
        self.no_bucket = False  # a padding rule did not fit: always exact


_history: collections.OrderedDict[tuple, _Seen] = collections.OrderedDict()


class Program:
    """A linearised graph: inputs, instructions and the slot of the target."""

    __slots__ = (
        "diff_slots",
        "diff_tensors",
        "in_avals",
        "inputs",
        "instrs",
        "key",
        "nodes",
        "out_avals",
    )

    def __init__(self) -> None:
        self.inputs: list[Any] = []  # values of input slots
        self.in_avals: list[Any] = []  # their Aval, or the Python scalar type
        self.out_avals: list[Any] = []  # Aval of each instruction's output
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
    tensor_type = TensorBase
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
            prog.in_avals.append(t._aval)
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
            for a, snap, pinned in zip(node.args, node.snaps, node.pins):
                if isinstance(a, tensor_type) and (
                    snap is None or (for_grad and pinned)
                ):
                    stack.append((a, False))
            continue
        arg_slots = []
        for a, snap, pinned in zip(node.args, node.snaps, node.pins):
            if not isinstance(a, tensor_type):  # a constant array or Python scalar
                arg_slots.append(len(inputs))
                inputs.append(a)
                sigs.append(_scalar_sig(a))
                prog.in_avals.append(sigs[-1])
            elif snap is None or (for_grad and pinned):
                arg_slots.append(slot_of[id(a)])
            else:  # a constant leaf, as recorded
                slot = slot_of.get(id(snap))
                if slot is None:
                    slot = slot_of[id(snap)] = len(inputs)
                    inputs.append(snap)
                    sigs.append(a._aval if snap is a._value else _scalar_sig(snap))
                    prog.in_avals.append(sigs[-1])
                arg_slots.append(slot)
        slot_of[id(t)] = -1 - len(instrs)
        instrs.append((node.op, node.static, tuple(arg_slots)))
        prog.out_avals.append(t._aval)
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


def _make_grad(prog: Program, run: Callable = _run) -> Callable:
    instrs, diff_slots = prog.instrs, tuple(prog.diff_slots)

    def value_and_grads(ins: list[Any], seed: Any, *extra: Any) -> tuple[Any, list]:
        def f(diff_vals: list[Any]) -> Any:
            full = list(ins)
            for s, v in zip(diff_slots, diff_vals):
                full[s] = v
            return run(instrs, full, *extra)

        out, vjp = jax.vjp(f, [ins[s] for s in diff_slots])
        cot = jnp.ones_like(out) if seed is None else jnp.asarray(seed, out.dtype)
        (grads,) = vjp(cot)
        return out, grads

    return value_and_grads


def _is_traced(values: Sequence[Any]) -> bool:
    return any(isinstance(v, jax.core.Tracer) for v in values)


def _structure(prog: Program, kind: str) -> tuple:
    """The shape-free key of ``prog``: instructions, input ranks and dtypes."""
    ranks = tuple(
        a if isinstance(a, type) else (len(a.shape), a.dtype) for a in prog.in_avals
    )
    return (kind, prog.key[0], ranks, tuple(prog.diff_slots))


def _bucket_plan(prog: Program, kind: str) -> _bucket.Plan | None:
    """A padded plan when this structure keeps changing shape, else None (exact)."""
    if not prog.instrs or _is_traced(prog.inputs):
        return None
    skey = _structure(prog, kind)
    seen = _history.get(skey)
    if seen is None:
        _history[skey] = _Seen(_bucket.dims(prog.in_avals, prog.out_avals))
        if len(_history) > _HISTORY_SIZE:
            _history.popitem(last=False)
        return None
    _history.move_to_end(skey)
    if seen.no_bucket or seen.exact < SHAPES_BEFORE_BUCKETING:
        seen.exact += 1
        return None
    seen.streak = seen.streak + 1 if seen.last == prog.key else 1
    seen.last = prog.key
    if seen.streak >= PROMOTE_AFTER:  # settled on this shape: compile it exactly
        seen.streak = 0
        return None
    p = _bucket.plan(prog, seen.ref)
    if p is None:  # an op without a padding rule never fits; nothing to pad may
        seen.no_bucket = any(op.pad is None for op, _, _ in prog.instrs)
    else:
        p.seen = seen
    return p


def _run_bucketed(prog: Program, p: _bucket.Plan, kind: str, seed: Any) -> Any:
    """Run ``prog`` padded (compiling its bucket's program once); results unpadded."""
    key = ("bucket-" + kind, p.key)
    fn = _programs.get(key)
    if fn is None:
        instrs, in_specs, out_info = prog.instrs, p.in_specs, p.out_info

        def run(instrs: Sequence[tuple], ins: Sequence[Any], sz: Any) -> Any:
            return _bucket.run(instrs, in_specs, out_info, ins, sz)

        if kind == "forward":
            fn = jax.jit(lambda ins, sz: run(instrs, ins, sz))
        else:
            fn = jax.jit(_make_grad(prog, run))
        _programs.put(key, fn)
        stats["compiles"] += 1
    target = prog.out_avals[-1].shape
    try:
        if kind == "forward":
            out = _bucket.unpad(fn(p.ins, p.sz), target)
        else:
            if seed is not None:
                seed = _bucket.pad_like(seed, p.out_info[-1][1])
            out, grads = fn(p.ins, seed, p.sz)
            out = _bucket.unpad(out, target)
            grads = [
                _bucket.unpad(g, prog.in_avals[s].shape)
                for g, s in zip(grads, prog.diff_slots)
            ]
    except _bucket.Unsupported:
        _programs.pop(key)
        p.seen.no_bucket = True
        raise
    stats["bucketed"] += 1
    return out if kind == "forward" else (out, grads)


def _call(prog: Program, kind: str, seed: Any = None) -> Any:
    """Run the forward (``kind="forward"``) or value-and-grads program of ``prog``."""
    key = (kind, prog.key)
    fn = _programs.get(key)
    if fn is None:
        p = _bucket_plan(prog, kind)
        if p is not None:
            try:
                return _run_bucketed(prog, p, kind, seed)
            except _bucket.Unsupported:
                pass  # this structure is compiled exactly from now on
        fn = jax.jit(_make_forward(prog) if kind == "forward" else _make_grad(prog))
        _programs.put(key, fn)
        stats["compiles"] += 1
    return fn(prog.inputs) if kind == "forward" else fn(prog.inputs, seed)


def evaluate(t: Tensor) -> Any:
    """Compute the value of a lazy tensor.

    When this graph's structure has been differentiated before (at this shape or, in
    a loop of changing shapes, at another), a backward pass is expected to follow: the
    gradients are computed in the same call and kept for `backward`.
    """
    prog = None
    if t.requires_grad and t.size == 1:
        try:
            prog = build(t, for_grad=True)
        except TapeError:  # part of the graph was freed: a plain forward is fine
            prog = None
        if prog is not None and prog.instrs:
            grad_fn = _programs.get(("grad", prog.key))
            if grad_fn is not None or _structure(prog, "grad") in _history:
                if grad_fn is None:
                    out, grads = _call(prog, "grad")
                else:
                    out, grads = grad_fn(prog.inputs, None)
                stats["fused"] += 1
                t._pending = (grads, prog.diff_tensors, prog.nodes)
                return out
    if prog is None:
        prog = build(t, for_grad=False)
    return _call(prog, "forward")


def backward(t: Tensor, seed: Any = None, *, retain_graph: bool = False) -> None:
    """Accumulate d(t)/d(leaf) (times ``seed``) into ``.grad`` of every leaf."""
    pending = t._pending
    t._pending = None
    if pending is not None and seed is None:
        grads, tensors, nodes = pending
    else:
        prog = build(t, for_grad=True)
        tensors, nodes = prog.diff_tensors, prog.nodes
        out, grads = _call(prog, "grad", seed)
        if t._value is None:
            t._value = out
    for leaf, g in zip(tensors, grads):
        leaf.grad = g if leaf.grad is None else leaf.grad + g
    if not retain_graph:
        for node in nodes:
            node.free()


def clear_caches() -> None:
    """Forget every compiled program, the shape history and the counters.

    This releases the memory of the compiled programs (JAX's own caches of them are
    keyed by the dropped functions).
    """
    _programs.clear()
    _history.clear()
    _ops._AVAL_CACHE.clear()
