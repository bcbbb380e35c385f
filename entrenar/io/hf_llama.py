"""Hugging Face Llama checkpoints (``config.json`` + safetensors) into `entrenar.nn`.

A checkpoint folder holds ``config.json`` and either ``model.safetensors`` or shards
listed in ``model.safetensors.index.json`` (``{"weight_map": {name: file}}``). The
names (``model.layers.3.self_attn.q_proj.weight``) are entrenar's flattened names, so
`entrenar.nn.from_hf_names` stacks them into the param tree; Hugging Face already uses
the half-split rotary layout, so nothing is permuted.
"""

from __future__ import annotations

import json
import os
from typing import Any

from entrenar.errors import FormatError
from entrenar.io.safetensors_io import read_safetensors
from entrenar.nn import LlamaConfig, from_hf_names
from entrenar.types import Params


def _json(path: str) -> Any:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        raise FormatError(f"{path} is missing") from None
    except (ValueError, RecursionError) as e:
        raise FormatError(f"{path}: invalid JSON: {e}") from None


def _config_and_files(folder: str) -> tuple[LlamaConfig, list[str]]:
    """The folder's `LlamaConfig` and its safetensors files (checked names)."""
    hf = _json(os.path.join(folder, "config.json"))
    if not isinstance(hf, dict):
        raise FormatError(f"{folder}/config.json is not a JSON object")
    config = LlamaConfig.from_hf_config(hf)
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.exists(index):
        weight_map = _json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise FormatError(f"{index}: 'weight_map' must map names to files")
        files = sorted({str(v) for v in weight_map.values()})
    else:
        files = ["model.safetensors"]
    for name in files:
        if os.path.basename(name) != name:
            raise FormatError(f"{index}: shard name {name!r} must be a plain file name")
    return config, [os.path.join(folder, name) for name in files]


def read_hf_llama_header(folder: str | os.PathLike[str]) -> LlamaConfig:
    """The `LlamaConfig` of a checkpoint folder, its files checked, no tensor read.

    ``config.json``, the shard index and each safetensors file's header are
    validated (`read_safetensors` maps the data without reading it).

    Raises:
        FormatError: missing or invalid files.
    """
    config, files = _config_and_files(os.fspath(folder))
    for file in files:
        read_safetensors(file)
    return config


def load_hf_llama(
    folder: str | os.PathLike[str], *, dtype: str | None = None
) -> tuple[LlamaConfig, Params]:
    """Load a Hugging Face ``LlamaForCausalLM`` checkpoint folder.

    Args:
        folder: holds ``config.json`` and ``model.safetensors`` (or sharded files
            with ``model.safetensors.index.json``).
        dtype: cast every parameter to this dtype; None keeps the stored dtypes.

    Returns:
        ``(config, params)`` with the stacked param tree of ``config``.

    Raises:
        FormatError: missing or invalid files, or tensors that do not fit the config.
    """
    config, files = _config_and_files(os.fspath(folder))
    flat: dict[str, Any] = {}
    for file in files:
        tensors, _ = read_safetensors(file)
        flat.update(tensors)
    return config, from_hf_names(flat, config, dtype=dtype)  # type: ignore[arg-type]


__all__ = ["load_hf_llama", "read_hf_llama_header"]
