"""Hostile data files: a FormatError naming the file, line and column, never a crash."""

from __future__ import annotations

import re

import pytest

from entrenar.data import load_records, read_csv, read_jsonl
from entrenar.errors import FormatError


@pytest.mark.parametrize(
    ("line", "match"),
    [
        ('{"x": ' + "7" * 5000 + "}", r"column 7: invalid JSON \(an integer of 5000"),
        ('{"x": ' + "[" * 100_000 + "]" * 100_000 + "}", r"column \d+: invalid JSON"),
        ('{"x": ' + "[" * 150 + "]" * 150 + "}", r"column 106: .*deeper than 100"),
        ('{"x": tru}', r"column 7: invalid JSON \(Expecting value, near"),
    ],
)
def test_jsonl_limits_name_the_true_line_and_column(tmp_path, line, match):
    p = tmp_path / "d.jsonl"
    p.write_text('{"x": 1}\n\n' + line + "\n")
    with pytest.raises(FormatError, match=r"d\.jsonl line 3, " + match):
        read_jsonl(p)


def test_brackets_in_strings_are_not_nesting(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text('{"x": "' + "[{" * 200 + '"}\n')
    assert read_jsonl(p).rows == [{"x": "[{" * 200}]


@pytest.mark.parametrize(
    ("name", "data", "match"),
    [
        ("d.jsonl", b'{"x": 1}\n{"x": "caf\xe9"}\n', r"line 2, column 11: not UTF-8"),
        ("d.csv", b"x,y\n1,2\n3,\xff\xfe\n", r"line 3, column 3: not UTF-8"),
        (
            "d.json",
            b'\xef\xbb\xbf{"x": 1}\n{"x": \xc3}\n',
            "line 2, column 7",
        ),
    ],
)
def test_invalid_utf8_names_the_line_and_column(tmp_path, name, data, match):
    p = tmp_path / name
    p.write_bytes(data)
    with pytest.raises(FormatError, match=re.escape(name) + " " + match):
        load_records(p)


def test_a_valid_csv_with_a_bom_and_non_ascii_still_reads(tmp_path):
    """A BOM (Excel's "CSV UTF-8") is not part of the first column's name.

    The test wrote no BOM ("utf-8" adds none) and the reader kept one: the first
    column of such a file was named "\ufeffx", so asking for "x" failed.
    """
    p = tmp_path / "d.csv"
    for encoding in ("utf-8", "utf-8-sig"):
        p.write_text("x,y\ncafé,2\n", encoding=encoding)
        assert read_csv(p, columns=["x"]).rows == [{"x": "café", "y": "2"}]


@pytest.mark.parametrize("arrow_schema", [True, False])
def test_a_parquet_dictionary_bomb_is_refused_before_it_expands(tmp_path, arrow_schema):
    """1,000 rows naming one 10 kB string: 2 kB of footer sizes, 10 MB as strings."""
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    import numpy as np

    rows = pa.DictionaryArray.from_arrays(
        pa.array(np.zeros(1000, np.int32)), pa.array(["x" * 10_000])
    )
    p = tmp_path / "bomb.parquet"
    pq.write_table(pa.table({"text": rows}), p, store_schema=arrow_schema)
    md = pq.ParquetFile(p).metadata
    assert md.row_group(0).total_byte_size < 100_000  # what the footer declares
    with pytest.raises(FormatError, match="dictionaries are expanded") as e:
        load_records(p, max_bytes=1_000_000)
    assert str(p) in str(e.value)
    assert len(load_records(p, max_bytes=20_000_000)) == 1000


@pytest.mark.parametrize("seq_len", [2**40, 2**63])
@pytest.mark.parametrize("rows", ["pad_rows", "pack_rows"])
def test_a_huge_seq_len_is_refused_before_numpy_allocates(seq_len, rows, deadline):
    """``data.seq_len: 1099511627776`` in a run config: every row is seq_len long."""
    import numpy as np

    from entrenar import data
    from entrenar.errors import ShapeError

    docs = [(np.arange(1, 4), np.arange(1, 4)) for _ in range(1000)]
    with deadline(10), pytest.raises(ShapeError, match=r"seq_len=.* GiB, more than"):
        getattr(data, rows)(docs, seq_len)
