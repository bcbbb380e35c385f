"""llama.cpp GGUF files of every `LlamaConfig` family: metadata, names, load.

``general.architecture`` names the family (`entrenar.nn.architecture_for_gguf`:
``llama``, ``qwen2``, ``qwen3``, ``gemma2``, ``gemma3``, ``phi3``, ...); its
``{arch}.*`` keys give the sizes, and the tensor table the switches (biases
``blk.N.attn_q.bias``, q/k norms, Gemma's post norms, Phi-3's fused ``attn_qkv``);
`entrenar.io.gguf_families` holds the per-family conventions. Names (``N`` = layer)::

    token_embd.weight          model.embed_tokens.weight
    blk.N.attn_norm.weight     model.layers.N.input_layernorm.weight
    blk.N.attn_q/k/v.weight    model.layers.N.self_attn.q_proj/k_proj/v_proj.weight
    blk.N.attn_output.weight   model.layers.N.self_attn.o_proj.weight
    blk.N.ffn_norm.weight      model.layers.N.post_attention_layernorm.weight
    blk.N.ffn_gate/up/down     model.layers.N.mlp.gate_proj/up_proj/down_proj.weight
    output_norm.weight         model.norm.weight
    output.weight              lm_head.weight   (absent: tied to token_embd)
    rope_freqs.weight          LlamaConfig.rope_freq_divisors (Llama 3.x scaling)

llama.cpp applies rotary embeddings to interleaved pairs ``(x[2i], x[2i+1])`` in the
``llama`` family; Hugging Face to halves ``(x[i], x[i + d/2])``. Its converter
therefore permutes the rows (and biases) of ``q_proj`` (``n = H`` heads) and
``k_proj`` (``n = KV``) of each head::

    gguf = hf.reshape(n, 2, d/2, D).swapaxes(1, 2).reshape(n·d, D)

so GGUF row ``h·d + 2i + j`` is Hugging Face row ``h·d + j·d/2 + i``. The loader
applies the inverse, the writer the permutation itself. Rows are whole quantization
blocks, so quantized tensors are permuted in their raw bytes. The other families use
half-split (NEOX) rotary in llama.cpp too and are not permuted.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import math
import os
import warnings
from collections.abc import Callable, Generator, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from entrenar import nn
from entrenar.errors import ConfigError, FormatError, UnsupportedError
from entrenar.io.deepseek_gguf import (
    deepseek_config_from_gguf,
    expected_tensors,
    load_deepseek_tree,
)
from entrenar.io.ggml_dequant import dequantize_ggml, dequantize_ggml_into
from entrenar.io.gguf_families import (
    EXPERT_NORM,
    FF_EXPERTS,
    IMPLIED,
    LAYER_NORM_EPS,
    LOGIT_SCALE,
    MOE_FAMILIES,
    NOPE_FULL,
    NORM_SHIFT,
    ONE_WIDTH,
    PARTIAL_ROTARY,
    PERMUTED,
    QK_NORM_LAYERS,
    SCALE_KEYS,
    SHARED_EXPERT,
    SHARED_MLP,
    SPLIT_STEMS,
    SWA_LAYERS,
    SWITCH_FIELDS,
    TEMPERATURE,
    UNSCALED,
    WHOLE_HEADS,
    WINDOWED,
    YARN_LOG_MUL,
    default_layer_types,
    default_nope_layers,
    full_layers_nope,
    gguf_names,
    split_names,
)
from entrenar.io.gguf_meta import family_fields, meta_float, meta_int
from entrenar.io.gguf_reader import GGUFFile, GGUFMetadata, read_gguf
from entrenar.io.glm4moe_gguf import NAME as GLM4MOE
from entrenar.io.glm4moe_gguf import expected_tensors as glm4moe_tensors
from entrenar.io.glm4moe_gguf import gguf_tensor_names as glm4moe_names
from entrenar.io.glm4moe_gguf import (
    glm4moe_config_from_gguf,
)
from entrenar.io.heap import bound_heap, host_buffer, to_device, trim_heap
from entrenar.io.hf_folder import check_config_values
from entrenar.io.read_ahead import ReadAhead
from entrenar.io.tokenizer import BPETokenizer
from entrenar.nn import LlamaConfig
from entrenar.nn.deepseek import DeepseekConfig
from entrenar.nn.glm4_moe import Glm4MoeConfig
from entrenar.nn.hf_names import (
    CHUNK_BYTES,
    Quantize,
    Reader,
    RowFill,
    RowReader,
    StackedLeaf,
    per_layer_shapes,
    quantize_leaves,
    stream_layers,
    stream_one,
)
from entrenar.nn.host_arrays import populate_ahead
from entrenar.nn.rope_scaling import yarn_mscale
from entrenar.quant import GGMLWeight, QuantizedWeight, from_ggml
from entrenar.quant import ggml_head as _ggml_head  # noqa: F401  (registers head_nll)
from entrenar.quant.ggml import BLOCK_BYTES, HEAD_BYTES, QK, split_blocks
from entrenar.quant.ggml_mixed import (
    ROW_FORMATS,
    MixedGGMLWeight,
    check_types,
    row_bytes,
)
from entrenar.quant.kquant import FORMATS as KQUANT_FORMATS
from entrenar.threads import shared_pool
from entrenar.types import Params

KEEP_QUANTIZED = (
    *("Q8_0", "Q4_0", "Q4_1"),
    *("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "BF16", "F16"),
)
"""ggml types `load_llama_gguf(keep_quantized=True)` keeps as stored (projections,
embeddings and ``lm_head``): Q8_0/Q4_0/Q4_1 as `QuantizedWeight`, the K-quants, BF16
and F16 as `entrenar.quant.GGMLWeight`."""


def permute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Hugging Face -> llama.cpp row order of ``w: (..., n·d, X)`` (axis -2 rows).

    >>> permute_qk(np.arange(8).reshape(4, 2), 1)[:, 0].tolist()  # rows 0 2 1 3
    [0, 4, 2, 6]
    """
    *lead, rows, x = w.shape
    w = w.reshape(*lead, n_heads, 2, rows // n_heads // 2, x)  # (.., n, 2, d/2, X)
    return np.swapaxes(w, -2, -3).reshape(*lead, rows, x)


def unpermute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Inverse of `permute_qk`: llama.cpp -> Hugging Face row order.

    >>> w = np.arange(16).reshape(8, 2)
    >>> bool((unpermute_qk(permute_qk(w, 2), 2) == w).all())
    True
    """
    *lead, rows, x = w.shape
    return unpermuted_rows(w, n_heads).reshape(*lead, rows, x)


def unpermuted_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """`unpermute_qk` of ``w: (..., n·d, X)`` as a view ``(..., n, 2, d/2, X)``.

    No copy: flattened over its axes ``n, 2, d/2`` its rows are in Hugging Face
    order, so a copy into ``out.reshape(view.shape)`` un-permutes as it copies.
    """
    *lead, rows, x = w.shape
    w = w.reshape(*lead, n_heads, rows // n_heads // 2, 2, x)  # (.., n, d/2, 2, X)
    return np.swapaxes(w, -2, -3)  # (.., n, 2, d/2, X)


ROPE_SCALINGS = ("none", "", "linear", "yarn", "longrope")
"""``{arch}.rope.scaling.type`` values entrenar reads."""


def _arch_name(g: GGUFFile) -> str:
    f = g.fields.get("general.architecture")
    if f is None or not isinstance(f.value, str):
        raise FormatError(f"{g.path}: metadata 'general.architecture' is missing")
    return f.value


def _head_dim(g: GGUFFile, p: str, hidden: int, heads: int) -> int:
    """``attention.key_length`` (default ``hidden / heads``), checked for consistency.

    ``attention.value_length``, when given, must equal it.

    Raises:
        FormatError: no key length and a width that ``heads`` does not divide.
        UnsupportedError: values of another width than keys (entrenar projects
            whole heads).
    """
    if f"{p}attention.key_length" in g.fields:
        head_dim = meta_int(g, f"{p}attention.key_length")
    elif hidden % heads:
        raise FormatError(
            f"{g.path}: metadata '{p}embedding_length' = {hidden} is not a "
            f"multiple of '{p}attention.head_count' = {heads} and "
            f"'{p}attention.key_length' is missing"
        )
    else:
        head_dim = hidden // heads
    key = f"{p}attention.value_length"
    if key in g.fields and meta_int(g, key) != head_dim:
        raise UnsupportedError(
            f"{g.path}: metadata {key!r} = {g.fields[key].value} differs from "
            f"the head dimension {head_dim}; entrenar needs them equal"
        )
    return head_dim


def _rotary_dim(g: GGUFFile, name: str, head_dim: int) -> int:
    """``rope.dimension_count`` (default ``head_dim``): the rotated values of a head.

    Raises:
        UnsupportedError: fewer than ``head_dim`` in a family whose llama.cpp
            graph rotates whole heads (`PARTIAL_ROTARY` lists the others), or
            more, or an odd number.
    """
    key = f"{name}.rope.dimension_count"
    if key not in g.fields:
        return head_dim
    n_rot = meta_int(g, key)
    if n_rot == head_dim:
        return n_rot
    if name not in PARTIAL_ROTARY or not 2 <= n_rot < head_dim or n_rot % 2:
        raise UnsupportedError(
            f"{g.path}: metadata {key!r} = {n_rot} differs from the head dimension "
            f"{head_dim}; entrenar rotates part of a head (an even number of "
            f"values) only in {sorted(PARTIAL_ROTARY)}, as llama.cpp's graphs do"
        )
    return n_rot


def _vector(g: GGUFFile, name: str, n: int) -> tuple[float, ...]:
    """A small float tensor (``rope_freqs``, ``rope_factors_*``) of ``n`` values."""
    t = g.tensors[name]
    if t.shape != (n,):
        raise FormatError(f"{g.path}: tensor {name!r} has shape {t.shape}, want ({n},)")
    values = g.tensor(name).astype(np.float64)
    if not (np.isfinite(values).all() and (values > 0).all()):
        raise FormatError(f"{g.path}: tensor {name!r} holds values that are not > 0")
    return tuple(float(v) for v in values)


def rotary_factor(n_rot: int, head_dim: int) -> float:
    """The ``partial_rotary_factor`` whose ``int(head_dim · factor)`` is ``n_rot``.

    ``n_rot / head_dim``, one step up where the product rounds below ``n_rot``
    (``2 / 98 · 98`` is ``1.999…`` in floating point).

    >>> rotary_factor(96, 128), int(98 * rotary_factor(2, 98))
    (0.75, 2)
    """
    factor = n_rot / head_dim
    while int(head_dim * factor) < n_rot:
        factor = math.nextafter(factor, math.inf)
    return factor


def _rope_fields(g: GGUFFile, p: str, head_dim: int) -> dict[str, Any]:
    """Rotary scaling from ``{arch}.rope.scaling.*`` and ``rope_freqs``/factors.

    ``head_dim``: the rotated values of a head (``rope.dimension_count``).
    """
    kind_f = g.fields.get(f"{p}rope.scaling.type")
    kind = "none" if kind_f is None else kind_f.value
    if kind not in ROPE_SCALINGS:
        raise UnsupportedError(
            f"{g.path}: metadata '{p}rope.scaling.type' = {kind!r}; entrenar reads "
            f"{ROPE_SCALINGS[2:]} (or none)"
        )
    out: dict[str, Any] = {}
    half = head_dim // 2  # the rotated values' (rope.dimension_count)
    if "rope_freqs.weight" in g.tensors:
        out["rope_freq_divisors"] = _vector(g, "rope_freqs.weight", half)
    long, short = "rope_factors_long.weight", "rope_factors_short.weight"
    if long in g.tensors or short in g.tensors or kind == "longrope":
        if long not in g.tensors or short not in g.tensors:
            raise FormatError(f"{g.path}: longrope needs tensors {long} and {short}")
        kind = "longrope"
        out["rope_long_factor"] = _vector(g, long, half)
        out["rope_short_factor"] = _vector(g, short, half)
    if kind in ("none", ""):
        return out
    out["rope_type"] = kind
    out["rope_factor"] = meta_float(g, f"{p}rope.scaling.factor", 1.0)
    orig = f"{p}rope.scaling.original_context_length"
    if orig in g.fields or kind != "linear":
        out["rope_original_max_position_embeddings"] = meta_int(g, orig)
    attn = meta_float(g, f"{p}rope.scaling.attn_factor", None)
    if kind == "yarn" and attn is not None:  # llama.cpp: × yarn_mscale(factor)
        attn = None if attn == 1.0 else attn * yarn_mscale(out["rope_factor"])
    elif kind == "yarn":  # the converter's copy of config.json's attention_factor
        attn = meta_float(g, f"{p}rope.scaling.yarn_attn_factor", None)
    if attn is not None:
        out["rope_attention_factor"] = attn
    if kind == "yarn":
        out["rope_beta_fast"] = meta_float(g, f"{p}rope.scaling.yarn_beta_fast", 32.0)
        out["rope_beta_slow"] = meta_float(g, f"{p}rope.scaling.yarn_beta_slow", 1.0)
    return out


def _window_fields(g: GGUFFile, name: str, p: str, n_layers: int) -> dict[str, Any]:
    """``sliding_window`` and ``layer_types`` from ``attention.sliding_window*``.

    A window of 0 is none, as llama.cpp reads it: its converter writes 0 for a Phi-3
    family model without a window (Phi-4, ``sliding_window: null``).
    """
    key = f"{p}attention.sliding_window"
    swa = SWA_LAYERS.get(name, (None,))[0] == n_layers  # EXAONE 4.0 32B's
    default = 4096 if name == "gemma2" or swa else None  # llama.cpp's default
    f = g.fields.get(key)
    if f is not None and f.value == 0 and not isinstance(f.value, (bool, float)):
        return {}
    window = meta_int(g, key) if f is not None else default
    if window is None:
        return {}
    types = default_layer_types(name, n_layers)
    pattern = g.fields.get(f"{p}attention.sliding_window_pattern")
    if pattern is not None:
        v = pattern.value
        if (
            isinstance(v, list)
            and len(v) == n_layers
            and all(isinstance(b, bool) for b in v)
        ):
            types = tuple("sliding_attention" if b else "full_attention" for b in v)
        elif isinstance(v, int) and not isinstance(v, bool) and 0 < v <= n_layers:
            types = tuple(
                "full_attention" if (i + 1) % v == 0 else "sliding_attention"
                for i in range(n_layers)
            )
        else:
            raise FormatError(
                f"{g.path}: metadata '{p}attention.sliding_window_pattern' must be "
                f"{n_layers} booleans or a period"
            )
    return {"sliding_window": window, "layer_types": types}


def _swa_layers(g: GGUFFile, fields: dict[str, Any], name: str) -> dict[str, Any]:
    """`gguf_families.SWA_LAYERS`: the window keys as llama.cpp's graph takes them.

    At the family's layer count the sliding layers rotate and the others are NoPE;
    at any other llama.cpp ignores the window keys (warned): no window, every layer
    rotates.
    """
    count, n_layers = SWA_LAYERS[name][0], fields["num_layers"]
    if count != n_layers and fields.get("sliding_window"):
        warnings.warn(
            f"{g.path}: llama.cpp's {name} slides only at {count} layers and ignores "
            f"'{name}.attention.sliding_window' at {n_layers}; read as it runs the "
            "file: every layer global and rotating",
            stacklevel=4,
        )
    if count != n_layers or not fields.get("sliding_window"):
        return {"sliding_window": None, "layer_types": None, "nope_layers": None}
    nope = tuple(t != "sliding_attention" for t in fields["layer_types"])
    return {"nope_layers": nope if any(nope) else None}


def _yarn_log_mul(g: GGUFFile, p: str, factor: float) -> dict[str, Any]:
    """YaRN's attention factor under ``rope.scaling.yarn_log_multiplier`` ``m``.

    llama.cpp (llama-context.cpp, ``mscale`` 1) scales cos and sin by
    ``attn_factor · yarn_mscale(s) / (0.1 m ln s + 1)``; without the key the generic
    rule (`_rope_fields`) holds.
    """
    m = meta_float(g, f"{p}rope.scaling.yarn_log_multiplier", None)
    if not m:  # llama.cpp: 0 is none
        return {}
    attn = meta_float(g, f"{p}rope.scaling.attn_factor", 1.0)
    scale = yarn_mscale(factor) / yarn_mscale(factor, m)
    return {"rope_attention_factor": attn * scale}


def _expert_fields(g: GGUFFile, name: str, p: str, n_ff: int) -> dict[str, Any]:
    """The mixture-of-experts `LlamaConfig` fields of ``{arch}.expert_*``.

    As llama.cpp reads them (src/models/llama.cpp, qwen2moe.cpp, qwen3moe.cpp,
    olmoe.cpp, granite.cpp): ``expert_count`` ``E`` and ``expert_used_count``
    ``k``; an expert's width ``expert_feed_forward_length`` (`FF_EXPERTS`:
    ``feed_forward_length``; Qwen's default ``n_ff / k``), Qwen2-MoE's shared
    expert's ``expert_shared_feed_forward_length`` (default ``n_ff``), Granite MoE
    shared's ungated ``shared_mlp`` of that width (default 0: none, `SHARED_MLP`);
    the renormalisation of the top-k weights fixed by the architecture
    (`EXPERT_NORM`). Empty for a dense model.

    Raises:
        FormatError: expert tensors without ``expert_count``, or counts that do not
            fit (``0 < k <= E``).
        UnsupportedError: experts in an architecture llama.cpp reads none for, or a
            routing entrenar does not compute (``expert_weights_scale`` other than
            1, a gating function other than softmax).
    """
    count = g.fields.get(f"{p}expert_count")
    if count is None or count.value == 0:
        if any(t.endswith(("_exps.weight", "ffn_gate_inp.weight")) for t in g.tensors):
            raise FormatError(
                f"{g.path}: ffn_*_exps expert tensors but no {p}expert_count; the "
                "file is corrupt"
            )
        return {}
    if name not in MOE_FAMILIES:
        raise UnsupportedError(
            f"{g.path}: a mixture of experts ({p}expert_count = {count.value}) in "
            f"general.architecture {name!r}; entrenar reads experts in "
            f"{sorted(MOE_FAMILIES)} (Mixtral as llama, Qwen3-MoE, Qwen2-MoE, "
            "gpt-oss, OLMoE, Granite MoE)"
        )
    e = meta_int(g, f"{p}expert_count")
    k = meta_int(g, f"{p}expert_used_count")
    if k > e:
        raise FormatError(
            f"{g.path}: metadata {p}expert_used_count = {k} is over "
            f"{p}expert_count = {e}"
        )
    scale = g.fields.get(f"{p}expert_weights_scale")
    if scale is not None and scale.value not in (0, 0.0, 1, 1.0):  # 0: unset
        raise UnsupportedError(
            f"{g.path}: metadata {p}expert_weights_scale = {scale.value}; entrenar "
            "does not scale the routing weights"
        )
    gating = g.fields.get(f"{p}expert_gating_func")
    if gating is not None and gating.value != 1:  # LLAMA_EXPERT_GATING_FUNC_SOFTMAX
        raise UnsupportedError(
            f"{g.path}: metadata {p}expert_gating_func = {gating.value}; entrenar "
            "routes by softmax (1)"
        )
    out: dict[str, Any] = dict(
        num_experts=e, num_experts_per_tok=k, norm_topk_prob=EXPERT_NORM[name]
    )
    if name in ONE_WIDTH:  # gpt-oss: the experts' width is the model's
        out["intermediate_size"] = meta_int(g, f"{p}expert_feed_forward_length", n_ff)
    elif name not in FF_EXPERTS:  # Mixtral's are feed_forward_length wide
        key = f"{p}expert_feed_forward_length"
        out["moe_intermediate_size"] = meta_int(g, key, max(1, n_ff // k))
    if name in SHARED_EXPERT:
        key = f"{p}expert_shared_feed_forward_length"
        out["shared_expert_intermediate_size"] = meta_int(g, key, n_ff)
    if name in SHARED_MLP:  # Granite MoE shared: an ungated MLP beside
        key = f"{p}expert_shared_feed_forward_length"
        out["shared_mlp_intermediate_size"] = meta_int(g, key, 0)
    return out


def llama_config_from_gguf(g: GGUFFile) -> LlamaConfig:
    """The `LlamaConfig` (of its family) a GGUF file's metadata and tensors describe.

    Every integer is checked against `INT_LIMITS`, every float against
    `FLOAT_RANGES`, and the shapes against each other (heads divide the width, KV
    heads divide the heads, an even head dimension); the config built, every field
    is checked as a ``config.json``'s are (`check_config_values`: its type, finite
    floats, integers in range), the fields ``entrenar.family`` gives included.

    Raises:
        FormatError: missing, out-of-range or inconsistent fields (named in the
            message).
        UnsupportedError: an architecture entrenar does not implement, a rope
            scaling or partial rotary.
    """
    config = _config_from_gguf(g)
    check_config_values(config, g.path, "the GGUF metadata")
    return config


def _config_from_gguf(g: GGUFFile) -> LlamaConfig:
    """`llama_config_from_gguf` before its values are checked."""
    name = _arch_name(g)
    arch = nn.architecture_for_gguf(name, g.path)
    if name == "deepseek2":  # DeepSeek-V2/V3's latent attention: its own keys
        return deepseek_config_from_gguf(g)
    if name == GLM4MOE:  # GLM-4.5's unrolled layers: its own keys
        return glm4moe_config_from_gguf(g)
    if arch.config_class is not LlamaConfig:
        raise UnsupportedError(
            f"{g.path}: general.architecture {name!r} is not a decoder entrenar loads "
            "from llama.cpp files"
        )
    p = f"{name}."
    heads = meta_int(g, f"{p}attention.head_count")
    hidden = meta_int(g, f"{p}embedding_length")
    n_layers = meta_int(g, f"{p}block_count")
    emb = g.tensors.get("token_embd.weight")
    n_vocab = emb.shape[0] if emb is not None and len(emb.shape) == 2 else None
    head_dim = _head_dim(g, p, hidden, heads)
    has = set(g.tensors)
    implied = IMPLIED.get(name, {})
    eps = LAYER_NORM_EPS if implied.get("layer_norm") else (
        "attention.layer_norm_rms_epsilon"
    )  # fmt: skip
    fields: dict[str, Any] = dict(
        vocab_size=meta_int(g, f"{p}vocab_size", n_vocab),
        hidden_size=hidden,
        intermediate_size=meta_int(g, f"{p}feed_forward_length"),
        num_layers=n_layers,
        num_heads=heads,
        num_kv_heads=meta_int(g, f"{p}attention.head_count_kv", heads),
        head_dim=head_dim,
        rope_theta=meta_float(g, f"{p}rope.freq_base", 10000.0),
        rms_norm_eps=meta_float(g, p + eps, 1e-5),
        tie_word_embeddings="output.weight" not in has,
        max_position_embeddings=meta_int(g, f"{p}context_length", 2048),
        attention_bias=bool({"blk.0.attn_q.bias", "blk.0.attn_qkv.bias"} & has),
        attention_out_bias="blk.0.attn_output.bias" in has,
        mlp_bias="blk.0.ffn_down.bias" in has,
        qk_norm="blk.0.attn_q_norm.weight" in has,
        fused_qkv="blk.0.attn_qkv.weight" in has,
        fused_gate_up="blk.0.ffn_up.weight" in has
        and not IMPLIED.get(name, {}).get("ungated_mlp")
        and "blk.0.ffn_gate.weight" not in has,
    )
    fields |= IMPLIED.get(name, {})  # over the tensor table's (OLMoE's o bias)
    if name in WHOLE_HEADS and head_dim * heads == hidden:
        fields["head_dim"] = None  # OLMoE's: D / H, as its config.json reader
    fields["nope_layers"] = default_nope_layers(name, n_layers)
    if name in QK_NORM_LAYERS:  # Command-R+: a gain per head, {d, H}
        fields["qk_norm_heads"] = fields["qk_norm"]
    n_rot = _rotary_dim(g, name, head_dim)
    if n_rot != head_dim:
        fields["partial_rotary_factor"] = rotary_factor(n_rot, head_dim)
    fields |= _rope_fields(g, p, n_rot)
    fields |= _window_fields(g, name, p, n_layers)
    if name in NOPE_FULL:  # Cohere 2: the full-attention layers do not rotate
        types = fields.get("layer_types")
        fields["nope_layers"] = full_layers_nope(name, types, n_layers)
    if name in SWA_LAYERS:  # EXAONE 4: sliding layers at 64 layers only
        fields |= _swa_layers(g, fields, name)
    if name in YARN_LOG_MUL and fields.get("rope_type") == "yarn":
        fields |= _yarn_log_mul(g, p, fields["rope_factor"])
    temperature = f"{p}attention.temperature_scale"
    if name in TEMPERATURE and temperature in g.fields:  # Llama 4's (Ministral 3)
        beta = meta_float(g, temperature, None)
        orig = f"{p}rope.scaling.original_context_length"
        fields["query_scale_beta"] = beta
        fields["query_scale_length"] = meta_int(
            g, orig, fields["max_position_embeddings"]
        )
    fields |= _expert_fields(g, name, p, fields["intermediate_size"])
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        value = meta_float(g, f"{p}{key}", None)
        if value is not None:
            fields[key] = value
    for field, key in SCALE_KEYS.items():  # Granite's multipliers
        if name in LOGIT_SCALE and key == "logit_scale":
            field = "logit_scale"  # Cohere's multiplies the logits
        value = meta_float(g, f"{p}{key}", None)
        if value is not None:
            fields[field] = value
    if name == "gemma3" or f"{p}rope.freq_base_swa" in g.fields:
        local = meta_float(g, f"{p}rope.freq_base_swa", 10000.0)
        if fields.get("sliding_window") and local != fields["rope_theta"]:
            fields["rope_local_theta"] = local
    if (name, n_layers) in (("gemma2", 46), ("gemma3", 62)):  # llama.cpp's 27B rule
        fields["query_pre_attn_scalar"] = float(hidden // heads)
    default = arch.name
    if name in UNSCALED and not fields.get("query_scale_beta"):
        default = UNSCALED[name]  # Mistral Small 3.1/3.2 in mistral3
    if name in WINDOWED and fields.get("sliding_window"):  # OLMo 3 in olmo2
        default = WINDOWED[name]
        local = meta_float(g, f"{p}rope.freq_base_swa", fields["rope_theta"])
        fields["rope_local_theta"] = local  # set even when equal: unscaled
    family = family_fields(g, name, SWITCH_FIELDS)
    if fields.get("num_experts") and "architecture" not in family:
        family["architecture"] = MOE_FAMILIES[name]  # a llama with experts: Mixtral
        if fields.get("shared_mlp_intermediate_size"):  # Granite MoE shared
            family["architecture"] = SHARED_MLP[name]
    if family.get("rope_type", "default") != "default":
        fields.pop("rope_freq_divisors", None)  # rope_freqs was derived from them
    fields |= family
    family_arch = nn.architecture(family.get("architecture", default))
    try:
        return family_arch.make_config(**fields)
    except (ConfigError, TypeError, ValueError) as e:
        raise FormatError(f"{g.path}: inconsistent {name}.* metadata: {e}") from None


def _expected(
    g: GGUFFile, config: LlamaConfig
) -> dict[str, tuple[str, tuple[int, ...]]]:
    """GGUF name -> (Hugging Face name, shape of one tensor) for every tensor."""
    flat = per_layer_shapes(config)
    names = gguf_names(config)
    out = {names[hf]: (hf, shape) for hf, shape in flat.items() if hf in names}
    for hf, halves in split_names(config).items():  # Granite MoE shared's [gate; up]
        rows, *rest = flat[hf]
        for part in halves:  # its name: "" (read by `_load_tree`'s `halves`)
            out[part] = ("", (rows // 2, *rest))
    half = config.rotary_dim // 2
    if "rope_freqs.weight" in g.tensors:
        out["rope_freqs.weight"] = ("", (half,))
    if config.rope_type == "longrope" and "rope_factors_long.weight" in g.tensors:
        out["rope_factors_long.weight"] = ("", (half,))
        out["rope_factors_short.weight"] = ("", (half,))
    return out


def _check_tensors(g: GGUFFile, config: LlamaConfig) -> None:
    if isinstance(config, DeepseekConfig):
        want = expected_tensors(g, config)
    elif isinstance(config, Glm4MoeConfig):  # MTP layers listed (skipped)
        want = glm4moe_tensors(g, config)
    else:
        want = _expected(g, config)
    p = f"{_arch_name(g)}.*"
    for name, (_, shape) in want.items():
        if name not in g.tensors:
            raise FormatError(f"{g.path}: tensor {name!r} is missing")
        if g.tensors[name].shape != shape:
            raise FormatError(
                f"{g.path}: tensor {name!r} has shape {g.tensors[name].shape}, the "
                f"{p} metadata implies {shape}"
            )
    extra = sorted(set(g.tensors) - set(want))
    if extra:
        family = nn.architecture_of(config).name
        raise FormatError(f"{g.path}: unexpected tensors {extra[:5]} for a {family}")


def read_llama_header(
    path: str | os.PathLike[str] | GGUFFile,
) -> tuple[GGUFFile, LlamaConfig]:
    """A llama.cpp GGUF's header, checked without reading the weights' data.

    The magic, version and metadata (`read_gguf`), the hyperparameters
    (`llama_config_from_gguf`) and the tensor table: every tensor the config
    implies is there with its shape, and no other. `load_llama_gguf` starts with it.

    Raises:
        FormatError: not a GGUF, a corrupt header, or a tensor table that does not
            fit the metadata.
        UnsupportedError: an architecture entrenar does not read, or a GGUF version
            other than 2 and 3.
    """
    g = path if isinstance(path, GGUFFile) else read_gguf(path)
    config = llama_config_from_gguf(g)
    _check_tensors(g, config)
    return g, config


def _rows(g: GGUFFile, name: str) -> np.ndarray:
    """Raw bytes of ``name`` as ``(rows, row_bytes)`` (a vector: ``(n, item)``)."""
    raw, n = g.raw(name), g.tensors[name].shape[0]
    return raw.reshape(n, -1) if raw.size % n == 0 else raw


def _block_arrays(
    lead: tuple[int, ...], nb: int, kind: str
) -> tuple[int, np.ndarray, np.ndarray, np.ndarray | None]:
    """``(width, codes, d, m)``: page-aligned host arrays of a Q8_0/Q4_0/Q4_1 node.

    ``width`` code bytes a block; ``codes (*lead, nb · width)`` uint8, float16 ``d
    (*lead, nb)`` and, for Q4_1, ``m (*lead, nb)`` (else None), for `split_blocks`
    to fill and `blocks_node` to wrap.
    """
    width = BLOCK_BYTES[kind] - HEAD_BYTES[kind]
    codes = host_buffer((*lead, nb * width), np.uint8)
    d = host_buffer((*lead, nb), np.float16)
    m = host_buffer((*lead, nb), np.float16) if kind == "Q4_1" else None
    return width, codes, d, m


READ_LEAD = 256 << 20
"""Most bytes of the file read ahead of the load (256 MiB: a small file is read
whole while the header is parsed); `entrenar.io.read_ahead.ReadAhead`."""


def _mapped(path: str) -> np.ndarray | None:
    """The whole file, memory-mapped read-only (uint8); None if it cannot be."""
    try:
        if os.path.getsize(path) == 0:
            return None
        return np.memmap(path, np.uint8, mode="r")
    except (OSError, ValueError):
        return None  # the parse says why


def _ahead() -> concurrent.futures.ThreadPoolExecutor:
    """Threads of a load's side work: JAX's client, a table kept as stored."""
    return shared_pool("gguf-ahead", 2)


def blocks_node(
    codes: np.ndarray, d: np.ndarray, m: np.ndarray | None, kind: str
) -> QuantizedWeight:
    """The `QuantizedWeight` of split Q8_0/Q4_0/Q4_1 host arrays, uncopied on the CPU.

    ``codes (..., rows, nb · width)`` uint8, ``d`` and Q4_1's ``m`` ``(..., rows,
    nb)`` float16, as `entrenar.quant.ggml.split_blocks` writes them.
    """
    return QuantizedWeight(
        to_device(codes.view(np.int8) if kind == "Q8_0" else codes),
        to_device(d),
        None if m is None else to_device(m),
        scheme=kind.lower(),
        block_size=QK,
        dtype=np.dtype(np.float32),
    )


Fill = Generator[None, None, Any]
"""A stacked leaf filled a layer per step: each ``next`` reads one more layer (the
first allocates), and the generator returns the leaf (`by_layer`)."""


def by_layer(fills: Sequence[Fill]) -> list[Any]:
    """Run ``fills`` a step each in turn: every leaf's layer ``i``, then ``i + 1``.

    Returns each fill's leaf, in order. On an error the other fills are closed
    (their ``finally`` blocks run) before it is raised.
    """
    values: list[Any] = [None] * len(fills)
    live = list(range(len(fills)))
    try:
        while live:
            for k in list(live):
                try:
                    next(fills[k])
                except StopIteration as done:
                    values[k] = done.value
                    live.remove(k)
    finally:
        for f in fills:
            f.close()
    return values


def _at_once(make: Callable[[], Any]) -> Fill:
    """A `Fill` that builds its whole leaf at its first step (``make()``)."""
    return make()
    yield  # a generator: nothing before its first step


def load_llama_gguf(
    path: str | os.PathLike[str] | GGUFFile,
    keep_quantized: bool = False,
    *,
    dtype: str = "float32",
    quantize: Quantize | None = None,
    stream: bool = True,
) -> tuple[LlamaConfig, Params, Mapping[str, Any]]:
    """Load a llama.cpp GGUF of any `LlamaConfig` family into entrenar's tree.

    The file is memory-mapped and read tensor by tensor: each stacked leaf is filled
    layer by layer in ``dtype`` (then quantized, if asked) and the file's pages
    given back before the next is read, so the load holds the final tree plus about
    one stacked leaf (`entrenar.nn.hf_names.StackedLeaf`).

    Args:
        path: the ``.gguf`` file (or a `GGUFFile` already read).
        keep_quantized: keep every matrix as stored (for QLoRA): Q8_0, Q4_0 and
            Q4_1 as `entrenar.quant.QuantizedWeight` nodes, the K-quants
            (Q2_K-Q6_K), BF16 and F16 as `entrenar.quant.GGMLWeight`, a projection
            whose layers have different types (llama.cpp's Q4_K_M: Q4_K and Q6_K)
            as a `entrenar.quant.ggml_mixed.MixedGGMLWeight`. The projections and
            the token embedding and ``lm_head`` alike: a kept embedding is looked
            up by decoding only the rows it looks up (`entrenar.nn.embedding`'s
            rule for the node), and a tied head multiplies through the node. Only
            the F32 tensors (norms, biases, an F32 embedding) are converted to
            ``dtype``.
        dtype: dtype of the dequantized leaves.
        quantize: which dequantized leaves to quantize as they are read, and how
            (`entrenar.nn.hf_names.Quantize`); leaves kept quantized stay as stored.
        stream: False reads the way entrenar did before streaming (each stacked
            leaf dequantized whole, then quantized): the same tree; the reference
            the streaming load is tested against.

    A ``deepseek2`` file (DeepSeek-V2/V3, `entrenar.io.deepseek_gguf`) and a
    ``glm4moe`` file (GLM-4.5, `entrenar.io.glm4moe_gguf`) have a list of
    unstacked layers: every tensor is dequantized into ``dtype`` (``keep_quantized``
    and ``stream`` do not apply), then ``quantize``d as asked.

    Returns:
        ``(config, params, tokenizer_info)``: the tree of ``config.param_shapes()``
        (q/k rows in Hugging Face order, Gemma's norms as Hugging Face stores them)
        and the ``tokenizer.*`` metadata (a read-only `GGUFMetadata`: the vocabulary
        is decoded when first read; build a tokenizer with
        `BPETokenizer.from_gguf_metadata`).

    Raises:
        FormatError: a corrupt file or tensors that do not fit the metadata.
        UnsupportedError: an architecture or rope scaling entrenar does not read, or
            an undecodable tensor type.
    """
    # the file read front to back on a thread from the start (the layers are then
    # filled in the file's order, behind it), and JAX's CPU client started (10-20 ms
    # in a new process) on another, while this one parses the header
    reading = ReadAhead(lead=READ_LEAD)
    whole = None if isinstance(path, GGUFFile) else _mapped(os.fspath(path))
    reading.read([] if whole is None else [whole])
    ahead = _ahead().submit(jax.devices)
    try:
        g, config = read_llama_header(path)
        if isinstance(config, DeepseekConfig):  # a list of unstacked layers
            return load_deepseek_tree(
                g, config, dtype=dtype, quantize=quantize, release=reading.release
            )
        if isinstance(config, Glm4MoeConfig):  # (DeepSeekMoE's list too)
            return load_deepseek_tree(
                g, config, dtype=dtype, quantize=quantize, release=reading.release,
                names=glm4moe_names(config),
            )  # fmt: skip
        if whole is None:  # a GGUFFile already parsed: its tensors in the file's order
            stored = sorted(g.tensors.values(), key=lambda t: t.offset)
            reading.read([g.raw(t.name) for t in stored])
        return _load_tree(g, config, reading, keep_quantized, dtype, quantize, stream)
    finally:  # nothing of the load runs on after it
        reading.close()
        concurrent.futures.wait([ahead])


def _load_tree(
    g: GGUFFile,
    config: LlamaConfig,
    reading: ReadAhead,
    keep_quantized: bool,
    dtype: str,
    quantize: Quantize | None,
    stream: bool,
) -> tuple[LlamaConfig, Params, Mapping[str, Any]]:
    """`load_llama_gguf` once the header is read, the file being read by ``reading``."""
    release = reading.release  # a tensor read: its pages dropped, the reader told

    def read_into(gname: str, out: np.ndarray) -> np.ndarray:
        """`GGUFFile.read_into` through the load's descriptor, the reader told."""
        got = g.read_into(gname, out, fd)
        reading.consumed(got.nbytes)
        return got

    bound_heap(sum(t.nbytes for t in g.tensors.values()))  # big buffers mapped
    config = dataclasses.replace(config, param_dtype=dtype)
    name = _arch_name(g)
    want = _expected(g, config)
    by_hf = {hf: gguf for gguf, (hf, _) in want.items() if hf}
    permute = name in PERMUTED
    shift = NORM_SHIFT.get(name, 0.0)
    perm_heads = {"attn_q": config.num_heads, "attn_k": config.num_kv_heads}
    final = jax.dtypes.canonicalize_dtype(dtype)

    def _type(gname: str) -> str:
        return g.tensors[gname].type_name

    def one(gname: str, shape: tuple[int, ...]) -> np.ndarray:
        """One tensor dequantized, un-permuted and un-shifted: (shape) float32."""
        rows = _rows(g, gname)
        stem = gname.split(".")[-2]
        if permute and stem in perm_heads:
            rows = unpermute_qk(rows, perm_heads[stem])
        a = dequantize_ggml(rows, g.tensors[gname].type_id, shape)
        release(g.raw(gname))
        return a - np.float32(shift) if shift and stem.endswith("norm") else a

    def reader(gname: str, shape: tuple[int, ...]) -> Reader:
        """One layer in the load's dtype: float32 stays in numpy (no JAX program)."""
        if final == np.float32:
            return lambda: one(gname, shape)
        return lambda: jnp.asarray(one(gname, shape), dtype=dtype)

    def rows(gname: str, shape: tuple[int, ...]) -> RowReader:
        """Rows of an unstacked tensor (never permuted; a vector read whole)."""

        def read(start: int | None, stop: int | None) -> Any:
            if start is None or stop is None:
                return reader(gname, shape)()
            raw = _rows(g, gname)[start:stop]  # whole rows of blocks
            a = dequantize_ggml(
                raw, g.tensors[gname].type_id, (stop - start, *shape[1:])
            )
            out = jnp.asarray(a, dtype=dtype).block_until_ready()
            release(raw)
            return out

        return read

    def matrix(path_: str, gname: str, shape: tuple[int, ...]) -> jax.Array:
        """An unstacked float32 matrix (the embedding) decoded into its leaf.

        As `stream_one` with `fill` (rows of `CHUNK_BYTES` of float32 at a time,
        the file's pages given back after each), but the buffer comes lazily zeroed
        and the decoding threads fault in each part's pages just before writing it
        (`dequantize_ggml_into`'s ``populate``), instead of this thread populating
        the whole buffer first.
        """
        buf = host_buffer(shape, np.float32, zeroed=True)  # (rows, cols), lazy
        type_id = g.tensors[gname].type_id
        step = max(1, CHUNK_BYTES // (4 * math.prod(shape[1:])))  # rows at a time
        for start in range(0, shape[0], step):
            raw = _rows(g, gname)[start : start + step]  # whole rows of blocks
            part = buf[start : start + step]  # (rows, cols) of the leaf
            dequantize_ggml_into(raw, type_id, part, populate=True)
            release(raw)
        return to_device(buf)

    def fill(gname: str) -> RowFill | None:
        """Rows of an unstacked float32 leaf decoded straight into its buffer."""
        if final != np.float32:
            return None
        type_id = g.tensors[gname].type_id

        def write(start: int, stop: int, out: np.ndarray) -> None:
            raw = _rows(g, gname)[start:stop]  # whole rows of blocks
            dequantize_ggml_into(raw, type_id, out)  # (stop - start, *shape[1:])
            release(raw)

        return write

    stage = np.empty(0, np.uint8)

    def staged(size: int) -> np.ndarray:
        """``size`` bytes of one buffer every leaf reads a layer through in turn.

        One for the load: the fills run a layer at a time, each done with it
        before the next starts, so it stays in the cache.
        """
        nonlocal stage
        if stage.size < size:
            stage = np.empty(size, np.uint8)
        return stage[:size]

    def kept_bytes(path_: str, names: list[str], types: list[str], shape: Any) -> Fill:
        """A stacked leaf as stored, filled layer by layer on the host (a `Fill`).

        Each layer's bytes are read from the file (``pread``, `GGUFFile.read_into`)
        into its place in one page-aligned ``(L, rows, width)`` uint8 buffer, or
        through a one-layer buffer when its rows are un-permuted; the buffer becomes
        the JAX array without a copy on the CPU (`entrenar.io.heap.to_device`). A
        `GGMLWeight`, or a `MixedGGMLWeight` when the layers' types differ
        (llama.cpp's mixes): then each layer's bytes are packed at the start of its
        ``rows * width`` room. The buffer comes zeroed (lazily) from the kernel and
        each layer's bytes are faulted in on a background thread ahead of their
        read (`populate_ahead`), so the page faults overlap the disk, and the
        unused end of a narrower layer's room is never written, never resident.
        """
        yield  # allocated at the first layer's turn
        kinds = tuple(sorted(set(types)))
        cols = shape[-1]
        width = max(row_bytes(t, cols) for t in check_types(kinds, cols))
        buf = host_buffer((*shape[:-1], width), np.uint8, zeroed=True)  # lazy
        stem = names[0].split(".")[-2]
        permuted = permute and stem in perm_heads
        sizes = [shape[-2] * row_bytes(t, cols) for t in types]
        # each layer's room (only the bytes written become resident), faulted in
        # on a background thread ahead of its read
        rooms = [buf[i].reshape(-1)[:size] for i, size in enumerate(sizes)]
        ready = populate_ahead(rooms)
        for i, gname in enumerate(names):
            if i > 0:
                yield  # the other leaves' layer i - 1
            size, room = sizes[i], rooms[i]  # layer i's bytes, packed (contiguous)
            if not permuted:
                read_into(gname, room)  # straight into its place
                continue
            raw = read_into(gname, staged(size)).reshape(shape[-2], -1)
            hf = unpermuted_rows(raw, perm_heads[stem])  # (n, 2, d/2, row bytes)
            room.reshape(hf.shape)[...] = hf  # un-permuted as it is copied
        concurrent.futures.wait(ready)
        data = to_device(buf)
        if len(kinds) == 1:
            return GGMLWeight(data, kinds[0])
        kind = to_device(np.asarray([kinds.index(t) for t in types], np.int32))  # (L,)
        return MixedGGMLWeight(data, kind, kinds, cols)

    def kept_blocks(names: list[str], kind: str, shape: Any) -> Fill:
        """A stacked Q8_0/Q4_0/Q4_1 leaf as `from_ggml` makes it, a `Fill` of layers.

        Each layer's blocks are split from the mapped file (read ahead into the
        page cache; q/k through a view in Hugging Face's row order,
        `unpermuted_rows`) into the node's page-aligned ``(L,
        rows, ...)`` host arrays (codes, float16 ``d``, Q4_1's float16 ``m``), which
        become the JAX arrays uncopied, and the layer's pages given back: no copy
        of the raw layer (a ``pread`` into a buffer first cost SmolLM2-135M's load
        ~20 ms), no stacked copy of the raw leaf, no JAX program.
        """
        yield  # allocated at the first layer's turn
        rows, cols = shape[-2], shape[-1]
        nb, size = cols // QK, BLOCK_BYTES[kind]
        width, codes, d, m = _block_arrays((shape[0], rows), nb, kind)  # (L, rows, ·)
        stem = names[0].split(".")[-2]
        for i, gname in enumerate(names):
            if i > 0:
                yield  # the other leaves' layer i - 1
            raw = _rows(g, gname)  # (rows, nb · size) layer i's blocks, mapped
            if permute and stem in perm_heads:  # split as they are un-permuted
                raw = unpermuted_rows(raw, perm_heads[stem])  # (n, 2, d/2, ·) view
            lead = raw.shape[:-1]  # (rows,) or (n, 2, d/2): Hugging Face's order
            split_blocks(
                raw.reshape(*lead, nb, size), kind,
                codes[i].reshape(*lead, nb, width), d[i].reshape(*lead, nb),
                None if m is None else m[i].reshape(*lead, nb),
            )  # fmt: skip
            release(g.raw(gname))
        return blocks_node(codes, d, m, kind)

    def kept_matrix(gname: str, kind: str, shape: tuple[int, ...]) -> QuantizedWeight:
        """An unstacked Q8_0/Q4_0/Q4_1 matrix (an embedding, ``lm_head``) as stored.

        The node `from_ggml` makes, split from the mapped file `CHUNK_BYTES` of
        blocks at a time into its page-aligned ``(rows, ...)`` host arrays, the
        file's pages given back after each: no float32 copy, no JAX program.
        """
        rows, cols = shape
        nb, size = cols // QK, BLOCK_BYTES[kind]
        width, codes, d, m = _block_arrays((rows,), nb, kind)  # (rows, ·)
        step = max(1, CHUNK_BYTES // (nb * size))  # rows at a time
        for start in range(0, rows, step):
            raw = _rows(g, gname)[start : start + step]  # (n, nb · size), mapped
            part = slice(start, start + raw.shape[0])
            split_blocks(
                raw.reshape(-1, nb, size), kind, codes[part].reshape(-1, nb, width),
                d[part], None if m is None else m[part],
            )  # fmt: skip
            release(raw)
        return blocks_node(codes, d, m, kind)

    def kept_table(path_: str, gname: str, shape: tuple[int, ...]) -> GGMLWeight:
        """An unstacked matrix as stored, read from the file into its buffer."""
        t = g.tensors[gname]
        rows_ = t.shape[0]  # (rows, row_bytes): sizes checked by the header
        buf = host_buffer((rows_, t.nbytes // rows_), np.uint8)
        read_into(gname, buf)
        return GGMLWeight(to_device(buf), _type(gname))

    def copied(
        path_: str,
        names: list[str],
        shape: tuple[int, ...],
        readers: list[Reader] | None = None,
    ) -> Fill:
        """A stacked leaf dequantized and cast into its buffer, layer by layer.

        ``readers``: each layer's (default: ``names`` read whole).
        """
        yield  # allocated at the first layer's turn
        if readers is None:
            readers = [reader(n, shape[1:]) for n in names]
        leaf = StackedLeaf(path_, shape, final, readers)
        for i in range(shape[0]):
            if i > 0:
                yield  # the other leaves' layer i - 1
            leaf.copy(i)
        return leaf.value()

    def stacked(path_: str, hf_stem: str, shape: tuple[int, ...]) -> Fill:
        """The stacked leaf ``path_`` as a `Fill` of its layers."""
        names = [by_hf[f"model.layers.{i}.{hf_stem}"] for i in range(shape[0])]
        layer_types = [g.tensors[n].type_name for n in names]
        types = set(layer_types)
        (t,) = types if len(types) == 1 else (None,)
        kept = keep_quantized and len(shape) == 3
        if kept and types <= set(ROW_FORMATS) and (t is None or t in KQUANT_FORMATS):
            return kept_bytes(path_, names, layer_types, shape)
        if kept and t in BLOCK_BYTES and stream:
            return kept_blocks(names, t, shape)
        if kept and t in KEEP_QUANTIZED:

            def whole() -> Any:
                raw = np.stack([_rows(g, n) for n in names])  # (L, rows, row_bytes)
                for n in names:
                    release(g.raw(n))
                stem = names[0].split(".")[-2]
                if permute and stem in perm_heads:
                    raw = unpermute_qk(raw, perm_heads[stem])
                return from_ggml(raw.reshape(-1), t, shape)

            return _at_once(whole)
        if stream and (quantize is None or quantize(path_, shape) is None):
            return copied(path_, names, shape)
        if stream:  # layer by layer: llama.cpp's mixes (Q4_K_M) differ in row bytes
            layers = [reader(n, shape[1:]) for n in names]
            return _at_once(
                lambda: stream_layers(
                    [StackedLeaf(path_, shape, final, layers, quantize)]
                )[0]
            )
        return _at_once(
            lambda: jnp.asarray(
                np.stack([one(n, shape[1:]) for n in names]), dtype=dtype
            )
        )

    split = split_names(config)

    def halves(path_: str, hf_stem: str, shape: tuple[int, ...]) -> Fill:
        """A leaf stored as two tensors of row halves (`SPLIT_STEMS`), by layer.

        Each layer's ``[a; b]`` is dequantized (a kept type too) and joined.
        """
        half = (shape[1] // 2, *shape[2:])

        def joined(a: str, b: str) -> Reader:
            def read() -> Any:
                rows = np.concatenate([one(a, half), one(b, half)])  # (2 S, D)
                return rows if final == np.float32 else jnp.asarray(rows, dtype)

            return read

        pairs = [split[f"model.layers.{i}.{hf_stem}"] for i in range(shape[0])]
        layers = [joined(a, b) for a, b in pairs]
        if stream and (quantize is None or quantize(path_, shape) is None):
            return copied(path_, [], shape, layers)
        if stream:
            return _at_once(
                lambda: stream_layers(
                    [StackedLeaf(path_, shape, final, layers, quantize)]
                )[0]
            )
        return _at_once(
            lambda: jnp.asarray(np.stack([r() for r in layers]), dtype=dtype)
        )

    fills: list[tuple[dict[str, Any], str, Fill]] = []  # the stacked leaves
    aside: list[tuple[dict[str, Any], str, concurrent.futures.Future[Any]]] = []

    def on_the_side(
        out: dict[str, Any], k: str, make: Callable[..., Any], *args: Any
    ) -> None:
        """``out[k] = make(*args)`` on a second thread while this one reads layers.

        For a table kept as stored (an embedding, ``lm_head``): its bytes come
        first in the file, where the read ahead has passed.
        """
        out[k] = None  # its place in the tree
        aside.append((out, k, _ahead().submit(make, *args)))

    def build(tree: dict[str, Any], prefix: str) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for k, v in tree.items():
            path_ = f"{prefix}{k}"
            if isinstance(v, dict):
                out[k] = build(v, f"{path_}.")
            elif prefix.startswith("model.layers."):
                # filled below, a layer at a time, every leaf's layer i before
                # layer i + 1: the file's order, so it is read front to back
                out[k] = None  # its place in the tree
                stem = path_.removeprefix("model.layers.")
                split_leaf = stem.rpartition(".")[0] in SPLIT_STEMS  # two halves
                leaf = (halves if split_leaf else stacked)(path_, stem, tuple(v))
                fills.append((out, k, leaf))
            elif (
                keep_quantized and len(v) == 2 and _type(by_hf[path_]) in KQUANT_FORMATS
            ):
                # embeddings, lm_head: looked up / multiplied from their rows
                on_the_side(out, k, kept_table, path_, by_hf[path_], tuple(v))
            elif keep_quantized and len(v) == 2 and _type(by_hf[path_]) in BLOCK_BYTES:
                # a Q8_0/Q4_0/Q4_1 embedding or lm_head: as the projections
                gname, kind = by_hf[path_], _type(by_hf[path_])
                if stream:
                    on_the_side(out, k, kept_matrix, gname, kind, tuple(v))
                else:
                    out[k] = from_ggml(g.raw(gname), kind, tuple(v))
            elif (
                stream
                and final == np.float32
                and len(v) == 2
                and (quantize is None or quantize(path_, tuple(v)) is None)
            ):  # a float32 matrix kept as it is (an embedding)
                out[k] = matrix(path_, by_hf[path_], tuple(v))
            elif stream:
                read = rows(by_hf[path_], tuple(v))
                write = fill(by_hf[path_])
                make = functools.partial(
                    stream_one, path_, tuple(v), final, read, quantize, fill=write
                )
                if len(v) == 1:  # a vector (the final norm): after the layers
                    after_layers(out, k, make)
                else:  # a matrix, where the file has it: the read ahead passes it
                    out[k] = make()
            else:
                out[k] = jnp.asarray(one(by_hf[path_], tuple(v)), dtype=dtype)
        return out

    last: list[tuple[dict[str, Any], str, Callable[[], Any]]] = []

    def after_layers(out: dict[str, Any], k: str, make: Callable[[], Any]) -> None:
        """``out[k] = make()`` once the layers are read.

        A small unstacked leaf read into JAX (the final norm) would wait for JAX's
        client, which starts beside the header's parse and takes 10-25 ms in a new
        process: the layers, read into host buffers, go first. A matrix (an
        embedding, ``lm_head``) stays where the file has it: read after the layers,
        its bytes would hold the read ahead's lead (it counts what the load has not
        released) and wait in the page cache.
        """
        out[k] = None  # its place in the tree
        last.append((out, k, make))

    fd = os.open(g.path, os.O_RDONLY)  # the tensors kept as stored are read from it
    try:
        params = build(config.param_shapes(), "")
        leaves = by_layer([f for *_, f in fills])
        for (out, k, _), value in zip(fills, leaves, strict=True):
            out[k] = value
        for out, k, make in last:
            out[k] = make()
        for out, k, job in aside:
            out[k] = job.result()
    finally:  # the work on the side ends with the load
        concurrent.futures.wait([job for *_, job in aside])  # before fd closes
        os.close(fd)
    if not stream:
        params = quantize_leaves(params, quantize)
    trim_heap()
    tokenizer = {k: f for k, f in g.fields.items() if k.startswith("tokenizer.")}
    info = GGUFMetadata(tokenizer)  # the vocabulary decoded when it is read
    return config, params, info


def load_tokenizer(path: str | os.PathLike[str] | GGUFFile) -> BPETokenizer:
    """The `BPETokenizer` of a GGUF file (from its ``tokenizer.ggml.*`` fields)."""
    g = path if isinstance(path, GGUFFile) else read_gguf(path)
    return BPETokenizer.from_gguf_metadata(g.metadata, g.path)


__all__ = [
    "KEEP_QUANTIZED",
    "llama_config_from_gguf",
    "load_llama_gguf",
    "load_tokenizer",
    "permute_qk",
    "read_llama_header",
    "unpermute_qk",
    "unpermuted_rows",
]
