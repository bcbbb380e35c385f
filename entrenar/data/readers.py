"""Records from JSONL, CSV and Parquet files, and arrays from records.

A record is a dict from column name to value. `Records` keeps the file each one came
from and its row number, so an error later (a missing field, a wrong type) names the
file, the row and the column. Row numbers are 1-based: the line for JSONL, the data
row (after the header) for CSV and Parquet.

Every reader checks the file's size against ``max_bytes`` before reading it; Parquet
also checks the uncompressed size its footer declares, and the size of its values with
dictionary-encoded strings expanded (a dictionary column names one entry per row, so a
small file can hold gigabytes of repeated text), so a small hostile file cannot expand
into memory. `READERS` holds the reader of each file extension: adding a file
type is one ``@READERS.register(".ext")``.
"""

from __future__ import annotations

import csv
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from entrenar.errors import FormatError, UnsupportedError
from entrenar.io.bounded import parse_json
from entrenar.schema import Registry

MAX_BYTES = 4 << 30
"""Default size limit of a data file (4 GiB)."""

READERS: Registry[Callable[..., Records]] = Registry("data file type")
"""File extension -> ``reader(path, *, columns, max_bytes) -> Records`` (``.ndjson``
and ``.json`` are JSON Lines too, read by `read_jsonl`)."""


@dataclass(frozen=True)
class Records(Sequence[dict[str, Any]]):
    """Rows of a file: a sequence of dicts that remembers where each came from.

    Attributes:
        rows: the records.
        source: the file (or a description such as ``"<records>"``).
        row_numbers: the 1-based row (or line) number of each record in ``source``.
        unit: ``"line"`` (JSONL) or ``"row"``.
    """

    rows: list[dict[str, Any]]
    source: str = "<records>"
    row_numbers: list[int] = field(default_factory=list)
    unit: str = "record"

    @classmethod
    def wrap(cls, records: Sequence[Mapping[str, Any]] | Records) -> Records:
        """``records`` as `Records` (in-memory dicts are numbered from 1)."""
        if isinstance(records, Records):
            return records
        return cls([dict(r) if isinstance(r, Mapping) else r for r in records])

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: Any) -> Any:
        return self.rows[i]

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return iter(self.rows)

    def where(self, i: int, column: str | None = None) -> str:
        """``"file.jsonl line 3, column 'text'"`` for record ``i``."""
        n = self.row_numbers[i] if self.row_numbers else i + 1
        col = "" if column is None else f", column {column!r}"
        return f"{self.source} {self.unit} {n}{col}"

    def value(self, i: int, column: str, kind: type | tuple[type, ...]) -> Any:
        """Record ``i``'s ``column``, checked to be of ``kind``."""
        row = self.rows[i]
        if not isinstance(row, Mapping):
            raise FormatError(
                f"{self.where(i)}: expected an object with named fields, got "
                f"{type(row).__name__}"
            )
        if column not in row:
            raise FormatError(
                f"{self.where(i, column)}: missing; the row has {sorted(row)}"
            )
        value = row[column]
        if not isinstance(value, kind):
            names = kind if isinstance(kind, tuple) else (kind,)
            want = " or ".join(k.__name__ for k in names)
            raise FormatError(
                f"{self.where(i, column)}: expected {want}, got "
                f"{type(value).__name__} {str(value)[:40]!r}"
            )
        return value


def _check_size(path: str, max_bytes: int) -> None:
    if not os.path.isfile(path):
        raise FormatError(f"{path}: no such file")
    size = os.path.getsize(path)
    if size > max_bytes:
        raise FormatError(
            f"{path}: {size} bytes is over the limit of {max_bytes}; pass a larger "
            "max_bytes if the file is trusted"
        )


def _require(recs: Records, columns: Sequence[str] | None) -> Records:
    for i in range(len(recs)):
        for c in columns or ():
            recs.value(i, c, object)
    return recs


