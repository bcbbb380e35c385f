"""DeepSeek-V2 and V3 (V2-Lite, V3/R1, Kimi-K2, Moonlight): MLA and DeepSeekMoE.

DeepSeek-AI, "DeepSeek-V2: A Strong, Economical, and Efficient Mixture-of-Experts
Language Model", 2024 (multi-head latent attention, DeepSeekMoE); "DeepSeek-V3
Technical Report", 2024 (sigmoid routing with a bias for the choice only, the
auxiliary-loss-free balancing). transformers 5.25's ``modeling_deepseek_v3.py`` is
the reference; `DeepseekConfig` is a `LlamaConfig` (norms, embeddings, head,
rotary tables, training and generation entry points) with its own layers.

Multi-head latent attention (MLA) of ``x: (T, D)``, ``H`` heads, key head
``d_qk = d_n + d_r`` (``qk_nope_head_dim + qk_rope_head_dim``), value head ``d_v``::

    q   = RMSNorm(x W_qaᵀ) W_qbᵀ        (T, H d_qk)  (q_lora_rank set; else x W_qᵀ)
    c, k_r = split(x W_kvaᵀ)           (T, r), (T, d_r)   kv_a_proj_with_mqa
    k_n, v = split(RMSNorm(c) W_kvbᵀ)  per head (T, H, d_n), (T, H, d_v)
    q = [q_n, rope(q_r)],  k = [k_n, rope(k_r) for every head]
    o   = softmax(q kᵀ · s + M) v W_oᵀ,   s = d_qk^-1/2 · m²

with ``m = 0.1 mscale_all_dim ln(factor) + 1`` under YaRN (transformers'
``yarn_apply_mscale``; 1 otherwise). Rotary embeddings turn the ``d_r`` rope values
only (the tables are ``d_r`` wide: ``head_dim`` is ``qk_rope_head_dim``, as
transformers sets it). ``rope_interleave`` (the checkpoints' layout): the rope
values come in pairs ``(x_0, x_1), (x_2, x_3), ...`` that one frequency turns;
they are taken as ``[x_0, x_2, ...; x_1, x_3, ...]`` and rotated half against half,
which is transformers' ``apply_rotary_pos_emb_interleave`` (the rotated keys stay in
that order; queries and keys alike, so the scores are those of the pairs).

The MLP is DeepSeekMoE (`entrenar.nn.deepseek_moe.DeepseekMoeConfig`: dense
layers first, then routed experts chosen by V3's sigmoid or V2's softmax routing
plus shared experts; the layers unrolled, Hugging Face's names, the
multi-token-prediction layers skipped), which GLM-4.5 shares.

The KV cache holds each layer's expanded keys ``(B, S, H, d_qk)`` and values
``(B, S, H, d_v)`` (not the compressed latent): every attention path entrenar has
takes value heads of another width than the keys' (the JAX path and the native
kernel as they are; the fused path gets the values padded with zeros to ``d_qk``
and its output sliced back).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from entrenar.errors import ConfigError, UnsupportedError
from entrenar.nn.attention import (
    KVCache,
    cached_attention,
    dot_product_attention,
    init_kv_cache,
    write_cache,
)
from entrenar.nn.decoder_config import (
    TINY_SIZES,
    common_from_hf,
    common_to_hf,
    register_family,
)
from entrenar.nn.deepseek_moe import (
    TOPK_METHODS,
    DeepseekMoeConfig,
    deepseek_moe_from_hf_tensors,
    deepseek_moe_to_hf_tensors,
)
from entrenar.nn.fused_attention import fused_attention
from entrenar.nn.linear import linear
from entrenar.nn.rope import interleaved_as_halves, rotate
from entrenar.nn.rope_scaling import yarn_mscale
from entrenar.types import Params


@dataclasses.dataclass(frozen=True)
class DeepseekConfig(DeepseekMoeConfig):
    """DeepSeek-V3's attention on top of `DeepseekMoeConfig` (module docstring).

    ``head_dim`` is the rotary width ``qk_rope_head_dim`` (set from it; the rotary
    tables and scalings read it), ``num_kv_heads`` equals ``num_heads`` (MLA
    expands the latent to every head), ``num_experts`` is ``n_routed_experts``,
    ``intermediate_size`` the dense layers' MLP and ``moe_intermediate_size`` an
    expert's.

    Attributes:
        q_lora_rank: the query's low-rank width (``q_a_proj``, ``q_a_layernorm``,
            ``q_b_proj``); None: one ``q_proj``.
        kv_lora_rank: ``r``, the compressed key/value latent's width.
        qk_nope_head_dim: ``d_n``, a key head's values without rotary.
        qk_rope_head_dim: ``d_r``, a key head's rotated values (shared by heads).
        v_head_dim: ``d_v``, a value head's width.
        rope_interleave: the rope values come in interleaved pairs (module
            docstring; transformers' default, the checkpoints' layout).
        rope_mscale_all_dim: YaRN's ``mscale_all_dim``: the softmax scale is
            multiplied by ``(0.1 mscale_all_dim ln(factor) + 1)²``; 0: not.
    """

    q_lora_rank: int | None = None
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    rope_interleave: bool = True
    rope_mscale_all_dim: float = 0.0

    def __post_init__(self) -> None:
        if self.head_dim is None:
            object.__setattr__(self, "head_dim", self.qk_rope_head_dim)
        super().__post_init__()
        _check_deepseek(self)

    # ------------------------------------------------------------------ shapes
    @property
    def qk_head_dim(self) -> int:
        """``d_qk = d_n + d_r``, a query or key head."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def softmax_scale(self) -> float:
        """``d_qk^-1/2``, times YaRN's ``m²`` (module docstring)."""
        scale = self.qk_head_dim**-0.5
        if self.rope_type != "default" and self.rope_mscale_all_dim:
            m = yarn_mscale(float(self.rope_factor), float(self.rope_mscale_all_dim))
            scale = scale * m * m
        return scale

    def _attention_shapes(self) -> dict[str, Any]:
        d, h, r = self.hidden_size, self.num_heads, self.kv_lora_rank
        bias = self.attention_bias

        def lin(out: int, fan_in: int, b: bool = False) -> dict[str, Any]:
            return {"weight": (out, fan_in), **({"bias": (out,)} if b else {})}

        attn: dict[str, Any] = {}
        if self.q_lora_rank is None:
            attn["q_proj"] = lin(h * self.qk_head_dim, d)
        else:
            attn["q_a_proj"] = lin(self.q_lora_rank, d, bias)
            attn["q_a_layernorm"] = {"weight": (self.q_lora_rank,)}
            attn["q_b_proj"] = lin(h * self.qk_head_dim, self.q_lora_rank)
        attn["kv_a_proj_with_mqa"] = lin(r + self.qk_rope_head_dim, d, bias)
        attn["kv_a_layernorm"] = {"weight": (r,)}
        attn["kv_b_proj"] = lin(h * (self.qk_nope_head_dim + self.v_head_dim), r)
        attn["o_proj"] = lin(d, h * self.v_head_dim, bias)
        return attn

    def init_cache(self, batch: int, max_len: int) -> KVCache:
        """A cache of expanded keys ``(L, B, S, H, d_qk)`` and values ``(.., d_v)``."""
        n, h = self.num_layers, self.num_heads
        k = init_kv_cache(n, batch, max_len, h, self.qk_head_dim, self.dtype)
        v = init_kv_cache(n, batch, max_len, h, self.v_head_dim, self.dtype)
        return KVCache(k.k, v.v, k.pos)

    # ------------------------------------------------------------------- model
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
        """Multi-head latent attention of ``x: (B, T, D)`` (module docstring)."""
        b, t, _ = x.shape
        h, dn, dr, dv = (self.num_heads, self.qk_nope_head_dim,
                         self.qk_rope_head_dim, self.v_head_dim)  # fmt: skip
        r, md = self.kv_lora_rank, self.matmul_dtype
        if self.q_lora_rank is None:
            q = _linear(x, ap["q_proj"], md)
        else:
            qa = self._norm(_linear(x, ap["q_a_proj"], md), ap["q_a_layernorm"])
            q = _linear(qa, ap["q_b_proj"], md)
        q = q.reshape(b, t, h, dn + dr)  # (B, T, H, d_qk)
        ckv = _linear(x, ap["kv_a_proj_with_mqa"], md)  # (B, T, r + d_r)
        c, k_rot = ckv[..., :r], ckv[..., r:]
        c = self._norm(c, ap["kv_a_layernorm"])  # (B, T, r)
        kvb = _linear(c, ap["kv_b_proj"], md).reshape(b, t, h, dn + dv)
        k_nope, v = kvb[..., :dn], kvb[..., dn:]  # (B, T, H, d_n), (B, T, H, d_v)
        q_rot = rotate(self._pairs(q[..., dn:]), rope)  # (B, T, H, d_r)
        k_rot = rotate(self._pairs(k_rot[:, :, None, :]), rope)  # (B, T, 1, d_r)
        q = jnp.concatenate([q[..., :dn], q_rot], axis=-1)
        k = jnp.concatenate(
            [k_nope, jnp.broadcast_to(k_rot, (b, t, h, dr)).astype(k_nope.dtype)], -1
        )  # (B, T, H, d_qk)
        scale = self.softmax_scale()
        if kv is not None and pos is not None:
            ck = write_cache(kv[0], k, jnp.int32(i), pos)  # (L, B, S, H, d_qk)
            cv = write_cache(kv[1], v, jnp.int32(i), pos)  # (L, B, S, H, d_v)
            kv = (ck, cv)
            o = cached_attention(
                q, ck, cv, jnp.int32(i), mask, scale=scale, matmul_dtype=md
            )  # (B, T, H, d_v)
        elif self.uses_fused_attention():  # the kernel wants d_v = d_qk: pad v
            vp = jnp.pad(v, ((0, 0), (0, 0), (0, 0), (0, dn + dr - dv)))
            o = fused_attention(
                q, k, vp, mask, causal=kernel, scale=scale, matmul_dtype=md
            )[..., :dv]  # (B, T, H, d_v)
        else:
            o = dot_product_attention(
                q, k, v, mask, scale=scale, matmul_dtype=md, impl="reference"
            )  # (B, T, H, d_v)
        return _linear(o.reshape(b, t, h * dv), ap["o_proj"], md), kv

    def _pairs(self, x: jax.Array) -> jax.Array:
        """Interleaved rope pairs as halves: ``[x_0, x_2, ...; x_1, x_3, ...]``."""
        if not self.rope_interleave:
            return x
        return interleaved_as_halves(x, x.shape[-1])


