"""`plan_memory`: a training run's peak resident memory, predicted before loading.

Everything comes from the model file's header (shapes, dtypes, a GGUF's tensor
types) and the config; no weight is read and nothing the size of the model is
allocated. The run's two phases each have a peak, and the run's is the larger::

    load  = runtime + weights + load_transient
    train = runtime + compiler + weights + adapters + bf16_copy + state_copy
            + optimizer + step

- ``runtime``: the interpreter, JAX, entrenar and the data (`RUNTIME_BYTES`,
  measured), the tokenizer (`TOKEN_BYTES` per token); ``compiler``: what compiling
  the step holds, XLA's compiler and the executable (`COMPILER_BYTES`, measured;
  a DPO or GRPO run's larger programs add `memory_pref.preference_extra`);
- ``weights``: the model's tree as the run holds it: each leaf in ``model.dtype``,
  or NF4 (`quantize_base`, `entrenar.runs.models.base_quantizer`), or as the GGUF
  stores it (``keep_quantized``: `entrenar.quant.from_ggml`'s node of its bytes);
- ``adapters``: the LoRA factors ``A``, ``B`` in that tree, and DoRA's magnitudes
  (or, without LoRA, 0: the whole tree trains); with per-layer ranks
  (``lora.rank_pattern`` by layer) the factors as stored, padded to each stack's
  largest rank, and so are ``state_copy`` and ``optimizer`` (the memory used, not
  the parameter count `entrenar.lora.trainable_report` gives);
- ``bf16_copy``: with ``matmul_dtype: bfloat16`` the Trainer rounds the frozen
  projections to bfloat16 once and keeps them beside the tree it returns
  (`entrenar.nn.to_bfloat16_weights`);
- ``state_copy``: GRPO's loop copies the trainable half (`TrainState.create`: the
  step donates it); a run's Trainer takes the arrays instead (``donate_params``),
  0; ``optimizer``: the optimizer's state over it (``optimizer.init`` traced);
- ``step``: what the jitted train step allocates beyond its arguments: gradients,
  the activations the remat policy keeps, XLA's temporaries, the batch, outputs not
  aliased to donated inputs. It is XLA's own buffer assignment of the real step
  (`make_train_step` on the run's loss, optimizer and state, lowered and compiled on
  `jax.ShapeDtypeStruct` arguments): ``temp + argument(batch) + output - alias``;
- ``load_transient``: the streaming load holds the final tree plus the leaf being
  read: a stacked leaf in ``model.dtype`` and, for a leaf quantized as it loads,
  the quantizer's temporaries (its compiled ``temp``); the maximum over leaves
  (`entrenar.runs.memory_tree`).

What is not counted: the exports after training (a merged model written by
``export.formats`` is folded from the tree: about one float copy of the projections;
the plan's ``notes`` say so), the native kernels' own workspaces (outside XLA's
buffers: 0.05-0.25 GB measured with bfloat16 matmuls), evaluation (a forward step,
smaller than the train step), distillation teachers and multi-device meshes
(`plan_memory` refuses them: `UnsupportedError`).

Preference runs: ``step`` is the largest phase of their loop
(`entrenar.runs.memory_pref`): DPO's train step on ``2B`` rows with the
reference's forward (or the pass that precomputes its log-probs), GRPO's
generation with its KV cache, the reference's log-probs and its train step.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from entrenar import lora, native
from entrenar.config.spec import TrainSpec
from entrenar.errors import ConfigError, UnsupportedError
from entrenar.nn.weight_node import logical_shape
from entrenar.runs.build import build_optimizer, train_config
from entrenar.runs.memory_pref import dpo_step, grpo_step, preference_extra
from entrenar.runs.memory_tree import describe, run_tree, weight_nodes
from entrenar.runs.models import BuiltModel, build_model
from entrenar.train.config import check_budget, parse_bytes
from entrenar.train.model_loss import loss_for_model, with_compute_dtype
from entrenar.train.state import TrainState
from entrenar.train.step import make_train_step
from entrenar.train.trainer import _compute_frozen  # the step reads this half
from entrenar.tree import key_path_str, tree_bytes

RUNTIME_BYTES = 300_000_000
"""The interpreter, JAX's CPU client, entrenar's modules, the data and the small
programs compiled while the run is prepared (0.17-0.22 GB after the imports; 0.30 GB
after preparing a 2-layer Llama with NF4 bases on every linear layer; 0.27 GB fitted
the runs of SmolLM2-135M and a 1.1B model in benchmarks/results/scale.md, all of
which it under-predicted by 2-13%)."""

TOKEN_BYTES = 1_000
"""A tokenizer's memory per token of its vocabulary (SmolLM2's 49,152: 0.046 GB)."""

COMPILER_BYTES = 230_000_000
"""What compiling the train step holds: XLA's compiler and the executable
(measured in fresh processes: 0.19-0.20 GB for SmolLM2-135M's step with LoRA on
q/k/v/o, 0.23 GB for a 2-layer Llama's with NF4 bases and LoRA on every linear
layer; the layers are one scanned program whatever their number)."""


def available_memory() -> int:
    """Bytes this process may still use: ``MemAvailable``, or a lower cgroup limit."""
    avail = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
    except OSError:
        pass
    if avail is None:  # not Linux: the physical memory
        avail = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for limit, usage in (
        ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
        ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
         "/sys/fs/cgroup/memory/memory.usage_in_bytes"),
    ):  # fmt: skip
        try:
            with open(limit) as f, open(usage) as g:
                cap = f.read().strip()
                if cap.isdigit():
                    avail = min(avail, int(cap) - int(g.read().strip()))
        except OSError:
            continue
    return avail


def budget_bytes(value: str | None) -> int | None:
    """The byte budget of ``training.max_memory`` (None: no check)."""
    if value is None:
        return None
    return available_memory() if value == "auto" else parse_bytes(value)


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """A run's predicted memory, in bytes (the module docstring gives the sums).

    Attributes:
        runtime, compiler, weights, adapters, bf16_copy, state_copy, optimizer,
        step, load_transient: the parts of the module docstring.
        weights_detail: how the weights are held (``"60 leaves NF4, ..."``).
        step_detail: batch shape, remat policy and matmul dtype of the step.
        budget: ``training.max_memory`` in bytes (None: no check).
        notes: what the plan does not count for this run (merged exports).
    """

    runtime: int
    compiler: int
    weights: int
    adapters: int
    bf16_copy: int
    state_copy: int
    optimizer: int
    step: int
    load_transient: int
    weights_detail: str = ""
    step_detail: str = ""
    budget: int | None = None
    notes: tuple[str, ...] = ()

    @property
    def load_peak(self) -> int:
        """The load's peak: runtime, the final tree and the leaf being read."""
        return self.runtime + self.weights + self.load_transient

    @property
    def train_peak(self) -> int:
        """The training steps' peak."""
        return (
            self.runtime + self.compiler + self.weights + self.adapters + self.bf16_copy
            + self.state_copy + self.optimizer + self.step
        )  # fmt: skip

    @property
    def peak(self) -> int:
        """The run's peak resident memory: the larger of the two phases."""
        return max(self.load_peak, self.train_peak)

    @property
    def fits(self) -> bool:
        """Whether the peak is within the budget (True without one)."""
        return self.budget is None or self.peak <= self.budget

    def rows(self) -> list[tuple[str, int, str]]:
        """``(part, bytes, what it is)`` for the table, in the order of the sums."""
        return [
            ("runtime", self.runtime, "Python, JAX, entrenar, tokenizer, data"),
            ("compiler", self.compiler, "XLA compiling the step, its executable"),
            ("weights", self.weights, self.weights_detail),
            ("adapters", self.adapters, "LoRA A and B in the run's tree"),
            ("bf16 copy", self.bf16_copy, "frozen projections rounded once "
             "(matmul_dtype: bfloat16)"),
            ("state copy", self.state_copy, "the step's copy of the trainable "
             "half"),
            ("optimizer", self.optimizer, "optimizer state"),
            ("step", self.step, self.step_detail),
            ("load transient", self.load_transient, "the leaf being loaded "
             "(and quantized)"),
        ]  # fmt: skip


