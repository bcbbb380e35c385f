"""Workflows: what ``entrenar train|eval|generate|quantize|merge|validate`` runs.

Protocol: plain functions over a checked `entrenar.config.TrainSpec` or model files,
which the command line and notebooks call. ``train_from_yaml(path, overrides)`` runs
a whole YAML run (`entrenar.runs.run`) and returns a `RunResult`; `build_model` /
`load_built` / `save_built` give and keep a `BuiltModel`; `evaluate_model`,
`generate_text`, `quantize_file` and `run_merge` are the other commands, and
`entrenar.runs.preflight` checks what ``train`` would refuse without loading weights.
"""

from entrenar.runs.evaluate import evaluate_config, evaluate_model
from entrenar.runs.inference import generate_text
from entrenar.runs.merging import run_merge
from entrenar.runs.models import BuiltModel, build_model, load_built, save_built
from entrenar.runs.quantize import quantize_file
from entrenar.runs.run import RunResult, train_from_yaml

__all__ = [
    "BuiltModel",
    "RunResult",
    "build_model",
    "evaluate_config",
    "evaluate_model",
    "generate_text",
    "load_built",
    "quantize_file",
    "run_merge",
    "save_built",
    "train_from_yaml",
]
