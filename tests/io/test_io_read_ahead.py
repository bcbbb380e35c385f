"""A load's tensors read on a thread ahead of it: in its order, within a lead."""

import glob
import os
import sys
import threading
import time

import ml_dtypes
import numpy as np
import pytest
from page_cache import cached_pages, evict, mapped_kb, mostly_cached
from test_io_streaming import QLORA, tiny_config, write_folder

from entrenar import io
from entrenar.io import read_ahead
from entrenar.nn import hf_names, host_arrays
from entrenar.runs.models import BaseQuantize, base_quantizer

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="madvise, mincore, fadvise"
)

MiB = 1 << 20


def _until(check, seconds=10.0) -> bool:
    """Whether ``check()`` holds within ``seconds`` (polled)."""
    end = time.monotonic() + seconds
    while not check():
        if time.monotonic() > end:
            return False
        time.sleep(0.01)
    return True


def _evicted_file(tmp_path, size):
    path = tmp_path / "f.bin"
    np.random.default_rng(0).integers(0, 256, size, np.uint8).tofile(path)
    evict(path)
    held, pages = cached_pages(path)
    if held > pages // 2:
        pytest.skip("this system keeps the file cached after POSIX_FADV_DONTNEED")
    return path


@pytest.mark.parametrize("populate", [True, False])
def test_the_files_reach_the_page_cache_and_not_the_resident_set(
    tmp_path, monkeypatch, populate
):
    """By ``MADV_POPULATE_READ`` (then dropped), or ``MADV_WILLNEED`` without it."""
    if not populate:  # as on a kernel without the advice

        def advise(view, advice):
            ok = advice != host_arrays.MADV_POPULATE_READ
            return ok and host_arrays.advise(view, advice)

        monkeypatch.setattr(read_ahead, "advise", advise)
    path = _evicted_file(tmp_path, 24 * MiB + 12345)
    view = np.memmap(path, np.uint8, mode="r")
    with read_ahead.ReadAhead(lead=1 << 40) as ahead:
        ahead.read([view[: 10 * MiB], view[10 * MiB :]])
        assert _until(lambda: mostly_cached(path))
        assert _until(lambda: mapped_kb(path) <= 8)  # a page or two being dropped
    assert np.array_equal(view[-100:], np.fromfile(path, np.uint8)[-100:])


def _mapped_zeros(tmp_path, size):
    path = tmp_path / "zeros.bin"
    np.zeros(size, np.uint8).tofile(path)
    return np.memmap(path, np.uint8, mode="r")