def _linear(x: jax.Array, p: Params, md: str | None) -> jax.Array:
    return linear(x, p["weight"], p.get("bias"), matmul_dtype=md)


def _check_deepseek(c: DeepseekConfig) -> None:
    """Raise `ConfigError` for DeepSeek-V3 fields that do not fit together."""
    if c.head_dim != c.qk_rope_head_dim:
        raise ConfigError(
            f"DeepseekConfig.head_dim is the rotary width qk_rope_head_dim = "
            f"{c.qk_rope_head_dim}; got head_dim {c.head_dim} (leave it None)"
        )
    if c.num_kv_heads != c.num_heads:
        raise ConfigError(
            "DeepseekConfig.num_kv_heads must equal num_heads: latent attention "
            f"expands keys and values to every head (got {c.num_kv_heads} of "
            f"{c.num_heads})"
        )
    for name in ("kv_lora_rank", "qk_nope_head_dim", "v_head_dim"):
        if getattr(c, name) <= 0:
            raise ConfigError(f"DeepseekConfig.{name} must be > 0")
    if c.q_lora_rank is not None and c.q_lora_rank <= 0:
        raise ConfigError("DeepseekConfig.q_lora_rank must be > 0 or None")
    if c.v_head_dim > c.qk_head_dim:
        raise ConfigError(
            f"DeepseekConfig.v_head_dim {c.v_head_dim} exceeds the key head "
            f"qk_nope_head_dim + qk_rope_head_dim = {c.qk_head_dim}"
        )
    off = {"sliding_window": c.sliding_window, "layer_types": c.layer_types,
           "nope_layers": c.nope_layers, "qk_norm": c.qk_norm,
           "fused_qkv": c.fused_qkv, "fused_gate_up": c.fused_gate_up,
           "mlp_bias": c.mlp_bias, "moe_bias": c.moe_bias,
           "shared_expert_intermediate_size": c.shared_expert_intermediate_size,
           "swiglu_limit": c.swiglu_limit, "attention_sinks": c.attention_sinks,
           "router_jitter_noise": c.router_jitter_noise,
           "output_router_logits": c.output_router_logits,
           "sandwich_norms": c.sandwich_norms, "post_norms": c.post_norms,
           "glm_norms": c.glm_norms,
           "partial_rotary_factor": c.partial_rotary_factor != 1.0,
           "rope_local_theta": c.rope_local_theta,
           "hidden_act": c.hidden_act != "silu"}  # fmt: skip
    on = sorted(k for k, v in off.items() if v not in (None, False, 0, 0.0))
    if on:
        raise ConfigError(
            f"DeepseekConfig does not take {on}: DeepSeek-V3's layers have none "
            "of them (and no auxiliary router loss)"
        )


