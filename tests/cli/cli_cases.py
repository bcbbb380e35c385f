"""A tiny wine run config for the command line tests."""

from __future__ import annotations

from pathlib import Path

import yaml

REPO = Path(__file__).parents[2]
WINE = REPO / "examples" / "data" / "wine"
CONFIGS = REPO / "examples" / "configs"
MODELS = REPO / "examples" / "models"
WORDS = REPO / "examples" / "data" / "number_words"


def write_tiny_config(tmp_path: Path) -> Path:
    """A 4-step wine MLP run writing to tmp/run."""
    doc = {
        "model": {"architecture": "mlp", "config": {"sizes": [13, 8, 3]}},
        "data": {
            "train": str(WINE / "train.parquet"),
            "validation": str(WINE / "validation.parquet"),
            "target": "cultivar",
            "batch_size": 16,
        },
        "optimizer": {"name": "adam", "lr": 0.01},
        "training": {
            "max_steps": 4,
            "checkpoint_every": 2,
            "log_every": 1,
            "output_dir": str(tmp_path / "run"),
        },
    }
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path
