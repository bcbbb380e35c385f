"""`train_from_yaml`: a whole run from one YAML file.

The workflow, top to bottom (each step in its own function below):

1. load and validate the config (with overrides);
2. build the model: read a GGUF / safetensors / HF folder, or initialise an
   architecture from scratch (`entrenar.runs.models`);
3. wrap the targeted weights in LoRA adapters, the bases 4-bit for QLoRA
   (`entrenar.lora.apply`);
4. build the data (`entrenar.data`), the schedule and the optimizer
   (`entrenar.optim`), and the loss: the model's own, distillation from a teacher
   (`entrenar.distill.make_distill_loss_fn`) or DPO on preference pairs
   (`entrenar.preference.make_dpo_loss_fn`, the reference's log-probabilities
   precomputed here for full fine-tuning); a ``grpo`` section runs the online
   loop instead (`entrenar.runs.online`: sample, score, step);
5. `entrenar.train.Trainer.fit`: metrics.jsonl, checkpoints/, early stopping, resume;
6. export: adapter (PEFT), model files, GGUF / HF folder, a quantized copy, loss.png.

A config whose only job is a ``merge`` recipe runs `entrenar.merge.run_recipe` instead.
"""

from __future__ import annotations

import dataclasses
import json
import os
import warnings
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from entrenar import distributed, lora, native
from entrenar.config.spec import TrainSpec
from entrenar.config.summary import as_dict, validate
from entrenar.distill import make_distill_loss_fn
from entrenar.errors import ConfigError, UnsupportedError
from entrenar.io import atomic_write
from entrenar.io.lock import OutputLock
from entrenar.preference import make_dpo_loss_fn, reference_logps
from entrenar.runs.build import (
    RunData,
    apply_lora,
    build_data,
    build_optimizer,
    build_schedule,
    check_teacher,
    total_steps,
    train_config,
)
from entrenar.runs.export import (
    check_adapter_export,
    check_gguf_export,
    check_hf_export,
    check_quantizable,
    write_outputs,
)
from entrenar.runs.memory_plan import check_memory
from entrenar.runs.merging import run_merge
from entrenar.runs.models import (
    BuiltModel,
    base_quantizer,
    build_model,
    load_built,
    tokenizer_ref,
)
from entrenar.train import Callback, Trainer, TrainResult
from entrenar.train.checkpoint import resolve_resume
from entrenar.train.plot import plot


@dataclasses.dataclass
class RunResult:
    """What `train_from_yaml` returns.

    Attributes:
        spec: the validated `TrainSpec` (overrides applied).
        output_dir: where the run wrote its files.
        files: what was written, by kind (``"safetensors"``, ``"adapter"``,
            ``"gguf"``, ``"quantized"``, ``"merged"``, ``"metrics"``, ``"plot"``...).
        train: the Trainer's result (None for a dry run or a merge).
        metrics: final figures: ``steps``, ``train_loss``, ``eval_loss``...
    """

    spec: TrainSpec
    output_dir: str
    files: dict[str, str]
    train: TrainResult | None = None
    metrics: dict[str, Any] = dataclasses.field(default_factory=dict)

    def _repr_html_(self) -> str:
        """Jupyter's view: the final figures, the files written, the training run."""
        import html

        def table(d: Mapping[str, Any]) -> str:
            rows = "".join(
                f"<tr><th style='text-align:left'>{html.escape(str(k))}</th>"
                f"<td style='text-align:left'>{html.escape(str(v))}</td></tr>"
                for k, v in d.items()
            )
            return f"<table>{rows}</table>"

        name = html.escape(self.spec.name or "")
        out = f"<b>RunResult</b> {name} in {html.escape(self.output_dir)}"
        out += table(self.metrics) + table(self.files)
        return out + (self.train._repr_html_() if self.train is not None else "")


@dataclasses.dataclass
class Prepared:
    """Everything `fit` needs, built from the spec (what ``--dry-run`` checks)."""

    built: BuiltModel
    params: Any
    loss: Any
    trainable: Any
    data: RunData
    optimizer: Any
    total: int