# ------------------------------------------------------------ config.json fields
def _rope_mscale_all_dim(hf: Mapping[str, Any]) -> float:
    rope = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
    value = rope.get("mscale_all_dim") if isinstance(rope, Mapping) else None
    return float(value or 0.0)


def _refuse_quantized(hf: Mapping[str, Any], model_type: str) -> None:
    """Raise `UnsupportedError` for a quantized checkpoint (the Hub's FP8 ones)."""
    quant = hf.get("quantization_config")
    if quant:
        method = quant.get("quant_method") if isinstance(quant, Mapping) else quant
        raise UnsupportedError(
            f"config.json: quantization_config (quant_method {method!r}) is not "
            f"supported for {model_type}: entrenar reads float checkpoints "
            "(bfloat16, float32); dequantize the FP8 weights to bfloat16 first"
        )


def _from_hf(
    hf: Mapping[str, Any], family: str, d: Mapping[str, Any], **fields: Any
) -> DeepseekConfig:
    """The fields both families' ``config.json`` share; ``d``: their defaults."""
    heads = int(hf.get("num_attention_heads", 128))
    base = {"num_key_value_heads": heads, "rms_norm_eps": 1e-6,
            "max_position_embeddings": d["max_position_embeddings"]}  # fmt: skip
    hf = {**base, **hf, "head_dim": None}  # head_dim: qk_rope_head_dim
    q_rank = hf.get("q_lora_rank", 1536)
    n = int(hf["num_hidden_layers"])
    bias = bool(hf.get("attention_bias", False))
    return DeepseekConfig(
        **common_from_hf(hf, "config.json"),
        architecture=family,
        attention_bias=bias,
        attention_out_bias=bias,
        q_lora_rank=None if q_rank is None else int(q_rank),
        kv_lora_rank=int(hf.get("kv_lora_rank", 512)),
        qk_nope_head_dim=int(hf.get("qk_nope_head_dim", 128)),
        qk_rope_head_dim=int(hf.get("qk_rope_head_dim", 64)),
        v_head_dim=int(hf.get("v_head_dim") or 128),
        rope_mscale_all_dim=_rope_mscale_all_dim(hf),
        first_k_dense_replace=min(
            n, int(hf.get("first_k_dense_replace", d["first_k_dense_replace"]) or 0)
        ),
        num_experts=int(hf.get("n_routed_experts", hf.get("num_experts", 0)) or 0)
        or d["n_routed_experts"],
        num_experts_per_tok=int(hf.get("num_experts_per_tok") or d["top_k"]),
        moe_intermediate_size=int(
            hf.get("moe_intermediate_size", d["moe_intermediate_size"])
        ),
        n_shared_experts=int(hf.get("n_shared_experts", d["n_shared_experts"]) or 0),
        n_group=int(hf.get("n_group") or 1),
        topk_group=int(hf.get("topk_group") or 1),
        routed_scaling_factor=float(
            hf.get("routed_scaling_factor", d["routed_scaling_factor"])
        ),
        num_nextn_predict_layers=int(
            hf.get("num_nextn_predict_layers", hf.get("num_mtp_layers", 0)) or 0
        ),
        **fields,
    )


