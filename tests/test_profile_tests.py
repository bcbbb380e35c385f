"""``tools/profile_tests.py``'s summary, on its own lines and on older ones."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def profile_tool() -> Any:
    """``tools/profile_tests.py`` as a module (its `summary`, its `read_records`)."""
    spec = importlib.util.spec_from_file_location(
        "profile_tests", REPO / "tools" / "profile_tests.py"
    )
    assert spec is not None and spec.loader is not None
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    return tool


def test_summary_reads_lines_without_the_compile_figures_as_zero(tmp_path, capsys):
    """An earlier plugin wrote no trace/lower/compile/hits/misses: KeyError before."""
    tool = profile_tool()
    new = {"id": "tests/a.py::t1", "wall": 2.0, "cpu": 1.0, "child": 0.5}
    new |= {"trace": 0.25, "lower": 0.25, "compile": 3.0, "hits": 1, "misses": 2}
    old = {"id": "tests/b.py::t2", "wall": 4.0, "cpu": 3.0, "child": 0.0}
    old |= {"maps0": 1706, "t": 1796607070.9, "slow": True}  # keys it no longer has
    (tmp_path / "gw0.jsonl").write_text(json.dumps(new) + "\n\n")
    (tmp_path / "gw1.jsonl").write_text(json.dumps(old) + "\n")
    tool.summary(sorted(str(p) for p in tmp_path.glob("*.jsonl")))
    out = capsys.readouterr().out.splitlines()
    assert out[0] == (
        "2 tests wall 6 cpu 4 child 0 trace 0 lower 0 compile 3 hits 1 misses 2"
    )
    rows = {line.split()[0]: line.split()[1:] for line in out[2:4]}
    assert rows["tests/b.py"] == ["1", "4", "3", "0", "0", "0", "0", "0", "0"]
    assert out[-2:] == [
        "    3.0     0.0 tests/b.py::t2",
        "    1.5     3.0 tests/a.py::t1",
    ]
