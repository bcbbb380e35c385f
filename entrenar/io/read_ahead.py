"""Read a load's memory-mapped tensors from disk on a thread, ahead of the load.

A streaming load (`entrenar.nn.hf_names.stream_hf_names`,
`entrenar.io.load_llama_gguf`) copies and quantizes a tensor at a time from
memory-mapped files. Left to page faults, each tensor is read from the disk when
the load first touches it, the CPU idle meanwhile; one ``madvise(MADV_WILLNEED)``
a layer ahead (what a folder load did before) cost the loading thread 38 ms of
request submission at SmolLM2-135M and kept one layer in flight.

`ReadAhead` walks the tensors in the order the load will read them (the order a
shard stores them: `stream_hf_names` fills its stacked leaves a layer at a time),
on its own thread, `PIECE_BYTES` at a time: ``madvise(MADV_POPULATE_READ)``
(Linux 5.14+: the disk reads the piece into the page cache, no copy) with the
next piece ``MADV_WILLNEED``ed meanwhile (so the disk gets big requests back to
back), then ``MADV_DONTNEED`` (the pages leave this process; the page cache keeps
them), so the load's resident set does not grow. It stays at most ``lead`` bytes
ahead of what the load has released (`ReadAhead.release`, which drops the
pages as `entrenar.io.safetensors_io.release_pages` does), so it does not fill
the page cache far ahead of use, and skips a piece once the load's releases have
passed it by bytes (the load read it itself). On a kernel without the advice
each piece gets ``MADV_WILLNEED`` instead.

Only the timing changes: the values are read from the same mapped bytes either way.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Sequence
from types import TracebackType
from typing import Any

import numpy as np

from entrenar.io.safetensors_io import mapped_range, release_pages
from entrenar.nn.host_arrays import (
    MADV_DONTNEED,
    MADV_POPULATE_READ,
    MADV_WILLNEED,
    advise,
)

PIECE_BYTES = 4 << 20
"""Bytes the reader faults in per request (4 MiB)."""

LEAD_BYTES = 64 << 20
"""Default bound on the bytes read ahead of the load (64 MiB)."""


class ReadAhead:
    """Faults in a load's mapped arrays on a thread, in the order it reads them.

    Use as a context manager around the load; `read` the arrays in the order the
    load will read them (in one call or several, as the load learns its order) and
    `release` each (or each row chunk) once copied out::

        with ReadAhead() as ahead:
            params = stream_hf_names(flat, cfg, read_ahead=ahead.read,
                                     release=ahead.release)

    Args:
        lead: most bytes read beyond what the load has released.
    """

    def __init__(self, lead: int = LEAD_BYTES) -> None:
        self._lead = max(int(lead), PIECE_BYTES)
        self._cond = threading.Condition()
        self._pieces: list[np.ndarray] = []  # what to read, in order
        self._next = 0  # the index of the piece the reader takes next
        self._read = 0  # bytes of pieces the reader has passed, in order
        self._released = 0  # bytes the load has released
        self._closed = False
        self._thread: threading.Thread | None = None

    def read(self, arrays: Sequence[Any]) -> None:
        """Queue ``arrays`` to be read after those queued before, in order.

        Arrays that are not views of an `mmap.mmap` (`read_safetensors`' arrays
        are) are skipped: they are in memory already.
        """
        if not sys.platform.startswith("linux"):
            return
        with self._cond:
            self._pieces.extend(p for a in arrays for p in _pieces(a))
            self._cond.notify_all()
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._run, name="read-ahead", daemon=True
            )
            self._thread.start()

    def release(self, view: Any) -> None:
        """Drop ``view``'s pages from this process and count them as read.

        Its size is read first, from ``nbytes`` (a stand-in such as
        `entrenar.nn.moe_families.ExpertStack` would otherwise be made again, and
        kept, by ``np.asarray``, only to be counted).
        """
        nbytes = getattr(view, "nbytes", None)
        nbytes = int(np.asarray(view).nbytes if nbytes is None else nbytes)
        release_pages(view)
        self.consumed(nbytes)

    def consumed(self, nbytes: int) -> None:
        """Count ``nbytes`` as read by the load (read some other way than mapped)."""
        with self._cond:
            held = self._read - self._released >= self._lead  # the reader waits
            self._released += nbytes
            if held and self._ready():
                self._cond.notify_all()  # only then: a wake-up costs the GIL

    def close(self) -> None:
        """Stop the reader (it ends its current piece) and wait for it."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join()
        self._pieces.clear()  # the maps' views: the maps may be closed now

    def __enter__(self) -> ReadAhead:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        err: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _ready(self) -> bool:
        """Whether the reader may go on: closed, or a piece queued within the lead."""
        return self._closed or (
            self._next < len(self._pieces) and self._read - self._released < self._lead
        )

    def _run(self) -> None:
        advice = MADV_POPULATE_READ
        while True:
            with self._cond:
                self._cond.wait_for(self._ready)
                if self._closed:
                    return
                i, self._next = self._next, self._next + 1
                piece = self._pieces[i]
                after = self._pieces[i + 1] if i + 1 < len(self._pieces) else None
                behind = self._read + piece.nbytes <= self._released
                self._read += piece.nbytes
            if behind:
                continue  # the load's releases have passed it: it read it itself
            if after is not None:  # the next piece's reads queued, in big requests
                advise(after, MADV_WILLNEED)
            if advice == MADV_WILLNEED or not advise(piece, MADV_POPULATE_READ):
                advice = MADV_WILLNEED  # an older kernel: start the reads only
                advise(piece, advice)
            else:  # in the page cache now; not resident in this process
                advise(piece, MADV_DONTNEED)


def _pieces(a: Any) -> list[np.ndarray]:
    """``a``'s bytes in `PIECE_BYTES` slices, if ``a`` is a view of a memory map.

    No slices otherwise: dropping the pages of anonymous memory would zero them.
    """
    if not isinstance(a, np.ndarray) or not a.flags.c_contiguous:
        return []
    if mapped_range(a) is None:
        return []
    flat = a.reshape(-1).view(np.uint8)  # (nbytes,) the same memory
    return [flat[i : i + PIECE_BYTES] for i in range(0, flat.size, PIECE_BYTES)]


__all__ = ["LEAD_BYTES", "PIECE_BYTES", "ReadAhead"]
