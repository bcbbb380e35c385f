"""``training.export_best``: a run exports the parameters of its best evaluation.

The wine MLP at a learning rate of 1.0 (Adam): its eval loss is lowest at step 4
and rises after (1.16 at step 4, then 4.9, 9.1, 11.8), early stopping (patience 3)
ends it at step 7. The exported files are compared with the checkpoint of step 4
read by orbax's own reader and the model file by the safetensors library, and with
a run that simply stops at step 4.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
from config_cases import wine_doc, write
from safetensors.numpy import load_file

from entrenar.errors import ConfigError
from entrenar.runs import train_from_yaml


def doc(out, **training):
    d = wine_doc(out, optimizer={"name": "adam", "lr": 1.0})
    d["model"]["config"]["sizes"] = [13, 32, 3]
    d["training"].update(
        max_steps=12, eval_every=1, checkpoint_every=3, keep_checkpoints=1,
        early_stopping={"patience": 3},
    )  # fmt: skip
    d["training"].update(training)
    if d["training"]["early_stopping"] is None:
        del d["training"]["early_stopping"]
    d["quantization"] = {"scheme": "int8", "per_channel": True}
    return d


def run(tmp_path, name, **training):
    (tmp_path / name).mkdir()
    path = write(tmp_path / name / "run.yaml", doc(tmp_path / name / "out", **training))
    return train_from_yaml(path, progress=False), tmp_path / name / "out"


def checkpoint_params(out: Path, step: int) -> dict[str, np.ndarray]:
    """Checkpoint ``step``'s trained arrays under the model file's names."""
    import orbax.checkpoint as ocp

    with ocp.StandardCheckpointer() as ck:
        state = ck.restore(out / "checkpoints" / str(step) / "state")
    return {
        f"layers.{i}.{k}": np.asarray(v)
        for i, layer in enumerate(state["trainable"]["layers"])
        for k, v in layer.items()
    }


def assert_same_arrays(a, b):
    assert sorted(a) == sorted(b)
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)  # bit for bit


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("best")
    return {
        "best": run(tmp, "best", export_best=True),
        "last": run(tmp, "last"),
        "to4": run(tmp, "to4", max_steps=4, early_stopping=None),
    }


def test_the_best_steps_parameters_are_exported(runs):
    result, out = runs["best"]
    metrics = json.loads((out / "result.json").read_text())["metrics"]
    assert metrics["best_step"] == metrics["exported_step"] == 4, metrics
    assert metrics["steps"] == 7 and metrics["stopped_early"]
    evals = [e["eval_loss"] for e in result.train.eval_history]
    assert min(evals) == evals[3] < evals[-1]  # the loss rose after step 4
    # keep_checkpoints=1: the last one, and the best one that rotation spared
    assert sorted(os.listdir(out / "checkpoints")) == ["4", "7"]
    assert_same_arrays(load_file(out / "model.safetensors"), checkpoint_params(out, 4))
    # a run stopped at step 4 exports the same model and quantized copy
    _, to4 = runs["to4"]
    for name in ("model.safetensors", "model-int8.safetensors"):
        assert_same_arrays(load_file(out / name), load_file(to4 / name))


def test_without_export_best_the_last_steps_parameters_are_exported(runs):
    result, out = runs["last"]
    metrics = json.loads((out / "result.json").read_text())["metrics"]
    assert "exported_step" not in metrics and metrics["best_step"] == 4
    assert result.train.params_step == metrics["steps"] == 7
    assert os.listdir(out / "checkpoints") == ["7"]
    assert_same_arrays(load_file(out / "model.safetensors"), checkpoint_params(out, 7))
    best = runs["best"][1]
    # the same training: only the exported parameters differ
    assert (out / "metrics.jsonl").read_text() == (best / "metrics.jsonl").read_text()
    ma, mb = (json.loads((o / "checkpoints/7/meta/metadata").read_text())
              for o in (out, best))  # fmt: skip
    for m in (ma, mb):
        del m["config"]["output_dir"], m["config"]["export_best"]
    assert ma == mb


def test_export_best_without_validation_data_is_refused(tmp_path):
    d = doc(tmp_path / "out", export_best=True, eval_every=None, early_stopping=None)
    del d["data"]["validation"]
    with pytest.raises(ConfigError, match=r"training\.export_best: evaluations need"):
        train_from_yaml(write(tmp_path / "run.yaml", d), progress=False)
