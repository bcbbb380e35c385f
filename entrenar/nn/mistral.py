"""Mistral: Llama with sliding-window attention in every layer.

Jiang et al., "Mistral 7B", 2023. A `LlamaConfig` with ``architecture="mistral"``
and ``sliding_window`` (None in Mistral v0.2+ and Mistral-Nemo: plain Llama):
a query at position ``p`` attends to keys at ``p - W < s <= p``.
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


def mistral_from_hf(hf: Mapping[str, Any]) -> LlamaConfig:
    """A ``model_type: mistral`` ``config.json`` as a `LlamaConfig`."""
    window = hf.get("sliding_window")
    return LlamaConfig(
        **common_from_hf(hf, "config.json"),
        architecture="mistral",
        sliding_window=None if window is None else int(window),
    )


def mistral_to_hf(c: LlamaConfig) -> dict[str, Any]:
    """The ``config.json`` of a Mistral `LlamaConfig`."""
    hf = common_to_hf(
        c, "MistralForCausalLM", "mistral", ("rope_type", "sliding_window")
    )
    hf["sliding_window"] = c.sliding_window
    return hf


def _tiny() -> LlamaConfig:
    """Sliding window 4 (shorter than the tests' sequences), dynamic NTK rope."""
    return LlamaConfig(
        **TINY_SIZES,
        architecture="mistral",
        rope_type="dynamic",
        rope_factor=2.0,
        max_position_embeddings=8,
        sliding_window=4,
    )


register_family(
    LlamaConfig,
    "mistral",
    "Mistral: Llama with sliding-window attention",
    hf_class="MistralForCausalLM",
    from_hf=mistral_from_hf,
    to_hf=mistral_to_hf,
    tiny=_tiny,
    in_gguf=False,  # llama.cpp writes Mistral as general.architecture "llama"
)

__all__ = ["mistral_from_hf", "mistral_to_hf"]