def parse_json_line(line: str, path: str, n: int) -> Any:
    r"""The JSON value of line ``n`` of ``path`` (its line end is ignored).

    An invalid line is a `FormatError` ``"<path> line <n>, column <c>: invalid JSON
    (<reason>, near '<text>')"``. The line is parsed without its line end, so an
    error at its end (a line cut short) is at the column after its last character,
    not at column 1 of a next line. The limits of `entrenar.io.bounded.parse_json`
    apply: nesting at most `MAX_DEPTH` deep, integers of at most `MAX_INT_DIGITS`
    digits.

    >>> parse_json_line('{"a": 1}\n', "d.jsonl", 1)
    {'a': 1}
    """
    return parse_json(line.rstrip("\r\n"), path, first_line=n)


def _not_utf8(path: str) -> FormatError:
    """The error for a text file that is not UTF-8: its first bad line and column."""
    with open(path, "rb") as f:
        for n, line in enumerate(f, start=1):
            try:
                line.decode("utf-8")
            except UnicodeDecodeError as e:
                return FormatError(
                    f"{path} line {n}, column {e.start + 1}: not UTF-8 text (byte "
                    f"0x{line[e.start]:02x}); save the file as UTF-8"
                )
    return FormatError(f"{path}: not UTF-8 text; save the file as UTF-8")


@READERS.register(".json")
@READERS.register(".ndjson")
@READERS.register(".jsonl")
def read_jsonl(
    path: str | os.PathLike[str],
    *,
    columns: Sequence[str] | None = None,
    max_bytes: int = MAX_BYTES,
) -> Records:
    """One record per non-blank line of a JSON Lines file; each must be an object.

    Args:
        path: the file.
        columns: fields every record must have (else a `FormatError` naming the line).
        max_bytes: refuse larger files.
    """
    path = os.fspath(path)
    _check_size(path, max_bytes)
    rows, numbers = [], []
    # Lines end at "\n" only (a "\r" is JSON whitespace); a leading BOM is skipped.
    try:
        with open(path, encoding="utf-8-sig", newline="\n") as f:
            for n, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                row = parse_json_line(line, path, n)
                if not isinstance(row, dict):
                    raise FormatError(
                        f"{path} line {n}: expected a JSON object, got "
                        f"{type(row).__name__}"
                    )
                rows.append(row)
                numbers.append(n)
    except UnicodeDecodeError:
        raise _not_utf8(path) from None
    return _require(Records(rows, path, numbers, "line"), columns)


@READERS.register(".csv")
def read_csv(
    path: str | os.PathLike[str],
    *,
    columns: Sequence[str] | None = None,
    max_bytes: int = MAX_BYTES,
    delimiter: str = ",",
) -> Records:
    """Rows of a CSV file with a header line, values as strings.

    A row with more or fewer fields than the header is a `FormatError` naming the row
    and the first column it lacks (or that there is one field too many).
    """
    path = os.fspath(path)
    _check_size(path, max_bytes)
    # The csv module's per-field limit (128 KiB) is process-wide: lift it to the file
    # size while reading, then put it back.
    old = csv.field_size_limit(min(max(max_bytes, 1 << 17), 2**31 - 1))
    try:
        return _csv_records(path, columns, delimiter)
    except UnicodeDecodeError:
        raise _not_utf8(path) from None
    finally:
        csv.field_size_limit(old)


def _csv_records(path: str, columns: Sequence[str] | None, delimiter: str) -> Records:
    # utf-8-sig: a leading BOM (Excel's "CSV UTF-8") is not part of the first name
    with open(path, encoding="utf-8-sig", newline="") as f:
        reader = csv.reader(f, delimiter=delimiter)
        header = next(reader, None)
        if not header:
            raise FormatError(f"{path}: no header line")
        if len(set(header)) != len(header):
            raise FormatError(f"{path}: duplicate column names in header {header}")
        missing = [c for c in columns or () if c not in header]
        if missing:
            raise FormatError(
                f"{path}: missing column {missing[0]!r}; the header has {header}"
            )
        rows, numbers = [], []
        try:
            for n, values in enumerate(reader, start=1):
                if not values:
                    continue
                if len(values) != len(header):
                    col = header[len(values)] if len(values) < len(header) else None
                    what = (
                        f"column {col!r} is missing"
                        if col
                        else f"{len(values) - len(header)} field(s) past the header"
                    )
                    raise FormatError(
                        f"{path} row {n}: {what} ({len(values)} fields, the header "
                        f"has {len(header)})"
                    )
                rows.append(dict(zip(header, values)))
                numbers.append(n)
        except csv.Error as e:
            raise FormatError(f"{path} row {reader.line_num}: {e}") from None
    return Records(rows, path, numbers, "row")


