"""A small, validating safetensors reader and an atomic writer (numpy arrays).

Format (https://github.com/huggingface/safetensors): ``u64`` little-endian header
length ``n``, ``n`` bytes of JSON ``{name: {"dtype", "shape", "data_offsets": [b, e]},
"__metadata__": {str: str}}``, then the data buffer; offsets are relative to it,
row-major, little-endian. The reader checks the header size, every dtype, shape and
offset against the file size before reading any tensor.
"""

from __future__ import annotations

import json
import os
import struct
import tempfile
from typing import Any

import ml_dtypes
import numpy as np

from entrenar.errors import FormatError

DTYPES: dict[str, Any] = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "BF16": ml_dtypes.bfloat16,
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U8": np.uint8,
    "BOOL": np.bool_,
}
_NAMES = {np.dtype(v): k for k, v in DTYPES.items()}
MAX_HEADER = 100 * 1024 * 1024


def read_header(path: str) -> tuple[dict[str, Any], dict[str, str], int]:
    """``(tensors, metadata, data_start)`` of a safetensors file, fully validated."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise FormatError(f"{path}: {size} bytes, too short for a safetensors file")
        (n,) = struct.unpack("<Q", head)
        if n > MAX_HEADER or 8 + n > size:
            raise FormatError(f"{path}: header length {n} exceeds the file ({size} B)")
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise FormatError(f"{path}: header is not valid JSON ({e})") from e
    if not isinstance(header, dict):
        raise FormatError(f"{path}: header is not a JSON object")
    meta = header.pop("__metadata__", None) or {}
    data_len = size - 8 - n
    for name, info in header.items():
        where = f"{path}: tensor {name!r}"
        if not isinstance(info, dict) or info.get("dtype") not in DTYPES:
            raise FormatError(f"{where}: missing or unsupported dtype in {info!r}")
        shape, offs = info.get("shape"), info.get("data_offsets")
        if not (
            isinstance(shape, list)
            and all(isinstance(s, int) and s >= 0 for s in shape)
        ):
            raise FormatError(f"{where}: bad shape {shape!r}")
        if not (
            isinstance(offs, list)
            and len(offs) == 2
            and all(isinstance(o, int) for o in offs)
        ):
            raise FormatError(f"{where}: bad data_offsets {offs!r}")
        need = int(np.prod(shape)) * np.dtype(DTYPES[info["dtype"]]).itemsize
        if not 0 <= offs[0] <= offs[1] <= data_len or offs[1] - offs[0] != need:
            raise FormatError(
                f"{where}: data_offsets {offs} do not hold {need} bytes of "
                f"{info['dtype']}{shape} inside the {data_len}-byte data buffer"
            )
        info["shape"] = tuple(shape)
    return header, meta, 8 + n


def read_tensor(path: str, info: dict[str, Any], data_start: int) -> np.ndarray:
    """One tensor described by a validated header entry."""
    begin, end = info["data_offsets"]
    with open(path, "rb") as f:
        f.seek(data_start + begin)
        raw = f.read(end - begin)
    dtype = np.dtype(DTYPES[info["dtype"]]).newbyteorder("<")
    return np.frombuffer(raw, dtype=dtype).reshape(info["shape"]).copy()


def write(path: str, tensors: dict[str, np.ndarray], metadata: dict[str, str]) -> None:
    """Write ``tensors`` atomically (temp file in the same folder + ``os.replace``)."""
    header: dict[str, Any] = {"__metadata__": metadata}
    offset, blobs = 0, []
    for name in sorted(tensors):
        a = np.ascontiguousarray(tensors[name])
        if a.dtype not in _NAMES:
            raise FormatError(f"{path}: cannot store {name!r} of dtype {a.dtype}")
        blob = a.astype(a.dtype.newbyteorder("<"), copy=False).tobytes()
        header[name] = {
            "dtype": _NAMES[a.dtype],
            "shape": list(a.shape),
            "data_offsets": [offset, offset + len(blob)],
        }
        offset += len(blob)
        blobs.append(blob)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # align the data buffer to 8 bytes
    fd, tmp = tempfile.mkstemp(
        dir=os.path.dirname(os.path.abspath(path)), suffix=".tmp"
    )
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(struct.pack("<Q", len(text)) + text)
            for blob in blobs:
                f.write(blob)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp) if os.path.exists(tmp) else None
        raise


__all__ = ["DTYPES", "read_header", "read_tensor", "write"]
