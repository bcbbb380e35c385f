"""safetensors model files, and Hugging Face Llama checkpoints.

Layout (https://github.com/huggingface/safetensors)::

    u64 little-endian N | N bytes of JSON header | data
    header = {"__metadata__": {str: str}, name: {"dtype": "F32", "shape": [..],
              "data_offsets": [begin, end]}, ...}   (offsets relative to the data)

entrenar writes the ``safetensors`` package's layout itself (`safetensors_header`;
bfloat16 as ``ml_dtypes.bfloat16``), ``__metadata__`` in a fixed key order so that
equal models are equal files, and puts the model's metadata in it: ``format`` =
``entrenar.model``, ``name``, ``architecture``, ``version`` and ``training_config`` /
``custom`` as JSON strings. Reading parses and validates the header first (length,
JSON, dtypes, shapes, offsets inside the file, no overlaps) and then maps the data.
A mapped tensor costs no memory until it is read; `release_pages` gives back the pages
a streaming load has copied out (specs/io.md, "Streaming loads").
"""

from __future__ import annotations

import itertools
import json
import math
import mmap
import os
import struct
import sys
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np

from entrenar.errors import FormatError
from entrenar.io.atomic import atomic_write
from entrenar.io.model import (
    STORAGE_DTYPES,
    Model,
    ModelMetadata,
    flatten_params,
    unflatten_params,
)

ST_DTYPES = {
    "F16": "float16",
    "BF16": "bfloat16",
    "F32": "float32",
    "F64": "float64",
    "I8": "int8",
    "I16": "int16",
    "I32": "int32",
    "I64": "int64",
    "U8": "uint8",
    "U16": "uint16",
    "U32": "uint32",
    "U64": "uint64",
    "BOOL": "bool",
}
"""safetensors dtype tag -> numpy dtype name."""
MAX_HEADER = 100 * 2**20


def save_safetensors(
    tensors: dict[str, Any], path: str | os.PathLike[str], metadata: dict[str, str]
) -> None:
    """Write ``{name: array}`` with string ``metadata`` atomically (dtypes kept).

    The ``safetensors`` package's layout (`safetensors_header`), with
    ``__metadata__`` in ``metadata``'s key order: the package writes it from a Rust
    ``HashMap``, in an order that changes from one call to the next, so the same
    model saved twice (a run and its resumed copy) gave different bytes.
    """
    # np.asarray(order="C"), not np.ascontiguousarray, which makes a 0-d array 1-d
    arrays = {k: np.asarray(v, order="C") for k, v in tensors.items()}
    unknown = {k: a.dtype.name for k, a in arrays.items() if a.dtype.name not in _TAGS}
    if unknown:
        raise FormatError(
            f"{os.fspath(path)}: safetensors has no dtype for {unknown}; "
            f"it stores {sorted(_TAGS)}"
        )
    specs = {k: (a.dtype, a.shape) for k, a in arrays.items()}
    write_safetensors_stream(path, specs, lambda name: (arrays[name],), metadata)


ST_ORDER: tuple[str, ...] = (
    "U64", "I64", "F64", "F32", "U32", "I32", "BF16", "F16", "U16", "I16", "I8", "U8",
    "BOOL",
)  # fmt: skip
"""The order of the ``safetensors`` package's data: by dtype in this order (its Rust
``Dtype`` enum, descending), then by name."""
_TAGS = {v: k for k, v in ST_DTYPES.items()}

TensorParts = Callable[[str], Iterable[Any]]
"""``parts(name)``: the arrays whose bytes, in order, are tensor ``name``'s (one
array, or one per layer of a stacked tensor), made when iterated."""


def safetensors_header(
    specs: Mapping[str, tuple[Any, tuple[int, ...]]],
    metadata: Mapping[str, str] | None,
) -> tuple[bytes, list[str]]:
    """The header bytes (``u64 N`` + JSON + spaces) and the data order of ``specs``.

    ``specs`` maps each name to its ``(dtype, shape)``. The header is the
    ``safetensors`` package's, byte for byte: ``__metadata__`` first (in the given
    key order), then the tensors in `ST_ORDER`, compact JSON (UTF-8), padded with
    spaces to a multiple of 8 bytes.
    """
    tags = {n: _TAGS[np.dtype(dt).name] for n, (dt, _) in specs.items()}
    order = sorted(specs, key=lambda n: (ST_ORDER.index(tags[n]), n))
    header: dict[str, Any] = {}
    if metadata is not None:
        header["__metadata__"] = dict(metadata)
    pos = 0
    for name in order:
        dt, shape = specs[name]
        end = pos + math.prod(shape) * np.dtype(dt).itemsize
        header[name] = {"dtype": tags[name], "shape": list(shape)}
        header[name]["data_offsets"] = [pos, end]
        pos = end
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text, order


