"""OLMoE: a Llama decoder with q/k norms over all heads and a mixture of experts.

Muennighoff et al., "OLMoE: Open Mixture-of-Experts Language Models", 2024
(allenai/OLMoE-1B-7B-0924: 64 experts, top-8). A `LlamaConfig` with
``architecture="olmoe"``, as transformers 5.25's ``OlmoeForCausalLM``:

- pre-norm layers (``input_layernorm``, ``post_attention_layernorm`` before the
  MLP, unlike OLMo 2's post-norms);
- ``qk_norm`` with ``qk_norm_whole``: RMSNorm of the ``H d`` query and ``KV d``
  key values of a token at once, then, with ``clip_qkv`` ``c``, queries, keys and
  values clipped to ``[-c, c]``; then rotary;
- one ``attention_bias`` for q, k, v and o_proj;
- every MLP a sparse mixture (`entrenar.nn.moe`) of ``num_experts`` SwiGLU experts
  of width ``intermediate_size``, top-``num_experts_per_tok``, renormalised only
  with ``norm_topk_prob`` (False by default); the Switch loss with
  ``router_aux_loss_coef`` (default 0.01) when ``output_router_logits``.

Checkpoints name the experts as Qwen's (``mlp.experts.{e}.{gate,up,down}_proj``,
router ``mlp.gate``): `entrenar.nn.moe_families.moe_from_hf_tensors` reads them.
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
from entrenar.nn.moe_families import moe_from_hf_tensors, moe_to_hf_tensors

_OLMOE: dict[str, Any] = {"qk_norm": True, "qk_norm_whole": True}
_SWITCHES = ("rope_type", "attention_bias", "attention_out_bias", "clip_qkv",
             "num_experts", *_OLMOE)  # fmt: skip


def olmoe_from_hf(hf: Mapping[str, Any]) -> LlamaConfig:
    """A ``model_type: olmoe`` ``config.json`` as a `LlamaConfig`."""
    bias = bool(hf.get("attention_bias", False))
    clip = hf.get("clip_qkv")
    experts = hf.get("num_experts", hf.get("num_local_experts", 64))
    fields = common_from_hf({"rms_norm_eps": 1e-5, **hf}, "config.json")
    if fields["head_dim"] is not None:
        if int(fields["head_dim"]) * fields["num_heads"] != fields["hidden_size"]:
            raise UnsupportedError(
                f"config.json: head_dim {fields['head_dim']} is not hidden_size / "
                "num_attention_heads; transformers' OLMoE sizes its q/k norms from "
                "hidden_size, entrenar reads OLMoE with whole-width heads"
            )
        fields["head_dim"] = None
    return LlamaConfig(
        **fields,
        **_OLMOE,
        architecture="olmoe",
        attention_bias=bias,
        attention_out_bias=bias,
        clip_qkv=None if clip is None else float(clip),
        num_experts=int(experts),
        num_experts_per_tok=int(hf.get("num_experts_per_tok", 8)),
        norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
        output_router_logits=bool(hf.get("output_router_logits", False)),
        router_aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.01)),
    )


def olmoe_to_hf(c: LlamaConfig) -> dict[str, Any]:
    """The ``config.json`` of an OLMoE `LlamaConfig`.

    Raises:
        UnsupportedError: no experts, experts wider or narrower than
            ``intermediate_size``, q/k norms not over whole rows, or a
            ``head_dim`` other than ``hidden_size / num_heads`` (transformers'
            OLMoE sizes its q/k norms from ``hidden_size``).
    """
    for name, want in _OLMOE.items():
        if getattr(c, name) != want:
            raise UnsupportedError(f"LlamaConfig.{name} must be {want!r} in OLMoE")
    if not c.num_experts:
        raise UnsupportedError("OLMoE is a mixture of experts: num_experts must be > 0")
    if c.expert_size != c.intermediate_size:
        raise UnsupportedError(
            "OLMoE's experts are intermediate_size wide: set moe_intermediate_size "
            f"None (it is {c.moe_intermediate_size})"
        )
    if c.hd * c.num_heads != c.hidden_size:
        raise UnsupportedError(
            f"OLMoE's heads are hidden_size / num_heads = "
            f"{c.hidden_size // c.num_heads} wide; head_dim {c.hd} has no OLMoE "
            "config.json form"
        )
    hf = common_to_hf(c, "OlmoeForCausalLM", "olmoe", _SWITCHES)
    del hf["head_dim"]
    hf.update(
        clip_qkv=c.clip_qkv,
        num_experts=c.num_experts,
        num_experts_per_tok=c.num_experts_per_tok,
        norm_topk_prob=c.norm_topk_prob,
        output_router_logits=c.output_router_logits,
        router_aux_loss_coef=c.router_aux_loss_coef,
        # transformers' OLMoE defaults (pad 1, eos 50279) may lie outside a small
        # vocabulary; the token ids are the tokenizer's, written by entrenar.io
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    return hf


def _tiny() -> LlamaConfig:
    """Biases, clipped q/k/v, linear rope scaling, top-3 of 4 not renormalised."""
    return LlamaConfig(
        **{**TINY_SIZES, "head_dim": None},
        **_OLMOE,
        architecture="olmoe",
        rms_norm_eps=1e-5,
        attention_bias=True,
        attention_out_bias=True,
        clip_qkv=0.9,
        rope_type="linear",
        rope_factor=2.0,
        num_experts=4,
        num_experts_per_tok=3,
        norm_topk_prob=False,
        router_aux_loss_coef=0.01,
    )


register_family(
    LlamaConfig,
    "olmoe",
    "OLMoE: q/k norms over whole rows, clipped q/k/v, a top-k mixture of experts",
    hf_class="OlmoeForCausalLM",
    from_hf=olmoe_from_hf,
    to_hf=olmoe_to_hf,
    tiny=_tiny,
    defaults={**_OLMOE, "num_experts": 64, "num_experts_per_tok": 8,
              "norm_topk_prob": False, "router_aux_loss_coef": 0.01},
    from_hf_tensors=moe_from_hf_tensors,
    to_hf_tensors=moe_to_hf_tensors,
)  # fmt: skip

__all__ = ["olmoe_from_hf", "olmoe_to_hf"]
