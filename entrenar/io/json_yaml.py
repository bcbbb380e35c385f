"""JSON and YAML model files: readable, exact, for small models.

Both hold the same document::

    format: entrenar.model
    format_version: 1
    metadata: {name, architecture, version, training_config, custom}
    tensors:
      <dotted name>: {dtype: float32, shape: [2, 3], data: [[...], [...]]}

``data`` is nested lists in the tensor's shape (a 0-d tensor is a bare number).
Floats are written with Python's shortest round-trip ``repr`` of their float64 value,
which is exact for float16/bfloat16/float32/float64, so loading gives back the same
bits (NaN payloads aside). JSON has no NaN or infinity: they are written as the
strings ``"nan"``, ``"inf"``, ``"-inf"``; YAML writes ``.nan``, ``.inf``, ``-.inf``.
YAML is read with ``yaml.safe_load`` within the limits of `entrenar.io.bounded`
(nesting depth, aliases); the files' sizes are checked first (`MAX_JSON_BYTES`,
`MAX_YAML_BYTES`).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from typing import Any

import numpy as np
import yaml

from entrenar.errors import FormatError
from entrenar.io.atomic import atomic_write
from entrenar.io.bounded import read_json, read_yaml
from entrenar.io.model import (
    STORAGE_DTYPES,
    Model,
    ModelMetadata,
    flatten_params,
    unflatten_params,
)

FORMAT_NAME = "entrenar.model"
FORMAT_VERSION = 1
_MAX_RANK = 8
MAX_JSON_BYTES = 1 << 30
"""Size limit of a JSON model file (1 GiB; larger models belong in safetensors)."""
MAX_YAML_BYTES = 64 << 20
"""Size limit of a YAML model file (64 MiB: the YAML parser is pure Python)."""


def _json_safe(x: Any) -> Any:
    """Replace non-finite floats in nested lists by strings."""
    if isinstance(x, list):
        return [_json_safe(v) for v in x]
    if isinstance(x, float) and not math.isfinite(x):
        return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")
    return x


def _document(model: Model, json_mode: bool) -> dict[str, Any]:
    tensors = {}
    for name, a in flatten_params(model.params).items():
        values = a.astype(np.float32) if a.dtype.name == "bfloat16" else a
        data = values.tolist()  # bfloat16's numpy kind is "V": test the float32 copy
        if json_mode and values.dtype.kind == "f" and not np.isfinite(values).all():
            data = _json_safe(data)
        tensors[name] = {"dtype": a.dtype.name, "shape": list(a.shape), "data": data}
    return {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "metadata": model.metadata.to_dict(),
        "tensors": tensors,
    }


def save_json(model: Model, path: str | os.PathLike[str], pretty: bool = False) -> None:
    """Write ``model`` as JSON, atomically."""
    doc = _document(model, json_mode=True)
    with atomic_write(path, "w") as f:
        json.dump(doc, f, indent=1 if pretty else None, allow_nan=False)


def save_yaml(model: Model, path: str | os.PathLike[str], pretty: bool = False) -> None:
    """Write ``model`` as YAML, atomically (data rows in flow style)."""
    doc = _document(model, json_mode=False)
    with atomic_write(path, "w") as f:
        yaml.safe_dump(doc, f, sort_keys=False, default_flow_style=None, width=120)


def _check_nested(data: Any, shape: list[int], where: str) -> list[Any]:
    """Check nested lists have exactly ``shape``, level by level (no recursion).

    Returns:
        The ``prod(shape)`` values, flat, in row-major order.
    """
    level = [data]
    for depth, n in enumerate(shape):
        nxt: list[Any] = []
        for x in level:
            if not isinstance(x, list) or len(x) != n:
                got = len(x) if isinstance(x, list) else type(x).__name__
                raise FormatError(f"{where}: data at depth {depth} is {got}, want {n}")
            nxt.extend(x)
        level = nxt
    for x in level:
        if isinstance(x, (list, dict)):
            raise FormatError(f"{where}: data nests deeper than shape {shape}")
    return level


NON_FINITE = frozenset({"nan", "inf", "-inf"})
"""Strings that stand for non-finite floats (JSON has no literal for them)."""


def _allowed(kind: str) -> tuple[set[type], str]:
    """Python types a tensor of dtype kind ``kind`` may hold, and their description."""
    if kind == "b":
        return {bool}, "true or false"
    if kind in "iu":
        return {int}, "integers"
    return {int, float, str}, 'numbers (or "nan", "inf", "-inf")'


def _check_values(values: list[Any], dtype: str, where: str) -> None:
    """Each value is of a Python type ``dtype`` takes: no null, no bool as a number.

    ``true`` or ``2.7`` in an integer tensor, ``null`` in a float one (numpy would
    make them 1, 2 and NaN) are `FormatError`s naming the value's flat index.
    """
    allowed, want = _allowed(STORAGE_DTYPES[dtype].kind)
    kinds = set(map(type, values))
    strings = {x for x in values if type(x) is str} if str in kinds else set()
    if kinds <= allowed and strings <= NON_FINITE:
        return
    i, x = next(
        (i, x)
        for i, x in enumerate(values)
        if type(x) not in allowed or (type(x) is str and x not in NON_FINITE)
    )
    got = "null" if x is None else f"{str(x)[:40]!r} ({type(x).__name__})"
    raise FormatError(
        f"{where}: value {i} (row-major) is {got}; dtype {dtype} holds only {want}"
    )


def _tensor(name: str, t: Any, path: str, budget: int) -> np.ndarray:
    where = f"{path}: tensor {name!r}"
    if not isinstance(t, Mapping) or set(t) != {"dtype", "shape", "data"}:
        raise FormatError(f"{where} must be a mapping with dtype, shape and data")
    dtype, shape = t["dtype"], t["shape"]
    if not isinstance(dtype, str) or dtype not in STORAGE_DTYPES:
        raise FormatError(
            f"{where}: dtype {dtype!r} is not one of {sorted(STORAGE_DTYPES)}"
        )
    if (
        not isinstance(shape, list)
        or len(shape) > _MAX_RANK
        or not all(type(s) is int and s >= 0 for s in shape)
    ):
        raise FormatError(f"{where}: shape {shape!r} must be a list of ints >= 0")
    if math.prod(shape) > budget:
        raise FormatError(f"{where}: shape {shape} has more values than the file")
    _check_values(_check_nested(t["data"], shape, where), dtype, where)
    try:
        with np.errstate(over="raise", invalid="raise"):  # 1e10 as float16: error
            if dtype == "bfloat16":  # written through float32, which parses "inf"
                a = np.array(t["data"], np.float32).astype(STORAGE_DTYPES[dtype])
                return a.reshape(shape)
            return np.array(t["data"], dtype=STORAGE_DTYPES[dtype]).reshape(shape)
    except (ValueError, TypeError, OverflowError, FloatingPointError) as e:
        raise FormatError(f"{where}: data is not {dtype}: {e}") from None


def model_from_document(doc: Any, path: str, budget: int) -> Model:
    """Validate a parsed JSON/YAML document and build the `Model`."""
    if not isinstance(doc, Mapping) or doc.get("format") != FORMAT_NAME:
        raise FormatError(f"{path}: not an entrenar model (format != {FORMAT_NAME!r})")
    if doc.get("format_version") != FORMAT_VERSION:
        raise FormatError(
            f"{path}: format_version {doc.get('format_version')!r} is not "
            f"{FORMAT_VERSION}; upgrade entrenar"
        )
    tensors = doc.get("tensors")
    if not isinstance(tensors, Mapping):
        raise FormatError(f"{path}: 'tensors' must be a mapping of name to tensor")
    meta = ModelMetadata.from_dict(doc.get("metadata", {}), path)
    flat = {str(k): _tensor(str(k), t, path, budget) for k, t in tensors.items()}
    return Model(meta, unflatten_params(flat))


def load_json(path: str | os.PathLike[str]) -> Model:
    """Read a model written by `save_json` (at most `MAX_JSON_BYTES`).

    Raises:
        FormatError: a file too large, not UTF-8, invalid JSON (naming the line and
            column), or a document that does not validate.
    """
    path = os.fspath(path)
    doc = read_json(path, max_bytes=MAX_JSON_BYTES, max_depth=None, what="model file")
    return model_from_document(doc, path, os.path.getsize(path))


def load_yaml(path: str | os.PathLike[str]) -> Model:
    """Read a model written by `save_yaml` (at most `MAX_YAML_BYTES`).

    The YAML is read within `entrenar.io.bounded`'s limits (nesting, aliases).

    Raises:
        FormatError: a file too large, not UTF-8, invalid YAML (naming the line and
            column), a limit exceeded, or a document that does not validate.
    """
    path = os.fspath(path)
    doc = read_yaml(path, max_bytes=MAX_YAML_BYTES, what="model file")
    return model_from_document(doc, path, os.path.getsize(path))


__all__ = ["load_json", "load_yaml", "save_json", "save_yaml"]
