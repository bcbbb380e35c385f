"""OLMo 2 and 3: Llama with norms on the sublayer outputs, q/k norms over rows.

OLMo et al., "2 OLMo 2 Furious", 2024; Ai2, "OLMo 3", 2025. `LlamaConfig`
families with ``architecture="olmo2"`` / ``"olmo3"``:

- ``post_norms``: no norm before attention or the MLP; each sublayer's output is
  normalised, then added: ``h = h + RMSNorm(Attn(h))``, ``h = h + RMSNorm(MLP(h))``
  (``post_attention_layernorm``, ``post_feedforward_layernorm``);
- ``qk_norm`` with ``qk_norm_whole``: RMSNorm of the ``H d`` query and ``KV d`` key
  values of a token at once (one mean square over all heads), before rotary;
- untied head, ``rms_norm_eps`` 1e-5, optional q/k/v/o biases;
- OLMo 3 adds sliding-window layers (``layer_types``; by default every layer but
  each fourth slides, window 4096) whose rotary is unscaled, at the sliding
  layers' own base (transformers 5's ``rope_parameters`` per layer type; a plain
  ``rope_theta`` / ``rope_scaling`` is the global layers' scaling and both bases):
  ``rope_local_theta``, set whenever a layer slides.
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
    rope_by_layer_type,
    rope_to_hf,
    sliding_from_hf,
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


def olmo3_from_hf(hf: Mapping[str, Any]) -> LlamaConfig:
    """A ``model_type: olmo3`` ``config.json`` as a `LlamaConfig`.

    ``layer_types`` default to transformers' (layer ``i`` slides unless ``(i + 1)
    % 4 == 0``); sliding layers with ``sliding_window: null`` are refused.
    """
    theta = 500_000.0  # transformers' Olmo3Config.default_theta
    fields = common_from_hf({"rms_norm_eps": 1e-5, **hf}, "config.json", theta)
    local: float | None = fields["rope_theta"]
    layered = rope_by_layer_type(hf, "config.json", theta)
    if layered is not None:
        full, slide = layered
        fields.update(full)
        local = full["rope_theta"] if slide is None else slide
    n = fields["num_layers"]
    layout = [
        "sliding_attention" if (i + 1) % 4 else "full_attention" for i in range(n)
    ]
    window, types = sliding_from_hf(hf, "config.json", layout, 4096)
    if types is None:
        local = None
    bias = bool(hf.get("attention_bias", False))
    return LlamaConfig(
        **fields,
        **_OLMO2,
        architecture="olmo3",
        attention_bias=bias,
        attention_out_bias=bias,
        sliding_window=window,
        layer_types=types,
        rope_local_theta=local,
    )


def olmo3_to_hf(c: LlamaConfig) -> dict[str, Any]:
    """The ``config.json`` of an OLMo 3 `LlamaConfig` (``rope_parameters`` per type).

    Raises:
        UnsupportedError: sliding layers without ``rope_local_theta`` (OLMo 3's
            sliding layers rotate unscaled at their own base), or the reverse.
    """
    _check(c, "OLMo 3")
    if (c.sliding_window is None) != (c.rope_local_theta is None):
        raise UnsupportedError(
            "OLMo 3's sliding layers rotate at rope_local_theta, unscaled: set "
            "LlamaConfig.sliding_window and rope_local_theta together (or neither)"
        )
    allowed = (*_SWITCHES, "sliding_window", "layer_types", "rope_local_theta")
    hf = common_to_hf(c, "Olmo3ForCausalLM", "olmo3", allowed)
    full = {"rope_type": "default", **(rope_to_hf(c) or {}), "rope_theta": c.rope_theta}
    local = c.rope_local_theta or c.rope_theta
    del hf["rope_theta"], hf["rope_scaling"]
    types = c.layer_types or (
        ("sliding_attention" if c.sliding_window else "full_attention",) * c.num_layers
    )
    hf.update(
        rope_parameters={
            "full_attention": full,
            "sliding_attention": {"rope_type": "default", "rope_theta": local},
        },
        sliding_window=c.sliding_window,
        layer_types=list(types),
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
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


def _tiny_olmo3() -> LlamaConfig:
    """OLMo 3: a sliding layer (window 4, its own base) and a global one (yarn)."""
    return LlamaConfig(
        **TINY_SIZES,
        **_OLMO2,
        architecture="olmo3",
        rms_norm_eps=1e-5,
        attention_bias=True,
        attention_out_bias=True,
        sliding_window=4,
        layer_types=("sliding_attention", "full_attention"),
        rope_theta=500_000.0,
        rope_local_theta=10_000.0,
        rope_type="yarn",
        rope_factor=2.0,
        rope_original_max_position_embeddings=8,
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

register_family(
    LlamaConfig,
    "olmo3",
    "OLMo 3: OLMo 2 with sliding-window layers (unscaled rotary, own base)",
    hf_class="Olmo3ForCausalLM",
    from_hf=olmo3_from_hf,
    to_hf=olmo3_to_hf,
    tiny=_tiny_olmo3,
    in_gguf=False,  # llama.cpp converts OLMo 3 as olmo2 (with its window keys)
    defaults=_OLMO2,
)

__all__ = ["olmo2_from_hf", "olmo2_to_hf", "olmo3_from_hf", "olmo3_to_hf"]
