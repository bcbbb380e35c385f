"""Merge recipes in mergekit's YAML shape, validated on load.

::

    merge_method: ties            # linear | task_arithmetic | ties | dare_linear
    base_model: base.safetensors  #   | dare_ties | slerp
    models:
      - model: math.safetensors
        parameters: {weight: 1.0, density: 0.5}
      - model: code.gguf
        parameters: {weight: [0.5, 1.0], density: 0.5}   # a gradient over depth
    parameters: {normalize: true, lambda: 1.0}           # global settings
    dtype: float32                # inputs rounded to it; the output too unless
    out_dtype: bfloat16           # out_dtype says otherwise
    random_seed: 0                # entrenar's addition: DARE's key
    quantized: correct            # entrenar's addition: task vectors that are
                                  #   mostly re-quantization noise (merge.noise):
                                  #   correct | refuse | keep

mergekit's single ``slices`` entry whose sources all span the whole depth is read
as ``models``. A model is a GGUF, safetensors, JSON or YAML file, a Hugging Face
folder (``config.json`` + safetensors), or ``model+adapter`` (a PEFT adapter folder
folded into the model first, mergekit's syntax). Relative paths are relative to the
recipe's folder. An unknown key or method is a `ConfigError` naming it.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

from entrenar.errors import ConfigError, UnsupportedError
from entrenar.io.bounded import read_yaml
from entrenar.merge.schedule import Setting, check_setting

POLICIES = ("correct", "refuse", "keep")
"""``quantized``: what a merge does with a task vector that is mostly the noise of
re-quantizing the base (`entrenar.merge.noise`)."""

METHODS: dict[str, dict[str, Any]] = {
    "linear": {"kind": "linear", "normalize": True},
    "task_arithmetic": {"kind": "task_vectors", "normalize": False},
    "ties": {"kind": "task_vectors", "trim": True, "elect": True, "normalize": True},
    "dare_linear": {"kind": "task_vectors", "drop": True, "normalize": False},
    "dare_ties": {
        "kind": "task_vectors",
        "drop": True,
        "elect": True,
        "normalize": False,
    },
    "slerp": {"kind": "slerp"},
}
"""Supported ``merge_method`` values and mergekit's defaults for each."""

_GLOBAL = {
    "linear": {"normalize", "weight"},
    "task_arithmetic": {"normalize", "lambda", "int8_mask", "weight"},
    "ties": {"normalize", "lambda", "int8_mask", "rescale", "weight", "density"},
    "dare_linear": {"normalize", "lambda", "int8_mask", "rescale", "weight", "density"},
    "dare_ties": {"normalize", "lambda", "int8_mask", "rescale", "weight", "density"},
    "slerp": {"t"},
}
_PER_MODEL = {
    "linear": {"weight"},
    "task_arithmetic": {"weight"},
    "ties": {"weight", "density"},
    "dare_linear": {"weight", "density"},
    "dare_ties": {"weight", "density"},
    "slerp": set(),
}
_FLAGS = {"normalize", "int8_mask", "rescale"}
DTYPES = {
    "float32": "float32",
    "fp32": "float32",
    "float16": "float16",
    "fp16": "float16",
    "half": "float16",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
}
_TOP = {
    "merge_method",
    "base_model",
    "models",
    "slices",
    "parameters",
    "dtype",
    "out_dtype",
    "random_seed",
    "tokenizer_source",
    "quantized",
}


@dataclasses.dataclass(frozen=True)
class ModelRef:
    """One input model: its path (resolved), optional adapter, per-model settings.

    ``key`` names where the recipe gave it (``"recipe.yaml: models[1].model"``), so
    an error opening the model points at the recipe line to fix.
    """

    path: str
    adapter: str | None = None
    parameters: Mapping[str, Setting] = dataclasses.field(default_factory=dict)
    layer_range: tuple[int, int] | None = None
    key: str = dataclasses.field(default="", compare=False)