def gb(n: int) -> str:
    """Bytes as gigabytes, two decimals (``"1.23 GB"``)."""
    return f"{n / 1e9:.2f} GB"


def _size(n: int) -> str:
    """``"1.23 GB"``, or ``"4.5 MB"`` below 10 MB."""
    return gb(n) if n >= 10**7 else f"{n / 1e6:.1f} MB"


def format_plan(plan: MemoryPlan) -> list[str]:
    """The plan as a table of lines: each part, then the phases' peaks."""
    lines = [f"  {'part':<15} {'GB':>8}  what"]
    for name, n, what in plan.rows():
        lines.append(f"  {name:<15} {n / 1e9:>8.3f}  {what}")
    lines.append(f"  {'load peak':<15} {plan.load_peak / 1e9:>8.3f}  runtime + "
                 "weights + load transient")  # fmt: skip
    lines.append(f"  {'train peak':<15} {plan.train_peak / 1e9:>8.3f}  runtime + "
                 "compiler + weights + ... + step")  # fmt: skip
    phase = "training" if plan.train_peak >= plan.load_peak else "loading"
    budget = "no max_memory" if plan.budget is None else (
        f"max_memory {gb(plan.budget)}: " + ("fits" if plan.fits else "DOES NOT FIT")
    )  # fmt: skip
    lines.append(f"  {'peak':<15} {plan.peak / 1e9:>8.3f}  {phase}; {budget}")
    lines += [f"  note: {note}" for note in plan.notes]
    return lines


