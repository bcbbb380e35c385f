"""Scaled dot-product attention with grouped-query heads, masks and a KV cache.

Vaswani et al., "Attention Is All You Need", 2017; grouped-query attention (GQA):
Ainslie et al., 2023. With ``H`` query heads and ``KV`` key/value heads (``H % KV ==
0``), query head ``h`` attends with key/value head ``h // (H / KV)``:

    ``o_h = softmax(q_h k_gᵀ / sqrt(d) + M) v_g``,  ``M = 0`` where allowed, ``-∞`` not.

Attention sinks (gpt-oss; Xiao et al., "Efficient Streaming Language Models with
Attention Sinks", 2023, in the learned form of OpenAI's gpt-oss): a learned logit
``z_h`` per query head joins each row's softmax denominator and is then dropped,
so a head can attend to "nothing"::

    p_hts = exp(s_hts) / (exp(z_h) + Σ_s' exp(s_hts'))     (Σ_s p_hts <= 1)

The JAX path appends ``z_h`` as a score column; the native kernel and the fused
path attend to one more key whose score is ``z_h`` and whose value is 0
(`sink_key`, `entrenar.nn.fused_attention`).

Scores and the softmax are computed in float32 (float64 for float64 inputs). A
`KVCache` keeps the keys and values of every layer for ``max_len`` positions; a step
writes its ``T`` new entries at ``pos`` (one position for all rows, or one per row)
and attends causally to positions ``<= pos + t``. A model's layer loop carries the
whole ``(L, B, S, KV, d)`` buffers and writes only the new entries into them
(`write_cache`), so that a compiled step that donates the cache updates it in place,
and attends to its layer of them (`cached_attention`: the native kernel reads the
layer where it lies; `read_cache` would copy it out every step).
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from entrenar import native
from entrenar.errors import ShapeError
from entrenar.nn.fused_attention import fused_attention, use_fused
from entrenar.nn.layers import upcast_dtype
from entrenar.types import DType

ATTENTION_NAME = "entrenar_attention"
"""`jax.ad_checkpoint.checkpoint_name` of the native kernel's output and log-sum-exp:
a remat policy that saves these names keeps the forward kernel from running again
in the backward pass (`entrenar.nn.llama` saves them with the ``dots`` policies)."""

_NEG = -1e30  # finite "minus infinity": a fully masked row gives a uniform, not NaN


class KVCache(NamedTuple):
    """Keys and values of all layers; entries at index ``>= pos`` are not yet filled.

    Attributes:
        k: ``(L, B, S, KV, d)`` keys (rotary already applied where the model uses it).
        v: ``(L, B, S, KV, d)`` values.
        pos: int32, the number of positions already written: a scalar (every row
            alike) or ``(B,)``, one per row (prompts of different lengths).
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
    """``(..., T, S)`` boolean mask, True where key index ``s <= q_positions[..., t]``.

    ``q_positions`` is ``(T,)`` (a ``(T, S)`` mask) or ``(B, T)`` (``(B, T, S)``).

    >>> causal_mask(jnp.arange(2), 3).tolist()
    [[True, False, False], [True, True, False]]
    """
    if q_positions.ndim == 1:
        return (
            jnp.arange(k_len, dtype=q_positions.dtype)[None, :] <= q_positions[:, None]
        )
    keys = jnp.arange(k_len, dtype=q_positions.dtype)  # (S,)
    return keys[None, None, :] <= q_positions[:, :, None]  # (B, T, S)


def cache_positions(pos: jax.Array, t: int) -> jax.Array:
    """Positions of ``t`` new tokens after ``pos``: ``(T,)``, or ``(B, T)`` per row.

    >>> cache_positions(jnp.asarray([2, 0]), 2).tolist()
    [[2, 3], [0, 1]]
    """
    pos, steps = jnp.asarray(pos, jnp.int32), jnp.arange(t, dtype=jnp.int32)
    if pos.ndim == 0:
        return pos + steps  # (T,)
    if pos.ndim == 1:
        return pos[:, None] + steps[None, :]  # (B, T)
    raise ShapeError(f"cache pos must be a scalar or (batch,), got {pos.shape}")


def update_cache_layer(cache: jax.Array, new: jax.Array, pos: jax.Array) -> jax.Array:
    """Write ``new: (B, T, KV, d)`` into a layer's ``cache: (B, S, KV, d)`` at ``pos``.

    Like `jax.lax.dynamic_update_slice`, a write past ``S`` is clamped; callers check
    ``pos + T <= S`` on the host (`entrenar.nn.generate` does). ``pos`` is a scalar;
    `write_cache` also takes one position per row.
    """
    zero = jnp.zeros((), jnp.int32)
    start = (zero, pos.astype(jnp.int32), zero, zero)
    return jax.lax.dynamic_update_slice(cache, new.astype(cache.dtype), start)


