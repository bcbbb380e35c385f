"""Llama: RMSNorm, rotary embeddings, grouped-query attention, SwiGLU.

Touvron et al., "LLaMA: Open and Efficient Foundation Language Models", 2023. The
config is the model: `LlamaConfig` is a frozen dataclass with ``init(key) -> params``
and a pure ``apply(params, tokens) -> logits``. The param tree uses Hugging Face names
with the layers stacked along a leading axis ``L`` (specs/conventions.md); map it to
flat names with `entrenar.nn.to_hf_names` / `entrenar.nn.from_hf_names`.

Forward, for tokens ``x: (B, T)`` (specs/models.md has the exact math)::

    h = E[x]
    for each layer:  h = h + Attn(RMSNorm(h));  h = h + SwiGLU(RMSNorm(h))
    logits = RMSNorm(h) Wᵀ   (W = E when embeddings are tied)
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
from jax.custom_derivatives import CustomVJPPrimal, SymbolicZero

from entrenar.errors import ConfigError, ShapeError, UnsupportedError
from entrenar.nn.attention import (
    ATTENTION_NAME,
    KVCache,
    cache_positions,
    cached_attention,
    causal_mask,
    dot_product_attention,
    init_kv_cache,
    read_cache,
    write_cache,
)
from entrenar.nn.bf16_weight import TiedEmbedding
from entrenar.nn.decoder_config import (
    TINY_SIZES,
    as_float,
    check_switches,
    common_from_hf,
    common_to_hf,
    register_family,
    sliding_layers,
)
from entrenar.nn.fused_attention import (
    check_attention_impl,
    fused_attention,
    use_fused,
)
from entrenar.nn.init import normal
from entrenar.nn.layers import (
    embedding,
    gated_mlp,
    gelu_tanh,
    layer_norm,
    relu2,
    rms_norm,
    silu,
    token_chunked,
    upcast_dtype,
)
from entrenar.nn.linear import check_matmul_dtype, linear
from entrenar.nn.matvec import layer_params
from entrenar.nn.moe import clamped_swiglu, router_jitter, sparse_moe
from entrenar.nn.multimodal import WRAPPERS
from entrenar.nn.registry import architecture, architecture_for_hf
from entrenar.nn.rope import interleaved_as_halves, rope_tables, rotate
from entrenar.nn.rope_scaling import attention_factor, rope_inv_freq
from entrenar.types import Params, PRNGKey

COMPUTE_DTYPES = ("float32", "bfloat16", "float16", "float64")
REMAT_POLICIES = (
    "everything_saveable",
    "nothing_saveable",
    "dots_saveable",
    "dots_with_no_batch_dims_saveable",
)
"""`jax.checkpoint_policies` names `LlamaConfig.remat_policy` accepts."""
REMAT_SAVED_DTYPES = ("bfloat16",)
"""`LlamaConfig.remat_saved_dtype`'s values (None: the layer input in ``dtype``)."""

ACTIVATIONS: dict[str, Callable[[jax.Array], jax.Array]] = {
    "silu": silu,
    "gelu_pytorch_tanh": gelu_tanh,
    "relu2": relu2,
}
"""`LlamaConfig.hidden_act` -> its function (`decoder_config.HIDDEN_ACTS`)."""

_DENSE: Any = object()
"""`LlamaConfig._layers`' default ``fused``: every layer's mask is dense."""


