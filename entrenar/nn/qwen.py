"""Qwen2 / Qwen2.5 and Qwen3: Llama with q/k/v biases, or with per-head q/k norms.

Qwen2 (Yang et al., "Qwen2 Technical Report", 2024; Qwen2.5 shares the
architecture): biases on the q, k and v projections (not o_proj), optional sliding
windows on the layers from ``max_window_layers`` on. Qwen3 (2025): no biases by
default, RMSNorm of each query and key head (``q_norm``, ``k_norm``) before
rotary. Both are `LlamaConfig` families (``architecture="qwen2"`` / ``"qwen3"``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from entrenar.errors import UnsupportedError
from entrenar.nn.decoder_config import (
    check_hidden_act,
    common_from_hf,
    common_to_hf,
    refuse_switches,
)
from entrenar.nn.llama import LlamaConfig
from entrenar.nn.registry import Architecture, register_architecture

_QWEN2_SWITCHES = ("rope_type", "attention_bias", "sliding_window", "layer_types")
_QWEN3_SWITCHES = (*_QWEN2_SWITCHES, "attention_out_bias", "qk_norm")


def _windows(hf: Mapping[str, Any]) -> dict[str, Any]:
    """``sliding_window`` and ``layer_types`` as transformers reads them."""
    if not hf.get("use_sliding_window", False) or hf.get("sliding_window") is None:
        return {}
    n = int(hf["num_hidden_layers"])
    types = hf.get("layer_types") or [
        "sliding_attention" if i >= int(hf.get("max_window_layers", 28)) else
        "full_attention"
        for i in range(n)
    ]  # fmt: skip
    if "sliding_attention" not in types:
        return {}
    return {"sliding_window": int(hf["sliding_window"]), "layer_types": tuple(types)}


def _windows_to_hf(c: LlamaConfig) -> dict[str, Any]:
    if c.sliding_window is None:
        return {"use_sliding_window": False, "max_window_layers": c.num_layers}
    types = c.layer_types or ("sliding_attention",) * c.num_layers
    return {
        "use_sliding_window": True,
        "sliding_window": c.sliding_window,
        "max_window_layers": types.index("sliding_attention"),
        "layer_types": list(types),
    }


def qwen2_from_hf(hf: Mapping[str, Any]) -> LlamaConfig:
    """A ``model_type: qwen2`` ``config.json`` (Qwen2, Qwen2.5) as a `LlamaConfig`."""
    check_hidden_act(hf, "config.json", "silu")
    return LlamaConfig(
        **common_from_hf(hf, "config.json"),
        architecture="qwen2",
        attention_bias=True,
        **_windows(hf),
    )


def qwen2_to_hf(c: LlamaConfig) -> dict[str, Any]:
    """The ``config.json`` of a Qwen2 `LlamaConfig`."""
    refuse_switches(c, "Qwen2", _QWEN2_SWITCHES)
    hf = common_to_hf(c, "Qwen2ForCausalLM", "qwen2")
    hf.update(_windows_to_hf(c))
    return hf


def qwen3_from_hf(hf: Mapping[str, Any]) -> LlamaConfig:
    """A ``model_type: qwen3`` ``config.json`` as a `LlamaConfig`."""
    check_hidden_act(hf, "config.json", "silu")
    bias = bool(hf.get("attention_bias", False))
    return LlamaConfig(
        **common_from_hf(hf, "config.json"),
        architecture="qwen3",
        attention_bias=bias,
        attention_out_bias=bias,
        qk_norm=True,
        **_windows(hf),
    )


def qwen3_to_hf(c: LlamaConfig) -> dict[str, Any]:
    """The ``config.json`` of a Qwen3 `LlamaConfig`."""
    refuse_switches(c, "Qwen3", _QWEN3_SWITCHES)
    if c.attention_bias != c.attention_out_bias:
        raise UnsupportedError(
            "Qwen3's config.json has one attention_bias for q, k, v and o_proj; "
            "LlamaConfig.attention_bias and attention_out_bias must be equal"
        )
    hf = common_to_hf(c, "Qwen3ForCausalLM", "qwen3")
    hf["attention_bias"] = c.attention_bias
    hf.update(_windows_to_hf(c))
    return hf


_TINY: dict[str, Any] = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    rms_norm_eps=1e-6,
    sliding_window=4,
    layer_types=("full_attention", "sliding_attention"),
)


def _tiny_qwen2() -> LlamaConfig:
    """q/k/v biases, a sliding second layer, YaRN rope, tied head (small sizes)."""
    return LlamaConfig(
        **_TINY,
        architecture="qwen2",
        attention_bias=True,
        tie_word_embeddings=True,
        rope_type="yarn",
        rope_factor=4.0,
        rope_original_max_position_embeddings=32,
        max_position_embeddings=128,
    )


def _tiny_qwen3() -> LlamaConfig:
    """q/k norms, biases on q/k/v/o, a sliding layer, linear rope, tied head."""
    return LlamaConfig(
        **_TINY,
        architecture="qwen3",
        qk_norm=True,
        attention_bias=True,
        attention_out_bias=True,
        tie_word_embeddings=True,
        rope_type="linear",
        rope_factor=2.0,
    )


register_architecture(
    Architecture(
        name="qwen2",
        config_class=LlamaConfig,
        summary="Qwen2 / Qwen2.5: Llama with q/k/v biases",
        hf_model_types=("qwen2",),
        hf_class="Qwen2ForCausalLM",
        gguf_name="qwen2",
        from_hf=qwen2_from_hf,
        to_hf=qwen2_to_hf,
        defaults={"architecture": "qwen2", "attention_bias": True},
        tiny=_tiny_qwen2,
    )
)

register_architecture(
    Architecture(
        name="qwen3",
        config_class=LlamaConfig,
        summary="Qwen3: Llama with per-head q/k RMSNorm",
        hf_model_types=("qwen3",),
        hf_class="Qwen3ForCausalLM",
        gguf_name="qwen3",
        from_hf=qwen3_from_hf,
        to_hf=qwen3_to_hf,
        defaults={"architecture": "qwen3", "qk_norm": True},
        tiny=_tiny_qwen3,
    )
)

__all__ = ["qwen2_from_hf", "qwen2_to_hf", "qwen3_from_hf", "qwen3_to_hf"]
