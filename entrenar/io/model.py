"""`Model`, `ModelMetadata`, `SaveConfig`, `ModelFormat`; names and dtypes of tensors.

A model's params are a nested dict of arrays; every format stores them flat, by the
dotted path (``model.layers.self_attn.q_proj.weight``, Hugging Face's convention), so a
key may not contain a dot. Dtypes are kept exactly (`STORAGE_DTYPES`).

A quantized model that is not a llama.cpp GGUF is stored with each quantized weight
split into its arrays (``<name>.codes``, ``<name>.scales``, ``<name>.offsets``, ...)
and ``custom["quantization"]`` mapping the weight's name to its static fields (scheme,
block size, dtype, granularity): `split_quantized`, `restore_quantized`.
"""

from __future__ import annotations

import dataclasses
import enum
import os
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from entrenar import quant
from entrenar.errors import FormatError
from entrenar.tree import key_path_str
from entrenar.types import Params

STORAGE_DTYPES: dict[str, np.dtype] = {
    name: np.dtype(name)
    for name in (
        "float16",
        "float32",
        "float64",
        "int8",
        "int16",
        "int32",
        "int64",
        "uint8",
        "uint16",
        "uint32",
        "uint64",
        "bool",
    )
}
"""Array dtypes the formats store, by name (``bfloat16`` is added below)."""
try:  # jax depends on ml_dtypes; numpy itself has no bfloat16
    import ml_dtypes

    STORAGE_DTYPES["bfloat16"] = np.dtype(ml_dtypes.bfloat16)
except ImportError:  # pragma: no cover
    pass


class ModelFormat(enum.Enum):
    """File formats `entrenar.io.save_model` writes."""

    JSON = "json"
    YAML = "yaml"
    SAFETENSORS = "safetensors"
    GGUF = "gguf"


@dataclasses.dataclass(frozen=True)
class ModelMetadata:
    """What a saved model is: name, architecture, version, how it was trained.

    Attributes:
        name: model name.
        architecture: e.g. ``"llama"``, ``"mlp"``.
        version: free-form version string.
        training_config: JSON-serialisable dict (the config it was trained with).
        custom: JSON-serialisable dict of anything else.

    >>> m = ModelMetadata("tiny", "mlp").with_version("2").with_custom(seed=1)
    >>> (m.version, m.custom)
    ('2', {'seed': 1})
    """

    name: str = "model"
    architecture: str = "custom"
    version: str = "0.1.0"
    training_config: dict[str, Any] = dataclasses.field(default_factory=dict)
    custom: dict[str, Any] = dataclasses.field(default_factory=dict)

    def with_version(self, version: str) -> ModelMetadata:
        """A copy with ``version`` replaced."""
        return dataclasses.replace(self, version=str(version))

    def with_custom(self, **items: Any) -> ModelMetadata:
        """A copy with ``items`` added to ``custom``."""
        return dataclasses.replace(self, custom={**self.custom, **items})

    def moved(self, source: str, output: str) -> ModelMetadata:
        """This metadata of the file ``source`` as the file ``output`` stores it.

        A tokenizer ``custom["tokenizer"]`` names relative to its file's folder (as
        `entrenar.runs.save_built` writes it) is named relative to ``output``'s
        folder, so that a model written elsewhere (a merge, a quantized copy) is read
        with the same tokenizer; an absolute path stays as it is.

        >>> m = ModelMetadata(custom={"tokenizer": "tok.gguf"})
        >>> m.moved("/runs/a/model.safetensors", "/runs/b/q.safetensors").custom
        {'tokenizer': '../a/tok.gguf'}
        """
        tok = self.custom.get("tokenizer")
        if not isinstance(tok, str) or os.path.isabs(tok):
            return self
        path = os.path.join(os.path.dirname(os.path.abspath(source)), tok)
        where = os.path.dirname(os.path.abspath(output))
        return self.with_custom(tokenizer=os.path.relpath(path, where))

    def to_dict(self) -> dict[str, Any]:
        """Plain dict of the fields."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Any, path: str = "<metadata>") -> ModelMetadata:
        """Validate and build from `to_dict`'s output."""
        if not isinstance(d, Mapping):
            raise FormatError(f"{path}: metadata must be a mapping, got {type(d)}")
        unknown = set(d) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise FormatError(f"{path}: unknown metadata fields {sorted(unknown)}")
        for k in ("name", "architecture", "version"):
            if k in d and not isinstance(d[k], str):
                raise FormatError(f"{path}: metadata.{k} must be a string")
        for k in ("training_config", "custom"):
            if k in d and not isinstance(d[k], Mapping):
                raise FormatError(f"{path}: metadata.{k} must be a mapping")
        return cls(**d)