def check_dtype(name: str, field: str) -> None:
    """Raise `ConfigError` unless ``name`` is one of `COMPUTE_DTYPES`."""
    if name not in COMPUTE_DTYPES:
        raise ConfigError(f"{field} must be one of {COMPUTE_DTYPES}, got {name!r}")


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """Llama architecture, precision and memory options; also the model itself.

    Attributes:
        vocab_size: ``V``.
        hidden_size: ``D``.
        intermediate_size: ``I``, width of the SwiGLU block.
        num_layers: ``L`` (Hugging Face: ``num_hidden_layers``).
        num_heads: ``H`` query heads.
        num_kv_heads: ``KV`` key/value heads, ``H % KV == 0`` (GQA; ``KV == H`` is
            plain multi-head attention).
        head_dim: ``d``; None means ``D // H``.
        rope_theta: rotary base ``θ``.
        rms_norm_eps: ``ε`` of every RMSNorm.
        tie_word_embeddings: the output head reuses ``embed_tokens`` (no ``lm_head``).
        max_position_embeddings: longest context the weights were trained for.
        initializer_range: std of the normal initialiser of ``init``.
        dtype: compute dtype (activations, KV cache); logits are float32 (float64
            when computing in float64).
        param_dtype: dtype of the parameters ``init`` creates.
        remat: rematerialise each layer in the backward pass (`jax.checkpoint`),
            trading compute for activation memory.
        remat_policy: rematerialise each layer with this `jax.checkpoint_policies`
            policy (e.g. ``"dots_saveable"``: keep matmul outputs, recompute the
            elementwise work; 4-7% faster than no remat for SmolLM2's LoRA step with
            bfloat16 matmuls, benchmarks/results/finetune_step.md); None: ``remat``
            decides (everything recomputed, or nothing).
        matmul_dtype: None (every matmul in ``dtype``), or ``"bfloat16"`` (or
            ``"float16"``): mixed precision for the weight matmuls (projections,
            MLP, output head). Their inputs are cast to bfloat16, products
            accumulate in float32 and the results are in ``dtype``, in the forward
            and the backward pass (`entrenar.nn.lowp_matmul`, whose backward pass
            computes no gradient for a frozen weight); attention's two products
            take bfloat16 inputs with float32 accumulation too; activations,
            norms, rotary embeddings, attention scores and softmax and logits stay
            in ``dtype`` (float32).
            Parameters, adapters and optimizer state keep their own dtypes. On
            CPUs with AMX (Intel Sapphire Rapids and later) XLA:CPU runs these
            dots several times faster than float32; elsewhere the results are the
            same, only not faster.
        tied_head_copy: with ``matmul_dtype`` and ``tie_word_embeddings``, a
            training step keeps the tied head as a transposed bfloat16 copy
            ``(D, V)`` of the table (`entrenar.nn.TiedEmbedding`; XLA:CPU's head
            input gradient is faster from it); False: a bfloat16 table is the
            head itself, read ``(V, D)``, and no copy is held (Gemma-3-27B:
            2.82 GB; the step slower, benchmarks/results/big_shapes.md).
        remat_saved_dtype: None (the default), or ``"bfloat16"``: with every
            layer wholly recomputed (``remat_policy`` ``"nothing_saveable"``, or
            ``remat`` without a policy), the one activation a layer keeps for the
            backward pass, its input ``h: (B, T, D)`` (the residual stream), is
            kept rounded to bfloat16 instead of in ``dtype``: ``L x B x T x D x 2``
            bytes instead of ``x 4`` (Qwen2.5-32B at 1 x 2048: 1.34 GB less),
            what gradient checkpointing of a bfloat16 model keeps (PEFT).
            The forward pass, the loss and the residual stream itself are
            unchanged (float32); the backward pass recomputes each layer from
            the rounded input, so gradients are those of the layer at
            ``bf16(h)``: a relative perturbation of ``h`` of at most 2^-9, which
            sharp attention can amplify (`_saved_as`; specs/models.md).
        mlp_chunk_elements: a dense MLP runs over chunks of tokens of at most this
            ``tokens x I`` (`entrenar.nn.layers.token_chunked`); None: its
            default, `entrenar.nn.layers.MLP_CHUNK_ELEMENTS` (2^23). Lower: less
            memory in the backward pass (Qwen2.5-32B at 1 x 2048, 2^22: 14 chunks
            instead of 7, 0.11 GB less), more dequantization of NF4 weights (each
            chunk's recomputation dequantizes the MLP's). The values are the same.
        architecture: the registry name of the family (``"llama"``, ``"qwen2"``,
            ...); `to_hf_config` writes that family's ``config.json``.
        hf_wrapper: the vision-language ``model_type`` (``"gemma3"``,
            ``"qwen2_5_vl"``, ... `entrenar.nn.multimodal.WRAPPERS`) whose
            language model this is, or None
            (`entrenar.nn.multimodal`): PEFT files name its modules as on the
            ConditionalGeneration model, a Hugging Face export writes the whole
            folder again.
        rope_type: rotary scaling (Hugging Face's ``rope_type``): ``"default"``,
            ``"linear"``, ``"dynamic"`` (NTK: the base grows with the sequence
            length), ``"llama3"``, ``"yarn"`` or ``"longrope"`` (specs/models.md).
        rope_factor: the scaling ``factor``.
        rope_low_freq_factor: ``llama3``'s ``low_freq_factor``.
        rope_high_freq_factor: ``llama3``'s ``high_freq_factor``.
        rope_original_max_position_embeddings: the pre-training context of
            ``llama3``, ``yarn`` and ``longrope``.
        rope_beta_fast: ``yarn``'s ``beta_fast``.
        rope_beta_slow: ``yarn``'s ``beta_slow``.
        rope_attention_factor: ``yarn`` / ``longrope`` scale of ``cos`` and
            ``sin``; None: derived from the factor as Hugging Face does.
        rope_truncate: ``yarn``'s correction range rounded to whole dimensions
            (floor / ceil: transformers' default ``truncate: true``); False keeps
            the fractional bounds (gpt-oss).
        rope_short_factor: ``longrope``'s per-frequency divisors up to the original
            context (``d/2`` values).
        rope_long_factor: ``longrope``'s divisors beyond it.
        rope_freq_divisors: explicit per-frequency divisors of the inverse
            frequencies (``d/2`` values, llama.cpp's ``rope_freqs`` tensor), with
            ``rope_type="default"``.
        partial_rotary_factor: rotary embeddings turn the first ``r = int(d ·
            factor)`` values of each head (`rotary_dim`) and pass the other
            ``d - r`` through (Hugging Face's ``partial_rotary_factor``: Phi-4-mini's
            0.75; llama.cpp's ``rope.dimension_count``); 1: the whole head.
        rope_interleave: the rotated values come in interleaved pairs ``(x_0,
            x_1), (x_2, x_3), ...`` that one frequency turns (GLM-4's, GPT-J's
            layout, Cohere's, ERNIE 4.5's; transformers' ``repeat_interleave`` of
            ``cos`` /
            ``sin``):
            they are taken as ``[x_0, x_2, ...; x_1, x_3, ...]`` and rotated half
            against half, queries and keys alike, so the scores are the pairs'
            (the cache holds keys in that order); False: Hugging Face's halves.
        rope_local_theta: rotary base of the sliding-window layers (Gemma 3's
            ``rope_local_base_freq``; no scaling there); None: ``rope_theta``.
        attention_bias: biases on the q, k and v projections.
        attention_out_bias: a bias on o_proj (Llama's ``attention_bias`` sets both).
        mlp_bias: biases on gate, up and down projections.
        qk_norm: per-head RMSNorm of queries and keys before rotary (``q_norm``,
            ``k_norm``, weights ``(L, d)``: Qwen3, Gemma 3).
        qk_norm_whole: ``qk_norm`` over the whole projection instead, ``H d``
            query and ``KV d`` key values at once (weights ``(L, H d)`` and
            ``(L, KV d)``: OLMo 2).
        clip_qkv: None, or ``c``: queries, keys and values are clipped to
            ``[-c, c]`` after their projections (and q/k norms), before rotary
            (OLMoE's ``clip_qkv``).
        sliding_window: a sliding layer's query at ``p`` attends to keys at
            ``p - sliding_window < s <= p``; None: no sliding layer.
        layer_types: per layer ``"full_attention"`` or ``"sliding_attention"``;
            None: every layer slides when ``sliding_window`` is set (Mistral).
        nope_layers: per layer, True where the layer rotates neither queries nor
            keys (NoPE: SmolLM3's ``no_rope_layers`` zeros); None: every layer
            rotates.
        hidden_act: the gate's activation, ``"silu"`` (SwiGLU) or
            ``"gelu_pytorch_tanh"`` (GeGLU, tanh GELU: Gemma); or ``"relu2"``,
            the squared ReLU (Arcee's ungated MLP).
        norm_unit_offset: RMSNorm gains are ``1 + w`` (Gemma; ``init`` makes w 0).
        sandwich_norms: Gemma 2/3 norms: ``post_attention_layernorm`` on the
            attention output, ``pre_feedforward_layernorm`` before and
            ``post_feedforward_layernorm`` after the MLP.
        post_norms: OLMo 2's norms: none before attention or the MLP (no
            ``input_layernorm``); ``post_attention_layernorm`` on the attention
            output and ``post_feedforward_layernorm`` on the MLP output, each
            then added to the residual stream.
        glm_norms: GLM-4's norms: Gemma 2's four under GLM-4's names,
            ``post_self_attn_layernorm`` on the attention output,
            ``post_attention_layernorm`` before and ``post_mlp_layernorm`` after
            the MLP.
        scale_embeddings: multiply the embeddings by ``sqrt(D)`` (in ``dtype``).
        query_pre_attn_scalar: attention scores scale ``s^-1/2``; None: ``d^-1/2``.
        attn_logit_softcapping: scores become ``c tanh(scores / c)`` (Gemma 2).
        final_logit_softcapping: logits become ``c tanh(logits / c)`` (Gemma 2).
        embedding_multiplier: multiply the embeddings by this (in ``dtype``;
            Granite).
        residual_multiplier: each sublayer's output is multiplied by this before
            it is added to the residual stream (Granite).
        attention_multiplier: attention scores scale, replacing ``d^-1/2``
            (Granite; ``query_pre_attn_scalar`` is its other form).
        logits_scaling: logits are divided by this (Granite); ``features``
            gives ``RMSNorm(h) / logits_scaling``, so its product with the head
            is still ``apply``'s logits.
        fused_qkv: one ``qkv_proj`` weight ``(L, (H + 2 KV) d, D)`` (Phi-3).
        fused_gate_up: one ``gate_up_proj`` weight ``(L, 2 I, D)`` (Phi-3).
        num_experts: ``E`` > 0 makes every layer's MLP a sparse mixture of ``E``
            gated experts (`entrenar.nn.moe`: Mixtral, Qwen2/3-MoE) with a router
            ``mlp.gate.weight (L, E, D)`` and experts stacked
            ``mlp.experts.{gate,up,down}_proj.weight (L, E, out, in)``; 0: dense.
        num_experts_per_tok: ``k``, the experts each token is routed to.
        norm_topk_prob: renormalise the ``k`` routing probabilities to sum to 1
            (Mixtral always; Qwen's ``norm_topk_prob``).
        moe_intermediate_size: an expert's ``I``; None: ``intermediate_size``.
        shared_expert_intermediate_size: > 0 adds Qwen2-MoE's shared expert
            (``mlp.shared_expert``, that wide) behind the sigmoid gate
            ``mlp.shared_expert_gate.weight (L, 1, D)``.
        shared_mlp_intermediate_size: ``S`` > 0 adds Granite MoE shared's
            ungated shared expert beside the MoE block, as its checkpoints hold
            it: ``shared_mlp.input_linear.weight (L, 2 S, D)`` (``[gate; up]``)
            and ``shared_mlp.output_linear.weight (L, D, S)``; the layer's MLP
            output is ``MoE(x) + SwiGLU_shared(x)``.
        output_router_logits: the training loss adds ``router_aux_loss_coef``
            times the Switch load-balancing loss of the routers
            (`entrenar.nn.moe.load_balancing_loss`), as transformers does when its
            config sets ``output_router_logits`` (off by default there too).
        router_aux_loss_coef: that loss's weight (transformers' default 0.001).
        router_jitter_noise: ``j`` > 0: while training (a ``key`` given to
            `apply` / `features`), each MoE block's input is multiplied by noise
            ``U(1 - j, 1 + j)`` before the router and the experts read it
            (Mixtral's, `entrenar.nn.moe.router_jitter`); 0: none.
        moe_bias: biases on the router (``mlp.gate.bias (L, E)``) and on every
            expert projection (``mlp.experts.{gate,up,down}_proj.bias (L, E,
            out)``): gpt-oss.
        swiglu_limit: None (SwiGLU experts), or gpt-oss's clamped SwiGLU
            (`entrenar.nn.moe.clamped_swiglu`) with this limit.
        swiglu_alpha: the clamped SwiGLU's sigmoid gain ``α``.
        attention_sinks: a learned logit per query head in every attention
            softmax's denominator (``self_attn.sinks (L, H)``; gpt-oss,
            `entrenar.nn.attention`).
        query_scale_beta: Ministral 3's position-dependent query scale (Llama
            4's attention temperature): after rotary, the query at position
            ``p`` is multiplied by ``1 + β ln(1 + ⌊p / query_scale_length⌋)``
            (1 within the first ``query_scale_length`` positions); None: none.
        query_scale_length: that scale's period ``L`` (Ministral 3: the rope's
            ``original_max_position_embeddings``, 16384).
        layer_norm: every norm (the layers', the final one, the q/k norms) is a
            LayerNorm with a gain and no bias, ``(x - μ) / sqrt(σ² + ε) · w`` in
            float32 (Cohere's ``CohereLayerNorm``), in place of RMSNorm; ``ε`` is
            ``rms_norm_eps``.
        parallel_residual: attention and the MLP read the same
            ``input_layernorm`` output and both add to the stream, ``h = h +
            Attn(x) + MLP(x)`` with ``x = Norm(h)`` (Cohere); no
            ``post_attention_layernorm``.
        qk_norm_heads: ``qk_norm``'s gains are per head, ``q_norm (L, H, d)``
            and ``k_norm (L, KV, d)``, each head normalised over its ``d`` values
            (Cohere's ``use_qk_norm``).
        logit_scale: logits are multiplied by this (Cohere's ``logit_scale``);
            ``features`` carries the factor, as for ``logits_scaling``.
        ungated_mlp: the MLP is ``act(x W_upᵀ + b_up) W_downᵀ + b_down`` with no
            ``gate_proj`` (Arcee AFM: ``up_proj``, ``down_proj`` only); dense
            layers only (no experts, no fused ``gate_up_proj``).
        attention_impl: ``"reference"`` (`entrenar.nn.dot_product_attention`'s
            own paths: the native kernel on CPUs), ``"fused"``
            (`entrenar.nn.fused_attention`: `jax.nn.dot_product_attention`,
            cuDNN's flash-attention kernel on NVIDIA GPUs, with the causal mask
            and a uniform sliding window as the kernel's own flags) or ``"auto"``
            (fused off the CPU). Soft-capped attention (Gemma 2) and float64
            always take the reference path.
    """

    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_layers: int = 32
    num_heads: int = 32
    num_kv_heads: int = 32
    head_dim: int | None = None
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 2048
    initializer_range: float = 0.02
    dtype: str = "float32"
    param_dtype: str = "float32"
    remat: bool = False
    matmul_dtype: str | None = None
    remat_policy: str | None = None
    tied_head_copy: bool = True
    remat_saved_dtype: str | None = None
    mlp_chunk_elements: int | None = None
    architecture: str = "llama"
    hf_wrapper: str | None = None
    rope_type: str = "default"
    rope_factor: float = 1.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_position_embeddings: int | None = None
    rope_beta_fast: float = 32.0
    rope_beta_slow: float = 1.0
    rope_attention_factor: float | None = None
    rope_short_factor: tuple[float, ...] | None = None
    rope_long_factor: tuple[float, ...] | None = None
    rope_freq_divisors: tuple[float, ...] | None = None
    partial_rotary_factor: float = 1.0
    rope_interleave: bool = False
    rope_local_theta: float | None = None
    attention_bias: bool = False
    attention_out_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    qk_norm_whole: bool = False
    clip_qkv: float | None = None
    sliding_window: int | None = None
    layer_types: tuple[str, ...] | None = None
    nope_layers: tuple[bool, ...] | None = None
    hidden_act: str = "silu"
    norm_unit_offset: bool = False
    sandwich_norms: bool = False
    post_norms: bool = False
    glm_norms: bool = False
    scale_embeddings: bool = False
    query_pre_attn_scalar: float | None = None
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    embedding_multiplier: float | None = None
    residual_multiplier: float | None = None
    attention_multiplier: float | None = None
    logits_scaling: float | None = None
    fused_qkv: bool = False
    fused_gate_up: bool = False
    attention_impl: str = "auto"
    num_experts: int = 0
    num_experts_per_tok: int = 2
    norm_topk_prob: bool = True
    moe_intermediate_size: int | None = None
    shared_expert_intermediate_size: int = 0
    shared_mlp_intermediate_size: int = 0
    output_router_logits: bool = False
    router_aux_loss_coef: float = 0.001
    router_jitter_noise: float = 0.0
    rope_truncate: bool = True
    moe_bias: bool = False
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.702
    attention_sinks: bool = False
    query_scale_beta: float | None = None
    query_scale_length: int | None = None
    layer_norm: bool = False
    parallel_residual: bool = False
    qk_norm_heads: bool = False
    logit_scale: float | None = None
    ungated_mlp: bool = False

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"LlamaConfig.{name} must be positive")
        if self.num_heads <= 0 or self.num_kv_heads <= 0:
            raise ConfigError("LlamaConfig.num_heads and num_kv_heads must be > 0")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"LlamaConfig.num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim is None and self.hidden_size % self.num_heads:
            raise ConfigError(
                f"hidden_size ({self.hidden_size}) is not divisible by num_heads "
                f"({self.num_heads}); set head_dim explicitly"
            )
        if self.hd % 2:
            raise ConfigError(f"LlamaConfig head_dim must be even, got {self.hd}")
        for name in ("rope_theta", "rms_norm_eps"):  # NaN logits otherwise
            value = getattr(self, name)
            if not 0 < as_float(value) < math.inf:
                raise ConfigError(
                    f"LlamaConfig.{name} must be a finite number > 0, got {value!r}"
                )
        check_dtype(self.dtype, "LlamaConfig.dtype")
        check_dtype(self.param_dtype, "LlamaConfig.param_dtype")
        check_matmul_dtype(self.matmul_dtype, "LlamaConfig.matmul_dtype")
        check_attention_impl(self.attention_impl, "LlamaConfig.attention_impl")
        if self.remat_policy is not None and self.remat_policy not in REMAT_POLICIES:
            raise ConfigError(
                f"LlamaConfig.remat_policy must be None or one of {REMAT_POLICIES} "
                f"(jax.checkpoint_policies), got {self.remat_policy!r}"
            )
        _check_remat_saved(self)
        _check_mlp_chunks(self)
        check_switches(self)
        _check_experts(self)
        if self.hf_wrapper is not None and self.hf_wrapper not in WRAPPERS:
            raise ConfigError(
                f"LlamaConfig.hf_wrapper must be None or one of {sorted(WRAPPERS)} "
                f"(a vision-language folder's model_type), got {self.hf_wrapper!r}"
            )
        try:
            family = architecture(self.architecture)
        except UnsupportedError as e:
            raise ConfigError(f"LlamaConfig.architecture: {e}") from None
        if family.config_class is not type(self):
            raise ConfigError(
                f"{type(self).__name__}.architecture {self.architecture!r} is not a "
                f"{type(self).__name__} family (it is a "
                f"{family.config_class.__name__})"
            )

    # ----------------------------------------------------------------- presets
    @classmethod
    def smollm2_135m(cls, **overrides: Any) -> LlamaConfig:
        """SmolLM2-135M (HuggingFaceTB/SmolLM2-135M), exactly.

        >>> c = LlamaConfig.smollm2_135m()
        >>> (c.hidden_size, c.num_layers, c.num_heads, c.num_kv_heads, c.hd)
        (576, 30, 9, 3, 64)
        """
        fields: dict[str, Any] = dict(
            vocab_size=49152,
            hidden_size=576,
            intermediate_size=1536,
            num_layers=30,
            num_heads=9,
            num_kv_heads=3,
            head_dim=64,
            rope_theta=100000.0,
            rms_norm_eps=1e-5,
            tie_word_embeddings=True,
            max_position_embeddings=8192,
            initializer_range=0.041666666666666664,
        )
        fields.update(overrides)
        return cls(**fields)

    @classmethod
    def from_hf_config(cls, hf: Mapping[str, Any], **overrides: Any) -> LlamaConfig:
        """Build from a Hugging Face ``config.json`` dict of any LlamaConfig family.

        The family is found by ``model_type`` (``llama`` when absent) in the
        registry; ``overrides`` replace fields afterwards.

        Raises:
            UnsupportedError: a ``model_type`` or a field the family cannot honour
                (an unknown rope type, an activation, ...), named in the message.
        """
        arch = (
            architecture_for_hf(hf, "config.json")
            if "model_type" in hf
            else architecture("llama")
        )
        if arch.config_class is not cls or arch.from_hf is None:
            raise UnsupportedError(
                f"config.json: model_type {hf.get('model_type')!r} is a "
                f"{arch.config_class.__name__}, not a {cls.__name__}"
            )
        config = arch.from_hf(hf)
        return dataclasses.replace(config, **overrides) if overrides else config

    def to_hf_config(self) -> dict[str, Any]:
        """The Hugging Face ``config.json`` dict of this architecture's family.

        Raises:
            UnsupportedError: a switch the family's ``config.json`` cannot hold.
        """
        to_hf = architecture(self.architecture).to_hf
        assert to_hf is not None  # every LlamaConfig family registers one
        return to_hf(self)

    # ------------------------------------------------------------------ shapes
    @property
    def hd(self) -> int:
        """The head dimension ``d``."""
        return self.head_dim or self.hidden_size // self.num_heads

    @property
    def rotary_dim(self) -> int:
        """``r = int(d · partial_rotary_factor)``: the rotated values of each head.

        As transformers computes it (``modeling_rope_utils``): the inverse
        frequencies, and every scaling's, are those of a head of ``r`` values.
        """
        return int(self.hd * self.partial_rotary_factor)

    def param_shapes(self) -> dict[str, Any]:
        """Nested dict of parameter shapes, the tree of specs/conventions.md.

        The family switches add leaves under Hugging Face's names: ``bias`` next
        to the weights, ``self_attn.{q,k}_norm``, Gemma's
        ``{pre,post}_feedforward_layernorm`` (OLMo 2: the post one, and no
        ``input_layernorm``; Cohere's parallel layers: no
        ``post_attention_layernorm``); Phi-3's fused ``qkv_proj`` and
        ``gate_up_proj`` replace q/k/v and gate/up.
        """
        d, i, n = self.hidden_size, self.intermediate_size, self.num_layers
        qd, kvd = self.num_heads * self.hd, self.num_kv_heads * self.hd

        def lin(out: int, fan_in: int, bias: bool) -> dict[str, Any]:
            w: dict[str, Any] = {"weight": (n, out, fan_in)}
            if bias:
                w["bias"] = (n, out)
            return w

        ab, mb = self.attention_bias, self.mlp_bias
        attn: dict[str, Any] = (
            {"qkv_proj": lin(qd + 2 * kvd, d, ab)}
            if self.fused_qkv
            else {"q_proj": lin(qd, d, ab), "k_proj": lin(kvd, d, ab)}
        )
        if not self.fused_qkv:
            attn["v_proj"] = lin(kvd, d, ab)
        attn["o_proj"] = lin(d, qd, self.attention_out_bias)
        if self.qk_norm_heads:  # Cohere: a gain per head
            attn["q_norm"] = {"weight": (n, self.num_heads, self.hd)}
            attn["k_norm"] = {"weight": (n, self.num_kv_heads, self.hd)}
        elif self.qk_norm:  # per head, or over the whole projection (OLMo 2)
            attn["q_norm"] = {"weight": (n, qd if self.qk_norm_whole else self.hd)}
            attn["k_norm"] = {"weight": (n, kvd if self.qk_norm_whole else self.hd)}
        if self.attention_sinks:  # gpt-oss: one logit per query head
            attn["sinks"] = (n, self.num_heads)
        mlp: dict[str, Any] = (
            {"gate_up_proj": lin(2 * i, d, mb)}
            if self.fused_gate_up
            else {"gate_proj": lin(i, d, mb), "up_proj": lin(i, d, mb)}
        )
        if self.ungated_mlp:  # Arcee: up and down only
            del mlp["gate_proj"]
        mlp["down_proj"] = lin(d, i, mb)
        if self.num_experts:
            mlp = self._moe_shapes()
        layers: dict[str, Any] = {
            "input_layernorm": {"weight": (n, d)},
            "self_attn": attn,
            "post_attention_layernorm": {"weight": (n, d)},
            "mlp": mlp,
        }
        s = self.shared_mlp_intermediate_size
        if s:  # Granite MoE shared: beside the MoE block, fused [gate; up]
            layers["shared_mlp"] = {
                "input_linear": {"weight": (n, 2 * s, d)},
                "output_linear": {"weight": (n, d, s)},
            }
        if self.post_norms:  # OLMo 2: no norm before attention
            del layers["input_layernorm"]
        if self.parallel_residual:  # Cohere: one norm for attention and the MLP
            del layers["post_attention_layernorm"]
        after_attn, before_mlp, after_mlp = self.norm_names
        for name in (after_attn, before_mlp, after_mlp):
            if name is not None:
                layers[name] = {"weight": (n, d)}
        return self._model_shapes(layers)

    @property
    def norm_names(self) -> tuple[str | None, str | None, str | None]:
        """A layer's norms on the attention output, before and after the MLP.

        Hugging Face's names (None: no such norm): Llama's
        ``post_attention_layernorm`` is the one before the MLP; Gemma 2's and
        OLMo 2's of that name normalise the attention output; GLM-4's
        (``glm_norms``) the MLP input again.
        """
        if self.glm_norms:
            return (
                "post_self_attn_layernorm",
                "post_attention_layernorm",
                "post_mlp_layernorm",
            )
        if self.sandwich_norms:
            return (
                "post_attention_layernorm",
                "pre_feedforward_layernorm",
                "post_feedforward_layernorm",
            )
        if self.post_norms:
            return ("post_attention_layernorm", None, "post_feedforward_layernorm")
        if self.parallel_residual:  # Cohere: the MLP reads input_layernorm's output
            return (None, None, None)
        return (None, "post_attention_layernorm", None)

    def _remat(self, layer: Callable[..., Any]) -> Callable[..., Any]:
        """``layer`` rematerialised as ``remat`` / ``remat_policy`` ask (or as is).

        A ``dots*`` policy also saves the attention kernel's named outputs
        (`ATTENTION_NAME`): attention is a product too. (``remat_saved_dtype``
        takes `_saved_as` instead, in `_layers`.)
        """
        if self.remat_policy is not None:
            policy = getattr(jax.checkpoint_policies, self.remat_policy)
            if self.remat_policy.startswith("dots"):
                policy = jax.checkpoint_policies.save_from_both_policies(
                    policy,
                    jax.checkpoint_policies.save_only_these_names(ATTENTION_NAME),
                )
            return jax.checkpoint(layer, policy=policy)
        return jax.checkpoint(layer) if self.remat else layer

    def _model_shapes(self, layers: Any) -> dict[str, Any]:
        """The whole tree around ``layers``: embeddings, final norm, untied head."""
        v, d = self.vocab_size, self.hidden_size
        shapes: dict[str, Any] = {
            "model": {
                "embed_tokens": {"weight": (v, d)},
                "layers": layers,
                "norm": {"weight": (d,)},
            }
        }
        if not self.tie_word_embeddings:
            shapes["lm_head"] = {"weight": (v, d)}
        return shapes

    def _moe_shapes(self) -> dict[str, Any]:
        """The MoE block's shapes: router, stacked experts, Qwen2-MoE's shared one."""
        n, e, d = self.num_layers, self.num_experts, self.hidden_size
        i = self.expert_size
        mlp: dict[str, Any] = {
            "gate": {"weight": (n, e, d)},
            "experts": {
                "gate_proj": {"weight": (n, e, i, d)},
                "up_proj": {"weight": (n, e, i, d)},
                "down_proj": {"weight": (n, e, d, i)},
            },
        }
        if self.moe_bias:  # gpt-oss: the router's and each expert's biases
            mlp["gate"]["bias"] = (n, e)
            for proj, out in (("gate_proj", i), ("up_proj", i), ("down_proj", d)):
                mlp["experts"][proj]["bias"] = (n, e, out)
        s = self.shared_expert_intermediate_size
        if s:
            mlp["shared_expert"] = {
                "gate_proj": {"weight": (n, s, d)},
                "up_proj": {"weight": (n, s, d)},
                "down_proj": {"weight": (n, d, s)},
            }
            mlp["shared_expert_gate"] = {"weight": (n, 1, d)}
        return mlp

    @property
    def expert_size(self) -> int:
        """An expert's intermediate width (``moe_intermediate_size`` or ``I``)."""
        return self.moe_intermediate_size or self.intermediate_size

    def num_params(self) -> int:
        """Number of scalar parameters.

        >>> LlamaConfig.smollm2_135m().num_params()
        134515008
        """
        leaves = jax.tree_util.tree_leaves(
            self.param_shapes(), is_leaf=lambda s: isinstance(s, tuple)
        )
        total = 0
        for shape in leaves:
            size = 1
            for s in shape:
                size *= s
            total += size
        return total

    # ------------------------------------------------------------------- model
    def init(self, key: PRNGKey) -> Params:
        """Random parameters: weights ``N(0, initializer_range²)``, norm gains 1."""
        shapes = self.param_shapes()
        flat, treedef = jax.tree_util.tree_flatten_with_path(
            shapes, is_leaf=lambda s: isinstance(s, tuple)
        )
        leaves = []
        for idx, (path, shape) in enumerate(flat):
            name = jax.tree_util.keystr(path)
            if "norm" in name:  # gains 1: w = 1, or 1 + w with w = 0
                fill = jnp.zeros if self.norm_unit_offset else jnp.ones
                leaves.append(fill(shape, self.param_dtype))
            elif name.endswith("['bias']"):
                leaves.append(jnp.zeros(shape, self.param_dtype))
            else:
                k = jax.random.fold_in(key, idx)
                leaves.append(
                    normal(
                        shape, key=k, std=self.initializer_range, dtype=self.param_dtype
                    )
                )
        return jax.tree_util.tree_unflatten(treedef, leaves)

    def apply(
        self,
        params: Params,
        tokens: jax.Array,
        *,
        mask: jax.Array | None = None,
        segment_ids: jax.Array | None = None,
        positions: jax.Array | None = None,
        return_hidden: bool = False,
        key: Any = None,
    ) -> Any:
        """Causal-attention logits ``(B, T, V)`` (float32 or 64) for ``tokens: (B, T)``.

        Args:
            params: the param tree of `param_shapes` (leaves may be weight nodes).
            tokens: int token ids ``(B, T)``.
            mask: optional ``(B, T)`` bool, False at padding positions, which no
                token attends to.
            segment_ids: optional int ``(B, T)`` for packed sequences: a token attends
                only to earlier tokens with the same segment id, so packed documents
                never see each other.
            positions: optional int ``(B, T)`` or ``(T,)`` rotary positions; by
                default ``0..T-1``. With packing, pass positions that restart at 0
                for each document so that a packed document gets the logits it
                would get alone.
            return_hidden: also return the hidden states, ``(L + 1, B, T, D)``: the
                embeddings, then each layer's output (before the final norm).
            key: training randomness (``router_jitter_noise``); None: the
                deterministic forward pass of evaluation.

        Returns:
            logits, or ``(logits, hidden)`` with ``return_hidden``.
        """
        h, hidden, _ = self._trunk(
            params, tokens, mask, segment_ids, positions, return_hidden, key=key
        )
        logits = self._head(params, h)
        if not return_hidden:
            return logits
        return logits, hidden

    def features(
        self,
        params: Params,
        tokens: jax.Array,
        *,
        mask: jax.Array | None = None,
        segment_ids: jax.Array | None = None,
        positions: jax.Array | None = None,
        return_router_logits: bool = False,
        key: Any = None,
    ) -> Any:
        """The final normalised hidden states ``RMSNorm(h): (B, T, D)`` in ``dtype``.

        (Divided by ``logits_scaling`` when set: Granite; multiplied by
        ``logit_scale``: Cohere.)

        ``apply``'s logits are ``features(...) Wᵀ`` with ``W = output_weight(params)``;
        a loss that never forms the whole ``(B, T, V)`` logits
        (`entrenar.nn.losses.chunked_causal_lm_loss`) takes these two instead.
        Arguments as in `apply`; ``return_router_logits`` (a mixture of experts):
        also every layer's router logits ``(L, B T, E)``, for
        `entrenar.nn.moe.load_balancing_loss`.
        """
        h, _, logits = self._trunk(
            params, tokens, mask, segment_ids, positions, False,
            router=return_router_logits, key=key,
        )  # fmt: skip
        features = self._final(params, h)
        return (features, logits) if return_router_logits else features

    def output_weight(self, params: Params) -> Any:
        """The output head's weight ``(V, D)``: ``embed_tokens`` when tied."""
        if self.tie_word_embeddings:
            return params["model"]["embed_tokens"]["weight"]
        if "lm_head" in params:
            return params["lm_head"]["weight"]
        raise ShapeError(
            "params have no 'lm_head' but the config does not tie embeddings; "
            "set tie_word_embeddings=True or add lm_head.weight"
        )

    def init_cache(self, batch: int, max_len: int) -> KVCache:
        """An empty `KVCache` for ``batch`` sequences of up to ``max_len`` tokens."""
        return init_kv_cache(
            self.num_layers, batch, max_len, self.num_kv_heads, self.hd, self.dtype
        )

    def apply_cached(
        self,
        params: Params,
        tokens: jax.Array,
        cache: KVCache,
        *,
        logits_at: jax.Array | None = None,
    ) -> tuple[jax.Array, KVCache]:
        """One cached step: logits ``(B, T, V)`` of ``tokens`` at ``cache.pos + t``.

        Keys and values of the new tokens are written into the cache (only those
        ``B T`` entries: `entrenar.nn.attention.write_cache`); the new tokens attend
        to every cached position and causally among themselves. ``cache.pos`` is a
        scalar or ``(B,)``, one position per row (each row then decodes as it would
        alone; with ``dynamic`` or ``longrope`` rotary scaling the sequence length
        that picks the frequencies is the batch's longest, as in transformers).
        ``logits_at (B,)`` int: only the logits of position ``logits_at[b]`` of each
        row, ``(B, 1, V)`` (a prompt needs its last token's: the output head then
        multiplies ``B`` rows instead of ``B T``).
        """
        _check_tokens(tokens)
        t, s = tokens.shape[1], cache.k.shape[2]
        positions = cache_positions(cache.pos, t)  # (T,) or (B, T)
        allowed = causal_mask(positions, s)  # (T, S) or (B, T, S)
        h, ((k, v), _, _) = self._layers(params, tokens, positions, allowed, cache)
        if logits_at is not None:
            h = jnp.take_along_axis(h, logits_at[:, None, None], axis=1)  # (B, 1, D)
        return self._head(params, h), KVCache(k, v, cache.pos + t)

    # --------------------------------------------------------------- internals
    def _trunk(
        self,
        params: Params,
        tokens: jax.Array,
        mask: jax.Array | None,
        segment_ids: jax.Array | None,
        positions: jax.Array | None,
        return_hidden: bool,
        *,
        router: bool = False,
        key: Any = None,
    ) -> tuple[jax.Array, Any, Any]:
        """Check the inputs, build the attention mask, run the layers.

        Returns ``(h, hidden or None, router logits (L, B T, E) or None)``; the
        logits with ``router``.
        """
        _check_tokens(tokens)
        b, t = tokens.shape
        allowed = causal_mask(jnp.arange(t, dtype=jnp.int32), t)  # (T, T)
        if mask is not None:
            allowed = allowed[None] & mask.astype(bool)[:, None, :]  # (B, T, T)
        if segment_ids is not None:
            if tuple(segment_ids.shape) != (b, t):
                raise ShapeError(
                    f"segment_ids must have the tokens' shape {(b, t)}, got "
                    f"{tuple(segment_ids.shape)}"
                )
            same = segment_ids[:, :, None] == segment_ids[:, None, :]  # (B, T, T)
            allowed = allowed & same
        if positions is None:
            positions = jnp.arange(t, dtype=jnp.int32)  # (T,)
        elif tuple(positions.shape) not in ((t,), (b, t)):
            raise ShapeError(
                f"positions must have shape {(t,)} or {(b, t)}, got "
                f"{tuple(positions.shape)}"
            )
        fused: Any = _DENSE
        if self.uses_fused_attention():  # the kernel applies causality; the rest:
            fused = _extra_mask(mask, segment_ids, b, t)  # (B, T, T) or None
        h, (_, hidden, logits) = self._layers(
            params, tokens, positions, allowed, None, return_hidden, fused=fused,
            router=router, key=key,
        )  # fmt: skip
        return h, hidden, logits

    def uses_fused_attention(self) -> bool:
        """Whether attention runs `entrenar.nn.fused_attention` here and now.

        ``attention_impl`` resolved on the current backend, no soft-capping and a
        compute dtype the fused path takes (`entrenar.nn.fused_attention.use_fused`).
        """
        return use_fused(self.attention_impl, self.dtype, self.attn_logit_softcapping)

    def _layers(
        self,
        params: Params,
        tokens: jax.Array,
        positions: jax.Array,
        allowed: jax.Array,
        cache: KVCache | None,
        return_hidden: bool = False,
        *,
        fused: Any = _DENSE,
        router: bool = False,
        key: Any = None,
    ) -> tuple[jax.Array, Any]:
        """Run the scanned layers; returns ``(h, (cache_kv, hidden, router))``.

        ``hidden``: with ``return_hidden``, else None; ``router``: with ``router``
        (a mixture of experts), every layer's router logits ``(L, B T, E)``, else
        None.

        ``fused``: on the training path with fused attention, the mask beyond
        causality (padding and segments, ``(B, T, T)``, or None); the kernel then
        applies the causal mask (and a sliding window every layer shares) itself.

        Per-layer switches (sliding or full attention, local or global rotary
        base, rotary or none) travel in the scan's ``xs`` when the layers
        differ. With a ``cache`` the scan carries its whole ``(L, B, S, KV, d)``
        buffers beside ``h`` and each layer writes its new entries into them at
        its index, so no layer's cache is copied (it would be, as the scan's
        ``xs`` and ``ys``). ``key`` (training, ``router_jitter_noise``): each layer
        jitters with its own key (`_layer_keys`), riding in ``xs`` too.
        """
        m = params["model"]
        table = m["embed_tokens"]["weight"]  # (V, D), or a TiedEmbedding's table
        table = table.table if isinstance(table, TiedEmbedding) else table
        h = embedding(table, tokens).astype(self.dtype)
        if self.scale_embeddings:  # Gemma: × sqrt(D), rounded to the compute dtype
            h = h * jnp.asarray(self.hidden_size**0.5, self.dtype)
        if self.embedding_multiplier is not None:  # Granite
            h = h * jnp.asarray(self.embedding_multiplier, self.dtype)
        pos = None if cache is None else cache.pos
        # (B|1, T, 1, r) each: every layer's rotation, computed once (rope_tables)
        rope = self._rope(positions, self.rope_theta, scaled=True)
        q_scale = self._query_scale(positions)  # (B|1, T, 1, 1) or None
        sliding = sliding_layers(self)
        mixed = any(sliding) and not all(sliding)
        masks = (allowed, allowed)  # (full, sliding)
        ropes = (rope, rope)
        if any(sliding):
            # a query at index p sees keys at p - W < s <= p (cache: p = position)
            q_index = jnp.arange(tokens.shape[1]) if cache is None else positions
            q_index = q_index.astype(jnp.int32)  # int64 positions under x64
            k_index = jnp.arange(allowed.shape[-1], dtype=jnp.int32)  # (S,)
            window = self.sliding_window or 0  # set: some layer slides
            if q_index.ndim == 1:
                near = (q_index[:, None] - k_index[None, :]) < window  # (T, S)
            else:  # per-row cache positions: (B, T, S)
                near = (q_index[:, :, None] - k_index[None, None, :]) < window
            masks = (allowed, allowed & near)  # (T, S) or (B, T, S)
            if self.rope_local_theta is not None:
                ropes = (rope, self._rope(positions, self.rope_local_theta, False))
        nope = self.nope_layers or ()
        flags = (  # (L,) bool each, or None where the layers do not differ
            jnp.asarray(sliding) if mixed else None,
            jnp.asarray(nope) if any(nope) else None,
            _layer_keys(key, self.num_layers) if self.router_jitter_noise else None,
        )
        every = int(all(sliding))  # 1: every layer slides (Mistral)

        kernel_mask: tuple[bool, int | None] = (False, None)  # (causal, window)
        if fused is not _DENSE and cache is None:
            kernel_mask = (True, self.sliding_window if every and not mixed else None)

        local_rope = ropes[1] is not ropes[0]
        # the arrays every layer reads, an argument of `_saved_as`'s custom_vjp
        shared = (masks, ropes, q_scale, None if fused is _DENSE else fused)

        def step(shared: Any, carry: Any, xs: Any) -> tuple[Any, Any]:
            masks, ropes, q_scale, fused = shared
            lp, index, (slide, no_rope, jitter) = xs
            h, kv = (carry, None) if cache is None else (carry[0], carry[1:])
            mask, tables = masks[every], ropes[every]
            if mixed:  # this layer's mask and rotary tables
                mask = jnp.where(slide, masks[1], masks[0])
                if local_rope:
                    cos, sin = (
                        jnp.where(slide, local, full) for full, local in zip(*ropes)
                    )
                    tables = (cos, sin)
            if no_rope is not None:  # NoPE layer: cos 1, sin 0 rotate nothing
                cos, sin = tables
                tables = (jnp.where(no_rope, 1, cos).astype(cos.dtype),
                          jnp.where(no_rope, 0, sin).astype(sin.dtype))  # fmt: skip
            if kernel_mask[0] and not mixed:  # the kernel's causal mask and window
                mask = fused
            if self.parallel_residual:  # Cohere: the MLP reads attention's input
                xm = self._norm(h, lp["input_layernorm"])
            a, kv = self._attention(
                lp, h, tables, mask, kv, index, pos, kernel_mask=kernel_mask,
                q_scale=q_scale,
            )  # fmt: skip
            after_attn, before_mlp, after_mlp = self.norm_names
            if after_attn is not None:  # Gemma 2, OLMo 2, GLM-4
                a = self._norm(a, lp[after_attn])
            h = h + self._residual(a)  # (B, T, D)
            if not self.parallel_residual:  # (Cohere's MLP reads attention's input)
                xm = h if before_mlp is None else self._norm(h, lp[before_mlp])
            x, logits = self._mlp_routed(lp["mlp"], xm, jitter)
            if "shared_mlp" in lp:  # Granite MoE shared: beside the experts
                x = x + self._shared_mlp(lp["shared_mlp"], xm)
            if after_mlp is not None:
                x = self._norm(x, lp[after_mlp])
            h = h + self._residual(x)
            ys = (h if return_hidden else None, logits if router else None)
            return (h if kv is None else (h, *kv)), ys

        def layer(carry: Any, xs: Any) -> tuple[Any, Any]:
            return step(shared, carry, xs)

        if cache is None and self.remat_saved_dtype is not None:
            saved = _saved_as(step, self.remat_saved_dtype, self.dtype)
            layer = functools.partial(saved, shared)
        elif cache is None:  # (decoding: no remat)
            layer = self._remat(layer)
        h0 = h
        if cache is None:
            h, (hidden, logits) = jax.lax.scan(layer, h, (m["layers"], None, flags))
            kv = None
        else:
            index = jnp.arange(self.num_layers, dtype=jnp.int32)  # (L,)
            carry = (h, cache.k, cache.v)  # (B, T, D), (L, B, S, KV, d) x 2
            stack = m["layers"]  # stored weights read in place (nn.matvec), no copy

            def cached(carry: Any, xs: Any) -> tuple[Any, Any]:
                i, slide = xs
                return layer(carry, (layer_params(stack, i), i, slide))

            (h, k, v), (hidden, logits) = jax.lax.scan(cached, carry, (index, flags))
            kv = (k, v)
        if return_hidden:
            hidden = jnp.concatenate([h0[None], hidden], axis=0)  # (L+1, B, T, D)
        return h, (kv, hidden, logits)

    def _rope(
        self, positions: jax.Array, theta: float, scaled: bool
    ) -> tuple[jax.Array, jax.Array]:
        """Rotary tables at ``positions``; ``scaled``: with ``rope_type``'s scaling."""
        f = upcast_dtype(self.dtype)
        if not scaled or (self.rope_type == "default" and not self.rope_freq_divisors):
            return rope_tables(positions, self.rotary_dim, theta, f)
        inv = rope_inv_freq(self, positions, f)
        return rope_tables(
            positions, self.rotary_dim, theta, f, inv_freq=inv,
            scale=attention_factor(self),
        )  # fmt: skip

    def _query_scale(self, positions: jax.Array) -> jax.Array | None:
        """Ministral 3's query scale ``1 + β ln(1 + ⌊p / L⌋)`` at ``positions``.

        transformers' ``get_llama_4_attn_scale``; ``(B|1, T, 1, 1)`` in float32,
        or None without ``query_scale_beta``.
        """
        if self.query_scale_beta is None or self.query_scale_length is None:
            return None
        p = positions if positions.ndim == 2 else positions[None]  # (B|1, T)
        periods = jnp.floor(p.astype(jnp.float32) / self.query_scale_length)
        scale = 1 + self.query_scale_beta * jnp.log1p(periods)
        return scale[:, :, None, None]

    def _residual(self, x: jax.Array) -> jax.Array:
        """A sublayer's output as added to the stream (× ``residual_multiplier``)."""
        if self.residual_multiplier is None:
            return x
        return x * jnp.asarray(self.residual_multiplier, x.dtype)

    def _final(self, params: Params, h: jax.Array) -> jax.Array:
        """The final norm; Granite's ``1 / logits_scaling``, Cohere's logit_scale."""
        h = self._norm(h, params["model"]["norm"])
        if self.logits_scaling is not None:
            h = h / jnp.asarray(self.logits_scaling, h.dtype)
        if self.logit_scale is not None:
            h = h * jnp.asarray(self.logit_scale, h.dtype)
        return h

    def _norm(self, x: jax.Array, p: Params) -> jax.Array:
        """RMSNorm with the gain ``p["weight"]`` (``1 + w`` for Gemma), or LayerNorm.

        ``layer_norm``: Cohere's LayerNorm with a gain and no bias.
        """
        if self.layer_norm:
            return layer_norm(x, p["weight"], None, self.rms_norm_eps)
        return rms_norm(
            x, p["weight"], self.rms_norm_eps, unit_offset=self.norm_unit_offset
        )

    def _mlp_routed(
        self, mp: Params, x: jax.Array, jitter: jax.Array | None = None
    ) -> tuple[jax.Array, Any]:
        """``(MLP(x), router logits (N, E) or None)``.

        A sparse mixture of gated experts (`entrenar.nn.moe`) when
        ``num_experts``, else `_mlp` over chunks of tokens when ``tokens x I`` is
        large (`entrenar.nn.layers.token_chunked`: the backward pass's float32
        ``(tokens, I)`` temporaries bounded to a chunk). ``jitter``: the layer's
        key data ``(2,)`` for `entrenar.nn.moe.router_jitter` (training), or None.
        """
        if not self.num_experts:
            mlp = functools.partial(self._mlp, mp)
            width = self.intermediate_size
            return token_chunked(mlp, x, width, self.mlp_chunk_elements), None
        if jitter is not None:  # Mixtral: router and experts read the jittered x
            key = jax.random.wrap_key_data(jitter)
            x = router_jitter(x, self.router_jitter_noise, key)
        act = ACTIVATIONS[self.hidden_act]
        glu = None
        if self.swiglu_limit is not None:  # gpt-oss
            glu = functools.partial(
                clamped_swiglu, limit=self.swiglu_limit, alpha=self.swiglu_alpha
            )
        return sparse_moe(
            mp, x, self.num_experts_per_tok, self.norm_topk_prob,
            matmul_dtype=self.matmul_dtype, activation=act, glu=glu,
        )  # fmt: skip

    def _shared_mlp(self, sp: Params, x: jax.Array) -> jax.Array:
        """Granite MoE shared's ``shared_mlp`` of ``x: (..., D)``.

        ``[g; u] = x W_inᵀ`` (``W_in: (2 S, D)``), then ``(act(g) ⊙ u) W_outᵀ``.
        """
        md = self.matmul_dtype
        act = ACTIVATIONS[self.hidden_act]
        gu = linear(x, sp["input_linear"]["weight"], matmul_dtype=md)  # (..., 2 S)
        g, u = jnp.split(gu, 2, axis=-1)  # (..., S) each
        return linear(act(g) * u, sp["output_linear"]["weight"], matmul_dtype=md)

    def _mlp(self, mp: Params, x: jax.Array) -> jax.Array:
        """The gated MLP: SwiGLU or GeGLU, biases and a fused gate_up as set."""
        md = self.matmul_dtype
        act = ACTIVATIONS[self.hidden_act]
        if self.ungated_mlp:  # Arcee: act(x W_upᵀ + b_up) W_downᵀ + b_down
            up, down = mp["up_proj"], mp["down_proj"]
            u = act(linear(x, up["weight"], _bias(up), matmul_dtype=md))  # (..., I)
            return linear(u, down["weight"], _bias(down), matmul_dtype=md)
        if self.fused_gate_up:  # Phi-3: gate_up_proj = [gate; up]
            gu = linear(x, mp["gate_up_proj"]["weight"], _bias(mp["gate_up_proj"]),
                        matmul_dtype=md)  # fmt: skip
            g, u = jnp.split(gu, 2, axis=-1)  # (..., I) each
            down = mp["down_proj"]
            return linear(act(g) * u, down["weight"], _bias(down), matmul_dtype=md)
        biases = None
        if self.mlp_bias:
            biases = (
                _bias(mp["gate_proj"]), _bias(mp["up_proj"]), _bias(mp["down_proj"])
            )  # fmt: skip
        if act is silu and biases is None:  # Llama's call, unchanged
            return gated_mlp(
                x,
                mp["gate_proj"]["weight"],
                mp["up_proj"]["weight"],
                mp["down_proj"]["weight"],
                matmul_dtype=md,
            )
        return gated_mlp(
            x,
            mp["gate_proj"]["weight"],
            mp["up_proj"]["weight"],
            mp["down_proj"]["weight"],
            act,
            matmul_dtype=md,
            biases=biases,
        )

    def _attention(
        self,
        lp: Params,
        h: jax.Array,
        rope: tuple[jax.Array, jax.Array],
        allowed: jax.Array,
        cache_kv: tuple[jax.Array, jax.Array] | None,
        index: jax.Array | None,
        pos: jax.Array | None,
        kernel_mask: tuple[bool, int | None] = (False, None),
        q_scale: jax.Array | None = None,
    ) -> tuple[jax.Array, Any]:
        """Self-attention of ``h: (B, T, D)``; returns ``(output, cache_kv)``.

        ``cache_kv``: None, or the whole ``(L, B, S, KV, d)`` key and value buffers,
        into which the new entries are written at layer ``index`` and ``pos``.
        ``kernel_mask``: ``(causal, window)`` that fused attention applies on top
        of ``allowed`` (the reference path gets them inside ``allowed``).
        ``q_scale``: `_query_scale`'s, multiplying the rotated queries.
        """
        x = h if self.post_norms else self._norm(h, lp["input_layernorm"])
        return self._gqa(
            lp["self_attn"], x, rope, allowed, cache_kv, index, pos, kernel_mask,
            q_scale,
        )  # fmt: skip

    def _gqa(
        self,
        ap: Params,
        x: jax.Array,
        rope: tuple[jax.Array, jax.Array],
        allowed: jax.Array | None,
        cache_kv: tuple[jax.Array, jax.Array] | None,
        index: jax.Array | None,
        pos: jax.Array | None,
        kernel_mask: tuple[bool, int | None] = (False, None),
        q_scale: jax.Array | None = None,
    ) -> tuple[jax.Array, Any]:
        """`_attention` of the normed ``x: (B, T, D)``; ``ap``: ``self_attn``'s tree."""
        b, t, _ = x.shape
        nh, nkv, hd = self.num_heads, self.num_kv_heads, self.hd
        md = self.matmul_dtype
        if self.fused_qkv:  # Phi-3: qkv_proj = [q; k; v]
            qkv = linear(x, ap["qkv_proj"]["weight"], _bias(ap["qkv_proj"]),
                         matmul_dtype=md)  # fmt: skip
            q, k, v = jnp.split(qkv, [nh * hd, (nh + nkv) * hd], axis=-1)
        else:
            q = linear(x, ap["q_proj"]["weight"], _bias(ap["q_proj"]), matmul_dtype=md)
            k = linear(x, ap["k_proj"]["weight"], _bias(ap["k_proj"]), matmul_dtype=md)
            v = linear(x, ap["v_proj"]["weight"], _bias(ap["v_proj"]), matmul_dtype=md)
        if self.qk_norm and self.qk_norm_whole:  # OLMo 2: over all H d values
            q = self._norm(q, ap["q_norm"])  # (B, T, H d)
            k = self._norm(k, ap["k_norm"])  # (B, T, KV d)
        if self.clip_qkv is not None:  # OLMoE: after the norms, before rotary
            c = jnp.asarray(self.clip_qkv, q.dtype)
            q, k, v = (jnp.clip(a, -c, c) for a in (q, k, v))
        q = q.reshape(b, t, nh, hd)  # (B, T, H, d)
        k = k.reshape(b, t, nkv, hd)  # (B, T, KV, d)
        v = v.reshape(b, t, nkv, hd)
        if self.qk_norm and not self.qk_norm_whole:  # per head, before rotary
            q = self._norm(q, ap["q_norm"])  # gains (d,) or (H, d): qk_norm_heads
            k = self._norm(k, ap["k_norm"])
        if self.rope_interleave:  # GLM, ERNIE 4.5: pairs as halves (same scores)
            q, k = (
                interleaved_as_halves(q, self.rotary_dim),
                interleaved_as_halves(k, self.rotary_dim),
            )
        q = rotate(q, rope)
        k = rotate(k, rope)
        if q_scale is not None:  # Ministral 3: (B|1, T, 1, 1)
            q = q * q_scale.astype(q.dtype)
        scale = self.attention_multiplier  # None: d^-1/2
        if self.query_pre_attn_scalar is not None:
            scale = self.query_pre_attn_scalar**-0.5
        fused = self.uses_fused_attention()
        sinks = ap.get("sinks")  # (H,) or None
        o: jax.Array | None = None
        if cache_kv is not None and index is not None and pos is not None:
            ck = write_cache(cache_kv[0], k, index, pos)  # (L, B, S, KV, d)
            cv = write_cache(cache_kv[1], v, index, pos)
            cache_kv = (ck, cv)
            if fused:
                k, v = read_cache(ck, index), read_cache(cv, index)  # (B, S, KV, d)
            else:  # the layer's keys and values read in place, not copied out
                o = cached_attention(
                    q, ck, cv, index, allowed, matmul_dtype=md, scale=scale,
                    softcap=self.attn_logit_softcapping, sinks=sinks,
                )  # (B, T, H, d)  # fmt: skip
        if o is None and fused:
            causal, window = kernel_mask
            o = fused_attention(
                q, k, v, allowed, causal=causal, window=window, scale=scale,
                matmul_dtype=md, implementation=None if cache_kv is None else "xla",
                sinks=sinks,
            )  # (B, T, H, d)  # fmt: skip
        elif o is None:
            o = dot_product_attention(
                q, k, v, allowed, matmul_dtype=md, scale=scale,
                softcap=self.attn_logit_softcapping, sinks=sinks, impl="reference",
            )  # (B, T, H, d)  # fmt: skip
        o = linear(o.reshape(b, t, nh * hd), ap["o_proj"]["weight"],
                   _bias(ap["o_proj"]), matmul_dtype=md)  # fmt: skip
        return o, cache_kv

    def _head(self, params: Params, h: jax.Array) -> jax.Array:
        return self.logits_of_features(params, self._final(params, h))

    def logits_of_features(self, params: Params, h: jax.Array) -> jax.Array:
        """`apply`'s logits ``(..., V)`` from `features` ``h: (..., D)``.

        ``h Wᵀ`` (``W = output_weight(params)``, in ``matmul_dtype``) in float32
        (float64 for a float64 model), soft-capped for Gemma 2. Scoring a few
        positions of a long sequence (`entrenar.nn.scoring`) takes `features` once
        and this on chunks of positions.
        """
        w = self.output_weight(params)
        logits = linear(h, w, matmul_dtype=self.matmul_dtype)  # (..., V)
        logits = logits.astype(upcast_dtype(h.dtype))
        if self.final_logit_softcapping is not None:  # Gemma 2
            c = jnp.asarray(self.final_logit_softcapping, logits.dtype)
            logits = jnp.tanh(logits / c) * c
        return logits


