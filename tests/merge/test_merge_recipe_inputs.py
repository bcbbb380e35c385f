"""Hostile merge recipes and model folders: entrenar errors naming the recipe key.

``merge_method: []`` once raised ``TypeError: unhashable type`` and a model folder
without ``model.safetensors`` a bare ``FileNotFoundError``.
"""

import json

import numpy as np
import pytest
import yaml

from entrenar import io, merge
from entrenar.errors import ConfigError, FormatError

MODEL = {"model": "a.safetensors", "parameters": {"weight": 1.0}}


@pytest.mark.parametrize(
    ("change", "key"),
    [
        ({"merge_method": []}, "merge_method []"),
        ({"merge_method": {"ties": 1}}, "merge_method {'ties': 1}"),
        ({"merge_method": 3}, "merge_method 3"),
        ({"dtype": ["float32"]}, "dtype ['float32']"),
        ({"out_dtype": {"a": 1}}, "out_dtype {'a': 1}"),
    ],
)
def test_values_of_the_wrong_type_are_config_errors_naming_the_key(change, key):
    doc = {"merge_method": "linear", "models": [MODEL], **change}
    with pytest.raises(ConfigError) as e:
        merge.parse_recipe(doc, source="r.yaml")
    assert str(e.value).startswith(f"r.yaml: {key} is not one of")


@pytest.fixture
def folder(tmp_path):
    """A recipe folder with one model file and an empty model folder ``hf``."""
    tree = {"w": np.arange(4, dtype=np.float32)}
    io.save_model(io.Model(io.ModelMetadata("a"), tree), tmp_path / "a.safetensors")
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text('{"model_type": "llama"}')
    return tmp_path


def _run(folder, doc):
    path = folder / "r.yaml"
    path.write_text(yaml.safe_dump(doc))
    return merge.run_recipe(path), str(path)


@pytest.mark.parametrize(
    ("doc", "key"),
    [
        (
            {"merge_method": "linear", "models": [MODEL, {**MODEL, "model": "hf"}]},
            "models[1].model",
        ),
        (
            {"merge_method": "ties", "base_model": "hf", "models": [MODEL]},
            "base_model",
        ),
    ],
)
def test_a_model_folder_without_weights_names_the_recipe_key(folder, doc, key):
    with pytest.raises(FormatError) as e:
        _run(folder, doc)
    recipe = str(folder / "r.yaml")
    assert str(e.value).startswith(f"{recipe}: {key}: {folder / 'hf'}: ")
    assert "needs model.safetensors" in str(e.value)


def test_a_missing_shard_and_unreadable_folder_files_name_the_key(folder):
    doc = {"merge_method": "linear", "models": [MODEL, {**MODEL, "model": "hf"}]}
    index = folder / "hf" / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"w": "shard-1.safetensors"}}))
    with pytest.raises(FormatError, match=r"models\[1\]\.model: .*'shard-1"):
        _run(folder, doc)
    index.write_text("[" * 100_000 + "]" * 100_000)  # RecursionError in json
    with pytest.raises(FormatError, match=r"models\[1\]\.model: .*nests deeper"):
        _run(folder, doc)
    index.write_text(json.dumps({"weight_map": {}}) + " " * (16 << 20))  # 16 MiB +
    with pytest.raises(FormatError, match=r"models\[1\]\.model: .*over the file"):
        _run(folder, doc)  # (was read whole: json.load had no bound)
    index.unlink()
    (folder / "hf" / "model.safetensors").write_bytes(
        (folder / "a.safetensors").read_bytes()
    )
    (folder / "hf" / "config.json").write_bytes(b'{"model_type": "\xff"}')
    with pytest.raises(FormatError, match=r"config\.json line 1.*not UTF-8"):
        _run(folder, doc)
    (folder / "hf" / "config.json").write_text('{"model_type": "custom"}')
    model, _ = _run(folder, doc)
    np.testing.assert_array_equal(model.params["w"], np.arange(4) * 1.0)


@pytest.mark.parametrize("name", ["m.safetensors", "m.gguf", "m.json"])
def test_a_merge_of_folders_into_a_model_file_is_refused(folder, name):
    """A merge of Hugging Face folders is written as a folder, not a model file.

    Before: the file held the folders' Hugging Face names and no architecture, so
    `entrenar eval` could not read it and llama.cpp could not run the GGUF.
    """
    (folder / "hf" / "model.safetensors").write_bytes(
        (folder / "a.safetensors").read_bytes()
    )
    (folder / "hf2").mkdir()
    for f in ("model.safetensors", "config.json"):
        (folder / "hf2" / f).write_bytes((folder / "hf" / f).read_bytes())
    doc = {"merge_method": "ties", "base_model": "hf",
           "models": [{"model": "hf2", "parameters": {"weight": 1.0}}]}  # fmt: skip
    path = folder / "r.yaml"
    path.write_text(yaml.safe_dump(doc))
    with pytest.raises(ConfigError, match=r"is a Hugging Face folder.*without a file"):
        merge.run_recipe(path, folder / name)
    assert not (folder / name).exists()
    merge.run_recipe(path, folder / "merged")  # a folder output is the way
    assert (folder / "merged" / "config.json").exists()