@dataclasses.dataclass(frozen=True)
class Model:
    """A model to save or that was loaded: metadata and a nested dict of arrays."""

    metadata: ModelMetadata
    params: Params


@dataclasses.dataclass(frozen=True)
class SaveConfig:
    """How `entrenar.io.save_model` writes.

    Attributes:
        format: the `ModelFormat`.
        pretty: indent JSON / block-style YAML for reading by people.
        gguf_tensor_type: GGUF matrices of a Llama: F32, F16, BF16, Q8_0, Q4_0, Q4_1.
        gguf_source: GGUF to copy a Llama's metadata and tokenizer from.
    """

    format: ModelFormat = ModelFormat.SAFETENSORS
    pretty: bool = False
    gguf_tensor_type: str = "F32"
    gguf_source: str | None = None


def _not_an_array_hint(v: Any) -> str | None:
    """What to do with a leaf that is not a plain array, or None if it is one."""
    kind = type(v).__name__
    if kind == "LoRAWeight":
        return (
            "is a LoRA adapter node: fold it into its base first "
            "(entrenar.lora.fold), or save the adapter alone (entrenar.lora."
            "save_adapter)"
        )
    if kind == "QuantizedWeight":
        return (
            "is a QuantizedWeight: dequantize first (entrenar.quant."
            "dequantize_params) or write a GGUF (entrenar.io.save_llama_gguf)"
        )
    if isinstance(v, tuple) and hasattr(v, "_fields"):
        return (
            f"is a {kind} (an optimizer or training state?): model files hold "
            "params; the Trainer's checkpoints (entrenar.train) hold whole states"
        )
    return None


def _index_key(k: str) -> int | None:
    """``"[3]"`` -> 3 (a list position in a stored name), else None."""
    if len(k) > 2 and k[0] == "[" and k[-1] == "]" and k[1:-1].isdigit():
        return int(k[1:-1])
    return None


def flatten_params(params: Params) -> dict[str, np.ndarray]:
    """Nested dicts and lists of arrays -> ``{dotted_name: numpy array}``.

    Dtypes are kept. A list position is stored as ``[i]`` (``layers.[0].weight``,
    the layout of `entrenar.nn.MLP`), which `unflatten_params` turns back into a
    list.

    >>> flatten_params({"a": {"w": np.zeros((1, 2), np.float16)}})["a.w"].dtype
    dtype('float16')
    >>> list(flatten_params({"layers": [{"b": np.zeros(1)}]}))
    ['layers.[0].b']
    """
    out: dict[str, np.ndarray] = {}

    def walk(tree: Any, prefix: str) -> None:
        items: Any
        if isinstance(tree, Mapping):
            items = tree.items()
        elif isinstance(tree, (list, tuple)) and not hasattr(tree, "_fields"):
            items = ((f"[{i}]", v) for i, v in enumerate(tree))
        else:
            raise FormatError(
                f"params must be nested dicts or lists of arrays, got {type(tree)}"
            )
        for k, v in items:
            if not isinstance(k, str) or not k or "." in k:
                raise FormatError(
                    f"param key {k!r} under {prefix!r}: keys must be non-empty "
                    "strings without dots"
                )
            hint = _not_an_array_hint(v)
            if hint is not None:
                raise FormatError(f"param {prefix}{k!r} {hint}")
            if isinstance(v, (Mapping, list)) or (
                isinstance(v, tuple) and not hasattr(v, "_fields")
            ):
                walk(v, f"{prefix}{k}.")
                continue
            a = np.asarray(v)  # jax arrays copy to host here
            if a.dtype.name not in STORAGE_DTYPES:
                raise FormatError(
                    f"param {prefix}{k!r} has dtype {a.dtype}, not one of "
                    f"{sorted(STORAGE_DTYPES)}; cast it (e.g. to float32) first"
                )
            out[f"{prefix}{k}"] = a

    walk(params, "")
    return out