def _extra_mask(
    mask: jax.Array | None, segment_ids: jax.Array | None, b: int, t: int
) -> jax.Array | None:
    """The mask beyond causality, ``(B, T, T)``: padded keys and other segments."""
    extra = None
    if mask is not None:
        extra = jnp.broadcast_to(mask.astype(bool)[:, None, :], (b, t, t))
    if segment_ids is not None:
        same = segment_ids[:, :, None] == segment_ids[:, None, :]  # (B, T, T)
        extra = same if extra is None else extra & same
    return extra


def _check_experts(c: LlamaConfig) -> None:
    """Raise `ConfigError` for mixture-of-experts fields that do not fit together."""
    if min(c.num_experts, c.shared_expert_intermediate_size,
           c.shared_mlp_intermediate_size) < 0:  # fmt: skip
        raise ConfigError(
            "LlamaConfig.num_experts, shared_expert_intermediate_size and "
            "shared_mlp_intermediate_size must be >= 0"
        )
    if c.moe_intermediate_size is not None and c.moe_intermediate_size <= 0:
        raise ConfigError("LlamaConfig.moe_intermediate_size must be > 0 or None")
    jitter = c.router_jitter_noise
    if not 0 <= as_float(jitter) < 1:
        raise ConfigError(
            f"LlamaConfig.router_jitter_noise must be in [0, 1), got {jitter!r}"
        )
    if c.swiglu_limit is not None and not c.swiglu_limit > 0:
        raise ConfigError(
            f"LlamaConfig.swiglu_limit must be > 0 or None, got {c.swiglu_limit}"
        )
    if not c.num_experts:
        for name in ("router_jitter_noise", "shared_expert_intermediate_size",
                     "shared_mlp_intermediate_size", "moe_bias",
                     "swiglu_limit"):  # fmt: skip
            if getattr(c, name) not in (0, False, None):
                raise ConfigError(f"LlamaConfig.{name} needs num_experts > 0")
        return
    if not 0 < c.num_experts_per_tok <= c.num_experts:
        raise ConfigError(
            f"LlamaConfig.num_experts_per_tok must be in [1, num_experts = "
            f"{c.num_experts}], got {c.num_experts_per_tok}"
        )
    if c.fused_gate_up or c.mlp_bias:
        raise ConfigError(
            "LlamaConfig.num_experts > 0 takes unfused, bias-free experts; set "
            "fused_gate_up=False and mlp_bias=False"
        )


