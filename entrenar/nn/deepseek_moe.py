"""DeepSeekMoE layers: dense layers first, then routed and shared experts, unrolled.

DeepSeek-AI, "DeepSeek-V2", 2024 (DeepSeekMoE: fine-grained routed experts beside
shared ones); "DeepSeek-V3 Technical Report", 2024 (sigmoid routing with a bias for
the choice only). `DeepseekMoeConfig` is the `LlamaConfig` both families with this
MLP build on: DeepSeek-V2/V3 (`entrenar.nn.deepseek`, multi-head latent attention)
and GLM-4.5 / 4.6 (`entrenar.nn.glm4_moe`, grouped-query attention). Each family
gives its attention (`DeepseekMoeConfig._attention_shapes`, `_self_attention`).

Layers ``l < first_k_dense_replace`` have a dense SwiGLU of ``intermediate_size``;
the others DeepSeekMoE, with router ``W_r: (E, D)`` in float32, correction bias
``b: (E,)`` (``e_score_correction_bias``, a buffer in transformers), ``G =
n_group`` groups::

    s   = σ(x W_rᵀ)                        (E,)  in float32
    s'  = s + b                                   the choice only
    g_j = Σ top-2(s' of group j)            (G,)  group scores
    S   = top-k(s' masked to the topk_group best groups)
    w_e = s_e / (Σ_{j∈S} s_j + 1e-20) · routed_scaling_factor    (norm_topk_prob;
          without it s_e · routed_scaling_factor)
    y   = Σ_{e∈S} w_e SwiGLU_e(x) + SwiGLU_shared(x)    (shared: n_shared_experts ×
                                                          moe_intermediate_size wide)

DeepSeek-V2's routing (``scoring_func: softmax``) scores with ``softmax(x W_rᵀ)``,
no bias, and takes the top ``k`` of all experts (``greedy``) or of the
``topk_group`` groups with the largest maximum (``group_limited_greedy``); ``w_e =
s_e · routed_scaling_factor``, never renormalised (`TOPK_METHODS`). The routed
experts run entrenar's grouped product (`entrenar.nn.moe.experts_mlp`: the tiled
scan with its own VJP), their weights stacked ``(E, out, in)`` per layer.

Layers differ (dense or MoE), so the tree holds them as a list, one unstacked layer
each, under Hugging Face's own names (``model.layers.{i}.mlp.gate.weight``), and the
forward pass runs them one after the other (one compiled body per layer where the
other families scan one stacked body; XLA:CPU's memory-minimising scheduler, which
``import entrenar`` selects, keeps the step's temporaries from growing with each
layer: specs/models.md). The Hub's per-expert tensors
(``mlp.experts.{e}.{gate,up,down}_proj.weight``) and transformers' in-memory fused
``gate_up_proj`` read as the stacks (`moe_from_hf_tensors`); a folder is written
with the Hub's names. The multi-token-prediction layers a checkpoint may hold past
the last layer (``num_nextn_predict_layers``) are not part of the model and are
skipped, as transformers skips them.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp

from entrenar.errors import ConfigError
from entrenar.nn.attention import KVCache
from entrenar.nn.bf16_weight import TiedEmbedding
from entrenar.nn.decoder_config import as_float
from entrenar.nn.layers import embedding, gated_mlp, upcast_dtype
from entrenar.nn.linear import linear
from entrenar.nn.llama import _DENSE, LlamaConfig, _saved_as
from entrenar.nn.moe import experts_mlp
from entrenar.nn.moe_families import moe_from_hf_tensors, moe_to_hf_tensors
from entrenar.nn.weight_node import to_dense
from entrenar.types import Params, PRNGKey

TOPK_METHODS = {
    "noaux_tc": "sigmoid",
    "greedy": "softmax",
    "group_limited_greedy": "softmax",
}
"""The routings `DeepseekMoeConfig` implements and the scoring each takes: V3's
sigmoid with the correction bias, V2's softmax top-k (of all experts, or of the
``topk_group`` groups with the largest maximum)."""


@dataclasses.dataclass(frozen=True)
class DeepseekMoeConfig(LlamaConfig):
    """Dense layers, then DeepSeekMoE layers, unrolled (module docstring).

    ``num_experts`` is ``n_routed_experts``, ``intermediate_size`` the dense
    layers' MLP and ``moe_intermediate_size`` an expert's. A subclass gives the
    attention: `_attention_shapes` (one layer's ``self_attn`` tree) and
    `_self_attention`.

    Attributes:
        first_k_dense_replace: the first layers, with a dense MLP.
        n_shared_experts: shared experts (one SwiGLU that many experts wide).
        n_group: expert groups of the router.
        topk_group: groups a token's experts are chosen from.
        routed_scaling_factor: the routed experts' weights are multiplied by it.
        scoring_func: ``"sigmoid"`` (DeepSeek-V3, GLM-4.5) or ``"softmax"`` (V2).
        topk_method: one of `TOPK_METHODS`: ``"noaux_tc"`` (V3, GLM-4.5),
            ``"greedy"`` or ``"group_limited_greedy"`` (V2).
        num_nextn_predict_layers: multi-token-prediction layers the checkpoint
            holds after the last layer (skipped on load; kept for the config).
    """

    first_k_dense_replace: int = 0
    n_shared_experts: int = 0
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    scoring_func: str = "sigmoid"
    topk_method: str = "noaux_tc"
    num_nextn_predict_layers: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_moe(self)
        if self.mlp_chunk_elements is not None:  # its dense layers run whole
            raise ConfigError(
                f"{type(self).__name__}.mlp_chunk_elements: this family's dense "
                f"MLPs are not run over chunks of tokens; remove it"
            )

    # ------------------------------------------------------------------ shapes
    def is_moe_layer(self, i: int) -> bool:
        """Whether layer ``i`` has the mixture of experts (else a dense MLP)."""
        return i >= self.first_k_dense_replace and self.num_experts > 0

    def param_shapes(self) -> dict[str, Any]:
        """The tree: ``model.layers`` a list of per-layer dicts (module docstring)."""
        d = self.hidden_size
        layers = [
            {
                "input_layernorm": {"weight": (d,)},
                "self_attn": self._attention_shapes(),
                "post_attention_layernorm": {"weight": (d,)},
                "mlp": self._moe_layer_shapes() if self.is_moe_layer(i) else mlp_shapes(
                    d, self.intermediate_size
                ),
            }
            for i in range(self.num_layers)
        ]  # fmt: skip
        return self._model_shapes(layers)

    def _attention_shapes(self) -> dict[str, Any]:
        """One layer's ``self_attn`` shapes (the family's attention)."""
        raise NotImplementedError

    def _moe_layer_shapes(self) -> dict[str, Any]:
        e, d, i = self.num_experts, self.hidden_size, self.expert_size
        mlp: dict[str, Any] = {
            "gate": {"weight": (e, d)},
            "experts": {
                "gate_proj": {"weight": (e, i, d)},
                "up_proj": {"weight": (e, i, d)},
                "down_proj": {"weight": (e, d, i)},
            },
        }
        if self.topk_method == "noaux_tc":  # V3: the choice's bias
            mlp["gate"]["e_score_correction_bias"] = (e,)
        if self.n_shared_experts:
            mlp["shared_experts"] = mlp_shapes(d, i * self.n_shared_experts)
        return mlp

    def init(self, key: PRNGKey) -> Params:
        """`LlamaConfig.init`, with the routers' correction biases 0."""
        params = super().init(key)
        for lp in params["model"]["layers"]:
            gate = lp["mlp"].get("gate")
            if gate is not None and "e_score_correction_bias" in gate:
                b = gate["e_score_correction_bias"]
                gate["e_score_correction_bias"] = jnp.zeros_like(b)
        return params

    # ------------------------------------------------------------------- model
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
        """The layers one after the other; `LlamaConfig._layers`' contract.

        Returns ``(h, (cache_kv, hidden, None))``: no router logits (the families
        have no auxiliary loss: `_check_moe`).
        """
        m = params["model"]
        table = m["embed_tokens"]["weight"]
        table = table.table if isinstance(table, TiedEmbedding) else table
        h = embedding(table, tokens).astype(self.dtype)  # (B, T, D)
        rope = self._rope(positions, self.rope_theta, scaled=True)  # (B|1,T,1,r)
        kernel = fused is not _DENSE and cache is None  # fused: causal in the kernel
        mask = fused if kernel else allowed
        kv = None if cache is None else (cache.k, cache.v)
        pos = None if cache is None else cache.pos
        hidden = [h]
        for i, lp in enumerate(m["layers"]):
            step: Callable[..., Any] = functools.partial(
                self._layer, i, rope, mask, pos, kernel
            )
            if cache is None and self.remat_saved_dtype is not None:
                # the layer kept as bf16(h) (`_saved_as`); rope and mask its arguments
                def layer(shared: Any, h: jax.Array, lp: Params, i: int = i) -> Any:
                    rope, mask = shared
                    return self._layer(i, rope, mask, None, kernel, lp, h, None)

                saved = _saved_as(layer, self.remat_saved_dtype, self.dtype)
                h, kv = saved((rope, mask), h, lp)
            else:
                if cache is None:  # (decoding: no remat)
                    step = self._remat(step)
                h, kv = step(lp, h, kv)
            hidden.append(h)
        stacked = jnp.stack(hidden) if return_hidden else None  # (L + 1, B, T, D)
        return h, (kv, stacked, None)

    def _layer(
        self,
        i: int,
        rope: tuple[jax.Array, jax.Array],
        mask: jax.Array | None,
        pos: jax.Array | None,
        kernel: bool,
        lp: Params,
        h: jax.Array,
        kv: tuple[jax.Array, jax.Array] | None,
    ) -> tuple[jax.Array, Any]:
        """Layer ``i``: ``h + Attn(RMSNorm(h))``, then ``+ MLP or MoE(RMSNorm(.))``."""
        x = self._norm(h, lp["input_layernorm"])
        a, kv = self._self_attention(lp["self_attn"], x, rope, mask, kv, i, pos, kernel)
        h = h + a
        x = self._norm(h, lp["post_attention_layernorm"])
        mp, md = lp["mlp"], self.matmul_dtype
        if "experts" in mp:
            y = self._deepseek_moe(mp, x)
        else:
            y = gated_mlp(
                x, mp["gate_proj"]["weight"], mp["up_proj"]["weight"],
                mp["down_proj"]["weight"], matmul_dtype=md,
            )  # fmt: skip
        return h + y, kv

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
        """Attention of the normed ``x: (B, T, D)`` of layer ``i`` (the family's).

        ``kv``: the whole cache buffers (written at layer ``i`` and ``pos``) or
        None; ``kernel``: fused attention applies the causal mask itself.
        Returns ``(output (B, T, D), kv)``.
        """
        raise NotImplementedError

    def _deepseek_moe(self, mp: Params, x: jax.Array) -> jax.Array:
        """DeepSeekMoE of ``x: (B, T, D)``: routed experts plus the shared ones."""
        shape, md = x.shape, self.matmul_dtype
        x2 = x.reshape(-1, shape[-1])  # (N, D)
        gate = mp["gate"]
        weights, chosen = self.route(
            x2, gate["weight"], gate.get("e_score_correction_bias")
        )  # (N, k) each
        ex = mp["experts"]
        y = experts_mlp(
            x2, weights, chosen, self.num_experts, ex["gate_proj"]["weight"],
            ex["up_proj"]["weight"], ex["down_proj"]["weight"], matmul_dtype=md,
        )  # (N, D)  # fmt: skip
        if "shared_experts" in mp:
            sp = mp["shared_experts"]
            y = y + gated_mlp(
                x2, sp["gate_proj"]["weight"], sp["up_proj"]["weight"],
                sp["down_proj"]["weight"], matmul_dtype=md,
            )  # fmt: skip
        return y.reshape(shape)

    def route(
        self, x: jax.Array, w: Any, bias: jax.Array | None
    ) -> tuple[jax.Array, jax.Array]:
        """The routing of ``x: (N, D)`` (module docstring; V2's: `TOPK_METHODS`).

        ``bias``: the correction bias ``(E,)`` of sigmoid routing (None for V2).
        Returns ``(weights (N, k) float32, experts (N, k) int32)``. The router's
        product is in float32 (transformers keeps ``gate.weight`` in float32).
        """
        f = upcast_dtype(x.dtype)
        wr = jnp.asarray(to_dense(w)).astype(f)  # (E, D)
        logits = linear(x.astype(f), wr)  # (N, E)
        n, e, g = logits.shape[0], self.num_experts, self.n_group
        if self.scoring_func == "softmax":  # V2
            s = jax.nn.softmax(logits, axis=-1)  # (N, E)
            choice = jax.lax.stop_gradient(s)
        else:  # V3: the bias moves the choice only
            s = jax.nn.sigmoid(logits)
            choice = jax.lax.stop_gradient(s + jnp.asarray(bias).astype(f))
        if g > 1 and self.topk_method != "greedy":
            by_group = choice.reshape(n, g, e // g)  # (N, G, E/G)
            if self.topk_method == "noaux_tc":  # V3: a group's top-2 sum
                group = jax.lax.top_k(by_group, 2)[0].sum(-1)  # (N, G)
            else:  # V2: a group's maximum
                group = by_group.max(-1)
            _, best = jax.lax.top_k(group, self.topk_group)  # (N, topk_group)
            keep = jnp.zeros((n, g), bool).at[jnp.arange(n)[:, None], best].set(True)
            keep = jnp.repeat(keep, e // g, axis=1)  # (N, E)
            choice = jnp.where(keep, choice, -jnp.inf)
        _, experts = jax.lax.top_k(choice, self.num_experts_per_tok)  # (N, k)
        weights = jnp.take_along_axis(s, experts, axis=-1)  # (N, k)
        if self.norm_topk_prob:
            weights = weights / (jnp.sum(weights, -1, keepdims=True) + 1e-20)
        weights = weights * jnp.asarray(self.routed_scaling_factor, f)
        return weights, experts.astype(jnp.int32)


def mlp_shapes(d: int, i: int) -> dict[str, Any]:
    """A SwiGLU block's shapes, ``I = i`` wide."""
    return {
        "gate_proj": {"weight": (i, d)},
        "up_proj": {"weight": (i, d)},
        "down_proj": {"weight": (d, i)},
    }


def _check_moe(c: DeepseekMoeConfig) -> None:
    """Raise `ConfigError` for DeepSeekMoE fields that do not fit together."""
    name = type(c).__name__
    if not 0 <= c.first_k_dense_replace <= c.num_layers:
        raise ConfigError(
            f"{name}.first_k_dense_replace must be in [0, num_layers = "
            f"{c.num_layers}], got {c.first_k_dense_replace}"
        )
    if TOPK_METHODS.get(c.topk_method) != c.scoring_func:
        raise ConfigError(
            f"{name}.topk_method {c.topk_method!r} with scoring_func "
            f"{c.scoring_func!r}: the routings are {TOPK_METHODS} (method: scoring)"
        )
    if c.scoring_func == "softmax" and c.norm_topk_prob:
        raise ConfigError(
            f"{name}.norm_topk_prob with softmax scoring: transformers' "
            "DeepSeek-V2 never renormalises (DeepSeek's own code does); set it False"
        )
    if not 0 < as_float(c.routed_scaling_factor) < float("inf"):
        raise ConfigError(f"{name}.routed_scaling_factor must be a finite number > 0")
    if c.num_experts:
        e, g = c.num_experts, c.n_group
        pair = c.topk_method == "noaux_tc" and g > 1
        if g <= 0 or e % g or (pair and e // g < 2):
            raise ConfigError(
                f"{name}.n_group {g} must divide num_experts {e} into "
                "groups (of at least 2 for noaux_tc: a group's score is its top-2 sum)"
            )
        if not 0 < c.topk_group <= g:
            raise ConfigError(
                f"{name}.topk_group must be in [1, n_group = {g}], got {c.topk_group}"
            )
        if c.num_experts_per_tok > c.topk_group * (e // g):
            raise ConfigError(
                f"{name}.num_experts_per_tok {c.num_experts_per_tok} "
                f"exceeds the experts of topk_group = {c.topk_group} groups"
            )


# ------------------------------------------------------------- tensor names
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def deepseek_moe_from_hf_tensors(
    flat: Mapping[str, Any], config: DeepseekMoeConfig
) -> dict[str, Any]:
    """A checkpoint's tensors under the tree's names (module docstring).

    The multi-token-prediction layers ``L .. L + num_nextn_predict_layers - 1``
    are dropped, and so is the empty shared MLP transformers builds for
    ``n_shared_experts`` 0; the experts are stacked (`moe_from_hf_tensors`).
    """
    n, extra = config.num_layers, config.num_nextn_predict_layers
    kept = {}
    for name, value in flat.items():
        m = _LAYER.match(name)
        if m is not None and n <= int(m.group(1)) < n + extra:
            continue
        if ".shared_experts." in name and 0 in getattr(value, "shape", ()):
            continue  # n_shared_experts 0: transformers' empty shared MLP
        kept[name] = value
    return moe_from_hf_tensors(kept, config)


def deepseek_moe_to_hf_tensors(
    made: Mapping[str, Callable[[], Any]], config: DeepseekMoeConfig
) -> dict[str, Callable[[], Any]]:
    """``{name: make}`` with each MoE layer's experts under the Hub's names."""
    return moe_to_hf_tensors(made, config)


__all__ = [
    "TOPK_METHODS",
    "DeepseekMoeConfig",
    "deepseek_moe_from_hf_tensors",
    "deepseek_moe_to_hf_tensors",
    "mlp_shapes",
]
