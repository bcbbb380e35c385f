"""`save_model` / `load_model`: one entry point over JSON, YAML, safetensors, GGUF.

The format is read from the file's magic bytes (``GGUF``; an 8-byte length then
``{`` for safetensors; ``{`` for JSON), falling back to the extension (``.yaml``,
``.yml``). A GGUF written from a model that is not a Llama ("generic GGUF") stores
each tensor by its dotted name in its own dtype (F32, F16, BF16, F64, I8..I64) and
the metadata as ``general.name``, ``general.architecture``, ``entrenar.version``,
``entrenar.training_config`` and ``entrenar.custom`` (JSON strings).
"""

from __future__ import annotations

import dataclasses
import json
import os
import struct
from typing import Any

import numpy as np

from entrenar import nn
from entrenar.errors import EntrenarError, FormatError, UnsupportedError
from entrenar.io.bounded import read_json
from entrenar.io.deepseek_gguf import NAME as DEEPSEEK
from entrenar.io.deepseek_gguf import deepseek_family
from entrenar.io.gguf_families import FAMILY_KEY, MOE_FAMILIES, SHARED_MLP
from entrenar.io.gguf_reader import GGUFField, GGUFFile, GGUFValueType, read_gguf
from entrenar.io.gguf_writer import GGUFTensor, write_gguf
from entrenar.io.json_yaml import load_json, load_yaml, save_json, save_yaml
from entrenar.io.llama_gguf_write import save_llama_gguf
from entrenar.io.model import (
    STORAGE_DTYPES,
    Model,
    ModelFormat,
    ModelMetadata,
    SaveConfig,
    flatten_params,
    unflatten_params,
)
from entrenar.io.safetensors_io import load_model_safetensors, save_model_safetensors
from entrenar.nn import LlamaConfig, multimodal
from entrenar.types import Params

# numpy dtype name <-> ggml type id for generic GGUF tensors.
_GGUF_DTYPES = {
    "float32": 0,
    "float16": 1,
    "bfloat16": 30,
    "int8": 24,
    "int16": 25,
    "int32": 26,
    "int64": 27,
    "float64": 28,
}
_GGUF_IDS = {v: k for k, v in _GGUF_DTYPES.items()}
_EXT = {
    ".json": ModelFormat.JSON,
    ".yaml": ModelFormat.YAML,
    ".yml": ModelFormat.YAML,
    ".safetensors": ModelFormat.SAFETENSORS,
    ".gguf": ModelFormat.GGUF,
}


def disk_bytes(path: str) -> int:
    """Bytes ``path`` takes: a file's size, or the sum of a folder's files' sizes."""
    if not os.path.isdir(path):
        return os.path.getsize(path)
    return sum(
        os.path.getsize(os.path.join(root, name))
        for root, _, names in os.walk(path)
        for name in names
    )


def detect_format(path: str | os.PathLike[str]) -> ModelFormat:
    """The `ModelFormat` of an existing file, by magic bytes, then by extension.

    Raises:
        FormatError: neither the content nor the extension names a format.
    """
    path = os.fspath(path)
    with open(path, "rb") as f:
        head = f.read(9)
    if head[:4] == b"GGUF":
        return ModelFormat.GGUF
    if len(head) == 9 and head[8:9] == b"{":
        (n,) = struct.unpack("<Q", head[:8])
        if 0 < n <= os.path.getsize(path) - 8:
            return ModelFormat.SAFETENSORS
    ext = os.path.splitext(path)[1].lower()
    if ext in (".yaml", ".yml"):
        return ModelFormat.YAML
    if head.lstrip()[:1] == b"{":
        return ModelFormat.JSON
    if ext in _EXT:
        return _EXT[ext]
    raise FormatError(
        f"{path}: cannot tell the format from the content or extension; use .json, "
        ".yaml, .safetensors or .gguf"
    )


