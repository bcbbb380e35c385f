"""The merge methods as pure functions over parameter trees.

Each takes whole trees and returns a new one, merged leaf by leaf (one jitted
program per leaf shape, memory near the inputs plus the output). Stacked layers
(specs/conventions.md) are merged per layer: TIES trims and SLERP measures angles
per layer tensor, and settings may vary over depth. Weight nodes: a
`QuantizedWeight` is dequantized and comes out dense; a `LoRAWeight` is folded into
its weight (``lora="fold"``) or, with ``lora="adapters"``, its A and B are merged.
specs/merging.md gives every step.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from entrenar.errors import ConfigError
from entrenar.merge.engine import LoRAMode, Plan, merge_trees
from entrenar.merge.schedule import Setting, check_setting, map_setting
from entrenar.types import Params, PRNGKey


def _models(models: Any, what: str = "models") -> list[Params]:
    if not isinstance(models, Sequence) or isinstance(models, dict) or not models:
        raise ConfigError(f"{what} must be a non-empty list of parameter trees")
    return list(models)


def _per_model(value: Any, n: int, what: str, default: Any = None) -> tuple:
    """One setting per model: a sequence of ``n`` or one value for all."""
    if value is None:
        value = default
    if isinstance(value, Sequence) and not isinstance(value, str):
        if len(value) != n:
            raise ConfigError(f"{what} has {len(value)} entries for {n} models")
        values = tuple(value)
    else:
        values = (value,) * n
    for i, v in enumerate(values):
        check_setting(v, f"{what}[{i}]")
    return values


def _check_range(
    values: Sequence[Any], what: str, lo: float, hi: float, lo_in: bool, hi_in: bool
) -> None:
    """Range-check the plain numbers now (schedules are checked per leaf)."""
    for v in values:
        if not isinstance(v, int | float) or isinstance(v, bool):
            continue
        if not ((v >= lo if lo_in else v > lo) and (v <= hi if hi_in else v < hi)):
            rng = f"{'[' if lo_in else '('}{lo}, {hi}{']' if hi_in else ')'}"
            raise ConfigError(f"{what} = {v} is outside {rng}")


def _lam(lam: float) -> float:
    if not isinstance(lam, int | float) or not math.isfinite(lam):
        raise ConfigError(f"lam must be a finite number, got {lam!r}")
    return float(lam)


def task_arithmetic(
    base: Params,
    models: Sequence[Params],
    weights: Sequence[Setting] | float,
    lam: float = 1.0,
    *,
    normalize: bool = False,
    lora: LoRAMode = "fold",
    dtype: Any = None,
) -> Params:
    """Task arithmetic (Ilharco et al. 2023, arXiv:2212.04089).

    ``θ = θ_base + λ Σ_i w_i τ_i`` with task vectors ``τ_i = θ_i - θ_base``
    (divided by ``Σ_i w_i`` when ``normalize``).

    Args:
        base: the pre-trained tree.
        models: fine-tuned trees of the same structure, shapes and dtypes.
        weights: ``w_i``, one per model (or one number for all).
        lam: λ.
        normalize: divide the weighted sum by ``Σ_i w_i``.
        lora: ``"fold"`` or ``"adapters"`` (see `entrenar.merge.merge_trees`).
        dtype: output dtype (default: each leaf's own).

    Example:
        >>> import jax.numpy as jnp
        >>> base = {"w": jnp.zeros(2)}
        >>> out = task_arithmetic(base, [{"w": jnp.ones(2)}, {"w": -jnp.ones(2)}],
        ...                       [1.0, 0.5])
        >>> out["w"].tolist()
        [0.5, 0.5]
    """
    models = _models(models)
    plan = Plan(
        "task_vectors",
        weights=_per_model(weights, len(models), "weights"),
        lam=_lam(lam),
        normalize=normalize,
    )
    return merge_trees(plan, base, models, lora=lora, dtype=dtype)


def ties(
    base: Params,
    models: Sequence[Params],
    density: Sequence[Setting] | float,
    weights: Sequence[Setting] | float | None = None,
    lam: float = 1.0,
    *,
    normalize: bool = True,
    lora: LoRAMode = "fold",
    dtype: Any = None,
) -> Params:
    """TIES-Merging: trim, elect sign, disjoint merge (Yadav et al. 2023, 2306.01708).

    Per tensor (per layer of a stacked leaf), with ``τ_i = θ_i - θ_base``:

    1. Trim: keep the ``k_i = max(1, ⌊density_i · m⌋)`` entries of largest ``|τ_i|``
       (all entries tied with the k-th are kept), zero the rest: ``τ̂_i``.
    2. Elect: ``γ = sign(Σ_i w_i τ̂_i)``, ``+1`` where the sum is 0.
    3. Disjoint merge: ``A = {i : sign(w_i τ̂_i) = γ}``;
       ``τ = Σ_{i∈A} w_i τ̂_i / Σ_{i∈A} w_i`` (1 where ``A`` is empty).
    4. ``θ = θ_base + λ τ``.

    Weights enter the election by weighting each trimmed vector before the sum (a
    model of weight 2 votes like two copies of it) and make the disjoint mean a
    weighted mean; with all ``w_i = 1`` this is the paper's algorithm. The trim is
    per tensor, as mergekit does (the paper's code trims the whole flattened model).

    Args:
        base: the pre-trained tree.
        models: fine-tuned trees.
        density: fraction kept by the trim, in (0, 1], one per model or one for all.
        weights: ``w_i`` (default 1 each).
        lam: λ.
        normalize: divide by the agreeing weights' sum (False: the sum).
        lora: ``"fold"`` or ``"adapters"``.
        dtype: output dtype (default: each leaf's own).

    Example:
        >>> import jax.numpy as jnp
        >>> base = {"w": jnp.zeros(3)}
        >>> ms = [{"w": jnp.array([2.0, 1.0, -1.0])},
        ...       {"w": jnp.array([1.0, -3.0, -1.0])}]
        >>> ties(base, ms, density=1.0)["w"].tolist()
        [1.5, -3.0, -1.0]
    """
    models = _models(models)
    dens = _per_model(density, len(models), "density")
    _check_range(dens, "density", 0.0, 1.0, False, True)
    plan = Plan(
        "task_vectors",
        weights=_per_model(weights, len(models), "weights", 1.0),
        density=dens,
        lam=_lam(lam),
        elect=True,
        normalize=normalize,
    )
    return merge_trees(plan, base, models, lora=lora, dtype=dtype)


def dare(
    base: Params,
    models: Sequence[Params],
    drop_rate: Sequence[Setting] | float,
    *,
    key: PRNGKey,
    weights: Sequence[Setting] | float | None = None,
    rescale: bool = True,
    ties: bool = False,
    lam: float = 1.0,
    normalize: bool | None = None,
    lora: LoRAMode = "fold",
    dtype: Any = None,
) -> Params:
    """DARE: drop and rescale task vectors (Yu et al. 2024, arXiv:2311.03099).

    For each model ``i`` and leaf: ``m_i ~ Bernoulli(1 - p_i)`` elementwise (1 =
    kept), ``τ̂_i = m_i ⊙ τ_i / (1 - p_i)`` (no division without ``rescale``). Then
    task arithmetic ``θ = θ_base + λ Σ_i w_i τ̂_i``, or with ``ties=True`` TIES'
    sign election and disjoint merge of the ``τ̂_i`` (no magnitude trim).

    The mask of model ``i`` at leaf ``name`` is drawn with
    ``fold_in(fold_in(key, crc32(name)), i)``, so the same key gives the same
    merge, whatever the other leaves.

    Args:
        base: the pre-trained tree.
        models: fine-tuned trees.
        drop_rate: ``p`` in [0, 1), one per model or one for all.
        key: PRNG key.
        weights: ``w_i`` (default 1 each).
        rescale: divide kept values by ``1 - p``.
        ties: sign election and disjoint merge after the drop.
        lam: λ.
        normalize: divide by the (agreeing) weights' sum; default: ``ties``.
        lora: ``"fold"`` or ``"adapters"``.
        dtype: output dtype (default: each leaf's own).

    Example:
        >>> import jax, jax.numpy as jnp
        >>> base, ft = {"w": jnp.zeros(4)}, {"w": jnp.ones(4)}
        >>> dare(base, [ft], 0.0, key=jax.random.key(0))["w"].tolist()
        [1.0, 1.0, 1.0, 1.0]
    """
    models = _models(models)
    rates = _per_model(drop_rate, len(models), "drop_rate")
    _check_range(rates, "drop_rate", 0.0, 1.0, True, False)
    plan = Plan(
        "task_vectors",
        weights=_per_model(weights, len(models), "weights", 1.0),
        keep=tuple(map_setting(r, lambda p: 1.0 - p) for r in rates),
        lam=_lam(lam),
        elect=ties,
        normalize=ties if normalize is None else normalize,
        rescale=rescale,
        key=key,
    )
    return merge_trees(plan, base, models, lora=lora, dtype=dtype)


def slerp(
    a: Params, b: Params, t: Setting, *, lora: LoRAMode = "fold", dtype: Any = None
) -> Params:
    """Spherical linear interpolation of two models, tensor by tensor.

    Per tensor (per layer of a stacked leaf), flattened: ``cos θ = â · b̂`` with
    ``x̂ = x / ‖x‖``, and ``sin((1-t)θ)/sin θ · a + sin(tθ)/sin θ · b``; linear
    ``(1-t) a + t b`` where ``|cos θ| > 0.9995`` or a norm is ``<= 1e-8`` (Shoemake
    1985; mergekit's threshold).

    Args:
        a: the tree at ``t = 0``.
        b: the tree at ``t = 1``.
        t: in [0, 1]: a number, a per-layer schedule ``[t_0, ..., t_{g-1}]``
            interpolated over depth (layer ``i`` of ``N`` at ``i / (N - 1)``; tensors
            outside the layers take ``t_0``), or mergekit's ``{filter, value}``
            conditionals (`entrenar.merge.schedule`).
        lora: ``"fold"`` or ``"adapters"``.
        dtype: output dtype (default: each leaf's own).

    Example:
        >>> import jax.numpy as jnp
        >>> out = slerp({"w": jnp.array([1.0, 0.0])}, {"w": jnp.array([0.0, 1.0])}, 0.5)
        >>> [round(v, 4) for v in out["w"].tolist()]
        [0.7071, 0.7071]
    """
    check_setting(t, "t")
    _check_range([t] if not isinstance(t, list) else t, "t", 0.0, 1.0, True, True)
    return merge_trees(Plan("slerp", t=t), a, [b], lora=lora, dtype=dtype)


def linear(
    models: Sequence[Params],
    weights: Sequence[Setting] | float,
    normalize: bool = True,
    *,
    lora: LoRAMode = "fold",
    dtype: Any = None,
) -> Params:
    """Weighted average ("model soup", Wortsman et al. 2022, arXiv:2203.05482).

    ``θ = Σ_i w_i θ_i / Σ_i w_i`` (no division without ``normalize``).

    Args:
        models: trees of the same structure, shapes and dtypes.
        weights: ``w_i``, one per model (or one number for all).
        normalize: divide by ``Σ_i w_i`` (which must not be 0).
        lora: ``"fold"`` or ``"adapters"``.
        dtype: output dtype (default: each leaf's own).

    Example:
        >>> import jax.numpy as jnp
        >>> out = linear([{"w": jnp.ones(2)}, {"w": 3 * jnp.ones(2)}], [1.0, 1.0])
        >>> out["w"].tolist()
        [2.0, 2.0]
    """
    models = _models(models)
    plan = Plan(
        "linear",
        weights=_per_model(weights, len(models), "weights"),
        normalize=normalize,
    )
    return merge_trees(plan, None, models, lora=lora, dtype=dtype)


__all__ = ["dare", "linear", "slerp", "task_arithmetic", "ties"]
