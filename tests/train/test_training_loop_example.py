"""examples/training_loop.py runs as a user would run it and meets its thresholds."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]


@pytest.mark.slow
def test_training_loop_example(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "training_loop.py"), "--out",
         str(tmp_path)],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
        env=dict(os.environ, JAX_PLATFORMS="cpu"),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    acc = float(re.search(r"test accuracy (\d+\.\d)%", proc.stdout).group(1))
    assert acc >= 95.0, proc.stdout
    assert "resumed run identical: True" in proc.stdout
    assert (tmp_path / "full" / "loss.png").stat().st_size > 10_000
    assert (tmp_path / "full" / "metrics.jsonl").exists()
