"""Merge LoRA fine-tunes of one base through their adapters, not through files.

Every fine-tune is ``W + Δ_i`` with ``Δ_i = s_i B_i A_i`` over the same frozen
``W``, so its task vector is ``Δ_i`` exactly: no rounding of ``W`` onto another
grid (`entrenar.merge.noise`) enters the merge. Where the method is linear in the
task vectors (task arithmetic; linear with weights that sum to 1 or normalized)
the merge is itself an adapter, the concatenation

    Δ = Σ_i c_i Δ_i = [c_1 s_1 B_1, ..., c_n s_n B_n] · [A_1; ...; A_n]

of rank ``Σ r_i`` and scale 1 (``alpha = rank``), with ``c_i = λ w_i`` (divided by
``Σ w`` when normalized): the base stays as it is (4-bit for QLoRA) and
`entrenar.lora.save_adapter` writes the result. Other methods (TIES, DARE, SLERP,
per-layer schedules) merge ``Δ_i`` densely leaf by leaf: ``W + merge(Δ_i)``,
which is what folding each adapter and merging the float models computes.

A DoRA fine-tune's task vector is its fold minus the base,
``Δ_i = (m_i / ‖W + s_i B_i A_i‖_row) ⊙ (W + s_i B_i A_i) - W`` (`entrenar.lora.fold
.update`), which no low-rank adapter holds: a leaf with a DoRA adapter in any tree
is merged densely.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from entrenar.errors import CompatibilityError, ConfigError
from entrenar.lora.fold import update
from entrenar.lora.weight import LoRAWeight
from entrenar.merge.engine import Plan, merge_leaf
from entrenar.merge.leaves import layouts, named_leaves
from entrenar.nn.weight_node import logical_dtype, logical_shape, to_dense
from entrenar.types import PyTree


def _number(s: Any) -> float | None:
    return float(s) if isinstance(s, int | float) and not isinstance(s, bool) else None


def linear_coefficients(plan: Plan) -> tuple[float, ...] | None:
    """``c_i`` when ``plan`` merges task vectors linearly with fixed numbers.

    None for TIES/DARE/SLERP, for per-layer schedules, and for a linear merge
    whose weights neither sum to 1 nor are normalized (it would scale ``W``).
    """
    if plan.kind == "slerp" or plan.density is not None or plan.keep is not None:
        return None
    if plan.elect:
        return None
    w = [_number(s) for s in plan.weights]
    lam = _number(plan.lam) if plan.kind == "task_vectors" else 1.0
    if lam is None or any(x is None for x in w):
        return None
    ws = [float(x) for x in w if x is not None]
    total = sum(ws)
    if plan.kind == "linear" and not plan.normalize and abs(total - 1.0) > 1e-12:
        return None
    div = total if plan.normalize and abs(total) >= 1e-8 else 1.0
    return tuple(lam * x / div for x in ws)


def _concat(name: str, xs: Sequence[LoRAWeight], c: Sequence[float]) -> LoRAWeight:
    """One adapter whose update is ``Σ c_i Δ_i`` (module docstring)."""
    a = jnp.concatenate([jnp.asarray(x.a, jnp.float32) for x in xs], axis=-2)
    b = jnp.concatenate(
        [ci * x.scale * jnp.asarray(x.b, jnp.float32) for ci, x in zip(c, xs)],
        axis=-1,
    )  # (*lead, out, Σr)
    rank = int(a.shape[-2])
    dt = logical_dtype(xs[0].a)
    return LoRAWeight(xs[0].base, a.astype(dt), b.astype(dt), alpha=rank, rank=rank)


def merge_adapters(
    plan: Plan, adapted: Sequence[PyTree], *, dense: bool = False
) -> PyTree:
    """Merge trees that carry `LoRAWeight` adapters over one shared frozen base.

    Args:
        plan: the method and its settings (`entrenar.merge.run.build_plan` builds
            one from a recipe); ``weights`` holds one setting per tree.
        adapted: the fine-tunes, each a tree with `LoRAWeight` nodes (as
            `entrenar.lora.load_adapter` returns) over the same base.
        dense: fold the merged update into dense weights even when the method
            is linear (by default a linear merge stays an adapter).

    Returns:
        A tree like ``adapted[0]``: concatenated `LoRAWeight` nodes for a linear
        merge of plain LoRA adapters, dense merged weights ``W + merge(Δ_i)``
        otherwise (DoRA adapters included).

    Raises:
        CompatibilityError: an adapted weight that is not a `LoRAWeight` in every
            tree, or trees of different structure.
    """
    if not adapted:
        raise ConfigError("merge_adapters needs at least one adapted tree")
    flats = [named_leaves(t)[0] for t in adapted]
    treedef = named_leaves(adapted[0])[1]
    if any(list(f) != list(flats[0]) for f in flats):
        raise CompatibilityError("the adapted trees differ in structure")
    lay = layouts({k: logical_shape(v) for k, v in flats[0].items()})
    coef = None if dense else linear_coefficients(plan)
    out = []
    for name, first in flats[0].items():
        xs = [f[name] for f in flats]
        if not any(isinstance(x, LoRAWeight) for x in xs):
            out.append(first)  # the frozen base, shared
            continue
        if not all(isinstance(x, LoRAWeight) for x in xs):
            raise CompatibilityError(
                f"leaf {name!r}: adapted in some fine-tunes only; merge_adapters "
                "needs an adapter on it in every tree (or none)"
            )
        if coef is not None and not any(x.dora for x in xs):
            out.append(_concat(name, xs, coef))
            continue
        w = to_dense(first.base)
        zero = jnp.zeros(logical_shape(w), jnp.float32)
        merged = merge_leaf(plan, name, lay[name], zero, [update(x) for x in xs],
                            np.float32)  # fmt: skip
        out.append((w.astype(jnp.float32) + merged).astype(w.dtype))
    return jax.tree_util.tree_unflatten(treedef, out)


__all__ = ["linear_coefficients", "merge_adapters"]