@dataclasses.dataclass(frozen=True)
class Recipe:
    """A validated merge recipe (see the module docstring for the YAML)."""

    merge_method: str
    models: tuple[ModelRef, ...]
    base_model: ModelRef | None = None
    parameters: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    dtype: str | None = None
    out_dtype: str | None = None
    random_seed: int = 0
    quantized: str = "correct"

    def setting(self, ref: ModelRef, name: str, default: Any = None) -> Setting:
        """A per-model setting, falling back to the global one, then ``default``.

        A conditional per-model setting that matches no tensor falls back too
        (`entrenar.merge.schedule.evaluate` returns None there).
        """
        local, glob = ref.parameters.get(name), self.parameters.get(name)
        fallback = glob if glob is not None else default
        if local is None or fallback is None:
            return fallback if local is None else local
        conditional = isinstance(local, Mapping) or (
            isinstance(local, list) and all(isinstance(c, Mapping) for c in local)
        )
        if conditional:
            listed = [local] if isinstance(local, Mapping) else list(local)
            return [*listed, {"value": fallback}]
        return local

    def flag(self, name: str) -> bool:
        """A boolean global parameter with mergekit's default for the method."""
        value = self.parameters.get(name, METHODS[self.merge_method].get(name))
        return bool(value) if value is not None else name == "rescale"


def _resolve_path(spec: Any, folder: str, where: str) -> tuple[str, str | None]:
    if not isinstance(spec, str) or not spec:
        raise ConfigError(f"{where}: a model must be a path string, got {spec!r}")
    path, _, adapter = spec.partition("+")

    def full(p: str) -> str:
        p = os.path.expanduser(p)
        return p if os.path.isabs(p) else os.path.normpath(os.path.join(folder, p))

    return full(path), (full(adapter) if adapter else None)


def _model_ref(entry: Any, method: str, folder: str, where: str) -> ModelRef:
    if not isinstance(entry, Mapping) or "model" not in entry:
        raise ConfigError(f"{where}: each entry needs 'model', got {entry!r}")
    unknown = set(entry) - {"model", "parameters", "layer_range"}
    if unknown:
        raise ConfigError(f"{where}: unknown keys {sorted(unknown)}")
    path, adapter = _resolve_path(entry["model"], folder, where)
    params = _parameters(
        entry.get("parameters"), _PER_MODEL[method], method, f"{where}.parameters"
    )
    rng = entry.get("layer_range")
    if rng is not None and (
        not isinstance(rng, list)
        or len(rng) != 2
        or not all(type(r) is int for r in rng)
    ):
        raise ConfigError(f"{where}.layer_range must be [start, end], got {rng!r}")
    return ModelRef(
        path, adapter, params, tuple(rng) if rng else None, f"{where}.model"
    )


def _model_entries(doc: Mapping[str, Any], source: str) -> tuple[Any, Any]:
    """The model entries and the slice's base model (``models`` or one ``slices``)."""
    entries = doc.get("models")
    if doc.get("slices") is None:
        return entries, None
    if entries is not None:
        raise ConfigError(f"{source}: give either 'models' or 'slices', not both")
    slices = doc["slices"]
    if not isinstance(slices, list) or len(slices) != 1:
        raise UnsupportedError(
            f"{source}: only one slice spanning every layer is supported"
        )
    s = slices[0]
    if not isinstance(s, Mapping) or set(s) - {"sources", "base_model"}:
        raise ConfigError(f"{source}: slices[0] takes 'sources' (and base_model)")
    return s.get("sources"), s.get("base_model")


def _parameters(raw: Any, allowed: set[str], method: str, where: str) -> dict[str, Any]:
    """``parameters`` (a recipe's or one model's) checked against what ``method`` takes.

    Flags (``normalize``, ``int8_mask``, ``rescale``) must be booleans; every other
    value is a setting (a number, or a per-layer schedule: `check_setting`).
    """
    params = raw or {}
    if not isinstance(params, Mapping):
        raise ConfigError(f"{where} must be a mapping")
    bad = set(params) - allowed
    if bad:
        raise ConfigError(
            f"{where}: {sorted(bad)} not used by {method} (it takes "
            f"{sorted(allowed) or 'none'})"
        )
    for k, v in params.items():
        if k in _FLAGS:
            if not isinstance(v, bool):
                raise ConfigError(f"{where}.{k} must be true or false")
        else:
            check_setting(v, f"{where}.{k}")
    return dict(params)