@READERS.register(".parquet")
def read_parquet(
    path: str | os.PathLike[str],
    *,
    columns: Sequence[str] | None = None,
    max_bytes: int = MAX_BYTES,
) -> Records:
    """Rows of a Parquet file (pyarrow), optionally only ``columns``.

    A requested column the file lacks is a `FormatError`; a null in a requested column
    is one naming the row and column.
    """
    try:
        import pyarrow.parquet as pq
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise UnsupportedError(
            "reading Parquet needs pyarrow: pip install 'entrenar[data]'"
        ) from e
    path = os.fspath(path)
    _check_size(path, max_bytes)
    try:
        schema = pq.read_schema(path)
        # strings stay dictionary-encoded in memory until counted (_expanded_bytes)
        text = [f.name for f in schema if _is_text(f.type)]
        pf = pq.ParquetFile(path, read_dictionary=text)
    except Exception as e:  # pyarrow raises ArrowInvalid / OSError variants
        raise FormatError(f"{path}: not a readable Parquet file ({e})") from None
    names = pf.schema_arrow.names
    missing = [c for c in columns or () if c not in names]
    if missing:
        raise FormatError(
            f"{path}: missing column {missing[0]!r}; the file has {names}"
        )
    md = pf.metadata
    expanded = sum(md.row_group(g).total_byte_size for g in range(md.num_row_groups))
    if expanded > max_bytes:
        raise FormatError(
            f"{path}: {expanded} bytes uncompressed is over the limit of {max_bytes}"
        )
    try:
        table = pf.read(columns=list(columns) if columns else None)
    except Exception as e:
        raise FormatError(f"{path}: cannot read its data ({e})") from None
    expanded = _expanded_bytes(table)
    if expanded > max_bytes:
        raise FormatError(
            f"{path}: {expanded} bytes of values once its dictionaries are expanded "
            f"is over the limit of {max_bytes}"
        )
    rows = table.to_pylist()
    for c in columns or ():
        nulls = table.column(c).null_count
        if nulls:
            i = next(i for i, r in enumerate(rows) if r[c] is None)
            raise FormatError(f"{path} row {i + 1}, column {c!r}: null value")
    return Records(rows, path, list(range(1, len(rows) + 1)), "row")


def _is_text(t: Any) -> bool:
    """Whether Arrow type ``t`` holds strings or bytes (or a dictionary of them)."""
    import pyarrow as pa

    if pa.types.is_dictionary(t):
        t = t.value_type
    kinds = (pa.types.is_string, pa.types.is_large_string, pa.types.is_binary,
             pa.types.is_large_binary)  # fmt: skip
    return any(k(t) for k in kinds)


def _expanded_bytes(table: Any) -> int:
    """Bytes of ``table``'s values with each dictionary entry counted where used.

    A dictionary-encoded column of n rows that all name one 1 MB string is a few
    bytes per row in the file and in Arrow, but n MB as Python strings: its size is
    the sum over rows of the length of the entry each row names.
    """
    import pyarrow as pa
    import pyarrow.compute as pc

    total = 0
    for column in table.columns:
        for chunk in column.chunks:
            if not pa.types.is_dictionary(chunk.type):
                total += chunk.nbytes
                continue
            values = chunk.dictionary
            if _is_text(values.type):
                sizes = pc.binary_length(values)
                total += int(pc.sum(pc.take(sizes, chunk.indices)).as_py() or 0)
            else:  # fixed-width values: their width; others: the whole dictionary
                width = getattr(values.type, "bit_width", 0) // 8 or values.nbytes
                total += width * len(chunk)
            total += chunk.indices.nbytes
    return total


