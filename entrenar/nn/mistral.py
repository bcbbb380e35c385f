"""Mistral: Llama with sliding-window attention in every layer; Ministral 3.

Jiang et al., "Mistral 7B", 2023. A `LlamaConfig` with ``architecture="mistral"``
and ``sliding_window`` (None in Mistral v0.2+ and Mistral-Nemo: plain Llama):
a query at position ``p`` attends to keys at ``p - W < s <= p``.

Ministral 3 (3B/8B/14B, December 2025; ``model_type: ministral3``, the
``text_config`` of its ``mistral3`` vision-language folders): Mistral with YaRN
rotary and Llama 4's attention temperature, each query multiplied after rotary by
``1 + β ln(1 + ⌊p / L⌋)`` (``rope_parameters.llama_4_scaling_beta`` β = 0.1, ``L``
its ``original_max_position_embeddings`` = 16384; `LlamaConfig.query_scale_beta`):
1 within the pre-training context, growing by ``β ln 2`` at ``L``. GGUF: llama.cpp's
``mistral3`` (``attention.temperature_scale`` β; ``L`` its YaRN original context).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from entrenar.errors import FormatError, UnsupportedError
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


_MINISTRAL3_ROPE = {  # Ministral3Config's rope_parameters when the file has none
    "rope_type": "yarn",
    "rope_theta": 1000000.0,
    "factor": 16.0,
    "original_max_position_embeddings": 16384,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale_all_dim": 1.0,
    "mscale": 1.0,
    "llama_4_scaling_beta": 0.1,
}


def ministral3_from_hf(hf: Mapping[str, Any]) -> LlamaConfig:
    """A ``model_type: ministral3`` ``config.json`` as a `LlamaConfig`.

    Raises:
        FormatError: ``llama_4_scaling_beta`` without a positive
            ``original_max_position_embeddings`` in the rope dict.
    """
    if not hf.get("rope_parameters") and not hf.get("rope_scaling"):
        hf = {**hf, "rope_parameters": _MINISTRAL3_ROPE}
    rope = hf.get("rope_parameters") or hf.get("rope_scaling")
    beta = rope.get("llama_4_scaling_beta") if isinstance(rope, Mapping) else None
    scale: dict[str, Any] = {}
    if beta is not None and isinstance(rope, Mapping):
        length = rope.get("original_max_position_embeddings")
        if isinstance(length, bool) or not isinstance(length, int) or length <= 0:
            raise FormatError(
                f"config.json: ministral3 rope llama_4_scaling_beta {beta!r} needs "
                "original_max_position_embeddings (the query scale's period), got "
                f"{length!r}"
            )
        scale = {"query_scale_beta": float(beta), "query_scale_length": length}
    config = mistral_from_hf(hf)
    return dataclasses.replace(config, architecture="ministral3", **scale)


def ministral3_to_hf(c: LlamaConfig) -> dict[str, Any]:
    """The ``config.json`` of a Ministral 3 `LlamaConfig` (``rope_parameters``)."""
    hf = common_to_hf(
        c, "Ministral3ForCausalLM", "ministral3",
        ("rope_type", "sliding_window", "query_scale_beta"),
    )  # fmt: skip
    hf["sliding_window"] = c.sliding_window
    rope = {"rope_type": "default", **(hf.pop("rope_scaling") or {})}
    rope["rope_theta"] = hf.pop("rope_theta")
    old = c.rope_original_max_position_embeddings
    if c.query_scale_beta is not None and old not in (None, c.query_scale_length):
        raise UnsupportedError(
            "Ministral 3's config.json has one original_max_position_embeddings "
            f"for rotary and the query scale: LlamaConfig.query_scale_length "
            f"{c.query_scale_length} must equal rope_original_max_position_embeddings "
            f"{old}"
        )
    if c.query_scale_beta is not None:
        rope["llama_4_scaling_beta"] = c.query_scale_beta
        rope["original_max_position_embeddings"] = c.query_scale_length
    hf["rope_parameters"] = rope
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


def _tiny_ministral3() -> LlamaConfig:
    """YaRN x16 over 4 positions, the query scale from position 4 on (T = 12)."""
    return LlamaConfig(
        **TINY_SIZES,
        architecture="ministral3",
        rope_type="yarn",
        rope_factor=16.0,
        rope_original_max_position_embeddings=4,
        max_position_embeddings=64,
        query_scale_beta=0.1,
        query_scale_length=4,
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

register_family(
    LlamaConfig,
    "ministral3",
    "Ministral 3: Mistral with YaRN and Llama 4's query scale",
    hf_class="Ministral3ForCausalLM",
    from_hf=ministral3_from_hf,
    to_hf=ministral3_to_hf,
    tiny=_tiny_ministral3,
    gguf_name="mistral3",  # llama.cpp's name (its converter's Ministral3Model)
)

__all__ = ["ministral3_from_hf", "ministral3_to_hf", "mistral_from_hf", "mistral_to_hf"]
