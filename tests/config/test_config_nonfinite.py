"""A tabular run whose data holds a NaN cell stops before training, naming the cell."""

import json
import os

import pytest
import yaml
from click.testing import CliRunner

from entrenar.cli import cli

ROWS = [[0.5 * i, 1.0 - 0.1 * i, i % 2] for i in range(12)]


def _config(tmp_path, bad_cell):
    rows = [list(map(str, r)) for r in ROWS]
    rows[7][1] = bad_cell
    data = tmp_path / "d.csv"
    data.write_text("f1,f2,label\n" + "".join(",".join(r) + "\n" for r in rows))
    doc = {
        "model": {"architecture": "mlp", "config": {"sizes": [2, 4, 2]}},
        "data": {"train": str(data), "target": "label", "batch_size": 4},
        "optimizer": {"name": "adam", "lr": 0.01},
        "training": {"max_steps": 2, "output_dir": str(tmp_path / "run")},
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path, data


@pytest.mark.parametrize("command", ["train", "validate"])
@pytest.mark.parametrize("cell", ["nan", "inf"])
def test_a_nan_cell_is_refused_before_training(tmp_path, command, cell):
    path, data = _config(tmp_path, cell)
    result = CliRunner().invoke(cli, [command, str(path)])
    assert result.exit_code == 2, result.output
    line = result.output.strip().splitlines()[-1]
    assert line == (
        f"error: {data} row 8, column 'f2': '{cell}' is not a finite number (NaN, "
        "infinite or too large for float32); fix or drop the row"
    )
    metrics = tmp_path / "run" / "metrics.jsonl"
    assert not os.path.exists(metrics) or not [
        json.loads(x) for x in metrics.read_text().splitlines() if '"loss"' in x
    ]
