"""One engine under every method: a `Plan`, merged leaf by leaf.

`merge_leaf` resolves a plan's settings for each layer of one leaf, checks their
ranges (naming the leaf), and calls the jitted kernel of `entrenar.merge.kernels`;
`merge_trees` streams it over whole trees, so memory holds the inputs, the output
and one leaf's temporaries. `entrenar.merge.run` drives the same `merge_leaf` over
leaves read one at a time from files.
"""

from __future__ import annotations

import dataclasses
import zlib
from collections.abc import Sequence
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np

from entrenar.errors import CompatibilityError, ConfigError, UnsupportedError
from entrenar.lora.weight import LoRAWeight
from entrenar.merge import kernels
from entrenar.merge.leaves import (
    Layout,
    check_leaves,
    is_floating,
    layouts,
    named_leaves,
    same_values,
)
from entrenar.merge.schedule import Setting, evaluate
from entrenar.nn.weight_node import logical_dtype, logical_shape, to_dense
from entrenar.types import PRNGKey, PyTree

Kind = Literal["task_vectors", "linear", "slerp"]


@dataclasses.dataclass(frozen=True)
class Plan:
    """What to compute at every leaf; settings may vary by tensor and depth.

    Attributes:
        kind: ``"task_vectors"`` (``base + λ · combine(sparsify(θ_i - base))``:
            task arithmetic, TIES, DARE), ``"linear"`` or ``"slerp"``.
        weights: one setting per model (``weight``).
        density: TIES trim, one setting per model, in (0, 1]; None: no trim.
        keep: DARE keep probability ``1 - p`` (mergekit's ``density``), one setting
            per model, in (0, 1]; None: no drop.
        lam: λ, the scale of the merged task vector.
        t: SLERP's interpolation setting, in [0, 1].
        elect: TIES sign election and disjoint merge.
        normalize: divide by the (agreeing) weights' sum.
        rescale: DARE's ``1 / (1 - p)``.
        key: DARE's PRNG key.
    """

    kind: Kind
    weights: tuple[Setting, ...] = ()
    density: tuple[Setting, ...] | None = None
    keep: tuple[Setting, ...] | None = None
    lam: Setting = 1.0
    t: Setting = None
    elect: bool = False
    normalize: bool = False
    rescale: bool = True
    key: PRNGKey | None = None


def _resolve(
    setting: Setting, layout: Layout, what: str, name: str, default: float | None
) -> np.ndarray:
    """``(L,)`` values of ``setting`` over the layers of leaf ``name``."""
    out = []
    for hf, frac in zip(layout.layer_names, layout.fractions):
        v = evaluate(setting, hf, frac)
        if v is None:
            v = default
        if v is None:
            raise ConfigError(f"leaf {name!r}: no value of {what} applies to {hf!r}")
        out.append(v)
    return np.asarray(out, np.float64)


def _check_range(
    v: np.ndarray, what: str, name: str, lo: float, hi: float, lo_in: bool, hi_in: bool
) -> None:
    ok = (v >= lo if lo_in else v > lo) & (v <= hi if hi_in else v < hi)
    if not np.all(ok & np.isfinite(v)):
        bad = float(v[~(ok & np.isfinite(v))][0])
        rng = f"{'[' if lo_in else '('}{lo}, {hi}{']' if hi_in else ')'}"
        raise ConfigError(f"leaf {name!r}: {what} = {bad} is outside {rng}")


def _per_model(
    settings: Sequence[Setting], layout: Layout, what: str, name: str
) -> np.ndarray:
    """``(L, n)`` values of one setting per model."""
    cols = [
        _resolve(s, layout, f"{what} of model {i}", name, None)
        for i, s in enumerate(settings)
    ]
    return np.stack(cols, axis=1)


def leaf_key(key: PRNGKey, name: str, n: int) -> jax.Array:
    """``(n,)`` keys of leaf ``name``: ``fold_in(fold_in(key, crc32(name)), i)``."""
    k = jax.random.fold_in(key, zlib.crc32(name.encode()) & 0x7FFFFFFF)
    return jax.vmap(lambda i: jax.random.fold_in(k, i))(jnp.arange(n))


