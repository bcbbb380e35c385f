"""GLM-4 (GLM-4-9B-0414, GLM-4-32B-0414, GLM-Z1) and GLM (GLM-4-9B-chat-hf).

Team GLM, "ChatGLM: A Family of Large Language Models from GLM-130B to GLM-4 All
Tools", 2024; transformers 5.25's ``modeling_glm.py`` and ``modeling_glm4.py`` are
the reference. `LlamaConfig` families with ``architecture="glm"`` / ``"glm4"``:

- q/k/v biases, none on o_proj (``attention_bias``);
- partial rotary on the first half of each head (``partial_rotary_factor``,
  0.5 when the file has none, as transformers sets it) in interleaved pairs
  ``(x_0, x_1), (x_2, x_3), ...`` (``rope_interleave``: transformers'
  ``repeat_interleave`` of ``cos`` / ``sin`` and its pairwise ``rotate_half``);
- one ``gate_up_proj = [W_gate; W_up]`` per layer (``fused_gate_up``, Hugging
  Face's name, so PEFT adapters name GLM's modules);
- GLM-4 (``glm4``) adds a norm on each sublayer's output, four per layer
  (``glm_norms``: Gemma 2's ``sandwich_norms`` under GLM-4's names)::

      h = h + RMSNorm(Attn(RMSNorm(h; g_in)); g_post_self_attn)
      h = h + RMSNorm(MLP(RMSNorm(h; g_post_attention)); g_post_mlp)

  GLM (``glm``) has Llama's two norms.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from entrenar.errors import UnsupportedError
from entrenar.nn.decoder_config import (
    TINY_SIZES,
    check_hidden_act,
    common_from_hf,
    common_to_hf,
    register_family,
)
from entrenar.nn.llama import LlamaConfig

_GLM: dict[str, Any] = {
    "attention_bias": True,
    "fused_gate_up": True,
    "rope_interleave": True,
}
_SWITCHES = ("rope_type", "partial_rotary_factor", *_GLM)


def _from_hf(hf: Mapping[str, Any], family: str, sandwich: bool) -> LlamaConfig:
    check_hidden_act(hf, "config.json", "silu")
    # transformers' GlmConfig / Glm4Config default; one in rope_parameters wins
    hf = {"partial_rotary_factor": 0.5, **hf}
    return LlamaConfig(
        **common_from_hf(hf, "config.json", partial_rotary=True),
        **{**_GLM, "attention_bias": bool(hf.get("attention_bias", True))},
        architecture=family,
        glm_norms=sandwich,
    )


def _to_hf(
    c: LlamaConfig, hf_class: str, family: str, sandwich: bool
) -> dict[str, Any]:
    for name, want in {**_GLM, "glm_norms": sandwich}.items():
        if name != "attention_bias" and getattr(c, name) != want:
            raise UnsupportedError(
                f"LlamaConfig.{name} must be {want!r} in a {family} config "
                f"(transformers' {hf_class} has no other form)"
            )
    allowed = (*_SWITCHES, "glm_norms") if sandwich else _SWITCHES
    hf = common_to_hf(c, hf_class, family, allowed)
    hf["attention_bias"] = c.attention_bias
    hf["partial_rotary_factor"] = c.partial_rotary_factor  # 1 too: not the 0.5 default
    # transformers' GLM token defaults (pad 151329, eos 151329/151336/151338) lie
    # outside a small vocabulary; the token ids are the tokenizer's (entrenar.io)
    hf.update(bos_token_id=None, eos_token_id=None, pad_token_id=None)
    return hf


def glm_from_hf(hf: Mapping[str, Any]) -> LlamaConfig:
    """A ``model_type: glm`` ``config.json`` (GLM-4-9B-chat-hf) as a `LlamaConfig`."""
    return _from_hf(hf, "glm", sandwich=False)


def glm_to_hf(c: LlamaConfig) -> dict[str, Any]:
    """The ``config.json`` of a GLM `LlamaConfig`."""
    return _to_hf(c, "GlmForCausalLM", "glm", sandwich=False)


def glm4_from_hf(hf: Mapping[str, Any]) -> LlamaConfig:
    """A ``model_type: glm4`` ``config.json`` as a `LlamaConfig`."""
    return _from_hf(hf, "glm4", sandwich=True)


def glm4_to_hf(c: LlamaConfig) -> dict[str, Any]:
    """The ``config.json`` of a GLM-4 `LlamaConfig`."""
    return _to_hf(c, "Glm4ForCausalLM", "glm4", sandwich=True)


def _tiny_glm() -> LlamaConfig:
    """q/k/v biases, half of each head rotated in pairs, fused gate_up, linear rope."""
    return LlamaConfig(
        **TINY_SIZES,
        **_GLM,
        architecture="glm",
        partial_rotary_factor=0.5,
        rope_type="linear",
        rope_factor=2.0,
    )


def _tiny_glm4() -> LlamaConfig:
    """GLM's tiny with GLM-4's four norms, 12 of 16 values rotated, no scaling."""
    return LlamaConfig(
        **TINY_SIZES,
        **_GLM,
        architecture="glm4",
        partial_rotary_factor=0.75,
        glm_norms=True,
    )


register_family(
    LlamaConfig,
    "glm",
    "GLM (GLM-4-9B-chat-hf): q/k/v biases, half-head rotary in interleaved pairs, "
    "fused gate_up",
    hf_class="GlmForCausalLM",
    from_hf=glm_from_hf,
    to_hf=glm_to_hf,
    tiny=_tiny_glm,
    in_gguf=False,  # llama.cpp's chatglm graph: not read or written
    defaults={**_GLM, "partial_rotary_factor": 0.5},
)
register_family(
    LlamaConfig,
    "glm4",
    "GLM-4 (GLM-4-9B/32B-0414, GLM-Z1): GLM with norms on both sublayers' outputs",
    hf_class="Glm4ForCausalLM",
    from_hf=glm4_from_hf,
    to_hf=glm4_to_hf,
    tiny=_tiny_glm4,
    defaults={**_GLM, "partial_rotary_factor": 0.5, "glm_norms": True},
)

__all__ = [
    "glm4_from_hf",
    "glm4_to_hf",
    "glm_from_hf",
    "glm_to_hf",
]
