"""Cohere Command-R / Aya (``cohere``) and Command-R7B / Command-A (``cohere2``).

Cohere For AI, "Command R" model cards (c4ai-command-r-v01, -08-2024, -plus),
"Aya Expanse" and "Aya 23" (Aryabumi et al., 2024), "Command R7B" (12-2024) and
"Command A" (Cohere et al., 2025). transformers 5.25's ``modeling_cohere.py`` and
``modeling_cohere2.py`` are the reference. `LlamaConfig` families with
``architecture="cohere"`` / ``"cohere2"``; a layer is *parallel*::

    x = LayerNorm(h)                        (input_layernorm: gain, no bias)
    h = h + Attn(x) + SwiGLU(x)
    logits = LayerNorm(h) Eᵀ · logit_scale  (tied head)

- ``layer_norm``: every norm subtracts the mean, ``(x - μ) / sqrt(σ² + ε) · w`` in
  float32 (``CohereLayerNorm``; ``layer_norm_eps``, default 1e-5);
- ``parallel_residual``: attention and the MLP read the same norm's output; there
  is no ``post_attention_layernorm``;
- ``rope_interleave``: rotary pairs are ``(x[2i], x[2i+1])`` (``rotate_half``
  flattens ``stack([-x[1::2], x[0::2]])``, the tables are ``repeat_interleave``'d);
- ``logit_scale`` multiplies the logits (0.0625 by default);
- ``cohere``'s ``use_qk_norm`` (Command-R+): a LayerNorm of each query and key head
  over its ``d`` values before rotary, with a gain per head (``qk_norm`` with
  ``qk_norm_heads``: ``q_norm (L, H, d)``, ``k_norm (L, KV, d)``); ``attention_bias``
  puts biases on q, k, v and o_proj;
- ``cohere2``: sliding-window layers (``layer_types``; by default layer ``i``
  slides unless ``(i + 1) % sliding_window_pattern == 0``, pattern 4, window 4096)
  and only the sliding layers rotate: every full-attention layer is NoPE
  (``nope_layers`` are the full layers, derived, never read from the file).

The head is tied in every Cohere checkpoint (``tie_word_embeddings`` true by
default); an untied head is read and written as transformers allows it.
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
    sliding_from_hf,
    sliding_layers,
)
from entrenar.nn.llama import LlamaConfig

COHERE: dict[str, Any] = {
    "layer_norm": True,
    "parallel_residual": True,
    "rope_interleave": True,
}
"""The switches both Cohere families always set."""
_SWITCHES = ("rope_type", "attention_bias", "attention_out_bias", "logit_scale",
             *COHERE)  # fmt: skip
_DEFAULTS = {
    "layer_norm_eps": 1e-5,
    "tie_word_embeddings": True,
    "max_position_embeddings": 8192,
}  # transformers' CohereConfig / Cohere2Config


def _check(c: LlamaConfig, family: str) -> None:
    for name, want in COHERE.items():
        if getattr(c, name) != want:
            raise UnsupportedError(
                f"LlamaConfig.{name} must be {want!r} in a {family} config"
            )


def _fields(hf: Mapping[str, Any], theta: float) -> dict[str, Any]:
    """The fields both families read: ``layer_norm_eps``, biases, ``logit_scale``."""
    hf = {**_DEFAULTS, **hf}
    fields = common_from_hf(
        {**hf, "rms_norm_eps": hf["layer_norm_eps"]}, "config.json", theta
    )
    bias = bool(hf.get("attention_bias", False))
    scale = hf.get("logit_scale", 0.0625)
    return {
        **fields,
        **COHERE,
        "attention_bias": bias,
        "attention_out_bias": bias,
        "logit_scale": None if scale is None else float(scale),
    }


def _to_hf(c: LlamaConfig, family: str, allowed: tuple[str, ...]) -> dict[str, Any]:
    """The ``config.json`` entries both families write (``layer_norm_eps``)."""
    name = "Cohere" if family == "cohere" else "Cohere2"
    _check(c, family)
    hf = common_to_hf(c, f"{name}ForCausalLM", family, allowed)
    hf["layer_norm_eps"] = hf.pop("rms_norm_eps")
    # None: transformers' 0.0625 would apply; a missing scale is 1
    hf["logit_scale"] = 1.0 if c.logit_scale is None else c.logit_scale
    # transformers' defaults (pad 0, bos 5, eos 255001) may lie outside a small
    # vocabulary; the token ids are the tokenizer's, written by entrenar.io
    hf.update(bos_token_id=None, eos_token_id=None, pad_token_id=None)
    return hf


def cohere_from_hf(hf: Mapping[str, Any]) -> LlamaConfig:
    """A ``model_type: cohere`` ``config.json`` as a `LlamaConfig`."""
    qk = bool(hf.get("use_qk_norm", False))
    return LlamaConfig(
        **_fields(hf, 500_000.0),  # transformers' CohereConfig.default_theta
        architecture="cohere",
        qk_norm=qk,
        qk_norm_heads=qk,
    )


def cohere_to_hf(c: LlamaConfig) -> dict[str, Any]:
    """The ``config.json`` of a Cohere (Command-R) `LlamaConfig`.

    Raises:
        UnsupportedError: q/k norms other than Cohere's per-head ones.
    """
    if c.qk_norm != c.qk_norm_heads:
        raise UnsupportedError(
            "Cohere's q/k norms (use_qk_norm) have a gain per head: set "
            "LlamaConfig.qk_norm and qk_norm_heads together"
        )
    hf = _to_hf(c, "cohere", (*_SWITCHES, "qk_norm", "qk_norm_heads"))
    hf["use_qk_norm"] = c.qk_norm
    return hf


def cohere2_nope_layers(c: LlamaConfig) -> tuple[bool, ...] | None:
    """Cohere 2's NoPE layers: the full-attention ones (None: every layer slides)."""
    nope = tuple(not s for s in sliding_layers(c))
    return nope if any(nope) else None


