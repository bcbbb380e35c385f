"""Merge recipes in a config (``merge:``) or on their own, run by `entrenar.merge`.

A recipe's model paths are relative to its file's folder (`entrenar.merge.recipe`);
here every input is also checked to exist before anything is read, so a typo in a
path is a `ConfigError` naming the recipe entry.
"""

from __future__ import annotations

import os
from typing import Any

from entrenar import io, merge
from entrenar.config.spec import TrainSpec, read_yaml
from entrenar.config.summary import check_recipe_files, spec_recipe
from entrenar.errors import ConfigError
from entrenar.io.lock import OutputLock


def load_recipe_file(path: str) -> merge.Recipe:
    """A bare mergekit recipe file (``merge_method`` at the top), checked."""
    raw = read_yaml(path)
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: a recipe must be a mapping")
    folder = os.path.dirname(os.path.abspath(path))
    recipe = merge.parse_recipe(raw, folder, path)
    return check_recipe_files(recipe, path)


def is_bare_recipe(path: str) -> bool:
    """Whether a YAML file is a bare recipe rather than a config with ``merge:``."""
    raw: Any = read_yaml(path)
    return isinstance(raw, dict) and "merge_method" in raw


MODEL_FORMATS = {"safetensors": "safetensors", "json": "json", "gguf": "gguf"}


def run_merge(spec: TrainSpec) -> dict[str, str]:
    """Run a config's merge: ``model.<format>`` per export format in output_dir."""
    recipe = spec_recipe(spec)
    out_dir = spec.output_dir
    formats = [f for f in spec.export.formats if f in MODEL_FORMATS]
    if not formats:
        raise ConfigError(
            "export.formats: a merge writes safetensors, json or gguf model files; "
            f"got {list(spec.export.formats)}"
        )
    with OutputLock(out_dir):  # one writer per output folder
        os.makedirs(out_dir, exist_ok=True)
        first = os.path.join(out_dir, f"model.{formats[0]}")
        model = merge.run_recipe(recipe, first)
        files = {"merged": first}
        for fmt in formats[1:]:
            path = os.path.join(out_dir, f"model.{fmt}")
            io.save_model(model, path, io.SaveConfig(io.ModelFormat(fmt)))
            files[f"merged_{fmt}"] = path
    return files


__all__ = ["is_bare_recipe", "load_recipe_file", "run_merge"]
