"""Model merging: task arithmetic, TIES, DARE, SLERP and linear, as pytree functions.

Protocol: ``ties(base, models, density)`` (and `task_arithmetic`, `dare`, `slerp`,
`linear`) take parameter trees and return a new merged tree; nothing is mutated and
DARE's randomness is an explicit ``key``. Trees must match in structure, shapes and
dtypes (a `CompatibilityError`, `ShapeError` or `DTypeError` names the leaf); out of
range settings are a `ConfigError`. Leaves are merged one at a time by jitted
kernels, stacked layers per layer. ``run_recipe(path_or_recipe)`` runs a
mergekit-shaped YAML recipe over GGUF, safetensors or Hugging Face folders through
`entrenar.io` and writes the result atomically; `merge_files` does the same from
arguments. The math is in specs/merging.md.
"""

from entrenar.merge.engine import Plan, merge_leaf, merge_trees
from entrenar.merge.methods import dare, linear, slerp, task_arithmetic, ties
from entrenar.merge.recipe import METHODS, ModelRef, Recipe, load_recipe, parse_recipe
from entrenar.merge.run import merge_files, open_model, run_recipe
from entrenar.merge.schedule import Setting, evaluate

__all__ = [
    "METHODS",
    "ModelRef",
    "Plan",
    "Recipe",
    "Setting",
    "dare",
    "evaluate",
    "linear",
    "load_recipe",
    "merge_files",
    "merge_leaf",
    "merge_trees",
    "open_model",
    "parse_recipe",
    "run_recipe",
    "slerp",
    "task_arithmetic",
    "ties",
]
