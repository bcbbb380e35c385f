"""merge.search over a grid with a score function: the best worst-task setting wins."""

import numpy as np
import pytest

from entrenar import io, merge
from entrenar.errors import ConfigError
from entrenar.merge.run import files_recipe
from entrenar.merge.search import format_table, with_setting


def save(path, value):
    tree = {"w": np.full((4,), value, np.float32)}
    io.save_model(io.Model(io.ModelMetadata("m"), tree), path)
    return str(path)


@pytest.fixture
def recipe(tmp_path):
    base = save(tmp_path / "base.safetensors", 0.0)
    models = [save(tmp_path / f"m{i}.safetensors", 1.0) for i in range(2)]
    return files_recipe(models, "task_arithmetic", base=base, lam=1.0)


def test_default_grid_starts_with_the_recipe_setting(recipe):
    grid = merge.default_grid(recipe)
    assert grid[0] == {"lambda": 1.0, "weights": (1.0, 1.0)}
    assert len(grid) == len({repr(g) for g in grid}) == 3 * 3  # weights x λ
    assert {"weights": (2.0, 1.0), "lambda": 1.5} in grid


def test_search_keeps_the_best_worst_task_score(recipe):
    def score(model, budget):  # merged w = λ (w_0 + w_1): a wants 1.5, b >= 1.5
        w = float(np.asarray(model.params["w"])[0])
        return {"a": float(np.isclose(w, 1.5)), "b": float(w >= 1.5)}

    seen = []
    result = merge.search(
        recipe, score, [{"lambda": x} for x in (1.0, 0.75, 2.0)], progress=seen.append
    )
    assert [t.setting["lambda"] for t in result.trials] == [1.0, 0.75, 2.0]
    assert seen == list(result.trials)
    assert isinstance(result.best, merge.Trial) and result.best.setting == {
        "lambda": 0.75
    }
    assert (result.best.worst, result.trials[2].worst, result.trials[2].mean) == (
        1.0,
        0.0,
        0.5,
    )
    table = result.table()
    assert "| * | 0.75 | 1.000 | 1.000 | 1.000 | all |" in table
    assert table == format_table(result.trials, result.best)


def test_ties_prefer_the_recipe_own_values(recipe):
    result = merge.search(recipe, lambda m, b: {"a": 1.0}, merge.default_grid(recipe))
    assert result.best is result.trials[0]


def test_with_setting_checks_its_keys(recipe):
    assert with_setting(recipe, {"weights": (2.0, 1.0)}).models[0].parameters == {
        "weight": 2.0
    }
    with pytest.raises(ConfigError, match="unknown search keys"):
        with_setting(recipe, {"alpha": 1})
    with pytest.raises(ConfigError, match="3 weights for 2 models"):
        with_setting(recipe, {"weights": (1, 1, 1)})


def counting_score(records):
    """Score ``records`` per task like `ChatScorer`: 1-record batches, pruned.

    ``records[task](w)`` is the tuple of hits of the merged weight ``w``; each call
    logs ``(w, task, records scored)``.
    """
    log = []

    def score(model, budget):
        w = float(np.asarray(model.params["w"])[0])
        hits = {t: f(w)[: budget.items] for t, f in records.items()}
        right = dict.fromkeys(hits, 0)
        seen = dict.fromkeys(hits, 0)
        for k in range(max(len(h) for h in hits.values())):
            for t, h in hits.items():
                if k >= len(h):
                    continue
                right[t] += h[k]
                seen[t] += 1
                if (right[t] + len(h) - seen[t]) / len(h) < budget.floor:
                    log.append((w, dict(seen)))
                    return {u: (right[u] + len(hits[u]) - seen[u]) / len(hits[u])
                            for u in hits}  # fmt: skip
        log.append((w, dict(seen)))
        return {t: right[t] / len(h) for t, h in hits.items()}

    return score, log


# merged w = λ (1 + 1) = 2λ; 10 records per task, hits by w:
HITS = {
    2.0: {"a": (1,) * 6 + (0,) * 4, "b": (1,) * 6 + (0,) * 4},  # the recipe's: 0.6
    1.0: {"a": (0,) * 10, "b": (1,) * 10},  # a fails at once: pruned
    3.0: {"a": (1,) * 10, "b": (1,) * 9 + (0,)},  # the best: 0.9
    4.0: {"a": (1,) * 9 + (0,), "b": (1,) * 4 + (0,) * 6},  # screens well, then 0.4
    5.0: {"a": (1,) * 8 + (0,) * 2, "b": (1,) * 8 + (0,) * 2},  # 0.8, second best
}
TASKS = {t: (lambda w, t=t: HITS[w][t]) for t in ("a", "b")}
GRID = [{"lambda": x / 2} for x in (2.0, 1.0, 3.0, 4.0, 5.0)]


def test_pruning_keeps_the_winner_and_scores_less(recipe):
    full, _ = counting_score(TASKS)
    plain = merge.search(recipe, lambda m, b: full(m, merge.Budget()), GRID)
    score, log = counting_score(TASKS)
    pruned = merge.search(recipe, score, GRID)
    assert pruned.best.setting == plain.best.setting == {"lambda": 1.5}
    assert pruned.best.scores == plain.best.scores == {"a": 1.0, "b": 0.9}
    assert [t.pruned for t in pruned.trials] == [False, True, False, True, True]
    assert log[1] == (1.0, {"a": 5, "b": 4})  # 5 misses: a cannot reach 0.6
    for t, p in zip(plain.trials, pruned.trials, strict=True):  # bounds hold
        assert all(p.scores[k] >= v for k, v in t.scores.items())
        assert p.pruned or p.scores == t.scores
    assert sum(sum(n.values()) for _, n in log) < 5 * 20
    assert "| 0.5 | <=0.500 | <=1.000 | <=0.500 | all, pruned |" in pruned.table()


def test_screening_scores_the_recipe_and_the_finalists_in_full(recipe):
    score, log = counting_score(TASKS)
    result = merge.search(recipe, score, GRID, screen=4, finalists=2)
    assert result.best.setting == {"lambda": 1.5}
    assert result.best.scores == {"a": 1.0, "b": 0.9}
    full = [w for w, n in log if n == {"a": 10, "b": 10}]
    assert full[0] == 2.0  # the recipe's own setting first, in full
    # screened on 4 records: w=1 0.0 (screened first: nothing to prune against);
    # 3, 4 and 5 all 1.0, so the finalists go by grid order: w=3, then w=4, which
    # the full run prunes (0.4 < 0.9)
    assert [t.items for t in result.trials] == [None, 4, None, None, 4]
    assert [t.pruned for t in result.trials] == [False, False, False, True, False]
    assert "| 2.5 | 1.000 | 1.000 | 1.000 | first 4 |" in result.table()


def test_screen_must_be_positive(recipe):
    with pytest.raises(ConfigError, match="screen must be >= 1"):
        merge.search(recipe, lambda m, b: {"a": 1.0}, GRID, screen=0)
