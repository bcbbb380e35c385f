"""Each config is declared once: the YAML sections are the library's config classes.

No class mirrors a section field by field (read with `ast` from every module of
entrenar/), every ``Literal`` choice of a builder has its registry entry, choice
tuples derive from their ``Literal``, and input paths are found by their metadata.
"""

from __future__ import annotations

import ast
import dataclasses
import typing
from pathlib import Path

import pytest

from entrenar import data, nn, optim, quant
from entrenar.config import DataSection, QuantizationSection, TrainSpec
from entrenar.config.docs import sections
from entrenar.config.spec import resolve_paths
from entrenar.errors import ConfigError
from entrenar.lora import LoRAConfig
from entrenar.nn.losses import LOSSES
from entrenar.schema import Config, hints, parse
from entrenar.train import TrainConfig
from entrenar.train.config import COMPUTE_DTYPES, ComputeDtype

ROOT = Path(__file__).parents[2] / "entrenar"

LIBRARY = {
    "training": TrainConfig,
    "lora": LoRAConfig,
    "optimizer": optim.OptimizerConfig,
    "scheduler": optim.ScheduleConfig,
}


def test_the_sections_are_the_library_config_classes():
    found = dict(sections()[1:])
    for key, cls in LIBRARY.items():
        assert found[key] is cls, f"{key}: is {found[key]}, not {cls}"
    for key, cls in found.items():
        assert issubclass(cls, Config), f"{key}: {cls} is not checked when built"


def _dataclass_fields() -> dict[str, set[str]]:
    """``module:Class -> annotated field names`` of every class in entrenar/."""
    out = {}
    for path in ROOT.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                names = {
                    s.target.id
                    for s in node.body
                    if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)
                }
                out[f"{path.relative_to(ROOT)}:{node.name}"] = names
    return out


def test_no_class_mirrors_a_section():
    classes = _dataclass_fields()
    for key, cls in sections()[1:]:
        own = {f.name for f in dataclasses.fields(cls)}
        for where, names in classes.items():
            if where.endswith(f":{cls.__name__}"):
                continue
            shared = own & names  # a mirror: more than half of them, at least 4
            assert len(shared) < 4 or 2 * len(shared) <= len(own), (
                f"{where} repeats {sorted(shared)} of `{key}` ({cls.__name__})"
            )


def _choices(cls: type, field: str) -> tuple:
    hint = hints(cls)[field]
    args = typing.get_args(hint)
    literal = next(a for a in (hint, *args) if typing.get_origin(a) is typing.Literal)
    return typing.get_args(literal)


@pytest.mark.parametrize(
    ("cls", "field", "registry", "extra"),
    [
        (optim.OptimizerConfig, "name", optim.OPTIMIZERS.names(), ()),
        (optim.ScheduleConfig, "name", optim.SCHEDULES.names(), ()),
        (TrainConfig, "loss", tuple(LOSSES), ("auto",)),
        (DataSection, "format", data.FORMATS, ("tabular", "preference")),
        (LoRAConfig, "quantize_base", quant.SCHEMES, ("none",)),
        (QuantizationSection, "scheme", quant.SCHEMES, ()),
    ],
)
def test_every_literal_choice_has_a_registry_entry(cls, field, registry, extra):
    choices = set(_choices(cls, field)) - set(extra)
    assert choices <= set(registry), f"{cls.__name__}.{field}: no entry for " + str(
        sorted(choices - set(registry))
    )


def test_every_registered_builder_can_be_chosen():
    for cls, registry in ((optim.OptimizerConfig, optim.OPTIMIZERS),
                          (optim.ScheduleConfig, optim.SCHEDULES)):  # fmt: skip
        assert set(_choices(cls, "name")) == set(registry.names())
    assert nn.architecture_names()  # model.architecture is checked by the registry
    with pytest.raises(ConfigError, match=r"^model\.architecture: 'nope' is not"):
        parse(TrainSpec, {"model": {"architecture": "nope"}, "merge": {}})


def test_choice_tuples_derive_from_their_literal():
    assert typing.get_args(ComputeDtype) == COMPUTE_DTYPES


def test_input_paths_are_found_by_their_metadata(tmp_path):
    raw = {
        "model": {"path": "m.gguf", "tokenizer": "t.gguf"},
        "data": {"train": "a.jsonl", "validation": "b.jsonl"},
        "distillation": {"teacher": "teacher.safetensors"},
    }
    spec = resolve_paths(parse(TrainSpec, raw), str(tmp_path))
    for key, section in raw.items():
        for field, name in section.items():
            assert getattr(getattr(spec, key), field) == str(tmp_path / name)


def test_library_configs_are_checked_when_built_in_code():
    with pytest.raises(ConfigError, match=r"^TrainConfig\.batch_size: must be >= 1"):
        TrainConfig(batch_size=0)
    with pytest.raises(ConfigError, match=r"^LoRAConfig\.alpha: must be a finite"):
        LoRAConfig(alpha=float("inf"))
    assert LoRAConfig(targets="q_proj").targets == ("q_proj",)
    assert TrainConfig(patience=2, min_delta=0.1).patience == 2
    with pytest.raises(ConfigError, match=r"^OptimizerConfig\.momentum: adam does"):
        optim.OptimizerConfig("adam", momentum=0.9)
