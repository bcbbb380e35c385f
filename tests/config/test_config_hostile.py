"""Hostile run configs, recipes and --set values: a ConfigError at once, exit code 2."""

from __future__ import annotations

import struct
import time

import click
import pytest
from click.testing import CliRunner

from entrenar import merge
from entrenar.cli import cli
from entrenar.cli.app import parse_sets
from entrenar.config import load_config
from entrenar.errors import ConfigError, FormatError
from entrenar.io import file_architecture
from entrenar.io.bounded import read_yaml

BOMB = "".join(
    [f"a: &a [{', '.join(['x'] * 9)}]\n"]
    + [
        f"{c}: &{c} [{', '.join([f'*{p}'] * 9)}]\n"
        for p, c in zip("abcdefgh", "bcdefghi")
    ]
)
"""Nine levels of nine aliases: 9**9 = 387,420,489 leaves from 342 bytes."""


def test_an_alias_bomb_config_is_refused_in_well_under_a_second(tmp_path, deadline):
    p = tmp_path / "bomb.yaml"
    p.write_text(BOMB)
    start = time.perf_counter()
    with deadline(10), pytest.raises(ConfigError, match=r"bomb\.yaml.*alias bomb"):
        load_config(p)
    assert time.perf_counter() - start < 0.5


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("model: &a {path: *a}\n", r"line 1, column 18\): alias \*a is inside"),
        ("training: " + "[" * 200 + "]" * 200 + "\n", "nests deeper than 100"),
        ("training: {max_steps: " + "7" * 5000 + "}\n", "an integer of 5000"),
    ],
)
def test_cyclic_deep_and_huge_configs_are_config_errors(
    tmp_path, text, match, deadline
):
    p = tmp_path / "run.yaml"
    p.write_text(text)
    with deadline(10), pytest.raises(ConfigError, match=r"run\.yaml.*" + match):
        load_config(p)


def test_a_config_that_is_not_utf8_names_the_line(tmp_path):
    p = tmp_path / "run.yaml"
    p.write_bytes(b"model:\n  path: m\xff.gguf\n")
    with pytest.raises(ConfigError, match=r"run\.yaml line 2, column 10: not UTF-8"):
        load_config(p)


def test_a_key_given_twice_is_refused_naming_both_lines(tmp_path):
    """A key given twice in a mapping is a ConfigError naming both lines.

    PyYAML keeps the last of two equal keys: a second ``lora:`` section or a
    repeated ``max_steps`` changed the run silently. A merge key's (<<) values may
    still be given again.
    """
    p = tmp_path / "run.yaml"
    p.write_text(
        "model: {architecture: mlp, config: {sizes: [2, 2]}}\n"
        "training:\n  max_steps: 5\n  max_steps: 7\n"
    )
    with pytest.raises(
        ConfigError,
        match=r"run\.yaml: not valid YAML \(line 4, column 3\): key 'max_steps' "
        r"given twice \(first at line 3\); keep one$",
    ):
        load_config(p, check_files=False)
    p.write_text("a: &a {x: 1, y: 2}\nb:\n  <<: *a\n  x: 3\n")
    assert read_yaml(p) == {"a": {"x": 1, "y": 2}, "b": {"x": 3, "y": 2}}


def test_set_values_are_bounded_as_files_are(deadline):
    assert parse_sets(("training.max_steps=5",)) == {"training.max_steps": 5}
    with deadline(10), pytest.raises(click.BadParameter, match="alias bomb"):
        parse_sets(("model.config=" + BOMB.replace("\n", ", ").join("{}"),))
    with pytest.raises(click.BadParameter, match=r"lora\.rank.*a cycle"):
        parse_sets(("lora.rank=&a [*a]",))


def test_a_recipe_bomb_is_a_format_error(tmp_path, deadline):
    p = tmp_path / "recipe.yaml"
    p.write_text("merge_method: linear\n" + BOMB)
    with deadline(10), pytest.raises(FormatError, match=r"recipe\.yaml.*alias bomb"):
        merge.load_recipe(p)
    p.write_bytes(b"merge_method: lin\xc3ear\n")
    with pytest.raises(FormatError, match=r"recipe\.yaml line 1, column 18: not UTF"):
        merge.load_recipe(p)


@pytest.mark.parametrize("command", ["validate", "info", "merge"])
def test_the_command_line_exits_2_with_one_line(tmp_path, command, deadline):
    p = tmp_path / "bomb.yaml"
    p.write_text(BOMB)
    args = [command, str(p)]
    if command == "merge":
        args = [command, "--config", str(p), "-o", str(tmp_path / "out")]
    with deadline(30):
        result = CliRunner().invoke(cli, args)
    assert result.exit_code == 2, result.output
    assert "alias bomb" in result.output
    assert "Traceback" not in result.output


@pytest.mark.parametrize(
    "header", [b"[1, 2]", b"[" * 100_000 + b"]" * 100_000, b'{"__metadata__": [1]}']
)
def test_a_hostile_safetensors_header_tells_no_architecture(tmp_path, header):
    p = tmp_path / "m.safetensors"
    p.write_bytes(struct.pack("<Q", len(header)) + header)
    assert file_architecture(str(p)) is None
