"""``entrenar info`` and ``eval`` on JSON/YAML model files entrenar itself wrote.

A ``.yaml`` argument is a run config unless it is a model document (top-level
``format: entrenar.model``); these commands once read every YAML model as a config
and failed with ``format: unknown key``.
"""

from __future__ import annotations

import json

import pytest
from cli_cases import MODELS, WINE
from click.testing import CliRunner

from entrenar import io
from entrenar.cli import cli
from entrenar.cli.inspect import is_model_yaml


def run(*args):
    return CliRunner().invoke(cli, [str(a) for a in args])


@pytest.fixture(scope="module")
def wine_yaml(tmp_path_factory):
    """The shipped wine MLP, written by entrenar as a YAML model file."""
    path = tmp_path_factory.mktemp("m") / "wine.yaml"
    model = io.load_model(MODELS / "wine-mlp.safetensors")
    io.save_model(model, path, io.SaveConfig(io.ModelFormat.YAML))
    return path


def test_info_reads_a_yaml_model_entrenar_wrote(wine_yaml):
    result = run("info", wine_yaml, "--format", "json")
    assert result.exit_code == 0, result.output
    info = json.loads(result.output)
    assert (info["format"], info["architecture"]) == ("yaml", "mlp")
    assert info["parameters"] == 13 * 32 + 32 + 32 * 3 + 3


def test_eval_reads_a_yaml_model_entrenar_wrote(wine_yaml):
    result = run("eval", wine_yaml, "--data", WINE / "validation.parquet")
    assert result.exit_code == 0, result.output
    assert "examples: 36" in result.output
    ref = run(
        "eval", MODELS / "wine-mlp.safetensors", "--data", WINE / "validation.parquet"
    )
    assert result.output == ref.output


def test_a_bad_yaml_model_is_a_model_error_not_a_config_error(wine_yaml, tmp_path):
    text = wine_yaml.read_text()
    text = text.replace("\n    dtype: float32", "\n    dtype: [float32]", 1)
    bad = tmp_path / "bad.yaml"
    bad.write_text(text)
    for args in (["info"], ["eval", "--data", WINE / "validation.parquet"]):
        result = run(args[0], bad, *args[1:])
        assert result.exit_code == 2, result.output
        assert result.output.startswith(f"error: {bad}: tensor "), result.output
        assert "dtype ['float32'] is not one of" in result.output


@pytest.mark.parametrize(
    ("text", "model"),
    [
        ("format: entrenar.model\nformat_version: 1\n", True),
        ("format_version: 1\n'format': \"entrenar.model\"  # comment\n", True),
        ('{"format": "entrenar.model", "tensors": {}}\n', True),
        ("model: {path: m.gguf}\ndata: {format: entrenar.model}\n", False),
        ("data:\n  format: entrenar.model\n", False),
    ],
)
def test_model_yaml_is_told_from_a_config_by_its_top_level_format(
    tmp_path, text, model
):
    path = tmp_path / "x.yaml"
    path.write_text(text)
    assert is_model_yaml(str(path)) is model