def test_the_reader_stays_within_the_lead_and_skips_what_the_load_passed(
    tmp_path, monkeypatch
):
    calls: list[tuple[int, int]] = []  # (offset in MiB, advice)
    a = _mapped_zeros(tmp_path, 16 * MiB)

    def advise(view, advice):
        calls.append(((view.ctypes.data - a.ctypes.data) // MiB, advice))
        return True

    monkeypatch.setattr(read_ahead, "advise", advise)
    monkeypatch.setattr(read_ahead, "PIECE_BYTES", MiB)

    def populated():
        return [at for at, adv in calls if adv == host_arrays.MADV_POPULATE_READ]

    with read_ahead.ReadAhead(lead=4 * MiB) as ahead:
        ahead.read([a[: 3 * MiB], a[3 * MiB :]])  # two arrays, 16 pieces
        assert _until(lambda: len(populated()) == 4)
        time.sleep(0.2)
        assert populated() == [0, 1, 2, 3]  # 4 MiB ahead of the load, then waits
        ahead.release(a[: 2 * MiB])  # the load read 2 MiB: 2 more
        assert _until(lambda: len(populated()) == 6)
        time.sleep(0.2)
        assert populated() == [0, 1, 2, 3, 4, 5]
        ahead.release(a[2 * MiB :])  # the load read everything: nothing more
        time.sleep(0.2)
    assert populated() == [0, 1, 2, 3, 4, 5]
    willneed = [at for at, adv in calls if adv == host_arrays.MADV_WILLNEED]
    assert willneed == [1, 2, 3, 4, 5, 6]  # each next piece queued while one is read
    dropped = [at for at, adv in calls if adv == host_arrays.MADV_DONTNEED]
    assert dropped == [0, 1, 2, 3, 4, 5]


def test_close_stops_a_waiting_reader(tmp_path):
    a = _mapped_zeros(tmp_path, 8 * MiB)
    ahead = read_ahead.ReadAhead(lead=read_ahead.PIECE_BYTES)
    ahead.read([a])
    ahead.close()  # returns: the reader waited on the lead and ended
    assert ahead._thread is not None and not ahead._thread.is_alive()


def test_arrays_in_memory_are_not_touched(monkeypatch):
    """Only views of a memory map: dropping anonymous pages would zero them."""
    calls = []
    monkeypatch.setattr(read_ahead, "advise", lambda view, advice: calls.append(1))
    a = np.ones(8 * MiB, np.uint8)
    with read_ahead.ReadAhead() as ahead:
        ahead.read([a, a[:MiB]])
        time.sleep(0.1)
    assert not calls and a.all()


@pytest.mark.parametrize("quantize", [None, QLORA], ids=["stored", "nf4"])
def test_a_folder_load_reads_in_the_order_it_queued(tmp_path, quantize):
    """Every array queued is released, in the queued order (up to the threads)."""
    config = tiny_config(num_layers=4)
    folder = write_folder(tmp_path / "m", config, shard_bytes=40_000)
    flat = {}
    for f in sorted(glob.glob(os.path.join(folder, "*.safetensors"))):
        flat.update(io.read_safetensors(f)[0])
    queued: list[tuple[int, int]] = []  # (start, end) addresses, in order
    released: list[tuple[int, int]] = []
    lock = threading.Lock()

    def span(x):
        return x.ctypes.data, x.ctypes.data + x.nbytes

    def release(x):
        with lock:
            released.append(span(np.asarray(x)))

    def queue(arrays):
        queued.extend(span(x) for x in arrays)

    fn = None if quantize is None else base_quantizer(quantize)
    hf_names.stream_hf_names(
        flat, config, quantize=fn, release=release, read_ahead=queue
    )
    assert len(queued) == len(flat)  # every tensor, once
    assert sum(e - s for s, e in released) == sum(e - s for s, e in queued)
    index = [
        next(k for k, (s, e) in enumerate(queued) if s <= a < e) for a, _ in released
    ]
    name_at = {span(v)[0]: n for n, v in flat.items()}
    names = [name_at[s] for s, _ in queued]
    targets = () if quantize is None else tuple(quantize.targets)
    aside = [k for k in index if not names[k].startswith("model.layers.")]
    worked = [k for k in index if any(t in names[k] for t in targets)]
    copied = [k for k in index if k not in worked and k not in aside]
    assert aside == sorted(aside)  # the unstacked leaves, on their own thread
    assert copied == sorted(copied)  # copied on the loading thread, in order
    # quantized by the workers: released as each ends, <= 2 layers in flight
    ranked = sorted(range(len(worked)), key=worked.__getitem__)
    assert all(abs(at - r) <= hf_names.QUANTIZE_AHEAD for r, at in enumerate(ranked))
    # the unstacked leaves queued first; then the leaves quantized by JAX (the
    # native kernel off), leaf by leaf; the rest a layer at a time, as stored
    stacked = [n for n in names if n.startswith("model.layers.")]
    nf4 = BaseQuantize("nf4")  # what base_quantizer asks for each target
    by_jax = fn is not None and nf4.on_host(ml_dtypes.bfloat16, np.float32) is None
    alone = [n for n in stacked if by_jax and any(t in n for t in targets)]
    together = [n for n in stacked if n not in alone]
    assert stacked == alone + together
    for at in range(0, len(alone), config.num_layers):  # each leaf's layers in turn
        leaf = alone[at : at + config.num_layers]
        assert [n.split(".")[2] for n in leaf] == [str(i) for i in range(len(leaf))]
        assert len({n.split(".", 3)[3] for n in leaf}) == 1
    layers = [int(n.split(".")[2]) for n in together]
    assert layers == sorted(layers) and len(set(layers)) == config.num_layers
    assert set(names[: len(names) - len(stacked)]) == {names[k] for k in aside}
