"""`read_metrics`: a cut-short metrics.jsonl line is named with its true column."""

import pytest

from entrenar.errors import FormatError
from entrenar.train.plot import read_metrics


def test_a_cut_short_metrics_line_names_its_column(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 2.5}\n{"step": 2, ')
    with pytest.raises(FormatError, match=r"line 2, column 13: invalid JSON"):
        read_metrics(tmp_path)
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 2.5}\r\n')
    assert read_metrics(tmp_path) == [{"step": 1, "loss": 2.5}]
