"""Hostile YAML and JSON text: refused fast, as a FormatError naming file and line."""

from __future__ import annotations

import time

import pytest

from entrenar import io
from entrenar.errors import FormatError
from entrenar.io import bounded


def alias_bomb(levels: int = 9, width: int = 9) -> str:
    """``a: &a [x, ...]``, ``b: &b [*a, ...]``, ...: ``width ** levels`` leaves."""
    lines = [f"a: &a [{', '.join(['x'] * width)}]"]
    for i in range(1, levels):
        name, prev = chr(ord("a") + i), chr(ord("a") + i - 1)
        lines.append(f"{name}: &{name} [{', '.join([f'*{prev}'] * width)}]")
    return "\n".join(lines) + "\n"


def test_the_alias_bomb_is_small_and_refused_at_once(deadline):
    text = alias_bomb()
    assert len(text) < 400
    start = time.perf_counter()
    with deadline(5), pytest.raises(FormatError, match=r"line \d+.*alias bomb"):
        bounded.parse_yaml(text, "bomb.yaml")
    assert time.perf_counter() - start < 0.5


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("x: &a {y: *a}", r"line 1, column 11\): alias \*a is inside the node &a"),
        ("x: &a [1, [2, *a]]", "a cycle"),
        ("[" * 101 + "]" * 101, "nests deeper than 100 levels"),
        ("a: " + "9" * 5000, r"line 1, column 4\): an integer of 5000 characters"),
        ("d: 2001-13-45", "month must be in 1..12"),
        ("a: *nothing", "undefined alias"),
        ("a: 1\nb: \x00", r"line 2, column 4\): unacceptable character #x0000"),
        ("a: !!python/object:os.system x", "could not determine a constructor"),
    ],
)
def test_hostile_yaml_is_a_format_error_naming_the_place(text, match):
    with pytest.raises(FormatError, match=r"^f\.yaml: not valid YAML.*" + match):
        bounded.parse_yaml(text, "f.yaml")


def test_aliases_within_the_limit_still_load():
    doc = bounded.parse_yaml("base: &b {lr: 0.1, steps: 3}\nrun: *b\n", "f.yaml")
    assert doc == {"base": {"lr": 0.1, "steps": 3}, "run": {"lr": 0.1, "steps": 3}}
    # 9 ** 4 = 6561 expanded nodes is within MAX_ALIAS_NODES
    assert len(bounded.parse_yaml(alias_bomb(levels=4), "f.yaml")["d"]) == 9


def test_files_are_checked_for_size_and_utf8_before_parsing(tmp_path):
    big = tmp_path / "big.yaml"
    with open(big, "wb") as f:
        f.truncate(bounded.MAX_CONFIG_BYTES + 1)
    with pytest.raises(
        FormatError, match=r"big\.yaml: [\d,]+ bytes is over the file limit"
    ):
        bounded.read_yaml(big)
    bad = tmp_path / "bad.yaml"
    bad.write_bytes(b"a: 1\nb: caf\xe9\n")
    with pytest.raises(FormatError, match=r"bad\.yaml line 2, column 7: not UTF-8"):
        bounded.read_yaml(bad)
    with pytest.raises(FormatError, match="no such file"):
        bounded.read_json(tmp_path / "missing.json")


@pytest.mark.parametrize(
    ("text", "match"),
    [
        (
            '{"a": ' + "9" * 5000 + "}",
            r"line 1, column 7: invalid JSON \(an integer of 5000",
        ),
        (
            '{"a":\n  [' + "[" * 100 + "]" * 101 + "}",
            r"line 2, column 102: invalid JSON \(nests",
        ),
        ('{"a": [1, 2}', r"line 1, column 12: invalid JSON \(Expecting"),
    ],
)
def test_hostile_json_names_line_and_column(text, match):
    with pytest.raises(FormatError, match=r"^f\.json " + match):
        bounded.parse_json(text, "f.json")


def test_json_brackets_inside_strings_do_not_count():
    text = '{"a": "' + "[" * 500 + '\\"]"}'
    assert bounded.parse_json(text, "f.json") == {"a": "[" * 500 + '"]'}


@pytest.mark.parametrize(
    ("text", "match"),
    [
        # an unterminated string of escaped quotes (then brackets, so the depth is
        # scanned): the token regex restarted at each quote, an hour for 1 MiB
        ('"' + '\\"' * 500_000 + "[" * 20, r"column 1: invalid JSON \(Unterminated"),
        # runs of 4300 digits before a longer one: the integer regex rescanned
        # each run from each of its digits, 12 s of CPU for 1 MiB
        (
            "[" + ("9" * 4300 + ",") * 240 + "9" * 4301 + "]",
            r"column 1032242: invalid JSON \(an integer of 4301 digits",
        ),
    ],
)
def test_json_limits_scan_a_hostile_megabyte_in_linear_time(text, match, deadline):
    start = time.process_time()
    with deadline(20), pytest.raises(FormatError, match=r"^f\.json line 1, " + match):
        bounded.parse_json(text, "f.json", max_depth=16)
    assert time.process_time() - start < 1.0


def test_json_deeper_than_python_parses_without_a_depth_limit():
    text = "[" * 100_000 + "]" * 100_000
    with pytest.raises(FormatError, match=r"invalid JSON \(nests too deeply"):
        bounded.parse_json(text, "f.json", max_depth=None)


def test_model_files_refuse_alias_bombs_deep_nesting_and_big_ints(tmp_path, deadline):
    p = tmp_path / "m.yaml"
    p.write_text("format: entrenar.model\nformat_version: 1\n" + alias_bomb())
    with deadline(5), pytest.raises(FormatError, match=r"m\.yaml.*alias bomb"):
        io.load_yaml(p)
    p.write_text("x: &a {y: *a}\n")
    with pytest.raises(FormatError, match=r"m\.yaml.*a cycle"):
        io.load_yaml(p)
    j = tmp_path / "m.json"
    j.write_text('{"format": "entrenar.model",\n "x": ' + "1" * 5000 + "}")
    with pytest.raises(
        FormatError, match=r"m\.json line 2, column 7: invalid JSON \(an int"
    ):
        io.load_json(j)
    j.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(
        FormatError, match=r"m\.json line 1, column \d+: invalid JSON \(nests"
    ):
        io.load_json(j)