def _check_remat_saved(config: LlamaConfig) -> None:
    """``remat_saved_dtype``: None, or bfloat16 with every layer recomputed."""
    saved = config.remat_saved_dtype
    if saved is None:
        return
    if saved not in REMAT_SAVED_DTYPES:
        raise ConfigError(
            f"LlamaConfig.remat_saved_dtype must be None or one of "
            f"{REMAT_SAVED_DTYPES}, got {saved!r}"
        )
    whole = config.remat_policy == "nothing_saveable" or (
        config.remat and config.remat_policy is None
    )
    if not whole:
        raise ConfigError(
            f"LlamaConfig.remat_saved_dtype {saved!r} rounds the input that a wholly "
            f"recomputed layer keeps; it needs remat_policy 'nothing_saveable' (or "
            f"remat without a policy), got remat_policy {config.remat_policy!r}, "
            f"remat {config.remat}"
        )
    if config.dtype != "float32":
        raise ConfigError(
            f"LlamaConfig.remat_saved_dtype {saved!r} rounds a float32 residual "
            f"stream; with dtype {config.dtype!r} the layer input is already "
            f"{config.dtype}: remove remat_saved_dtype"
        )


def _check_mlp_chunks(config: LlamaConfig) -> None:
    """``mlp_chunk_elements``: None, or a positive bound on a dense MLP's chunks."""
    n = config.mlp_chunk_elements
    if n is None:
        return
    if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
        raise ConfigError(
            f"LlamaConfig.mlp_chunk_elements must be None or a positive int, got {n!r}"
        )
    if config.num_experts:
        raise ConfigError(
            f"LlamaConfig.mlp_chunk_elements bounds a dense MLP's chunks of tokens; "
            f"this model's MLPs are mixtures of {config.num_experts} experts: remove "
            f"it"
        )