def refusal(plan: MemoryPlan) -> str:
    """The message of a run that does not fit: the numbers and the knobs."""
    assert plan.budget is not None
    parts = ", ".join(f"{name} {_size(n)}" for name, n, _ in plan.rows() if n)
    phase = "training" if plan.train_peak >= plan.load_peak else "loading"
    return (
        f"training.max_memory: this run needs about {gb(plan.peak)} at its peak "
        f"({phase}), over the budget of {gb(plan.budget)}. Parts: {parts}. To fit, "
        "lower data.batch_size or data.seq_len (activations), set "
        "model.remat_policy (e.g. nothing_saveable: keep fewer activations; "
        "with it model.llama_options: {remat_saved_dtype: bfloat16} keeps them "
        "in half), "
        "lora.quantize_base: nf4 or model.keep_quantized: true (4-bit bases; with "
        "lora.quantize_untargeted: true also the weights no target adapts), fewer "
        "lora.targets or a lower lora.rank (adapters, optimizer), model.dtype: "
        "bfloat16 (halves the float weights), model.matmul_dtype or "
        "training.compute_dtype (the step's temporaries; a bfloat16 matmul_dtype "
        "also keeps the bf16 copy), model.tied_head_copy: false (a tied head's "
        "transposed copy); `entrenar info --memory CONFIG` shows each part; "
        "or raise training.max_memory"
    )


def _batch(spec: TrainSpec, built: BuiltModel) -> dict[str, jax.ShapeDtypeStruct]:
    """One step's batch as `build_data`'s loaders give it (shapes)."""
    d = spec.data
    assert d is not None
    rows = d.batch_size * spec.training.grad_accum
    if built.is_lm:
        keys = ["input_ids", "labels"] + (
            ["segment_ids", "positions"] if d.packing else []
        )
        out = {k: jax.ShapeDtypeStruct((rows, d.seq_len), np.int32) for k in keys}
        out["attention_mask"] = jax.ShapeDtypeStruct((rows, d.seq_len), np.bool_)
        return out
    n_in, n_out = built.config.sizes[0], built.config.sizes[-1]
    y = (
        jax.ShapeDtypeStruct((rows, 1), np.float32)
        if d.task == "regression"
        else jax.ShapeDtypeStruct((rows,), np.int32)
    )
    del n_out
    return {"x": jax.ShapeDtypeStruct((rows, n_in), np.float32), "y": y}