def write_safetensors_stream(
    path: str | os.PathLike[str],
    specs: Mapping[str, tuple[Any, tuple[int, ...]]],
    parts: TensorParts,
    metadata: Mapping[str, str] | None,
) -> None:
    """Write a safetensors file one tensor (or one layer) at a time, atomically.

    The same bytes as `save_safetensors` of the whole dict (the header by
    `safetensors_header`, then each tensor's bytes in its order), holding one part
    at a time: a writer of a big model passes ``parts`` that make each tensor, or
    each layer of it, when asked.

    Args:
        path: the file.
        specs: ``{name: (dtype, shape)}`` of every tensor.
        parts: `TensorParts`.
        metadata: ``__metadata__`` strings (None: none).

    Raises:
        FormatError: the parts of a tensor have another dtype or size than its spec.
    """
    head, order = safetensors_header(specs, metadata)
    with atomic_write(path) as f:
        f.write(head)
        for name in order:
            dt, shape = specs[name]
            want, got = math.prod(shape) * np.dtype(dt).itemsize, 0
            for part in parts(name):
                a = np.ascontiguousarray(np.asarray(part))
                if a.dtype != np.dtype(dt):
                    raise FormatError(
                        f"{os.fspath(path)}: tensor {name!r} is {np.dtype(dt).name}, "
                        f"a part of it came as {a.dtype.name}"
                    )
                f.write(a.reshape(-1).view(np.uint8).data)
                got += a.nbytes
            if got != want:
                raise FormatError(
                    f"{os.fspath(path)}: tensor {name!r} {tuple(shape)} needs {want} "
                    f"bytes, its parts gave {got}"
                )


def read_safetensors(
    path: str | os.PathLike[str],
) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """Validate and read a safetensors file: ``({name: array}, metadata)``.

    Arrays are read-only views of a memory map of the file.

    Raises:
        FormatError: a truncated, corrupt or hostile file (the message names it and
            the field).
    """
    path = os.fspath(path)
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise FormatError(f"{path}: {size} bytes is too short for safetensors")
        (n,) = struct.unpack("<Q", head)
        if n > min(size - 8, MAX_HEADER):
            raise FormatError(f"{path}: header length {n} exceeds the file or limit")
        try:
            header = json.loads(f.read(n).decode("utf-8"))
        except (ValueError, RecursionError) as e:
            raise FormatError(f"{path}: header is not JSON: {e}") from None
    if not isinstance(header, dict):
        raise FormatError(f"{path}: header is not a JSON object")
    meta = header.pop("__metadata__", None) or {}
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise FormatError(f"{path}: __metadata__ must map strings to strings")
    n_data = size - 8 - n
    spans, infos = [], {}
    for name, t in header.items():
        where = f"{path}: tensor {name!r}"
        if not isinstance(t, dict) or t.get("dtype") not in ST_DTYPES:
            raise FormatError(f"{where}: dtype must be one of {sorted(ST_DTYPES)}")
        shape: Any = t.get("shape")
        offs: Any = t.get("data_offsets")
        if not isinstance(shape, list) or not all(
            type(s) is int and s >= 0 for s in shape
        ):
            raise FormatError(f"{where}: shape {shape!r} is not a list of ints >= 0")
        ok = isinstance(offs, list) and len(offs) == 2
        if (
            not ok
            or not all(type(o) is int for o in offs)
            or not 0 <= offs[0] <= offs[1]
        ):
            raise FormatError(f"{where}: data_offsets {offs!r} are invalid")
        dt = STORAGE_DTYPES[ST_DTYPES[t["dtype"]]]
        if offs[1] > n_data or offs[1] - offs[0] != math.prod(shape) * dt.itemsize:
            raise FormatError(
                f"{where}: data_offsets {offs} do not fit shape {shape} of "
                f"{t['dtype']} within the {n_data} data bytes"
            )
        spans.append((offs[0], offs[1], name))
        infos[name] = (dt, tuple(shape), int(offs[0]))
    spans.sort()
    for (_, e0, a), (b1, _, b) in itertools.pairwise(spans):
        if b1 < e0:
            raise FormatError(f"{path}: tensors {a!r} and {b!r} overlap")
    mm = np.memmap(path, np.uint8, mode="r") if size else np.zeros(0, np.uint8)
    base = 8 + n
    out = {}
    for name, (dt, shape, off) in infos.items():
        count = math.prod(shape)
        raw = mm[base + off : base + off + count * dt.itemsize]
        out[name] = np.frombuffer(raw, dtype=dt.newbyteorder("<"), count=count).reshape(
            shape
        )
    return out, meta