V3_DEFAULTS = dict(max_position_embeddings=4096, first_k_dense_replace=3,
                   n_routed_experts=256, top_k=8, moe_intermediate_size=2048,
                   n_shared_experts=1, routed_scaling_factor=2.5)  # fmt: skip
"""transformers' `DeepseekV3Config` defaults entrenar reads."""

V2_DEFAULTS = dict(max_position_embeddings=2048, first_k_dense_replace=0,
                   n_routed_experts=64, top_k=2, moe_intermediate_size=1407,
                   n_shared_experts=2, routed_scaling_factor=1.0)  # fmt: skip
"""transformers' `DeepseekV2Config` defaults entrenar reads."""


def deepseek_v3_from_hf(hf: Mapping[str, Any]) -> DeepseekConfig:
    """A ``model_type: deepseek_v3`` ``config.json`` as a `DeepseekConfig`.

    transformers' `DeepseekV3Config` defaults where a key is missing.

    Raises:
        UnsupportedError: a quantized checkpoint (the Hub's FP8 DeepSeek-V3 and
            Kimi-K2), a scoring other than sigmoid, or ``topk_method`` other than
            ``noaux_tc``.
    """
    _refuse_quantized(hf, "deepseek_v3")
    scoring = hf.get("scoring_func", "sigmoid")
    method = hf.get("topk_method", "noaux_tc")
    if scoring != "sigmoid" or method != "noaux_tc":
        raise UnsupportedError(
            f"config.json: scoring_func {scoring!r} / topk_method {method!r} are not "
            "supported for deepseek_v3; transformers' DeepseekV3 routes with "
            "'sigmoid' / 'noaux_tc'"
        )
    return _from_hf(
        hf, "deepseek_v3", V3_DEFAULTS,
        rope_interleave=bool(hf.get("rope_interleave", True)),
        norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
    )  # fmt: skip


