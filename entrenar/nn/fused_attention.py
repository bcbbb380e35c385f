"""Fused attention through `jax.nn.dot_product_attention` (cuDNN's kernel on GPUs).

The same function as `entrenar.nn.attention.dot_product_attention`,

    ``o_h = softmax(q_h k_gᵀ · scale + bias + M) v_g``,  ``g = h // (H / KV)``,

computed by JAX's own attention: on an NVIDIA GPU cuDNN's flash-attention kernel
(Dao et al., 2022), which never writes the ``(T, S)`` scores of a head to memory and
skips the masked upper triangle of a causal mask; elsewhere, or where cuDNN does not
take the call (float32 inputs, a head size over 256 or not a multiple of 8, a
mask whose shape it cannot read), JAX's XLA form, which is the reference's math
(scores in float32, a masked score becomes a large negative number, so a row with
nothing allowed attends uniformly, as the reference's does).

The mask comes in two parts, so that the kernel can use the structure: ``causal``
(``s <= t``, the query and key axes aligned at 0) and ``window`` (``t - s < W``) are
flags the kernel applies itself, ``mask`` is anything else (padding, packed
segments, a cache's positions), a boolean ANDed with them.

With bfloat16 inputs JAX's backward pass of this function mixes bfloat16 and
float32 arrays: its gradient needs JAX's default ``jax_numpy_dtype_promotion``
(``standard``), not ``strict``.

Attention sinks (gpt-oss: a learned logit ``z_h`` per head in each row's softmax
denominator, `entrenar.nn.attention`) are one more key: ``k = 0``, ``v = 0``, and
the bias ``z_h`` on its score, so the kernel's softmax counts ``exp(z_h)`` and the
output gains nothing from it; the causal mask and window then travel in the mask
(the kernel's flags need as many keys as queries).

Not here: logit soft-capping (Gemma 2's ``c tanh(scores / c)``) has no form in
`jax.nn.dot_product_attention` or cuDNN; models that use it take the reference path
(`use_fused` says False for them).
"""

from __future__ import annotations

from typing import Any, Literal

import jax
import jax.numpy as jnp

from entrenar.errors import ConfigError, ShapeError

ATTENTION_IMPLS = ("auto", "reference", "fused")
"""Values of `entrenar.nn.LlamaConfig.attention_impl`: ``auto`` is ``fused`` off the
CPU (`jax.default_backend`) and ``reference`` on it (where the native kernel runs)."""

FUSED_DTYPES = ("float32", "bfloat16", "float16")
"""Input dtypes the fused path takes (float64 stays on the reference path: JAX's
XLA form computes its softmax in float32)."""


def check_attention_impl(name: str, field: str = "attention_impl") -> None:
    """Raise `ConfigError` unless ``name`` is one of `ATTENTION_IMPLS`."""
    if name not in ATTENTION_IMPLS:
        raise ConfigError(f"{field} must be one of {ATTENTION_IMPLS}, got {name!r}")


def resolve_impl(impl: str) -> str:
    """``"reference"`` or ``"fused"``: ``auto`` is fused unless the backend is the CPU.

    >>> resolve_impl("reference")
    'reference'
    """
    check_attention_impl(impl)
    if impl == "auto":
        return "reference" if jax.default_backend() == "cpu" else "fused"
    return impl


def use_fused(impl: str, dtype: Any, softcap: float | None = None) -> bool:
    """Whether attention with these settings runs `fused_attention`.

    ``impl`` resolves to ``fused`` (`resolve_impl`), there is no soft-capping and
    ``dtype`` is one of `FUSED_DTYPES`.
    """
    return (
        softcap is None
        and resolve_impl(impl) == "fused"
        and jnp.dtype(dtype).name in FUSED_DTYPES
    )


def _mask4(mask: jax.Array | None) -> jax.Array | None:
    """A ``(T, S)``, ``(B, T, S)`` or 4-d boolean mask as ``(B|1, H|1, T, S)``."""
    if mask is None:
        return None
    mask = mask.astype(bool)
    if mask.ndim == 2:
        return mask[None, None]  # (1, 1, T, S)
    if mask.ndim == 3:
        return mask[:, None]  # (B, 1, T, S)
    return mask


def _cudnn_candidate(q: jax.Array, dtype: Any) -> bool:
    """The cuDNN rules that are cheap to see: a GPU, 16-bit inputs, head size."""
    d = q.shape[-1]
    return (
        jax.default_backend() == "gpu"
        and jnp.dtype(dtype).name in ("bfloat16", "float16")
        and d % 8 == 0
        and d <= 256
    )


