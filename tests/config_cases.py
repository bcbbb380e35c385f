"""Small run configs written to a temporary folder, over the shipped example data."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).parents[1]
WINE = REPO / "examples" / "data" / "wine"
WORDS = REPO / "examples" / "data" / "number_words"
CONFIGS = REPO / "examples" / "configs"


def wine_doc(out: Path, **sections: Any) -> dict[str, Any]:
    """A tiny wine MLP run (a few steps), sections replaced by ``sections``."""
    doc: dict[str, Any] = {
        "model": {"architecture": "mlp", "config": {"sizes": [13, 8, 3]}},
        "data": {
            "train": str(WINE / "train.parquet"),
            "validation": str(WINE / "validation.parquet"),
            "format": "tabular",
            "target": "cultivar",
            "batch_size": 16,
        },
        "optimizer": {"name": "adam", "lr": 0.01},
        "training": {
            "max_steps": 6,
            "checkpoint_every": 3,
            "eval_every": 3,
            "log_every": 1,
            "output_dir": str(out),
        },
    }
    doc.update(sections)
    return doc


def write(path: Path, doc: Any) -> Path:
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def wine_yaml_factory(tmp_path: Path):
    """``make(**sections) -> path`` of a tiny wine run writing to tmp/run."""

    def make(**sections: Any) -> Path:
        return write(tmp_path / "run.yaml", wine_doc(tmp_path / "run", **sections))

    return make
