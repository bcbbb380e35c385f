"""Rotary position embeddings (RoPE), Hugging Face's half-split layout.

Su et al., "RoFormer: Enhanced Transformer with Rotary Position Embedding", 2021.
For head dimension ``d`` and base ``θ`` (``rope_theta``), pair ``i < d/2`` rotates by
the angle ``p · θ^(-2i/d)`` at position ``p``. In the half-split layout the pair is
``(x[i], x[i + d/2])`` (not the interleaved ``(x[2i], x[2i+1])`` of the paper and
llama.cpp), so

    ``rope(x) = x · cos + rotate_half(x) · sin``,
    ``rotate_half(x) = concat(-x[d/2:], x[:d/2])``,

with ``cos, sin`` of the angles repeated twice along the last axis.

Partial rotary embeddings (Phi-4-mini's ``partial_rotary_factor`` 0.75; GPT-NeoX's
``rotary_pct``) rotate the first ``r < d`` values of each head so, as a head of
``r`` values (``θ^(-2i/r)``, pairs ``(x[i], x[i + r/2])``), and pass ``x[r:]``
through, as transformers' ``apply_rotary_pos_emb`` does when its ``cos`` is
narrower than the head: `rotate` takes ``r`` from the tables' width.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from entrenar.errors import ShapeError
from entrenar.nn.layers import upcast_dtype


def rope_angles(
    positions: jax.Array, head_dim: int, theta: float, dtype: Any = jnp.float32
) -> jax.Array:
    """Angles ``p · θ^(-2i/d)``: ``positions (...)`` -> ``(..., d/2)`` in ``dtype``.

    >>> rope_angles(jnp.array([0, 1]), 4, 100.0).tolist()
    [[0.0, 0.0], [1.0, 0.10000000149011612]]
    """
    if head_dim % 2:
        raise ShapeError(f"rotary head_dim must be even, got {head_dim}")
    exponent = jnp.arange(0, head_dim, 2, dtype=dtype) / head_dim  # (d/2,)
    inv_freq = 1.0 / (jnp.asarray(theta, dtype) ** exponent)  # (d/2,)
    return positions.astype(dtype)[..., None] * inv_freq  # (..., d/2)


def rotate_half(x: jax.Array) -> jax.Array:
    """``concat(-x[..., d/2:], x[..., :d/2])``.

    >>> rotate_half(jnp.array([1.0, 2.0, 3.0, 4.0])).tolist()
    [-3.0, -4.0, 1.0, 2.0]
    """
    half = x.shape[-1] // 2
    return jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)


def rope_tables(
    positions: jax.Array,
    head_dim: int,
    theta: float,
    dtype: Any = jnp.float32,
    *,
    inv_freq: jax.Array | None = None,
    scale: float = 1.0,
) -> tuple[jax.Array, jax.Array]:
    """``(cos, sin)`` of the angles, each ``(B|1, T, 1, d)``, for `rotate`.

    ``inv_freq`` (``(d/2,)``, from `entrenar.nn.rope_scaling.rope_inv_freq`)
    replaces ``θ^(-2i/d)`` for scaled rotary embeddings, whose ``cos`` and ``sin``
    some scalings multiply by ``scale`` (Hugging Face's ``attention_scaling``).

    A model computes them once per forward pass and rotates every layer's queries and
    keys with them: computed inside a layer, XLA:CPU fuses ``cos`` and ``sin`` into
    the elementwise passes that read them and evaluates them once per element of
    ``(B, T, H, d)`` (and again in each rematerialized pass), which cost more than
    the rotation itself in a SmolLM2-shaped LoRA step.
    """
    if inv_freq is None:
        ang = rope_angles(positions, head_dim, theta, dtype)  # (T, d/2) | (B, T, d/2)
    else:
        ang = positions.astype(dtype)[..., None] * inv_freq.astype(dtype)
    ang = jnp.concatenate([ang, ang], axis=-1)  # (..., T, d)
    if ang.ndim == 2:
        ang = ang[None]  # (1, T, d)
    cos, sin = jnp.cos(ang)[:, :, None, :], jnp.sin(ang)[:, :, None, :]
    if scale != 1.0:
        cos, sin = cos * jnp.asarray(scale, dtype), sin * jnp.asarray(scale, dtype)
    return cos, sin


def rotate(x: jax.Array, tables: tuple[jax.Array, jax.Array]) -> jax.Array:
    """Rotate ``x: (B, T, H, d)`` by `rope_tables`' ``(cos, sin)``, in their dtype.

    Tables ``r < d`` wide rotate ``x[..., :r]`` and pass ``x[..., r:]`` through
    (partial rotary embeddings). Returned in ``x``'s dtype.

    >>> x = jnp.arange(1.0, 7.0).reshape(1, 1, 1, 6)
    >>> cos, sin = rope_tables(jnp.array([1]), 4, 1.0)  # r = 4 of d = 6
    >>> y = rotate(x, (cos, sin))
    >>> y[..., 4:].tolist() == x[..., 4:].tolist()
    True
    """
    cos, sin = tables
    r = cos.shape[-1]
    if r > x.shape[-1]:
        raise ShapeError(f"rotary tables {r} wide for heads of {x.shape[-1]} values")
    if r < x.shape[-1]:  # partial: (B, T, H, r) rotated, (B, T, H, d - r) passed
        rotated = _rotate(x[..., :r].astype(cos.dtype), cos, sin).astype(x.dtype)
        return jnp.concatenate([rotated, x[..., r:]], axis=-1)
    return _rotate(x.astype(cos.dtype), cos, sin).astype(x.dtype)  # (B, T, H, d)


def deinterleave(x: jax.Array, r: int) -> jax.Array:
    """The first ``r`` values of ``x: (..., d)`` as halves: evens, then odds.

    ``[x_0, x_2, ..., x_{r-2}, x_1, x_3, ..., x_{r-1}, x_r, ..., x_{d-1}]``: the
    interleaved rotary pairs ``(x_2i, x_2i+1)`` become `rotate`'s ``(x_i, x_{i +
    r/2})``, so ``rotate(deinterleave(x))`` is the interleaved rotation of ``x``
    with its values reordered (transformers' ERNIE 4.5 ``apply_rotary_pos_emb``).
    Applied to queries and keys alike it leaves every score ``q · k`` as is.

    >>> deinterleave(jnp.arange(6.0), 4).tolist()
    [0.0, 2.0, 1.0, 3.0, 4.0, 5.0]
    """
    parts = [x[..., 0:r:2], x[..., 1:r:2]]
    if r < x.shape[-1]:
        parts.append(x[..., r:])
    return jnp.concatenate(parts, axis=-1)


def apply_rope(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
    """Rotate queries or keys ``x: (B, T, H, d)`` at ``positions: (T,)`` or ``(B, T)``.

    Computed in float32 (float64 for float64 ``x``), returned in ``x``'s dtype.
    """
    f = upcast_dtype(x.dtype)
    return rotate(x, rope_tables(positions, x.shape[-1], theta, f))


@jax.custom_vjp
def _rotate(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """``x cos + rotate_half(x) sin``; the angles get no gradient (from positions).

    The VJP is the rotation by the opposite angle, ``g cos - rotate_half(g sin)``
    (``rotate_half``'s transpose is ``-rotate_half``): one fused elementwise pass,
    where autodiff's transpose of the concatenation costs two pad passes and an add.
    """
    return x * cos + rotate_half(x) * sin


def _rotate_fwd(x: jax.Array, cos: jax.Array, sin: jax.Array) -> Any:
    return _rotate(x, cos, sin), (cos, sin)


def _rotate_bwd(res: Any, g: jax.Array) -> Any:
    cos, sin = res
    return g * cos - rotate_half(g * sin), jnp.zeros_like(cos), jnp.zeros_like(sin)


_rotate.defvjp(_rotate_fwd, _rotate_bwd)


__all__ = [
    "apply_rope",
    "deinterleave",
    "rope_angles",
    "rope_tables",
    "rotate",
    "rotate_half",
]
