"""What a run will do, as data: `summarize` feeds ``validate --detailed`` and ``info``.

`check_model_sizes` builds the model's shapes (no arrays: `jax.eval_shape`) so that
bad sizes in ``model.config`` fail at validation, not minutes into a run.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

import jax

from entrenar import merge
from entrenar.config.spec import TrainSpec, arch_config, load_config
from entrenar.errors import ConfigError
from entrenar.schema import yaml_fields
from entrenar.tree import tree_size


def check_model_sizes(spec: TrainSpec) -> Any:
    """The model config of a from-scratch model (checked), or None for a file."""
    if spec.model is None or spec.model.path is not None:
        return None
    assert spec.model.architecture is not None
    return arch_config(spec.model.architecture, spec.model.config, "model.config")


def validate(
    config: str | os.PathLike[str] | TrainSpec,
    overrides: Mapping[str, Any] | None = None,
) -> TrainSpec:
    """Check a run's file (or spec) completely without running it.

    Beyond `load_config`'s checks of keys, types, ranges and files, the sizes of a
    model built from scratch are checked by building its shapes, and a merge recipe
    by `entrenar.merge`'s own parser.

    Returns:
        The `TrainSpec`.

    Raises:
        ConfigError: the first problem, starting with its key path.
    """
    spec = config if isinstance(config, TrainSpec) else load_config(config, overrides)
    check_model_sizes(spec)
    if spec.merge is not None:
        spec_recipe(spec)
    return spec


def check_recipe_files(recipe: merge.Recipe, where: str) -> merge.Recipe:
    """Every model and adapter of ``recipe`` exists (else a ConfigError)."""
    refs = [("base_model", recipe.base_model)] if recipe.base_model else []
    refs += [(f"models[{i}].model", r) for i, r in enumerate(recipe.models)]
    for key, ref in refs:
        assert ref is not None
        for p in (ref.path, ref.adapter):
            if p is not None and not os.path.exists(p):
                raise ConfigError(f"{where}.{key}: file not found: {p}")
    return recipe


def spec_recipe(spec: TrainSpec) -> merge.Recipe:
    """The validated `Recipe` of a config's ``merge:`` section."""
    assert spec.merge is not None
    folder = os.path.dirname(spec.source) if spec.source else os.getcwd()
    recipe = merge.parse_recipe(spec.merge, folder, "merge")
    return check_recipe_files(recipe, "merge")


def count_params(config: Any) -> int:
    """Number of parameters ``config.init`` creates (shapes only, nothing allocated)."""
    return tree_size(jax.eval_shape(config.init, jax.random.key(0)))


def _section(obj: Any) -> Any:
    if obj is None:
        return None
    if dataclasses.is_dataclass(obj):  # its YAML keys, grouped as in the file
        out: dict[str, Any] = {}
        for f in yaml_fields(obj):
            group = f.metadata.get("group")
            (out.setdefault(group, {}) if group else out)[f.name] = _section(
                getattr(obj, f.name)
            )
        return out
    if isinstance(obj, tuple):
        return [_section(v) for v in obj]
    if isinstance(obj, dict):
        return {k: _section(v) for k, v in obj.items()}
    return obj


def as_dict(spec: TrainSpec) -> dict[str, Any]:
    """The whole spec as plain data (defaults filled in), for JSON/YAML output."""
    out: dict[str, Any] = _section(spec)
    return out


def summarize(spec: TrainSpec) -> dict[str, Any]:
    """The headline facts of a run (model, size, optimizer, length, adapters)."""
    out: dict[str, Any] = {"name": spec.name or _stem(spec.source)}
    if spec.is_merge:
        recipe = spec.merge or {}
        out["merge"] = {
            "method": recipe.get("merge_method"),
            "models": len(recipe.get("models") or []),
            "base_model": recipe.get("base_model"),
        }
        return out
    assert spec.model is not None and spec.data is not None
    config = check_model_sizes(spec)
    model: dict[str, Any] = {"architecture": spec.model_architecture}
    if config is not None:
        model["parameters"] = count_params(config)
        model["from_scratch"] = True
    else:
        model["path"] = spec.model.path
    out["model"] = model
    out["data"] = {
        "train": spec.data.train,
        "validation": spec.data.validation,
        "format": spec.data.format,
        "batch_size": spec.data.batch_size,
    }
    opt = spec.optimizer
    out["optimizer"] = {"name": opt.name, "lr": opt.lr}
    if spec.scheduler is not None:
        out["scheduler"] = spec.scheduler.name
    t = spec.training
    out["training"] = {
        "epochs": None if t.max_steps else t.epochs,  # max_steps ends the run
        "max_steps": t.max_steps,
        "grad_accum": t.grad_accum,
        "seed": t.seed,
        "output_dir": t.output_dir,
    }
    if spec.lora is not None and spec.lora.enabled:
        out["lora"] = {
            "rank": spec.lora.rank,
            "alpha": spec.lora.alpha,
            "targets": list(spec.lora.targets),
            "quantize_base": spec.lora.quantize_base,
            "quantize_untargeted": spec.lora.quantize_untargeted,
            "use_dora": spec.lora.use_dora,
        }
        for key in ("rank_pattern", "alpha_pattern"):
            if getattr(spec.lora, key):
                out["lora"][key] = dict(getattr(spec.lora, key))
    if spec.distillation is not None:
        d = spec.distillation
        out["distillation"] = {
            "teacher": d.teacher,
            "temperature": d.temperature,
            "alpha": d.alpha,
        }
    if spec.quantization is not None and spec.quantization.enabled:
        out["quantization"] = spec.quantization.resolved_scheme
    out["export"] = list(spec.export.formats)
    return out


def _stem(path: str | None) -> str:
    return os.path.splitext(os.path.basename(path))[0] if path else "run"


def format_summary(summary: dict[str, Any]) -> list[str]:
    """The summary as indented ``key: value`` lines."""
    lines = []
    for key, value in summary.items():
        if isinstance(value, dict):
            parts = [f"{k}={v}" for k, v in value.items() if v is not None]
            lines.append(f"  {key.capitalize()}: {', '.join(parts)}")
        elif value is not None:
            lines.append(f"  {key.capitalize()}: {value}")
    return lines


__all__ = [
    "as_dict",
    "check_model_sizes",
    "check_recipe_files",
    "count_params",
    "format_summary",
    "spec_recipe",
    "summarize",
    "validate",
]
