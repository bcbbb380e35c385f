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
    def score(model):  # merged w = λ (w_0 + w_1): task a wants 1.5, task b >= 1.5
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
    assert "| * | 0.75 | 1.000 | 1.000 | 1.000 |" in table
    assert table == format_table(result.trials, result.best)


def test_ties_prefer_the_recipe_own_values(recipe):
    result = merge.search(recipe, lambda m: {"a": 1.0}, merge.default_grid(recipe))
    assert result.best is result.trials[0]


def test_with_setting_checks_its_keys(recipe):
    assert with_setting(recipe, {"weights": (2.0, 1.0)}).models[0].parameters == {
        "weight": 2.0
    }
    with pytest.raises(ConfigError, match="unknown search keys"):
        with_setting(recipe, {"alpha": 1})
    with pytest.raises(ConfigError, match="3 weights for 2 models"):
        with_setting(recipe, {"weights": (1, 1, 1)})