def mapped_range(view: np.ndarray) -> tuple[mmap.mmap, int, int] | None:
    """``(map, page-aligned start, length)`` of ``view`` in its `mmap.mmap`, or None."""
    base: Any = view
    while isinstance(base, np.ndarray) or isinstance(base, memoryview):
        base = base.obj if isinstance(base, memoryview) else base.base
    if not isinstance(base, mmap.mmap) or not view.nbytes:
        return None
    start = view.ctypes.data - np.frombuffer(base, np.uint8).ctypes.data
    if start < 0 or start + view.nbytes > len(base):
        return None
    lo = start // mmap.PAGESIZE * mmap.PAGESIZE
    return base, lo, start + view.nbytes - lo


def _advise(view: np.ndarray, advice: str) -> None:
    """``madvise`` the ``mmap`` module's ``advice`` over ``view``'s mapped pages.

    A no-op off Linux, where ``mmap`` lacks ``advice``, or where ``view`` is not a
    view of an `mmap.mmap`.
    """
    if not sys.platform.startswith("linux") or not hasattr(mmap, advice):
        return
    where = mapped_range(view)
    if where is not None:
        base, lo, n = where
        base.madvise(getattr(mmap, advice), lo, n)


def release_pages(view: np.ndarray) -> None:
    """Drop the pages of ``view``, a view of a memory-mapped file, from this process.

    A mapped file's pages count in the resident set once read; a streaming load that
    has copied a tensor out calls this so that the file's pages do not add up to the
    model's size. The pages stay in the page cache and are read back if ``view`` is
    used again, so the values never change. A no-op for an array that is not a view of
    an `mmap.mmap` (or on a system without ``MADV_DONTNEED``). A stand-in made of
    such views (``view.parts``: `entrenar.nn.moe_families.ExpertStack`) releases
    each, and drops the stack it made of them (``view.drop()``).
    """
    parts = getattr(view, "parts", None)
    if parts is not None:
        for part in parts:
            release_pages(part)
        drop = getattr(view, "drop", None)
        if drop is not None:
            drop()
        return
    _advise(view, "MADV_DONTNEED")


def header_metadata(md: ModelMetadata) -> dict[str, str]:
    """The ``__metadata__`` strings of a `Model` file (module docstring)."""
    return {
        "format": "entrenar.model",
        "name": md.name,
        "architecture": md.architecture,
        "version": md.version,
        "training_config": json.dumps(md.training_config),
        "custom": json.dumps(md.custom),
    }


def save_model_safetensors(model: Model, path: str | os.PathLike[str]) -> None:
    """Write a `Model` as safetensors (metadata in the header)."""
    save_safetensors(
        flatten_params(model.params), path, header_metadata(model.metadata)
    )


def metadata_from_header(meta: Mapping[str, str], path: str) -> ModelMetadata:
    """The `ModelMetadata` stored in a safetensors header's ``__metadata__`` strings.

    ``name``, ``architecture`` and ``version`` are strings; ``training_config`` and
    ``custom`` are JSON (a `FormatError` naming ``path`` and the key if not). Keys a
    file written by another library lacks stay at their defaults.
    """
    fields: dict[str, Any] = {
        k: meta[k] for k in ("name", "architecture", "version") if k in meta
    }
    for k in ("training_config", "custom"):
        if k in meta:
            try:
                fields[k] = json.loads(meta[k])
            except (ValueError, RecursionError):
                raise FormatError(f"{path}: metadata {k!r} is not JSON") from None
    return ModelMetadata.from_dict(fields, path)


def load_model_safetensors(path: str | os.PathLike[str]) -> Model:
    """Read a safetensors file as a `Model` (any names; metadata if entrenar's)."""
    tensors, meta = read_safetensors(path)
    metadata = metadata_from_header(meta, os.fspath(path))
    return Model(
        metadata, unflatten_params({k: np.array(v) for k, v in tensors.items()})
    )


__all__ = [
    "ST_ORDER",
    "TensorParts",
    "header_metadata",
    "load_model_safetensors",
    "mapped_range",
    "read_safetensors",
    "release_pages",
    "safetensors_header",
    "save_model_safetensors",
    "save_safetensors",
    "write_safetensors_stream",
]