def write_cache(
    buf: jax.Array, new: jax.Array, layer: jax.Array, pos: jax.Array
) -> jax.Array:
    """Write ``new: (B, T, KV, d)`` into layer ``layer`` of ``buf: (L, B, S, KV, d)``.

    Row ``b``'s entries go to positions ``pos + t`` (scalar ``pos``: one
    `jax.lax.dynamic_update_slice`, clamped like `update_cache_layer`) or
    ``pos[b] + t`` (``(B,)``: a scatter; entries past ``S`` are dropped). Only the
    ``B T`` new entries are written: under `jax.jit` with ``buf`` donated (or carried
    through a loop), XLA updates the buffer in place instead of copying it.
    """
    new = new.astype(buf.dtype)
    layer = jnp.asarray(layer, jnp.int32)
    if jnp.ndim(pos) == 0:
        zero = jnp.zeros((), jnp.int32)
        start = (layer, zero, jnp.asarray(pos, jnp.int32), zero, zero)
        return jax.lax.dynamic_update_slice(buf, new[None], start)
    b, t = new.shape[:2]
    rows = jnp.arange(b, dtype=jnp.int32)[:, None]  # (B, 1)
    cols = cache_positions(pos, t)  # (B, T)
    return buf.at[layer, rows, cols].set(new, mode="drop", unique_indices=True)


def read_cache(buf: jax.Array, layer: jax.Array) -> jax.Array:
    """Layer ``layer`` of ``buf: (L, B, S, KV, d)``: ``(B, S, KV, d)``."""
    return jax.lax.dynamic_index_in_dim(buf, layer, 0, keepdims=False)


