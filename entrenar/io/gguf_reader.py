"""A validating GGUF reader (format versions 2 and 3, little-endian).

Layout (all integers little-endian)::

    magic "GGUF" | version u32 | n_tensors u64 | n_kv u64
    n_kv × (key: string, type: u32, value)
    n_tensors × (name: string, n_dims u32, ne[n_dims] u64, ggml_type u32, offset u64)
    padding to `alignment` (metadata ``general.alignment``, default 32)
    tensor data; tensor ``i`` starts at data_start + offset_i (a multiple of alignment)

A string is ``u64 length`` + UTF-8 bytes; an array is ``item_type u32, count u64`` and
the items. ``ne[0]`` is the row length, so the numpy shape is ``ne`` reversed.

Every count, length, dimension and offset is checked against the bytes left in the
file before anything is allocated, so a truncated or hostile file raises
`entrenar.errors.FormatError` naming the file and the field. Tensor data is not read
until asked for: the file is memory-mapped and `GGUFFile.raw` returns a view.
"""

from __future__ import annotations

import enum
import math
import mmap
import os
import struct
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from entrenar.errors import FormatError, UnsupportedError
from entrenar.io.ggml_dequant import dequantize_ggml, ggml_type

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4
_MAX_DEPTH = 3  # arrays of arrays of arrays at most


class GGUFValueType(enum.IntEnum):
    """Type tags of GGUF metadata values."""

    UINT8 = 0
    INT8 = 1
    UINT16 = 2
    INT16 = 3
    UINT32 = 4
    INT32 = 5
    FLOAT32 = 6
    BOOL = 7
    STRING = 8
    ARRAY = 9
    UINT64 = 10
    INT64 = 11
    FLOAT64 = 12


SCALAR_FORMATS: dict[GGUFValueType, str] = {
    GGUFValueType.UINT8: "<B",
    GGUFValueType.INT8: "<b",
    GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I",
    GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f",
    GGUFValueType.BOOL: "<B",
    GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q",
    GGUFValueType.FLOAT64: "<d",
}
"""`struct` format of each fixed-size value type."""
_U64 = struct.Struct("<Q")


class GGUFField:
    """One metadata value with its GGUF type (``item_type`` for arrays).

    A vocabulary read from a file (a string array of `FAST_STRINGS` items or more
    whose strings `_chain` finds at once) keeps its checked bytes and is decoded the
    first time ``value`` is read, as the ``gguf`` package's reader decodes a field
    when asked for its contents: a load that never builds the tokenizer does not
    make its 10^5 strings (SmolLM2's 49,152 tokens and 48,900 merges: 15-25 ms in
    a new process). The values are the same either way, and decoding cannot fail
    (the file's structure was checked when it was read).
    """

    __slots__ = ("_decode", "_value", "item_type", "type")

    def __init__(
        self,
        value: Any,
        type: GGUFValueType,
        item_type: GGUFValueType | None = None,
    ) -> None:
        self._value: Any = value
        self._decode: Callable[[], Any] | None = None
        self.type = type
        self.item_type = item_type

    @classmethod
    def deferred(
        cls, decode: Callable[[], Any], type: GGUFValueType, item_type: GGUFValueType
    ) -> GGUFField:
        """A field whose value is ``decode()``, called at the first read of it."""
        f = cls(None, type, item_type)
        f._decode = decode
        return f

    @property
    def value(self) -> Any:
        """The value (a deferred one decoded now, once)."""
        decode = self._decode
        if decode is not None:  # two threads may both decode: the same list
            self._value = decode()
            self._decode = None
        return self._value

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, GGUFField):
            return NotImplemented
        return (self.value, self.type, self.item_type) == (
            other.value,
            other.type,
            other.item_type,
        )

    __hash__ = None  # type: ignore[assignment]  # a value may be a list

    def __repr__(self) -> str:
        lazy = " (not decoded yet)" if self._decode is not None else ""
        value = "..." if lazy else repr(self._value)
        return f"GGUFField({value}, {self.type!r}, {self.item_type!r}){lazy}"