def _saved_as(
    layer: Callable[[Any, jax.Array, Any], Any], saved: str, dtype: str
) -> Callable[[Any, jax.Array, Any], Any]:
    """``layer(shared, h, xs)``, recomputed in the backward pass from ``bf16(h)``.

    A `jax.custom_vjp` whose forward pass is ``layer`` itself (the same values)
    and whose residuals are ``h: (B, T, D)`` rounded to ``saved`` and the
    arguments as they are: ``shared`` (the masks and rotary tables every layer
    reads; arguments, not closed over, which a custom_vjp cannot do with
    traced values) and ``xs`` (the layer's slice of the stacked parameters,
    which the scan forwards rather than copies). The backward pass is
    ``jax.vjp(layer, shared, h', xs)`` at ``h' = dtype(saved(h))``: the layer's
    Jacobian at ``h'`` instead of ``h`` (``|h' - h| <= 2^-9 |h|`` element-wise
    for bfloat16) applied to exact incoming cotangents, so the residual
    connection's identity passes them through unchanged and only the attention
    and MLP branches see the rounding. That is `jax.checkpoint` with
    ``nothing_saveable`` with the saved input at half the bytes, as gradient
    checkpointing of a bfloat16 model keeps it (PEFT on a bfloat16 model).
    """
    low, high = jnp.dtype(saved), jnp.dtype(dtype)
    bits = jnp.dtype(f"uint{8 * low.itemsize}")
    primal = lambda x: isinstance(x, CustomVJPPrimal)  # noqa: E731
    empty = lambda x: x is None  # noqa: E731

    @jax.custom_vjp
    def run(shared: Any, h: jax.Array, xs: Any) -> Any:
        return layer(shared, h, xs)

    def forward(shared: Any, h: Any, xs: Any) -> tuple[Any, Any]:
        args = (shared, xs)
        value = jax.tree.map(lambda p: p.value, args, is_leaf=primal)
        # the arguments split by whether they are differentiated (the adapters)
        # or not (the frozen base: its codes, scales, norms; masks, tables), so
        # that the backward pass differentiates the layer in the former only
        moving = jax.tree.map(lambda p: p.value if p.perturbed else None, args,
                              is_leaf=primal)  # fmt: skip
        fixed = jax.tree.map(lambda p: None if p.perturbed else p.value, args,
                             is_leaf=primal)  # fmt: skip
        # kept as the rounded values' bit patterns: XLA:CPU turns a scan's stack
        # of bfloat16 residuals into a float32 one (converting where it is
        # written and read), which it cannot do to integers
        kept = jax.lax.bitcast_convert_type(h.value.astype(low), bits)  # (B, T, D)
        return layer(value[0], h.value, value[1]), (kept, moving, fixed)

    def backward(res: Any, ct: Any) -> Any:
        kept, moving, fixed = res
        ct = jax.tree.map(_instantiate, ct, is_leaf=_symbolic)
        h = jax.lax.bitcast_convert_type(kept, low).astype(high)

        def differentiated(h: jax.Array, moving: Any) -> Any:
            shared, xs = jax.tree.map(lambda m, f: f if m is None else m,
                                      moving, fixed, is_leaf=empty)  # fmt: skip
            return layer(shared, h, xs)

        _, vjp = jax.vjp(differentiated, h, moving)
        dh, dmoving = vjp(ct)
        return (dmoving[0], dh, dmoving[1])  # None: no cotangent (not differentiated)

    run.defvjp(forward, backward, symbolic_zeros=True)
    return run


