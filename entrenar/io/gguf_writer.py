"""Write GGUF version 3 files (the layout `entrenar.io.gguf_reader` documents).

Metadata keys are written in the given order with their GGUF types (`GGUFField`), so
a file's metadata copies over type for type; ``general.alignment`` is written when the
alignment is not the default 32. Tensors follow in the given order, each padded to the
alignment; a tensor's bytes may be made only when it is written (`GGUFTensor`), the
header needing only its shape and type. The file is written atomically.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Callable, Mapping
from typing import IO, Any, NamedTuple

import numpy as np

from entrenar.errors import FormatError
from entrenar.io.atomic import atomic_write
from entrenar.io.ggml_dequant import ggml_type, row_bytes
from entrenar.io.gguf_reader import (
    DEFAULT_ALIGNMENT,
    GGUF_MAGIC,
    MAX_DIMS,
    SCALAR_FORMATS,
    GGUFField,
    GGUFValueType,
)


class GGUFTensor(NamedTuple):
    """A tensor to write: its stored bytes, numpy ``shape`` and ggml type id.

    ``raw`` may be a function that makes the bytes when the tensor is written, so a
    writer of a big model holds one tensor at a time (`write_gguf`).
    """

    raw: np.ndarray | Callable[[], np.ndarray]
    shape: tuple[int, ...]
    type_id: int


def tensor_from_array(x: Any, type_name: str = "F32") -> GGUFTensor:
    """A `GGUFTensor` of a float array stored as ``F32``, ``F16`` or ``BF16``.

    >>> tensor_from_array(np.ones((2, 3)), "F16").raw.size
    12
    """
    a = np.asarray(x, dtype=np.float32)
    if type_name == "F32":
        raw = a.astype("<f4")
        tid = 0
    elif type_name == "F16":
        raw, tid = a.astype("<f2"), 1
    elif type_name == "BF16":  # round to nearest even, as ggml does
        u = np.ascontiguousarray(a).view(np.uint32).astype(np.uint64)
        rounded = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
        raw = np.where(np.isnan(a), (u >> 16) | 64, rounded).astype("<u2")
        tid = 30
    else:
        raise FormatError(f"tensor_from_array stores F32/F16/BF16, not {type_name!r}")
    return GGUFTensor(raw.reshape(-1).view(np.uint8), tuple(a.shape), tid)


def _value(f: IO[bytes], vtype: GGUFValueType, v: Any, item: Any, key: str) -> None:
    if vtype == GGUFValueType.STRING:
        b = str(v).encode("utf-8", errors="surrogateescape")
        f.write(struct.pack("<Q", len(b)) + b)
    elif vtype == GGUFValueType.ARRAY:
        if item is None:
            raise FormatError(f"metadata {key!r}: an array needs an item type")
        item = GGUFValueType(item)
        f.write(struct.pack("<IQ", int(item), len(v)))
        if item in SCALAR_FORMATS:
            dt = np.dtype(SCALAR_FORMATS[item])
            f.write(np.asarray(v, dtype=dt).tobytes())
        else:
            for x in v:
                if item == GGUFValueType.ARRAY:
                    raise FormatError(f"metadata {key!r}: nested arrays not written")
                _value(f, item, x, None, key)
    else:
        f.write(struct.pack(SCALAR_FORMATS[vtype], v))


def write_gguf(
    path: str | os.PathLike[str],
    fields: Mapping[str, GGUFField],
    tensors: Mapping[str, GGUFTensor],
    *,
    alignment: int = DEFAULT_ALIGNMENT,
) -> None:
    """Write a GGUF v3 file atomically.

    Args:
        path: destination.
        fields: metadata, key -> `GGUFField` (value and GGUF type), in order.
        tensors: name -> `GGUFTensor`, in order.
        alignment: data alignment, a power of two.

    Raises:
        FormatError: a tensor whose bytes do not match its shape and type, more than
            4 dimensions, or a bad alignment.
    """
    if alignment <= 0 or alignment & (alignment - 1):
        raise FormatError(f"alignment {alignment} is not a power of two")
    fields = dict(fields)
    fields.pop("general.alignment", None)
    if alignment != DEFAULT_ALIGNMENT:
        fields["general.alignment"] = GGUFField(alignment, GGUFValueType.UINT32)
    offsets, pos = [], 0
    for name, t in tensors.items():
        if not 1 <= len(t.shape) <= MAX_DIMS:
            raise FormatError(f"tensor {name!r}: {len(t.shape)} dims, GGUF allows 1..4")
        want = _nbytes(t)
        if not callable(t.raw):
            _check_raw(name, t, t.raw)
        offsets.append(pos)
        pos += -(-want // alignment) * alignment
    with atomic_write(path) as f:
        f.write(GGUF_MAGIC + struct.pack("<IQQ", 3, len(tensors), len(fields)))
        for key, fld in fields.items():
            _value(f, GGUFValueType.STRING, key, None, key)
            f.write(struct.pack("<I", int(fld.type)))
            _value(f, fld.type, fld.value, fld.item_type, key)
        for (name, t), off in zip(tensors.items(), offsets):
            _value(f, GGUFValueType.STRING, name, None, name)
            ne = tuple(reversed(t.shape))
            f.write(struct.pack(f"<I{len(ne)}QIQ", len(ne), *ne, t.type_id, off))
        f.write(b"\0" * (-f.tell() % alignment))
        for name, t in tensors.items():  # a lazy tensor made, written, dropped
            raw = _check_raw(name, t, t.raw() if callable(t.raw) else t.raw)
            f.write(np.ascontiguousarray(raw).reshape(-1).data)
            f.write(b"\0" * (-raw.size % alignment))


def _nbytes(t: GGUFTensor) -> int:
    return row_bytes(t.type_id, t.shape[-1]) * int(np.prod(t.shape[:-1]))


def _check_raw(name: str, t: GGUFTensor, raw: np.ndarray) -> np.ndarray:
    """``raw``; `FormatError` when it is not the bytes ``t``'s shape and type need."""
    want = _nbytes(t)
    if raw.size != want or raw.dtype != np.uint8:
        raise FormatError(
            f"tensor {name!r}: {ggml_type(t.type_id).name} of shape {t.shape} "
            f"needs {want} uint8 bytes, got {raw.size} {raw.dtype}"
        )
    return raw


__all__ = ["GGUFTensor", "tensor_from_array", "write_gguf"]
