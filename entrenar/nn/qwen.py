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

from entrenar.nn.decoder_config import (
    TINY_SIZES,
    common_from_hf,
    common_to_hf,
    register_family,
)
from entrenar.nn.llama import LlamaConfig

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
    return LlamaConfig(
        **common_from_hf(hf, "config.json"),
        architecture="qwen2",
        attention_bias=True,
        **_windows(hf),
    )


def qwen2_to_hf(c: LlamaConfig) -> dict[str, Any]:
    """The ``config.json`` of a Qwen2 `LlamaConfig`."""
    hf = common_to_hf(c, "Qwen2ForCausalLM", "qwen2", _QWEN2_SWITCHES)
    hf.update(_windows_to_hf(c))
    return hf


def qwen3_from_hf(hf: Mapping[str, Any]) -> LlamaConfig:
    """A ``model_type: qwen3`` ``config.json`` as a `LlamaConfig`."""
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
    hf = common_to_hf(c, "Qwen3ForCausalLM", "qwen3", _QWEN3_SWITCHES)
    hf.update(_windows_to_hf(c))
    return hf


_TINY: dict[str, Any] = dict(
    **TINY_SIZES,
    sliding_window=4,
    layer_types=("full_attention", "sliding_attention"),
    tie_word_embeddings=True,
    attention_bias=True,
)


def _tiny_qwen2() -> LlamaConfig:
    """q/k/v biases, a sliding second layer, YaRN rope, tied head (small sizes)."""
    return LlamaConfig(
        **_TINY,
        architecture="qwen2",
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
        attention_out_bias=True,
        rope_type="linear",
        rope_factor=2.0,
    )


register_family(
    LlamaConfig,
    "qwen2",
    "Qwen2 / Qwen2.5: Llama with q/k/v biases",
    hf_class="Qwen2ForCausalLM",
    from_hf=qwen2_from_hf,
    to_hf=qwen2_to_hf,
    tiny=_tiny_qwen2,
    defaults={"attention_bias": True},
)
register_family(
    LlamaConfig,
    "qwen3",
    "Qwen3: Llama with per-head q/k RMSNorm",
    hf_class="Qwen3ForCausalLM",
    from_hf=qwen3_from_hf,
    to_hf=qwen3_to_hf,
    tiny=_tiny_qwen3,
    defaults={"qk_norm": True},
)

__all__ = ["qwen2_from_hf", "qwen2_to_hf", "qwen3_from_hf", "qwen3_to_hf"]
