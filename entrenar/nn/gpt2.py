"""GPT-2: learned positions, pre-LayerNorm blocks, GELU MLP, tied output head.

Radford et al., "Language Models are Unsupervised Multitask Learners", 2019. The config
is the model (`GPT2Config.init`, `GPT2Config.apply`). Parameter names follow Hugging
Face's ``GPT2LMHeadModel`` (``transformer.h.{i}.attn.c_attn.weight`` ...) with layers
stacked under ``h``, but every weight is stored ``(out, in)`` like all of entrenar;
Hugging Face's ``Conv1D`` stores ``(in, out)``, so convert its checkpoints with
`conv1d_transpose`. Forward, for tokens ``x: (B, T)``::

    h = wte[x] + wpe[0..T-1]
    for each block:  h = h + Attn(LN₁(h));  h = h + MLP(LN₂(h)),  MLP = GELU-tanh
    logits = LN_f(h) wteᵀ
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from entrenar.errors import ConfigError, ShapeError
from entrenar.nn.attention import (
    KVCache,
    cache_positions,
    cached_attention,
    causal_mask,
    dot_product_attention,
    init_kv_cache,
    read_cache,
    use_fused,
    write_cache,
)
from entrenar.nn.decoder_config import as_float
from entrenar.nn.init import normal
from entrenar.nn.layers import (
    dropout,
    embedding,
    gelu_tanh,
    layer_norm,
    mlp,
    upcast_dtype,
)
from entrenar.nn.linear import linear
from entrenar.nn.llama import check_dtype
from entrenar.nn.registry import Architecture, register_architecture
from entrenar.types import Params, PRNGKey

CONV1D_SUFFIXES = (
    "attn.c_attn.weight",
    "attn.c_proj.weight",
    "mlp.c_fc.weight",
    "mlp.c_proj.weight",
)


@dataclasses.dataclass(frozen=True)
class GPT2Config:
    """GPT-2 architecture and options; also the model itself.

    Attributes:
        vocab_size: ``V``.
        n_positions: ``P``, number of learned positions (longest context).
        n_embd: ``D``.
        n_layer: ``L``.
        n_head: ``H``; head dimension ``D // H``.
        layer_norm_epsilon: ``ε`` of every LayerNorm.
        dropout: rate of the embedding and residual dropout, active only when
            ``apply`` gets a ``key`` (attention-probability dropout is not applied).
        initializer_range: std of the normal initialiser.
        dtype: compute dtype; logits are float32 (float64
            when computing in float64).
        param_dtype: dtype of the parameters ``init`` creates.
        remat: rematerialise each block in the backward pass (`jax.checkpoint`).
    """

    vocab_size: int = 50257
    n_positions: int = 1024
    n_embd: int = 768
    n_layer: int = 12
    n_head: int = 12
    layer_norm_epsilon: float = 1e-5
    dropout: float = 0.0
    initializer_range: float = 0.02
    dtype: str = "float32"
    param_dtype: str = "float32"
    remat: bool = False

    def __post_init__(self) -> None:
        for name in ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"GPT2Config.{name} must be positive")
        if self.n_embd % self.n_head:
            raise ConfigError(
                f"GPT2Config.n_embd ({self.n_embd}) must be divisible by n_head "
                f"({self.n_head})"
            )
        eps = self.layer_norm_epsilon  # NaN logits otherwise
        if not 0 < as_float(eps) < math.inf:
            raise ConfigError(
                "GPT2Config.layer_norm_epsilon must be a finite number > 0, got "
                f"{eps!r}"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"GPT2Config.dropout must lie in [0, 1): {self.dropout}")
        check_dtype(self.dtype, "GPT2Config.dtype")
        check_dtype(self.param_dtype, "GPT2Config.param_dtype")

    @property
    def num_layers(self) -> int:
        """``L`` (the name `entrenar.nn.from_hf_names` reads)."""
        return self.n_layer

    def to_hf_config(self) -> dict[str, Any]:
        """The Hugging Face ``config.json`` dict of this architecture."""
        return {
            "architectures": ["GPT2LMHeadModel"],
            "model_type": "gpt2",
            "vocab_size": self.vocab_size,
            "n_positions": self.n_positions,
            "n_embd": self.n_embd,
            "n_layer": self.n_layer,
            "n_head": self.n_head,
            "layer_norm_epsilon": self.layer_norm_epsilon,
            "activation_function": "gelu_new",
            "resid_pdrop": self.dropout,
            "embd_pdrop": self.dropout,
            "attn_pdrop": 0.0,
            "initializer_range": self.initializer_range,
        }

    def param_shapes(self) -> dict[str, Any]:
        """Nested dict of parameter shapes (weights ``(out, in)``, layers stacked)."""
        v, p, d, n = self.vocab_size, self.n_positions, self.n_embd, self.n_layer

        def ln(*lead: int) -> dict[str, tuple[int, ...]]:
            return {"weight": (*lead, d), "bias": (*lead, d)}

        def lin(o: int, i: int) -> dict[str, tuple[int, ...]]:
            return {"weight": (n, o, i), "bias": (n, o)}

        block = {
            "ln_1": ln(n),
            "attn": {"c_attn": lin(3 * d, d), "c_proj": lin(d, d)},
            "ln_2": ln(n),
            "mlp": {"c_fc": lin(4 * d, d), "c_proj": lin(d, 4 * d)},
        }
        return {
            "transformer": {
                "wte": {"weight": (v, d)},
                "wpe": {"weight": (p, d)},
                "h": block,
                "ln_f": ln(),
            }
        }

    def init(self, key: PRNGKey) -> Params:
        """GPT-2's initialisation.

        Weights ``N(0, initializer_range²)``, residual projections (``c_proj``) with
        the std scaled by ``1/sqrt(2L)``, zero biases, unit LayerNorm gains.
        """
        flat, treedef = jax.tree_util.tree_flatten_with_path(
            self.param_shapes(), is_leaf=lambda s: isinstance(s, tuple)
        )
        leaves = []
        for idx, (path, shape) in enumerate(flat):
            name = jax.tree_util.keystr(path)
            if "ln_" in name:
                fill = jnp.ones if name.endswith("['weight']") else jnp.zeros
                leaves.append(fill(shape, self.param_dtype))
            elif name.endswith("['bias']"):
                leaves.append(jnp.zeros(shape, self.param_dtype))
            else:
                std = self.initializer_range
                if "c_proj" in name:
                    std = std / (2 * self.n_layer) ** 0.5
                k = jax.random.fold_in(key, idx)
                leaves.append(normal(shape, key=k, std=std, dtype=self.param_dtype))
        return jax.tree_util.tree_unflatten(treedef, leaves)

    def apply(
        self,
        params: Params,
        tokens: jax.Array,
        *,
        mask: jax.Array | None = None,
        key: PRNGKey | None = None,
    ) -> jax.Array:
        """Causal-attention logits ``(B, T, V)`` (float32 or 64) for ``tokens: (B, T)``.

        Args:
            params: the param tree of `param_shapes`.
            tokens: int token ids ``(B, T)``, ``T <= n_positions``.
            mask: optional ``(B, T)`` bool, False at padding positions.
            key: dropout key; None (evaluation) disables dropout.
        """
        t = _check_tokens(tokens, self.n_positions)
        positions = jnp.arange(t, dtype=jnp.int32)
        allowed = causal_mask(positions, t)  # (T, T)
        if mask is not None:
            allowed = allowed[None] & mask.astype(bool)[:, None, :]  # (B, T, T)
        h, _ = self._blocks(params, tokens, positions, allowed, None, key)
        return self._head(params, h)

    def init_cache(self, batch: int, max_len: int) -> KVCache:
        """An empty `KVCache` for ``batch`` sequences of up to ``max_len`` tokens."""
        if max_len > self.n_positions:
            raise ShapeError(
                f"max_len {max_len} exceeds GPT-2's n_positions {self.n_positions}"
            )
        hd = self.n_embd // self.n_head
        return init_kv_cache(self.n_layer, batch, max_len, self.n_head, hd, self.dtype)

    def apply_cached(
        self,
        params: Params,
        tokens: jax.Array,
        cache: KVCache,
        *,
        logits_at: jax.Array | None = None,
    ) -> tuple[jax.Array, KVCache]:
        """One cached step: logits ``(B, T, V)`` of ``tokens`` at ``cache.pos + t``.

        ``cache.pos`` is a scalar or ``(B,)`` (one position per row); only the new
        entries are written into the cache (`entrenar.nn.attention.write_cache`).
        ``logits_at (B,)`` int: only the logits of position ``logits_at[b]`` of each
        row, ``(B, 1, V)`` (a prompt needs its last token's: the output head then
        multiplies ``B`` rows instead of ``B T``).
        """
        t = _check_tokens(tokens, self.n_positions)
        positions = cache_positions(cache.pos, t)  # (T,) or (B, T)
        allowed = causal_mask(positions, cache.k.shape[2])  # (T, S) or (B, T, S)
        h, (k, v) = self._blocks(params, tokens, positions, allowed, cache, None)
        if logits_at is not None:
            h = jnp.take_along_axis(h, logits_at[:, None, None], axis=1)  # (B, 1, D)
        return self._head(params, h), KVCache(k, v, cache.pos + t)

    def _blocks(
        self,
        params: Params,
        tokens: jax.Array,
        positions: jax.Array,
        allowed: jax.Array,
        cache: KVCache | None,
        key: PRNGKey | None,
    ) -> tuple[jax.Array, Any]:
        tp = params["transformer"]
        b, t = tokens.shape
        nh, hd = self.n_head, self.n_embd // self.n_head
        eps, rate = self.layer_norm_epsilon, self.dropout
        h = embedding(tp["wte"]["weight"], tokens) + embedding(
            tp["wpe"]["weight"], positions
        )  # (B, T, D)
        h = h.astype(self.dtype)
        if key is not None:
            key, k0 = jax.random.split(key)
            h = dropout(h, rate, key=k0)
        keys = None if key is None else jax.random.split(key, self.n_layer)
        pos = None if cache is None else cache.pos

        def block(carry: Any, xs: Any) -> tuple[Any, Any]:
            lp, index, k = xs
            h, ck, cv = (carry, None, None) if cache is None else carry
            ap, mp = lp["attn"], lp["mlp"]
            x = layer_norm(h, lp["ln_1"]["weight"], lp["ln_1"]["bias"], eps)
            qkv = linear(x, ap["c_attn"]["weight"], ap["c_attn"]["bias"])  # (B,T,3D)
            q, kk, v = jnp.split(qkv.reshape(b, t, 3, nh, hd), 3, axis=2)
            q, kk, v = q[:, :, 0], kk[:, :, 0], v[:, :, 0]  # (B, T, H, d)
            o = None
            if ck is not None and cv is not None and pos is not None:
                ck = write_cache(ck, kk, index, pos)  # (L, B, S, H, d)
                cv = write_cache(cv, v, index, pos)
                if use_fused("auto", q.dtype, None):  # off the CPU: cuDNN's kernel
                    kk, v = read_cache(ck, index), read_cache(cv, index)
                else:  # the layer's keys and values read in place, not copied out
                    o = cached_attention(q, ck, cv, index, allowed)  # (B, T, H, d)
            if o is None:
                o = dot_product_attention(q, kk, v, allowed)  # (B, T, H, d)
            o = o.reshape(b, t, nh * hd)
            o = linear(o, ap["c_proj"]["weight"], ap["c_proj"]["bias"])
            k1 = k2 = None
            if k is not None:
                k1, k2 = jax.random.split(k)
            h = h + dropout(o, rate, key=k1, deterministic=k is None)
            x = layer_norm(h, lp["ln_2"]["weight"], lp["ln_2"]["bias"], eps)
            x = mlp(
                x,
                mp["c_fc"]["weight"],
                mp["c_fc"]["bias"],
                mp["c_proj"]["weight"],
                mp["c_proj"]["bias"],
                gelu_tanh,
            )
            h = h + dropout(x, rate, key=k2, deterministic=k is None)
            return (h if cache is None else (h, ck, cv)), None

        if cache is None:
            if self.remat:
                block = jax.checkpoint(block)
            h, _ = jax.lax.scan(block, h, (tp["h"], None, keys))
            return h, None
        # the whole (L, B, S, H, d) buffers ride in the carry, written in place
        index = jnp.arange(self.n_layer, dtype=jnp.int32)  # (L,)
        (h, k, v), _ = jax.lax.scan(
            block, (h, cache.k, cache.v), (tp["h"], index, keys)
        )
        return h, (k, v)

    def _head(self, params: Params, h: jax.Array) -> jax.Array:
        tp = params["transformer"]
        h = layer_norm(
            h, tp["ln_f"]["weight"], tp["ln_f"]["bias"], self.layer_norm_epsilon
        )
        return linear(h, tp["wte"]["weight"]).astype(upcast_dtype(h.dtype))


def _check_tokens(tokens: jax.Array, n_positions: int) -> int:
    if tokens.ndim != 2:
        raise ShapeError(f"tokens must have shape (batch, time), got {tokens.shape}")
    if tokens.shape[1] > n_positions:
        raise ShapeError(
            f"sequence length {tokens.shape[1]} exceeds n_positions {n_positions}"
        )
    return int(tokens.shape[1])


def conv1d_transpose(flat: Mapping[str, Any]) -> dict[str, Any]:
    """Transpose the ``Conv1D`` weights of a flat GPT-2 dict (its own inverse).

    Hugging Face's GPT-2 stores ``c_attn``, ``c_proj`` and ``c_fc`` weights as
    ``(in, out)``; entrenar stores ``(out, in)``. Apply this to a Hugging Face state
    dict before `entrenar.nn.from_hf_names`, and to the output of
    `entrenar.nn.to_hf_names` before saving for Hugging Face.
    """
    return {
        k: (jnp.swapaxes(jnp.asarray(v), -1, -2) if k.endswith(CONV1D_SUFFIXES) else v)
        for k, v in flat.items()
    }


GPT2 = GPT2Config
"""The model is its config: ``GPT2(...)`` is a `GPT2Config`."""

__all__ = ["CONV1D_SUFFIXES", "GPT2", "GPT2Config", "conv1d_transpose"]


register_architecture(
    Architecture(
        name="gpt2",
        config_class=GPT2Config,
        summary="GPT-2: learned positions, pre-LayerNorm blocks, GELU MLP, tied head",
        hf_class="GPT2LMHeadModel",
    )
)