def cohere2_from_hf(hf: Mapping[str, Any]) -> LlamaConfig:
    """A ``model_type: cohere2`` ``config.json`` as a `LlamaConfig`.

    ``layer_types`` default to transformers' (``sliding_window_pattern``, 4);
    sliding layers with ``sliding_window: null`` are refused.
    """
    n = int(hf["num_hidden_layers"])
    period = int(hf.get("sliding_window_pattern") or 4)
    layout = [
        "sliding_attention" if (i + 1) % period else "full_attention" for i in range(n)
    ]
    window, types = sliding_from_hf(hf, "config.json", layout, 4096)
    nope = tuple(t != "sliding_attention" for t in types or ("",) * n)
    return LlamaConfig(
        **_fields(hf, 10_000.0),
        architecture="cohere2",
        sliding_window=window,
        layer_types=types,
        nope_layers=nope if any(nope) else None,
    )


def cohere2_to_hf(c: LlamaConfig) -> dict[str, Any]:
    """The ``config.json`` of a Cohere 2 (Command-R7B, Command-A) `LlamaConfig`.

    Raises:
        UnsupportedError: ``nope_layers`` other than the full-attention layers
            (transformers' Cohere 2 rotates exactly the sliding ones).
    """
    if c.nope_layers != cohere2_nope_layers(c):
        raise UnsupportedError(
            "Cohere 2 rotates the sliding layers only: LlamaConfig.nope_layers must "
            f"be the full-attention layers, {cohere2_nope_layers(c)}, got "
            f"{c.nope_layers}"
        )
    allowed = (*_SWITCHES, "sliding_window", "layer_types", "nope_layers")
    hf = _to_hf(c, "cohere2", allowed)
    types = c.layer_types or (
        ("sliding_attention" if c.sliding_window else "full_attention",) * c.num_layers
    )
    hf.update(sliding_window=c.sliding_window, layer_types=list(types))
    return hf


def _tiny_cohere() -> LlamaConfig:
    """Command-R+: per-head q/k norms, q/k/v/o biases, linear rope, tied head."""
    return LlamaConfig(
        **TINY_SIZES,
        **COHERE,
        architecture="cohere",
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        qk_norm=True,
        qk_norm_heads=True,
        attention_bias=True,
        attention_out_bias=True,
        logit_scale=0.5,
        rope_type="linear",
        rope_factor=2.0,
    )


def _tiny_cohere2() -> LlamaConfig:
    """Command-R7B: a sliding layer (window 4, rotary) and a full one (NoPE)."""
    return LlamaConfig(
        **TINY_SIZES,
        **COHERE,
        architecture="cohere2",
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        attention_bias=True,
        attention_out_bias=True,
        logit_scale=0.5,
        sliding_window=4,
        layer_types=("sliding_attention", "full_attention"),
        nope_layers=(False, True),
        rope_type="linear",
        rope_factor=2.0,
    )


register_family(
    LlamaConfig,
    "cohere",
    "Command-R, Aya: parallel attention and MLP, LayerNorm, interleaved rotary, "
    "logit scale, per-head q/k norms",
    hf_class="CohereForCausalLM",
    from_hf=cohere_from_hf,
    to_hf=cohere_to_hf,
    tiny=_tiny_cohere,
    gguf_name="command-r",
    defaults=COHERE,
)

register_family(
    LlamaConfig,
    "cohere2",
    "Command-R7B, Command-A: Cohere's layers, sliding-window layers with rotary, "
    "full-attention layers without",
    hf_class="Cohere2ForCausalLM",
    from_hf=cohere2_from_hf,
    to_hf=cohere2_to_hf,
    tiny=_tiny_cohere2,
    defaults=COHERE,
)

__all__ = [
    "COHERE",
    "cohere2_from_hf",
    "cohere2_nope_layers",
    "cohere2_to_hf",
    "cohere_from_hf",
    "cohere_to_hf",
]
