"""Mistral: Llama with sliding-window attention in every layer.

Jiang et al., "Mistral 7B", 2023. A `LlamaConfig` with ``architecture="mistral"``
and ``sliding_window`` (None in Mistral v0.2+ and Mistral-Nemo: plain Llama):
a query at position ``p`` attends to keys at ``p - W < s <= p``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from entrenar.nn.decoder_config import (
    check_hidden_act,
    common_from_hf,
    common_to_hf,
    refuse_switches,
)
from entrenar.nn.llama import LlamaConfig
from entrenar.nn.registry import Architecture, register_architecture


def mistral_from_hf(hf: Mapping[str, Any]) -> LlamaConfig:
    """A ``model_type: mistral`` ``config.json`` as a `LlamaConfig`."""
    check_hidden_act(hf, "config.json", "silu")
    window = hf.get("sliding_window")
    return LlamaConfig(
        **common_from_hf(hf, "config.json"),
        architecture="mistral",
        sliding_window=None if window is None else int(window),
    )


def mistral_to_hf(c: LlamaConfig) -> dict[str, Any]:
    """The ``config.json`` of a Mistral `LlamaConfig`."""
    refuse_switches(c, "Mistral", ("rope_type", "sliding_window"))
    hf = common_to_hf(c, "MistralForCausalLM", "mistral")
    hf["sliding_window"] = c.sliding_window
    return hf


def _tiny() -> LlamaConfig:
    """Sliding window 4 (shorter than the tests' sequences), dynamic NTK rope."""
    return LlamaConfig(
        architecture="mistral",
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rope_type="dynamic",
        rope_factor=2.0,
        max_position_embeddings=8,
        sliding_window=4,
    )


register_architecture(
    Architecture(
        name="mistral",
        config_class=LlamaConfig,
        summary="Mistral: Llama with sliding-window attention",
        hf_model_types=("mistral",),
        hf_class="MistralForCausalLM",
        gguf_name=None,  # llama.cpp writes Mistral as general.architecture "llama"
        from_hf=mistral_from_hf,
        to_hf=mistral_to_hf,
        defaults={"architecture": "mistral"},
        tiny=_tiny,
    )
)

__all__ = ["mistral_from_hf", "mistral_to_hf"]