def prepare(spec: TrainSpec) -> Prepared:
    """Steps 2-4: model, adapters, data, optimizer and loss, ready for `Trainer`."""
    assert spec.model is not None
    key = jax.random.key(spec.training.seed)
    built = build_model(
        spec.model,
        key=jax.random.fold_in(key, 0),
        quantize=base_quantizer(spec.lora),  # QLoRA bases quantized as they load
    )
    spec.check_architecture(built.architecture)
    params, trainable = built.params, None
    if spec.lora is not None and spec.lora.enabled:
        params, trainable = (
            apply_lora(spec, params, jax.random.fold_in(key, 1)),
            "lora",
        )
    teacher = None
    if spec.distillation is not None:
        teacher = load_built(spec.distillation.teacher)
        check_teacher(built, teacher, spec.distillation.teacher)
    data = build_data(spec, built, teacher)
    total = total_steps(spec, data.steps_per_epoch)
    optimizer = build_optimizer(spec, total)
    loss: Any = built.config
    if spec.distillation is not None and teacher is not None:
        d = spec.distillation
        loss = make_distill_loss_fn(
            built.config, teacher.config, teacher.params,
            temperature=d.temperature, alpha=d.alpha,
        )  # fmt: skip
        params = loss.init(params, key=jax.random.fold_in(key, 2))
        trainable = loss.trainable
    if spec.preference is not None:
        p = spec.preference
        reference = p.reference
        if reference == "auto":
            reference = "adapters" if trainable == "lora" else "precomputed"
        loss = make_dpo_loss_fn(
            built.config, beta=p.beta, loss_type=p.loss_type,
            label_smoothing=p.label_smoothing, reference=reference,
            disable_dropout=p.disable_dropout,
        )  # fmt: skip
        if reference == "precomputed":
            assert spec.data is not None
            with_reference_logps(built.config, params, data, spec.data.batch_size)
    return Prepared(built, params, loss, trainable, data, optimizer, total)


def with_reference_logps(model: Any, params: Any, data: RunData, batch: int) -> None:
    """Add the starting model's ``ref_chosen_logps``/``ref_rejected_logps``.

    TRL's ``precompute_ref_log_probs``: one pass over the training (and
    evaluation) pairs before the first step, ``batch`` pairs at a time.
    """
    fn = jax.jit(lambda p, b: reference_logps(model, p, b))
    for arrays in (data.train, data.eval):
        if arrays is None:
            continue
        n = len(arrays["input_ids"])
        chosen, rejected = [], []
        for i in range(0, n, batch):
            part = {k: v[i : i + batch] for k, v in arrays.items()}
            c, r = fn(params, part)
            chosen.append(np.asarray(c))
            rejected.append(np.asarray(r))
        arrays["ref_chosen_logps"] = np.concatenate(chosen).astype(np.float32)
        arrays["ref_rejected_logps"] = np.concatenate(rejected).astype(np.float32)


def train_from_yaml(
    path: str | os.PathLike[str],
    overrides: Mapping[str, Any] | None = None,
    *,
    resume: str | None = None,
    dry_run: bool = False,
    progress: bool = True,
) -> RunResult:
    """Run the whole workflow a YAML file describes (see the module docstring).

    Args:
        path: the run's YAML file (specs/config.md).
        overrides: dotted keys to set, e.g. ``{"training.max_steps": 5}``.
        resume: ``"latest"`` or a checkpoint path to continue from (None: fresh).
        dry_run: build everything (model, adapters, data, optimizer) and stop
            before training; nothing is written.
        progress: show the progress bar.

    Returns:
        A `RunResult` with the files written and the final metrics.

    Raises:
        ConfigError: an invalid config (before anything runs), naming the key, or
            an ``output_dir`` another run is writing (`entrenar.io.lock`).
        UnsupportedError: ``model.kernels: native`` where the native kernels
            cannot run (`entrenar.native.check`, before the model loads).
        ConfigError: a predicted peak over ``training.max_memory``
            (`entrenar.runs.memory_plan.check_memory`, before the model loads).
        ConfigError: a ``training.mesh`` that does not fit the devices or the
            batch (`check_mesh`, before the model loads).
    """
    spec = validate(path, overrides)
    out_dir = spec.output_dir
    if spec.is_merge:
        if dry_run:
            return RunResult(spec, out_dir, {})
        return RunResult(spec, out_dir, run_merge(spec))
    assert spec.model is not None  # validate: every run but a merge has one
    with native.policy(spec.model.kernels):  # model.kernels, for this run only
        native.check()
        check_memory(spec)  # training.max_memory: refused before anything loads
        check_mesh(spec)  # training.mesh: the devices and the batch, likewise
        if spec.grpo is not None:  # online RL: its own loop (entrenar.runs.online)
            return _grpo(spec, resume=resume, dry_run=dry_run, progress=progress)
        if dry_run:
            prep = prepare(spec)
            _check_exports(spec, prep)
            return RunResult(spec, out_dir, {}, metrics=_plan(prep))
        # One writer per output folder, checked before the model loads (process 0
        # of a multi-process run holds it for all).
        with OutputLock(out_dir, enabled=jax.process_index() == 0):
            saved = None
            if resume is not None:
                saved = check_resume_config(spec, resume)  # before the model loads
            prep = prepare(spec)
            _check_exports(spec, prep)  # the quantized copy, before training
            if saved is not None:
                check_resume_schedule(spec, saved, prep)
            return _train(spec, prep, resume=resume, progress=progress)


