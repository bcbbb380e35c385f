"""Workflows: what ``entrenar train|eval|generate|quantize|merge|validate|info`` runs.

Protocol: plain functions over a checked `entrenar.config.TrainSpec` or model files,
which the command line and notebooks call. ``train_from_yaml(path, overrides)`` runs
a whole YAML run (`entrenar.runs.run`) and returns a `RunResult`; `build_model` /
`load_built` / `save_built` give and keep a `BuiltModel`; `evaluate_model`,
`generate_text`, `quantize_file`, `run_merge` and `model_info` / `machine_info`
(``info``) are the other commands, and `entrenar.runs.preflight` checks what
``train`` would refuse without loading weights.
"""

from entrenar.runs.evaluate import evaluate_config, evaluate_model
from entrenar.runs.inference import generate_text
from entrenar.runs.info import machine_info, model_info
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
    "machine_info",
    "model_info",
    "quantize_file",
    "run_merge",
    "save_built",
    "train_from_yaml",
]
