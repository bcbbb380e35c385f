"""Declarative runs: a YAML file -> frozen dataclasses -> `train_from_yaml`.

Protocol: ``load_config(path, overrides)`` reads a run's YAML with ``yaml.safe_load``
into a `TrainSpec` (sections ``model``, ``data``, ``optimizer``, ``scheduler``,
``lora``, ``quantization``, ``distillation``, ``training``, ``merge``, ``export``),
checking every key, type, range and input file; any problem is a `ConfigError` whose
message starts with the key path and, for a likely typo, names the closest valid key.
``validate(path)`` also checks model sizes and merge recipes, and
`entrenar.config.preflight` (``entrenar validate``) what ``train`` would refuse without
loading weights: the model file's header, every data row, a tokenized sample and the
predicted token counts. ``train_from_yaml(path, overrides)`` runs the whole workflow
(`entrenar.config.run`) and returns a `RunResult`.
Every key, its default and its range: specs/config.md.
"""

from entrenar.config.fields import parse
from entrenar.config.models import BuiltModel, build_model, load_built, save_built
from entrenar.config.run import RunResult, train_from_yaml
from entrenar.config.sections import (
    DataSection,
    DistillationSection,
    EarlyStoppingSection,
    ExportSection,
    LoRASection,
    ModelSection,
    OptimizerSection,
    QuantizationSection,
    SchedulerSection,
    TrainingSection,
)
from entrenar.config.spec import TrainSpec, apply_overrides, load_config
from entrenar.config.summary import summarize, validate
from entrenar.errors import ConfigError

__all__ = [
    "BuiltModel",
    "ConfigError",
    "DataSection",
    "DistillationSection",
    "EarlyStoppingSection",
    "ExportSection",
    "LoRASection",
    "ModelSection",
    "OptimizerSection",
    "QuantizationSection",
    "RunResult",
    "SchedulerSection",
    "TrainSpec",
    "TrainingSection",
    "apply_overrides",
    "build_model",
    "load_built",
    "load_config",
    "parse",
    "save_built",
    "summarize",
    "train_from_yaml",
    "validate",
]
