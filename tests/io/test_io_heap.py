"""`entrenar.io.heap`: glibc's mmap threshold fixed for big models only."""

import os
import subprocess
import sys

import pytest

CHECK = """
import sys
from entrenar.io.heap import BIG_MODEL_BYTES, bound_heap
print(bound_heap(BIG_MODEL_BYTES - 1), bound_heap(BIG_MODEL_BYTES))
"""


def _run(env_extra, code=CHECK):
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_MMAP_THRESHOLD_"}
    env.update(env_extra)
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_threshold_fixed_for_big_models_only():
    # in a fresh process: mallopt changes the whole process's heap
    assert _run({}) == ["False", "True"]


def test_a_threshold_from_the_environment_is_kept():
    assert _run({"MALLOC_MMAP_THRESHOLD_": "65536"}) == ["False", "False"]


RESIDENT = """
import ctypes, mmap
import numpy as np
from entrenar.io.heap import host_buffer, to_device

libc = ctypes.CDLL("libc.so.6", use_errno=True)
page = mmap.PAGESIZE


def resident(address, n):  # pages of [address, address + n) in memory (mincore)
    vec = (ctypes.c_ubyte * ((n + page - 1) // page))()
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    assert libc.mincore(ctypes.c_void_p(address), ctypes.c_size_t(n), vec) == 0
    return sum(b & 1 for b in vec)


n = 64 << 20  # 64 MiB, 4 MiB of it written
buf = host_buffer((n,), np.uint8, zeroed=True)
buf[: 4 << 20] = 7
array = to_device(buf)
address = array.unsafe_buffer_pointer()
print(address == buf.ctypes.data, resident(address + (8 << 20), n - (8 << 20)),
      resident(address, 4 << 20) == (4 << 20) // page,
      int(np.asarray(array)[4 << 20 :].max()), int(np.asarray(array)[: 4 << 20].min()))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mincore")
def test_zeroed_host_buffer_pages_never_written_are_not_resident():
    """What keeps a mixed-type stack's unused room out of memory (`MixedGGMLWeight`).

    The JAX array aliases the buffer, the written 4 MiB are resident, the pages
    never written (beyond a 2 MiB huge page's reach) are not, and they read as 0.
    """
    assert _run({}, RESIDENT) == ["True", "0", "True", "0", "7"]


POPULATED = """
import ctypes, mmap
import numpy as np
from entrenar.io.heap import host_buffer, to_device
from entrenar.nn.host_arrays import populate

libc = ctypes.CDLL("libc.so.6", use_errno=True)
page = mmap.PAGESIZE


def resident(address, n):
    vec = (ctypes.c_ubyte * ((n + page - 1) // page))()
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    assert libc.mincore(ctypes.c_void_p(address), ctypes.c_size_t(n), vec) == 0
    return sum(b & 1 for b in vec)


n = 16 << 20
full = host_buffer((n // 4,), np.float32)  # populated: every page resident already
lazy = host_buffer((n,), np.uint8, zeroed=True)
populate(lazy[: 4 << 20])  # only these pages
full[:] = 2.5
array = to_device(full)
print(full.ctypes.data % page, resident(full.ctypes.data, n) == n // page,
      resident(lazy.ctypes.data, 4 << 20) == (4 << 20) // page,
      resident(lazy.ctypes.data + (8 << 20), 8 << 20), int(lazy.max()),
      array.unsafe_buffer_pointer() == full.ctypes.data, float(np.asarray(array).min()))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mincore")
def test_big_host_buffers_are_populated_and_zeroed_ones_only_where_asked():
    """Big buffers are populated at once; zeroed ones only where `populate` says.

    (`entrenar.nn.host_arrays`' docstring.) The zeroed buffer still reads 0.
    """
    assert _run({}, POPULATED) == ["0", "True", "True", "0", "0", "True", "2.5"]
