"""The C heap after loading a big model: free pages returned, big buffers mapped.

XLA's CPU buffers come from glibc's ``malloc``. glibc maps a request of at least
``M_MMAP_THRESHOLD`` bytes (128 KiB at start) with its own ``mmap`` and unmaps it
on ``free``; but the threshold is *dynamic*: each ``free`` of a mapped chunk raises
it to that chunk's size (up to 32 MiB), so once a load or a first training step has
freed its staging buffers, later buffers below that size come from the heap's
arenas, where a freed buffer in the middle of live ones stays resident until
reused. A training step allocates and frees the same buffers each step, so the
heap's high-water mark creeps up: measured on Llama-3-8B's shape cut to 8 layers
(QLoRA of every linear layer, batch 1 x 512, 2 steps), the run peaked at
3,576,296 kB with the dynamic threshold and 3,425,000 kB with the threshold fixed
at 128 KiB (the second step's peak 74 MB over the first, then 11 MB).

`bound_heap` fixes the threshold (``mallopt(M_MMAP_THRESHOLD, 128 KiB)``: every
buffer of 128 KiB or more is mapped and unmapped on its own, the heap holds only
small objects) for a model of at least `BIG_MODEL_BYTES`; a small model keeps
glibc's default (mapping a page-faulted fresh buffer each step costs time and buys
little there). `trim_heap` gives the heap's free pages back after a load. Both are
no-ops where there is no glibc, and `bound_heap` leaves a threshold the user chose
(``MALLOC_MMAP_THRESHOLD_`` in the environment) alone.

`host_buffer` and `to_device` (from `entrenar.nn.host_arrays`, re-exported here) let
a load fill a leaf on the host and hand it to JAX without a copy.
"""

from __future__ import annotations

import ctypes
import functools
import os
from typing import Any

from entrenar.nn.host_arrays import host_buffer, to_device

M_MMAP_THRESHOLD = -3
"""glibc's ``mallopt`` parameter number of the mmap threshold (``malloc.h``)."""

MMAP_THRESHOLD = 128 * 1024
"""The fixed threshold: glibc's initial value (128 KiB)."""

BIG_MODEL_BYTES = 1 << 30
"""Files of at least this many bytes (1 GiB) fix the threshold (`bound_heap`)."""


@functools.cache
def _libc() -> Any:
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


def trim_heap() -> None:
    """Give the C heap's free pages back to the system (glibc ``malloc_trim``).

    A load's freed staging buffers stay in the process's heap: 0.8 GB over a 1.0 GB
    tree for Llama-3-8B's embedding, head and two layers, counted in its resident
    memory until reused.
    """
    libc = _libc()
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)


def bound_heap(model_bytes: int) -> bool:
    """Fix glibc's mmap threshold at 128 KiB for a model of ``model_bytes`` or more.

    Returns:
        True if the threshold was set now (a model of at least `BIG_MODEL_BYTES`,
        glibc present, no ``MALLOC_MMAP_THRESHOLD_`` in the environment).
    """
    if model_bytes < BIG_MODEL_BYTES or "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    libc = _libc()
    if libc is None or not hasattr(libc, "mallopt"):
        return False
    return bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD))


__all__ = ["BIG_MODEL_BYTES", "bound_heap", "host_buffer", "to_device", "trim_heap"]
