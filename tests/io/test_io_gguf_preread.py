"""A GGUF load reads its file front to back on a thread: cached, nothing left mapped."""

import gc
import sys

import jax
import pytest
from page_cache import cached_pages, evict, mapped_kb, mostly_cached

from entrenar import nn
from entrenar.io import llama_gguf, load_llama_gguf, save_llama_gguf
from entrenar.io.gguf_reader import read_gguf

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="mincore, fadvise"
)


@pytest.fixture(scope="module")
def gguf(tmp_path_factory):
    cfg = nn.LlamaConfig(
        vocab_size=512, hidden_size=256, intermediate_size=512, num_layers=4,
        num_heads=4, num_kv_heads=2,
    )  # fmt: skip
    path = tmp_path_factory.mktemp("preread") / "m.gguf"
    save_llama_gguf(path, cfg, cfg.init(jax.random.key(0)), tensor_type="F32")
    return path


@pytest.mark.parametrize("keep", [True, False], ids=["kept", "dequantized"])
def test_the_whole_file_ends_in_the_page_cache_not_in_the_process(gguf, keep):
    evict(gguf)
    held, pages = cached_pages(gguf)
    if held > pages // 2:
        pytest.skip("this system keeps the file cached after POSIX_FADV_DONTNEED")
    params = load_llama_gguf(gguf, keep_quantized=keep)[1]  # the tree held
    gc.collect()  # the parse's map of the file goes with its last reference
    assert mostly_cached(gguf)  # read through the page cache
    assert mapped_kb(gguf) == 0  # no page of it left resident in this process
    assert jax.tree.leaves(params)


def test_a_parsed_file_is_read_ahead_too(gguf):
    evict(gguf)
    g = read_gguf(gguf)
    _, params, _ = load_llama_gguf(g)
    _, again, _ = load_llama_gguf(gguf)
    assert jax.tree.structure(params) == jax.tree.structure(again)


def test_a_file_that_cannot_be_mapped_is_left_to_the_parse(tmp_path):
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    assert llama_gguf._mapped(str(empty)) is None
    assert llama_gguf._mapped(str(tmp_path / "none.gguf")) is None
    with pytest.raises(Exception, match=r"empty\.gguf"):
        load_llama_gguf(empty)