def _grpo(
    spec: TrainSpec, *, resume: str | None, dry_run: bool, progress: bool
) -> RunResult:
    from entrenar.runs.online import prepare_grpo, train_grpo

    if spec.training.mesh is not None:
        raise ConfigError("training.mesh: a grpo run is on one device for now")
    if dry_run:
        _, _, records = prepare_grpo(spec)
        return RunResult(spec, spec.output_dir, {},
                         metrics={"prompts": len(records)})  # fmt: skip
    with OutputLock(spec.output_dir, enabled=jax.process_index() == 0):
        if resume is not None:
            saved = check_resume_config(spec, resume)  # before the model loads
            then = ((saved or {}).get("training") or {}).get("max_steps")
            if isinstance(then, int) and then > 0:
                _warn_schedule_moved(spec, then, int(spec.training.max_steps or 0))
        out = train_grpo(spec, resume=resume, progress=progress)
    _write_json(os.path.join(spec.output_dir, "result.json"), out)
    return RunResult(spec, spec.output_dir, out["files"], metrics=out["metrics"])


def check_mesh(spec: TrainSpec) -> None:
    """Refuse a ``training.mesh`` this process cannot run, before the model loads.

    Raises:
        ConfigError: the mesh's sizes do not multiply to the device count, or
            ``data.batch_size × training.grad_accum`` rows do not split over them.
    """
    t, d = spec.training, spec.data
    if t.mesh is None or d is None:
        return
    try:
        mesh = distributed.make_mesh(t.mesh)
    except ConfigError as e:  # the key, as validate's errors name it
        raise ConfigError(f"training.mesh: {e}") from None
    distributed.check_batch_rows(
        d.batch_size * t.grad_accum, mesh,
        f"data.batch_size × training.grad_accum = {d.batch_size} × {t.grad_accum}",
    )  # fmt: skip


RESUME_REFUSED = (
    "model.path", "model.architecture", "model.config", "model.tokenizer",
    "model.dtype", "lora.enabled", "lora.rank", "lora.alpha", "lora.targets",
    "lora.quantize_base", "lora.quantize_untargeted", "lora.init", "lora.rslora",
    "lora.use_dora",
    "lora.rank_pattern", "lora.alpha_pattern", "distillation", "preference", "grpo",
    "data.train", "data.validation_split", "data.format", "data.text_field",
    "data.prompt_field", "data.completion_field", "data.messages_field",
    "data.features", "data.target", "data.task", "data.normalize", "data.seq_len",
    "data.packing", "data.overflow",
)  # fmt: skip
"""Keys whose change makes a resumed run train another model, loss or examples."""

RESUME_FREE = (
    "name", "source", "export", "quantization", "training.epochs",
    "training.max_steps", "training.eval_every", "training.checkpoint_every",
    "training.keep_checkpoints", "training.log_every", "training.early_stopping",
    "training.export_best", "training.output_dir", "training.mesh",
    "training.max_memory", "training.tensorboard", "model.kernels",
    "model.remat_policy", "model.tied_head_copy",
    # the Trainer warns about these itself (the data order)
    "training.seed", "training.grad_accum", "data.batch_size", "data.shuffle",
)  # fmt: skip
"""Keys a resumed run may change: its length, schedule of outputs, exports."""