def _gguf_family(g: GGUFFile) -> str | None:
    """The registered family of a llama.cpp GGUF (None: not one entrenar reads)."""
    name = g.metadata.get("general.architecture")
    try:
        arch = nn.architecture_for_gguf(str(name), g.path)
        family = json.loads(str(g.metadata.get(FAMILY_KEY, "{}"))).get("architecture")
    except (EntrenarError, ValueError, AttributeError, RecursionError):
        return None
    if isinstance(family, str) and family in nn.architecture_names():
        return family
    if name == DEEPSEEK:  # V2 (softmax gating) or V3 (sigmoid)
        return deepseek_family(g.metadata)
    experts = g.metadata.get(f"{name}.expert_count")
    shared = g.metadata.get(f"{name}.expert_shared_feed_forward_length")
    if isinstance(shared, int) and shared > 0 and name in SHARED_MLP:
        return SHARED_MLP[str(name)]  # Granite MoE shared, written as granitemoe
    if isinstance(experts, int) and experts > 0 and name in MOE_FAMILIES:
        return MOE_FAMILIES[str(name)]  # llama.cpp writes Mixtral as llama
    return arch.name


def file_architecture(path: str) -> str | None:
    """The architecture a model file declares, read from its header only.

    A Hugging Face folder's ``config.json`` ``model_type`` and a llama.cpp GGUF's
    ``general.architecture`` name a registered family (`entrenar.nn`'s registry);
    an entrenar file says so in its metadata. None when it cannot be told cheaply
    (the model is then checked once it is loaded).
    """
    if os.path.isdir(path):
        try:
            hf = read_json(os.path.join(path, "config.json"))
            if not isinstance(hf, dict):
                return None
            if multimodal.wrapper(hf.get("model_type")) is not None:
                hf = multimodal.text_config(hf, path)  # its language model's family
            return nn.architecture_for_hf(hf, path).name
        except EntrenarError:
            return None
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            if head[:4] == b"GGUF":
                g = read_gguf(path)
                arch = g.metadata.get("general.architecture")
                return str(arch) if "entrenar.version" in g.fields else _gguf_family(g)
            (n,) = struct.unpack("<Q", head) if len(head) == 8 else (0,)
            if not 0 < n <= min(os.path.getsize(path) - 8, 1 << 26):
                return None
            header = json.loads(f.read(n))
    except (OSError, ValueError, RecursionError, struct.error):
        return None
    meta = header.get("__metadata__") if isinstance(header, dict) else None
    arch = meta.get("architecture") if isinstance(meta, dict) else None
    return arch if arch in nn.architecture_names() else None


def _save_generic_gguf(model: Model, path: str | os.PathLike[str]) -> None:
    md, s = model.metadata, GGUFValueType.STRING
    fields = {
        "general.architecture": GGUFField(md.architecture, s),
        "general.name": GGUFField(md.name, s),
        "entrenar.version": GGUFField(md.version, s),
        "entrenar.training_config": GGUFField(json.dumps(md.training_config), s),
        "entrenar.custom": GGUFField(json.dumps(md.custom), s),
    }
    tensors = {}
    for name, a in flatten_params(model.params).items():
        if a.dtype.name not in _GGUF_DTYPES or not 1 <= a.ndim <= 4:
            raise UnsupportedError(
                f"GGUF stores 1-4 dim tensors of {sorted(_GGUF_DTYPES)}; {name!r} is "
                f"{a.dtype} of shape {a.shape} (use safetensors)"
            )
        raw = np.ascontiguousarray(a).view(np.uint8).reshape(-1)
        tensors[name] = GGUFTensor(raw, a.shape, _GGUF_DTYPES[a.dtype.name])
    write_gguf(path, fields, tensors)


