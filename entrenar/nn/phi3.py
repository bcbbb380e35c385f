"""Phi-3 / Phi-3.5-mini / Phi-4: Llama with fused projections and LongRoPE.

Abdin et al., "Phi-3 Technical Report", 2024. A `LlamaConfig` with
``architecture="phi3"``: one ``qkv_proj`` weight ``[W_q; W_k; W_v]`` and one
``gate_up_proj`` weight ``[W_gate; W_up]`` per layer (Hugging Face's fused names,
so PEFT adapters name Phi-3's modules), ``longrope`` scaling (``su`` and ``yarn``
in older files mean the same in transformers' Phi-3) and an optional sliding window
in every layer. Phi-4-mini rotates the first 3/4 of each head
(``partial_rotary_factor`` 0.75, at the top level of its ``config.json``; its
LongRoPE factors have ``rotary_dim / 2`` values); Phi-4 (14B) is a Phi-3 with
whole-head rotary and no scaling.
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
)
from entrenar.nn.llama import LlamaConfig

_SWITCHES = (
    "rope_type",
    "partial_rotary_factor",
    "sliding_window",
    "fused_qkv",
    "fused_gate_up",
)


def phi3_from_hf(hf: Mapping[str, Any]) -> LlamaConfig:
    """A ``model_type: phi3`` ``config.json`` as a `LlamaConfig`."""
    hf = dict(hf)
    key = "rope_scaling" if hf.get("rope_scaling") else "rope_parameters"
    scaling = dict(hf.get(key) or {})
    kind = scaling.pop("type", None)  # Phi-3.5-mini and Phi-4-mini write "type"
    kind = scaling.setdefault("rope_type", kind or "default")
    if kind in ("su", "yarn"):
        scaling["rope_type"] = "longrope"
    if scaling["rope_type"] == "longrope":
        scaling.setdefault(
            "original_max_position_embeddings",
            hf.get("original_max_position_embeddings", 4096),
        )
    hf[key] = scaling
    window = hf.get("sliding_window")
    return LlamaConfig(
        **common_from_hf(hf, "config.json", partial_rotary=True),
        architecture="phi3",
        fused_qkv=True,
        fused_gate_up=True,
        sliding_window=None if window is None else int(window),
    )


def phi3_to_hf(c: LlamaConfig) -> dict[str, Any]:
    """The ``config.json`` of a Phi-3 `LlamaConfig`."""
    if c.hd * c.num_heads != c.hidden_size:
        raise UnsupportedError(
            "Phi-3's config.json has no head_dim (transformers checks its rope "
            f"factors against hidden_size / heads): head_dim {c.hd} must be "
            f"{c.hidden_size // c.num_heads}"
        )
    hf = common_to_hf(c, "Phi3ForCausalLM", "phi3", _SWITCHES)
    hf["sliding_window"] = c.sliding_window
    # transformers' Phi-3 defaults (32000 and 32064's neighbours) lie outside a
    # small vocabulary; the token ids are the tokenizer's, written by entrenar.io
    hf.update(bos_token_id=None, eos_token_id=None, pad_token_id=None)
    if c.rope_original_max_position_embeddings is not None:
        hf["original_max_position_embeddings"] = c.rope_original_max_position_embeddings
    return hf


def _tiny() -> LlamaConfig:
    """Fused weights, LongRoPE past a context of 8, sliding window 4, untied.

    Rotary on 12 of the 16 values of each head (Phi-4-mini's factor 0.75).
    """
    half = 6  # rotary_dim = int(16 x 0.75) = 12
    return LlamaConfig(
        **{**TINY_SIZES, "hidden_size": 64},
        architecture="phi3",
        rms_norm_eps=1e-5,
        fused_qkv=True,
        fused_gate_up=True,
        sliding_window=4,
        rope_type="longrope",
        partial_rotary_factor=0.75,
        rope_factor=4.0,
        max_position_embeddings=32,
        rope_original_max_position_embeddings=8,
        rope_short_factor=tuple(1.0 + 0.1 * i for i in range(half)),
        rope_long_factor=tuple(1.0 + 0.7 * i for i in range(half)),
    )


register_family(
    LlamaConfig,
    "phi3",
    "Phi-3 / Phi-3.5-mini / Phi-4(-mini): fused qkv and gate_up weights, LongRoPE, "
    "partial rotary",
    hf_class="Phi3ForCausalLM",
    from_hf=phi3_from_hf,
    to_hf=phi3_to_hf,
    tiny=_tiny,
    defaults={"fused_qkv": True, "fused_gate_up": True},
)

__all__ = ["phi3_from_hf", "phi3_to_hf"]
