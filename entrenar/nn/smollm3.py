"""SmolLM3: Llama with no rotary embeddings in some layers (NoPE).

Hugging Face, "SmolLM3: smol, multilingual, long-context reasoner", 2025 (after
Yang et al., "Rope to Nope and Back Again: A New Hybrid Attention Strategy", 2025).
A `LlamaConfig` with ``architecture="smollm3"`` and ``nope_layers``: a NoPE layer
attends with its queries and keys as projected, unrotated.

transformers 5.25's rule (``SmolLM3Config.__post_init__``): ``no_rope_layers`` is a
list of ints per layer, 1 where the layer *uses* rotary; when absent, layer ``i``
uses it unless ``(i + 1) % no_rope_layer_interval == 0`` (interval 4: every fourth
layer is NoPE). With ``use_sliding_window`` and a ``sliding_window``, the default
``layer_types`` make the NoPE layers the sliding ones; explicit ``layer_types`` win,
and slide whatever ``use_sliding_window`` says (transformers' mask follows them).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from entrenar.errors import FormatError
from entrenar.nn.decoder_config import (
    TINY_SIZES,
    common_from_hf,
    common_to_hf,
    register_family,
    sliding_from_hf,
)
from entrenar.nn.llama import LlamaConfig

_SWITCHES = (
    "rope_type",
    "attention_bias",
    "attention_out_bias",
    "mlp_bias",
    "sliding_window",
    "layer_types",
    "nope_layers",
)


def _nope(hf: Mapping[str, Any], n: int) -> tuple[bool, ...]:
    """Per layer, True for NoPE: ``no_rope_layers`` zeros, or the interval rule."""
    uses = hf.get("no_rope_layers")
    if uses is None:
        interval = int(hf.get("no_rope_layer_interval") or 4)
        return tuple((i + 1) % interval == 0 for i in range(n))
    if not isinstance(uses, (list, tuple)) or len(uses) != n:
        raise FormatError(
            f"config.json: no_rope_layers must list {n} values (1: the layer uses "
            f"rotary, 0: NoPE), got {str(uses)[:60]!r}"
        )
    return tuple(not bool(u) for u in uses)


def smollm3_from_hf(hf: Mapping[str, Any]) -> LlamaConfig:
    """A ``model_type: smollm3`` ``config.json`` as a `LlamaConfig`."""
    n = int(hf["num_hidden_layers"])
    nope = _nope(hf, n)
    layout = None  # transformers' default: the NoPE layers slide, when asked to
    if hf.get("use_sliding_window") and hf.get("sliding_window") is not None:
        layout = ["sliding_attention" if x else "full_attention" for x in nope]
    # explicit sliding layer types slide even without use_sliding_window:
    # transformers' mask follows layer_types (its eager attention does)
    window, types = sliding_from_hf(hf, "config.json", layout)
    bias = bool(hf.get("attention_bias", False))
    return LlamaConfig(
        **common_from_hf(hf, "config.json", default_theta=2_000_000.0),
        architecture="smollm3",
        attention_bias=bias,
        attention_out_bias=bias,
        mlp_bias=bool(hf.get("mlp_bias", False)),
        sliding_window=window,
        layer_types=types,
        nope_layers=nope if any(nope) else None,
    )


def smollm3_to_hf(c: LlamaConfig) -> dict[str, Any]:
    """The ``config.json`` of a SmolLM3 `LlamaConfig`."""
    hf = common_to_hf(c, "SmolLM3ForCausalLM", "smollm3", _SWITCHES)
    nope = c.nope_layers or (False,) * c.num_layers
    types = c.layer_types
    if c.sliding_window is not None and types is None:
        types = ("sliding_attention",) * c.num_layers  # every layer slides
    hf.update(
        mlp_bias=c.mlp_bias,
        no_rope_layers=[int(not x) for x in nope],
        use_sliding_window=c.sliding_window is not None,
        sliding_window=c.sliding_window,
        layer_types=list(types or ("full_attention",) * c.num_layers),
    )
    # transformers' SmolLM3 defaults (Llama 3's 128000-128004) lie outside a small
    # vocabulary; the token ids are the tokenizer's, written by entrenar.io
    hf.update(bos_token_id=None, eos_token_id=None, pad_token_id=None)
    return hf


def _tiny() -> LlamaConfig:
    """Four layers, the fourth NoPE and sliding (window 4), biases, tied, yarn.

    transformers' default layout at interval 4, and llama.cpp's (period 4).
    """
    return LlamaConfig(
        **{**TINY_SIZES, "num_layers": 4},
        architecture="smollm3",
        nope_layers=(False, False, False, True),
        sliding_window=4,
        layer_types=("full_attention",) * 3 + ("sliding_attention",),
        attention_bias=True,
        attention_out_bias=True,
        mlp_bias=True,
        tie_word_embeddings=True,
        rope_theta=2_000_000.0,
        rope_type="yarn",
        rope_factor=2.0,
        rope_original_max_position_embeddings=8,
    )


register_family(
    LlamaConfig,
    "smollm3",
    "SmolLM3: Llama with NoPE layers (no rotary on every fourth layer by default)",
    hf_class="SmolLM3ForCausalLM",
    from_hf=smollm3_from_hf,
    to_hf=smollm3_to_hf,
    tiny=_tiny,
)

__all__ = ["smollm3_from_hf", "smollm3_to_hf"]
