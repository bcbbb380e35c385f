"""Rows of token ids: right padding, or packing several documents per row.

Both turn tokenized documents (``(ids, labels)`` pairs, `entrenar.data.formatting`)
into arrays of ``N`` rows of ``T = seq_len`` tokens with the conventions' keys:

- ``input_ids`` ``(N, T)`` int32, ``pad_id`` after the last document;
- ``labels`` ``(N, T)`` int32, ``-100`` at padding and at every document's first
  token (no token of one document is ever the target of another's);
- ``attention_mask`` ``(N, T)`` bool, False at padding.

Packing adds ``segment_ids`` ``(N, T)`` int32 (1, 2, ... for the documents of a row,
0 at padding) and ``positions`` ``(N, T)`` int32 (0, 1, ... restarting at each
document), which `entrenar.nn.LlamaConfig.apply` takes so that a packed document
attends only to itself and gets the rotary positions it would get alone. Rows are
filled by best-fit decreasing: documents, longest first, each go into the row whose
free space fits it most tightly (a new row when none does). The result depends only
on the documents.

A document longer than ``T`` is truncated (``overflow="truncate"``), cut into pieces
of ``T`` tokens that become documents of their own (``"split"``), or refused
(``"error"``).
"""

from __future__ import annotations

import bisect
import os
from collections.abc import Sequence
from typing import Literal

import numpy as np

from entrenar.errors import ConfigError, ShapeError
from entrenar.nn.losses import IGNORE_INDEX

Overflow = Literal["truncate", "split", "error"]
Document = tuple[np.ndarray, np.ndarray]


def fit_documents(
    docs: Sequence[Document], seq_len: int, overflow: Overflow = "truncate"
) -> list[Document]:
    """Documents of at most ``seq_len`` tokens (empty ones dropped), see module doc."""
    if int(seq_len) < 1:
        raise ConfigError(f"seq_len must be at least 1, got {seq_len}")
    if overflow not in ("truncate", "split", "error"):
        raise ConfigError(f"overflow must be truncate, split or error: {overflow!r}")
    out = []
    for j, (ids, labels) in enumerate(docs):
        ids, labels = np.asarray(ids, np.int32), np.asarray(labels, np.int32)
        if ids.shape != labels.shape or ids.ndim != 1:
            raise ShapeError(
                f"document {j}: ids {ids.shape} and labels {labels.shape} must be "
                "equal 1-D shapes"
            )
        if len(ids) > seq_len and overflow == "error":
            raise ShapeError(
                f"document {j} has {len(ids)} tokens, more than seq_len={seq_len}; "
                "raise seq_len or let overflow be 'truncate' or 'split' "
                "(data.seq_len, data.overflow in a run config)"
            )
        cuts = range(0, len(ids), seq_len) if overflow == "split" else [0]
        for a in cuts:
            if len(ids[a : a + seq_len]):
                out.append((ids[a : a + seq_len], labels[a : a + seq_len]))
    return out


def _physical_memory() -> int:
    """Bytes of memory this machine has (0 when the platform does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def _empty(
    n: int, seq_len: int, pad_id: int, per_token: int = 9
) -> dict[str, np.ndarray]:
    """The padded arrays of ``n`` rows, each row ``seq_len`` tokens.

    Every row is ``seq_len`` long however short its documents, ``per_token`` bytes a
    token (int32 ids and labels, a bool mask; packing adds two int32 arrays), so a
    ``seq_len`` of 10**9 asks terabytes of a small file: more than the machine has
    is a `ShapeError`, before numpy tries.
    """
    need, have = n * seq_len * per_token, _physical_memory()
    if have and need > have:
        raise ShapeError(
            f"{n:,} rows of seq_len={seq_len:,} tokens need {need / 2**30:,.1f} GiB, "
            f"more than this machine's {have / 2**30:,.1f} GiB of memory; lower "
            "seq_len (data.seq_len in a run config) to the longest example"
        )
    return {
        "input_ids": np.full((n, seq_len), pad_id, np.int32),
        "labels": np.full((n, seq_len), IGNORE_INDEX, np.int32),
        "attention_mask": np.zeros((n, seq_len), bool),
    }


def pad_rows(
    docs: Sequence[Document],
    seq_len: int,
    *,
    pad_id: int = 0,
    overflow: Overflow = "truncate",
) -> dict[str, np.ndarray]:
    """One document per row, right-padded to ``seq_len``.

    >>> d = [(np.array([5, 6]), np.array([5, 6])), (np.array([7]), np.array([7]))]
    >>> r = pad_rows(d, 3, pad_id=0)
    >>> r["input_ids"].tolist(), r["labels"].tolist()
    ([[5, 6, 0], [7, 0, 0]], [[-100, 6, -100], [-100, -100, -100]])
    """
    docs = fit_documents(docs, seq_len, overflow)
    out = _empty(len(docs), seq_len, pad_id)
    for r, (ids, labels) in enumerate(docs):
        n = len(ids)
        out["input_ids"][r, :n] = ids
        out["labels"][r, 1:n] = labels[1:]
        out["attention_mask"][r, :n] = True
    return out


def pack_rows(
    docs: Sequence[Document],
    seq_len: int,
    *,
    pad_id: int = 0,
    overflow: Overflow = "truncate",
) -> dict[str, np.ndarray]:
    """Several documents per row (best-fit decreasing), with segment ids and positions.

    >>> d = [(np.array([1, 2, 3]), np.array([1, 2, 3])), (np.array([4]), np.array([4]))]
    >>> r = pack_rows(d, 5, pad_id=0)
    >>> r["input_ids"].tolist(), r["segment_ids"].tolist(), r["positions"].tolist()
    ([[1, 2, 3, 4, 0]], [[1, 1, 1, 2, 0]], [[0, 1, 2, 0, 0]])
    >>> r["labels"].tolist()
    [[-100, 2, 3, -100, -100]]
    """
    docs = fit_documents(docs, seq_len, overflow)
    order = sorted(range(len(docs)), key=lambda j: (-len(docs[j][0]), j))
    rows: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (free tokens, row), sorted
    for j in order:
        n = len(docs[j][0])
        k = bisect.bisect_left(free, (n, -1))
        if k == len(free):
            rows.append([j])
            room, row = seq_len - n, len(rows) - 1
        else:
            room, row = free.pop(k)
            rows[row].append(j)
            room -= n
        if room > 0:
            bisect.insort(free, (room, row))
    out = _empty(len(rows), seq_len, pad_id, per_token=17)
    out["segment_ids"] = np.zeros((len(rows), seq_len), np.int32)
    out["positions"] = np.zeros((len(rows), seq_len), np.int32)
    for r, members in enumerate(rows):
        at = 0
        for s, j in enumerate(sorted(members), start=1):
            ids, labels = docs[j]
            n = len(ids)
            out["input_ids"][r, at : at + n] = ids
            out["labels"][r, at + 1 : at + n] = labels[1:]
            out["attention_mask"][r, at : at + n] = True
            out["segment_ids"][r, at : at + n] = s
            out["positions"][r, at : at + n] = np.arange(n, dtype=np.int32)
            at += n
    return out


__all__ = ["IGNORE_INDEX", "Overflow", "fit_documents", "pack_rows", "pad_rows"]