def _new_bf16_bytes(before: Any, after: Any) -> int:
    """Bytes of the leaves `to_bfloat16_weights` adds (``bits``, ``head_t``, a head).

    ``before``/``after``: the frozen half and its converted form. The ``bits`` of a
    weight that already was bfloat16 are a view of it (`Bfloat16Weight.from_array`),
    not new memory.
    """
    was_bf16 = {
        key_path_str(p)
        for p, x in jax.tree_util.tree_flatten_with_path(before)[0]
        if getattr(x, "dtype", None) == jnp.bfloat16
    }
    names = {
        key_path_str(p) for p, _ in jax.tree_util.tree_flatten_with_path(before)[0]
    }
    leaves = jax.tree_util.tree_flatten_with_path(after)[0]
    return sum(
        tree_bytes(x)
        for p, x in leaves
        if key_path_str(p).endswith("head_t")
        or (key_path_str(p).endswith("bits") and key_path_str(p)[:-5] not in was_bf16)
        or (
            key_path_str(p) in names
            and key_path_str(p) not in was_bf16
            and getattr(x, "dtype", None) == jnp.bfloat16
        )  # an untied lm_head rounded to a plain bfloat16 array
    )


def plan_memory(spec: TrainSpec, *, compile_step: bool = True) -> MemoryPlan:
    """Predict the peak resident memory of ``spec``'s run, reading headers only.

    Args:
        spec: a validated training run (`entrenar.config.validate`).
        compile_step: compile the train step on shapes for its memory (seconds);
            False leaves ``step`` at 0 (the weights' parts alone).

    Returns:
        A `MemoryPlan` (the module docstring gives its parts); ``budget`` is
        ``training.max_memory`` in bytes (None when unset).

    Raises:
        UnsupportedError: a distillation run or a multi-device mesh.
        EntrenarError: what `entrenar validate` raises for the model's header.
    """
    if spec.model is None or spec.data is None or spec.is_merge:
        raise UnsupportedError("the memory plan is of a training run (model and data)")
    if spec.distillation is not None:
        raise UnsupportedError(
            "training.max_memory: the memory predictor does not cover distillation "
            "runs yet (the teacher's weights and forward); remove max_memory"
        )
    if spec.training.mesh is not None:
        raise UnsupportedError(
            "training.max_memory: the memory predictor covers one device; remove "
            "max_memory or training.mesh"
        )
    with native.policy(spec.model.kernels):  # the program the run compiles
        return _plan(spec, compile_step=compile_step)


def _plan(spec: TrainSpec, *, compile_step: bool) -> MemoryPlan:
    """`plan_memory` under the run's kernel policy (its checks done)."""
    assert spec.model is not None
    key = jax.random.key(spec.training.seed)
    built = build_model(spec.model, key=key, header_only=True)
    c = spec.lora if spec.lora is not None and spec.lora.enabled else None
    params, weights, adapters, transient = run_tree(spec, built, c)
    trainable = "lora" if c is not None else None
    optimizer = build_optimizer(spec, spec.training.max_steps or 1_000_000)
    state = jax.eval_shape(
        lambda p: TrainState.create(p, optimizer, key=key, trainable=trainable), params
    )
    model = built.config
    frozen = given = state.frozen
    if frozen is not None and spec.grpo is None:  # GRPO steps its own state
        frozen = jax.eval_shape(lambda f: _compute_frozen(model, f), frozen)
    bf16 = (
        _new_bf16_bytes(given, frozen) if given is not None and spec.grpo is None else 0
    )
    step, detail = 0, "not compiled"
    if compile_step and (spec.preference is not None or spec.grpo is not None):
        step, detail = _preference_step(spec, built, params, optimizer, state, frozen)
    elif compile_step:
        step, detail = _step_bytes(
            spec, built, optimizer, state, frozen,
            make_train_step, loss_for_model, with_compute_dtype,
        )  # fmt: skip
    merged: list[str] = []
    if c is not None:  # a LoRA run's plain weights are folded from the adapters
        merged = [f for f in spec.export.formats if f != "adapter"]
    if spec.quantization is not None and spec.quantization.enabled:
        merged.append("quantization")
    notes: tuple[str, ...] = ()
    if merged:
        base = lora.split(params)[1] if c is not None else params
        dense = 4 * sum(math.prod(logical_shape(x)) for x in weight_nodes(base))
        notes = (
            f"not counted: after training, {', '.join(merged)} write the model "
            f"from float copies of its weights (adapters folded in; {gb(dense)} "
            "each in float32)",
        )
    return MemoryPlan(
        runtime=RUNTIME_BYTES
        + TOKEN_BYTES * len(getattr(built.tokenizer, "tokens", ())),
        compiler=COMPILER_BYTES + preference_extra(spec, params),
        weights=weights,
        adapters=adapters,
        bf16_copy=bf16,
        state_copy=tree_bytes(state.trainable) if spec.grpo is not None else 0,
        optimizer=tree_bytes(state.opt_state),
        step=step,
        load_transient=transient,
        weights_detail=describe(lora.split(params)[1] if c is not None else params),
        step_detail=detail,
        budget=budget_bytes(spec.training.max_memory),
        notes=notes,
    )


