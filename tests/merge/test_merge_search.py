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


@pytest.fixture
def ties_recipe(tmp_path):
    """TIES over two random 'fine-tunes' of a (2, 3, 16) stacked leaf."""
    rng = np.random.default_rng(0)
    base = rng.normal(size=(2, 3, 16)).astype(np.float32)

    def model(path, value):
        tree = {"model": {"layers": {"w": value}}}
        io.save_model(io.Model(io.ModelMetadata("m"), tree), path)
        return str(path)

    b = model(tmp_path / "base.safetensors", base)
    ms = [model(tmp_path / f"m{i}.safetensors",
                base + rng.normal(size=base.shape).astype(np.float32))
          for i in range(2)]  # fmt: skip
    return files_recipe(ms, "ties", base=b, density=0.5)


def test_search_reuses_the_task_vector_across_lambda_with_the_same_bits(
    ties_recipe, monkeypatch
):
    from entrenar.merge import kernels
    from entrenar.merge.run import merge_inputs, open_inputs

    calls = []
    real = kernels.merged_task_vector
    monkeypatch.setattr(
        kernels, "merged_task_vector", lambda *a, **k: calls.append(1) or real(*a, **k)
    )
    got = {}

    def score(model, budget):
        got[len(got)] = np.asarray(model.params["model"]["layers"]["w"])
        return {"a": 1.0}

    grid = merge.default_grid(ties_recipe)  # (0.5, 1), then density x λ
    merge.search(ties_recipe, score, grid)
    assert len(calls) == 4  # one per density (0.5, 0.3, 0.6, 1), not per setting
    for i, point in enumerate(grid):  # each equals a merge from scratch
        fresh = merge_inputs(with_setting(ties_recipe, point), open_inputs(ties_recipe))
        want = np.asarray(fresh.params["model"]["layers"]["w"])
        np.testing.assert_array_equal(got[i], want, err_msg=str(point))


def test_density_one_trims_nothing():
    import jax
    import jax.numpy as jnp

    from entrenar.merge import kernels

    rng = np.random.default_rng(1)
    base = jnp.asarray(rng.normal(size=(2, 32)), jnp.float32)  # (L, m)
    thetas = tuple(base + jnp.asarray(rng.normal(size=(2, 32)), jnp.float32)
                   for _ in range(3))  # fmt: skip
    args = (base, thetas, jnp.ones((2, 3)), jnp.full((2, 3), 32, jnp.int32),
            jnp.ones((2, 3)), jax.random.split(jax.random.key(0), 3))  # fmt: skip
    flags = {"elect": True, "normalize": True, "drop": False, "rescale": False}
    trimmed = kernels.merged_task_vector(*args, trim=True, **flags)
    untrimmed = kernels.merged_task_vector(*args, trim=False, **flags)
    np.testing.assert_array_equal(np.asarray(trimmed), np.asarray(untrimmed))


def test_search_writes_the_best_merge_as_run_recipe_does(ties_recipe, tmp_path):
    def score(model, budget):  # prefers the sparsest, largest-λ merge
        w = np.asarray(model.params["model"]["layers"]["w"])
        return {"a": float(np.mean(w == 0)), "b": float(np.abs(w).max())}

    out = tmp_path / "best.safetensors"
    result = merge.search(ties_recipe, score, output=out)
    want = tmp_path / "want.safetensors"
    merge.run_recipe(with_setting(ties_recipe, result.best.setting), want)
    (got, got_meta), (ref, ref_meta) = map(io.read_safetensors, (str(out), str(want)))
    assert got_meta == ref_meta and got.keys() == ref.keys()
    for k in ref:
        np.testing.assert_array_equal(np.asarray(got[k]), np.asarray(ref[k]))