def _symbolic(x: Any) -> bool:
    return isinstance(x, SymbolicZero)


def _instantiate(x: Any) -> Any:
    """A `SymbolicZero` cotangent as zeros (others as they are)."""
    return jnp.zeros(x.shape, x.dtype) if isinstance(x, SymbolicZero) else x


def _layer_keys(key: Any, n: int) -> jax.Array | None:
    """The scan's per-layer jitter keys, raw data ``(n, 2)``; None without a key.

    ``split(fold_in(key, JITTER_STREAM), n)``: the training step's key also gives
    the LoRA dropout keys (`entrenar.lora.with_dropout_keys`: ``fold_in(key, i)``
    for leaf ``i``), so the jitter draws from its own stream.
    """
    if key is None:
        return None
    if not jnp.issubdtype(jnp.asarray(key).dtype, jax.dtypes.prng_key):
        key = jax.random.wrap_key_data(key)
    key = jax.random.fold_in(key, JITTER_STREAM)
    return jax.random.key_data(jax.random.split(key, n))


JITTER_STREAM = 0x7A17_7E12
"""`fold_in` data of the router jitter's keys (far above any leaf index)."""


def _bias(p: Params) -> Any:
    """A linear layer's bias, None when it has none."""
    return p.get("bias")


def _check_tokens(tokens: jax.Array) -> None:
    if tokens.ndim != 2:
        raise ShapeError(f"tokens must have shape (batch, time), got {tokens.shape}")


