"""A small GGUF read ahead into the page cache: all of it, nothing left mapped."""

import sys

import numpy as np
import pytest
from page_cache import cached_pages, evict, mapped_kb

from entrenar.io import llama_gguf

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="mincore, fadvise"
)


@pytest.mark.parametrize("populate", [True, False])
def test_the_whole_file_is_read_into_the_page_cache(tmp_path, monkeypatch, populate):
    """By ``MADV_POPULATE_READ``, or by ``read`` where the kernel lacks it."""
    if not populate:  # as on a kernel without the advice
        monkeypatch.setattr(llama_gguf, "advise", lambda view, advice: False)
    path = tmp_path / "f.gguf"
    np.random.default_rng(0).integers(0, 256, 24 << 20, np.uint8).tofile(path)
    evict(path)
    held, pages = cached_pages(path)
    if held > pages // 2:
        pytest.skip("this system keeps the file cached after POSIX_FADV_DONTNEED")
    ahead = llama_gguf._preread(str(path))
    assert ahead is not None
    ahead.result()
    assert cached_pages(path) == (pages, pages)
    assert mapped_kb(path) == 0  # no map of it left, no page of it resident


def test_big_and_missing_files_are_not_read_ahead(tmp_path, monkeypatch):
    path = tmp_path / "f.gguf"
    path.write_bytes(bytes(100))
    monkeypatch.setattr(llama_gguf, "PREREAD_BYTES", 99)
    assert llama_gguf._preread(str(path)) is None
    assert llama_gguf._preread(str(tmp_path / "none.gguf")) is None
