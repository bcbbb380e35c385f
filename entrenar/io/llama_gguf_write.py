"""Write an entrenar decoder (any `LlamaConfig` family) as a llama.cpp GGUF.

The file is written under the family's llama.cpp name
(`entrenar.io.gguf_families.written_name`: ``llama``, ``qwen2``, ``qwen3``,
``gemma2``, ``gemma3``, ``phi3``, ``olmoe``, ``granitemoe``, ...; Mistral as
``llama``, Granite MoE shared as ``granitemoe``; DeepSeek-V2/V3 as ``deepseek2``
through `entrenar.io.deepseek_gguf`, GLM-4.5 as ``glm4moe`` through
`entrenar.io.glm4moe_gguf`), with the family's tensor
names and conventions (q/k rows permuted only for ``llama``, Gemma's norms stored as
``1 + w``). Metadata: every field of the ``source`` GGUF (tokenizer, chat template,
general.*) is copied with its type, except its ``{arch}.*`` hyperparameters, which are
written from the config (sizes, ``rope.*``, ``attention.sliding_window(_pattern)``,
soft-caps), with ``general.file_type`` from the tensor type and the switches in
``entrenar.family`` (`entrenar.io.gguf_families`). Llama 3.x rotary scaling is written
as llama.cpp's converter writes it, a ``rope_freqs`` tensor of per-frequency
divisors. Tensors: norms, biases and vectors are F32 (as llama.cpp writes them);
matrices are stored in ``tensor_type`` (F32, F16, BF16, Q8_0, Q4_0, Q4_1), quantized
by `entrenar.quant` (bit-exact with llama.cpp's reference quantizers). A weight
already held as a `QuantizedWeight` of that scheme is written as is. A mixture of
experts' stacks (``ffn_{gate,up,down}_exps``) may take their own ``expert_type``,
MXFP4 among them (`entrenar.nn.mxfp4.quantize_ggml`, ggml's reference quantizer
byte for byte), as llama.cpp's gpt-oss files hold them (``general.file_type``
``MOSTLY_MXFP4_MOE``).

What the writer refuses for a config and its types (a family without a llama.cpp
form, a layout llama.cpp would compute otherwise, rows that are not whole blocks of
a quantized type, an expert type the model cannot take) is `check_llama_gguf`, which
the writer runs first and a run runs before training (`entrenar.runs.export.
check_gguf_export`), so a run that cannot be exported fails before its first step.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import warnings
from typing import Any, NamedTuple

import jax
import numpy as np

from entrenar import nn
from entrenar.errors import (
    ConfigError,
    FormatError,
    QuantizationError,
    UnsupportedError,
)
from entrenar.io.deepseek_gguf import NAME as DEEPSEEK
from entrenar.io.deepseek_gguf import (
    check_deepseek_gguf,
    deepseek_keys,
    deepseek_layer_tensors,
    family_json,
    row_widths,
)
from entrenar.io.ggml_dequant import GGML_TYPE_IDS
from entrenar.io.gguf_families import (
    EXPERT_NORM,
    F32_STEMS,
    FAMILY_KEY,
    FF_EXPERTS,
    HEAD_KEYS,
    IMPLIED,
    LAYER_NORM_EPS,
    LOGIT_SCALE,
    MOE_FAMILIES,
    NO_WINDOW,
    NOPE_FULL,
    NOPE_PERIOD,
    NORM_SHIFT,
    ONE_BASE,
    PARTIAL_ROTARY,
    PERMUTED,
    QK_NORM_LAYERS,
    SCALE_KEYS,
    SCALED,
    SCALING_NONE,
    SHARED_EXPERT,
    SHARED_MLP,
    SQUARE_ATTENTION,
    SWA_LAYERS,
    SWA_PATTERN,
    SWITCH_FIELDS,
    TEMPERATURE,
    TIED,
    UNBIASED,
    UNTIED,
    WHOLE_HEADS,
    YARN_LOG_MUL,
    default_nope_layers,
    full_layers_nope,
    gguf_names,
    split_names,
    written_name,
)
from entrenar.io.gguf_reader import GGUFField, GGUFFile, GGUFValueType, read_gguf
from entrenar.io.gguf_tokenizer import gguf_tokenizer_fields
from entrenar.io.gguf_writer import GGUFTensor, tensor_from_array, write_gguf
from entrenar.io.glm4moe_gguf import NAME as GLM4MOE
from entrenar.io.glm4moe_gguf import check_glm4moe_gguf, glm4moe_keys
from entrenar.io.glm4moe_gguf import family_json as glm4moe_family_json
from entrenar.io.glm4moe_gguf import gguf_tensor_names as glm4moe_names
from entrenar.io.glm4moe_gguf import row_widths as glm4moe_row_widths
from entrenar.io.llama_gguf import permute_qk
from entrenar.nn import LlamaConfig, to_dense
from entrenar.nn.decoder_config import sliding_layers
from entrenar.nn.deepseek import DeepseekConfig
from entrenar.nn.glm4_moe import Glm4MoeConfig
from entrenar.nn.mxfp4 import quantize_ggml as mxfp4_bytes
from entrenar.nn.rope_scaling import attention_factor, yarn_mscale
from entrenar.nn.weight_node import is_weight_node
from entrenar.quant import GGMLWeight, QuantizedWeight, dequantize, quantize, to_ggml
from entrenar.types import Params

TENSOR_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1")
"""Tensor types `save_llama_gguf` writes."""
EXPERT_TYPES = (*TENSOR_TYPES, "MXFP4")
"""Types `save_llama_gguf` writes a mixture of experts' stacks in."""
FILE_TYPES = {
    "F32": 0, "F16": 1, "Q4_0": 2, "Q4_1": 3, "Q8_0": 7, "BF16": 32, "MXFP4": 38,
}  # fmt: skip
"""llama.cpp's ``general.file_type`` (``llama_ftype``) of each tensor type; MXFP4
experts make a file ``MOSTLY_MXFP4_MOE`` (38) whatever the other tensors' type, as
llama.cpp's converter and ``llama-quantize`` mark them."""
U32, F32, STR = GGUFValueType.UINT32, GGUFValueType.FLOAT32, GGUFValueType.STRING
TOKENS = "tokenizer.ggml.tokens"


