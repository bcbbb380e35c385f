"""Write a safetensors file tensor by tensor, each made when its turn comes.

A merge of two 7B models must not hold the merged model (nor its serialized bytes)
in memory. `write_streamed` lays out the file first — the header is known from the
names, dtypes and shapes alone — and then asks for each tensor in file order,
writes its bytes and lets it go, so memory holds one tensor at a time. The bytes
are those `entrenar.io.save_safetensors` (the ``safetensors`` package) writes for
the same tensors and metadata:

    u64 little-endian N | header JSON, space-padded to N ≡ 0 (mod 8) | data

with the tensors ordered by dtype (the package's order: wider first) then name,
each at its offset in that order, no gaps. The order is asked of the package
itself (it sorts zero-size stand-ins of the same names and dtypes), so it cannot
drift from the in-memory writer's. One difference: the package writes the
``__metadata__`` keys in a Rust ``HashMap``'s order, which changes from one save to
the next when there are several; here they keep the given order (so the bytes are
the package's exactly when there is at most one key, as in a Hugging Face folder's
``{"format": "pt"}``, and otherwise equal up to that order).
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from entrenar.errors import ShapeError
from entrenar.io import atomic_write
from entrenar.io.safetensors_io import ST_DTYPES

_TAGS = {v: k for k, v in ST_DTYPES.items()}  # numpy dtype name -> safetensors tag

Spec = tuple[np.dtype, tuple[int, ...]]
"""A tensor's dtype and shape."""


def file_order(specs: Mapping[str, Spec], metadata: Mapping[str, str]) -> list[str]:
    """The names in the order the ``safetensors`` package lays their data out."""
    import safetensors.numpy

    stand_ins = {name: np.zeros((0,), dt) for name, (dt, _) in specs.items()}
    raw = safetensors.numpy.save(stand_ins, dict(metadata))
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    return [k for k in header if k != "__metadata__"]


def header_bytes(
    specs: Mapping[str, Spec], metadata: Mapping[str, str]
) -> tuple[bytes, list[str]]:
    """The file's first bytes (length and header) and the names in data order."""
    order = file_order(specs, metadata)
    head: dict[str, Any] = {"__metadata__": dict(metadata)}
    offset = 0
    for name in order:
        dt, shape = specs[name]
        size = math.prod(shape) * dt.itemsize
        head[name] = {
            "dtype": _TAGS[dt.name],
            "shape": list(shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    text = json.dumps(head, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text, order


def write_streamed(
    path: str | os.PathLike[str],
    specs: Mapping[str, Spec],
    metadata: Mapping[str, str],
    make: Callable[[str], Any],
) -> None:
    """Write a safetensors file atomically, calling ``make(name)`` for each tensor.

    Args:
        path: the file to write (a temporary file renamed into place).
        specs: name -> (dtype, shape) of every tensor.
        metadata: the header's ``__metadata__`` strings.
        make: returns the tensor ``name`` (an array of its spec's dtype and shape);
            called once per name, in data order, each result written and dropped
            before the next call.

    Raises:
        ShapeError: ``make`` returned another dtype or shape than its spec.
    """
    head, order = header_bytes(specs, metadata)
    with atomic_write(path) as f:
        f.write(head)
        for name in order:
            a = np.ascontiguousarray(np.asarray(make(name)))  # (*shape)
            dt, shape = specs[name]
            if a.dtype != dt or a.shape != shape:
                raise ShapeError(
                    f"{path}: tensor {name!r} came out {a.dtype}{list(a.shape)}, "
                    f"but the header says {dt}{list(shape)}"
                )
            f.write(a.reshape(-1).view(np.uint8).data)
            del a


__all__ = ["Spec", "file_order", "header_bytes", "write_streamed"]