def check_resume_config(spec: TrainSpec, resume: str) -> dict[str, Any] | None:
    """Compare ``spec`` with the config of the run whose checkpoint ``resume`` names.

    That run's ``config.json`` (written at its first step; absent: nothing to
    compare) against this one's keys, leaf by leaf. A change of `RESUME_REFUSED`
    (another model, adapters, teacher or examples under the same trained arrays,
    which orbax restores silently when the shapes agree) is refused; one outside
    `RESUME_FREE` (optimizer, schedule, clipping, dtypes...) is warned about: the
    run continues, but will not match an uninterrupted one.

    Returns:
        The saved config (None: no checkpoint, or no readable ``config.json``).

    Raises:
        ConfigError: a refused change, naming each key with its saved and new value.
    """
    folder, _ = resolve_resume(resume, spec.output_dir)
    saved_path = os.path.join(os.path.dirname(os.path.abspath(folder)), "config.json")
    has_checkpoint = os.path.isdir(folder) and any(
        n.isdigit() for n in os.listdir(folder)
    )
    if not has_checkpoint or not os.path.isfile(saved_path):
        return None  # a fresh start, or a run that wrote no config.json
    try:
        with open(saved_path, encoding="utf-8") as f:
            saved = json.load(f)
    except (OSError, ValueError):
        return None  # unreadable: the checkpoint's own checks still apply
    if not isinstance(saved, dict):
        return None
    now = json.loads(json.dumps(as_dict(spec), default=str))
    changed = _leaf_changes(saved, now)

    def under(key: str, prefixes: tuple[str, ...]) -> bool:
        """``key`` is one of ``prefixes``, inside one, or a section holding one."""
        return any(
            key == p or key.startswith(p + ".") or p.startswith(key + ".")
            for p in prefixes
        )

    refused = {k: v for k, v in changed.items() if under(k, RESUME_REFUSED)}
    if refused:
        what = "; ".join(f"{k}: {a!r} then, {b!r} now" for k, (a, b) in refused.items())
        raise ConfigError(
            f"--resume {resume}: this config changes what the checkpoints in "
            f"{folder} were trained on ({what}; from {saved_path}). Put the values "
            f"back to continue that run, or start a new run in another "
            f"training.output_dir (from its exported model to keep the training)"
        )
    warned = {k: v for k, v in changed.items() if not under(k, RESUME_FREE)}
    if warned:
        what = "; ".join(f"{k}: {a!r} then, {b!r} now" for k, (a, b) in warned.items())
        warnings.warn(
            f"--resume {resume}: the config differs from the run's ({what}): the "
            f"run goes on with the new values and will not match an uninterrupted "
            f"one",
            stacklevel=3,
        )
    return saved


def check_resume_schedule(
    spec: TrainSpec, saved: dict[str, Any], prep: Prepared
) -> None:
    """Warn when a resumed run's new length moves its learning rates.

    ``scheduler`` lays its warm-up and decay over the run's steps (``max_steps``,
    or ``epochs`` × steps per epoch), so a run extended at resume (free, see
    `RESUME_FREE`) gets, from the checkpoint on, the rates of a longer schedule:
    ``linear`` to 0 over 8 steps, extended to 10, trained steps 1-8 at the 8-step
    rates and 9-10 at the end of the 10-step decay, matching no uninterrupted run
    of either length. Compared over the saved run's steps: ``lr(t)`` of both
    lengths.
    """
    t = saved.get("training")
    if spec.scheduler is None or not isinstance(t, dict):
        return
    epochs, max_steps = t.get("epochs"), t.get("max_steps")
    if isinstance(max_steps, int) and max_steps > 0:
        then = max_steps
    elif isinstance(epochs, int) and epochs > 0:
        then = epochs * prep.data.steps_per_epoch
    else:
        return
    _warn_schedule_moved(spec, then, prep.total)


def _warn_schedule_moved(spec: TrainSpec, then: int, total: int) -> None:
    """`check_resume_schedule`'s warning: the rates of ``then`` and ``total`` steps."""
    if spec.scheduler is None or then == total:
        return
    old, new = build_schedule(spec, then), build_schedule(spec, total)
    differ = [s for s in range(min(then, total)) if float(old(s)) != float(new(s))]
    if differ:
        warnings.warn(
            f"the run now has {total} steps, {then} before: scheduler "
            f"{spec.scheduler.name!r} is laid over the new length, and its learning "
            f"rates differ from those of the schedule the checkpoint was trained on "
            f"(first at step {differ[0] + 1}): the run goes on at other rates than "
            f"planned and will match no uninterrupted run (a schedule that does not "
            f"depend on the length, or a fixed decay_steps, keeps them)",
            stacklevel=4,
        )


def _leaf_changes(saved: Any, now: Any, prefix: str = "") -> dict[str, tuple[Any, Any]]:
    """``{dotted key: (saved, now)}`` of the leaves that differ."""
    if isinstance(saved, dict) and isinstance(now, dict):
        out: dict[str, tuple[Any, Any]] = {}
        for k in {**saved, **now}:
            key = f"{prefix}.{k}" if prefix else str(k)
            out |= _leaf_changes(saved.get(k), now.get(k), key)
        return out
    return {} if saved == now else {prefix: (saved, now)}