def deepseek_v2_from_hf(hf: Mapping[str, Any]) -> DeepseekConfig:
    """A ``model_type: deepseek_v2`` ``config.json`` (DeepSeek-V2, V2-Lite).

    transformers' `DeepseekV2Config` defaults where a key is missing; the rope
    pairs are always interleaved (its ``apply_rotary_emb`` turns complex pairs).

    Raises:
        UnsupportedError: a quantized checkpoint, a ``topk_method`` other than
            ``greedy`` / ``group_limited_greedy``, ``norm_topk_prob`` true (which
            transformers ignores and DeepSeek's code applies) or ``mlp_bias``.
    """
    _refuse_quantized(hf, "deepseek_v2")
    method = hf.get("topk_method") or "greedy"
    if method not in ("greedy", "group_limited_greedy"):
        raise UnsupportedError(
            f"config.json: topk_method {method!r} is not supported for deepseek_v2; "
            "transformers' DeepseekV2 routes with 'greedy' or 'group_limited_greedy'"
        )
    if hf.get("norm_topk_prob"):
        raise UnsupportedError(
            "config.json: norm_topk_prob true is not supported for deepseek_v2: "
            "transformers 5.25 ignores it and DeepSeek's code renormalises, so the "
            "model is ambiguous"
        )
    if hf.get("mlp_bias"):
        raise UnsupportedError(
            "config.json: mlp_bias true is not supported for deepseek_v2 (DeepSeek's "
            "checkpoints have none)"
        )
    return _from_hf(
        hf, "deepseek_v2", V2_DEFAULTS, rope_interleave=True, norm_topk_prob=False,
        scoring_func="softmax", topk_method=method,
    )  # fmt: skip


