"""Host arrays JAX takes without a copy: fill a leaf in numpy, hand it over once.

A load fills a leaf of stored bytes on the host (numpy copies from the mapped file,
no compiled update per leaf shape) and hands it to JAX without a copy: JAX's CPU
client aliases a numpy buffer aligned to a page (`jax.device_put`), and copies one
that is not (other backends always copy). Used by the streaming loads
(`entrenar.nn.hf_names`, `entrenar.io.llama_gguf`).
"""

from __future__ import annotations

import mmap
from typing import Any

import jax
import numpy as np


def host_buffer(
    shape: tuple[int, ...], dtype: Any, *, zeroed: bool = False
) -> np.ndarray:
    """A C-contiguous numpy array whose data starts on a page.

    Uninitialised, or with ``zeroed`` all zeros from ``calloc``: a buffer glibc
    maps (over its mmap threshold) comes from the kernel already zero and is not
    written, so a page the caller never writes is never resident.
    """
    dtype = np.dtype(dtype)
    n = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = (np.zeros if zeroed else np.empty)(n + mmap.PAGESIZE, np.uint8)
    start = -raw.ctypes.data % mmap.PAGESIZE
    return raw[start : start + n].view(dtype).reshape(shape)


def to_device(buf: np.ndarray) -> jax.Array:
    """``buf`` as a JAX array; on the CPU the same memory when page-aligned.

    ``buf`` must not be written afterwards (the array may alias it).
    """
    return jax.block_until_ready(jax.device_put(buf))


__all__ = ["host_buffer", "to_device"]
