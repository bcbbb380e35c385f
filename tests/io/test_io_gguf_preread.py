"""A small GGUF read ahead into the page cache: all of it, nothing left mapped."""

import ctypes
import mmap
import os
import sys

import numpy as np
import pytest

from entrenar.io import llama_gguf

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="mincore, fadvise"
)


def _cached_pages(path) -> tuple[int, int]:
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


def _mapped_kb(path) -> int:
    """Resident kB of the maps of ``path`` left in this process (``smaps``)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            if line[:1].isdigit() or line[:1] in "abcdef":  # a mapping's header
                inside = line.rstrip().endswith(str(path))
            elif inside and line.startswith("Rss:"):
                total += int(line.split()[1])
    return total


@pytest.mark.parametrize("populate", [True, False])
def test_the_whole_file_is_read_into_the_page_cache(tmp_path, monkeypatch, populate):
    """By ``MADV_POPULATE_READ``, or by ``read`` where the kernel lacks it."""
    if not populate:  # as on a kernel without the advice
        monkeypatch.setattr(llama_gguf, "advise", lambda view, advice: False)
    path = tmp_path / "f.gguf"
    np.random.default_rng(0).integers(0, 256, 24 << 20, np.uint8).tofile(path)
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)
    held, pages = _cached_pages(path)
    if held > pages // 2:
        pytest.skip("this system keeps the file cached after POSIX_FADV_DONTNEED")
    ahead = llama_gguf._preread(str(path))
    assert ahead is not None
    ahead.result()
    assert _cached_pages(path) == (pages, pages)
    assert _mapped_kb(path) == 0  # no map of it left, no page of it resident


def test_big_and_missing_files_are_not_read_ahead(tmp_path, monkeypatch):
    path = tmp_path / "f.gguf"
    path.write_bytes(bytes(100))
    monkeypatch.setattr(llama_gguf, "PREREAD_BYTES", 99)
    assert llama_gguf._preread(str(path)) is None
    assert llama_gguf._preread(str(tmp_path / "none.gguf")) is None
