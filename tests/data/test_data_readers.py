"""JSONL, CSV and Parquet files written here load; bad rows and columns are named."""

import csv
import json

import numpy as np
import pytest

from entrenar.data import (
    encode_records,
    load_records,
    read_csv,
    read_jsonl,
    read_parquet,
    to_arrays,
)
from entrenar.errors import FormatError, UnsupportedError
from entrenar.io import BPETokenizer

ROWS = [
    {"text": "hello, world", "label": 1, "score": 0.5},
    {"text": 'quotes " and, commas\nand a newline', "label": 0, "score": -2.0},
    {"text": "ünïcödé 日本語 😀", "label": 1, "score": 3.25},
]


def _write_jsonl(path, rows):
    with open(path, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")


def _write_csv(path, rows):
    with open(path, "w", encoding="utf-8", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


def _write_parquet(path, rows):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    pq.write_table(pa.Table.from_pylist(rows), path)


def test_jsonl_loads(tmp_path):
    p = tmp_path / "d.jsonl"
    _write_jsonl(p, ROWS)
    with open(p, "a") as f:
        f.write("\n   \n")  # blank lines are skipped
    recs = read_jsonl(p, columns=["text"])
    assert recs.rows == ROWS and recs.row_numbers == [1, 2, 3]
    assert load_records(p).rows == ROWS
    assert recs.where(2, "text") == f"{p} line 3, column 'text'"


def test_csv_loads_strings(tmp_path):
    p = tmp_path / "d.csv"
    _write_csv(p, ROWS)
    recs = read_csv(p, columns=["text", "label"])
    assert [r["text"] for r in recs] == [r["text"] for r in ROWS]
    assert recs[0] == {"text": "hello, world", "label": "1", "score": "0.5"}
    arrays = to_arrays(recs, {"x": ["label", "score"], "y": "label"})
    np.testing.assert_array_equal(arrays["x"], [[1, 0.5], [0, -2.0], [1, 3.25]])
    assert arrays["y"].dtype == np.float32 and arrays["y"].shape == (3,)


def test_parquet_loads(tmp_path):
    p = tmp_path / "d.parquet"
    _write_parquet(p, ROWS)
    assert read_parquet(p).rows == ROWS
    assert load_records(p, columns=["score"]).rows == [
        {"score": r["score"]} for r in ROWS
    ]


def test_jsonl_bad_rows_name_file_and_line(tmp_path):
    p = tmp_path / "bad.jsonl"
    p.write_text('{"text": "ok"}\n{"text": "broken\n')
    with pytest.raises(
        FormatError, match=r"bad\.jsonl line 2, column \d+: invalid JSON"
    ):
        read_jsonl(p)
    p.write_text('{"text": "ok"}\n[1, 2]\n')
    with pytest.raises(FormatError, match=r"bad\.jsonl line 2: expected a JSON object"):
        read_jsonl(p)
    p.write_text('{"text": "ok"}\n\n{"body": "x"}\n')
    with pytest.raises(FormatError, match=r"bad\.jsonl line 3, column 'text': missing"):
        read_jsonl(p, columns=["text"])


def test_jsonl_error_gives_the_true_column(tmp_path):
    # A line cut short at column 89 (88 characters), and an error mid-line.
    good = '{"messages": [{"role": "user", "content": "Write this date: the 13th"}]}'
    cut = good[:-2] + ", "  # the rest of the line is lost
    cut = cut.replace("the 13th", "the 13th" + "!" * (88 - len(cut)))
    assert len(cut) == 88
    p = tmp_path / "cut.jsonl"
    p.write_text(good + "\n" + cut + "\n")
    with pytest.raises(FormatError, match=r"cut\.jsonl line 2, column 89: invalid"):
        read_jsonl(p)
    p.write_text(good + "\r\n" + '{"text": "x" "y"}\r\n')  # CRLF line ends
    with pytest.raises(FormatError, match=r"line 2, column 14: invalid JSON"):
        read_jsonl(p)


def test_jsonl_lines_end_only_at_newlines(tmp_path):
    # A carriage return is JSON whitespace, not a line end; a BOM is skipped.
    p = tmp_path / "cr.jsonl"
    p.write_bytes(b'\xef\xbb\xbf{"text": "a",\r"label": 1}\n{"text": "b"}\n')
    recs = read_jsonl(p)
    assert recs.rows == [{"text": "a", "label": 1}, {"text": "b"}]
    assert recs.row_numbers == [1, 2]


def test_csv_bad_rows_name_file_row_column(tmp_path):
    p = tmp_path / "bad.csv"
    p.write_text("text,label,score\na,1,0.5\nb,0\n")
    with pytest.raises(FormatError, match=r"bad\.csv row 2: column 'score' is missing"):
        read_csv(p)
    p.write_text("text,label\na,1,9\n")
    with pytest.raises(
        FormatError, match=r"bad\.csv row 1: 1 field\(s\) past the header"
    ):
        read_csv(p)
    p.write_text("text,label\na,1\n")
    with pytest.raises(FormatError, match=r"bad\.csv: missing column 'score'"):
        read_csv(p, columns=["text", "score"])
    p.write_text("text,label\na,1\nb,x\n")
    with pytest.raises(
        FormatError, match=r"bad\.csv row 2, column 'label': 'x' is not"
    ):
        to_arrays(read_csv(p), {"y": "label"})


def test_parquet_bad_column_and_null(tmp_path):
    p = tmp_path / "bad.parquet"
    _write_parquet(p, [{"text": "a"}, {"text": None}])
    with pytest.raises(FormatError, match=r"bad\.parquet: missing column 'prompt'"):
        read_parquet(p, columns=["prompt"])
    with pytest.raises(FormatError, match=r"bad\.parquet row 2, column 'text': null"):
        read_parquet(p, columns=["text"])
    p.write_bytes(b"PAR1 this is not parquet PAR1")
    with pytest.raises(FormatError, match=r"bad\.parquet: not a readable Parquet"):
        read_parquet(p)


def test_wrong_field_type_names_file_row_column(tmp_path):
    p = tmp_path / "d.jsonl"
    _write_jsonl(p, [{"text": "fine"}, {"text": 42}])
    tok = BPETokenizer(tokens=tuple("abcdefghijklmnopqrstuvwxyz"), merges=(),
                       token_types=(1,) * 26, eos_id=0)  # fmt: skip
    with pytest.raises(
        FormatError, match=r"d\.jsonl line 2, column 'text': expected str"
    ):
        encode_records(load_records(p), tok, format="text")
    _write_jsonl(p, [{"prompt": "a"}])
    with pytest.raises(FormatError, match=r"line 1, column 'completion': missing"):
        encode_records(load_records(p), tok, format="prompt_completion")


def test_size_checked_before_reading(tmp_path):
    p = tmp_path / "big.jsonl"
    _write_jsonl(p, ROWS * 10)
    with pytest.raises(FormatError, match=r"big\.jsonl: \d+ bytes is over the limit"):
        read_jsonl(p, max_bytes=100)
    q = tmp_path / "big.parquet"
    # Compresses well: small on disk, large once decoded.
    _write_parquet(q, [{"text": "x" * 100_000} for _ in range(50)])
    size = q.stat().st_size
    with pytest.raises(FormatError, match="uncompressed is over the limit"):
        read_parquet(q, max_bytes=size + 1000)
    with pytest.raises(FormatError, match="no such file"):
        read_csv(tmp_path / "absent.csv")
    with pytest.raises(UnsupportedError, match=r"\.txt"):
        load_records(tmp_path / "notes.txt")


def test_long_csv_field_and_nested_parquet(tmp_path):
    p = tmp_path / "long.csv"
    _write_csv(p, [{"text": "w " * 200_000}])  # 400 kB, over csv's default limit
    assert len(read_csv(p)[0]["text"]) == 400_000
    assert csv.field_size_limit() == 131072  # the process-wide limit restored
    q = tmp_path / "chat.parquet"
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    _write_parquet(q, [{"messages": msgs}])
    assert read_parquet(q, columns=["messages"]).rows == [{"messages": msgs}]