def load_records(
    path: str | os.PathLike[str],
    *,
    columns: Sequence[str] | None = None,
    max_bytes: int = MAX_BYTES,
) -> Records:
    r"""Records of a ``.jsonl``/``.ndjson``, ``.csv`` or ``.parquet`` file.

    >>> import os, tempfile
    >>> tmp = tempfile.TemporaryDirectory()  # removed with the object
    >>> p = os.path.join(tmp.name, "d.jsonl")
    >>> _ = open(p, "w").write('{"text": "hi"}\n')
    >>> load_records(p, columns=["text"]).rows
    [{'text': 'hi'}]
    """
    ext = os.path.splitext(os.fspath(path))[1].lower()
    if ext not in READERS:
        raise UnsupportedError(
            f"{os.fspath(path)}: unknown data file type {ext!r}; use one of "
            f"{', '.join(READERS)}"
        )
    return READERS[ext](path, columns=columns, max_bytes=max_bytes)


def to_arrays(
    records: Sequence[Mapping[str, Any]] | Records,
    columns: Mapping[str, str | Sequence[str]],
    *,
    dtype: Any = np.float32,
    finite: bool = True,
) -> dict[str, np.ndarray]:
    """Numeric arrays from records, e.g. ``{"x": ["f1", "f2"], "y": "label"}``.

    A column name gives an ``(N,)`` array; a list of names an ``(N, k)`` array. A value
    that does not convert to ``dtype`` is a `FormatError` naming file, row and column;
    so is, with ``finite`` (the default), a NaN or infinite value, or one too large
    for ``dtype`` (``"nan"``, ``"inf"``, ``1e39`` in float32): it would only surface
    later as a NaN loss.

    >>> to_arrays([{"a": "1", "b": 2}], {"x": ["a", "b"], "y": "b"})["x"].tolist()
    [[1.0, 2.0]]
    >>> to_arrays([{"a": "nan"}], {"x": ["a"]})
    Traceback (most recent call last):
    entrenar.errors.FormatError: <records> record 1, column 'a': 'nan' is not a finite number (NaN, infinite or too large for float32); fix or drop the row
    """  # noqa: E501
    recs = Records.wrap(records)
    # bfloat16 (numpy kind "V") parses no strings: they go through Python's float
    bf16 = np.dtype(dtype).name == "bfloat16"
    out = {}
    for key, cols in columns.items():
        names = [cols] if isinstance(cols, str) else list(cols)
        arr = np.empty((len(recs), len(names)), dtype)  # (N, k)
        for i in range(len(recs)):
            for j, c in enumerate(names):
                v = recs.value(i, c, object)
                try:
                    with np.errstate(over="ignore", invalid="ignore"):
                        # too large: inf, refused below
                        arr[i, j] = float(v) if bf16 and isinstance(v, str) else v
                except (TypeError, ValueError, OverflowError):
                    raise FormatError(
                        f"{recs.where(i, c)}: {str(v)[:40]!r} is not a "
                        f"{np.dtype(dtype).name} number"
                    ) from None
        if finite:
            _check_finite(arr, recs, names)
        out[key] = arr[:, 0] if isinstance(cols, str) else arr
    return out


def _check_finite(arr: np.ndarray, recs: Records, names: list[str]) -> None:
    """Refuse the first NaN or infinite value of ``arr: (N, k)``, by row and column."""
    if arr.dtype.kind not in "fc" and arr.dtype.name != "bfloat16":
        return
    bad = ~np.isfinite(arr)
    if not bad.any():
        return
    i, j = (int(k) for k in np.argwhere(bad)[0])
    v = recs.rows[i][names[j]]
    raise FormatError(
        f"{recs.where(i, names[j])}: {str(v)[:40]!r} is not a finite number (NaN, "
        f"infinite or too large for {arr.dtype.name}); fix or drop the row"
    )


__all__ = [
    "MAX_BYTES",
    "READERS",
    "Records",
    "load_records",
    "parse_json_line",
    "read_csv",
    "read_jsonl",
    "read_parquet",
    "to_arrays",
]