def _to_hf(c: DeepseekConfig, hf_class: str, model_type: str) -> dict[str, Any]:
    """The ``config.json`` entries both families write."""
    allowed = (
        "rope_type", "attention_bias", "attention_out_bias", "num_experts",
        "rope_interleave",
    )  # fmt: skip
    hf = common_to_hf(c, hf_class, model_type, allowed)
    del hf["head_dim"]  # transformers sets it to qk_rope_head_dim
    if hf["rope_scaling"] is not None and c.rope_mscale_all_dim:
        hf["rope_scaling"]["mscale_all_dim"] = c.rope_mscale_all_dim
    hf.update(
        attention_bias=c.attention_bias,
        q_lora_rank=c.q_lora_rank,
        kv_lora_rank=c.kv_lora_rank,
        qk_nope_head_dim=c.qk_nope_head_dim,
        qk_rope_head_dim=c.qk_rope_head_dim,
        v_head_dim=c.v_head_dim,
        first_k_dense_replace=c.first_k_dense_replace,
        n_routed_experts=c.num_experts,
        num_experts_per_tok=c.num_experts_per_tok,
        norm_topk_prob=c.norm_topk_prob,
        moe_intermediate_size=c.expert_size,
        n_shared_experts=c.n_shared_experts,
        n_group=c.n_group,
        topk_group=c.topk_group,
        routed_scaling_factor=c.routed_scaling_factor,
        topk_method=c.topk_method,
        num_nextn_predict_layers=c.num_nextn_predict_layers,
    )
    return hf


def _refuse_other(c: DeepseekConfig, family: str, v3: bool) -> None:
    """Raise `UnsupportedError` for a routing the family's file cannot hold."""
    if (c.scoring_func == "sigmoid") != v3:
        raise UnsupportedError(
            f"{family}'s config.json cannot hold scoring_func {c.scoring_func!r} / "
            f"topk_method {c.topk_method!r}: deepseek_v3 routes with sigmoid, "
            "deepseek_v2 with softmax"
        )
    if not v3 and not c.rope_interleave:
        raise UnsupportedError(
            "deepseek_v2's config.json has no rope_interleave: its rope pairs are "
            "interleaved; set rope_interleave=True"
        )


def deepseek_v3_to_hf(c: DeepseekConfig) -> dict[str, Any]:
    """The ``config.json`` of a DeepSeek-V3 `DeepseekConfig` (transformers' keys)."""
    _refuse_other(c, "deepseek_v3", True)
    hf = _to_hf(c, "DeepseekV3ForCausalLM", "deepseek_v3")
    hf.update(rope_interleave=c.rope_interleave, scoring_func=c.scoring_func)
    return hf


def deepseek_v2_to_hf(c: DeepseekConfig) -> dict[str, Any]:
    """The ``config.json`` of a DeepSeek-V2 `DeepseekConfig` (transformers' keys)."""
    _refuse_other(c, "deepseek_v2", False)
    hf = _to_hf(c, "DeepseekV2ForCausalLM", "deepseek_v2")
    hf.update(scoring_func=c.scoring_func, mlp_bias=False)
    return hf


deepseek_from_hf_tensors = deepseek_moe_from_hf_tensors
deepseek_to_hf_tensors = deepseek_moe_to_hf_tensors


