"""Merges that search: score each setting of a small grid on held-out tasks.

A merge's settings (TIES/DARE density, λ, the models' weights, SLERP's t) decide
which skills survive, and the best ones depend on the fine-tunes. `search` opens
the inputs once (`entrenar.merge.run.open_inputs`), merges them with each setting
of a grid, scores every task on the merged model with a caller's ``score``
function (exact match of greedy replies, in ``entrenar merge --eval``), and keeps
the setting with the best *worst-task* score (ties: the better mean, then the
fewer values changed from the grid's first setting, the recipe's own, then the
earlier one):

    best = argmax_s  (min_task score(s, task),  mean_task score(s, task))

A merge with task vectors is ``base + λ · M`` where the merged task vector ``M``
does not depend on λ (`entrenar.merge.kernels.merged_task_vector`): a setting that
differs from the previous one only in λ reuses its ``M`` (the grid lists λ
innermost), so a TIES grid of 3 densities x 3 λ runs the trim-and-elect kernel
3 times, not 9; the result is the same bits as merging from scratch.

Scoring dominates the rest (scoring two 80-record tasks of SmolLM2-135M takes
most of a minute on 2 cores), so two things keep it short; neither changes which
setting wins among those scored in full:

- **Pruning.** A score is told the best worst-task score so far (`Budget.floor`)
  and may stop as soon as some task cannot reach it: with ``c`` of ``n`` records
  right after ``k`` scored, the task ends at most at ``(c + n - k) / n``; when
  that is below the floor the setting cannot win (its worst task is below the
  best's) and the score returns those upper bounds (the trial is *pruned*).
- **Screening** (``screen=N``). Every setting is first scored on each task's first
  ``N`` records; the recipe's own setting and the ``finalists`` best screened
  others are then scored on every record, and only those compete. The recipe's
  own setting is scored in full first, so the result is never a setting that
  lost to it on the worst task over the full sets.

`default_grid` is the small grid searched when none is given.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

from entrenar.errors import ConfigError
from entrenar.io import Model
from entrenar.merge.recipe import METHODS, Recipe
from entrenar.merge.run import merge_inputs, merged_refs, open_inputs, write_opened

Setting = Mapping[str, Any]
"""One point of a grid: ``density``, ``lambda``, ``t`` (numbers) or ``weights``
(one number per merged model)."""


class Budget(NamedTuple):
    """How much scoring a setting gets (module docstring).

    Attributes:
        items: score each task's first ``items`` records; None: every record.
        floor: the best worst-task score so far: a score may stop once some task
            cannot reach it, returning each task's upper bound (``-inf``: never).
    """

    items: int | None = None
    floor: float = float("-inf")


Score = Callable[[Model, Budget], Mapping[str, float]]
"""Scores of a merged model per task name, within a `Budget` (upper bounds when it
stopped early)."""

DENSITIES = (0.3, 0.6, 1.0)
LAMBDAS = (1.0, 1.5, 2.0)
TS = (0.25, 0.5, 0.75)


class Trial(NamedTuple):
    """One setting and the merged model's score on each task.

    Attributes:
        setting: the grid point.
        scores: per task; upper bounds when ``pruned``.
        items: records scored per task (None: all of them).
        pruned: the score stopped early (a task could not reach the best).
    """

    setting: Setting
    scores: Mapping[str, float]
    items: int | None = None
    pruned: bool = False

    @property
    def worst(self) -> float:
        """The lowest task score."""
        return min(self.scores.values())

    @property
    def mean(self) -> float:
        """The mean task score."""
        return sum(self.scores.values()) / len(self.scores)


class SearchResult(NamedTuple):
    """Every trial in grid order, and the best one (module docstring)."""

    trials: tuple[Trial, ...]
    best: Trial

    def table(self) -> str:
        """The trials as a Markdown table, the best marked with ``*``."""
        return format_table(self.trials, self.best)


def current_setting(recipe: Recipe) -> dict[str, Any]:
    """The recipe's own values of the keys a grid varies (its defaults)."""
    kind = METHODS[recipe.merge_method]
    refs = merged_refs(recipe)
    if kind["kind"] == "slerp":
        return {"t": recipe.parameters.get("t")}
    out: dict[str, Any] = {}
    if kind.get("trim") or kind.get("drop"):
        out["density"] = recipe.setting(refs[0], "density", 1.0)
    if kind["kind"] == "task_vectors":
        out["lambda"] = recipe.parameters.get("lambda", 1.0)
    out["weights"] = tuple(recipe.setting(r, "weight", 1.0) for r in refs)
    return out


