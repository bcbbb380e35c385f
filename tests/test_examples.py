"""Every example runs end to end (in a subprocess, as a user would run it)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]


def run_example(name: str, *args: str, timeout: int = 600) -> str:
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / name), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=ROOT,
    )
    assert proc.returncode == 0, f"{name} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


@pytest.mark.slow
def test_first_training_loop_learns_xor():
    out = run_example("first_training_loop.py")
    acc = re.search(r"validation (\d+\.\d)%", out)
    assert acc and float(acc.group(1)) >= 95.0, out


@pytest.mark.slow
def test_finetune_lora_example(tmp_path):
    out = run_example("finetune_lora.py", "--steps", "8", "--out", str(tmp_path / "a"))
    assert (tmp_path / "a" / "adapter_config.json").exists()
    assert (tmp_path / "a" / "adapter_model.safetensors").exists()
    first, last = map(float, re.search(r"loss (\S+) -> (\S+)", out).groups())
    assert last < first, out
    assert "reloaded logits identical: True" in out


@pytest.mark.slow
def test_finetune_qlora_example(tmp_path):
    out = run_example("finetune_qlora.py", "--steps", "8", "--out", str(tmp_path / "q"))
    assert (tmp_path / "q" / "adapter_config.json").exists()
    assert "loss" in out.lower()


@pytest.mark.slow
def test_model_io_example():
    out = run_example("model_io.py")
    assert "SmolLM2" in out or "smollm" in out.lower()
