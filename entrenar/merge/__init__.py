"""Model merging: task arithmetic, TIES, DARE, SLERP and linear, as pytree functions.

Protocol: ``ties(base, models, density)`` (and `task_arithmetic`, `dare`, `slerp`,
`linear`) take parameter trees and return a new merged tree; nothing is mutated and
DARE's randomness is an explicit ``key``. Trees must match in structure, shapes and
dtypes (a `CompatibilityError`, `ShapeError` or `DTypeError` names the leaf); out of
range settings are a `ConfigError`. Leaves are merged one at a time by jitted
kernels, stacked layers per layer. ``run_recipe(path_or_recipe)`` runs a
mergekit-shaped YAML recipe over GGUF, safetensors or Hugging Face folders through
`entrenar.io` and writes the result atomically; `merge_files` does the same from
arguments. LoRA fine-tunes of one base merge through their adapters with
`merge_adapters` (exact task vectors; a linear merge stays an adapter); a file's
task vector that is mostly re-quantization noise is measured by
`requantization_noise` and corrected or refused (``quantized:``). `search` scores
merges on held-out chat tasks over a grid of settings (pruned and screened within a
`Budget`). The math is in
specs/merging.md.
"""

from entrenar.merge.adapters import merge_adapters
from entrenar.merge.engine import Plan, merge_leaf, merge_trees
from entrenar.merge.methods import dare, linear, slerp, task_arithmetic, ties
from entrenar.merge.noise import NoiseReport, requantization_noise
from entrenar.merge.recipe import METHODS, ModelRef, Recipe, load_recipe, parse_recipe
from entrenar.merge.run import merge_files, open_model, run_recipe
from entrenar.merge.schedule import Setting, evaluate
from entrenar.merge.search import Budget, SearchResult, Trial, default_grid, search

__all__ = [
    "METHODS",
    "Budget",
    "ModelRef",
    "NoiseReport",
    "Plan",
    "Recipe",
    "SearchResult",
    "Setting",
    "Trial",
    "dare",
    "default_grid",
    "evaluate",
    "linear",
    "load_recipe",
    "merge_adapters",
    "merge_files",
    "merge_leaf",
    "merge_trees",
    "open_model",
    "parse_recipe",
    "requantization_noise",
    "run_recipe",
    "search",
    "slerp",
    "task_arithmetic",
    "ties",
]