def fused_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    mask: jax.Array | None = None,
    *,
    causal: bool = False,
    window: int | None = None,
    bias: jax.Array | None = None,
    scale: float | None = None,
    matmul_dtype: str | None = None,
    implementation: Literal["xla", "cudnn"] | None = None,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """Grouped-query attention by `jax.nn.dot_product_attention`.

    Args:
        q: ``(B, T, H, d)`` queries.
        k: ``(B, S, KV, d)`` keys, ``H % KV == 0``.
        v: ``(B, S, KV, d)`` values (the same head size as the keys).
        mask: boolean, True where attention is allowed: ``(T, S)``, ``(B, T, S)``
            or broadcastable to ``(B, H, T, S)``; ANDed with ``causal`` and
            ``window``. None: no further mask.
        causal: query ``t`` attends to keys ``s <= t`` (needs ``T == S``).
        window: a sliding window ``W``: query ``t`` attends to ``t - s < W`` (with
            ``causal``: ``t - W < s <= t``).
        bias: optional additive float scores, broadcastable to ``(B, H, T, S)``.
        scale: score scale, ``1/√d`` by default.
        matmul_dtype: None (the products in the inputs' dtype, float32 for float32
            inputs), or ``"bfloat16"`` / ``"float16"``: ``q``, ``k``, ``v`` are
            cast to it (the scores and softmax stay float32; the output of the
            second product is in that dtype, where the reference path keeps it
            in float32).
        implementation: ``"xla"``, ``"cudnn"`` or None: cuDNN where it is a
            candidate (a GPU, bfloat16 or float16 products, ``d`` a multiple of 8
            up to 256) and takes the call when traced, else XLA.
        sinks: None, or ``(H,)`` attention-sink logits (module docstring).

    Returns:
        ``(B, T, H, d)`` in ``q``'s dtype.

    Raises:
        ShapeError: heads that do not divide, or ``causal`` with ``T != S``.
        ConfigError: an unknown ``implementation``.
    """
    _, t, h, _ = q.shape
    s, kv = k.shape[1], k.shape[2]
    if h % kv:
        raise ShapeError(
            f"query heads ({h}) must be a multiple of key/value heads ({kv})"
        )
    if causal and t != s:
        raise ShapeError(
            f"causal fused attention needs as many queries as keys, got T={t}, "
            f"S={s}; pass the cache's positions as a mask instead"
        )
    if implementation not in (None, "xla", "cudnn"):
        raise ConfigError(
            f"implementation must be None, 'xla' or 'cudnn', got {implementation!r}"
        )
    dtype = jnp.dtype(matmul_dtype or q.dtype)
    if sinks is not None:
        mask, sink_bias, k, v = _sink_key(q, k, v, mask, bias, sinks, causal, window)
        bias, causal, window = sink_bias.astype(dtype), False, None
    qi, ki, vi = (x.astype(dtype) for x in (q, k, v))  # one dtype: JAX requires it
    m4 = _mask4(mask)
    # (left, right): t - s <= W - 1, and no bound on the right unless causal
    local = None if window is None else (int(window) - 1, 0 if causal else s)

    def call(impl: Literal["xla", "cudnn"]) -> jax.Array:
        return jax.nn.dot_product_attention(
            qi, ki, vi, bias, m4, scale=scale, is_causal=causal,
            local_window_size=local, implementation=impl,
        )  # fmt: skip

    # JAX's function promotes bfloat16 with float32 inside: allowed under strict
    with jax.numpy_dtype_promotion("standard"):
        if implementation is not None:
            out = call(implementation)
        elif _cudnn_candidate(q, dtype):
            try:
                out = call("cudnn")
            except (NotImplementedError, ValueError, RuntimeError):
                # cuDNN refused the call while tracing (its shape, dtype and mask
                # rules); XLA's form computes the same function
                out = call("xla")
        else:
            out = call("xla")
    return out.astype(q.dtype)  # (B, T, H, d)


def _sink_key(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    mask: jax.Array | None,
    bias: jax.Array | None,
    sinks: jax.Array,
    causal: bool,
    window: int | None,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """The sinks as a key ``S``: ``(mask4, bias, k, v)`` with ``S + 1`` keys.

    ``mask4 (B|1, 1, T, S+1)`` holds ``causal``, ``window`` and ``mask`` (True at
    the sink), ``bias (B|1, H, T, S+1)`` the sink logits at key ``S`` (0 elsewhere,
    plus ``bias``), ``k``, ``v`` a zero key and value appended.
    """
    _, t, h, _ = q.shape
    s = k.shape[1]
    qi = jnp.arange(t)[:, None]
    ki = jnp.arange(s)[None, :]
    allowed = jnp.ones((t, s), bool)
    if causal:
        allowed = allowed & (ki <= qi)
    if window is not None:
        allowed = allowed & (qi - ki < window)
    m4 = allowed[None, None]  # (1, 1, T, S)
    extra_mask = _mask4(mask)
    if extra_mask is not None:
        m4 = m4 & extra_mask  # (B|1, H|1, T, S)
    m4 = jnp.concatenate([m4, jnp.ones((*m4.shape[:3], 1), bool)], -1)
    f = jnp.promote_types(q.dtype, jnp.float32)
    z = jnp.broadcast_to(sinks.astype(f).reshape(1, h, 1, 1), (1, h, t, 1))
    extra = jnp.zeros((1, h, t, s), f)
    if bias is not None:  # broadcastable to (B, H, T, S)
        extra = extra + jnp.asarray(bias).astype(f)
    full_bias = jnp.concatenate(
        [extra, jnp.broadcast_to(z, (*extra.shape[:3], 1))], -1
    )  # (B|1, H, T, S+1)
    zero = jnp.zeros((k.shape[0], 1, *k.shape[2:]), k.dtype)
    k = jnp.concatenate([k, zero], 1)  # (B, S+1, KV, d)
    v = jnp.concatenate([v, zero.astype(v.dtype)], 1)
    return m4, full_bias, k, v


__all__ = [
    "ATTENTION_IMPLS",
    "FUSED_DTYPES",
    "check_attention_impl",
    "fused_attention",
    "resolve_impl",
    "use_fused",
]