def merge_leaf(
    plan: Plan,
    name: str,
    layout: Layout,
    base: Any,
    models: Sequence[Any],
    out_dtype: Any,
    memo: dict[str, jax.Array] | None = None,
) -> jax.Array:
    """Merge one leaf (dense arrays of one shape) as ``plan`` says, in ``out_dtype``.

    Args:
        plan: the method and its settings.
        name: the leaf's dotted name (for settings' filters, keys and errors).
        layout: its `Layout`.
        base: the base model's leaf (``a`` for SLERP; None for linear).
        models: the other models' leaves.
        out_dtype: dtype of the result.
        memo: task-vector methods: the merged task vector
            (`kernels.merged_task_vector`) of each leaf, taken from here when
            ``name`` is in it and stored otherwise. It does not depend on λ, so
            merges that differ only in λ may share one (`entrenar.merge.search`);
            the caller keeps it for one setting of everything else.
    """
    shape = logical_shape(models[0])
    rows = len(layout.layer_names)

    def as_layers(x: Any) -> Any:  # (*shape) -> (L, m)
        return (np.asarray(x) if isinstance(x, np.ndarray) else jnp.asarray(x)).reshape(
            rows, -1
        )

    m = int(np.prod(shape)) // rows
    if plan.kind == "slerp":
        t = _resolve(plan.t, layout, "t", name, None)
        _check_range(t, "t", name, 0.0, 1.0, True, True)
        out = kernels.slerp_leaf(
            as_layers(base), as_layers(models[0]), jnp.asarray(t, jnp.float32)
        )
        return out.reshape(shape).astype(out_dtype)
    w = _per_model(plan.weights, layout, "weight", name)  # (L, n)
    if plan.kind == "linear":
        thetas = jnp.stack([jnp.asarray(as_layers(x)) for x in models])  # (n, L, m)
        if plan.normalize and np.any(np.abs(w.sum(axis=1)) < 1e-12):
            raise ConfigError(f"leaf {name!r}: the weights sum to 0; cannot normalize")
        out = kernels.linear_leaf(
            thetas, jnp.asarray(w, jnp.float32), normalize=plan.normalize
        )
        return out.reshape(shape).astype(out_dtype)
    n = len(models)
    k = np.full((rows, n), m, np.int32)
    if plan.density is not None:
        d = _per_model(plan.density, layout, "density", name)
        _check_range(d, "density", name, 0.0, 1.0, False, True)
        k = np.maximum(1, np.floor(d * m)).astype(np.int32) if m else k
    keep = np.ones((rows, n))
    keys = jax.random.split(jax.random.key(0), n)
    if plan.keep is not None:
        if plan.key is None:
            raise ConfigError("DARE needs a PRNG key: pass key=jax.random.key(seed)")
        keep = _per_model(plan.keep, layout, "keep probability (1 - drop_rate)", name)
        _check_range(keep, "keep probability (1 - drop_rate)", name, 0, 1, False, True)
        keys = leaf_key(plan.key, name, n)
    lam = _resolve(plan.lam, layout, "lambda", name, 1.0)
    _check_range(lam, "lambda", name, -np.inf, np.inf, False, False)
    head = as_layers(base)  # (L, m)
    merged = memo.get(name) if memo is not None else None
    if merged is None:
        merged = kernels.merged_task_vector(
            head,
            tuple(as_layers(x) for x in models),  # n x (L, m)
            jnp.asarray(w, jnp.float32),
            jnp.asarray(k),
            jnp.asarray(keep, jnp.float32),
            keys,
            # keeping all m values (density 1) trims nothing: the same result
            trim=plan.density is not None and bool(np.any(k < m)),
            elect=plan.elect,
            normalize=plan.normalize,
            drop=plan.keep is not None,
            rescale=plan.rescale,
        )  # (L, m)
        if memo is not None:
            memo[name] = merged
    out = kernels.scaled_sum(head, merged, jnp.asarray(lam, jnp.float32))
    return out.reshape(shape).astype(out_dtype)


LoRAMode = Literal["fold", "adapters"]


