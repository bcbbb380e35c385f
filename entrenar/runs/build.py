"""The pieces of a run built from its sections: data, optimizer, TrainConfig.

Tabular data becomes in-memory arrays (`entrenar.data.tabular_arrays`, the Trainer
batches them); text becomes an `entrenar.data`
`TextLoader` whose batches hold ``batch_size × grad_accum`` rows (the Trainer splits
each into ``grad_accum`` micro-batches). Preference pairs (a ``preference`` section)
become in-memory ``(N, 2, T)`` arrays (`entrenar.data.encode_preference` and
`collate_preference`, as TRL tokenizes them) padded to the longest pair.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from entrenar import data as data_lib
from entrenar import lora, optim
from entrenar.config.spec import TrainSpec
from entrenar.errors import (
    CompatibilityError,
    ConfigError,
    ShapeError,
    UnsupportedError,
)
from entrenar.runs.models import BuiltModel
from entrenar.train import TrainConfig


@dataclasses.dataclass(frozen=True)
class RunData:
    """Training and evaluation data of a run.

    Attributes:
        train: arrays (tabular) or a loader (text).
        eval: the same kinds, or None.
        steps_per_epoch: optimizer steps in one pass over ``train``.
        examples: training examples (rows, or documents for text).
        stats: tabular normalisation (``{"mean": [...], "std": [...]}``) and the
            feature names, to be stored with the model; empty for text.
    """

    train: Any
    eval: Any
    steps_per_epoch: int
    examples: int
    stats: dict[str, Any]


def _tabular(
    spec: TrainSpec, built: BuiltModel, preset: dict[str, Any] | None
) -> RunData:
    d = spec.data
    assert d is not None and d.target is not None
    target: str = d.target
    train_recs = data_lib.load_records(d.train)
    if not len(train_recs):
        raise ConfigError(f"data.train: {d.train} holds no rows")
    first = train_recs[0]
    if target not in first:
        raise ConfigError(
            f"data.target: column {target!r} is not in {d.train} (it has "
            f"{sorted(first)})"
        )
    preset = preset or {}
    stored = preset.get("features")
    features = list(d.features or stored or [c for c in first if c != target])
    n_in, n_out = built.config.sizes[0], built.config.sizes[-1]
    if len(features) != n_in:
        raise ConfigError(
            f"model.config.sizes: the first size is {n_in} but data has "
            f"{len(features)} feature columns ({', '.join(features[:6])}...)"
        )

    def arrays(recs: Any, where: str) -> dict[str, np.ndarray]:
        return data_lib.tabular_arrays(recs, where, features, target, d.task, n_out)

    train = arrays(train_recs, d.train)
    if d.validation is not None:
        valid: dict[str, np.ndarray] | None = arrays(
            data_lib.load_records(d.validation), d.validation
        )
    elif d.validation_split > 0:
        keep, held = data_lib.split_rows(
            len(train["x"]), d.validation_split, spec.training.seed
        )
        valid = {k: v[held] for k, v in train.items()}
        train = {k: v[keep] for k, v in train.items()}
    else:
        valid = None
    stats: dict[str, Any] = {"features": features, "target": target}
    if d.normalize:
        own = "mean" in preset and list(stored or []) == features  # the model's own
        stats |= data_lib.standardize(train, valid, preset if own else None)
    per_step = d.batch_size * spec.training.grad_accum
    steps = len(train["x"]) // per_step
    if steps == 0:
        raise ConfigError(
            f"data.batch_size: {len(train['x'])} training rows make no full step of "
            f"batch_size × grad_accum = {per_step}"
        )
    return RunData(train, valid, steps, len(train["x"]), stats)


def check_lm(spec: TrainSpec, built: BuiltModel) -> None:
    """What text data needs of the model: a tokenizer that fits its vocabulary."""
    d = spec.data
    assert d is not None
    if built.tokenizer is None:
        source = spec.model.path if spec.model else None
        raise ConfigError(
            f"model.tokenizer: {source or 'this language model'} has no tokenizer; "
            "set model.tokenizer to a .gguf whose tokenizer to use, or to a "
            "tokenizer.json (or the folder holding it)"
        )
    if d.format == "chat" and not getattr(built.tokenizer, "chat_template", None):
        m = spec.model
        source = (m.tokenizer or m.path) if m is not None else None
        raise ConfigError(
            f"data.format: chat renders each conversation with the model's chat "
            f"template; {source or 'its tokenizer'} has none: set "
            "model.tokenizer to a tokenizer with one (a .gguf with "
            "tokenizer.chat_template, or a Hugging Face folder whose "
            "tokenizer_config.json has chat_template), or use format: "
            "prompt_completion"
        )
    n_tokens = len(built.tokenizer.tokens)
    if n_tokens > built.config.vocab_size:
        raise ConfigError(
            f"model.config.vocab_size: {built.config.vocab_size} is smaller than the "
            f"tokenizer's {n_tokens} tokens"
        )
    if d.packing and built.architecture == "gpt2":
        raise ConfigError("data.packing: GPT-2 does not take packed rows; use llama")
    if d.validation is None and d.validation_split > 0:
        raise ConfigError(
            "data.validation_split: for text data give a `validation` file instead"
        )


def apply_lora(spec: TrainSpec, params: Any, key: Any) -> Any:
    """`lora.apply` as the run's ``lora:`` section says; its refusals name the key.

    ``params`` may be shapes (`jax.ShapeDtypeStruct`) under `jax.eval_shape`, as
    `entrenar.runs.preflight` checks a run without its weights.
    """
    c = spec.lora
    assert c is not None
    quantize = None if c.quantize_base == "none" else c.quantize_base
    try:
        return lora.apply(params, c, key=key, quantize=quantize)
    except (ConfigError, UnsupportedError) as e:
        raise type(e)(f"lora.targets: {e}") from None
    except ShapeError as e:  # a base the 4-bit quantizer cannot split into blocks
        if quantize is None:
            raise
        raise ConfigError(
            f"lora.quantize_base: {e} (in a run: lora.quantize_base: none keeps the "
            "bases as they are, or leave that module out of lora.targets)"
        ) from None


def check_teacher(student: BuiltModel, teacher: BuiltModel, path: str) -> None:
    """A distillation teacher must predict what the student predicts.

    The same classes (an mlp's outputs) or the same vocabulary: as many logits, and
    for language models with tokenizers the same token behind each id both have
    (one may have more: padding, added tokens), since the loss compares the two
    distributions id by id.

    Raises:
        CompatibilityError: naming the teacher's file and what differs.
    """

    def out(b: BuiltModel) -> int:
        c = b.config
        return int(c.sizes[-1]) if b.architecture == "mlp" else int(c.vocab_size)

    if student.is_lm != teacher.is_lm or out(student) != out(teacher):
        raise CompatibilityError(
            f"distillation.teacher: {path} is a {teacher.architecture} with "
            f"{out(teacher)} outputs; the student ({student.architecture}) has "
            f"{out(student)}: they must predict the same classes or vocabulary"
        )
    mine, theirs = (
        getattr(b.tokenizer, "tokens", None) for b in (student, teacher)
    )  # fmt: skip
    if mine is None or theirs is None:
        return
    n = min(len(mine), len(theirs))  # beyond: one's padding or added tokens
    at = next((i for i in range(n) if mine[i] != theirs[i]), None)
    if at is None:
        return
    raise CompatibilityError(
        f"distillation.teacher: {path}'s tokenizer is not the student's (id {at} is "
        f"{theirs[at]!r} in the teacher's, {mine[at]!r} in the student's): the loss "
        "compares the two vocabularies id by id; distil from a teacher with the "
        "student's tokenizer"
    )


def text_loader(
    spec: TrainSpec,
    built: BuiltModel,
    path: str,
    *,
    train: bool = True,
    records: data_lib.Records | None = None,
) -> data_lib.TextLoader:
    """The loader of text file ``path`` as the run reads it (``records``: its rows).

    Training batches hold ``batch_size × grad_accum`` rows, shuffled, the last
    incomplete one dropped; evaluation batches ``batch_size`` rows in order.
    """
    d = spec.data
    assert d is not None
    fmt: Any = d.format  # auto: from the first record's fields (lm_loader)
    common: dict[str, Any] = dict(
        format=fmt,
        seq_len=d.seq_len,
        packing=d.packing,
        fields=d.fields,
        overflow=d.overflow,
    )
    source = path if records is None else records
    if not train:
        return data_lib.lm_loader(
            source, built.tokenizer, batch_size=d.batch_size, shuffle=False, **common
        )
    try:
        return data_lib.lm_loader(
            source, built.tokenizer, batch_size=d.batch_size * spec.training.grad_accum,
            shuffle=d.shuffle, seed=spec.training.seed, drop_last=True, **common,
        )  # fmt: skip
    except data_lib.NoFullBatchError:  # fewer sequences than one full batch
        raise _no_step(spec, path) from None


def _no_step(spec: TrainSpec, path: str) -> ConfigError:
    """The error of a training file too short for one optimizer step."""
    d = spec.data
    assert d is not None
    return ConfigError(
        f"data.batch_size: {path} has fewer rows than batch_size × grad_accum = "
        f"{d.batch_size * spec.training.grad_accum}, one optimizer step; lower "
        "data.batch_size or training.grad_accum, or add rows"
    )


def check_steps(spec: TrainSpec, loader: data_lib.TextLoader) -> None:
    """A training loader that makes no full step is a `ConfigError`."""
    d = spec.data
    assert d is not None
    if len(loader) == 0:
        raise _no_step(spec, d.train)


def preference_arrays(
    spec: TrainSpec, built: BuiltModel, path: str
) -> dict[str, np.ndarray]:
    """The pairs of ``path`` as ``(N, 2, T)`` arrays, ``T`` the longest kept row.

    Rows are cut at ``data.seq_len`` (TRL's ``max_length``); pairs whose prompt
    alone fills it are dropped, as TRL drops them.
    """
    d = spec.data
    assert d is not None
    recs = data_lib.load_records(path)
    pairs = data_lib.encode_preference(recs, built.tokenizer, max_length=d.seq_len)
    if not pairs:
        raise ConfigError(
            f"data.seq_len: every pair of {path} has a prompt of {d.seq_len} tokens "
            "or more (no completion token would be left); raise data.seq_len"
        )
    tok = built.tokenizer
    pad = tok.pad_id if getattr(tok, "pad_id", None) is not None else tok.eos_id
    return data_lib.collate_preference(pairs, int(pad or 0), max_length=d.seq_len)


def _preference(spec: TrainSpec, built: BuiltModel) -> RunData:
    d = spec.data
    assert d is not None
    check_lm(spec, built)
    train = preference_arrays(spec, built, d.train)
    valid = None
    if d.validation is not None:
        valid = preference_arrays(spec, built, d.validation)
    n = len(train["input_ids"])
    per_step = d.batch_size * spec.training.grad_accum
    if n < per_step:
        raise _no_step(spec, d.train)
    return RunData(train, valid, n // per_step, n, {})


def _text(spec: TrainSpec, built: BuiltModel) -> RunData:
    d = spec.data
    assert d is not None
    check_lm(spec, built)
    train = text_loader(spec, built, d.train)
    valid = None
    if d.validation is not None:
        valid = text_loader(spec, built, d.validation, train=False)
    check_steps(spec, train)
    return RunData(train, valid, len(train), train.documents, {})


def build_data(
    spec: TrainSpec, built: BuiltModel, teacher: BuiltModel | None = None
) -> RunData:
    """The training and evaluation data of ``spec`` for ``built``.

    Tabular features are normalised with the statistics stored in the model file
    being fine-tuned, else in the distillation teacher's file, else computed from the
    training split, so a model always sees inputs scaled as in its training.
    """
    if built.is_lm and spec.preference is not None:
        return _preference(spec, built)
    if built.is_lm:
        return _text(spec, built)
    preset = built.custom.get("tabular")
    if not isinstance(preset, dict) and teacher is not None:
        preset = teacher.custom.get("tabular")
    return _tabular(spec, built, preset if isinstance(preset, dict) else None)


def total_steps(spec: TrainSpec, steps_per_epoch: int) -> int:
    """Optimizer steps of the run: ``max_steps``, else ``epochs × steps_per_epoch``."""
    t = spec.training
    return t.max_steps or t.epochs * steps_per_epoch


def build_schedule(spec: TrainSpec, total: int) -> Any:
    """The learning rate: ``optimizer.lr`` or the ``scheduler`` over ``total`` steps."""
    lr, s = spec.optimizer.lr, spec.scheduler
    if s is None:
        return lr
    warm = s.warmup(total)
    if warm and warm >= total:
        key, value = "warmup_steps", f"{warm}"
        if s.warmup_ratio is not None:
            key, value = "warmup_ratio", f"{s.warmup_ratio} ({warm} steps)"
        raise ConfigError(
            f"scheduler.{key}: {value} is not below the run's {total} steps"
        )
    return s.build(lr, total)


def build_optimizer(spec: TrainSpec, total: int) -> optim.GradientTransformation:
    """The ``optimizer`` at the rate of `build_schedule`."""
    return spec.optimizer.build(build_schedule(spec, total))


def train_config(spec: TrainSpec, *, progress: bool = True) -> TrainConfig:
    """The ``training`` section completed from ``data`` (batches) and the run."""
    t, d = spec.training, spec.data
    assert d is not None
    loss = t.loss
    if loss == "auto":
        loss = "mse" if d.task == "regression" else "cross_entropy"
    return dataclasses.replace(
        t, batch_size=d.batch_size, shuffle=d.shuffle, loss=loss, progress=progress
    )


__all__ = [
    "RunData",
    "apply_lora",
    "build_data",
    "build_optimizer",
    "build_schedule",
    "check_lm",
    "check_steps",
    "check_teacher",
    "preference_arrays",
    "text_loader",
    "total_steps",
    "train_config",
]
