"""Where each parameter and optimizer-state array lives on a mesh.

A rule is chosen per named leaf (the dotted names of `entrenar.tree.key_path_str`,
e.g. ``model.layers.self_attn.q_proj.weight``), like optimizer masks and LoRA targets:

1. ``ShardingRules.rules``: ``(match, spec)`` pairs, first match wins; ``match`` is a
   predicate ``fn(name, leaf) -> bool`` or a regular expression searched in the name,
   ``spec`` a `jax.sharding.PartitionSpec` (``None``: replicated).
2. LoRA adapters (``lora_A``, ``lora_B``, their dropout keys) are replicated: they are
   small, and replicating them keeps their update free of communication.
3. Everything else follows the FSDP rule: a leaf of at least ``min_size`` elements is
   split along one axis over ``fsdp``: the largest axis whose length ``fsdp``
   divides (the first of equals), never axis 0 of stacked layers
   (``model.layers.*``: ``lax.scan`` slices that axis per layer); other leaves are
   replicated. A ``QuantizedWeight`` ``(*lead, out, in)`` is split along ``out``,
   the one axis its codes, scales and offsets share, so every shard holds whole
   quantization blocks; its second-level scales (double quantization) are
   replicated. A frozen weight's bfloat16 copy is placed as the float32 weight it
   rounds: a `entrenar.nn.Bfloat16Weight`'s bits by the weight's own name and
   shape, a `entrenar.nn.TiedEmbedding`'s table as the embedding and its
   transposed head ``(D, V)`` along the embedding's split axis, transposed.

Optimizer state is placed like the params it belongs to: each subtree of the state
with the params' structure and shapes (optax's ``mu``, ``nu``, ...) gets the params'
placement; any other leaf (step counts, learning rates, factored moments) follows the
rules by its own dotted name.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from entrenar import nn
from entrenar.distributed.mesh import MESH_AXES
from entrenar.errors import ConfigError
from entrenar.lora import LoRAWeight
from entrenar.lora.names import stacked_split
from entrenar.quant import QuantizedWeight
from entrenar.tree import key_path_str
from entrenar.types import PyTree

Match = Callable[[str, Any], bool] | str
"""A predicate ``fn(dotted_name, leaf) -> bool`` or a regex searched in the name."""

_ADAPTER_PARTS = ("lora_A", "lora_B", "dropout_key")


@dataclasses.dataclass(frozen=True)
class ShardingRules:
    """How params are placed on a mesh (see the module docstring).

    Attributes:
        min_size: leaves with fewer elements are replicated (their communication
            would cost more than their memory saves).
        rules: ``(match, spec)`` pairs checked before the defaults; ``spec`` is a
            `PartitionSpec` over the mesh axes ``("data", "fsdp")`` or ``None``
            (replicated).
        stacked_keys: dict keys under which layers are stacked along axis 0.

    Example:
        >>> rules = ShardingRules(min_size=0, rules=[("embed_tokens", None)])
        >>> rules.min_size
        0
    """

    min_size: int = 2**14
    rules: Sequence[tuple[Match, PartitionSpec | None]] = ()
    stacked_keys: tuple[str, ...] = nn.STACKED_KEYS

    def __post_init__(self) -> None:
        for i, rule in enumerate(self.rules):
            _check_rule(i, rule)


def _check_rule(i: int, rule: Any) -> None:
    """Refuse a malformed ``ShardingRules.rules[i]`` before any array is placed."""
    where = f"ShardingRules.rules[{i}]"
    if not (isinstance(rule, (tuple, list)) and len(rule) == 2):
        raise ConfigError(f"{where} must be a (match, PartitionSpec | None) pair, "
                          f"got {rule!r}")  # fmt: skip
    match, spec = rule
    if isinstance(match, str):
        try:
            re.compile(match)
        except re.error as e:
            raise ConfigError(f"{where}: {match!r} is not a regex: {e}") from None
    elif not callable(match):
        raise ConfigError(
            f"{where}: match must be a regex or fn(name, leaf) -> bool, got {match!r}"
        )
    if spec is None:
        return
    if not isinstance(spec, PartitionSpec):
        raise ConfigError(
            f"{where}: the placement must be a jax.sharding.PartitionSpec or None "
            f"(replicated), got {spec!r}; e.g. PartitionSpec(None, 'fsdp')"
        )
    unknown = [a for a in _spec_axes(spec) if a not in MESH_AXES]
    if unknown:
        raise ConfigError(
            f"{where}: {spec} names {unknown}, not mesh axes; entrenar's meshes have "
            f"the axes {MESH_AXES}"
        )


def _spec_axes(spec: PartitionSpec) -> list[str]:
    out: list[str] = []
    for entry in spec:
        if entry is None:
            continue
        out.extend(entry if isinstance(entry, tuple) else (entry,))
    return out


def _user_spec(
    name: str, leaf: Any, spec: PartitionSpec | None, match: Match, mesh: Mesh
) -> PartitionSpec:
    """A rule's placement for ``leaf``, checked against its shape.

    Unchecked, jax's error at placement names neither the leaf nor the rule.
    """
    if spec is None:
        return PartitionSpec()
    shape = tuple(int(n) for n in np.shape(leaf))
    problem = None
    if len(spec) > len(shape):
        problem = f"it has {len(spec)} entries for {len(shape)} axes"
    for axis, entry in enumerate(spec):
        if problem is not None or entry is None:
            continue
        names = entry if isinstance(entry, tuple) else (entry,)
        parts = int(np.prod([mesh.shape[a] for a in names]))
        if shape[axis] % parts:
            problem = (
                f"axis {axis} of length {shape[axis]} does not split in {parts} "
                f"({names} of the mesh {dict(mesh.shape)})"
            )
    if problem is not None:
        raise ConfigError(
            f"sharding rule {match!r} -> {spec} does not fit {name} of shape "
            f"{shape}: {problem}; narrow the rule's match or change its spec"
        )
    return spec


def _matches(match: Match, name: str, leaf: Any) -> bool:
    if isinstance(match, str):
        return re.search(match, name) is not None
    return bool(match(name, leaf))


def _is_stacked(name: str, stacked_keys: tuple[str, ...]) -> bool:
    return stacked_split(name, stacked_keys) is not None


def fsdp_axis(
    shape: tuple[int, ...], shards: int, *, stacked: bool, min_size: int
) -> int | None:
    """The axis FSDP splits a leaf of ``shape`` along, or None (replicated).

    >>> fsdp_axis((2, 64, 32), 8, stacked=True, min_size=0)
    1
    >>> fsdp_axis((30, 32), 8, stacked=False, min_size=0)
    1
    >>> fsdp_axis((4, 32), 8, stacked=False, min_size=4096) is None
    True
    """
    if shards <= 1 or int(np.prod(shape)) < min_size:
        return None
    axes = [a for a in range(1 if stacked else 0, len(shape)) if shape[a] % shards == 0]
    return max(axes, key=lambda a: (shape[a], -a)) if axes else None


def _spec(axis: int | None) -> PartitionSpec:
    return PartitionSpec() if axis is None else PartitionSpec(*[None] * axis, "fsdp")


Undivided = list[tuple[str, tuple[int, ...], int]]
"""``(dotted name, shape, bytes)`` of leaves the FSDP rule leaves whole."""


def _note_undivided(
    undivided: Undivided | None, name: str, leaf: Any, mesh: Mesh, rules: ShardingRules
) -> None:
    """Record a leaf of ``min_size`` elements or more that stays whole (fsdp > 1)."""
    shape = tuple(int(s) for s in np.shape(leaf))
    if undivided is None or mesh.shape["fsdp"] <= 1 or np.prod(shape) < rules.min_size:
        return
    nbytes = int(np.prod(shape)) * np.dtype(leaf.dtype).itemsize
    undivided.append((name, shape, nbytes))


def _array_spec(
    name: str, leaf: Any, mesh: Mesh, rules: ShardingRules,
    undivided: Undivided | None = None,
) -> Any:  # fmt: skip
    for match, spec in rules.rules:
        if _matches(match, name, leaf):
            return _user_spec(name, leaf, spec, match, mesh)
    if name.rsplit(".", 1)[-1] in _ADAPTER_PARTS:
        return PartitionSpec()
    stacked = _is_stacked(name, rules.stacked_keys)
    shape = tuple(int(s) for s in np.shape(leaf))
    axis = fsdp_axis(
        shape, mesh.shape["fsdp"], stacked=stacked, min_size=rules.min_size
    )
    if axis is None:
        _note_undivided(undivided, name, leaf, mesh, rules)
    return _spec(axis)


def _quantized_specs(
    name: str, q: QuantizedWeight, mesh: Mesh, rules: ShardingRules,
    undivided: Undivided | None = None,
) -> QuantizedWeight:  # fmt: skip
    """Codes, scales and offsets split along ``out`` (axis -2 of the logical shape)."""
    shape = q.shape
    axis = len(shape) - 2
    shards = mesh.shape["fsdp"]
    split = (
        axis >= (1 if _is_stacked(name, rules.stacked_keys) else 0)
        and shards > 1
        and q.size >= rules.min_size
        and shape[axis] % shards == 0
    )

    def child(part: str, x: Any) -> Any:
        if x is None:
            return None
        full = f"{name}.{part}"
        for match, spec in rules.rules:
            if _matches(match, full, x):
                return _user_spec(full, x, spec, match, mesh)
        same = np.ndim(x) == len(shape) and np.shape(x)[axis] == shape[axis]
        if same and not split and part == "codes" and q.size >= rules.min_size:
            _note_undivided(undivided, full, x, mesh, rules)
        return _spec(axis if split and same else None)

    return dataclasses.replace(
        q, **{f.name: child(f.name, getattr(q, f.name))
              for f in dataclasses.fields(q) if f.name in _QUANT_CHILDREN}
    )  # fmt: skip


_QUANT_CHILDREN = ("codes", "scales", "offsets", "scale_scales", "scale_offset")


def _tied_specs(
    name: str, x: nn.TiedEmbedding, mesh: Mesh, rules: ShardingRules,
    undivided: Undivided | None = None,
) -> nn.TiedEmbedding:  # fmt: skip
    """The table as the embedding it holds; ``head_t`` ``(D, V)`` as its transpose.

    The table keeps the embedding's placement (its name, its shape); the rounded
    head is split along the axis the dense ``(V, D)`` embedding would be, so both
    hold the same rows' values on each device.
    """
    dense = jax.ShapeDtypeStruct(nn.logical_shape(x.table), nn.logical_dtype(x.table))
    spec = tuple(_array_spec(name, dense, mesh, rules))
    head = (*spec, None, None)[1::-1]  # (V, D) -> (D, V)
    while head and head[-1] is None:  # written as `_spec` writes it
        head = head[:-1]
    return dataclasses.replace(
        x,
        table=_node_specs(name, x.table, mesh, rules, undivided),
        head_t=None if x.head_t is None else PartitionSpec(*head),
    )


def _node_specs(
    name: str, x: Any, mesh: Mesh, rules: ShardingRules,
    undivided: Undivided | None = None,
) -> Any:  # fmt: skip
    if isinstance(x, LoRAWeight):
        return x.replace(
            base=None if x.base is None else _node_specs(f"{name}.base", x.base, mesh,
                                                         rules, undivided),
            a=None if x.a is None else PartitionSpec(),
            b=None if x.b is None else PartitionSpec(),
            dropout_key=None if x.dropout_key is None else PartitionSpec(),
            magnitude=None if x.magnitude is None else PartitionSpec(),
            layer_scale=None if x.layer_scale is None else PartitionSpec(),
        )  # fmt: skip
    if isinstance(x, QuantizedWeight):
        return _quantized_specs(name, x, mesh, rules, undivided)
    if isinstance(x, nn.Bfloat16Weight):  # as the float32 weight it rounds
        return dataclasses.replace(
            x, bits=_array_spec(name, x.bits, mesh, rules, undivided)
        )
    if isinstance(x, nn.TiedEmbedding):
        return _tied_specs(name, x, mesh, rules, undivided)
    if nn.is_weight_node(x):  # any other node: each array by its own dotted name
        return jax.tree_util.tree_map_with_path(
            lambda p, c: _array_spec(
                f"{name}.{key_path_str(p)}", c, mesh, rules, undivided
            ),
            x,
        )
    return _array_spec(name, x, mesh, rules, undivided)


def param_specs(
    tree: PyTree, mesh: Mesh, rules: ShardingRules | None = None, prefix: str = "",
    *, undivided: Undivided | None = None,
) -> PyTree:  # fmt: skip
    """A tree like ``tree`` with a `PartitionSpec` at each array leaf.

    ``undivided``: a list that receives ``(name, shape, bytes)`` of every leaf the
    FSDP rule would split (``min_size`` elements or more, ``fsdp`` > 1, no user
    rule) but keeps whole because ``fsdp`` divides none of its splittable axes.
    """
    rules = rules or ShardingRules()
    flat, treedef = jax.tree_util.tree_flatten_with_path(
        tree, is_leaf=nn.is_weight_node
    )
    out = []
    for path, x in flat:
        name = ".".join(p for p in (prefix, key_path_str(path)) if p)
        out.append(_node_specs(name, x, mesh, rules, undivided))
    return jax.tree_util.tree_unflatten(treedef, out)


def undivided_leaves(
    tree: PyTree, mesh: Mesh, rules: ShardingRules | None = None
) -> Undivided:
    """``(name, shape, bytes)`` of the leaves FSDP keeps whole on every device.

    Arrays of ``min_size`` elements or more whose splittable axes ``fsdp`` does not
    divide (a hidden size of 4096 = 2¹² over ``fsdp: 6``): they cost every device
    their full size. Empty with ``fsdp: 1``.

    Example:
        >>> from jax.sharding import AbstractMesh
        >>> mesh = AbstractMesh((1, 8), ("data", "fsdp"))
        >>> undivided_leaves({"w": np.zeros((6, 36), np.float32)}, mesh,
        ...                  ShardingRules(min_size=0))
        [('w', (6, 36), 864)]
    """
    out: Undivided = []
    param_specs(tree, mesh, rules, undivided=out)
    return out


def warn_undivided(params: PyTree, mesh: Mesh, rules: ShardingRules | None) -> None:
    """A `UserWarning` when FSDP leaves a tenth or more of ``params``' bytes whole.

    Without it a mesh whose ``fsdp`` size divides none of a model's dimensions
    (``fsdp: 6`` for a hidden size of 4096) trains correctly but holds the whole
    model on every device: the memory FSDP was chosen for is silently not saved.
    """
    leaves = undivided_leaves(params, mesh, rules)
    whole = sum(b for *_, b in leaves)
    total = sum(
        int(np.prod(np.shape(x))) * np.dtype(x.dtype).itemsize
        for x in jax.tree_util.tree_leaves(params)
        if not jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)
    )
    if not leaves or whole < 0.1 * total:
        return
    big = sorted(leaves, key=lambda t: -t[2])[:3]
    warnings.warn(
        f"FSDP over {mesh.shape['fsdp']} devices keeps {len(leaves)} arrays "
        f"({whole / 2**20:.1f} MiB, {whole / total:.0%} of the params) whole on every "
        f"device: the fsdp size divides none of their axes "
        f"({', '.join(f'{n} {s}' for n, s, _ in big)}); choose an fsdp size that "
        "divides the model's hidden, intermediate and vocabulary sizes (the rest "
        "of the devices can go to the data axis)",
        UserWarning,
        stacklevel=3,
    )


def _named(mesh: Mesh, specs: PyTree) -> PyTree:
    return jax.tree_util.tree_map(
        lambda s: NamedSharding(mesh, s), specs,
        is_leaf=lambda s: isinstance(s, PartitionSpec),
    )  # fmt: skip


def param_sharding(
    tree: PyTree, mesh: Mesh, rules: ShardingRules | None = None
) -> PyTree:
    """A tree like ``tree`` with a `NamedSharding` at each array leaf.

    Example:
        >>> import jax.numpy as jnp
        >>> from entrenar.distributed import make_mesh
        >>> mesh = make_mesh({"fsdp": -1})
        >>> s = param_sharding({"w": jnp.zeros((4, 8))}, mesh, ShardingRules(0))
        >>> s["w"].spec == (PartitionSpec(None, "fsdp") if mesh.shape["fsdp"] > 1
        ...                 else PartitionSpec())
        True
    """
    return _named(mesh, param_specs(tree, mesh, rules))


def _shapes(tree: PyTree) -> list[tuple[int, ...]]:
    return [tuple(np.shape(x)) for x in jax.tree_util.tree_leaves(tree)]


def opt_state_sharding(
    opt_state: PyTree, params: PyTree, mesh: Mesh, rules: ShardingRules | None = None
) -> PyTree:
    """Shardings for an optimizer state over ``params`` (the trainable half).

    Each subtree of ``opt_state`` shaped like ``params`` (same structure and leaf
    shapes: optax's and entrenar.optim's moments) is placed like ``params``; other
    leaves by the rules, under their own dotted names.
    """
    rules = rules or ShardingRules()
    pdef, pshapes = jax.tree_util.tree_structure(params), _shapes(params)
    params_specs = param_specs(params, mesh, rules)

    def like_params(x: Any) -> bool:
        return (
            jax.tree_util.tree_structure(x) == pdef  # type: ignore[operator]
            and _shapes(x) == pshapes
        )

    flat, treedef = jax.tree_util.tree_flatten_with_path(
        opt_state, is_leaf=lambda x: like_params(x) or nn.is_weight_node(x)
    )
    out = []
    for path, x in flat:
        if like_params(x):
            out.append(params_specs)
        else:
            out.append(param_specs(x, mesh, rules, prefix=key_path_str(path)))
    return _named(mesh, jax.tree_util.tree_unflatten(treedef, out))


def replicated(mesh: Mesh) -> NamedSharding:
    """The sharding of an array every device holds whole."""
    return NamedSharding(mesh, PartitionSpec())


def put(tree: PyTree, shardings: PyTree) -> PyTree:
    """Place ``tree``'s arrays by ``shardings`` (same structure), on any process.

    With one process this is ``jax.device_put``. With several, each leaf must hold
    the same value on every process; each process builds only its own shards.
    """
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    shards = treedef.flatten_up_to(shardings)  # type: ignore[attr-defined]
    if jax.process_count() == 1:
        return jax.tree_util.tree_unflatten(treedef, jax.device_put(leaves, shards))
    out = []
    for x, s in zip(leaves, shards):
        if isinstance(x, jax.Array) and x.sharding == s:
            out.append(x)
            continue
        out.append(from_host(x, s))
    return jax.tree_util.tree_unflatten(treedef, out)


def from_host(x: Any, sharding: Any) -> jax.Array:
    """A global array of the value ``x`` (the same on every process).

    Each process builds only the shards of its own devices
    (`jax.make_array_from_callback`), so it works across processes.
    """
    host = np.asarray(jax.device_get(x))

    def shard(index: Any) -> np.ndarray:
        return host[index]

    return jax.make_array_from_callback(host.shape, sharding, shard)


def shard_params(
    tree: PyTree, mesh: Mesh, rules: ShardingRules | None = None
) -> PyTree:
    """``tree`` placed on ``mesh`` by `param_sharding`."""
    return put(tree, param_sharding(tree, mesh, rules))


def shard_opt_state(
    opt_state: PyTree, params: PyTree, mesh: Mesh, rules: ShardingRules | None = None
) -> PyTree:
    """``opt_state`` placed on ``mesh`` by `opt_state_sharding`."""
    return put(opt_state, opt_state_sharding(opt_state, params, mesh, rules))


Convert = Callable[[str, Any], Any]
"""``fn(dotted_name, leaf) -> node``: a leaf (weight nodes whole) in another form."""


def shard_converted(
    tree: PyTree, mesh: Mesh, convert: Convert, rules: ShardingRules | None = None
) -> PyTree:
    """``tree`` with each leaf ``x`` (weight nodes whole) replaced by ``convert``'s.

    Built one leaf at a time and shard by shard: ``x`` is placed by the rules
    (each device receives its shards), ``convert`` runs under `jax.jit` with the
    rules' placement of its result as ``out_shardings`` (each device computes its
    shards of it), and the placed ``x`` is dropped. No device ever holds a whole
    split leaf, and besides the converted tree at most one placed leaf's shards:
    a float32 frozen half becomes its bfloat16 copy (`entrenar.nn.
    to_bfloat16_weights`) in half the memory, never 1.5 times it. A leaf that
    ``convert`` returns unchanged (same structure, shapes, dtypes) is placed as
    `shard_params` places it.

    Example:
        >>> import jax.numpy as jnp
        >>> from entrenar.distributed import make_mesh
        >>> to16 = lambda name, x: x.astype(jnp.bfloat16)
        >>> out = shard_converted({"w": jnp.ones((8, 4))}, make_mesh({"fsdp": -1}),
        ...                       to16, ShardingRules(min_size=0))
        >>> out["w"].dtype, out["w"].shape
        (dtype(bfloat16), (8, 4))
    """
    rules = rules or ShardingRules()
    flat, treedef = jax.tree_util.tree_flatten_with_path(
        tree, is_leaf=nn.is_weight_node
    )
    out = []
    for path, x in flat:
        name = key_path_str(path)
        fn = functools.partial(convert, name)
        target = jax.eval_shape(fn, x)
        placed = put(x, _named(mesh, param_specs(x, mesh, rules, prefix=name)))
        if _same_form(target, x):
            out.append(placed)
            continue
        shardings = _named(mesh, param_specs(target, mesh, rules, prefix=name))
        out.append(jax.jit(fn, out_shardings=shardings)(placed))
        del placed  # its buffers go when the caller holds no other reference
    return jax.tree_util.tree_unflatten(treedef, out)


def _same_form(a: PyTree, b: PyTree) -> bool:
    """Same tree structure, leaf shapes and dtypes."""
    la, ta = jax.tree_util.tree_flatten(a)
    lb, tb = jax.tree_util.tree_flatten(b)
    return ta == tb and all(  # type: ignore[operator]
        np.shape(x) == np.shape(y) and x.dtype == y.dtype for x, y in zip(la, lb)
    )


def shard_state(
    state: Any, mesh: Mesh, rules: ShardingRules | None = None,
    *, convert_frozen: Convert | None = None,
) -> Any:  # fmt: skip
    """A train state (``trainable, frozen, opt_state, step, key`` fields) on ``mesh``.

    The params and optimizer state by the rules; the step and the random key
    replicated. Warns (`warn_undivided`) when FSDP cannot split a tenth or more
    of the params' bytes. ``convert_frozen``: the frozen half is placed in the
    form it gives each leaf, built shard by shard (`shard_converted`).
    """
    warn_undivided((state.trainable, state.frozen), mesh, rules)
    rep = replicated(mesh)
    key = state.key
    key_data = put(jax.random.key_data(key), rep)
    frozen = (
        shard_params(state.frozen, mesh, rules)
        if convert_frozen is None
        else shard_converted(state.frozen, mesh, convert_frozen, rules)
    )
    return state._replace(
        trainable=shard_params(state.trainable, mesh, rules),
        frozen=frozen,
        opt_state=shard_opt_state(state.opt_state, state.trainable, mesh, rules),
        step=put(state.step, rep),
        key=jax.random.wrap_key_data(key_data, impl=jax.random.key_impl(key)),
    )


def constrain(tree: PyTree, shardings: PyTree) -> PyTree:
    """`jax.lax.with_sharding_constraint` over a tree (inside `jax.jit`)."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    shards = treedef.flatten_up_to(shardings)  # type: ignore[attr-defined]
    return jax.tree_util.tree_unflatten(
        treedef, jax.lax.with_sharding_constraint(leaves, shards)
    )


__all__ = [
    "Match",
    "ShardingRules",
    "constrain",
    "from_host",
    "fsdp_axis",
    "opt_state_sharding",
    "param_sharding",
    "param_specs",
    "put",
    "replicated",
    "shard_converted",
    "shard_opt_state",
    "shard_params",
    "shard_state",
    "undivided_leaves",
    "warn_undivided",
]
