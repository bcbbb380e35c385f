"""OLMo 2: Llama with norms on the sublayer outputs and q/k norms over whole rows.

OLMo et al., "2 OLMo 2 Furious", 2024. A `LlamaConfig` with
``architecture="olmo2"``:

- ``post_norms``: no norm before attention or the MLP; each sublayer's output is
  normalised, then added: ``h = h + RMSNorm(Attn(h))``, ``h = h + RMSNorm(MLP(h))``
  (``post_attention_layernorm``, ``post_feedforward_layernorm``);
- ``qk_norm`` with ``qk_norm_whole``: RMSNorm of the ``H d`` query and ``KV d`` key
  values of a token at once (one mean square over all heads), before rotary;
- untied head, ``rms_norm_eps`` 1e-5, optional q/k/v/o biases.
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

_OLMO2: dict[str, Any] = {"post_norms": True, "qk_norm": True, "qk_norm_whole": True}
_SWITCHES = ("rope_type", "attention_bias", "attention_out_bias", *_OLMO2)


def _check(c: LlamaConfig, family: str) -> None:
    for name, want in _OLMO2.items():
        if getattr(c, name) != want:
            raise UnsupportedError(
                f"LlamaConfig.{name} must be {want!r} in an {family} config"
            )


def olmo2_from_hf(hf: Mapping[str, Any]) -> LlamaConfig:
    """A ``model_type: olmo2`` ``config.json`` as a `LlamaConfig`."""
    bias = bool(hf.get("attention_bias", False))
    fields = common_from_hf({"rms_norm_eps": 1e-5, **hf}, "config.json")
    return LlamaConfig(
        **fields,
        **_OLMO2,
        architecture="olmo2",
        attention_bias=bias,
        attention_out_bias=bias,
    )


def olmo2_to_hf(c: LlamaConfig) -> dict[str, Any]:
    """The ``config.json`` of an OLMo 2 `LlamaConfig`."""
    _check(c, "OLMo 2")
    hf = common_to_hf(c, "Olmo2ForCausalLM", "olmo2", _SWITCHES)
    # transformers' OLMo 2 defaults (pad 1, eos 50279) may lie outside a small
    # vocabulary; the token ids are the tokenizer's, written by entrenar.io
    hf.update(bos_token_id=None, eos_token_id=None, pad_token_id=None)
    return hf


def _tiny_olmo2() -> LlamaConfig:
    """OLMo 2 with q/k/v/o biases and linear rope scaling, untied."""
    return LlamaConfig(
        **TINY_SIZES,
        **_OLMO2,
        architecture="olmo2",
        rms_norm_eps=1e-5,
        attention_bias=True,
        attention_out_bias=True,
        rope_type="linear",
        rope_factor=2.0,
    )


register_family(
    LlamaConfig,
    "olmo2",
    "OLMo 2: norms on the attention and MLP outputs, q/k norms over whole rows",
    hf_class="Olmo2ForCausalLM",
    from_hf=olmo2_from_hf,
    to_hf=olmo2_to_hf,
    tiny=_tiny_olmo2,
    defaults=_OLMO2,
)

__all__ = ["olmo2_from_hf", "olmo2_to_hf"]
