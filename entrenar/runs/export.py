"""The files a run writes after training, and quantized model files.

A quantized model that is not a llama.cpp GGUF is stored as an `entrenar.io` model
file in the layout of `entrenar.io.split_quantized`.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from typing import Any

import jax

from entrenar import io, lora, nn, quant
from entrenar.errors import (
    CompatibilityError,
    ConfigError,
    FormatError,
    UnsupportedError,
)
from entrenar.io.atomic import remove_temporaries
from entrenar.io.gguf_tokenizer import gguf_tokenizer_fields
from entrenar.io.hf_mxfp4 import check_hf_expert_type
from entrenar.io.llama_gguf_write import check_expert_type, check_llama_gguf
from entrenar.io.lock import OutputLock
from entrenar.lora.adapter_io import check_saveable
from entrenar.runs.models import BuiltModel, dicts_from_lists, save_built
from entrenar.types import Params

GGML_SCHEMES = ("q8_0", "q4_0", "q4_1")


def quantize_options(
    scheme: str, block_size: int, per_channel: bool, symmetric: bool = True
) -> dict[str, Any]:
    """Keyword options of `entrenar.quant.quantize` for a scheme.

    ``symmetric=False`` gives int8 zero points (uint8 codes); q4_1 is the
    asymmetric 4-bit GGML scheme by itself.
    """
    if scheme in GGML_SCHEMES:
        return {}
    opts: dict[str, Any] = {"block_size": block_size}
    if scheme == "nf4":
        opts["double_quant"] = True
    if scheme == "int8" and per_channel:
        opts["granularity"] = "channel"
    if scheme == "int8" and not symmetric:
        opts["symmetric"] = False
    return opts


def gguf_tokenizer(built: BuiltModel) -> Any:
    """The tokenizer a GGUF of ``built`` is written with, when no source GGUF has one.

    The model's own (a Hugging Face folder's `entrenar.io.HFTokenizer`, or the GGUF
    tokenizer a stored model names), so that llama.cpp can run the file. None, with
    a `UserWarning` saying why the file will have no tokenizer, when it has more
    tokens than the model's ``vocab_size`` or llama.cpp has no form for it.
    """
    tok = built.tokenizer
    if built.gguf_source is not None or tok is None or not built.is_decoder:
        return None
    try:
        gguf_tokenizer_fields(tok, vocab_size=built.config.vocab_size)
    except (FormatError, UnsupportedError) as e:
        warnings.warn(
            f"the GGUF is written without a tokenizer, so llama.cpp cannot run it "
            f"as is: {e}",
            UserWarning,
            stacklevel=3,
        )
        return None
    return tok


def check_quantizable(spec: Any, built: BuiltModel, params: Params) -> None:
    """Refuse, before training, a ``quantization`` that would quantize no weight.

    The quantized copy is written after training (`write_quantized_model`), which
    quantizes each floating weight whose rows split into whole blocks; a model with
    none (the wine MLP's rows of 13 and 8 in int8 blocks of 64) trained to the end
    and then failed. Checked on shapes only (``jax.eval_shape``: nothing is
    computed), with the same choice; a Llama-style decoder in a GGML scheme is
    written by the GGUF writer and is not checked here.

    Raises:
        ConfigError: naming ``quantization`` and what to change.
    """
    q = spec.quantization
    if q is None or not q.enabled:
        return
    scheme = q.resolved_scheme
    if built.is_decoder and scheme in GGML_SCHEMES:
        return
    options = quantize_options(scheme, q.block_size, q.per_channel)

    def quantized(p: Params) -> Params:
        plain = quant.dequantize_params(lora.fold(p) if has_adapters(p) else p)
        return quant.quantize_params(dicts_from_lists(plain), scheme, **options)

    _, info = io.split_quantized(jax.eval_shape(quantized, params))
    if not info:
        block = 32 if scheme in GGML_SCHEMES else q.block_size
        hint = "a smaller quantization.block_size"
        if scheme == "int8":
            hint += ", quantization.per_channel: true"
        raise ConfigError(
            f"quantization: {scheme} in blocks of {block} quantizes no weight of this "
            f"model (no weight's rows split into whole blocks), so the quantized copy "
            f"written after training would fail: set {hint} or another "
            f"quantization.scheme, or quantization.enabled: false"
        )


def hf_model_type(config: Any) -> str | None:
    """The Hugging Face ``model_type`` of a model config, or None if it has none.

    A vision-language folder's language model has its wrapper's (``gemma3``).
    """
    wrapper = getattr(config, "hf_wrapper", None)
    if wrapper is not None:
        return str(wrapper)
    try:
        types = nn.architecture_of(config).hf_model_types
    except UnsupportedError:  # a config of no registered architecture
        return None
    return types[0] if types else None


def check_adapter_export(spec: Any, built: BuiltModel, params: Params) -> None:
    """Refuse, before training, an ``adapter`` export PEFT could not load.

    `entrenar.lora.adapter_io.check_saveable`: a stack of experts' adapters, or
    adapters on a 2-D MLP of a mixture of experts whose PEFT config PEFT 0.21
    rewrites (`entrenar.lora.peft_moe`), would fail after training or be dropped
    by PEFT.

    Raises:
        ConfigError: naming ``export.formats`` and what to change.
    """
    if "adapter" not in spec.export.formats or not has_adapters(params):
        return
    try:
        check_saveable(params, hf_model_type(built.config))
    except CompatibilityError as e:
        raise ConfigError(f"export.formats: 'adapter': {e}") from None


def check_gguf_export(spec: Any, built: BuiltModel) -> None:
    """Refuse, before training, a GGUF the run would fail to write after it.

    `entrenar.io.check_llama_gguf`, which the writer itself runs first, on the
    config alone: ``export.formats: [gguf]`` in ``export.gguf_type`` and
    ``export.gguf_expert_type``, and ``quantization`` in a GGML scheme (a
    ``model-<scheme>.gguf``). A family llama.cpp has no form for, a layout its
    graph would compute otherwise (EXAONE 4's sliding layers, GLM-4.5's rotary
    scaling, Ministral 3's query scale period, ...), rows that are not whole
    blocks of a quantized type, or an expert type the model cannot take would
    train to the end and then fail to export.

    Raises:
        ConfigError: naming the key (``export.gguf_expert_type``,
            ``export.formats``, ``quantization.scheme``), with the writer's
            message.
    """
    ex = spec.export
    if "gguf" in ex.formats:
        if ex.gguf_expert_type is not None:
            try:
                check_expert_type(built.config, ex.gguf_expert_type, ex.gguf_type)
            except (ConfigError, UnsupportedError) as e:
                raise ConfigError(f"export.gguf_expert_type: {e}") from None
        try:
            check_llama_gguf(
                built.config, tensor_type=ex.gguf_type, expert_type=ex.gguf_expert_type
            )
        except (ConfigError, UnsupportedError) as e:
            raise ConfigError(
                f"export.formats: 'gguf' would fail after training: {e}"
            ) from None
    q = spec.quantization
    if q is None or not q.enabled:
        return
    scheme = q.resolved_scheme
    if built.is_decoder and scheme in GGML_SCHEMES:  # `write_quantized`'s .gguf
        try:
            check_llama_gguf(built.config, tensor_type=scheme)
        except (ConfigError, UnsupportedError) as e:
            raise ConfigError(
                f"quantization.scheme: {scheme} writes a llama.cpp GGUF, which "
                f"would fail after training: {e}"
            ) from None


def check_hf_export(spec: Any, built: BuiltModel) -> None:
    """Refuse, before training, an ``export.hf_expert_type`` the model cannot take.

    `entrenar.io.hf_mxfp4.check_hf_expert_type`: MXFP4 experts are gpt-oss's
    form, with rows of whole 32-value blocks.

    Raises:
        ConfigError: naming ``export.hf_expert_type`` and what to change.
    """
    ex = spec.export
    if "hf" not in ex.formats or ex.hf_expert_type is None:
        return
    try:
        check_hf_expert_type(built.config, ex.hf_expert_type)
    except (ConfigError, UnsupportedError) as e:
        raise ConfigError(f"export.hf_expert_type: {e}") from None


def write_quantized(
    built: BuiltModel,
    params: Params,
    path: str,
    scheme: str,
    *,
    block_size: int = 64,
    per_channel: bool = False,
    name: str = "model",
    extra: Mapping[str, Any] | None = None,
) -> str:
    """Write ``params`` of ``built`` quantized with ``scheme``; returns the path.

    A `LlamaConfig` family (llama, qwen2, ...) in a GGML scheme (q8_0, q4_0, q4_1) to
    a ``.gguf`` path is written as a llama.cpp model; anything else as an entrenar
    model file (see the module docstring) in the format of the path's extension.
    """
    if path.endswith(".gguf"):
        if not built.is_decoder or scheme not in GGML_SCHEMES:
            raise ConfigError(
                f"{path}: a .gguf output holds a Llama-style decoder in q8_0, q4_0 or "
                f"q4_1; this is a {built.architecture} in {scheme} (write "
                ".safetensors instead)"
            )
        io.save_llama_gguf(
            path, built.config, params, source=built.gguf_source,
            tensor_type=scheme.upper(), name=name, tokenizer=gguf_tokenizer(built),
        )  # fmt: skip
        return path
    custom = built.stored_config() | dict(extra or {})
    meta = io.ModelMetadata(name, built.architecture, custom=custom)
    return write_quantized_model(
        io.Model(meta, dicts_from_lists(params)), path, scheme,
        block_size=block_size, per_channel=per_channel,
    )  # fmt: skip


def write_quantized_model(
    model: io.Model,
    path: str,
    scheme: str,
    *,
    block_size: int = 64,
    per_channel: bool = False,
    symmetric: bool = True,
) -> str:
    """Quantize the weights of any `entrenar.io` model and write it (module docstring).

    Every floating weight with two or more axes (in each layer, for a layer stack:
    `entrenar.quant.api.layer_axes`) whose rows split into whole blocks is quantized
    (`entrenar.quant.quantize_params`' default choice); biases, norms and odd shapes
    stay as they are.

    Raises:
        ConfigError: no weight of the model can be quantized with these settings.
    """
    options = quantize_options(scheme, block_size, per_channel, symmetric)
    block = 32 if scheme in GGML_SCHEMES else block_size
    qparams = quant.quantize_params(
        quant.dequantize_params(model.params), scheme, **options
    )
    tree, info = io.split_quantized(qparams)
    if not info:
        raise ConfigError(
            f"{scheme}: no weight of this model has rows that split into blocks of "
            f"{block}; choose a smaller --block-size or another scheme"
        )
    meta = model.metadata.with_custom(quantization=info)
    fmt = io.ModelFormat.JSON if path.endswith(".json") else io.ModelFormat.SAFETENSORS
    io.save_model(io.Model(meta, tree), path, io.SaveConfig(fmt))
    return path


def has_adapters(params: Params) -> bool:
    """Whether ``params`` holds any `entrenar.lora.LoRAWeight`."""

    def is_lora(x: Any) -> bool:
        return isinstance(x, lora.LoRAWeight)

    leaves = jax.tree_util.tree_leaves(params, is_leaf=is_lora)
    return any(is_lora(x) for x in leaves)


def write_outputs(
    spec: Any,
    built: BuiltModel,
    params: Params,
    out_dir: str,
    *,
    extra: Mapping[str, Any] | None = None,
    report: dict[str, Any] | None = None,
) -> dict[str, str]:
    """Write what ``export`` and ``quantization`` ask for; ``{kind: path}``.

    A LoRA run's GGUF goes through `entrenar.lora.save_folded_gguf`, which measures
    the share of the update ``export.gguf_type`` keeps (put in ``report`` as
    ``gguf_update_kept``) and warns when it is low.

    Raises:
        ConfigError: another run is writing ``out_dir`` (`entrenar.io.lock`).
    """
    # One writer per output folder (re-entrant: train_from_yaml holds it already;
    # process 0 holds it for every process of a multi-process run).
    with OutputLock(out_dir, enabled=jax.process_index() == 0):
        return _write_exports(spec, built, params, out_dir, extra, report)


def _write_exports(
    spec: Any,
    built: BuiltModel,
    params: Params,
    out_dir: str,
    extra: Mapping[str, Any] | None,
    report: dict[str, Any] | None,
) -> dict[str, str]:
    os.makedirs(out_dir, exist_ok=True)
    # a run killed while writing these files left its temporaries (we hold the lock)
    for folder in (
        out_dir,
        os.path.join(out_dir, "adapter"),
        os.path.join(out_dir, "hf"),
    ):
        remove_temporaries(folder)
    written: dict[str, str] = {}
    ex = spec.export
    name = spec.name or "model"
    adapted = has_adapters(params)
    if "adapter" in ex.formats:
        if not adapted:
            raise ConfigError("export.formats: 'adapter' needs a LoRA run (lora:)")
        folder = os.path.join(out_dir, "adapter")
        lora.save_adapter(
            params, folder, base_model_name_or_path=built.source,
            task_type="CAUSAL_LM" if built.is_lm else None,
            config=spec.lora if spec.lora is not None and spec.lora.enabled else None,
            wrapper=getattr(built.config, "hf_wrapper", None),
            model_type=hf_model_type(built.config),
        )  # fmt: skip
        written["adapter"] = folder
    folded: list[Params] = []

    def model_params() -> Params:
        """The plain weights, folded once when a format writes them.

        A fold is a float copy of every adapted weight: made only for an entrenar
        model file or a quantized one; the GGUF and Hugging Face writers fold and
        dequantize each layer as they write it.
        """
        if not folded:
            folded.append(lora.fold(params) if adapted else params)
        return folded[0]

    train_cfg = {"config": os.path.basename(spec.source or ""), "name": spec.name}
    for fmt in ("safetensors", "json"):
        if fmt in ex.formats:
            path = os.path.join(out_dir, f"model.{fmt}")
            save_built(
                built, quant.dequantize_params(model_params()), path, fmt=fmt,
                name=name, training_config=train_cfg, extra=extra,
            )  # fmt: skip
            written[fmt] = path
    if "gguf" in ex.formats:
        path = os.path.join(out_dir, "model.gguf")
        source, tok = built.gguf_source, gguf_tokenizer(built)
        if adapted:  # measures how much of the update the type keeps; warns if little
            kept = lora.save_folded_gguf(
                path, built.config, params, source=source, tensor_type=ex.gguf_type,
                expert_type=ex.gguf_expert_type, name=name, tokenizer=tok,
            )  # fmt: skip
            if report is not None:
                report["gguf_update_kept"] = round(float(kept.kept), 4)
        else:
            io.save_llama_gguf(
                path, built.config, params, source=source,  # folds layer by layer
                tensor_type=ex.gguf_type, expert_type=ex.gguf_expert_type,
                name=name, tokenizer=tok,
            )  # fmt: skip
        written["gguf"] = path
    if "hf" in ex.formats:
        written["hf"] = write_hf_folder(
            built,
            params,
            os.path.join(out_dir, "hf"),
            dtype=ex.hf_dtype,
            expert_type=ex.hf_expert_type,
        )
    q = spec.quantization
    if q is not None and q.enabled:
        scheme = q.resolved_scheme
        ext = "gguf" if built.is_decoder and scheme in GGML_SCHEMES else "safetensors"
        path = os.path.join(out_dir, f"model-{scheme}.{ext}")
        write_quantized(
            built, model_params(), path, scheme, block_size=q.block_size,
            per_channel=q.per_channel, name=name, extra=extra,
        )  # fmt: skip
        written["quantized"] = path
    return written


def write_hf_folder(
    built: BuiltModel,
    params: Params,
    folder: str,
    *,
    dtype: str = "auto",
    expert_type: str | None = None,
) -> str:
    """A Hugging Face folder of the model's family (`entrenar.io.save_hf_folder`).

    ``config.json`` by the family's ``to_hf``, the weights (LoRA adapters folded,
    quantized bases dequantized, a layer at a time as each is written), the
    ``generation_config.json`` and, when the model has a tokenizer, its
    ``tokenizer.json``, ``tokenizer_config.json`` and chat template, so that
    ``transformers``' ``AutoModelForCausalLM`` and ``AutoTokenizer`` load it.

    ``dtype`` (``export.hf_dtype``): of the float tensors; ``"auto"``: the base
    Hugging Face folder's ``torch_dtype`` (a run loads a bfloat16 folder as float32
    by default, ``model.dtype``; the folder written is bfloat16 like its base, each
    trained or folded value rounded to nearest), else as the params are.
    ``expert_type`` (``export.hf_expert_type``): ``"MXFP4"`` writes gpt-oss's
    experts as the Hub's MXFP4 tensors (`entrenar.io.hf_mxfp4`).

    Raises:
        ConfigError: a family with no Hugging Face form (an mlp).
    """
    arch = nn.architecture(built.architecture)
    if arch.to_hf is None:
        raise ConfigError(
            f"export.formats: 'hf' writes language models of a Hugging Face family; "
            f"a {built.architecture} has no such form"
        )
    cast: str | None = dtype
    if dtype == "auto":
        src = built.source
        cast = io.folder_dtype(src) if src and os.path.isdir(src) else None
    return io.save_hf_folder(
        folder,
        built.config,
        params,
        tokenizer=built.tokenizer,
        dtype=cast,
        source=built.source,
        expert_type=expert_type,
    )


__all__ = [
    "GGML_SCHEMES",
    "check_gguf_export",
    "check_hf_export",
    "check_quantizable",
    "gguf_tokenizer",
    "has_adapters",
    "quantize_options",
    "write_hf_folder",
    "write_outputs",
    "write_quantized",
    "write_quantized_model",
]