Llama = LlamaConfig
"""The model is its config: ``Llama(...)`` is a `LlamaConfig`."""


_LLAMA_SWITCHES = ("rope_type", "attention_bias", "attention_out_bias", "mlp_bias")


def llama_from_hf(hf: Mapping[str, Any]) -> LlamaConfig:
    """A Llama 1-3.x ``config.json`` (``model_type: llama``) as a `LlamaConfig`."""
    bias = bool(hf.get("attention_bias", False))
    return LlamaConfig(
        **common_from_hf(hf, "config.json"),
        attention_bias=bias,
        attention_out_bias=bias,
        mlp_bias=bool(hf.get("mlp_bias", False)),
    )


def llama_to_hf(c: LlamaConfig) -> dict[str, Any]:
    """The ``config.json`` of a Llama `LlamaConfig`."""
    hf = common_to_hf(c, "LlamaForCausalLM", "llama", _LLAMA_SWITCHES)
    hf["mlp_bias"] = c.mlp_bias
    return hf


def _tiny_llama() -> LlamaConfig:
    """Llama 3.1-style: llama3 rope scaling, biases everywhere, untied head."""
    return LlamaConfig(
        **TINY_SIZES,
        rope_type="llama3",
        rope_factor=8.0,
        rope_low_freq_factor=1.0,
        rope_high_freq_factor=4.0,
        rope_original_max_position_embeddings=64,
        attention_bias=True,
        attention_out_bias=True,
        mlp_bias=True,
    )


register_family(
    LlamaConfig,
    "llama",
    "Llama 1-3.x: RMSNorm, rotary embeddings (llama3, linear, dynamic scaling), "
    "grouped-query attention, SwiGLU",
    hf_class="LlamaForCausalLM",
    from_hf=llama_from_hf,
    to_hf=llama_to_hf,
    tiny=_tiny_llama,
)

__all__ = ["COMPUTE_DTYPES", "REMAT_POLICIES", "Llama", "LlamaConfig", "check_dtype"]