def parse_recipe(doc: Any, folder: str = ".", source: str = "<recipe>") -> Recipe:
    """Validate a recipe mapping (as read from YAML) into a `Recipe`.

    Raises:
        ConfigError: an unknown key, method or parameter, or a malformed value.
        UnsupportedError: mergekit features entrenar does not run (several slices,
            partial layer ranges, ``modules``, tokenizer merging).
    """
    if not isinstance(doc, Mapping):
        raise ConfigError(f"{source}: a recipe must be a mapping")
    unknown = set(doc) - _TOP
    if unknown:
        if "modules" in unknown:
            raise UnsupportedError(f"{source}: 'modules' recipes are not supported")
        raise ConfigError(f"{source}: unknown keys {sorted(unknown)}")
    method = doc.get("merge_method")
    if not isinstance(method, str) or method not in METHODS:
        raise ConfigError(
            f"{source}: merge_method {method!r} is not one of {sorted(METHODS)}"
        )
    if doc.get("tokenizer_source") not in (None, "base"):
        raise UnsupportedError(
            f"{source}: tokenizer_source {doc['tokenizer_source']!r}: only the base "
            "model's tokenizer is kept"
        )
    entries, slice_base = _model_entries(doc, source)
    if not isinstance(entries, list) or not entries:
        raise ConfigError(f"{source}: 'models' must be a non-empty list")
    models = tuple(
        _model_ref(e, method, folder, f"{source}: models[{i}]")
        for i, e in enumerate(entries)
    )
    ranges = {m.layer_range for m in models}
    if len(ranges) > 1:
        raise UnsupportedError(f"{source}: sources with different layer ranges")
    base_spec = doc.get("base_model", slice_base)
    base = None
    if base_spec is not None:
        path, adapter = _resolve_path(base_spec, folder, f"{source}: base_model")
        base = ModelRef(path, adapter, {}, next(iter(ranges)), f"{source}: base_model")
    if METHODS[method]["kind"] != "linear" and base is None:
        raise ConfigError(f"{source}: {method} needs a base_model")
    params = _parameters(
        doc.get("parameters"), _GLOBAL[method], method, f"{source}: parameters"
    )
    dtypes = {}
    for k in ("dtype", "out_dtype"):
        v = doc.get(k)
        if v is not None and (not isinstance(v, str) or v not in DTYPES):
            raise ConfigError(f"{source}: {k} {v!r} is not one of {sorted(DTYPES)}")
        dtypes[k] = DTYPES[v] if v is not None else None
    seed = doc.get("random_seed", 0)
    if type(seed) is not int:
        raise ConfigError(f"{source}: random_seed must be an integer")
    quantized = doc.get("quantized", "correct")
    if quantized not in POLICIES:
        raise ConfigError(
            f"{source}: quantized {quantized!r} is not one of {list(POLICIES)}"
        )
    return Recipe(
        method,
        models,
        base,
        params,
        dtypes["dtype"],
        dtypes["out_dtype"],
        seed,
        quantized,
    )


def load_recipe(path: str | os.PathLike[str]) -> Recipe:
    """Read and validate a recipe YAML file (`entrenar.io.bounded.read_yaml`).

    The file is read within the limits of `entrenar.io.bounded`: at most 1 MiB,
    nesting at most 100 deep, aliases standing for at most 10,000 nodes in all.

    Raises:
        FormatError: the file is missing, too large, not UTF-8 or not YAML, or
            exceeds a limit.
        ConfigError: see `parse_recipe`.
    """
    path = os.fspath(path)
    doc = read_yaml(path, what="recipe file")
    return parse_recipe(doc, os.path.dirname(os.path.abspath(path)), path)


__all__ = ["DTYPES", "METHODS", "ModelRef", "Recipe", "load_recipe", "parse_recipe"]
