"""GLM-4.5, GLM-4.5-Air, GLM-4.6: grouped-query attention and DeepSeekMoE.

GLM-4.5 Team, "GLM-4.5: Agentic, Reasoning, and Coding (ARC) Foundation Models",
2025; transformers 5.25's ``modeling_glm4_moe.py`` is the reference.
`Glm4MoeConfig` is a `DeepseekMoeConfig` (`entrenar.nn.deepseek_moe`: the first
``first_k_dense_replace`` layers dense, then DeepSeek-V3's sigmoid routing with
``e_score_correction_bias``, ``n_group`` / ``topk_group``, ``norm_topk_prob``,
``routed_scaling_factor`` and ``n_shared_experts`` shared experts; the layers
unrolled under Hugging Face's names) whose attention is `LlamaConfig`'s
grouped-query attention::

    q = x W_qᵀ + b_q,  k = x W_kᵀ + b_k,  v = x W_vᵀ + b_v    (attention_bias)
    q, k = RMSNorm_d(q; g_q), RMSNorm_d(k; g_k)  per head     (use_qk_norm)
    q, k = rope(q), rope(k)  on the first r = d · partial_rotary_factor values
                             (0.5 when the file has none), Hugging Face's halves
    o = softmax(q kᵀ / sqrt(d) + M) v W_oᵀ                   (no bias on o_proj)

``head_dim`` need not be ``D / H`` (GLM-4.5: 128 with ``D`` 5120 and 96 heads).
The multi-token-prediction layers the Hub's checkpoints hold past the last layer
(``num_nextn_predict_layers``, 1) are skipped, as transformers skips them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from entrenar.errors import ConfigError, UnsupportedError
from entrenar.nn.decoder_config import (
    SWITCHES,
    TINY_SIZES,
    check_hidden_act,
    common_from_hf,
    common_to_hf,
    register_family,
)
from entrenar.nn.deepseek_moe import (
    DeepseekMoeConfig,
    deepseek_moe_from_hf_tensors,
    deepseek_moe_to_hf_tensors,
)
from entrenar.types import Params

_SWITCHES = (
    "rope_type",
    "partial_rotary_factor",
    "attention_bias",
    "qk_norm",
    "num_experts",
)
"""The `LlamaConfig` switches a GLM-4.5 layer has (`Glm4MoeConfig` refuses others)."""


@dataclasses.dataclass(frozen=True)
class Glm4MoeConfig(DeepseekMoeConfig):
    """GLM-4.5's grouped-query attention on `DeepseekMoeConfig` (module docstring).

    The attention is `LlamaConfig`'s with q/k/v biases (``attention_bias``), the
    optional per-head q/k norms (``qk_norm``) and partial rotary; the switches
    outside `_SWITCHES` are refused (transformers' model has none of them).
    """

    def __post_init__(self) -> None:
        super().__post_init__()
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        off = [n for n in SWITCHES if n not in _SWITCHES]
        on = [n for n in off if getattr(self, n) != defaults[n]]
        if self.output_router_logits:
            on.append("output_router_logits")
        if self.topk_method != "noaux_tc":
            on.append("topk_method")
        if on:
            raise ConfigError(
                f"Glm4MoeConfig does not take {sorted(on)}: GLM-4.5's layers have "
                f"none of them (it sets {sorted(_SWITCHES)}; no auxiliary router "
                "loss, sigmoid noaux_tc routing)"
            )

    def _attention_shapes(self) -> dict[str, Any]:
        d, hd, bias = self.hidden_size, self.hd, self.attention_bias
        qd, kvd = self.num_heads * hd, self.num_kv_heads * hd

        def lin(out: int, fan_in: int, b: bool) -> dict[str, Any]:
            return {"weight": (out, fan_in), **({"bias": (out,)} if b else {})}

        attn = {
            "q_proj": lin(qd, d, bias),
            "k_proj": lin(kvd, d, bias),
            "v_proj": lin(kvd, d, bias),
            "o_proj": lin(d, qd, False),
        }
        if self.qk_norm:  # per head
            attn["q_norm"] = {"weight": (hd,)}
            attn["k_norm"] = {"weight": (hd,)}
        return attn

    def _self_attention(
        self,
        ap: Params,
        x: jax.Array,
        rope: tuple[jax.Array, jax.Array],
        mask: jax.Array | None,
        kv: tuple[jax.Array, jax.Array] | None,
        i: int,
        pos: jax.Array | None,
        kernel: bool,
    ) -> tuple[jax.Array, Any]:
        """`LlamaConfig`'s grouped-query attention of layer ``i`` (module docstring)."""
        index = None if kv is None else jnp.int32(i)
        return self._gqa(ap, x, rope, mask, kv, index, pos, (kernel, None))


_DEFAULTS = dict(
    intermediate_size=10944, num_hidden_layers=46, num_attention_heads=96,
    num_key_value_heads=8, max_position_embeddings=131072, rms_norm_eps=1e-5,
    partial_rotary_factor=0.5,
)  # fmt: skip
"""transformers' `Glm4MoeConfig` defaults of the shared fields entrenar reads."""


def glm4_moe_from_hf(hf: Mapping[str, Any]) -> Glm4MoeConfig:
    """A ``model_type: glm4_moe`` ``config.json`` as a `Glm4MoeConfig`.

    transformers' `Glm4MoeConfig` defaults where a key is missing.

    Raises:
        UnsupportedError: a quantized checkpoint (the Hub's FP8 GLM-4.5), a
            router auxiliary loss, or an activation other than SiLU.
    """
    check_hidden_act(hf, "config.json", "silu")
    quant = hf.get("quantization_config")
    if quant:
        method = quant.get("quant_method") if isinstance(quant, Mapping) else quant
        raise UnsupportedError(
            f"config.json: quantization_config (quant_method {method!r}) is not "
            "supported for glm4_moe: entrenar reads float checkpoints (bfloat16, "
            "float32); use the bfloat16 release or dequantize first"
        )
    if hf.get("output_router_logits"):
        raise UnsupportedError(
            "config.json: output_router_logits true is not supported for glm4_moe "
            "(transformers' GLM-4.5 computes no auxiliary router loss)"
        )
    hf = {**_DEFAULTS, **hf}  # a factor in rope_parameters wins over the top level
    n = int(hf["num_hidden_layers"])
    return Glm4MoeConfig(
        **common_from_hf(hf, "config.json", partial_rotary=True),
        architecture="glm4_moe",
        attention_bias=bool(hf.get("attention_bias", False)),
        qk_norm=bool(hf.get("use_qk_norm", False)),
        first_k_dense_replace=min(n, int(hf.get("first_k_dense_replace", 1) or 0)),
        num_experts=int(hf.get("n_routed_experts", 128)),
        num_experts_per_tok=int(hf.get("num_experts_per_tok", 8)),
        norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
        moe_intermediate_size=int(hf.get("moe_intermediate_size", 1408)),
        n_shared_experts=int(hf.get("n_shared_experts", 1) or 0),
        n_group=int(hf.get("n_group") or 1),
        topk_group=int(hf.get("topk_group") or 1),
        routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
        num_nextn_predict_layers=int(
            hf.get("num_nextn_predict_layers", hf.get("num_mtp_layers", 1)) or 0
        ),
    )


def glm4_moe_to_hf(c: Glm4MoeConfig) -> dict[str, Any]:
    """The ``config.json`` of a `Glm4MoeConfig` (transformers' keys)."""
    hf = common_to_hf(c, "Glm4MoeForCausalLM", "glm4_moe", _SWITCHES)
    hf.update(
        partial_rotary_factor=c.partial_rotary_factor,  # 1 too: not the 0.5 default
        attention_bias=c.attention_bias,
        use_qk_norm=c.qk_norm,
        first_k_dense_replace=c.first_k_dense_replace,
        n_routed_experts=c.num_experts,
        num_experts_per_tok=c.num_experts_per_tok,
        norm_topk_prob=c.norm_topk_prob,
        moe_intermediate_size=c.expert_size,
        n_shared_experts=c.n_shared_experts,
        n_group=c.n_group,
        topk_group=c.topk_group,
        routed_scaling_factor=c.routed_scaling_factor,
        num_nextn_predict_layers=c.num_nextn_predict_layers,
        # transformers' GLM token defaults lie outside a small vocabulary; the
        # token ids are the tokenizer's, written by entrenar.io
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    return hf


def _tiny() -> Glm4MoeConfig:
    """Every GLM-4.5 feature on, at the conformance tests' sizes.

    ``head_dim`` 16 with ``D / H`` 8, q/k/v biases, q/k norms, half of each head
    rotated, a dense first layer then 2 MoE layers, a shared expert 24 wide, top-3
    of 8 experts in 2 of 4 groups renormalised, a routed scale, one
    multi-token-prediction layer in the checkpoint.
    """
    return Glm4MoeConfig(
        **{**TINY_SIZES, "num_layers": 3},
        architecture="glm4_moe",
        rms_norm_eps=1e-5,
        attention_bias=True,
        qk_norm=True,
        partial_rotary_factor=0.5,
        first_k_dense_replace=1,
        num_experts=8,
        num_experts_per_tok=3,
        moe_intermediate_size=12,
        n_shared_experts=2,
        n_group=4,
        topk_group=2,
        routed_scaling_factor=2.5,
        num_nextn_predict_layers=1,
    )


_FAMILY = dict(
    num_experts=8, num_experts_per_tok=2, moe_intermediate_size=None,
    n_shared_experts=1, first_k_dense_replace=1, partial_rotary_factor=0.5,
    attention_bias=True,
)  # fmt: skip
"""A from-scratch GLM-4.5 model's switches (`Architecture.make_config`)."""

register_family(
    Glm4MoeConfig,
    "glm4_moe",
    "GLM-4.5 / 4.5-Air / 4.6: grouped-query attention with half-head rotary, "
    "dense first layers then DeepSeekMoE (sigmoid group-limited routing, shared "
    "experts)",
    hf_class="Glm4MoeForCausalLM",
    from_hf=glm4_moe_from_hf,
    to_hf=glm4_moe_to_hf,
    tiny=_tiny,
    gguf_name="glm4moe",  # entrenar.io.glm4moe_gguf
    defaults=_FAMILY,
    from_hf_tensors=deepseek_moe_from_hf_tensors,
    to_hf_tensors=deepseek_moe_to_hf_tensors,
)

__all__ = ["Glm4MoeConfig", "glm4_moe_from_hf", "glm4_moe_to_hf"]