def _merge_adapters(
    plan: Plan, name: str, layout: Layout, base: Any, models: Sequence[Any]
) -> LoRAWeight:
    """Merge the adapters' A and B (PEFT's ``add_weighted_adapter`` convention).

    Task vectors are the adapter matrices themselves (a zero base); SLERP
    interpolates ``base``'s adapter with the other's. The frozen weight is the
    base's (the first model's for linear). DoRA adapters are refused (their
    magnitudes do not merge as A and B do).
    """
    adapters = ([base] if plan.kind == "slerp" else []) + list(models)
    first = adapters[0]
    if any(isinstance(x, LoRAWeight) and x.dora for x in adapters):
        raise UnsupportedError(
            f"leaf {name!r}: a DoRA adapter's magnitudes rescale W + s·BA, so "
            "merging its A and B apart from them is not its task vector; use "
            "lora='fold' (each fine-tune folded first, then merged)"
        )
    for x in adapters:
        if not isinstance(x, LoRAWeight) or _adapter_shape(x) != _adapter_shape(first):
            raise CompatibilityError(
                f"leaf {name!r}: merging adapters needs a LoRAWeight of one rank, "
                f"alpha and rslora in every model; got {x!r} and {first!r} (use "
                "lora='fold' to fold each adapter into its weight first)"
            )
    frozen = base.base if isinstance(base, LoRAWeight) else base
    if frozen is None:
        frozen = first.base
    merged = {}
    for part in ("a", "b"):
        xs = [jnp.asarray(getattr(x, part)) for x in adapters]
        dt = logical_dtype(xs[0])
        head: jax.Array | None
        if plan.kind == "slerp":
            head, xs = xs[0], xs[1:]
        else:
            head = None if plan.kind == "linear" else jnp.zeros_like(xs[0])
        merged[part] = merge_leaf(plan, f"{name}.{part}", layout, head, xs, dt)
    return first.replace(base=frozen, a=merged["a"], b=merged["b"], dropout_key=None)


def _adapter_shape(x: LoRAWeight) -> tuple[Any, ...]:
    """What adapters merged entry by entry must share (per-layer ranks included)."""
    return (x.alpha, x.rank, x.rslora, x.layer_ranks, x.layer_alphas)


def merge_trees(
    plan: Plan,
    base: PyTree | None,
    models: Sequence[PyTree],
    *,
    lora: LoRAMode = "fold",
    dtype: Any = None,
) -> PyTree:
    """Merge whole trees leaf by leaf as ``plan`` says.

    Args:
        plan: the method and its settings.
        base: the base tree (SLERP's ``a``); None for linear.
        models: the other trees.
        lora: ``"fold"`` folds every `LoRAWeight` into its weight first;
            ``"adapters"`` merges the adapters' A and B (task vectors are the
            adapter matrices themselves) and keeps the base's frozen weight.
        dtype: output dtype of float leaves (default: each leaf's own).

    Returns:
        A tree with the structure of ``base`` (or ``models[0]``); quantized nodes
        come out dense.
    """
    if lora not in ("fold", "adapters"):
        raise ConfigError(f"lora must be 'fold' or 'adapters', got {lora!r}")
    trees = ([base] if base is not None else []) + list(models)
    labels = (["base"] if base is not None else []) + [
        f"model {i}" for i in range(len(models))
    ]
    flats = [named_leaves(t)[0] for t in trees]
    treedef = named_leaves(trees[0])[1]
    check_leaves(labels, flats, same_dtype=True)
    shapes = {k: logical_shape(v) for k, v in flats[0].items()}
    lay = layouts(shapes)
    out = []
    for name in flats[0]:
        xs = [f[name] for f in flats]
        dt = logical_dtype(xs[0]) if dtype is None else np.dtype(dtype)
        if not is_floating(logical_dtype(xs[0])):
            out.append(same_values(name, xs))
            continue
        head = xs[0] if base is not None else None
        rest = xs[1:] if base is not None else xs
        if lora == "adapters" and any(isinstance(x, LoRAWeight) for x in xs):
            out.append(_merge_adapters(plan, name, lay[name], head, rest))
            continue
        dense = [to_dense(x) for x in rest]
        dense_head = None if head is None else to_dense(head)
        out.append(merge_leaf(plan, name, lay[name], dense_head, dense, dt))
    return jax.tree_util.tree_unflatten(treedef, out)


__all__ = ["LoRAMode", "Plan", "leaf_key", "merge_leaf", "merge_trees"]
