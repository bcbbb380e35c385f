"""`preflight`: what `train` would refuse, found in seconds, and the size of the run.

``entrenar validate`` runs it after `validate` (the config's keys, values and files).
It runs what `train_from_yaml` runs, without the weights and without training:

1. the model from its header alone (`build_model` with ``header_only``): a GGUF's
   magic, version, metadata and tensor table, never its tensors; the tokenizer; the
   rules that depend on the architecture and on the precision settings;
2. the exports the config asks for that need no weights: a GGUF the writer would
   refuse for this config (`entrenar.runs.export.check_gguf_export`), or an
   ``export.hf_expert_type`` the model cannot take (`check_hf_export`);
3. ``training.max_memory``: the predicted peak memory of the run
   (`entrenar.runs.memory_plan`), over the budget a `ConfigError` with its parts;
4. tabular data: `build_data` itself (every row read and converted);
5. text data: every row of every file parsed (`entrenar.data.load_records`) and the
   fields its format reads checked (`entrenar.data.record_fields`); an evenly
   spaced sample of rows (every row, up to ``sample``) tokenized and laid out by the
   loader training builds (`text_loader`), its counts scaled to the whole file.

A problem is the error `train` would raise (naming the file, line and column for
data); the report predicts the rows, tokens, sequences and steps of the run.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import numpy as np

from entrenar import data as data_lib
from entrenar import lora, nn
from entrenar.config.spec import TrainSpec
from entrenar.errors import ConfigError
from entrenar.runs.build import (
    apply_lora,
    build_data,
    check_lm,
    check_steps,
    check_teacher,
    preference_arrays,
    text_loader,
    total_steps,
)
from entrenar.runs.export import check_gguf_export, check_hf_export
from entrenar.runs.memory_plan import MemoryPlan, check_memory, gb
from entrenar.runs.models import BuiltModel, build_model, read_header
from entrenar.tree import tree_size

SAMPLE_ROWS = 1000
"""Rows of a text file tokenized by default (evenly spaced; all of a smaller file)."""


@dataclasses.dataclass(frozen=True)
class TextPlan:
    """The predicted size of one text data file in the run.

    Attributes:
        path: the file.
        rows: its records (every row was parsed).
        sampled: rows tokenized (``rows`` when the counts are exact).
        tokens: tokens of the documents, before fitting them to ``seq_len``.
        kept: tokens the rows of ``seq_len`` keep (after truncation or packing).
        trained: tokens with a loss (the completion, the assistant's replies).
        sequences: rows of ``seq_len`` tokens.
        steps: optimizer steps in one epoch (training file), else batches.
        unlabelled: documents left out with no token with a loss in their first
            ``seq_len`` (`entrenar.data.TextLoader`: a prompt that fills the row).
    """

    path: str
    rows: int
    sampled: int
    tokens: int
    kept: int
    trained: int
    sequences: int
    steps: int
    unlabelled: int = 0

    @property
    def exact(self) -> bool:
        """Whether every row was tokenized (else the counts are estimates)."""
        return self.sampled == self.rows


def sample_records(records: data_lib.Records, n: int) -> data_lib.Records:
    """At most ``n`` evenly spaced records, the first and last included.

    They keep their file and row numbers, so an error names the file's own line.
    """
    if len(records) <= n:
        return records
    picks = np.unique(np.linspace(0, len(records) - 1, n).round().astype(int))
    numbers = records.row_numbers or list(range(1, len(records) + 1))
    return data_lib.Records(
        [records.rows[i] for i in picks],
        records.source,
        [numbers[i] for i in picks],
        records.unit,
    )


def _check_fields(spec: TrainSpec, records: data_lib.Records) -> None:
    """Every record has the fields the format reads, of the right type."""
    d = spec.data
    assert d is not None
    fmt: Any = d.format  # text data: not tabular
    if fmt == "auto":
        fmt = data_lib.detect_record_format(records, d.fields)
    for i in range(len(records)):
        data_lib.record_fields(records, i, fmt, d.fields)


def plan_text(
    spec: TrainSpec,
    built: BuiltModel,
    path: str,
    *,
    train: bool = True,
    sample: int = SAMPLE_ROWS,
) -> TextPlan:
    """Parse every row of ``path``, tokenize a sample, predict the file's counts.

    Raises:
        FormatError: a row that does not parse, or lacks a field (file, line,
            column).
        ConfigError: an empty file.
        ShapeError: (every row sampled) too few rows for one step.
    """
    d = spec.data
    assert d is not None
    records = data_lib.load_records(path)
    _check_fields(spec, records)
    part = sample_records(records, max(sample, 1))
    exact = len(part) == len(records)
    # The whole file: the loader train builds. A sample: its rows, batched later.
    loader = text_loader(spec, built, path, train=train and exact, records=part)
    scale = len(records) / len(part)

    def scaled(n: float) -> int:
        return int(n) if exact else round(n * scale)

    labels = loader.arrays["labels"]
    sequences = scaled(len(loader.arrays["input_ids"]))
    if exact:
        if train:
            check_steps(spec, loader)
        steps = len(loader)
    elif train:
        steps = sequences // (d.batch_size * spec.training.grad_accum)
    else:
        steps = math.ceil(sequences / d.batch_size)
    return TextPlan(
        path=path,
        rows=len(records),
        sampled=len(part),
        tokens=scaled(loader.document_tokens),
        kept=scaled(loader.tokens_per_epoch()),
        trained=scaled(int(np.sum(labels != data_lib.IGNORE_INDEX))),
        sequences=sequences,
        steps=steps,
        unlabelled=scaled(loader.unlabelled),
    )


def _model_facts(built: BuiltModel) -> dict[str, Any]:
    out: dict[str, Any] = {
        "architecture": built.architecture,
        "source": built.source or "from scratch",
        "parameters": tree_size(built.params),
    }
    if built.tokenizer is not None:
        out["vocabulary"] = len(built.tokenizer.tokens)
    context = nn.context_length(built.config)
    if context:
        out["context"] = context
    return out


def _check_memory(spec: TrainSpec, report: dict[str, Any]) -> None:
    """``training.max_memory``: the predicted peak, or the run's refusal."""
    plan = check_memory(spec)
    if plan is not None:
        report["memory"] = plan


def _check_lora(spec: TrainSpec, built: BuiltModel) -> int | None:
    """Refuse what `lora.apply` would refuse, on the header's shapes.

    Targets that match no weight, bases that QLoRA cannot quantize; nothing is
    computed. A GGUF kept quantized keeps its bases as stored (nothing to quantize).

    Returns:
        The adapters' trainable parameters (`entrenar.lora.trainable_report`: with
        per-layer ranks the real ones, as PEFT counts them), or ``None`` without
        LoRA.
    """
    if spec.lora is None or not spec.lora.enabled:
        return None
    if spec.model is not None and spec.model.keep_quantized:
        spec = dataclasses.replace(
            spec,
            lora=dataclasses.replace(
                spec.lora, quantize_base="none", quantize_untargeted=False
            ),
        )
    shapes = jax.eval_shape(
        lambda p: apply_lora(spec, p, jax.random.key(1)), built.params
    )
    return lora.trainable_report(shapes).trainable_params


def preflight(spec: TrainSpec, *, sample: int = SAMPLE_ROWS) -> dict[str, Any]:
    """Check a validated training run as `train` would, without loading weights.

    Args:
        spec: a `TrainSpec` from `entrenar.config.validate`.
        sample: rows of each text file to tokenize (``0``: all of them).

    Returns:
        ``{"model": {...}, "data": {...}}``: the model's architecture, parameters,
        tokenizer and context; per data file its rows and (text) the predicted
        tokens, sequences and steps (`TextPlan`), and the run's steps; with
        ``training.max_memory``, ``"memory"``: the `MemoryPlan`.

    Raises:
        EntrenarError: the error `train` would raise, naming the key or the file.
    """
    assert spec.model is not None and spec.data is not None
    d = spec.data
    built = build_model(spec.model, key=jax.random.key(0), header_only=True)
    spec.check_architecture(built.architecture)
    check_gguf_export(spec, built)  # the GGUF written after training
    check_hf_export(spec, built)  # and the Hugging Face folder
    trainable = _check_lora(spec, built)
    report: dict[str, Any] = {"model": _model_facts(built), "data": {}}
    if trainable is not None:
        report["model"]["trainable"] = trainable
    teacher = None
    if spec.distillation is not None:
        teacher = read_header(spec.distillation.teacher)
        check_teacher(built, teacher, spec.distillation.teacher)
    if not built.is_lm:
        _check_memory(spec, report)
        run = build_data(spec, built, teacher)
        report["data"]["train"] = {"file": d.train, "rows": run.examples}
        if run.eval is not None:
            report["data"]["validation"] = {"rows": len(run.eval["x"])}
        report["steps_per_epoch"] = run.steps_per_epoch
        report["steps"] = total_steps(spec, run.steps_per_epoch)
        return report
    check_lm(spec, built)
    if spec.grpo is not None:  # prompts, and the columns the rewards read
        for name, path in (("train", d.train), ("validation", d.validation)):
            if path is None:
                continue
            recs = list(data_lib.load_records(path))
            missing = [
                f"{r.column} ({r.type})" for r in spec.grpo.rewards
                if r.column is not None and recs and r.column not in recs[0]
            ]  # fmt: skip
            if not recs or "prompt" not in recs[0] or missing:
                raise ConfigError(
                    f"data.{name}: a GRPO run reads records with a prompt and the "
                    f"columns its rewards read; {path} lacks "
                    f"{['prompt'] if not recs or 'prompt' not in recs[0] else missing}"
                )
            report["data"][name] = {"file": path, "rows": len(recs), "prompts": 1}
        prompts = report["data"]["train"]["rows"]
        report["steps_per_epoch"] = max(1, prompts // spec.grpo.prompts_per_step)
        report["steps"] = int(spec.training.max_steps or 0)
        _check_memory(spec, report)
        return report
    _check_memory(spec, report)
    if spec.preference is not None:  # pairs kept (TRL drops prompts >= seq_len)
        for name, path in (("train", d.train), ("validation", d.validation)):
            if path is not None:
                pairs = len(preference_arrays(spec, built, path)["input_ids"])
                report["data"][name] = {"file": path, "rows": pairs, "pairs": pairs}
        per_step = d.batch_size * spec.training.grad_accum
        report["steps_per_epoch"] = report["data"]["train"]["rows"] // per_step
        report["steps"] = total_steps(spec, report["steps_per_epoch"])
        return report
    rows = sample if sample > 0 else 2**62
    plan = plan_text(spec, built, d.train, sample=rows)
    report["data"]["train"] = plan
    if d.validation is not None:
        report["data"]["validation"] = plan_text(
            spec, built, d.validation, train=False, sample=rows
        )
    report["steps_per_epoch"] = plan.steps
    report["steps"] = total_steps(spec, plan.steps)
    return report


def format_preflight(report: dict[str, Any]) -> list[str]:
    """The report of `preflight` as indented lines (``~``: an estimate)."""
    m = report["model"]
    model = f"  Model: {m['architecture']}, {m['parameters']:,} parameters"
    if "vocabulary" in m:
        model += f", a {m['vocabulary']:,}-token tokenizer"
    if "context" in m:
        model += f", context {m['context']:,}"
    lines = [model + f" ({m['source']})"]
    if "trainable" in m:
        share = 100 * m["trainable"] / max(m["parameters"], 1)
        lines.append(
            f"  LoRA: {m['trainable']:,} trainable parameters ({share:.4f}% of the "
            "model's)"
        )
    for name, plan in report["data"].items():
        if isinstance(plan, TextPlan):
            lines.append(f"  Data {name}: {_text_line(plan)}")
        else:
            unit = ("preference pairs" if "pairs" in plan else
                    "GRPO prompts" if "prompts" in plan else "rows")  # fmt: skip
            lines.append(f"  Data {name}: {plan['rows']:,} {unit}")
    lines.append(
        f"  Steps: {report['steps']:,} ({report['steps_per_epoch']:,} per epoch)"
    )
    plan = report.get("memory")
    if isinstance(plan, MemoryPlan) and plan.budget is not None:
        lines.append(
            f"  Memory: peak ~{gb(plan.peak)} of max_memory {gb(plan.budget)} "
            f"(weights {gb(plan.weights)}, step {gb(plan.step)}; entrenar info "
            "--memory CONFIG for every part)"
        )
    return lines


def _text_line(p: TextPlan) -> str:
    about = "" if p.exact else "~"
    sampled = "" if p.exact else f" (estimated from {p.sampled:,} rows)"
    lost = p.tokens - p.kept
    cut = f", {about}{lost:,} cut by seq_len" if lost else ""
    left = p.unlabelled
    out = f"; {about}{left:,} rows left out: no loss within seq_len" if left else ""
    return (
        f"{p.rows:,} rows, {about}{p.tokens:,} tokens{cut}, {about}{p.trained:,} "
        f"with a loss, in {about}{p.sequences:,} sequences{sampled}{out}"
    )


__all__ = [
    "SAMPLE_ROWS",
    "TextPlan",
    "format_preflight",
    "plan_text",
    "preflight",
    "sample_records",
]
