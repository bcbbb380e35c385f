"""Every example runs end to end (in a subprocess, as a user would run it)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from entrenar.io import ModelFormat

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
    # folding the adapter into the float32 base changes the logits by rounding only
    diff = float(re.search(r"merged vs adapted logits: max \|diff\| = (\S+)", out)[1])
    assert diff < 1e-4, out
    assert "reloaded logits identical: True" in out


@pytest.mark.slow
def test_finetune_qlora_example(tmp_path):
    out = run_example("finetune_qlora.py", "--steps", "8", "--out", str(tmp_path / "q"))
    assert (tmp_path / "q" / "adapter_config.json").exists()
    assert len(re.findall(r"final loss \d+\.\d+", out)) == 2, out  # LoRA, then QLoRA
    # the 4-bit base trains as well as the float32 one (0.9973 at the default steps)
    ratio = float(re.search(r"QLoRA / LoRA final loss: (\S+)", out)[1])
    assert 0.9 <= ratio <= 1.1, out
    assert "max |err|" in out and "(PEFT layout)" in out, out


@pytest.mark.slow
def test_model_io_example():
    out = run_example("model_io.py")
    # every format keeps the metadata and the weights exactly
    rows = re.findall(r"metadata kept: (\w+)  exact: (\w+)", out)
    assert len(rows) == len(ModelFormat) and all(r == ("True", "True") for r in rows)
    assert re.search(r"loaded SmolLM2\S*\.gguf .*30 layers, D=576, V=49152", out), out
    # written back as Q4_1 with Q8_0 embeddings, as the source: the same bytes
    assert re.search(r"all \d+ tensors identical to the source: True", out), out
