"""examples/merge_models.py runs, and TIES keeps more than averaging."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]


@pytest.mark.slow
def test_merge_example_ties_beats_averaging():
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "merge_models.py"), "--seeds", "2"],
        capture_output=True,
        text=True,
        timeout=600,
        env=dict(os.environ, JAX_PLATFORMS="cpu"),
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    gain = re.search(r"TIES - averaging over 2 seeds: .* mean \+([0-9.]+)", proc.stdout)
    assert gain and float(gain.group(1)) >= 0.02
    assert "from a YAML recipe over safetensors" in proc.stdout
