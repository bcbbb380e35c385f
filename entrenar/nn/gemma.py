"""Gemma 1, 2 and 3 (text): Llama with Gemma's norms, GeGLU and local layers.

Gemma Team, "Gemma: Open Models Based on Gemini Research and Technology", 2024;
"Gemma 2: Improving Open Language Models at a Practical Size", 2024; "Gemma 3
Technical Report", 2025. All are `LlamaConfig` families. Gemma 1 (and CodeGemma) is
Llama with the first three points below (Llama's two norms a layer, scores scaled by
``d^-1/2``, ``head_dim`` 256 whatever ``D / H``, one KV head on 2B); Gemma 2 and 3
add the rest:

- embeddings scaled by ``sqrt(D)`` (rounded to the compute dtype);
- RMSNorm gains ``1 + w``; four norms a layer: ``input_layernorm`` before and
  ``post_attention_layernorm`` after attention, ``pre_feedforward_layernorm``
  before and ``post_feedforward_layernorm`` after the MLP, each output added to
  the residual stream;
- GeGLU with the tanh GELU (Gemma 1's ``hidden_act: gelu`` means it too, as
  transformers reads it); scores scaled by ``query_pre_attn_scalar^-1/2``;
- sliding-window and global layers alternating (``layer_types``);
- Gemma 2: attention scores and final logits soft-capped, ``c tanh(x / c)``;
- Gemma 3: per-head q/k norms, the sliding layers' own rotary base
  (``rope_local_base_freq``) and rope scaling on the global layers only.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from entrenar.errors import UnsupportedError
from entrenar.nn.decoder_config import (
    TINY_SIZES,
    common_from_hf,
    common_to_hf,
    register_family,
    rope_by_layer_type,
    sliding_from_hf,
)
from entrenar.nn.llama import LlamaConfig

_GELU = "gelu_pytorch_tanh"
_GEMMA = {
    "hidden_act": _GELU,
    "norm_unit_offset": True,
    "sandwich_norms": True,
    "scale_embeddings": True,
    "tie_word_embeddings": True,
}
_SWITCHES = (
    "rope_type",
    "attention_bias",
    "attention_out_bias",
    "sliding_window",
    "layer_types",
    "query_pre_attn_scalar",
    "attn_logit_softcapping",
    "final_logit_softcapping",
    *(k for k in _GEMMA if k != "tie_word_embeddings"),
)


def _gemma_fields(hf: Mapping[str, Any], pattern: int) -> dict[str, Any]:
    """The fields Gemma 2 and 3 read alike; ``pattern``: every n-th layer global."""
    if hf.get("use_bidirectional_attention"):
        raise UnsupportedError(
            "config.json: use_bidirectional_attention is not supported (causal "
            "attention only)"
        )
    n = int(hf["num_hidden_layers"])
    pattern = int(hf.get("sliding_window_pattern", pattern))
    layout = [
        "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n)
    ]
    window, types = sliding_from_hf(hf, "config.json", layout, 4096)
    bias = bool(hf.get("attention_bias", False))
    caps = ("attn_logit_softcapping", "final_logit_softcapping")
    return {
        **_GEMMA,
        "tie_word_embeddings": bool(hf.get("tie_word_embeddings", True)),
        "head_dim": int(hf.get("head_dim") or 256),
        "attention_bias": bias,
        "attention_out_bias": bias,
        "query_pre_attn_scalar": float(hf.get("query_pre_attn_scalar") or 256),
        "sliding_window": window,
        "layer_types": types,
        **{k: None if hf.get(k) is None else float(hf[k]) for k in caps},
    }


def _gemma_to_hf(c: LlamaConfig, hf_class: str, model_type: str) -> dict[str, Any]:
    for name, want in _GEMMA.items():
        if name != "tie_word_embeddings" and getattr(c, name) != want:
            raise UnsupportedError(
                f"LlamaConfig.{name} must be {want!r} in a Gemma config"
            )
    gemma3 = ("qk_norm", "rope_local_theta") if model_type != "gemma2" else ()
    hf = common_to_hf(c, hf_class, model_type, (*_SWITCHES, *gemma3))
    hf["hidden_activation"] = hf.pop("hidden_act")
    hf.update(
        query_pre_attn_scalar=_number(c.query_pre_attn_scalar or c.hd),
        sliding_window=c.sliding_window,
        layer_types=None if c.layer_types is None else list(c.layer_types),
        attn_logit_softcapping=c.attn_logit_softcapping,
        final_logit_softcapping=c.final_logit_softcapping,
    )
    return hf


def _number(x: float) -> float | int:
    """``x`` as an int when whole (transformers types the scalar ``int``)."""
    return int(x) if float(x).is_integer() else x


_GEMMA1: dict[str, Any] = {k: v for k, v in _GEMMA.items() if k != "sandwich_norms"}
_GEMMA1_SWITCHES = (
    "rope_type",
    "attention_bias",
    "attention_out_bias",
    *(k for k in _GEMMA1 if k != "tie_word_embeddings"),
)


def gemma_from_hf(hf: Mapping[str, Any]) -> LlamaConfig:
    """A ``model_type: gemma`` ``config.json`` (Gemma 1, CodeGemma) as a `LlamaConfig`.

    ``hidden_act: gelu`` (the official files' legacy value) is the tanh GELU, as
    transformers reads it; a missing ``head_dim`` is Gemma's 256.
    """
    hf = dict(hf)
    for key in ("hidden_act", "hidden_activation"):
        if hf.get(key) == "gelu":
            hf[key] = _GELU
    if hf.get("use_bidirectional_attention"):
        raise UnsupportedError(
            "config.json: use_bidirectional_attention is not supported (causal "
            "attention only)"
        )
    bias = bool(hf.get("attention_bias", False))
    fields = common_from_hf(hf, "config.json", act=_GELU)
    return LlamaConfig(
        **{
            **fields,
            **_GEMMA1,
            "tie_word_embeddings": bool(hf.get("tie_word_embeddings", True)),
            "head_dim": int(hf.get("head_dim") or 256),
            "attention_bias": bias,
            "attention_out_bias": bias,
        },
        architecture="gemma",
    )


def gemma_to_hf(c: LlamaConfig) -> dict[str, Any]:
    """The ``config.json`` of a Gemma 1 `LlamaConfig`."""
    for name, want in _GEMMA1.items():
        if name != "tie_word_embeddings" and getattr(c, name) != want:
            raise UnsupportedError(
                f"LlamaConfig.{name} must be {want!r} in a Gemma config"
            )
    return common_to_hf(c, "GemmaForCausalLM", "gemma", _GEMMA1_SWITCHES)


def gemma2_from_hf(hf: Mapping[str, Any]) -> LlamaConfig:
    """A ``model_type: gemma2`` ``config.json`` as a `LlamaConfig`."""
    fields = {**common_from_hf(hf, "config.json", act=_GELU), **_gemma_fields(hf, 2)}
    return LlamaConfig(**fields, architecture="gemma2")


def gemma2_to_hf(c: LlamaConfig) -> dict[str, Any]:
    """The ``config.json`` of a Gemma 2 `LlamaConfig`."""
    return _gemma_to_hf(c, "Gemma2ForCausalLM", "gemma2")


def gemma3_from_hf(hf: Mapping[str, Any]) -> LlamaConfig:
    """A ``model_type: gemma3_text`` ``config.json`` as a `LlamaConfig`.

    Reads the global layers' ``rope_theta`` and ``rope_scaling`` and the sliding
    layers' ``rope_local_base_freq``, or transformers 5's per-layer-type
    ``rope_parameters``.
    """
    fields = {
        **common_from_hf(hf, "config.json", 1_000_000.0, _GELU),
        **_gemma_fields(hf, 6),
    }
    local = hf.get("rope_local_base_freq", 10_000.0)
    layered = rope_by_layer_type(hf, "config.json", fields["rope_theta"])
    if layered is not None:
        full, slide = layered
        fields.update(full)
        local = local if slide is None else slide
    return LlamaConfig(
        **fields, architecture="gemma3", qk_norm=True, rope_local_theta=float(local)
    )


def gemma3_to_hf(c: LlamaConfig) -> dict[str, Any]:
    """The ``config.json`` of a Gemma 3 text `LlamaConfig`."""
    if not c.qk_norm:
        raise UnsupportedError("Gemma 3 has q/k norms: LlamaConfig.qk_norm=True")
    hf = _gemma_to_hf(c, "Gemma3ForCausalLM", "gemma3_text")
    hf["rope_local_base_freq"] = c.rope_local_theta or c.rope_theta
    return hf


_TINY: dict[str, Any] = dict(
    **_GEMMA,
    **TINY_SIZES,
    attention_bias=True,
    attention_out_bias=True,
    sliding_window=4,
    layer_types=("sliding_attention", "full_attention"),
    query_pre_attn_scalar=24.0,
)


def _tiny_gemma() -> LlamaConfig:
    """Gemma 1: one KV head (2B's MQA), ``head_dim`` apart from ``D / H``, biases."""
    return LlamaConfig(
        **{**TINY_SIZES, "num_kv_heads": 1},
        **_GEMMA1,
        architecture="gemma",
        attention_bias=True,
        attention_out_bias=True,
        rope_type="linear",
        rope_factor=2.0,
    )


def _tiny_gemma2() -> LlamaConfig:
    """Gemma 2 with strong soft-capping (so that tanh bends), a sliding layer."""
    return LlamaConfig(
        **_TINY,
        architecture="gemma2",
        attn_logit_softcapping=1.0,
        final_logit_softcapping=2.0,
    )


def _tiny_gemma3() -> LlamaConfig:
    """Gemma 3: q/k norms, local rotary base, linear scaling on the global layer."""
    return LlamaConfig(
        **_TINY,
        architecture="gemma3",
        qk_norm=True,
        rope_theta=1_000_000.0,
        rope_local_theta=10_000.0,
        rope_type="linear",
        rope_factor=8.0,
    )


register_family(
    LlamaConfig,
    "gemma",
    "Gemma 1 / CodeGemma: GeGLU, (1 + w) norms, sqrt(D) embedding scale, tied head",
    hf_class="GemmaForCausalLM",
    from_hf=gemma_from_hf,
    to_hf=gemma_to_hf,
    tiny=_tiny_gemma,
    defaults=_GEMMA1,
)
register_family(
    LlamaConfig,
    "gemma2",
    "Gemma 2: sandwich norms, GeGLU, soft-capping, local/global layers",
    hf_class="Gemma2ForCausalLM",
    from_hf=gemma2_from_hf,
    to_hf=gemma2_to_hf,
    tiny=_tiny_gemma2,
    defaults=_GEMMA,
)
register_family(
    LlamaConfig,
    "gemma3",
    "Gemma 3 (text): Gemma 2 with q/k norms and local rotary bases",
    hf_class="Gemma3ForCausalLM",
    from_hf=gemma3_from_hf,
    to_hf=gemma3_to_hf,
    tiny=_tiny_gemma3,
    model_type="gemma3_text",
    defaults={**_GEMMA, "qk_norm": True},
)

__all__ = [
    "gemma2_from_hf",
    "gemma2_to_hf",
    "gemma3_from_hf",
    "gemma3_to_hf",
    "gemma_from_hf",
    "gemma_to_hf",
]
