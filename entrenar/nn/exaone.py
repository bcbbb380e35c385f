"""LG EXAONE 4.0: OLMo 2's output norms, per-head q/k norms, NoPE global layers.

LG AI Research, "EXAONE 4.0: Unified Large Language Models Integrating
Non-reasoning and Reasoning Modes", 2025. A `LlamaConfig` with
``architecture="exaone4"`` (transformers 5.25's ``Exaone4ForCausalLM``):

- ``post_norms``: no norm before attention or the MLP; ``h = h + RMSNorm(Attn(h))``,
  ``h = h + RMSNorm(MLP(h))`` (OLMo 2's ``post_attention_layernorm`` and
  ``post_feedforward_layernorm``);
- ``qk_norm`` per head (``q_norm``, ``k_norm`` of ``d`` values), before rotary;
- hybrid attention: with a ``sliding_window``, the sliding layers (``layer_types``;
  by default every layer but each fourth, ``sliding_window_pattern`` 4, window
  4096) rotate and the global ones do not (``nope_layers``: transformers rotates a
  layer only when ``sliding_window`` is null or the layer slides); without one,
  every layer is global and rotates (EXAONE 4.0 1.2B);
- one rotary scaling for every rotating layer (the 32B model's ``llama3``); no
  biases; ``head_dim`` ``D / H`` unless given; ``rms_norm_eps`` 1e-5.

A ``sliding_window_pattern`` string (``"LLLG"``) without ``layer_types`` is
refused, as transformers 5.25 cannot read it either; EXAONE 4.5 (vision) and
EXAONE MoE are other model types. GGUF: llama.cpp's ``exaone4``, which slides only
at 64 layers (`entrenar.io.gguf_families.SWA_LAYERS`).
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

_EXAONE4: dict[str, Any] = {"post_norms": True, "qk_norm": True}
_SWITCHES = ("rope_type", "sliding_window", "layer_types", "nope_layers", *_EXAONE4)


def exaone4_from_hf(hf: Mapping[str, Any]) -> LlamaConfig:
    """A ``model_type: exaone4`` ``config.json`` as a `LlamaConfig`.

    Raises:
        UnsupportedError: a non-integer ``sliding_window_pattern`` without
            ``layer_types``; sliding layers with a null window.
    """
    fields = common_from_hf({"rms_norm_eps": 1e-5, **hf}, "config.json")
    n = fields["num_layers"]
    window = hf.get("sliding_window", 4096)
    types = hf.get("layer_types")
    if not types and window is not None:
        pattern = hf.get("sliding_window_pattern", 4)
        if isinstance(pattern, bool) or not isinstance(pattern, int) or pattern < 1:
            raise UnsupportedError(
                f"config.json: exaone4's sliding_window_pattern {pattern!r} without "
                "layer_types (transformers 5.25 reads only an integer period); add "
                "layer_types, one 'sliding_attention' or 'full_attention' a layer"
            )
        types = [
            "sliding_attention" if (i + 1) % pattern else "full_attention"
            for i in range(n)
        ]
    if not types:  # no window: every layer global, every layer rotates
        types = ["full_attention"] * n
    nope = tuple(window is not None and t == "full_attention" for t in types)
    slide, layer_types = sliding_from_hf(
        {**hf, "layer_types": types, "sliding_window": window}, "config.json"
    )
    return LlamaConfig(
        **fields,
        **_EXAONE4,
        architecture="exaone4",
        sliding_window=slide,
        layer_types=layer_types,
        nope_layers=nope if any(nope) else None,
    )


def exaone4_to_hf(c: LlamaConfig) -> dict[str, Any]:
    """The ``config.json`` of an EXAONE 4.0 `LlamaConfig`.

    Raises:
        UnsupportedError: OLMo 2's whole-row q/k norms or pre-norms, or NoPE
            layers other than transformers' rule (the global layers when some
            layer slides; all or none otherwise).
    """
    for name, want in {**_EXAONE4, "qk_norm_whole": False}.items():
        if getattr(c, name) != want:
            raise UnsupportedError(
                f"LlamaConfig.{name} must be {want!r} in an exaone4 config"
            )
    slides = sliding_layers(c)
    nope = c.nope_layers or (False,) * c.num_layers
    window = c.sliding_window if any(slides) else None
    want = tuple(not s for s in slides) if any(slides) else nope
    if nope != want or (not any(slides) and len(set(nope)) > 1):
        raise UnsupportedError(
            "EXAONE 4's global layers rotate only when no layer slides: "
            "LlamaConfig.nope_layers must be the full_attention layers (with "
            f"sliding layers), else all or none; got {c.nope_layers}"
        )
    if not any(slides) and all(nope):  # a window with no sliding layer: no rotary
        window = c.max_position_embeddings
    hf = common_to_hf(c, "Exaone4ForCausalLM", "exaone4", _SWITCHES)
    hf.update(
        sliding_window=window,
        layer_types=["sliding_attention" if s else "full_attention" for s in slides],
        # transformers' EXAONE 4 defaults (bos 0, eos 2) suit any vocabulary,
        # but the token ids are the tokenizer's, written by entrenar.io
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    return hf


def _tiny() -> LlamaConfig:
    """A sliding layer (window 4, rotating) then a global NoPE one, llama3 rope."""
    return LlamaConfig(
        **TINY_SIZES,
        **_EXAONE4,
        architecture="exaone4",
        rms_norm_eps=1e-5,
        sliding_window=4,
        layer_types=("sliding_attention", "full_attention"),
        nope_layers=(False, True),
        rope_theta=1_000_000.0,
        rope_type="llama3",
        rope_factor=16.0,
        rope_original_max_position_embeddings=8,
    )


register_family(
    LlamaConfig,
    "exaone4",
    "EXAONE 4.0: output norms, per-head q/k norms, sliding layers and NoPE global ones",
    hf_class="Exaone4ForCausalLM",
    from_hf=exaone4_from_hf,
    to_hf=exaone4_to_hf,
    tiny=_tiny,
    defaults=_EXAONE4,
)

__all__ = ["exaone4_from_hf", "exaone4_to_hf"]