def _train(
    spec: TrainSpec, prep: Prepared, *, resume: str | None, progress: bool
) -> RunResult:
    """Steps 5 and 6: train, then write the exports, metrics and result.json."""
    out_dir = spec.output_dir
    cfg = train_config(spec, progress=progress)
    trainer = Trainer(
        prep.loss, prep.params, prep.optimizer, cfg, trainable=prep.trainable,
        callbacks=[_ConfigWriter(spec)], donate_params=True,
    )  # fmt: skip  # prep.params' trainable arrays are the state's: not held twice
    result = trainer.fit(prep.data.train, prep.data.eval, resume=resume)
    params = result.params
    if spec.distillation is not None:
        params = params["student"]
    # several processes: every array whole on each (a collective, so all call it);
    # process 0 writes the outputs, as it wrote the metrics
    params = distributed.gather_to_host(params)
    metrics = _final_metrics(result, export_best=spec.training.export_best)
    if jax.process_index() != 0:
        return RunResult(spec, out_dir, {}, result, metrics)
    extra: dict[str, Any] = {"tabular": prep.data.stats} if prep.data.stats else {}
    # the tokenizer the model files name: model.tokenizer, else the source's own (a
    # GGUF, a Hugging Face folder, or the one an entrenar model file names)
    tokenizer = (spec.model.tokenizer if spec.model else None) or (
        prep.built.tokenizer_source
    )
    if prep.built.is_lm and tokenizer:
        extra["tokenizer"] = tokenizer_ref(tokenizer, os.path.join(out_dir, "model"))
    files = write_outputs(
        spec, prep.built, params, out_dir, extra=extra, report=metrics
    )
    files["metrics"] = os.path.join(out_dir, "metrics.jsonl")
    files["checkpoints"] = os.path.join(out_dir, "checkpoints")
    files |= _plot(out_dir)
    _write_json(
        os.path.join(out_dir, "result.json"), {"metrics": metrics, "files": files}
    )
    return RunResult(spec, out_dir, files, result, metrics)


class _ConfigWriter(Callback):
    """Writes ``config.json`` (the validated config) at the run's first step.

    Not before `Trainer.fit` has accepted the output folder: a run it refuses (the
    folder holds another run's checkpoints, a resume path that is not one) leaves
    the earlier run's ``config.json`` as it was.
    """

    def __init__(self, spec: TrainSpec) -> None:
        self.spec, self.written = spec, False

    def on_step(self, trainer: Any, step: int, metrics: dict[str, Any]) -> None:
        if not self.written and jax.process_index() == 0:
            _write_json(
                os.path.join(self.spec.output_dir, "config.json"), as_dict(self.spec)
            )
            self.written = True


def _check_exports(spec: TrainSpec, prep: Prepared) -> None:
    """What the exports after training would refuse, refused before it."""
    params = prep.params["student"] if spec.distillation is not None else prep.params
    check_quantizable(spec, prep.built, params)
    check_adapter_export(spec, prep.built, params)
    check_gguf_export(spec, prep.built)
    check_hf_export(spec, prep.built)


def _plan(prep: Prepared) -> dict[str, Any]:
    trainable = (
        prep.params
        if prep.trainable is None
        else (lora.split(prep.params)[0] if prep.trainable == "lora" else None)
    )
    out = {
        "steps": prep.total,
        "steps_per_epoch": prep.data.steps_per_epoch,
        "examples": prep.data.examples,
        "parameters": lora.trainable_report(prep.params).total_params,
    }
    if trainable is not None:
        out["trainable_parameters"] = lora.trainable_report(trainable).total_params
    return out


def _plot(out_dir: str) -> dict[str, str]:
    """``loss.png`` when matplotlib is installed (the plot is optional)."""
    try:
        return {"plot": plot(out_dir)}
    except UnsupportedError:  # no matplotlib
        return {}


def _final_metrics(result: TrainResult, *, export_best: bool) -> dict[str, Any]:
    """result.json's ``metrics``.

    ``exported_step`` (only with ``training.export_best``): the step whose
    parameters were exported, ``best_step``.
    """
    out: dict[str, Any] = {"steps": result.steps, "stopped_early": result.stopped_early}
    if result.history:
        out["train_loss"] = result.history[-1].get("loss")
    if result.eval_history:
        out["eval_loss"] = result.eval_history[-1].get("eval_loss")
        out["best_eval_loss"] = result.best_eval_loss
        out["best_step"] = result.best_step
    if export_best:
        out["exported_step"] = result.params_step
    return out


def _write_json(path: str, data: Any) -> None:
    with atomic_write(path, "w") as f:
        json.dump(data, f, indent=2, default=str)


__all__ = [
    "RESUME_FREE",
    "RESUME_REFUSED",
    "Prepared",
    "RunResult",
    "check_mesh",
    "check_resume_config",
    "check_resume_schedule",
    "prepare",
    "train_from_yaml",
]