def cached_attention(
    q: jax.Array,
    k_buf: jax.Array,
    v_buf: jax.Array,
    layer: jax.Array,
    mask: jax.Array | None,
    *,
    scale: float | None = None,
    matmul_dtype: str | None = None,
    softcap: float | None = None,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """`dot_product_attention` on layer ``layer`` of stacked caches, read in place.

    Equal to ``dot_product_attention(q, read_cache(k_buf, layer), read_cache(v_buf,
    layer), mask, ..., impl="reference")``, bit for bit. Where the native kernel
    takes the call (see `dot_product_attention`), it gets the whole ``(L, B, S, KV,
    d)`` buffers and the layer index and reads that layer's keys and values where
    they lie: `read_cache` is a ``dynamic-slice`` that XLA materializes, a copy of
    the layer's ``(B, S, KV, d)`` keys and values on every decoding step (for a
    30-layer model with 3 x 64 float32 key/value heads, ``S`` x 46 KB a step). The
    gradient (rarely needed: decoding) is the one of the sliced path.

    Args:
        q: ``(B, T, H, d)`` queries.
        k_buf: ``(L, B, S, KV, d)`` keys of every layer, ``H % KV == 0``.
        v_buf: ``(L, B, S, KV, dv)`` values.
        layer: int32 ``()``, the layer to attend to.
        mask: as `dot_product_attention`: ``(T, S)``, ``(B, T, S)``, 4-d or None.
        scale: score scale, ``1/√d`` by default.
        matmul_dtype: as `dot_product_attention`.
        softcap: as `dot_product_attention` (the sliced JAX path).
        sinks: as `dot_product_attention` (the sliced JAX path).

    Returns:
        ``(B, T, H, dv)`` in ``q``'s dtype.
    """
    layer = jnp.asarray(layer, jnp.int32)
    scale = 1.0 / q.shape[-1] ** 0.5 if scale is None else scale
    if k_buf.ndim != 5 or v_buf.ndim != 5 or q.ndim != 4:
        raise ShapeError(
            f"cached_attention takes q (B, T, H, d) and k, v (L, B, S, KV, d), got "
            f"{q.shape}, {k_buf.shape}, {v_buf.shape}"
        )
    _check_heads(q.shape[2], k_buf.shape[3])
    k1, v1 = (jax.ShapeDtypeStruct(x.shape[1:], x.dtype) for x in (k_buf, v_buf))
    plain = softcap is None and sinks is None
    if plain and _native_ok(q, k1, v1, mask, None, matmul_dtype):
        m, how = _kernel_operands(q, k_buf.shape[2], mask, scale, matmul_dtype)
        return _native_cached(q, k_buf, v_buf, layer, m, how)
    k, v = read_cache(k_buf, layer), read_cache(v_buf, layer)  # (B, S, KV, d)
    return dot_product_attention(
        q, k, v, mask, scale=scale, matmul_dtype=matmul_dtype, softcap=softcap,
        sinks=sinks, impl="reference",
    )  # fmt: skip


def dot_product_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    mask: jax.Array | None,
    *,
    bias: jax.Array | None = None,
    scale: float | None = None,
    matmul_dtype: str | None = None,
    softcap: float | None = None,
    sinks: jax.Array | None = None,
    impl: str = "auto",
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
        softcap: None, or ``c``: scores become ``c tanh(scores / c)`` before the
            bias and mask (Gemma 2's ``attn_logit_softcapping``; the JAX path).
        sinks: None, or ``(H,)`` attention-sink logits (gpt-oss, module
            docstring): each joins its head's softmax denominator (the JAX path,
            or the fused one).
        impl: ``"reference"`` (this module's paths below), ``"fused"``
            (`entrenar.nn.fused_attention`: `jax.nn.dot_product_attention`,
            cuDNN's kernel on GPUs) or ``"auto"``: fused off the CPU, reference on
            it. A call the fused path cannot take (soft-capping, float64, value
            heads of another size than the keys') runs the reference path.

    Returns:
        ``(B, T, H, dv)`` in ``q``'s dtype.

    On the CPU, float32 inputs with no ``bias``, a 2-d or 3-d (or no) mask and
    ``matmul_dtype`` None or ``"bfloat16"`` run the native kernel
    ``entrenar/kernels/attention.cc`` where it can be built (`entrenar.native`):
    forward and backward each one pass per key/value head that keeps its keys and
    values in cache, where XLA runs a dozen small batched products, transposes and
    softmax loops. The forward pass agrees with the JAX path to float32 rounding
    (with the same bfloat16 rounding of the products' inputs); the backward pass
    rounds the products' inputs as the forward does, but keeps the cotangents in
    float32 where the JAX path rounds them too.
    """
    d = q.shape[-1]
    _check_heads(q.shape[2], k.shape[2])
    scale = 1.0 / d**0.5 if scale is None else scale
    if (
        use_fused(impl, q.dtype, softcap)
        and v.shape[-1] == d == k.shape[-1]
        and min(q.shape) > 0
        and min(k.shape) > 0
    ):
        return fused_attention(
            q, k, v, mask, bias=bias, scale=scale, matmul_dtype=matmul_dtype,
            sinks=sinks,
        )  # fmt: skip
    if softcap is None and _native_ok(q, k, v, mask, bias, matmul_dtype):
        if sinks is not None:  # the sinks as one more key the kernel attends to
            q, k, v, mask = sink_key(q, k, v, mask, sinks, scale)
        m, how = _kernel_operands(q, k.shape[1], mask, scale, matmul_dtype)
        return _native_attention(q, k, v, m, how)
    return _attention_jax(q, k, v, mask, bias, scale, matmul_dtype, softcap, sinks)


def sink_key(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    mask: jax.Array | None,
    sinks: jax.Array,
    scale: float,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Attention sinks as a key ``S`` every query attends to, for plain attention.

    Query head ``h = g G + j`` (``G = H / KV``) gets 2 ``G`` more dimensions, 1 at
    ``2j`` and ``2j + 1``, 0 elsewhere; key ``S`` of key/value head ``g`` is 0 but
    for ``(hi, lo)`` of ``z_h / scale`` at ``2j, 2j + 1`` (``hi`` its bfloat16
    rounding, ``lo`` the rest, so that bfloat16 products keep ``z`` to ``2^-16``),
    the real keys 0 there; value ``S`` is 0. Then ``scale · q'_h · k'_S = z_h``,
    ``q'_h · k'_s = q_h · k_s``, and the softmax over ``S + 1`` keys, ``S`` allowed
    for every query, is the sinks' (module docstring). Gradients reach ``z`` through
    ``hi + lo``.

    Returns ``(q (B, T, H, d + 2G), k (B, S + 1, KV, d + 2G), v (B, S + 1, KV, dv),
    mask (B|1, T, S + 1))``.
    """
    b, t, h, _ = q.shape
    s, kv = k.shape[1], k.shape[2]
    g = h // kv
    z = (sinks.astype(jnp.float32) / jnp.float32(scale)).reshape(kv, g)  # (KV, G)
    hi = z.astype(jnp.bfloat16).astype(jnp.float32)
    pair = jnp.stack([hi, z - hi], -1).reshape(kv, 2 * g)  # (KV, 2G): hi, lo
    # (KV, G, 2G): row j holds (hi, lo) of head g G + j at 2j, 2j + 1
    onehot = jnp.repeat(jnp.eye(g, dtype=jnp.float32), 2, axis=1)  # (G, 2G)
    extra_q = jnp.tile(onehot, (kv, 1)).astype(q.dtype)  # (H, 2G)
    q = jnp.concatenate([q, jnp.broadcast_to(extra_q, (b, t, h, 2 * g))], -1)
    sink_k = jnp.concatenate(
        [jnp.zeros((kv, k.shape[-1]), pair.dtype), pair], -1
    ).astype(k.dtype)  # (KV, d + 2G)
    k = jnp.concatenate([k, jnp.zeros((b, s, kv, 2 * g), k.dtype)], -1)
    k = jnp.concatenate([k, jnp.broadcast_to(sink_k, (b, 1, kv, k.shape[-1]))], 1)
    v = jnp.concatenate([v, jnp.zeros((b, 1, kv, v.shape[-1]), v.dtype)], 1)
    m = jnp.ones((1, t, s), bool) if mask is None else mask.astype(bool)
    m = m if m.ndim == 3 else m[None]  # (B|1, T, S)
    m = jnp.concatenate([m, jnp.ones((*m.shape[:2], 1), bool)], -1)
    return q, k, v, m


def _check_heads(h: int, kv: int) -> None:
    """Grouped-query attention needs ``h`` query heads a multiple of ``kv``."""
    if h % kv:
        raise ShapeError(
            f"query heads ({h}) must be a multiple of key/value heads ({kv})"
        )


def _kernel_operands(
    q: jax.Array,
    s: int,
    mask: jax.Array | None,
    scale: float,
    matmul_dtype: str | None,
) -> tuple[jax.Array, tuple[float, bool]]:
    """The kernel's uint8 mask ``(B|1, T, S)`` and ``how = (scale, bfloat16)``."""
    t = q.shape[1]
    if mask is None:
        m = jnp.ones((1, t, s), jnp.uint8)
    else:
        m = (mask if mask.ndim == 3 else mask[None]).astype(jnp.uint8)
    lowp = np.dtype(matmul_dtype or np.float32) != np.float32  # bfloat16
    return m, (float(scale), lowp)


def _attention_jax(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    mask: jax.Array | None,
    bias: jax.Array | None,
    scale: float,
    matmul_dtype: str | None,
    softcap: float | None = None,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """`dot_product_attention` in JAX: batched products and a float32 softmax."""
    b, t, h, d = q.shape
    s, kv = k.shape[1], k.shape[2]
    g = h // kv
    qg = q.reshape(b, t, kv, g, d)  # (B, T, KV, G, d)
    f = upcast_dtype(q.dtype)
    lowp = None if matmul_dtype is None else jnp.dtype(matmul_dtype)
    if lowp is not None:
        qg, k = qg.astype(lowp), k.astype(lowp)
    scores = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=f)
    scores = scores * jnp.asarray(scale, f)  # (B, KV, G, T, S)
    if softcap is not None:
        c = jnp.asarray(softcap, f)
        scores = jnp.tanh(scores / c) * c
    if bias is not None:
        full = jnp.broadcast_to(bias, (b, h, t, s)).reshape(b, kv, g, t, s)
        scores = scores + full.astype(f)
    if mask is not None:
        if mask.ndim == 4:
            m = jnp.broadcast_to(mask, (b, h, t, s)).reshape(b, kv, g, t, s)
        else:
            m = (mask if mask.ndim == 3 else mask[None])[:, None, None]  # (B|1,1,1,T,S)
        scores = jnp.where(m, scores, jnp.asarray(_NEG, f))
    if sinks is None:
        probs = jax.nn.softmax(scores, axis=-1)  # (B, KV, G, T, S)
    else:  # the sink's logit joins the denominator, then is dropped
        z = jnp.broadcast_to(
            sinks.astype(f).reshape(1, kv, g, 1, 1), (b, kv, g, t, 1)
        )  # (B, KV, G, T, 1)
        probs = jax.nn.softmax(jnp.concatenate([scores, z], -1), axis=-1)[..., :s]
    if lowp is not None:
        probs, v = probs.astype(lowp), v.astype(lowp)
        out = jnp.einsum("bkgts,bskd->btkgd", probs, v, preferred_element_type=f)
    else:
        out = jnp.einsum("bkgts,bskd->btkgd", probs.astype(v.dtype), v)
    # out: (B, T, KV, G, dv)
    return out.reshape(b, t, h, v.shape[-1]).astype(q.dtype)


def _native_ok(
    q: jax.Array,
    k: jax.Array | jax.ShapeDtypeStruct,
    v: jax.Array | jax.ShapeDtypeStruct,
    mask: jax.Array | None,
    bias: Any,
    matmul_dtype: str | None = None,
) -> bool:
    """Whether the native kernel takes this call (else the JAX path does).

    The kernel's own rules (no bias, a 2-d or 3-d mask, equal head sizes of ``q``
    and ``k``, no empty axis), then `entrenar.native.use`; ``k`` and ``v`` may be
    their shapes only (`cached_attention`: one layer of the caches).
    """
    return (
        bias is None
        and (mask is None or mask.ndim in (2, 3))
        and k.shape[-1] == q.shape[-1]
        and min(q.shape) > 0
        and min(k.shape) > 0
        and native.use("attention", q, k, v, matmul_dtype or "float32")
    )


def _native_call(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    mask: jax.Array,
    how: tuple[float, bool],
    layer: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """The kernel's forward: ``(o (B, T, H, dv), lse (B, H, T))``.

    With ``layer``, ``k`` and ``v`` are stacked ``(L, B, S, KV, ·)`` caches and the
    kernel reads layer ``layer`` of them in place (``entrenar_attention_cached``).
    """
    b, t, h, _ = q.shape
    out = (
        jax.ShapeDtypeStruct((b, t, h, v.shape[-1]), jnp.float32),
        jax.ShapeDtypeStruct((b, h, t), jnp.float32),
    )
    name = "entrenar_attention_fwd" if layer is None else "entrenar_attention_cached"
    call = jax.ffi.ffi_call(name, out, vmap_method="sequential")
    where = () if layer is None else (layer,)
    o, lse = call(q, k, v, mask, jnp.asarray(how, jnp.float32), *where)
    return o, lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _native_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, how: tuple[float, bool]
) -> jax.Array:
    """Attention by the kernel; ``how = (scale, products' inputs in bfloat16)``."""
    return _native_call(q, k, v, mask, how)[0]  # (B, T, H, dv)


def _native_attention_fwd(
    q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, how: tuple[float, bool]
) -> tuple[jax.Array, Any]:
    o, lse = _native_call(q, k, v, mask, how)
    q, k, v, o, lse = (checkpoint_name(x, ATTENTION_NAME) for x in (q, k, v, o, lse))
    return o, (q, k, v, mask, o, lse)


def _native_attention_bwd(how: tuple[float, bool], res: Any, g: jax.Array) -> Any:
    q, k, v, mask, o, lse = res
    shapes = tuple(jax.ShapeDtypeStruct(x.shape, jnp.float32) for x in (q, k, v))
    call = jax.ffi.ffi_call("entrenar_attention_bwd", shapes, vmap_method="sequential")
    dq, dk, dv = call(q, k, v, mask, jnp.asarray(how, jnp.float32), o, lse, g)
    return dq, dk, dv, None


_native_attention.defvjp(_native_attention_fwd, _native_attention_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _native_cached(
    q: jax.Array,
    k_buf: jax.Array,
    v_buf: jax.Array,
    layer: jax.Array,
    mask: jax.Array,
    how: tuple[float, bool],
) -> jax.Array:
    """`_native_attention` on layer ``layer`` of ``(L, B, S, KV, d)`` buffers."""
    return _native_call(q, k_buf, v_buf, mask, how, layer)[0]  # (B, T, H, dv)


def _native_cached_fwd(
    q: jax.Array,
    k_buf: jax.Array,
    v_buf: jax.Array,
    layer: jax.Array,
    mask: jax.Array,
    how: tuple[float, bool],
) -> tuple[jax.Array, Any]:
    o = _native_cached(q, k_buf, v_buf, layer, mask, how)
    return o, (q, k_buf, v_buf, layer, mask)


def _native_cached_bwd(how: tuple[float, bool], res: Any, g: jax.Array) -> Any:
    """The gradient of the sliced path: `read_cache` then `_native_attention`."""
    q, k_buf, v_buf, layer, mask = res

    def sliced(q: jax.Array, kb: jax.Array, vb: jax.Array) -> jax.Array:
        k, v = read_cache(kb, layer), read_cache(vb, layer)  # (B, S, KV, d)
        return _native_attention(q, k, v, mask, how)

    dq, dk, dv = jax.vjp(sliced, q, k_buf, v_buf)[1](g)
    return dq, dk, dv, None, None


_native_cached.defvjp(_native_cached_fwd, _native_cached_bwd)


__all__ = [
    "KVCache",
    "cache_positions",
    "cached_attention",
    "causal_mask",
    "dot_product_attention",
    "init_kv_cache",
    "read_cache",
    "sink_key",
    "update_cache_layer",
    "write_cache",
]
