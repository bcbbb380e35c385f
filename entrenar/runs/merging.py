"""Merge recipes in a config (``merge:``) or on their own, run by `entrenar.merge`.

A recipe's model paths are relative to its file's folder (`entrenar.merge.recipe`);
here every input is also checked to exist before anything is read, so a typo in a
path is a `ConfigError` naming the recipe entry.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp

from entrenar import data, io, merge
from entrenar.chat import ChatModel, exact_match
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


def chat_scorer(
    model_file: str, tasks: Mapping[str, str], *, batch_size: int = 16
) -> Callable[[io.Model], dict[str, float]]:
    """Exact match of greedy replies on each task's chat JSONL, for `merge.search`.

    Args:
        model_file: a Llama GGUF of the merged models' architecture (the base):
            its config, tokenizer and chat template score every merged model.
        tasks: task name -> held-out chat JSONL (``{"messages": [...]}``).
        batch_size: records per forward pass (`entrenar.chat.exact_match`).

    Raises:
        ConfigError: ``model_file`` is not a GGUF, or a task file has no records.
    """
    if io.detect_format(model_file) != io.ModelFormat.GGUF:
        raise ConfigError(
            f"--eval scores merges through a GGUF's tokenizer and chat template; "
            f"{model_file} is not a GGUF (merge GGUF files, or evaluate the written "
            "model with `entrenar eval`)"
        )
    chat = ChatModel.from_gguf(model_file)
    records = {}
    for name, path in tasks.items():
        records[name] = list(data.load_records(path))
        if not records[name]:
            raise ConfigError(f"--eval {name}={path}: no records")

    def score(model: io.Model) -> dict[str, float]:
        params = jax.tree_util.tree_map(jnp.asarray, model.params)
        merged = dataclasses.replace(chat, params=params)
        return {
            name: exact_match(merged, recs, batch_size=batch_size).accuracy
            for name, recs in records.items()
        }

    return score


__all__ = ["chat_scorer", "is_bare_recipe", "load_recipe_file", "run_merge"]
