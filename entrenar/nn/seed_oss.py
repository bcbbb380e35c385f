"""ByteDance Seed-OSS: Llama with separate q/k/v and o_proj bias switches.

ByteDance Seed Team, "Seed-OSS-36B", 2025 (model card
ByteDance-Seed/Seed-OSS-36B-Base). A `LlamaConfig` with
``architecture="seed_oss"``: transformers 5.25's ``SeedOssForCausalLM`` is Llama's
forward (pre-norm RMSNorm, rotary over whole heads in the half-split layout, SwiGLU,
grouped-query attention, scores ``d^-1/2``) with

- ``attention_bias`` (default **true**) on q, k and v_proj and its own
  ``attention_out_bias`` (default false) on o_proj: the 36B model has biased q/k/v
  and an unbiased o_proj;
- ``head_dim`` 128 when the file has none (not ``D / H``: the 36B model's 5120 / 80
  = 64 would be wrong);
- llama.cpp's ``seed_oss`` (GGUF) has q/k/v biases but none on o_proj or the
  MLP, and names the MLP's norm ``post_attention_norm``
  (`entrenar.io.gguf_families`);
- ``attention_dropout`` and ``residual_dropout`` (0.1 in the 36B config), which only
  act in transformers' training mode; entrenar's forward has no dropout (as for
  every family), so fine-tuning runs without them.
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

_SWITCHES = ("rope_type", "attention_bias", "attention_out_bias", "mlp_bias")


def seed_oss_from_hf(hf: Mapping[str, Any]) -> LlamaConfig:
    """A ``model_type: seed_oss`` ``config.json`` as a `LlamaConfig`.

    transformers' defaults where the file is silent: ``head_dim`` 128,
    ``attention_bias`` true, ``attention_out_bias`` and ``mlp_bias`` false.
    """
    hf = {"head_dim": 128, **hf}
    if hf["head_dim"] is None:  # transformers: D / H
        hf["head_dim"] = int(hf["hidden_size"]) // int(hf["num_attention_heads"])
    return LlamaConfig(
        **common_from_hf(hf, "config.json"),
        architecture="seed_oss",
        attention_bias=bool(hf.get("attention_bias", True)),
        attention_out_bias=bool(hf.get("attention_out_bias", False)),
        mlp_bias=bool(hf.get("mlp_bias", False)),
    )


def seed_oss_to_hf(c: LlamaConfig) -> dict[str, Any]:
    """The ``config.json`` of a Seed-OSS `LlamaConfig`."""
    hf = common_to_hf(c, "SeedOssForCausalLM", "seed_oss", _SWITCHES, split_bias=True)
    hf["mlp_bias"] = c.mlp_bias
    # transformers' Seed-OSS defaults (pad 1, bos 0, eos 2) suit any vocabulary,
    # but the token ids are the tokenizer's, written by entrenar.io
    hf.update(bos_token_id=None, eos_token_id=None, pad_token_id=None)
    return hf


def _tiny() -> LlamaConfig:
    """The 36B model's biases (q/k/v, none on o_proj or the MLP), linear rope."""
    return LlamaConfig(
        **TINY_SIZES,
        architecture="seed_oss",
        attention_bias=True,
        attention_out_bias=False,
        rope_type="linear",
        rope_factor=2.0,
    )


register_family(
    LlamaConfig,
    "seed_oss",
    "Seed-OSS: Llama with q/k/v biases and a separate o_proj bias switch",
    hf_class="SeedOssForCausalLM",
    from_hf=seed_oss_from_hf,
    to_hf=seed_oss_to_hf,
    tiny=_tiny,
)

__all__ = ["seed_oss_from_hf", "seed_oss_to_hf"]
