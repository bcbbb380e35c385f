"""Host arrays JAX takes without a copy: fill a leaf in numpy, hand it over once.

A load fills a leaf of stored bytes on the host (numpy copies from the mapped file,
no compiled update per leaf shape) and hands it to JAX without a copy: JAX's CPU
client aliases a numpy buffer aligned to a page (`jax.device_put`), and copies one
that is not (other backends always copy). Used by the streaming loads
(`entrenar.nn.hf_names`, `entrenar.io.llama_gguf`).

A buffer of at least `MAPPED_BYTES` is its own anonymous memory map, its pages
*populated* by the kernel in one call (``MAP_POPULATE``, or ``MADV_POPULATE_WRITE``
on a part, `populate`) instead of faulted one 4 KiB page at a time as numpy writes
them. On a virtual machine whose free memory goes back to the host (free page
reporting, as on the machine of specs/io.md's figures) a first touch of a page
costs a fault in the host too: writing a fresh 512 MiB buffer took 2.0-4.6 s there,
populating it 0.35-0.74 s. Transparent huge pages (``MADV_HUGEPAGE``) would fault
512 times fewer pages, but are not used: there a fresh huge page is one the host
took back, and populating 108 MiB of them took 0.07-0.57 s against 0.03 s.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import functools
import mmap
import sys
from typing import Any

import jax
import numpy as np

from entrenar.threads import shared_pool

MAPPED_BYTES = 1 << 20
"""Buffers of at least this many bytes (1 MiB) are mapped and populated."""

POPULATE_THREADS = 2
"""Threads `populate_ahead` faults pages in on (a fault's cost is mostly the host's;
two vCPUs take two at a time)."""

SPLIT_BYTES = 8 << 20
"""Buffers of at least this many bytes (8 MiB) are populated by several threads."""

POPULATE_PARTS = 4
"""Parts such a buffer is populated in: the first on the calling thread, the
others on the `POPULATE_THREADS` (populating 108 MiB in 2-8 parts took 18-29 ms on
the 2-vCPU machine of specs/io.md's figures, in one 31-37 ms)."""

MADV_POPULATE_WRITE = 23
"""Linux's ``madvise`` advice that faults a range in, writable (5.14+)."""

MADV_POPULATE_READ = 22
"""Linux's ``madvise`` advice that faults a range in, readable (5.14+): of a mapped
file, reads its pages into the page cache without copying them anywhere."""

MADV_DONTNEED = 4
"""Linux's ``madvise`` advice that drops a range's pages from this process."""

MADV_WILLNEED = 3
"""Linux's ``madvise`` advice that starts reading a range in the background."""


@functools.cache
def _madvise() -> Any:
    """Libc's ``madvise`` through ctypes (the GIL released during the call), or None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def advise(view: np.ndarray, advice: int) -> bool:
    """``madvise(advice)`` over the whole pages ``view`` (contiguous) covers.

    Through ctypes, so the call (a populate can wait on the disk) releases the
    GIL. Returns whether the system took it: False where there is no ``madvise``,
    for an advice the kernel does not know, or an empty ``view``.
    """
    fn = _madvise()
    if fn is None or not view.nbytes:
        return False
    start = view.ctypes.data // mmap.PAGESIZE * mmap.PAGESIZE
    return fn(start, view.ctypes.data + view.nbytes - start, advice) == 0


def populate(view: np.ndarray) -> None:
    """Fault in the pages under ``view`` (contiguous) before it is written.

    ``madvise(MADV_POPULATE_WRITE)`` over the whole pages ``view`` covers; a no-op
    where the system lacks it (the pages then fault as they are written, the same
    values either way).
    """
    advise(view, MADV_POPULATE_WRITE)


def _populator() -> concurrent.futures.ThreadPoolExecutor:
    return shared_pool("populate", POPULATE_THREADS)


def populate_ahead(views: list[np.ndarray]) -> list[concurrent.futures.Future[None]]:
    """`populate` each of ``views`` in order on `POPULATE_THREADS` background threads.

    A load reading layer ``i`` from the disk (``pread``) meanwhile has layer
    ``i + 1``'s pages faulted in: the disk and the page faults overlap instead of
    adding up. Writing a view before its future is done is safe (the kernel faults
    a page once, whoever touches it first); wait for the futures before dropping
    the buffer.
    """
    return [_populator().submit(populate, v) for v in views]


def host_buffer(
    shape: tuple[int, ...], dtype: Any, *, zeroed: bool = False
) -> np.ndarray:
    """A C-contiguous numpy array whose data starts on a page.

    Uninitialised, or with ``zeroed`` all zeros and *lazy*: a page the caller never
    writes is never resident (a buffer of `MAPPED_BYTES` or more is an anonymous
    map; a smaller one comes from ``calloc``). A big buffer that is not ``zeroed``
    has its pages populated at once (module docstring), one of `SPLIT_BYTES` or more
    in `POPULATE_PARTS` parts on several threads: the caller writes all of it.
    """
    dtype = np.dtype(dtype)
    n = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if n >= MAPPED_BYTES and hasattr(mmap, "MAP_ANONYMOUS"):
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
        split = not zeroed and _madvise() is not None and n >= SPLIT_BYTES
        if not zeroed and not split:
            flags |= getattr(mmap, "MAP_POPULATE", 0)
        raw = np.frombuffer(mmap.mmap(-1, n, flags=flags), np.uint8)  # page-aligned
        if split:  # populated in parts, on this thread and the populate threads
            step = -(-n // POPULATE_PARTS // mmap.PAGESIZE) * mmap.PAGESIZE
            parts = [raw[i : i + step] for i in range(0, n, step)]
            ready = populate_ahead(parts[1:])
            populate(parts[0])
            concurrent.futures.wait(ready)
        return raw.view(dtype).reshape(shape)
    raw = (np.zeros if zeroed else np.empty)(n + mmap.PAGESIZE, np.uint8)
    start = -raw.ctypes.data % mmap.PAGESIZE
    return raw[start : start + n].view(dtype).reshape(shape)


def to_device(buf: np.ndarray) -> jax.Array:
    """``buf`` as a JAX array; on the CPU the same memory when page-aligned.

    ``buf`` must not be written afterwards (the array may alias it).
    """
    return jax.block_until_ready(jax.device_put(buf))


__all__ = [
    "MAPPED_BYTES",
    "advise",
    "host_buffer",
    "populate",
    "populate_ahead",
    "to_device",
]