def _lists_back(node: Any, name: str) -> Any:
    """Turn dicts whose keys are all ``[i]`` back into lists, depth first."""
    if not isinstance(node, dict):
        return node
    node = {k: _lists_back(v, f"{name}{k}.") for k, v in node.items()}
    idx = [_index_key(k) for k in node]
    if not idx or any(i is None for i in idx):
        if any(i is not None for i in idx):
            raise FormatError(f"tensor names under {name!r} mix [i] and plain keys")
        return node
    if sorted(i for i in idx if i is not None) != list(range(len(idx))):
        raise FormatError(f"list positions under {name!r} are not 0..{len(idx) - 1}")
    return [node[f"[{i}]"] for i in range(len(idx))]


def unflatten_params(flat: Mapping[str, Any]) -> Any:
    """``{dotted_name: array}`` -> nested dicts and lists (inverse of `flatten_params`).

    >>> unflatten_params({"a.w": 1, "a.b": 2, "c": 3})
    {'a': {'w': 1, 'b': 2}, 'c': 3}
    >>> unflatten_params({"layers.[1].b": 2, "layers.[0].b": 1})
    {'layers': [{'b': 1}, {'b': 2}]}
    """
    tree: dict[str, Any] = {}
    for name, a in flat.items():
        *parents, leaf = parts = str(name).split(".")
        if not all(parts):
            raise FormatError(f"tensor name {name!r} has an empty part")
        node = tree
        for p in parents:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise FormatError(f"tensor name {name!r} nests under an array")
        if leaf in node:
            raise FormatError(f"tensor name {name!r} collides with another")
        node[leaf] = a
    return _lists_back(tree, "")


_FIELDS = ("codes", "scales", "offsets", "scale_scales", "scale_offset")


def split_quantized(params: Params) -> tuple[Params, dict[str, Any]]:
    """Params with each `QuantizedWeight` replaced by a dict of its arrays, + its info.

    Returns:
        ``(tree, info)``: ``info[name] = {"scheme", "block_size", "dtype",
        "granularity"}`` for each quantized weight's dotted ``name``.
    """
    info: dict[str, Any] = {}

    def rule(path: Any, x: Any) -> Any:
        if not quant.is_quantized(x):
            return x
        info[key_path_str(path)] = {
            "scheme": x.scheme,
            "block_size": int(x.block_size),
            "dtype": np.dtype(x.dtype).name,
            "granularity": x.granularity,
        }
        return {f: getattr(x, f) for f in _FIELDS if getattr(x, f) is not None}

    tree = jax.tree_util.tree_map_with_path(rule, params, is_leaf=quant.is_quantized)
    return tree, info


def restore_quantized(params: Params, info: Mapping[str, Any], path: str) -> Params:
    """Rebuild the `QuantizedWeight` nodes `split_quantized` took apart."""
    out = params
    for name, fields in info.items():
        parts = name.split(".")
        node: Any = out
        for p in parts[:-1]:
            node = node[int(p)] if isinstance(node, list) else node.get(p)
            if node is None:
                raise FormatError(f"{path}: quantized weight {name!r} is missing")
        arrays = node.get(parts[-1]) if isinstance(node, dict) else None
        if not isinstance(arrays, dict) or "codes" not in arrays:
            raise FormatError(f"{path}: quantized weight {name!r} has no codes")
        try:
            q = quant.QuantizedWeight(
                **{f: arrays.get(f) for f in _FIELDS},
                scheme=str(fields["scheme"]),
                block_size=int(fields["block_size"]),
                dtype=np.dtype(str(fields["dtype"])),
                granularity=str(fields["granularity"]),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise FormatError(f"{path}: quantization of {name!r}: {e}") from None
        node[parts[-1]] = q
    return out


__all__ = [
    "STORAGE_DTYPES",
    "Model",
    "ModelFormat",
    "ModelMetadata",
    "SaveConfig",
    "flatten_params",
    "restore_quantized",
    "split_quantized",
    "unflatten_params",
]
