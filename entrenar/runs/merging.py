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
from entrenar.merge.run import layout_ref
from entrenar.nn import auto_matmul_dtype


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
    """Run a config's merge into output_dir: ``model.<format>`` per model format.

    A merge of Hugging Face folders is written as one (``hf/``: the merged
    ``model.safetensors`` beside the base's ``config.json`` and tokenizer), its
    only format: a model file would keep the folders' tensor names and no
    architecture.
    """
    recipe = spec_recipe(spec)
    out_dir = spec.output_dir
    asked = list(spec.export.formats)
    folders = os.path.isdir(layout_ref(recipe).path)
    formats = [f for f in asked if f in MODEL_FORMATS]  # model files
    if folders and (formats or "hf" not in asked):
        raise ConfigError(
            "export.formats: the merged models are Hugging Face folders, so the "
            f"merge is written as one: set export.formats to [hf] (got {asked})"
        )
    if not folders and not formats:
        raise ConfigError(
            "export.formats: a merge of model files writes safetensors, json or "
            f"gguf model files (hf takes Hugging Face folders); got {asked}"
        )
    with OutputLock(out_dir):  # one writer per output folder
        os.makedirs(out_dir, exist_ok=True)
        if folders:
            first = os.path.join(out_dir, "hf")
            merge.run_recipe(recipe, first)
            return {"merged": first}
        first = os.path.join(out_dir, f"model.{formats[0]}")
        model = merge.run_recipe(recipe, first)
        files = {"merged": first}
        for fmt in formats[1:]:
            path = os.path.join(out_dir, f"model.{fmt}")
            io.save_model(model, path, io.SaveConfig(io.ModelFormat(fmt)))
            files[f"merged_{fmt}"] = path
    return files


class ChatScorer:
    """Exact match of greedy replies on each task's chat JSONL, for `merge.search`.

    ``scorer(model, budget)`` scores a merged `io.Model` (params in the base's
    layout) on every task, ``batch_size`` records per teacher-forced forward pass
    (`entrenar.chat.exact_match`; greedy decoding gives the same hits, at more
    cost). Batches of the tasks alternate so that a task that cannot reach
    ``budget.floor`` is seen early; it then stops and returns each task's upper
    bound ``(correct + n - scored) / n`` (`merge.search` prunes the setting).

    Args:
        model_file: a Llama GGUF of the merged models' architecture (the base):
            its config, tokenizer and chat template score every merged model.
        tasks: task name -> held-out chat JSONL (``{"messages": [...]}``).
        batch_size: records per forward pass.
        screen_matmul_dtype: the matmuls of a screening score (``budget.items``
            set): ``"auto"`` (bfloat16 with float32 accumulation where the CPU has
            AMX or AVX512-BF16, as training's ``matmul_dtype: auto``;
            `entrenar.nn.auto_matmul_dtype`), ``"bfloat16"``, or None (float32).
            A full score (``budget.items`` None) is always float32: bfloat16
            matmuls moved a TIES merge of two SmolLM2 fine-tunes by one record per
            80-record task (72/80 and 39/80 against 73/80 and 40/80), enough to
            rank screened settings, not to decide between them.

    Raises:
        ConfigError: ``model_file`` is not a GGUF, or a task file has no records.
    """

    def __init__(
        self,
        model_file: str,
        tasks: Mapping[str, str],
        *,
        batch_size: int = 16,
        screen_matmul_dtype: str | None = "auto",
    ) -> None:
        if (
            os.path.isdir(model_file)  # a Hugging Face folder
            or io.detect_format(model_file) != io.ModelFormat.GGUF
        ):
            raise ConfigError(
                f"--eval scores merges through a GGUF's tokenizer and chat template; "
                f"{model_file} is not a GGUF (merge GGUF files, or evaluate the "
                "written model with `entrenar eval`)"
            )
        chat = ChatModel.from_gguf(model_file)
        md = screen_matmul_dtype
        md = auto_matmul_dtype() if md == "auto" else md
        self.chat = dataclasses.replace(  # full scores: float32 matmuls
            chat, model=dataclasses.replace(chat.model, matmul_dtype=None)
        )
        self.screen_model = dataclasses.replace(chat.model, matmul_dtype=md)
        self.batch_size = batch_size
        self.records: dict[str, list[Any]] = {}
        for name, path in tasks.items():
            self.records[name] = list(data.load_records(path))
            if not self.records[name]:
                raise ConfigError(f"--eval {name}={path}: no records")

    @property
    def sizes(self) -> dict[str, int]:
        """Records per task."""
        return {name: len(recs) for name, recs in self.records.items()}

    def __call__(
        self, model: io.Model, budget: merge.Budget | None = None
    ) -> dict[str, float]:
        """Each task's exact match (upper bounds when it stopped early: class doc)."""
        budget = budget or merge.Budget()
        params = jax.tree_util.tree_map(jnp.asarray, model.params)
        screening = budget.items is not None
        model_cfg = self.screen_model if screening else self.chat.model
        chat = dataclasses.replace(self.chat, model=model_cfg, params=params)
        recs = {t: r[: budget.items] for t, r in self.records.items()}
        n = {t: len(r) for t, r in recs.items()}
        right = dict.fromkeys(recs, 0)  # records right so far, per task
        seen = dict.fromkeys(recs, 0)  # records scored so far, per task
        bs = self.batch_size
        turns = [(t, s) for s in range(0, max(n.values()), bs) for t in recs
                 if s < n[t]]  # batch k of every task in turn  # fmt: skip
        for task, s in turns:
            chunk = recs[task][s : s + bs]
            right[task] += exact_match(chat, chunk, batch_size=bs).correct
            seen[task] += len(chunk)
            if (right[task] + n[task] - seen[task]) / n[task] < budget.floor:
                break  # this task cannot reach the floor: the setting cannot win
        return {t: (right[t] + n[t] - seen[t]) / n[t] for t in recs}


def chat_scorer(
    model_file: str, tasks: Mapping[str, str], *, batch_size: int = 16
) -> ChatScorer:
    """A `ChatScorer` of ``tasks`` through ``model_file`` (its arguments)."""
    return ChatScorer(model_file, tasks, batch_size=batch_size)


SCREEN = 16
"""Records per task that screen every setting of ``entrenar merge --search``."""
FINALISTS = 2
"""Screened settings scored in full besides the command's own."""


def search_merge(
    recipe: merge.Recipe,
    scorer: ChatScorer,
    *,
    progress: Callable[[merge.Trial], None] | None = None,
    output: str | None = None,
) -> merge.SearchResult:
    """`merge.search` over the default grid as ``entrenar merge --search`` runs it.

    Settings are screened on each task's first `SCREEN` records when some task has
    more than twice as many, and the command's own plus `FINALISTS` others scored
    in full; otherwise every setting is scored in full (pruned either way). The
    best merge is written to ``output`` (None: nowhere).
    """
    screen = SCREEN if max(scorer.sizes.values()) > 2 * SCREEN else None
    return merge.search(
        recipe,
        scorer,
        screen=screen,
        finalists=FINALISTS,
        progress=progress,
        output=output,
    )


__all__ = [
    "FINALISTS",
    "SCREEN",
    "ChatScorer",
    "chat_scorer",
    "is_bare_recipe",
    "load_recipe_file",
    "run_merge",
    "search_merge",
]