def _load_gguf(path: str) -> Model:
    g = read_gguf(path)
    family = None if "entrenar.version" in g.fields else _gguf_family(g)
    if family is not None and nn.architecture(family).config_class is LlamaConfig:
        from entrenar.io.llama_gguf import load_llama_gguf

        config, params, _ = load_llama_gguf(g)
        meta = ModelMetadata(
            name=str(g.metadata.get("general.name", family)),
            architecture=family,
            custom={"llama_config": dataclasses.asdict(config), "gguf_source": path},
        )
        return Model(meta, params)
    md: dict[str, Any] = {}
    for key, k in (("general.name", "name"), ("general.architecture", "architecture")):
        if key in g.fields:
            md[k] = g.fields[key].value
    if "entrenar.version" in g.fields:
        md["version"] = g.fields["entrenar.version"].value
    for k in ("training_config", "custom"):
        if f"entrenar.{k}" in g.fields:
            try:
                md[k] = json.loads(g.fields[f"entrenar.{k}"].value)
            except (ValueError, TypeError, RecursionError):
                raise FormatError(f"{path}: entrenar.{k} is not JSON") from None
    flat = {}
    for name, t in g.tensors.items():
        if t.type_id in _GGUF_IDS:
            dt = STORAGE_DTYPES[_GGUF_IDS[t.type_id]]
            flat[name] = np.frombuffer(g.raw(name), dt.newbyteorder("<")).reshape(
                t.shape
            )
        else:
            flat[name] = g.tensor(name)  # quantized: dequantized to float32
    return Model(ModelMetadata.from_dict(md, path), unflatten_params(flat))


def save_model(
    model: Model | Params,
    path: str | os.PathLike[str],
    config: SaveConfig | None = None,
) -> None:
    """Write ``model`` to ``path`` in ``config.format`` (atomically).

    ``model`` is a `Model` or a bare params tree (nested dicts and lists of arrays),
    saved with the default `ModelMetadata`. Without a ``config`` the format is the
    one ``path``'s extension names (``.json``, ``.yaml``/``.yml``, ``.safetensors``,
    ``.gguf``), safetensors for any other; a ``config`` is followed as given.

    A model with ``custom["llama_config"]`` (as `load_model` returns for a llama.cpp
    GGUF of any `LlamaConfig` family) is written to GGUF as a llama.cpp model
    (`entrenar.io.save_llama_gguf`, tensors in ``config.gguf_tensor_type``, metadata
    and tokenizer from ``config.gguf_source`` or ``custom["gguf_source"]``); any
    other model as a generic GGUF.
    """
    if isinstance(model, dict | list | tuple):
        model = Model(ModelMetadata(), model)
    elif not isinstance(model, Model):
        raise TypeError(
            f"save_model takes an entrenar.io.Model or a params tree (dicts and lists "
            f"of arrays), not {type(model).__name__}"
        )
    if config is None:
        ext = os.path.splitext(os.fspath(path))[1].lower()
        config = SaveConfig(_EXT.get(ext, ModelFormat.SAFETENSORS))
    fmt = ModelFormat(config.format)
    if fmt == ModelFormat.JSON:
        save_json(model, path, config.pretty)
    elif fmt == ModelFormat.YAML:
        save_yaml(model, path, config.pretty)
    elif fmt == ModelFormat.SAFETENSORS:
        save_model_safetensors(model, path)
    elif isinstance(model.metadata.custom.get("llama_config"), dict):
        custom = model.metadata.custom
        save_llama_gguf(
            path,
            LlamaConfig(**custom["llama_config"]),
            model.params,
            source=config.gguf_source or custom.get("gguf_source"),
            tensor_type=config.gguf_tensor_type,
            name=model.metadata.name,
        )
    else:
        _save_generic_gguf(model, path)


def load_model(path: str | os.PathLike[str]) -> Model:
    """Read a model file in any `ModelFormat` (detected by `detect_format`).

    Raises:
        FormatError: an unknown, truncated, corrupt or hostile file, naming the file
            and the field.
    """
    path = os.fspath(path)
    fmt = detect_format(path)
    if fmt == ModelFormat.GGUF:
        return _load_gguf(path)
    if fmt == ModelFormat.SAFETENSORS:
        return load_model_safetensors(path)
    if fmt == ModelFormat.YAML:
        return load_yaml(path)
    return load_json(path)


__all__ = ["detect_format", "file_architecture", "load_model", "save_model"]
