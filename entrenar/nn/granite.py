"""IBM Granite 3.x (dense): Llama with four scalar multipliers.

IBM, "Granite 3.0 Language Models", 2024. A `LlamaConfig` with
``architecture="granite"`` and transformers' ``GraniteForCausalLM`` numbers:

- ``embedding_multiplier`` ``m_e``: ``h₀ = E[x] · m_e``;
- ``residual_multiplier`` ``m_r``: ``h = h + m_r · Attn(...)``, ``+ m_r · MLP(...)``;
- ``attention_multiplier`` ``m_a``: scores ``q kᵀ · m_a`` (in place of ``d^-1/2``);
- ``logits_scaling`` ``s``: logits ``RMSNorm(h) Wᵀ / s``.

Granite's MoE models (``granitemoe``, ``granitemoeshared``) are
`entrenar.nn.granitemoe`; Granite 4's hybrid Mamba layers are not implemented.
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

MULTIPLIERS = (
    "embedding_multiplier",
    "residual_multiplier",
    "attention_multiplier",
    "logits_scaling",
)
"""Granite's ``config.json`` keys, which are `LlamaConfig` fields of the same name
(default 1.0 in transformers)."""
_SWITCHES = ("rope_type", "attention_bias", "attention_out_bias", "mlp_bias")


def granite_from_hf(hf: Mapping[str, Any]) -> LlamaConfig:
    """A ``model_type: granite`` ``config.json`` as a `LlamaConfig`."""
    bias = bool(hf.get("attention_bias", False))
    scales: dict[str, Any] = {k: float(hf.get(k, 1.0)) for k in MULTIPLIERS}
    return LlamaConfig(
        **common_from_hf(hf, "config.json"),
        **scales,
        architecture="granite",
        attention_bias=bias,
        attention_out_bias=bias,
        mlp_bias=bool(hf.get("mlp_bias", False)),
    )


def granite_to_hf(c: LlamaConfig) -> dict[str, Any]:
    """The ``config.json`` of a Granite `LlamaConfig` (None multipliers: 1.0)."""
    hf = common_to_hf(c, "GraniteForCausalLM", "granite", (*_SWITCHES, *MULTIPLIERS))
    hf["mlp_bias"] = c.mlp_bias
    for key in MULTIPLIERS:
        value = getattr(c, key)
        hf[key] = 1.0 if value is None else value
    if c.attention_multiplier is None:  # transformers' 1.0 is not d^-1/2
        hf["attention_multiplier"] = c.hd**-0.5
    # transformers' Granite defaults (bos 1, eos 2) suit any vocabulary, but the
    # token ids are the tokenizer's, written by entrenar.io
    hf.update(bos_token_id=None, eos_token_id=None, pad_token_id=None)
    return hf


def _tiny() -> LlamaConfig:
    """Every multiplier away from 1 (logits divided by 2, not 8: not too flat)."""
    return LlamaConfig(
        **TINY_SIZES,
        architecture="granite",
        embedding_multiplier=12.0,
        residual_multiplier=0.22,
        attention_multiplier=0.2,
        logits_scaling=2.0,
        attention_bias=True,
        attention_out_bias=True,
        mlp_bias=True,
        rope_type="linear",
        rope_factor=2.0,
    )


register_family(
    LlamaConfig,
    "granite",
    "Granite 3.x: Llama with embedding, residual, attention and logits multipliers",
    hf_class="GraniteForCausalLM",
    from_hf=granite_from_hf,
    to_hf=granite_to_hf,
    tiny=_tiny,
)

__all__ = ["MULTIPLIERS", "granite_from_hf", "granite_to_hf"]
