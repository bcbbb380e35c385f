"""What of a file is in the page cache, and what of it this process holds (Linux)."""

import ctypes
import mmap
import os


def evict(path) -> None:
    """Drop ``path``'s clean pages from the page cache (``POSIX_FADV_DONTNEED``)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def cached_pages(path) -> tuple[int, int]:
    """(pages of ``path`` in the page cache, pages of the file): ``mincore``."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    size = os.path.getsize(path)
    n = -(-size // mmap.PAGESIZE)
    vec = (ctypes.c_ubyte * n)()
    with open(path, "rb") as f:  # a new private map: its pages are the cache's
        m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        start = ctypes.c_char.from_buffer(m)
        assert libc.mincore(ctypes.addressof(start), size, vec) == 0
        del start
        m.close()
    return sum(b & 1 for b in vec), n


RECLAIM_SLACK = 0.10
"""Fraction of a just-read file's pages the kernel may already have reclaimed: a
virtual machine whose host takes free memory back drops clean cached pages at any
time (the CI machine kept 0.45 GB of page cache with 23 GB free, once lost 10 of a
test file's 2563 pages between its read and the check, and twice, in sessions 19 and
21, more than 2% of them while its proactive reclaimer, kdamond, ran). A load that
skipped the page cache leaves none of the file cached, one that read half of it about
half: 10% still tells those apart."""


def mostly_cached(path) -> bool:
    """Whether all of ``path``'s pages but `RECLAIM_SLACK` are in the page cache."""
    held, pages = cached_pages(path)
    return held >= pages * (1 - RECLAIM_SLACK)


def mapped_kb(path) -> int:
    """Resident kB of the maps of ``path`` in this process (``/proc/self/smaps``)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            if line[:1].isdigit() or line[:1] in "abcdef":  # a mapping's header
                inside = line.rstrip().endswith(str(path))
            elif inside and line.startswith("Rss:"):
                total += int(line.split()[1])
    return total
