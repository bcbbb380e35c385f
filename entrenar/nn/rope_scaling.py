"""Rotary scaling: the inverse frequencies of `LlamaConfig.rope_type`.

Every scaling Hugging Face names (``transformers.modeling_rope_utils``) changes the
inverse frequencies ``ω_i = θ^(-2i/d)`` of plain rotary embeddings, and some scale
``cos`` and ``sin`` by an attention factor. All but ``dynamic`` divide each ``ω_i``
by a constant (specs/models.md has the formulas):

- ``linear``: ``ω_i / factor``;
- ``llama3``: wavelengths ``2π/ω_i`` above ``L / low_freq_factor`` divided by
  ``factor``, below ``L / high_freq_factor`` kept, a smooth blend between
  (``L = original_max_position_embeddings``);
- ``yarn``: a blend of ``ω_i`` and ``ω_i / factor`` along a linear ramp between the
  correction dimensions of ``beta_fast`` and ``beta_slow`` (floored and ceiled,
  unless ``rope_truncate`` is False: gpt-oss), attention factor
  ``0.1 ln(factor) + 1``;
- ``longrope``: ``ω_i / short_factor_i`` while the sequence fits in ``L``,
  ``ω_i / long_factor_i`` beyond, attention factor
  ``sqrt(1 + ln(factor) / ln(L))``;
- explicit ``rope_freq_divisors`` (llama.cpp's ``rope_freqs`` tensor).

``dynamic`` (NTK) grows the base with the sequence length ``s = max(position) + 1``
(a traced value under `jax.jit`): ``θ' = θ (factor s / M - (factor - 1))^(d/(d-2))``
for ``s > M = max_position_embeddings``, ``θ`` otherwise.

With partial rotary embeddings every formula's ``d`` is the rotated width ``r =
int(d · partial_rotary_factor)`` (`LlamaConfig.rotary_dim`), as transformers'
``dim`` in each ``_compute_*_parameters``: ``r/2`` frequencies, factors and
divisors.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def base_inv_freq(head_dim: int, theta: Any, dtype: Any) -> jax.Array:
    """``θ^(-2i/d)`` for ``i < d/2`` in ``dtype`` (``θ`` may be traced)."""
    exponent = jnp.arange(0, head_dim, 2, dtype=dtype) / head_dim  # (d/2,)
    return 1.0 / (jnp.asarray(theta, dtype) ** exponent)


def scaling_divisors(c: Any) -> np.ndarray | None:
    """The constant divisors of ``ω_i`` for ``c``'s scaling, ``(r/2,)`` float64.

    None for plain rotary embeddings and for ``dynamic``; for ``longrope`` the
    short factors (`rope_inv_freq` switches to the long ones past the original
    context). llama.cpp stores these as a GGUF's ``rope_freqs`` tensor.

    >>> from entrenar.nn import LlamaConfig
    >>> c = LlamaConfig(hidden_size=8, num_heads=1, num_kv_heads=1,
    ...                 rope_type="linear", rope_factor=2)
    >>> scaling_divisors(c).tolist()
    [2.0, 2.0, 2.0, 2.0]
    """
    d, kind = c.rotary_dim, c.rope_type
    if c.rope_freq_divisors is not None:
        return np.asarray(c.rope_freq_divisors, np.float64)
    if kind in ("default", "dynamic"):
        return None
    if kind == "longrope":
        return np.asarray(c.rope_short_factor, np.float64)
    factor = float(c.rope_factor)
    if kind == "linear":
        return np.full(d // 2, factor)
    inv = 1.0 / c.rope_theta ** (np.arange(0, d, 2, dtype=np.float64) / d)
    old = float(c.rope_original_max_position_embeddings)
    if kind == "llama3":
        low, high = c.rope_low_freq_factor, c.rope_high_freq_factor
        wavelen = 2 * math.pi / inv
        smooth = (old / wavelen - low) / (high - low)
        medium = 1.0 / ((1 - smooth) / factor + smooth)
        return np.where(
            wavelen > old / low, factor, np.where(wavelen < old / high, 1.0, medium)
        )

    # yarn
    def correction_dim(rotations: float) -> float:
        return (
            d * math.log(old / (rotations * 2 * math.pi)) / (2 * math.log(c.rope_theta))
        )

    lo, hi = correction_dim(c.rope_beta_fast), correction_dim(c.rope_beta_slow)
    if c.rope_truncate:  # transformers' truncate (default true)
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, d - 1)
    hi = hi + 0.001 if lo == hi else hi
    ramp = np.clip((np.arange(d // 2, dtype=np.float64) - lo) / (hi - lo), 0, 1)
    keep = 1 - ramp  # the extrapolated share of each frequency
    return 1.0 / ((1 - keep) / factor + keep)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude ``0.1 mscale ln(factor) + 1`` (1 for ``factor <= 1``).

    The paper's Eq. 21, as transformers' ``yarn_get_mscale`` and llama.cpp compute it.

    >>> round(yarn_mscale(4.0), 6)
    1.138629
    """
    return 0.1 * mscale * math.log(factor) + 1.0 if factor > 1 else 1.0


def attention_factor(c: Any) -> float:
    """The factor ``cos`` and ``sin`` are scaled by (1 but for yarn and longrope)."""
    if c.rope_attention_factor is not None:
        return float(c.rope_attention_factor)
    factor = float(c.rope_factor)
    if c.rope_type == "yarn":
        return yarn_mscale(factor)
    if c.rope_type == "longrope":
        old = float(c.rope_original_max_position_embeddings)
        if factor <= 1:
            return 1.0
        return math.sqrt(1 + math.log(factor) / math.log(old))
    return 1.0


def rope_inv_freq(c: Any, positions: jax.Array, dtype: Any) -> jax.Array | None:
    """``c``'s inverse frequencies ``(r/2,)`` for ``positions``; None when plain.

    ``positions`` only matter to ``dynamic`` and ``longrope``, through the
    sequence length ``max(positions) + 1`` (traced).
    """
    divisors = scaling_divisors(c)
    kind = c.rope_type
    if divisors is None and kind != "dynamic":
        return None
    seq_len = jnp.max(positions).astype(dtype) + 1
    if kind == "dynamic":
        d, m, factor = c.rotary_dim, c.max_position_embeddings, c.rope_factor
        s = jnp.maximum(seq_len, jnp.asarray(m, dtype))
        grow = (factor * s / m - (factor - 1)) ** (d / (d - 2))
        return base_inv_freq(d, c.rope_theta * grow, dtype)
    inv = base_inv_freq(c.rotary_dim, c.rope_theta, dtype)
    if kind == "longrope":
        long = jnp.asarray(np.asarray(c.rope_long_factor), dtype)
        short = jnp.asarray(divisors, dtype)
        beyond = seq_len > c.rope_original_max_position_embeddings
        return inv / jnp.where(beyond, long, short)
    return inv / jnp.asarray(divisors, dtype)


__all__ = [
    "attention_factor",
    "base_inv_freq",
    "rope_inv_freq",
    "scaling_divisors",
    "yarn_mscale",
]