class GGUFMetadata(Mapping[str, Any]):
    """Metadata values by key (without their types), read-only.

    A deferred vocabulary is decoded when its key is read (`GGUFField`).
    """

    def __init__(self, fields: Mapping[str, GGUFField]) -> None:
        self._fields = fields

    def __getitem__(self, key: str) -> Any:
        return self._fields[key].value

    def __iter__(self) -> Iterator[str]:
        return iter(self._fields)

    def __len__(self) -> int:
        return len(self._fields)

    def __repr__(self) -> str:
        return f"GGUFMetadata({list(self._fields)})"


@dataclass(frozen=True)
class GGUFTensorInfo:
    """Where one tensor lies: numpy ``shape``, ggml type, absolute ``offset``, bytes."""

    name: str
    shape: tuple[int, ...]
    type_id: int
    offset: int
    nbytes: int

    @property
    def type_name(self) -> str:
        """The ggml type name, e.g. ``"Q4_1"``."""
        return ggml_type(self.type_id).name


@dataclass(frozen=True)
class GGUFFile:
    """A parsed GGUF file: metadata, tensor infos and a memory map of the data."""

    path: str
    version: int
    fields: dict[str, GGUFField]
    tensors: dict[str, GGUFTensorInfo]
    alignment: int
    data_offset: int
    _data: np.ndarray = field(repr=False)

    @property
    def metadata(self) -> GGUFMetadata:
        """Metadata values by key (without their types), each decoded when read."""
        return GGUFMetadata(self.fields)

    def info(self, name: str) -> GGUFTensorInfo:
        """The `GGUFTensorInfo` of ``name``; `KeyError`-like `FormatError` if absent."""
        if name not in self.tensors:
            raise FormatError(f"{self.path}: no tensor named {name!r}")
        return self.tensors[name]

    def raw(self, name: str) -> np.ndarray:
        """The tensor's stored bytes, a read-only uint8 view into the file."""
        t = self.info(name)
        return self._data[t.offset : t.offset + t.nbytes]

    def read_into(
        self, name: str, out: np.ndarray, fd: int | None = None
    ) -> np.ndarray:
        """Read the tensor's stored bytes from the file into ``out`` and return it.

        ``out``: a C-contiguous array of exactly the tensor's bytes (any dtype).
        Plain ``pread`` calls, not the memory map: a cold file is read in large
        requests, and no mapped page stays in the resident set. ``fd``: the file
        open for reading (a load reading many tensors opens it once), else it is
        opened for this call.
        """
        t = self.info(name)
        if not out.flags.c_contiguous or out.nbytes != t.nbytes:
            raise FormatError(
                f"{self.path}: tensor {name!r} has {t.nbytes} bytes, the buffer "
                f"{out.nbytes}{'' if out.flags.c_contiguous else ' (not contiguous)'}"
            )
        view = out.reshape(-1).view(np.uint8).data  # its bytes, writable
        own = fd is None
        fd = os.open(self.path, os.O_RDONLY) if fd is None else fd
        try:
            done = 0
            while done < t.nbytes:
                n = os.preadv(fd, [view[done:]], t.offset + done)
                if n <= 0:
                    raise FormatError(
                        f"{self.path}: tensor {name!r} ends early: the file is "
                        f"truncated or was changed while reading"
                    )
                done += n
        finally:
            if own:
                os.close(fd)
        return out

    def tensor(self, name: str) -> np.ndarray:
        """The tensor dequantized to float32, in numpy shape order."""
        t = self.info(name)
        return dequantize_ggml(self.raw(name), t.type_id, t.shape)