def default_grid(recipe: Recipe) -> list[dict[str, Any]]:
    """The small grid `search` tries by default, the recipe's setting first.

    TIES/DARE: density x λ (9 settings); task arithmetic: λ x weights; linear:
    weights (equal, and each model's weight doubled); SLERP: t. λ starts at 1:
    merging dilutes each task's update (TIES' disjoint mean halves it where two
    dense updates agree), so the search looks for more of it, not less. One
    setting of SmolLM2-135M with two 80-record tasks cost a 6 s merge and a
    39-53 s score on the loaded 2-core CPU (load 6-7) where this was written.
    """
    spec = METHODS[recipe.merge_method]
    n = len(merged_refs(recipe))
    weights: list[tuple[float, ...]] = [(1.0,) * n]
    weights += [tuple(2.0 if j == i else 1.0 for j in range(n)) for i in range(n)]
    grid: list[dict[str, Any]]
    if spec["kind"] == "slerp":
        grid = [{"t": t} for t in TS]
    elif spec.get("trim") or spec.get("drop"):
        grid = [{"density": d, "lambda": lam}
                for d, lam in itertools.product(DENSITIES, LAMBDAS)]  # fmt: skip
    elif spec["kind"] == "task_vectors":
        grid = [{"lambda": lam, "weights": w}
                for w, lam in itertools.product(weights, LAMBDAS)]  # fmt: skip
    else:
        grid = [{"weights": w} for w in weights]
    first = {k: v for k, v in current_setting(recipe).items() if k in grid[0]}
    return [first] + [g for g in grid if g != first]


def with_setting(recipe: Recipe, setting: Setting) -> Recipe:
    """``recipe`` with a grid setting (global values replace per-model ones)."""
    unknown = set(setting) - {"density", "lambda", "t", "weights"}
    if unknown:
        raise ConfigError(f"unknown search keys {sorted(unknown)}")
    params = dict(recipe.parameters)
    per_model = {"density"} & set(setting)
    for k in ("density", "lambda", "t"):
        if k in setting:
            params[k] = setting[k]
    weights = setting.get("weights")
    refs = merged_refs(recipe)
    if weights is not None and len(weights) != len(refs):
        raise ConfigError(f"{len(weights)} weights for {len(refs)} models")
    models = []
    for r in recipe.models:
        p = {k: v for k, v in r.parameters.items() if k not in per_model}
        if weights is not None and r in refs:
            p["weight"] = weights[refs.index(r)]
        models.append(dataclasses.replace(r, parameters=p))
    return dataclasses.replace(recipe, models=tuple(models), parameters=params)


