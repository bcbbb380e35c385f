"""The family switches of `LlamaConfig`: their checks and their ``config.json`` form.

Every decoder family (Llama, Mistral, Qwen2, Qwen3, Gemma 2/3, Phi-3) is a
`LlamaConfig` whose switches say how it differs from Llama (specs/models.md). This
module checks the switches (`check_switches`) and converts the fields all families
share to and from Hugging Face ``config.json`` dicts, in both of its styles: the old
``rope_theta`` / ``rope_scaling`` and transformers 5's ``rope_parameters``. A family
module reads its own fields on top (`entrenar.nn.qwen`, `entrenar.nn.gemma`, ...).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from entrenar.errors import ConfigError, FormatError, UnsupportedError
from entrenar.nn.registry import Architecture, register_architecture
from entrenar.nn.rope_scaling import yarn_mscale

ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")
"""Rotary scalings `LlamaConfig.rope_type` accepts (Hugging Face's names)."""

LAYER_TYPES = ("full_attention", "sliding_attention")
"""Values of `LlamaConfig.layer_types` (Hugging Face's own)."""

HIDDEN_ACTS = ("silu", "gelu_pytorch_tanh", "relu2")
"""MLP activations: SwiGLU and GeGLU (tanh GELU) gates, the squared ReLU (Arcee)."""

_TUPLES = (
    "rope_short_factor",
    "rope_long_factor",
    "rope_freq_divisors",
    "layer_types",
    "nope_layers",
)


def as_float(value: Any) -> float:
    """``float(value)``, NaN for what is not a number (a string, None, a bool)."""
    if isinstance(value, (bool, str)) or value is None:
        return math.nan
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


def check_switches(c: Any) -> None:
    """Raise `ConfigError` for family switches of ``c`` that do not fit together."""
    for name in _TUPLES:  # lists from Python or JSON become tuples: hashable
        value = getattr(c, name)
        if value is not None and not isinstance(value, tuple):
            object.__setattr__(c, name, tuple(value))
    factor = c.partial_rotary_factor
    if not 0 < as_float(factor) <= 1:
        raise ConfigError(
            f"LlamaConfig.partial_rotary_factor must be in (0, 1], got {factor!r}"
        )
    if c.rotary_dim < 2 or c.rotary_dim % 2:
        raise ConfigError(
            f"LlamaConfig.partial_rotary_factor {factor} rotates int({c.hd} x "
            f"{factor}) = {c.rotary_dim} values of each head; rotary needs an even "
            "number >= 2 (pairs)"
        )
    half = c.rotary_dim // 2
    if c.rope_type not in ROPE_TYPES:
        raise ConfigError(
            f"LlamaConfig.rope_type must be one of {ROPE_TYPES}, got {c.rope_type!r}"
        )
    if not c.rope_factor > 0:
        raise ConfigError(f"LlamaConfig.rope_factor must be > 0, got {c.rope_factor}")
    needs_original = c.rope_type in ("llama3", "yarn", "longrope")
    if needs_original and not c.rope_original_max_position_embeddings:
        raise ConfigError(
            f"LlamaConfig.rope_type {c.rope_type!r} needs "
            "rope_original_max_position_embeddings (the pre-training context)"
        )
    if c.rope_type == "llama3" and c.rope_high_freq_factor <= c.rope_low_freq_factor:
        raise ConfigError(
            "LlamaConfig.rope_high_freq_factor must exceed rope_low_freq_factor"
        )
    for name in ("rope_short_factor", "rope_long_factor", "rope_freq_divisors"):
        value = getattr(c, name)
        if value is not None and (len(value) != half or min(value) <= 0):
            raise ConfigError(
                f"LlamaConfig.{name} must hold rotary_dim / 2 = {half} positive "
                f"numbers (rotary_dim = head_dim x partial_rotary_factor), got "
                f"{value!r}"
            )
    if c.rope_type == "longrope" and (
        c.rope_short_factor is None or c.rope_long_factor is None
    ):
        raise ConfigError(
            "LlamaConfig.rope_type 'longrope' needs rope_short_factor and "
            "rope_long_factor"
        )
    if c.rope_freq_divisors is not None and c.rope_type != "default":
        raise ConfigError(
            "LlamaConfig.rope_freq_divisors are the scaling themselves: use them "
            f"with rope_type 'default', not {c.rope_type!r}"
        )
    if c.sliding_window is not None and c.sliding_window <= 0:
        raise ConfigError(
            f"LlamaConfig.sliding_window must be positive, got {c.sliding_window}"
        )
    if c.layer_types is not None:
        if len(c.layer_types) != c.num_layers:
            raise ConfigError(
                f"LlamaConfig.layer_types has {len(c.layer_types)} entries for "
                f"{c.num_layers} layers"
            )
        bad = sorted(set(c.layer_types) - set(LAYER_TYPES))
        if bad:
            raise ConfigError(
                f"LlamaConfig.layer_types holds {bad}; each is one of {LAYER_TYPES}"
            )
        if "sliding_attention" in c.layer_types and c.sliding_window is None:
            raise ConfigError(
                "LlamaConfig.layer_types has sliding layers but sliding_window is None"
            )
    if c.nope_layers is not None and (
        len(c.nope_layers) != c.num_layers
        or not all(isinstance(b, bool) for b in c.nope_layers)
    ):
        raise ConfigError(
            f"LlamaConfig.nope_layers must be {c.num_layers} booleans (one per "
            f"layer), got {c.nope_layers!r}"
        )
    if c.attention_multiplier is not None and c.query_pre_attn_scalar is not None:
        raise ConfigError(
            "LlamaConfig.attention_multiplier and query_pre_attn_scalar both set the "
            "attention scale: set one"
        )
    if c.query_scale_beta is not None and not (
        as_float(c.query_scale_beta) > 0
        and isinstance(c.query_scale_length, int)
        and c.query_scale_length > 0
    ):
        raise ConfigError(
            "LlamaConfig.query_scale_beta must be > 0 with a positive int "
            f"query_scale_length, got {c.query_scale_beta!r} and "
            f"{c.query_scale_length!r}"
        )
    if c.qk_norm_whole and not c.qk_norm:
        raise ConfigError("LlamaConfig.qk_norm_whole needs qk_norm=True")
    if c.qk_norm_heads and (not c.qk_norm or c.qk_norm_whole):
        raise ConfigError(
            "LlamaConfig.qk_norm_heads (a gain per head) needs qk_norm=True and "
            "qk_norm_whole=False"
        )
    if c.parallel_residual and (c.post_norms or c.sandwich_norms):
        raise ConfigError(
            "LlamaConfig.parallel_residual (Cohere: one norm before attention and "
            "the MLP) excludes post_norms and sandwich_norms"
        )
    if c.clip_qkv is not None and not as_float(c.clip_qkv) > 0:
        raise ConfigError(
            f"LlamaConfig.clip_qkv must be > 0 or None, got {c.clip_qkv!r}"
        )
    if c.post_norms + c.sandwich_norms + c.glm_norms > 1:
        raise ConfigError(
            "LlamaConfig.post_norms (OLMo 2), sandwich_norms (Gemma 2/3) and "
            "glm_norms (GLM-4) exclude each other: set one"
        )
    if c.ungated_mlp and (
        c.fused_gate_up or c.num_experts or c.shared_mlp_intermediate_size
    ):
        raise ConfigError(
            "LlamaConfig.ungated_mlp (Arcee's up/down MLP) is for dense layers "
            "without a fused gate_up_proj: unset fused_gate_up, num_experts and "
            "shared_mlp_intermediate_size"
        )
    if c.hidden_act not in HIDDEN_ACTS:
        raise ConfigError(
            f"LlamaConfig.hidden_act must be one of {HIDDEN_ACTS}, got {c.hidden_act!r}"
        )
    for name in (
        "query_pre_attn_scalar",
        "attn_logit_softcapping",
        "final_logit_softcapping",
        "rope_local_theta",
        "rope_attention_factor",
        "embedding_multiplier",
        "residual_multiplier",
        "attention_multiplier",
        "logits_scaling",
        "logit_scale",
    ):
        value = getattr(c, name)
        if value is not None and not value > 0:
            raise ConfigError(f"LlamaConfig.{name} must be > 0 or None, got {value}")


def sliding_layers(c: Any) -> tuple[bool, ...]:
    """Per layer, whether it attends through the sliding window."""
    if c.sliding_window is None:
        return (False,) * c.num_layers
    if c.layer_types is None:
        return (True,) * c.num_layers
    return tuple(t == "sliding_attention" for t in c.layer_types)


def sliding_from_hf(
    hf: Mapping[str, Any],
    source: str,
    default_types: Sequence[str] | None = None,
    default_window: int | None = None,
) -> tuple[int | None, tuple[str, ...] | None]:
    """``(sliding_window, layer_types)`` of a ``config.json``; None, None: no slide.

    The families with sliding layers (Gemma 2/3, OLMo 3, SmolLM3) read them here.
    ``layer_types`` are the file's, else ``default_types`` (the family's layout);
    ``sliding_window`` the file's, else ``default_window`` (a ``null`` in the file
    stays null).

    Raises:
        UnsupportedError: sliding layers and a ``null`` window (transformers'
            sliding mask raises for them at the first forward pass).
    """
    types = hf.get("layer_types") or default_types
    window = hf.get("sliding_window", default_window)
    if not types or "sliding_attention" not in types:
        return None, None
    if window is None:
        raise UnsupportedError(
            f"{source}: {hf.get('model_type')}'s layer_types have sliding layers but "
            "sliding_window is null; set the window (or make those layers "
            "full_attention)"
        )
    return int(window), tuple(types)


# ------------------------------------------------------------ config.json <-> fields
ROPE_KEYS = {
    "factor": "rope_factor",
    "low_freq_factor": "rope_low_freq_factor",
    "high_freq_factor": "rope_high_freq_factor",
    "original_max_position_embeddings": "rope_original_max_position_embeddings",
    "beta_fast": "rope_beta_fast",
    "beta_slow": "rope_beta_slow",
    "attention_factor": "rope_attention_factor",
    "short_factor": "rope_short_factor",
    "long_factor": "rope_long_factor",
}
"""A ``rope_scaling`` dict's keys -> the `LlamaConfig` fields of the rope type's
parameters."""


def rope_from_hf(scaling: Mapping[str, Any], source: str) -> dict[str, Any]:
    """`LlamaConfig` rope fields from a ``rope_scaling`` / ``rope_parameters`` dict.

    Raises:
        FormatError: ``scaling`` is not a JSON object.
        UnsupportedError: a rope type or option entrenar does not implement.
    """
    if not isinstance(scaling, Mapping):
        raise FormatError(
            f"{source}: rope_scaling = {str(scaling)[:40]!r} is not an object"
        )
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    kind = "longrope" if kind == "su" else kind
    if kind not in ROPE_TYPES:
        raise UnsupportedError(
            f"{source}: rope_scaling.rope_type {kind!r} is not supported; entrenar "
            f"implements {ROPE_TYPES}"
        )
    truncate = scaling.get("truncate", True)
    if not isinstance(truncate, bool):
        raise FormatError(
            f"{source}: rope_scaling.truncate = {truncate!r} is not true or false"
        )
    out: dict[str, Any] = {"rope_type": kind}
    partial = scaling.get("partial_rotary_factor")
    if partial is not None:
        out["partial_rotary_factor"] = partial_factor(partial, source)
    if kind == "default":
        return out
    if kind == "yarn" and not truncate:  # gpt-oss: fractional correction range
        out["rope_truncate"] = False
    for key, field in ROPE_KEYS.items():
        value = scaling.get(key)
        if value is None:
            continue
        if isinstance(value, (list, tuple)):
            out[field] = tuple(float(v) for v in value)
        elif field == "rope_original_max_position_embeddings":
            out[field] = int(value)
        else:
            out[field] = float(value)
    mscale, mscale_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if kind == "yarn" and "rope_attention_factor" not in out and mscale and mscale_all:
        # transformers' _compute_yarn_parameters (one of the two alone: ignored)
        factor = out.get("rope_factor", 1.0)
        out["rope_attention_factor"] = yarn_mscale(factor, float(mscale)) / yarn_mscale(
            factor, float(mscale_all)
        )
    return out


def partial_factor(value: Any, source: str) -> float:
    """A ``partial_rotary_factor`` from a ``config.json``, as a float.

    Raises:
        FormatError: not a number in (0, 1].
    """
    factor = as_float(value)
    if not 0 < factor <= 1:
        raise FormatError(
            f"{source}: partial_rotary_factor = {str(value)[:40]!r}, want a number "
            "in (0, 1] (the share of each head that rotary embeddings turn)"
        )
    return factor


def rope_to_hf(c: Any) -> dict[str, Any] | None:
    """The ``rope_scaling`` dict of ``c`` (None without scaling).

    Raises:
        UnsupportedError: explicit ``rope_freq_divisors`` (no Hugging Face form).
    """
    if c.rope_freq_divisors is not None:
        raise UnsupportedError(
            "LlamaConfig.rope_freq_divisors (llama.cpp's rope_freqs) have no "
            "Hugging Face config.json form; set rope_type and its factors instead"
        )
    if c.rope_type == "default":
        return None
    out: dict[str, Any] = {"rope_type": c.rope_type, "factor": c.rope_factor}
    if c.rope_type == "llama3":
        out["low_freq_factor"] = c.rope_low_freq_factor
        out["high_freq_factor"] = c.rope_high_freq_factor
    if c.rope_type == "yarn":
        out["beta_fast"] = c.rope_beta_fast
        out["beta_slow"] = c.rope_beta_slow
        if not c.rope_truncate:
            out["truncate"] = False
    if c.rope_type == "longrope":
        out["short_factor"] = list(c.rope_short_factor)
        out["long_factor"] = list(c.rope_long_factor)
    if c.rope_original_max_position_embeddings is not None:
        out["original_max_position_embeddings"] = (
            c.rope_original_max_position_embeddings
        )
    if c.rope_attention_factor is not None:
        out["attention_factor"] = c.rope_attention_factor
    return out


def common_from_hf(
    hf: Mapping[str, Any],
    source: str,
    default_theta: float = 10000.0,
    act: str = "silu",
    partial_rotary: bool = False,
) -> dict[str, Any]:
    """The fields every decoder family shares, from a ``config.json`` dict.

    Checks that the activation is the family's ``act`` (`check_hidden_act`); reads
    ``rope_theta`` and ``rope_scaling`` (old style) or ``rope_parameters``
    (transformers 5). A family with per-layer ``rope_parameters`` (Gemma 3) reads
    its rope fields itself. ``partial_rotary_factor`` is read from the rope dict,
    else from the top level (transformers' order); ``partial_rotary``: the family's
    transformers model rotates part of a head (Phi-3), else a factor below 1 is
    refused.

    Raises:
        UnsupportedError: a partial rotary factor the family cannot follow.
    """
    check_hidden_act(hf, source, act)
    heads = int(hf["num_attention_heads"])
    rope = hf.get("rope_parameters") or {}
    if not isinstance(rope, Mapping):
        raise FormatError(
            f"{source}: rope_parameters = {str(rope)[:40]!r} is not an object"
        )
    layered = any(t in rope for t in LAYER_TYPES)
    scaling = {} if layered else (hf.get("rope_scaling") or rope)
    theta = hf.get("rope_theta", None if layered else rope.get("rope_theta"))
    fields: dict[str, Any] = dict(
        vocab_size=int(hf["vocab_size"]),
        hidden_size=int(hf["hidden_size"]),
        intermediate_size=int(hf["intermediate_size"]),
        num_layers=int(hf["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(hf.get("num_key_value_heads") or heads),
        head_dim=hf.get("head_dim"),
        rope_theta=float(default_theta if theta is None else theta),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
        initializer_range=float(hf.get("initializer_range", 0.02)),
    )
    rope = rope_from_hf(scaling, source)
    if (
        "partial_rotary_factor" not in rope
        and hf.get("partial_rotary_factor") is not None
    ):
        factor = partial_factor(hf["partial_rotary_factor"], source)
        rope["partial_rotary_factor"] = factor
    if rope.get("partial_rotary_factor", 1.0) == 1.0:
        rope.pop("partial_rotary_factor", None)
    elif not partial_rotary:
        raise UnsupportedError(
            f"{source}: partial_rotary_factor {rope['partial_rotary_factor']} is not "
            f"supported for {hf.get('model_type')}: transformers' model rotates "
            "whole heads (entrenar rotates part of a head for phi3)"
        )
    old = rope.get("rope_original_max_position_embeddings")
    if rope["rope_type"] == "longrope" and "rope_factor" not in rope and old:
        # transformers' factor when the file gives none (Phi-3-mini-128k and
        # Phi-3.5-mini write only the two contexts): their ratio, which sets the
        # attention factor sqrt(1 + ln(factor) / ln(old))
        rope["rope_factor"] = fields["max_position_embeddings"] / old
    fields.update(rope)
    return fields


def rope_by_layer_type(
    hf: Mapping[str, Any], source: str, theta: float
) -> tuple[dict[str, Any], float | None] | None:
    """Transformers 5's per-layer-type ``rope_parameters`` (Gemma 3, OLMo 3).

    Returns the global layers' rope fields (with ``rope_theta``, default
    ``theta``) and the sliding layers' base (None when not given); None when
    ``rope_parameters`` is not split by layer type.

    Raises:
        FormatError: ``sliding_attention`` is not an object.
        UnsupportedError: rope scaling on the sliding layers.
    """
    params = hf.get("rope_parameters") or {}
    if not isinstance(params, Mapping) or not any(t in params for t in LAYER_TYPES):
        return None
    full = params.get("full_attention") or {}
    slide = params.get("sliding_attention") or {}
    if not isinstance(slide, Mapping):
        raise FormatError(
            f"{source}: rope_parameters.sliding_attention = {str(slide)[:40]!r} is "
            "not an object"
        )
    if slide.get("rope_type", "default") != "default":
        raise UnsupportedError(
            f"{source}: rope_parameters.sliding_attention.rope_type "
            f"{slide['rope_type']!r} is not supported (no scaling on local layers)"
        )
    fields = rope_from_hf(full, source)
    for key, part in (("full_attention", full), ("sliding_attention", slide)):
        if part.get("partial_rotary_factor") not in (None, 1, 1.0):
            raise UnsupportedError(
                f"{source}: rope_parameters.{key}.partial_rotary_factor "
                f"{part['partial_rotary_factor']} is not supported (these families "
                "rotate whole heads)"
            )
    fields.pop("partial_rotary_factor", None)
    fields["rope_theta"] = float(full.get("rope_theta", theta))
    local = slide.get("rope_theta")
    return fields, None if local is None else float(local)


def common_to_hf(
    c: Any,
    hf_class: str,
    model_type: str,
    allowed: tuple[str, ...],
    split_bias: bool = False,
) -> dict[str, Any]:
    """The ``config.json`` entries every decoder family shares.

    ``allowed``: the switches the family's file holds (`refuse_switches`). A family
    that allows ``attention_out_bias`` has one ``attention_bias`` entry for q, k, v
    and o_proj, written here; ``split_bias``: two entries, ``attention_bias`` (q, k,
    v) and ``attention_out_bias`` (o_proj: Seed-OSS).

    Raises:
        UnsupportedError: a switch off its default that the file cannot hold.
    """
    family = hf_class.removesuffix("ForCausalLM")
    refuse_switches(c, family, allowed)
    hf: dict[str, Any] = {
        "architectures": [hf_class],
        "model_type": model_type,
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads,
        "head_dim": c.hd,
        "hidden_act": c.hidden_act,
        "rope_theta": c.rope_theta,
        "rope_scaling": rope_to_hf(c),
        "rms_norm_eps": c.rms_norm_eps,
        "tie_word_embeddings": c.tie_word_embeddings,
        "max_position_embeddings": c.max_position_embeddings,
        "initializer_range": c.initializer_range,
    }
    if split_bias:
        hf["attention_bias"] = c.attention_bias
        hf["attention_out_bias"] = c.attention_out_bias
    elif "attention_out_bias" in allowed:
        if c.attention_bias != c.attention_out_bias:
            raise UnsupportedError(
                f"{family}'s config.json has one attention_bias for q, k, v and "
                "o_proj; LlamaConfig.attention_bias and attention_out_bias must be "
                "equal"
            )
        hf["attention_bias"] = c.attention_bias
    if c.partial_rotary_factor != 1.0:  # refuse_switches: the family allows it
        hf["partial_rotary_factor"] = c.partial_rotary_factor
    return hf


def check_hidden_act(hf: Mapping[str, Any], source: str, want: str) -> None:
    """Raise `UnsupportedError` unless the config's activation is ``want``."""
    key = "hidden_activation" if "hidden_activation" in hf else "hidden_act"
    act = hf.get(key) or want
    if act != want:
        raise UnsupportedError(
            f"{source}: {key} {act!r} is not supported for {hf.get('model_type')}; "
            f"entrenar implements {want!r}"
        )


def refuse_switches(c: Any, family: str, allowed: tuple[str, ...]) -> None:
    """Raise `UnsupportedError` for a switch ``family``'s ``config.json`` cannot hold.

    Every field of `SWITCHES` not in ``allowed`` must be at its default.
    """
    defaults = {f.name: f.default for f in dataclasses.fields(c)}
    for name in SWITCHES:
        if name not in allowed and getattr(c, name) != defaults[name]:
            raise UnsupportedError(
                f"LlamaConfig.{name}={getattr(c, name)!r} has no {family} "
                f"config.json form; {family} sets {sorted(allowed)}"
            )


TINY_SIZES: dict[str, Any] = {
    "vocab_size": 96,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_layers": 2,
    "num_heads": 4,
    "num_kv_heads": 2,
    "head_dim": 16,
}
"""The sizes of the families' tiny conformance configs (`Architecture.tiny`)."""


def register_family(
    config_class: type,
    name: str,
    summary: str,
    *,
    hf_class: str,
    from_hf: Callable[[Mapping[str, Any]], Any],
    to_hf: Callable[[Any], dict[str, Any]],
    tiny: Callable[[], Any],
    model_type: str | None = None,
    in_gguf: bool = True,
    gguf_name: str | None = None,
    defaults: Mapping[str, Any] | None = None,
    from_hf_tensors: Callable[[Mapping[str, Any], Any], dict[str, Any]] | None = None,
    to_hf_tensors: Callable[[Mapping[str, Any], Any], dict[str, Any]] | None = None,
) -> Architecture:
    """Register the decoder family ``name`` (a ``config_class`` with its switches).

    Its Hugging Face ``model_type`` and GGUF name are ``name`` unless ``model_type``
    says otherwise or ``in_gguf`` is False (llama.cpp writes it as another
    family); ``gguf_name``: llama.cpp's name when it is not ``name``
    (``qwen3moe``). `Architecture.make_config` sets ``architecture=name`` and
    ``defaults``. ``from_hf_tensors`` / ``to_hf_tensors``: the family's checkpoint
    names when they are not its tree's (`Architecture`).
    """
    return register_architecture(
        Architecture(
            name=name,
            config_class=config_class,
            summary=summary,
            hf_model_types=(model_type or name,),
            hf_class=hf_class,
            gguf_name=(gguf_name or name) if in_gguf else None,
            from_hf=from_hf,
            to_hf=to_hf,
            defaults={"architecture": name, **(defaults or {})},
            tiny=tiny,
            from_hf_tensors=from_hf_tensors,
            to_hf_tensors=to_hf_tensors,
        )
    )


SWITCHES = (
    "rope_type",
    "partial_rotary_factor",
    "rope_interleave",
    "rope_local_theta",
    "attention_bias",
    "attention_out_bias",
    "mlp_bias",
    "qk_norm",
    "qk_norm_whole",
    "clip_qkv",
    "sliding_window",
    "layer_types",
    "nope_layers",
    "hidden_act",
    "norm_unit_offset",
    "sandwich_norms",
    "post_norms",
    "glm_norms",
    "scale_embeddings",
    "query_pre_attn_scalar",
    "attn_logit_softcapping",
    "final_logit_softcapping",
    "embedding_multiplier",
    "residual_multiplier",
    "attention_multiplier",
    "logits_scaling",
    "fused_qkv",
    "fused_gate_up",
    "num_experts",
    "shared_expert_intermediate_size",
    "shared_mlp_intermediate_size",
    "router_jitter_noise",
    "moe_bias",
    "swiglu_limit",
    "attention_sinks",
    "query_scale_beta",
    "layer_norm",
    "parallel_residual",
    "qk_norm_heads",
    "logit_scale",
    "ungated_mlp",
)
"""`LlamaConfig` fields that make a family differ from Llama."""


__all__ = [
    "HIDDEN_ACTS",
    "LAYER_TYPES",
    "ROPE_KEYS",
    "ROPE_TYPES",
    "SWITCHES",
    "TINY_SIZES",
    "check_hidden_act",
    "check_switches",
    "common_from_hf",
    "common_to_hf",
    "partial_factor",
    "refuse_switches",
    "register_family",
    "rope_by_layer_type",
    "rope_from_hf",
    "rope_to_hf",
    "sliding_from_hf",
    "sliding_layers",
]