@functools.cache
def _quantize_jit() -> Any:
    """`entrenar.quant.quantize`, compiled once per shape and scheme."""
    return jax.jit(quantize, static_argnums=1)


def _to_bytes(w: Any, kind: str, name: str) -> np.ndarray:
    """Stored bytes of ``w: (..., rows, cols)`` in ``kind``, as ``(..., rows, nb)``."""
    if isinstance(w, GGMLWeight):  # a base kept in its file's type: rewritten in kind
        w = np.asarray(to_dense(w), np.float32)
    elif is_weight_node(w) and not isinstance(w, QuantizedWeight):
        w = to_dense(w)  # a LoRA adapter folded into its base, ...
    if kind == "MXFP4":  # gpt-oss's experts as llama.cpp ships them
        if isinstance(w, QuantizedWeight):
            w = dequantize(w, np.float32)
        return mxfp4_bytes(w, name)
    if kind in ("Q8_0", "Q4_0", "Q4_1"):
        if not (isinstance(w, QuantizedWeight) and w.scheme == kind.lower()):
            a = dequantize(w, np.float32) if isinstance(w, QuantizedWeight) else w
            a = np.asarray(a, np.float32)
            if not np.isfinite(a).all():
                raise QuantizationError(f"{name} holds NaN or Inf; cannot write {kind}")
            w = jax.device_get(_quantize_jit()(a, kind.lower()))
        raw, _ = to_ggml(w)
        return raw.reshape(*w.shape[:-1], -1)
    if isinstance(w, QuantizedWeight):
        w = dequantize(w, np.float32)
    t = tensor_from_array(w, kind)
    assert isinstance(t.raw, np.ndarray)  # tensor_from_array makes the bytes
    return t.raw.reshape(*t.shape[:-1], -1)


def _layer_bytes(stored: Any, w: Any, i: int, *args: Any) -> np.ndarray:
    """``stored`` of layer ``i`` of the stacked leaf or node ``w``."""
    layer = jax.tree_util.tree_map(lambda a: a[i], w)  # every array of it at i
    return stored(layer, *args)


def _half_bytes(layer: Any, j: int, kind: str, name: str) -> np.ndarray:
    """Stored bytes of rows half ``j`` (0: the first) of one layer's ``(2 S, X)``."""
    w = np.asarray(to_dense(layer), np.float32)  # a quantized base dequantized
    rows = w.shape[0] // 2
    return _to_bytes(w[j * rows : (j + 1) * rows], kind, name).reshape(-1)


def _order_key(name: str) -> tuple[int, int, str]:
    """token_embd, rope tensors, blk.0.*, blk.1.*, ..., output_norm, output."""
    if name.startswith("blk."):
        return (1, int(name.split(".")[1]), name)
    return (0 if name.startswith(("token_embd", "rope_")) else 2, 0, name)