def search(
    recipe: Recipe,
    score: Score,
    grid: Sequence[Setting] | None = None,
    *,
    screen: int | None = None,
    finalists: int = 2,
    progress: Callable[[Trial], None] | None = None,
    output: str | os.PathLike[str] | None = None,
) -> SearchResult:
    """Merge with each setting of ``grid`` and keep the best worst-task score.

    Args:
        recipe: what to merge; its settings are the grid's first point when
            ``grid`` is None (`default_grid`).
        score: the merged model's score per task (higher is better) within a
            `Budget`.
        grid: the settings to try, in order; the first is scored in full first.
        screen: score every setting on each task's first ``screen`` records, then
            only the first setting and the ``finalists`` best others in full
            (module docstring); None: every setting in full.
        finalists: with ``screen``, how many screened settings besides the first
            are scored in full.
        progress: called with each trial as it is scored.
        output: write the best setting's merge here (as `run_recipe` would,
            from the inputs the search opened); None: write nothing.

    Returns:
        Every setting's trial in grid order (the full one where a setting was
        scored twice) and the best of those scored in full; merge it again with
        ``run_recipe(with_setting(recipe, result.best.setting), output)``.
    """
    points = [dict(p) for p in (grid if grid is not None else default_grid(recipe))]
    if not points:
        raise ConfigError("the search grid is empty")
    if screen is not None and screen < 1:
        raise ConfigError(f"screen must be >= 1 records, got {screen}")
    sources = open_inputs(recipe)
    reuse: dict[str, Any] = {"key": None, "memo": {}}  # M of the last setting

    def memo(point: Setting) -> dict[str, Any]:
        key = sorted((k, repr(v)) for k, v in point.items() if k != "lambda")
        if key != reuse["key"]:  # another M: drop the last one first
            reuse["key"], reuse["memo"] = key, {}
        return reuse["memo"]

    def merged(point: Setting) -> Model:
        return merge_inputs(
            with_setting(recipe, point), sources, keep_inputs=True, memo=memo(point)
        )

    def trial(i: int, items: int | None, floor: float) -> Trial:
        model = merged(points[i])
        scores = dict(score(model, Budget(items, floor)))
        if not scores:
            raise ConfigError("the score function returned no task")
        t = Trial(points[i], scores, items, min(scores.values()) < floor)
        if progress is not None:
            progress(t)
        return t

    def rank(i: int, t: Trial) -> tuple[float, float, int, int]:
        changed = sum(t.setting.get(k) != v for k, v in points[0].items())
        return (t.worst, t.mean, -changed, -i)

    full: dict[int, Trial] = {0: trial(0, None, float("-inf"))}
    order = list(range(1, len(points)))
    screened: dict[int, Trial] = {}
    if screen is not None:
        floor = float("-inf")
        for i in order:
            screened[i] = trial(i, screen, floor)
            floor = max(floor, screened[i].worst)
        alive = [i for i in order if not screened[i].pruned]
        order = sorted(alive, key=lambda i: rank(i, screened[i]), reverse=True)
        order = order[:finalists]
    for i in order:
        full[i] = trial(i, None, max(t.worst for t in full.values()))
    best = max(full.items(), key=lambda it: rank(*it))[1]
    trials = tuple(full.get(i) or screened[i] for i in range(len(points)))
    if output is not None:
        best_recipe = with_setting(recipe, best.setting)
        write_opened(best_recipe, sources, output, memo=memo(best.setting))
    return SearchResult(trials, best)


def _value(v: Any) -> str:
    if isinstance(v, tuple | list):
        return "/".join(_value(x) for x in v)
    return f"{v:g}" if isinstance(v, float | int) else str(v)


def format_table(trials: Sequence[Trial], best: Trial | None = None) -> str:
    """A Markdown table: one row per trial, its setting and each task's score.

    The last column says what was scored: ``all`` records, the ``first N``
    (screening), or ``pruned`` (the scores are upper bounds, written ``<=``).
    """
    keys = list(dict.fromkeys(k for t in trials for k in t.setting))
    tasks = list(dict.fromkeys(k for t in trials for k in t.scores))
    head = ["", *keys, *tasks, "worst", "scored"]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for t in trials:
        bound = "<=" if t.pruned else ""
        cells = ["*" if t is best else ""]
        cells += [_value(t.setting.get(k, "")) for k in keys]
        cells += [f"{bound}{t.scores.get(k, float('nan')):.3f}" for k in tasks]
        cells.append(f"{bound}{t.worst:.3f}")
        what = "all" if t.items is None else f"first {t.items}"
        cells.append(f"{what}, pruned" if t.pruned else what)
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


__all__ = [
    "Budget",
    "SearchResult",
    "Trial",
    "current_setting",
    "default_grid",
    "format_table",
    "search",
    "with_setting",
]