class _Cursor:
    """Reads little-endian values from a buffer, checking each length first."""

    def __init__(self, buf: Any, size: int, path: str) -> None:
        self.buf, self.size, self.path, self.pos = buf, size, path, 0

    def fail(self, what: str, msg: str) -> FormatError:
        return FormatError(f"{self.path}: {what}: {msg} (at byte {self.pos})")

    def need(self, n: int, what: str) -> None:
        if n < 0 or self.pos + n > self.size:
            raise self.fail(
                what, f"needs {n} bytes but only {self.size - self.pos} remain"
            )

    def scalar(self, vtype: GGUFValueType, what: str) -> Any:
        fmt = SCALAR_FORMATS[vtype]
        n = struct.calcsize(fmt)
        self.need(n, what)
        (v,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += n
        return bool(v) if vtype == GGUFValueType.BOOL else v

    def u32(self, what: str) -> int:
        return int(self.scalar(GGUFValueType.UINT32, what))

    def u64(self, what: str) -> int:
        return int(self.scalar(GGUFValueType.UINT64, what))

    def string(self, what: str) -> str:
        n = self.u64(f"{what} length")
        self.need(n, what)
        b = bytes(self.buf[self.pos : self.pos + n])
        self.pos += n
        return b.decode("utf-8", errors="surrogateescape")

    def strings(self, count: int, what: str) -> list[str]:
        """``count`` strings, as ``string`` reads each (the same checks)."""
        buf, pos, size, out = self.buf, self.pos, self.size, []
        length = _U64.unpack_from
        for _ in range(count):
            if pos + 8 > size:
                self.pos = pos
                self.need(8, f"{what} length")
            (n,) = length(buf, pos)
            pos += 8
            if pos + n > size:
                self.pos = pos
                self.need(n, what)
            out.append(str(buf[pos : pos + n], "utf-8", "surrogateescape"))
            pos += n
        self.pos = pos
        return out

    def vtype(self, what: str) -> GGUFValueType:
        v = self.u32(what)
        try:
            return GGUFValueType(v)
        except ValueError:
            raise self.fail(what, f"unknown value type {v}") from None

    def value(self, vtype: GGUFValueType, what: str, depth: int = 0) -> GGUFField:
        if vtype == GGUFValueType.STRING:
            return GGUFField(self.string(what), vtype)
        if vtype != GGUFValueType.ARRAY:
            return GGUFField(self.scalar(vtype, what), vtype)
        if depth >= _MAX_DEPTH:
            raise self.fail(what, f"arrays nested deeper than {_MAX_DEPTH}")
        item = self.vtype(f"{what} item type")
        count = self.u64(f"{what} count")
        if item in SCALAR_FORMATS:
            n = struct.calcsize(SCALAR_FORMATS[item])
            self.need(count * n, f"{what} ({count} items)")
            a = np.frombuffer(self.buf, SCALAR_FORMATS[item], count, self.pos)
            self.pos += count * n
            vals = a.astype(bool) if item == GGUFValueType.BOOL else a
            return GGUFField(vals.tolist(), vtype, item)
        # Strings take >= 8 bytes each, arrays >= 12: bound count before looping.
        self.need(count * (8 if item == GGUFValueType.STRING else 12), what)
        if item == GGUFValueType.STRING:  # a vocabulary: 10^5 strings
            found = _chain(self.buf, self.pos, self.size, count)
            if found is None:  # short, or strings `_chain` does not read: one by one
                return GGUFField(self.strings(count, what), vtype, item)
            end, bytes_, start, stop = found
            self.pos += end
            return GGUFField.deferred(lambda: _decode(bytes_, start, stop), vtype, item)
        items = [self.value(item, what, depth + 1).value for _ in range(count)]
        return GGUFField(items, vtype, item)


FAST_STRINGS = 1024
"""String arrays this long or longer try `_chain` first (and are decoded lazily)."""
FAST_WINDOW = 64 << 20
"""Most bytes `_chain` looks at (a vocabulary is a few MB)."""


def _chain(
    buf: Any, pos: int, size: int, count: int
) -> tuple[int, np.ndarray, np.ndarray, np.ndarray] | None:
    """``count`` strings of up to 255 bytes each at ``pos``, found without a loop.

    A string of length ``n < 256`` starts with the 8 bytes ``n, 0, ..., 0``. Every
    position of a window followed by seven zero bytes is a candidate (numpy over the
    bytes); the array is these strings exactly when the first ``count`` candidates
    chain, each starting where the one before ends (``start[i+1] = start[i] + 8 +
    n[i]``), from ``pos``, inside the file: the positions a one-by-one read visits.
    Finding SmolLM2's 49,152 tokens took 1.3 ms this way (both its arrays 4-8 ms
    in a new process); reading and decoding them one by one took 16 ms.

    Returns:
        ``(end, data, start, stop)``: the array's bytes end ``end`` bytes after
        ``pos``; ``data`` is a copy of them (uint8), string ``i`` is ``data[start[i]
        + 8 : stop[i]]`` (`_decode` makes the strings). None (the caller then reads
        one at a time, with its checks and errors): an array shorter than
        `FAST_STRINGS`, a string of 256 bytes or more, an empty string, or bytes
        missing.
    """
    if count < FAST_STRINGS:
        return None
    window = min(size - pos, count * 20, FAST_WINDOW)  # grown if short
    while window >= 8 * count:
        data = np.frombuffer(buf, np.uint8, window, pos)  # (window,)
        # the little-endian u64 at every byte offset: (window - 7,), a byte apart
        u64 = np.ndarray((window - 7,), "<u8", data, 0, (1,))
        short = u64 < 256  # (window - 7,) bytes p+1..p+7 all zero: a candidate
        found = int(np.count_nonzero(short))
        if found > 4 * count + 4096:  # not text; the loop reads it
            return None
        if found >= count:
            start = np.flatnonzero(short)[:count]  # (count,) candidate starts
            stop = start + 8 + data[start].astype(np.int64)  # (count,) their ends
            if start[0] != 0 or not np.array_equal(start[1:], stop[:-1]):
                return None  # not a chain: long or empty strings
            end = int(stop[-1])
            if end <= window:  # a copy: the strings outlive the map
                return end, data[:end].copy(), start, stop
        if window == min(size - pos, FAST_WINDOW):
            return None
        window = min(size - pos, window * 2, FAST_WINDOW)
    return None


def _decode(data: np.ndarray, start: np.ndarray, stop: np.ndarray) -> list[str]:
    """The chained strings ``data[start[i] + 8 : stop[i]]`` (`_chain`), decoded.

    As ``_Cursor.string`` decodes each (UTF-8, undecodable bytes kept as
    surrogates), at once where it can: each string keeps the last of its 8 length
    bytes, a zero, so the bytes become ``0, s_0, 0, s_1, ...``, decoded together
    and split at the zeros. Valid when no string holds a zero byte (checked) and the
    whole is valid UTF-8 (a zero is ASCII, so no character crosses it); otherwise
    one string at a time.
    """
    end, count = int(stop[-1]), len(start)
    keep = np.ones(end, bool)  # (end,) False on length bytes 0..6 of each string
    for k in range(7):
        keep[start + k] = False
    joined = data[keep]  # (end - 7 count,) 0, s_0, 0, s_1, ...
    if np.count_nonzero(joined == 0) == count:  # no string holds a zero byte
        try:
            return joined.tobytes().decode("utf-8").split("\0")[1:]
        except UnicodeDecodeError:
            pass
    raw = data.tobytes()
    return [
        str(raw[a + 8 : b], "utf-8", "surrogateescape")
        for a, b in zip(start.tolist(), stop.tolist(), strict=True)
    ]


def _tensor_info(cur: _Cursor, i: int) -> tuple[str, tuple[int, ...], int, int, int]:
    name = cur.string(f"tensor {i} name")
    what = f"tensor {name!r}"
    n_dims = cur.u32(f"{what} n_dims")
    if not 1 <= n_dims <= MAX_DIMS:
        raise cur.fail(what, f"n_dims {n_dims} is not in 1..{MAX_DIMS}")
    ne = [cur.u64(f"{what} ne[{d}]") for d in range(n_dims)]
    type_id = cur.u32(f"{what} type")
    try:
        t = ggml_type(type_id)
    except FormatError:
        raise cur.fail(what, f"unknown ggml type {type_id}") from None
    offset = cur.u64(f"{what} offset")
    if ne[0] % t.block_size:
        raise cur.fail(what, f"ne[0]={ne[0]} not a multiple of {t.name}'s block size")
    n_rows = math.prod(ne[1:])
    nbytes = n_rows * (ne[0] // t.block_size * t.type_size)
    if nbytes > cur.size:
        raise cur.fail(what, f"shape {ne} needs {nbytes} bytes, more than the file")
    return name, tuple(reversed(ne)), type_id, offset, nbytes


def read_gguf(path: str | os.PathLike[str]) -> GGUFFile:
    """Parse and validate the GGUF file at ``path`` (tensor data is memory-mapped).

    Raises:
        FormatError: not a GGUF file, or a truncated, corrupt or hostile one; the
            message names the file and the field.
        UnsupportedError: a GGUF version other than 2 or 3.
    """
    path = os.fspath(path)
    size = os.path.getsize(path)
    if size < 24:
        raise FormatError(f"{path}: {size} bytes is too short for a GGUF header")
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    cur = _Cursor(mm, size, path)
    if mm[:4] != GGUF_MAGIC:
        raise FormatError(f"{path}: magic {mm[:4]!r} is not {GGUF_MAGIC!r}; not GGUF")
    cur.pos = 4
    version = cur.u32("version")
    if version not in (2, 3):
        raise UnsupportedError(
            f"{path}: GGUF version {version} is not supported (only 2 and 3, "
            "little-endian); convert the file with a recent llama.cpp"
        )
    n_tensors = cur.u64("tensor_count")
    n_kv = cur.u64("kv_count")
    # Each KV takes >= 12 bytes and each tensor info >= 28: bound before looping.
    cur.need(
        n_kv * 12 + n_tensors * 28, f"{n_kv} metadata entries, {n_tensors} tensors"
    )
    fields: dict[str, GGUFField] = {}
    for i in range(n_kv):
        key = cur.string(f"metadata key {i}")
        if key in fields:
            raise cur.fail(f"metadata key {key!r}", "appears twice")
        fields[key] = cur.value(cur.vtype(f"{key!r} type"), f"metadata {key!r}")
    alignment = DEFAULT_ALIGNMENT
    if "general.alignment" in fields:
        a = fields["general.alignment"]
        if a.type != GGUFValueType.UINT32 or a.value <= 0 or a.value & (a.value - 1):
            raise cur.fail("general.alignment", f"{a.value!r} is not a power of two")
        alignment = int(a.value)
    infos = [_tensor_info(cur, i) for i in range(n_tensors)]
    data_offset = -(-cur.pos // alignment) * alignment
    tensors: dict[str, GGUFTensorInfo] = {}
    for name, shape, type_id, offset, nbytes in infos:
        if name in tensors:
            raise FormatError(f"{path}: tensor {name!r} appears twice")
        if offset % alignment:
            raise FormatError(
                f"{path}: tensor {name!r} offset {offset} is not a multiple of the "
                f"alignment {alignment}"
            )
        start = data_offset + offset
        if start + nbytes > size:
            raise FormatError(
                f"{path}: tensor {name!r} data [{start}, {start + nbytes}) lies past "
                f"the end of the file ({size} bytes); the file is truncated"
            )
        tensors[name] = GGUFTensorInfo(name, shape, type_id, start, nbytes)
    data = np.frombuffer(mm, dtype=np.uint8)
    return GGUFFile(path, version, fields, tensors, alignment, data_offset, data)


__all__ = [
    "GGUFField",
    "GGUFFile",
    "GGUFMetadata",
    "GGUFTensorInfo",
    "GGUFValueType",
    "read_gguf",
]