def llama3_divisors(c: LlamaConfig) -> tuple[float, ...]:
    """llama.cpp's ``rope_freqs`` for ``rope_type="llama3"``: each frequency's divisor.

    As llama.cpp's converter computes them: with wavelength ``λ = 2π / f``, 1 for
    ``λ < L / high``, ``factor`` for ``λ > L / low``, else ``1 / ((1 - s) / factor +
    s)`` with ``s = (L / λ - low) / (high - low)`` (``L`` the original context).
    """
    d, factor = c.rotary_dim, c.rope_factor
    low, high = c.rope_low_freq_factor, c.rope_high_freq_factor
    ctx = float(c.rope_original_max_position_embeddings or 8192)
    freqs = 1.0 / (c.rope_theta ** (np.arange(0, d, 2, dtype=np.float32) / d))
    out = []
    for f in freqs.astype(np.float64):
        wavelen = 2 * math.pi / f
        if wavelen < ctx / high:
            out.append(1.0)
        elif wavelen > ctx / low:
            out.append(factor)
        else:
            smooth = (ctx / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return tuple(out)


def _switches(c: LlamaConfig, family: str, gname: str) -> dict[str, Any]:
    """``entrenar.family``: what the metadata and tensor table do not say already.

    The family when it is written under another's name (Mistral as ``llama``),
    every `SWITCH_FIELDS` field off its default, and the sliding window of the
    families llama.cpp gives a default one (Gemma 2). Empty for a plain Llama.
    """
    defaults = {f.name: f.default for f in dataclasses.fields(c)}
    out: dict[str, Any] = {}
    implied = c.num_experts and (
        MOE_FAMILIES.get(gname) == family  # llama: Mixtral
        or (SHARED_MLP.get(gname) == family and c.shared_mlp_intermediate_size)
    )  # the family the reader takes the file for
    if family != gname and not implied:
        out["architecture"] = family
    for name in SWITCH_FIELDS:
        value = getattr(c, name)
        always = (
            gname in SWA_PATTERN and name in ("sliding_window", "layer_types")
        ) or (
            c.rope_type == "longrope" and name == "rope_attention_factor"
        )  # llama.cpp's key holds the derived factor, entrenar's None derives it
        if name != "architecture" and (always or value != defaults[name]):
            out[name] = list(value) if isinstance(value, tuple) else value
    return out


def _ffn_length(c: LlamaConfig, gname: str) -> int:
    """``{arch}.feed_forward_length`` of ``c`` written as ``gname``.

    llama.cpp's llama, olmoe and granitemoe read their experts' width there
    (`FF_EXPERTS`; Qwen MoE's experts have ``expert_feed_forward_length``).
    """
    if c.num_experts and gname in FF_EXPERTS:
        return c.expert_size
    return c.intermediate_size


def _metadata(
    source: GGUFFile | None, c: LlamaConfig, gname: str, kind: str, name: str
) -> dict[str, GGUFField]:
    """The file's metadata: the source's, its hyperparameters rewritten from ``c``.

    Source keys keep their places (so a Llama rewritten from its own file keeps
    the order); its ``{arch}.*`` keys that ``c`` does not set are dropped.
    """
    fields: dict[str, GGUFField] = dict(source.fields) if source else {}
    old = fields.get("general.architecture")
    family = nn.architecture_of(c).name
    fields["general.architecture"] = GGUFField(gname, STR)
    if name or "general.name" not in fields:
        fields["general.name"] = GGUFField(name or f"entrenar-{family}", STR)
    p = f"{gname}."
    new: dict[str, tuple[Any, GGUFValueType]] = {
        p + "vocab_size": (c.vocab_size, U32),
        p + "context_length": (c.max_position_embeddings, U32),
        p + "embedding_length": (c.hidden_size, U32),
        p + "feed_forward_length": (_ffn_length(c, gname), U32),
        p + "block_count": (c.num_layers, U32),
        p + "attention.head_count": (c.num_heads, U32),
        p + "attention.head_count_kv": (c.num_kv_heads, U32),
        p + "rope.dimension_count": (c.rotary_dim, U32),
        p + "rope.freq_base": (c.rope_theta, F32),
        p + (LAYER_NORM_EPS if c.layer_norm else "attention.layer_norm_rms_epsilon"): (
            c.rms_norm_eps,
            F32,
        ),
        "general.file_type": (FILE_TYPES[kind], U32),
    }
    if c.num_experts:  # as llama.cpp's converter writes them
        new[p + "expert_count"] = (c.num_experts, U32)
        new[p + "expert_used_count"] = (c.num_experts_per_tok, U32)
        if gname not in FF_EXPERTS:
            new[p + "expert_feed_forward_length"] = (c.expert_size, U32)
        shared = c.shared_expert_intermediate_size or c.shared_mlp_intermediate_size
        if shared:  # Qwen2-MoE's gated shared expert, Granite MoE shared's MLP
            new[p + "expert_shared_feed_forward_length"] = (shared, U32)
    for k in ("attention.key_length", "attention.value_length"):
        if (
            p + k in fields
            or c.hd != c.hidden_size // c.num_heads
            or (gname in HEAD_KEYS)
        ):
            new[p + k] = (c.hd, U32)  # llama.cpp's default is D / H
    if c.rope_type == "default" and gname in SCALING_NONE:
        new[p + "rope.scaling.type"] = ("none", STR)  # as the converter writes
    if c.rope_type in ("linear", "yarn"):
        new[p + "rope.scaling.type"] = (c.rope_type, STR)
        new[p + "rope.scaling.factor"] = (c.rope_factor, F32)
    if c.rope_type in ("yarn", "longrope"):
        orig = c.rope_original_max_position_embeddings
        new[p + "rope.scaling.original_context_length"] = (orig, U32)
    if c.rope_type == "yarn" and c.rope_attention_factor is not None:
        # llama.cpp scales yarn's cos and sin by yarn_mscale(factor) * attn_factor
        # (and reads no yarn_attn_factor); the converter keeps config.json's
        # attention_factor in yarn_attn_factor
        a = c.rope_attention_factor
        new[p + "rope.scaling.attn_factor"] = (a / yarn_mscale(c.rope_factor), F32)
        new[p + "rope.scaling.yarn_attn_factor"] = (a, F32)
        if gname in YARN_LOG_MUL:  # Ministral 3's mscale_all_dim 1, as converted:
            # llama.cpp's factor is then attn_factor itself
            del new[p + "rope.scaling.attn_factor"]
            new[p + "rope.scaling.yarn_log_multiplier"] = (1.0, F32)
            if a != 1.0:
                new[p + "rope.scaling.attn_factor"] = (a, F32)
    if gname in TEMPERATURE and c.query_scale_beta is not None:
        new[p + "attention.temperature_scale"] = (c.query_scale_beta, F32)
        if c.rope_type not in ("yarn", "longrope"):  # llama.cpp's n_ctx_orig_yarn
            orig = c.query_scale_length
            new[p + "rope.scaling.original_context_length"] = (orig, U32)
    if c.rope_type == "longrope":  # llama.cpp's converter writes Phi-3's always
        new[p + "rope.scaling.attn_factor"] = (attention_factor(c), F32)
    if c.rope_type == "yarn":
        new[p + "rope.scaling.yarn_beta_fast"] = (c.rope_beta_fast, F32)
        new[p + "rope.scaling.yarn_beta_slow"] = (c.rope_beta_slow, F32)
    if c.sliding_window is not None:
        new[p + "attention.sliding_window"] = (c.sliding_window, U32)
        if gname in SWA_PATTERN:
            new[p + "rope.freq_base_swa"] = (c.rope_local_theta or c.rope_theta, F32)
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if getattr(c, key) is not None:
            new[p + key] = (getattr(c, key), F32)
    if gname in LOGIT_SCALE:  # Cohere's multiplies; cohere2 needs it
        new[p + "logit_scale"] = (c.logit_scale or 1.0, F32)
    if gname in SCALED:  # Granite's multipliers; llama.cpp needs logit_scale
        for field, key in SCALE_KEYS.items():
            value = getattr(c, field)
            if value is not None or key == "logit_scale":
                new[p + key] = (1.0 if value is None else value, F32)
    # The old architecture's keys go; never the tokenizer's or general ones (a
    # tokenizer-only GGUF says general.architecture = "tokenizer").
    archs = {gname, getattr(old, "value", gname)} - {"tokenizer", "general"}
    stale = tuple(f"{a}." for a in archs)
    for k in [k for k in fields if k.startswith(stale) or k == FAMILY_KEY]:
        if k not in new:
            del fields[k]
    for k, (v, t) in new.items():
        fields[k] = GGUFField(v, t)
    if c.sliding_window is not None and (gname in SWA_PATTERN or gname in SWA_LAYERS):
        fields[p + "attention.sliding_window_pattern"] = GGUFField(
            list(sliding_layers(c)), GGUFValueType.ARRAY, GGUFValueType.BOOL
        )
    switches = _switches(c, family, gname)
    if switches:
        fields[FAMILY_KEY] = GGUFField(json.dumps(switches), STR)
    return fields


def _gguf_name(config: Any) -> str:
    """The llama.cpp name ``config`` is written under, its implied switches checked."""
    if not isinstance(config, LlamaConfig):
        raise UnsupportedError(
            f"{type(config).__name__} has no llama.cpp GGUF form (LlamaConfig "
            "families do)"
        )
    arch = nn.architecture_of(config)
    gname = written_name(arch.name, arch.gguf_name)
    if gname is None:
        raise UnsupportedError(f"{arch.name} models have no llama.cpp GGUF form")
    if gname in TIED and not config.tie_word_embeddings:
        raise UnsupportedError(
            f"llama.cpp's {gname} ties its output head to the embeddings; this "
            f"{arch.name} config has tie_word_embeddings=False"
        )
    if gname in UNTIED and config.tie_word_embeddings:
        raise UnsupportedError(
            f"llama.cpp's {gname} needs its own output head; this {arch.name} "
            "config has tie_word_embeddings=True"
        )
    if config.rotary_dim != config.hd and gname not in PARTIAL_ROTARY:
        raise UnsupportedError(
            f"llama.cpp's {gname} rotates whole heads (its graph asserts "
            f"rope.dimension_count == head_dim); this {arch.name} config rotates "
            f"{config.rotary_dim} of {config.hd} (partial_rotary_factor "
            f"{config.partial_rotary_factor}). llama.cpp rotates part of a head in "
            f"{sorted(PARTIAL_ROTARY)}"
        )
    for field in UNBIASED.get(gname, ()):
        if getattr(config, field):
            raise UnsupportedError(
                f"llama.cpp's {gname} loads no {field.removesuffix('_bias')} bias; "
                f"this {arch.name} config has {field}=True"
            )
    if config.ungated_mlp and not IMPLIED.get(gname, {}).get("ungated_mlp"):
        raise UnsupportedError(
            f"this {arch.name} config's MLP has no gate (ungated_mlp); llama.cpp's "
            f"{gname} graph needs ffn_gate"
        )
    if config.rope_interleave and not IMPLIED.get(gname, {}).get("rope_interleave"):
        raise UnsupportedError(
            f"this {arch.name} config rotates interleaved pairs (rope_interleave); "
            f"entrenar writes llama.cpp's {gname} q/k rows only in Hugging Face's "
            "half-split layout"
        )
    local = config.rope_local_theta
    if gname in ONE_BASE and local is not None and local != config.rope_theta:
        warnings.warn(
            f"llama.cpp's {gname} rotates the sliding layers at rope_theta "
            f"{config.rope_theta:g}, not rope_local_theta {local:g}; the file keeps "
            "it for entrenar (rope.freq_base_swa), llama.cpp will not follow it",
            stacklevel=3,
        )
    implied = default_nope_layers(gname, config.num_layers)
    if gname in NOPE_PERIOD and config.nope_layers != implied:
        warnings.warn(
            f"llama.cpp's {gname} skips rotary on every {NOPE_PERIOD[gname]}th layer "
            f"({implied}); this config's nope_layers are {config.nope_layers}. The "
            "file keeps them for entrenar (entrenar.family), llama.cpp will not "
            "follow them",
            stacklevel=3,
        )
    width = config.num_heads * config.hd
    if gname in SQUARE_ATTENTION and width != config.hidden_size:
        warnings.warn(
            f"llama.cpp's {gname} needs the heads to fill the width (attn_output "
            f"{{D, D}}); this {arch.name} config has {config.num_heads} heads of "
            f"{config.hd} = {width} for D = {config.hidden_size}, so llama.cpp will "
            "refuse the file; entrenar reads it back",
            stacklevel=3,
        )
    layers = QK_NORM_LAYERS.get(gname)
    if layers is not None and config.qk_norm != (config.num_layers >= layers):
        warnings.warn(
            f"llama.cpp's {gname} loads per-head q/k norms exactly when a model has "
            f"{layers} layers or more; this {arch.name} config has "
            f"{config.num_layers} layers and qk_norm={config.qk_norm}, so llama.cpp "
            "will refuse the file (a missing or unexpected attn_q_norm tensor); "
            "entrenar reads it back",
            stacklevel=3,
        )
    if gname in NOPE_FULL:
        types = tuple(
            "sliding_attention" if s else "full_attention"
            for s in sliding_layers(config)
        )
        nope = full_layers_nope(gname, types, config.num_layers)
        if config.nope_layers != nope:
            raise UnsupportedError(
                f"llama.cpp's {gname} rotates the sliding layers only (NoPE layers "
                f"{nope}); this {arch.name} config has nope_layers "
                f"{config.nope_layers}"
            )
    if gname in SWA_LAYERS:
        _check_swa_layers(config, arch.name, gname)
    if gname in NO_WINDOW and config.sliding_window is not None:
        raise UnsupportedError(
            f"llama.cpp's {gname} has no sliding window; this {arch.name} config has "
            f"sliding_window={config.sliding_window} (set it to None, or save a "
            "Hugging Face folder)"
        )
    if gname in TEMPERATURE and config.query_scale_beta is not None:
        orig = (
            config.rope_original_max_position_embeddings
            if config.rope_type in ("yarn", "longrope")
            else config.query_scale_length
        )
        if config.query_scale_length != orig:
            raise UnsupportedError(
                f"llama.cpp's {gname} takes the query scale's period from "
                "rope.scaling.original_context_length; this config has "
                f"LlamaConfig.query_scale_length {config.query_scale_length} and "
                f"rope_original_max_position_embeddings {orig}"
            )
    if config.query_scale_beta is not None and gname not in TEMPERATURE:
        raise UnsupportedError(
            f"llama.cpp's {gname} has no query scale; this {arch.name} config has "
            f"query_scale_beta={config.query_scale_beta}"
        )
    if gname in WHOLE_HEADS and (
        config.hd * config.num_heads != config.hidden_size
        or config.num_kv_heads != config.num_heads
    ):
        raise UnsupportedError(
            f"llama.cpp's {gname} takes heads hidden_size / num_heads wide and as "
            f"many KV heads (its k norm is hidden_size wide); this {arch.name} "
            f"config has head_dim {config.hd}, {config.num_heads} heads and "
            f"{config.num_kv_heads} KV heads for hidden_size {config.hidden_size}"
        )
    for field, value in IMPLIED.get(gname, {}).items():
        if getattr(config, field) != value:
            raise UnsupportedError(
                f"llama.cpp's {gname} has {field}={value!r}; this {arch.name} config "
                f"has {getattr(config, field)!r}"
            )
    if config.num_experts:
        _check_routing(config, arch.name, gname)
    return gname


def _check_swa_layers(c: LlamaConfig, family: str, gname: str) -> None:
    """Refuse layouts llama.cpp's ``gname`` computes otherwise (`SWA_LAYERS`).

    EXAONE 4: at 64 layers llama.cpp slides by the file's pattern and rotates only
    the sliding layers (so a config needs a window, its global layers NoPE); at any
    other count it rotates and attends fully everywhere (no window, no NoPE).
    """
    count, _ = SWA_LAYERS[gname]
    slides = sliding_layers(c)
    if c.num_layers == count:
        nope = tuple(not s for s in slides)
        if c.sliding_window is None or (c.nope_layers or (False,) * count) != nope:
            raise UnsupportedError(
                f"llama.cpp's {gname} lays a {count}-layer model out as EXAONE 4.0 "
                "32B: sliding layers (attention.sliding_window_pattern) that "
                "rotate and global NoPE ones; this config has sliding_window="
                f"{c.sliding_window} and nope_layers={c.nope_layers} (set "
                "sliding_window, layer_types and nope_layers so, or save a Hugging "
                "Face folder)"
            )
    elif c.sliding_window is not None or any(c.nope_layers or ()):
        raise UnsupportedError(
            f"llama.cpp's {gname} has sliding layers only at {count} layers (EXAONE "
            f"4.0 32B); at {c.num_layers} it attends fully and rotates every layer, "
            f"where this {family} config has sliding_window={c.sliding_window} and "
            f"nope_layers={c.nope_layers} (set sliding_window, layer_types and "
            "nope_layers to None, as EXAONE 4.0 1.2B, or save a Hugging Face folder)"
        )


def _check_routing(c: LlamaConfig, family: str, gname: str) -> None:
    """Refuse experts llama.cpp would compute otherwise (`gguf_families.EXPERT_NORM`).

    llama.cpp renormalises the top-k weights of ``llama`` (Mixtral) and ``qwen3moe``
    and never those of ``qwen2moe``, whose layers all have a shared expert.
    """
    if family not in (MOE_FAMILIES.get(gname), SHARED_MLP.get(gname)):
        raise UnsupportedError(
            f"a {family} config with num_experts={c.num_experts}: llama.cpp reads "
            f"experts only in {sorted({*MOE_FAMILIES.values(), *SHARED_MLP.values()})}"
        )
    norm = EXPERT_NORM[gname]
    if c.norm_topk_prob != norm:
        raise UnsupportedError(
            f"llama.cpp's {gname} {'always' if norm else 'never'} renormalises the "
            f"top-k routing weights; this {family} config has norm_topk_prob="
            f"{c.norm_topk_prob}, which it cannot represent (save a Hugging Face "
            "folder instead)"
        )
    shared = bool(c.shared_expert_intermediate_size)
    if shared != (gname in SHARED_EXPERT):
        raise UnsupportedError(
            f"llama.cpp's {gname} {'needs' if not shared else 'has no'} shared "
            f"expert; this {family} config has shared_expert_intermediate_size="
            f"{c.shared_expert_intermediate_size}"
        )


def _save_unrolled(
    path: str | os.PathLike[str],
    config: DeepseekConfig | Glm4MoeConfig,
    params: Params,
    src: GGUFFile | None,
    kind: str,
    emb_kind: str,
    exp_kind: str,
    name: str,
    tok_fields: dict[str, GGUFField],
) -> None:
    """`save_llama_gguf` of a list of unstacked layers.

    DeepSeek-V2/V3 (`entrenar.io.deepseek_gguf`) or GLM-4.5
    (`entrenar.io.glm4moe_gguf`); the routed experts in ``exp_kind``.
    """
    file_kind = "MXFP4" if exp_kind == "MXFP4" else kind
    if isinstance(config, DeepseekConfig):  # checked: `check_llama_gguf`
        arch = DEEPSEEK
        new = deepseek_keys(config, FILE_TYPES[file_kind])
        names = None
    else:
        arch = GLM4MOE
        new = glm4moe_keys(config, FILE_TYPES[file_kind])
        names = glm4moe_names(config)
    fields: dict[str, GGUFField] = dict(src.fields) if src else {}
    old = fields.get("general.architecture")
    archs = {arch, getattr(old, "value", arch)} - {"tokenizer", "general"}
    stale = tuple(f"{a}." for a in archs)
    for k in [k for k in fields if k.startswith(stale)]:
        if k not in new:  # (the others keep their places)
            del fields[k]
    fields["general.architecture"] = GGUFField(arch, STR)
    if name or "general.name" not in fields:
        fields["general.name"] = GGUFField(
            name or f"entrenar-{config.architecture}", STR
        )
    fields |= new
    switches = _switches(config, config.architecture, arch)
    if isinstance(config, DeepseekConfig):
        family = family_json(config, switches)
    else:
        family = glm4moe_family_json(config, switches)
    fields[FAMILY_KEY] = GGUFField(family, STR)
    made = deepseek_layer_tensors(
        config, params, kind, emb_kind, _to_bytes, names, exp_kind
    )
    tensors = {
        n: GGUFTensor(make, shape, GGML_TYPE_IDS[k])
        for n, (make, shape, k) in made.items()
    }
    same = src is not None and set(src.tensors) == set(tensors)
    order = list(src.tensors) if same and src else sorted(tensors, key=_order_key)
    write_gguf(path, fields | tok_fields, {n: tensors[n] for n in order})


def check_expert_type(
    config: LlamaConfig, expert_type: str | None, tensor_type: str = "F32"
) -> str:
    """The type `save_llama_gguf` writes ``config``'s expert stacks in, checked.

    None gives ``tensor_type``. Runs call it before training (`entrenar.runs.
    export.check_gguf_export`), so an ``export.gguf_expert_type`` the model cannot
    take fails at once rather than after training.

    Raises:
        ConfigError: a type not in `EXPERT_TYPES`, a config without experts, or a
            quantized type for experts whose rows (``hidden_size``, ``expert_size``)
            are not whole 32-value blocks.

    >>> check_expert_type(LlamaConfig(num_experts=8, num_experts_per_tok=2), "mxfp4")
    'MXFP4'
    """
    kind = tensor_type.upper()
    if expert_type is None:
        return kind
    exp_kind = expert_type.upper()
    if exp_kind not in EXPERT_TYPES:
        raise ConfigError(
            f"expert type {expert_type!r}: expected one of {EXPERT_TYPES}"
        )
    family = getattr(config, "architecture", type(config).__name__)
    if not getattr(config, "num_experts", 0):
        raise ConfigError(
            f"expert_type={expert_type!r} is for a mixture of experts; this "
            f"{family} config has no experts (num_experts="
            f"{getattr(config, 'num_experts', 0)}): leave expert_type unset"
        )
    widths = (config.hidden_size, config.expert_size)
    if exp_kind not in ("F32", "F16", "BF16") and any(w % 32 for w in widths):
        raise ConfigError(
            f"expert_type {exp_kind} needs experts' rows of whole 32-value blocks; "
            f"this {family} config has hidden_size {config.hidden_size} and "
            f"expert_size {config.expert_size}: write the experts in F16 or F32 "
            "instead"
        )
    return exp_kind


class GGUFTypes(NamedTuple):
    """What `check_llama_gguf` found: the types to write and llama.cpp's name."""

    kind: str
    """``tensor_type`` (upper case): the matrices'."""
    emb_kind: str
    """``token_embd`` and ``output``'s."""
    exp_kind: str
    """A mixture of experts' stacks' (`check_expert_type`)."""
    gname: str
    """llama.cpp's architecture name the file is written under."""


def check_llama_gguf(
    config: Any,
    *,
    tensor_type: str = "F32",
    embedding_type: str | None = None,
    expert_type: str | None = None,
) -> GGUFTypes:
    """Raise what `save_llama_gguf` would refuse for ``config`` and these types.

    Reads the config only (no tensor): `save_llama_gguf` runs it before anything
    else, and a run before training (`entrenar.runs.export.check_gguf_export`), so
    the two refuse the same inputs with the same error. The checks: the types
    (`TENSOR_TYPES`, `check_expert_type`); the family's llama.cpp form and the
    layouts llama.cpp would compute otherwise (`entrenar.io.deepseek_gguf.
    check_deepseek_gguf`, `entrenar.io.glm4moe_gguf.check_glm4moe_gguf`, and for
    the `LlamaConfig` families the tying, rotary, biases, sliding windows, NoPE
    layers, query scale, heads and routing each llama.cpp graph takes, module
    `entrenar.io.gguf_families`); rows of whole 32-value blocks for a quantized
    type. The `UserWarning` of a file llama.cpp will not follow exactly is given
    here too.

    Raises:
        ConfigError: an unknown type, an expert type the model cannot take, or
            rows that are not whole blocks of a quantized type.
        UnsupportedError: a family with no llama.cpp form, or a layout its
            llama.cpp graph computes otherwise (naming the field).
    """
    kind = tensor_type.upper()
    emb_kind = (embedding_type or tensor_type).upper()
    for k in (kind, emb_kind):
        if k not in TENSOR_TYPES:
            raise ConfigError(f"tensor type {k!r}: expected one of {TENSOR_TYPES}")
    exp_kind = check_expert_type(config, expert_type, kind)
    quantized = bool((kind + emb_kind).count("Q"))
    if isinstance(config, (DeepseekConfig, Glm4MoeConfig)):  # a list of layers
        if isinstance(config, DeepseekConfig):
            check_deepseek_gguf(config)
            gname, rows = DEEPSEEK, row_widths(config)
        else:
            check_glm4moe_gguf(config)
            gname, rows = GLM4MOE, glm4moe_row_widths(config)
        if quantized and any(w % 32 for w in rows):
            raise ConfigError(
                f"{kind} needs rows of whole 32-value blocks; this "
                f"{config.architecture} config has rows {rows} wide: write F16 or "
                "F32 instead"
            )
        return GGUFTypes(kind, emb_kind, exp_kind, gname)
    gname = _gguf_name(config)
    widths = (
        *(config.hidden_size, config.intermediate_size, config.expert_size),
        *(config.shared_expert_intermediate_size, config.shared_mlp_intermediate_size),
    )  # (the shared experts' 0: none)
    if quantized and any(w % 32 for w in widths):
        raise ConfigError(
            f"{kind} needs hidden and intermediate sizes that are multiples of 32; "
            "write F16 or F32 instead"
        )
    return GGUFTypes(kind, emb_kind, exp_kind, gname)


def save_llama_gguf(
    path: str | os.PathLike[str],
    config: LlamaConfig,
    params: Params,
    *,
    source: str | os.PathLike[str] | GGUFFile | None = None,
    tensor_type: str = "F32",
    embedding_type: str | None = None,
    expert_type: str | None = None,
    name: str = "",
    tokenizer: Any = None,
) -> None:
    """Write ``params`` of ``config`` as a llama.cpp-readable GGUF file, atomically.

    Args:
        path: destination ``.gguf``.
        config: the model's `LlamaConfig` (any family, module docstring).
        params: its stacked param tree: arrays or weight nodes (`QuantizedWeight`,
            a GGUF's kept bases, LoRA adapters, which are folded: `entrenar.nn.
            to_dense`). Each layer of a stacked leaf is converted when it is written
            (`write_gguf`'s lazy tensors), so writing holds one layer's tensor, not
            a float32 copy of the model; the file is the one the whole leaves (or
            `lora.fold` of the tree) give, byte for byte.
        source: the GGUF the model came from: its metadata and tokenizer are copied.
        tokenizer: the model's tokenizer when ``source`` has none (an
            `entrenar.io.HFTokenizer` of a Hugging Face folder, or a GGUF's
            `entrenar.data.FastTokenizer`), written as llama.cpp's converter writes
            it (`entrenar.io.gguf_tokenizer`). With neither, the file has no
            tokenizer and llama.cpp cannot run it.
        tensor_type: one of `TENSOR_TYPES` for the matrices. The default, F32, is
            lossless and large: 4 bytes a value, 538 MB for SmolLM2-135M (F16 271 MB,
            Q8_0 145 MB, Q4_1 86 MB). To export a LoRA fine-tune use
            `entrenar.lora.save_folded_gguf` (Q8_0 by default), which checks that the
            type keeps the update: Q4_1 can round a short fine-tune of a 4-bit base
            away.
        embedding_type: type of ``token_embd`` and ``output`` (default
            ``tensor_type``); llama.cpp's own Q4 files keep these in Q8_0 or better.
        expert_type: type of a mixture of experts' stacks ``ffn_{gate,up,down}_exps``
            (`EXPERT_TYPES`; default ``tensor_type``; their biases stay F32).
            ``"MXFP4"`` writes them as llama.cpp's gpt-oss files hold them
            (`entrenar.nn.mxfp4.quantize_ggml`, 4.25 bits a value; gpt-oss-20b
            about 12 GB with Q8_0 elsewhere, against 21 GB all Q8_0), and makes the
            file's ``general.file_type`` ``MOSTLY_MXFP4_MOE`` (38).
        name: ``general.name``; default: keep the source's.

    Raises:
        ConfigError: an unknown ``tensor_type`` or ``expert_type``, a row length
            that does not split into 32-value blocks for a quantized type, or an
            ``expert_type`` for a config without experts (`check_llama_gguf`,
            first).
        FormatError: ``params`` lacks a tensor of ``config``, or ``tokenizer`` has
            more tokens than ``config.vocab_size``.
        UnsupportedError: a family with no llama.cpp form or a layout llama.cpp
            computes otherwise (`check_llama_gguf`), or a tokenizer llama.cpp has
            no form for.
    """
    kind, emb_kind, exp_kind, gname = check_llama_gguf(
        config, tensor_type=tensor_type, embedding_type=embedding_type,
        expert_type=expert_type,
    )  # fmt: skip
    if isinstance(config, (DeepseekConfig, Glm4MoeConfig)):  # a list of layers
        src = read_gguf(source) if isinstance(source, (str, os.PathLike)) else source
        tok: dict[str, GGUFField] = {}
        if tokenizer is not None and (src is None or TOKENS not in src.fields):
            tok = gguf_tokenizer_fields(tokenizer, vocab_size=config.vocab_size)
        _save_unrolled(path, config, params, src, kind, emb_kind, exp_kind, name, tok)
        return
    src = read_gguf(source) if isinstance(source, (str, os.PathLike)) else source
    tok_fields = {}
    if tokenizer is not None and (src is None or TOKENS not in src.fields):
        tok_fields = gguf_tokenizer_fields(tokenizer, vocab_size=config.vocab_size)
    names = gguf_names(config)
    split = split_names(config)  # Granite MoE shared's [gate; up]: two tensors
    permute = gname in PERMUTED
    shift = NORM_SHIFT.get(gname, 0.0)
    perm_heads = {"attn_q": config.num_heads, "attn_k": config.num_kv_heads}
    tensors: dict[str, GGUFTensor] = {}

    def put(gguf_name: str, raw: Any, shape: tuple[int, ...], k: str) -> None:
        if not callable(raw):
            raw = np.ascontiguousarray(raw).reshape(-1)
        tensors[gguf_name] = GGUFTensor(raw, shape, GGML_TYPE_IDS[k])

    def stored(w: Any, k: str, hf: str, stem: str, sub: tuple[int, ...]) -> Any:
        """The bytes of ``w`` (a whole leaf, or one layer) as the file stores them."""
        if shift and stem.endswith("norm"):
            w = np.asarray(w, np.float32) + np.float32(shift)
        raw = _to_bytes(w, k, hf)  # (rows, row_bytes) or a flat vector
        if len(sub) == 1:  # a vector: one row per value
            raw = raw.reshape(*sub, -1)
        if permute and stem in perm_heads:
            raw = permute_qk(raw, perm_heads[stem])
        return np.ascontiguousarray(raw).reshape(-1)

    def walk(tree: dict[str, Any], shapes: dict[str, Any], prefix: str) -> None:
        for key, sub in shapes.items():
            hf = f"{prefix}{key}"
            if isinstance(sub, dict):
                node = tree.get(key) if isinstance(tree, dict) else None
                if not isinstance(node, dict):
                    raise FormatError(f"params lack {hf} (config {config})")
                walk(node, sub, f"{hf}.")
                continue
            if key not in tree:
                raise FormatError(f"params lack {hf} (config {config})")
            w = tree[key]
            stacked = prefix.startswith("model.layers.")
            if stacked and hf.replace("model.layers.", "model.layers.0.", 1) in split:
                for i in range(config.num_layers):  # each layer's two halves
                    hf_i = hf.replace("model.layers.", f"model.layers.{i}.", 1)
                    for j, half in enumerate(split[hf_i]):
                        shape = (sub[1] // 2, *sub[2:])
                        make = functools.partial(
                            _layer_bytes, _half_bytes, w, i, j, kind, hf_i
                        )
                        put(half, make, shape, kind)
                continue
            layer0 = hf.replace("model.layers.", "model.layers.0.", 1)
            stem = names[layer0 if stacked else hf].split(".")[-2]
            # experts: (L, E, out, in); their biases (L, E, out) stay F32 (gpt-oss),
            # and norms (Cohere's per-head q/k gains (L, H, d)), as llama.cpp's
            matrix = (
                key != "bias"
                and not stem.endswith("norm")
                and len(sub) >= (3 if stacked else 2)
            )
            k = (emb_kind if not stacked else kind) if matrix else "F32"
            k = "F32" if stem in F32_STEMS else k  # the routers, as llama.cpp
            k = exp_kind if matrix and stem.endswith("_exps") else k
            if not stacked:
                put(names[hf], stored(w, k, hf, stem, tuple(sub)), tuple(sub), k)
                continue
            for i in range(config.num_layers):  # each layer made when written
                hf_i = hf.replace("model.layers.", f"model.layers.{i}.", 1)
                make = functools.partial(
                    _layer_bytes, stored, w, i, k, hf_i, stem, tuple(sub[1:])
                )
                put(names[hf_i], make, tuple(sub[1:]), k)

    walk(params, config.param_shapes(), "")
    rope = None
    if config.rope_type == "llama3":
        rope = llama3_divisors(config)
    elif config.rope_freq_divisors is not None:
        rope = config.rope_freq_divisors
    if rope is not None:
        vec = np.asarray(rope, np.float32)
        put("rope_freqs.weight", vec.view(np.uint8), vec.shape, "F32")
    if config.rope_type == "longrope":
        for which in ("long", "short"):
            vec = np.asarray(getattr(config, f"rope_{which}_factor"), np.float32)
            put(f"rope_factors_{which}.weight", vec.view(np.uint8), vec.shape, "F32")
    # The source's order when it has the same tensors, else layer by layer.
    same = src is not None and set(src.tensors) == set(tensors)
    order = list(src.tensors) if same and src else sorted(tensors, key=_order_key)
    tensors = {n: tensors[n] for n in order}
    file_kind = "MXFP4" if exp_kind == "MXFP4" else kind
    fields = _metadata(src, config, gname, file_kind, name) | tok_fields
    write_gguf(path, fields, tensors)


__all__ = [
    "EXPERT_TYPES",
    "FILE_TYPES",
    "TENSOR_TYPES",
    "GGUFTypes",
    "check_expert_type",
    "check_llama_gguf",
    "llama3_divisors",
    "save_llama_gguf",
]