# -------------------------------------------------------------------- family
def _tiny_deepseek_v3() -> DeepseekConfig:
    """Every DeepSeek-V3 feature on, at the conformance tests' sizes.

    A low-rank query, a dense first layer then MoE layers, a shared expert, 8
    experts in 4 groups of which 2 are searched, top-3, a routed scale, YaRN with
    ``mscale_all_dim``, interleaved rope pairs, ``d_v`` below ``d_qk``.
    """
    return DeepseekConfig(
        **{
            **TINY_SIZES,
            "num_kv_heads": TINY_SIZES["num_heads"],
            "head_dim": None,
            "num_layers": 3,
        },
        architecture="deepseek_v3",
        q_lora_rank=24,
        kv_lora_rank=16,
        qk_nope_head_dim=12,
        qk_rope_head_dim=8,
        v_head_dim=10,
        rope_type="yarn",
        rope_factor=4.0,
        rope_original_max_position_embeddings=16,
        rope_mscale_all_dim=0.8,
        max_position_embeddings=64,
        first_k_dense_replace=1,
        num_experts=8,
        num_experts_per_tok=3,
        moe_intermediate_size=12,
        n_shared_experts=2,
        n_group=4,
        topk_group=2,
        routed_scaling_factor=2.5,
    )


def _tiny_deepseek_v2() -> DeepseekConfig:
    """Every DeepSeek-V2 feature on, at the conformance tests' sizes.

    V2-Lite's plain ``q_proj``, a dense first layer, shared experts, softmax top-3
    of 8 experts limited to 2 of 4 groups (their maxima), a routed scale, YaRN
    with ``mscale`` and ``mscale_all_dim``.
    """
    return dataclasses.replace(
        _tiny_deepseek_v3(),
        architecture="deepseek_v2",
        q_lora_rank=None,
        rope_attention_factor=yarn_mscale(4.0, 0.707) / yarn_mscale(4.0, 0.8),
        scoring_func="softmax",
        topk_method="group_limited_greedy",
        norm_topk_prob=False,
        routed_scaling_factor=1.5,
    )


V3_FAMILY = dict(
    num_experts=8, num_experts_per_tok=2, moe_intermediate_size=None,
    n_shared_experts=1, first_k_dense_replace=1,
)  # fmt: skip
"""A from-scratch DeepSeek-V3 model's switches (`Architecture.make_config`)."""

V2_FAMILY = dict(
    V3_FAMILY, scoring_func="softmax", topk_method="greedy", norm_topk_prob=False
)
"""A from-scratch DeepSeek-V2 model's switches."""

register_family(
    DeepseekConfig,
    "deepseek_v3",
    "DeepSeek-V3 (V3/R1, Kimi-K2, Moonlight): multi-head latent attention, "
    "DeepSeekMoE with sigmoid group-limited routing and shared experts",
    hf_class="DeepseekV3ForCausalLM",
    from_hf=deepseek_v3_from_hf,
    to_hf=deepseek_v3_to_hf,
    tiny=_tiny_deepseek_v3,
    gguf_name="deepseek2",  # V2 too: entrenar.io.deepseek_gguf
    defaults=V3_FAMILY,
    from_hf_tensors=deepseek_from_hf_tensors,
    to_hf_tensors=deepseek_to_hf_tensors,
)
register_family(
    DeepseekConfig,
    "deepseek_v2",
    "DeepSeek-V2 (V2, V2-Lite): multi-head latent attention, DeepSeekMoE with "
    "softmax (group-limited) routing and shared experts",
    hf_class="DeepseekV2ForCausalLM",
    from_hf=deepseek_v2_from_hf,
    to_hf=deepseek_v2_to_hf,
    tiny=_tiny_deepseek_v2,
    in_gguf=False,  # written as deepseek2 (gguf_families.WRITTEN_AS)
    defaults=V2_FAMILY,
    from_hf_tensors=deepseek_from_hf_tensors,
    to_hf_tensors=deepseek_to_hf_tensors,
)

__all__ = [
    "TOPK_METHODS",
    "DeepseekConfig",
    "deepseek_from_hf_tensors",
    "deepseek_to_hf_tensors",
    "deepseek_v2_from_hf",
    "deepseek_v2_to_hf",
    "deepseek_v3_from_hf",
    "deepseek_v3_to_hf",
]
