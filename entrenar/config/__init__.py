"""The YAML schema of a run: a YAML file -> frozen dataclasses, checked.

Protocol: ``load_config(path, overrides)`` reads a run's YAML with ``yaml.safe_load``
into a `TrainSpec` (sections ``model``, ``data``, ``optimizer``, ``scheduler``,
``lora``, ``quantization``, ``distillation``, ``training``, ``merge``, ``export``),
checking every key, type, range and input file. The sections with a library
component are its own config class (``training:`` is `entrenar.train.TrainConfig`,
``lora:`` `entrenar.lora.LoRAConfig`, ``optimizer:``/``scheduler:``
`entrenar.optim.OptimizerConfig`/`ScheduleConfig`); any problem is a `ConfigError` whose
message starts with the key path and, for a likely typo, names the closest valid key.
``validate(path)`` also checks model sizes and merge recipes. The workflows that run
a spec (``train_from_yaml``, evaluation, merging, quantization, preflight) live one
layer up, in `entrenar.runs`.
Every key, its default and its range: specs/config.md.
"""

from entrenar.config.sections import (
    DataSection,
    DistillationSection,
    ExportSection,
    ModelSection,
    PreferenceSection,
    QuantizationSection,
)
from entrenar.config.spec import TrainSpec, apply_overrides, load_config
from entrenar.config.summary import summarize, validate
from entrenar.errors import ConfigError
from entrenar.schema import parse

__all__ = [
    "ConfigError",
    "DataSection",
    "DistillationSection",
    "ExportSection",
    "ModelSection",
    "PreferenceSection",
    "QuantizationSection",
    "TrainSpec",
    "apply_overrides",
    "load_config",
    "parse",
    "summarize",
    "validate",
]
