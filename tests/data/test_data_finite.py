"""NaN and infinite feature values are refused by row and column, before training.

A NaN cell used to reach the Trainer and surface only as "the loss is NaN, lower the
learning rate".
"""

import numpy as np
import pytest

from entrenar.data import read_csv, read_jsonl, to_arrays
from entrenar.errors import FormatError


@pytest.mark.parametrize("cell", ["nan", "NaN", "inf", "-inf", "1e39", " nan "])
def test_csv_non_finite_cells_name_file_row_and_column(tmp_path, cell):
    path = tmp_path / "d.csv"
    path.write_text(f"a,b,y\n1,2,0\n3,{cell},1\n")
    with pytest.raises(FormatError) as e:
        to_arrays(read_csv(path), {"x": ["a", "b"], "y": "y"})
    assert str(e.value).startswith(
        f"{path} row 2, column 'b': {cell!r} is not a finite"
    )


def test_jsonl_nan_and_huge_numbers_name_the_line(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"a": 1, "y": 0}\n\n{"a": NaN, "y": 1}\n')
    with pytest.raises(FormatError, match=r"d\.jsonl line 3, column 'a': 'nan'"):
        to_arrays(read_jsonl(path), {"x": ["a"]})
    path.write_text('{"a": 1, "y": 0}\n{"a": 1, "y": 1e400}\n')
    with pytest.raises(FormatError, match=r"line 2, column 'y': 'inf'"):
        to_arrays(read_jsonl(path), {"y": "y"}, dtype=np.float64)
    path.write_text('{"a": 1, "y": ' + "9" * 400 + "}\n")
    with pytest.raises(FormatError, match=r"line 1, column 'y': '9999.*float32"):
        to_arrays(read_jsonl(path), {"y": "y"})


def test_finite_false_keeps_them_and_finite_values_pass():
    recs = [{"a": "nan", "b": 1}, {"a": 2.5, "b": True}]
    x = to_arrays(recs, {"x": ["a", "b"]}, finite=False)["x"]
    assert np.isnan(x[0, 0]) and x[1].tolist() == [2.5, 1.0]
    with pytest.raises(FormatError, match="record 1, column 'a'"):
        to_arrays(recs, {"x": ["a", "b"]})
    ints = to_arrays([{"a": 3}], {"a": "a"}, dtype=np.int32)["a"]
    assert ints.dtype == np.int32 and ints.tolist() == [3]


def test_bfloat16_arrays_parse_csv_cells_and_refuse_non_finite(tmp_path):
    """dtype=bfloat16 reads CSV strings and checks them like float32 does.

    ml_dtypes' bfloat16 (numpy kind "V") parses no strings, so every CSV cell was
    "not a bfloat16 number", and the finite check (kind "f" only) let NaN through.
    """
    bf16 = np.dtype("bfloat16")
    path = tmp_path / "d.csv"
    path.write_text("a,y\n1.5,0\n-2,1\n")
    x = to_arrays(read_csv(path), {"x": ["a"]}, dtype=bf16)["x"]
    assert x.dtype == bf16 and x[:, 0].astype(np.float32).tolist() == [1.5, -2.0]
    for cell in ("nan", "3.4e38"):  # the second overflows bfloat16 (max 3.39e38)
        path.write_text(f"a,y\n1,0\n{cell},1\n")
        with pytest.raises(FormatError, match=rf"row 2, column 'a': '{cell}' is not a"):
            to_arrays(read_csv(path), {"x": ["a"]}, dtype=bf16)
    with pytest.raises(FormatError, match="record 1, column 'a'"):
        to_arrays([{"a": float("nan")}], {"x": ["a"]}, dtype=bf16)
