"""Arcee AFM: Llama with an ungated squared-ReLU MLP.

Arcee AI, "AFM-4.5B", 2025 (model card arcee-ai/AFM-4.5B). A `LlamaConfig` with
``architecture="arcee"``: transformers 5.25's ``ArceeForCausalLM`` is Llama's
forward (pre-norm RMSNorm, rotary in the half-split layout, grouped-query attention,
scores ``d^-1/2``, ``attention_bias`` on q/k/v/o) with the MLP

    m = relu(x W_upᵀ + b_up)² W_downᵀ + b_down

(``ungated_mlp``, ``hidden_act: relu2``; no ``gate_proj``). AFM-4.5B's rotary is
YaRN; ``rms_norm_eps`` defaults to 1e-5. llama.cpp's ``arcee`` (GGUF) permutes q/k
rows as Llama's and loads q/k/v biases only.
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

_ARCEE: dict[str, Any] = {"ungated_mlp": True, "hidden_act": "relu2"}
_SWITCHES = ("rope_type", "attention_bias", "attention_out_bias", "mlp_bias", *_ARCEE)


def arcee_from_hf(hf: Mapping[str, Any]) -> LlamaConfig:
    """A ``model_type: arcee`` ``config.json`` as a `LlamaConfig`.

    Raises:
        UnsupportedError: a ``hidden_act`` other than ``relu2``.
    """
    bias = bool(hf.get("attention_bias", False))
    return LlamaConfig(
        **common_from_hf({"rms_norm_eps": 1e-5, **hf}, "config.json", act="relu2"),
        **_ARCEE,
        architecture="arcee",
        attention_bias=bias,
        attention_out_bias=bias,
        mlp_bias=bool(hf.get("mlp_bias", False)),
    )


def arcee_to_hf(c: LlamaConfig) -> dict[str, Any]:
    """The ``config.json`` of an Arcee `LlamaConfig`."""
    for name, want in _ARCEE.items():
        if getattr(c, name) != want:
            raise UnsupportedError(
                f"LlamaConfig.{name} must be {want!r} in an arcee config "
                "(transformers' Arcee MLP is up/down with the squared ReLU)"
            )
    hf = common_to_hf(c, "ArceeForCausalLM", "arcee", _SWITCHES)
    hf["mlp_bias"] = c.mlp_bias
    # transformers' Arcee defaults (bos 128000, eos 128001) lie outside a small
    # vocabulary; the token ids are the tokenizer's, written by entrenar.io
    hf.update(bos_token_id=None, eos_token_id=None, pad_token_id=None)
    return hf


def _tiny() -> LlamaConfig:
    """The squared-ReLU up/down MLP, YaRN (AFM-4.5B's), untied, no biases.

    As AFM-4.5B (and llama.cpp's graph, which loads no o_proj or MLP bias);
    `test_full_finetuning_gradients_equal_transformers` has a biased variant.
    """
    return LlamaConfig(
        **TINY_SIZES,
        **_ARCEE,
        architecture="arcee",
        rms_norm_eps=1e-5,
        rope_type="yarn",
        rope_factor=2.0,
        rope_original_max_position_embeddings=8,
    )


register_family(
    LlamaConfig,
    "arcee",
    "Arcee AFM: Llama with an ungated up/down MLP and the squared ReLU",
    hf_class="ArceeForCausalLM",
    from_hf=arcee_from_hf,
    to_hf=arcee_to_hf,
    tiny=_tiny,
    defaults=_ARCEE,
)

__all__ = ["arcee_from_hf", "arcee_to_hf"]