def _preference_step(
    spec: TrainSpec, built: BuiltModel, params: Any, optimizer: Any, state: Any,
    frozen: Any,
) -> tuple[int, str]:  # fmt: skip
    """``step`` of a DPO or GRPO run: its largest phase (`memory_pref`)."""
    if spec.grpo is not None:
        return grpo_step(spec, built, params, optimizer, state)
    return dpo_step(spec, built, params, optimizer, state, frozen)


def _step_bytes(
    spec: TrainSpec, built: BuiltModel, optimizer: Any, state: Any, frozen: Any,
    make_train_step: Any, loss_for_model: Any, with_compute_dtype: Any,
) -> tuple[int, str]:  # fmt: skip
    """``(bytes, description)`` of the run's train step.

    ``bytes``: XLA's temporaries, the batch and the outputs not aliased to donated
    inputs (XLA's buffer assignment of the compiled step).
    """
    cfg = train_config(spec, progress=False)
    loss_fn = with_compute_dtype(
        loss_for_model(built.config, cfg.loss), cfg.compute_dtype
    )
    step = make_train_step(
        loss_fn, optimizer, grad_accum=cfg.grad_accum, clip=cfg.grad_clip,
        skip_nonfinite=True,
    )  # fmt: skip
    batch = _batch(spec, built)
    compiled = step.jitted.lower(
        state.trainable, state.opt_state, frozen, state.step, state.key, batch
    ).compile()
    m = compiled.memory_analysis()
    if m is None:
        raise UnsupportedError(
            f"the {jax.default_backend()} backend reports no memory analysis of the "
            "compiled step: the memory predictor cannot run here; remove max_memory"
        )
    temp, out, alias = (
        int(m.temp_size_in_bytes),
        int(m.output_size_in_bytes),
        int(m.alias_size_in_bytes),
    )
    n = temp + tree_bytes(batch) + max(out - alias, 0)
    d = spec.data
    assert d is not None
    config = built.config
    what = f"batch {d.batch_size * spec.training.grad_accum} x "
    what += f"{d.seq_len}" if built.is_lm else f"{built.config.sizes[0]} features"
    if built.is_decoder:
        what += f", remat {config.remat_policy or 'none'}"
        if config.remat_saved_dtype is not None:
            what += f" (inputs kept in {config.remat_saved_dtype})"
        what += ", matmul "
        what += f"{config.matmul_dtype or 'float32'}"
    if cfg.compute_dtype:
        what += f", compute {cfg.compute_dtype}"
    return n, f"gradients, activations, temporaries ({what})"


def check_memory(spec: TrainSpec) -> MemoryPlan | None:
    """Refuse a run whose predicted peak exceeds ``training.max_memory``.

    Returns:
        The plan (None when ``max_memory`` is unset: nothing is checked).

    Raises:
        ConfigError: the predicted peak is over the budget; the message gives each
            part and the settings that lower it (`refusal`).
    """
    if spec.training.max_memory is None or spec.is_merge:
        return None
    plan = plan_memory(spec)
    if not plan.fits:
        raise ConfigError(refusal(plan))
    return plan


__all__ = [
    "COMPILER_BYTES",
    "RUNTIME_BYTES",
    "TOKEN_BYTES",
    "MemoryPlan",
    "available_memory",
    "budget_bytes",
    "check_budget",
    "check_memory",
    "format_plan",
    "parse_bytes",
    "plan_memory",
    "refusal",
]
