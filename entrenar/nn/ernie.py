"""Baidu ERNIE 4.5 (dense): Llama with interleaved rotary pairs and one bias switch.

Baidu ERNIE Team, "ERNIE 4.5 Technical Report", 2025 (model card
baidu/ERNIE-4.5-0.3B-PT). A `LlamaConfig` with ``architecture="ernie4_5"``:
transformers 5.25's ``Ernie4_5ForCausalLM`` is Llama's forward (pre-norm RMSNorm,
SwiGLU, grouped-query attention, scores ``d^-1/2``) with

- rotary over **interleaved pairs** ``(x_2i, x_2i+1)`` of each query and key head
  (its ``apply_rotary_pos_emb`` repeats each ``cos`` / ``sin`` twice and rotates
  neighbours): ``rope_interleave`` (`entrenar.nn.rope.interleaved_as_halves`);
- ``use_bias``: one switch for the q/k/v/o and gate/up/down biases (default false);
- transformers' defaults where the file is silent: ``head_dim`` 128 (not ``D/H``),
  a tied head, ``rope_theta`` 500000, ``rms_norm_eps`` 1e-5.

llama.cpp's ``ernie4_5`` (GGUF) rotates interleaved pairs itself (its NORM rotary):
q/k rows are written as the checkpoint has them, and it loads no MLP biases.

ERNIE 4.5's mixtures of experts (``ernie4_5_moe``, ``ernie4_5_vl_moe``) are not
implemented (refused by `entrenar.nn.registry`).
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
    "attention_bias",
    "attention_out_bias",
    "mlp_bias",
    "rope_interleave",
)
_BIASES = ("attention_bias", "attention_out_bias", "mlp_bias")


def ernie4_5_from_hf(hf: Mapping[str, Any]) -> LlamaConfig:
    """A ``model_type: ernie4_5`` ``config.json`` as a `LlamaConfig`."""
    hf = {"head_dim": 128, "tie_word_embeddings": True, "rms_norm_eps": 1e-5, **hf}
    if hf["head_dim"] is None:  # transformers: D / H
        hf["head_dim"] = int(hf["hidden_size"]) // int(hf["num_attention_heads"])
    bias = bool(hf.get("use_bias", False))
    return LlamaConfig(
        **common_from_hf(hf, "config.json", default_theta=500_000.0),
        architecture="ernie4_5",
        rope_interleave=True,
        attention_bias=bias,
        attention_out_bias=bias,
        mlp_bias=bias,
    )


def ernie4_5_to_hf(c: LlamaConfig) -> dict[str, Any]:
    """The ``config.json`` of an ERNIE 4.5 `LlamaConfig`.

    Raises:
        UnsupportedError: half-split rotary, or biases on some projections only
            (``use_bias`` sets all seven).
    """
    if not c.rope_interleave:
        raise UnsupportedError(
            "ERNIE 4.5 rotates interleaved pairs: LlamaConfig.rope_interleave must "
            "be True in an ernie4_5 config"
        )
    if len({getattr(c, k) for k in _BIASES}) != 1:
        raise UnsupportedError(
            "ERNIE 4.5's config.json has one use_bias for q/k/v/o and the MLP; "
            f"LlamaConfig.{', '.join(_BIASES)} must be equal"
        )
    hf = common_to_hf(c, "Ernie4_5ForCausalLM", "ernie4_5", _SWITCHES)
    del hf["attention_bias"]  # use_bias is the file's one switch
    hf["use_bias"] = c.attention_bias
    # transformers' ERNIE 4.5 defaults (pad 0, bos 1, eos 2) suit any vocabulary,
    # but the token ids are the tokenizer's, written by entrenar.io
    hf.update(bos_token_id=None, eos_token_id=None, pad_token_id=None)
    return hf


def _tiny() -> LlamaConfig:
    """Interleaved rotary (yarn), tied, no biases (the 0.3B model's).

    llama.cpp's graph has no MLP biases; `test_ernie4_5_defaults_and_refusals`
    checks ``use_bias``.
    """
    return LlamaConfig(
        **TINY_SIZES,
        architecture="ernie4_5",
        rope_interleave=True,
        tie_word_embeddings=True,
        rms_norm_eps=1e-5,
        rope_theta=500_000.0,
        rope_type="yarn",
        rope_factor=2.0,
        rope_original_max_position_embeddings=8,
    )


register_family(
    LlamaConfig,
    "ernie4_5",
    "ERNIE 4.5 (dense): Llama with interleaved rotary pairs and one use_bias switch",
    hf_class="Ernie4_5ForCausalLM",
    from_hf=ernie4_5_from_hf,
    to_hf=ernie4_5_to_hf,
    tiny=_tiny,
    defaults={"rope_interleave": True},
)

__all__ = ["ernie4_5_from_hf", "ernie4_5_to_hf"]
