"""Scaled dot-product attention with grouped-query heads, masks and a KV cache.

Vaswani et al., "Attention Is All You Need", 2017; grouped-query attention (GQA):
Ainslie et al., 2023. With ``H`` query heads and ``KV`` key/value heads (``H % KV ==
0``), query head ``h`` attends with key/value head ``h // (H / KV)``:

    ``o_h = softmax(q_h k_gᵀ / sqrt(d) + M) v_g``,  ``M = 0`` where allowed, ``-∞`` not.

Scores and the softmax are computed in float32 (float64 for float64 inputs). A
`KVCache` keeps the keys and values of every layer for ``max_len`` positions; a step
writes its ``T`` new entries at ``pos`` and attends causally to positions
``<= pos + t``.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from entrenar.errors import ShapeError
from entrenar.nn.layers import upcast_dtype
from entrenar.types import DType

_NEG = -1e30  # finite "minus infinity": a fully masked row gives a uniform, not NaN


class KVCache(NamedTuple):
    """Keys and values of all layers; entries at index ``>= pos`` are not yet filled.

    Attributes:
        k: ``(L, B, S, KV, d)`` keys (rotary already applied where the model uses it).
        v: ``(L, B, S, KV, d)`` values.
        pos: int32 scalar, the number of positions already written.
    """

    k: jax.Array
    v: jax.Array
    pos: jax.Array


def init_kv_cache(
    num_layers: int,
    batch: int,
    max_len: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: DType = jnp.float32,
) -> KVCache:
    """An empty cache for ``max_len`` positions.

    >>> init_kv_cache(2, 1, 8, 3, 4).k.shape
    (2, 1, 8, 3, 4)
    """
    shape = (num_layers, batch, max_len, num_kv_heads, head_dim)
    return KVCache(
        jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), jnp.zeros((), jnp.int32)
    )


def causal_mask(q_positions: jax.Array, k_len: int) -> jax.Array:
    """``(T, S)`` boolean mask, True where key index ``s <= q_positions[t]``.

    >>> causal_mask(jnp.arange(2), 3).tolist()
    [[True, False, False], [True, True, False]]
    """
    return jnp.arange(k_len, dtype=q_positions.dtype)[None, :] <= q_positions[:, None]


def update_cache_layer(cache: jax.Array, new: jax.Array, pos: jax.Array) -> jax.Array:
    """Write ``new: (B, T, KV, d)`` into a layer's ``cache: (B, S, KV, d)`` at ``pos``.

    Like `jax.lax.dynamic_update_slice`, a write past ``S`` is clamped; callers check
    ``pos + T <= S`` on the host (`entrenar.nn.generate` does).
    """
    zero = jnp.zeros((), jnp.int32)
    start = (zero, pos.astype(jnp.int32), zero, zero)
    return jax.lax.dynamic_update_slice(cache, new.astype(cache.dtype), start)


def dot_product_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    mask: jax.Array | None,
    *,
    bias: jax.Array | None = None,
    scale: float | None = None,
    matmul_dtype: str | None = None,
) -> jax.Array:
    """Grouped-query attention ``softmax(q kᵀ · scale + bias, masked) v``.

    Vaswani et al. (2017) with GQA (Ainslie et al., 2023): each of the ``KV``
    key/value heads serves ``H / KV`` query heads. Scores and softmax run in float32
    (float64 for float64 inputs); a fully masked row attends uniformly, not NaN.

    Args:
        q: ``(B, T, H, d)`` queries.
        k: ``(B, S, KV, d)`` keys, ``H % KV == 0``.
        v: ``(B, S, KV, dv)`` values.
        mask: boolean, True where attention is allowed: ``(T, S)``, ``(B, T, S)`` or
            broadcastable to ``(B, H, T, S)`` when 4-d; None attends everywhere.
        bias: optional additive float scores, broadcastable to ``(B, H, T, S)``.
        scale: score scale, ``1/√d`` by default.
        matmul_dtype: None, or ``"bfloat16"`` / ``"float16"``: the two products
            take ``q, k`` and ``softmax, v`` in that dtype with float32
            accumulation (mixed precision, as `entrenar.nn.linear`); the scores,
            mask and softmax stay in float32.

    Returns:
        ``(B, T, H, dv)`` in ``q``'s dtype.
    """
    b, t, h, d = q.shape
    s, kv = k.shape[1], k.shape[2]
    if h % kv:
        raise ShapeError(
            f"query heads ({h}) must be a multiple of key/value heads ({kv})"
        )
    g = h // kv
    qg = q.reshape(b, t, kv, g, d)  # (B, T, KV, G, d)
    f = upcast_dtype(q.dtype)
    lowp = None if matmul_dtype is None else jnp.dtype(matmul_dtype)
    if lowp is not None:
        qg, k = qg.astype(lowp), k.astype(lowp)
    scores = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=f)
    scale = 1.0 / d**0.5 if scale is None else scale
    scores = scores * jnp.asarray(scale, f)  # (B, KV, G, T, S)
    if bias is not None:
        full = jnp.broadcast_to(bias, (b, h, t, s)).reshape(b, kv, g, t, s)
        scores = scores + full.astype(f)
    if mask is not None:
        if mask.ndim == 4:
            m = jnp.broadcast_to(mask, (b, h, t, s)).reshape(b, kv, g, t, s)
        else:
            m = (mask if mask.ndim == 3 else mask[None])[:, None, None]  # (B|1,1,1,T,S)
        scores = jnp.where(m, scores, jnp.asarray(_NEG, f))
    probs = jax.nn.softmax(scores, axis=-1)  # (B, KV, G, T, S)
    if lowp is not None:
        probs, v = probs.astype(lowp), v.astype(lowp)
        out = jnp.einsum("bkgts,bskd->btkgd", probs, v, preferred_element_type=f)
    else:
        out = jnp.einsum("bkgts,bskd->btkgd", probs.astype(v.dtype), v)
    # out: (B, T, KV, G, dv)
    return out.reshape(b, t, h, v.shape[-1]).astype(q.dtype)


__all__ = [
    "KVCache",
    "causal_mask",
    "dot_product_attention",
    "init_kv_cache",
    "update_cache_layer",
]
