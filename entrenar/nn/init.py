"""Weight initialisers with explicit keys.

Every initialiser is ``init(shape, *, key, dtype=float32, ...) -> array`` and draws only
from ``key``. Weights follow the ``(out_features, in_features)`` layout, so for a shape
``(*lead, out, in)`` the fans are ``fan_in = in`` and ``fan_out = out``; leading axes
(stacked layers) are independent matrices. A 1-D shape has ``fan_in = fan_out = n``.

References:
    Glorot & Bengio, "Understanding the difficulty of training deep feedforward neural
    networks", AISTATS 2010. He et al., "Delving Deep into Rectifiers", ICCV 2015.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp

from entrenar.errors import ConfigError, ShapeError
from entrenar.types import DType, PRNGKey


def fans(shape: Sequence[int]) -> tuple[int, int]:
    """Return ``(fan_in, fan_out)`` of a weight of shape ``(*lead, out, in)``.

    >>> fans((3, 8, 4))
    (4, 8)
    """
    if len(shape) == 0:
        raise ShapeError("cannot compute fans of a scalar shape (); give a 1-D+ shape")
    if len(shape) == 1:
        return int(shape[0]), int(shape[0])
    return int(shape[-1]), int(shape[-2])


def normal(
    shape: Sequence[int],
    *,
    key: PRNGKey,
    std: float = 0.02,
    dtype: DType = jnp.float32,
) -> jax.Array:
    """``W ~ N(0, std²)`` (GPT-2 and Llama use ``std = 0.02``).

    >>> normal((2, 3), key=jax.random.key(0)).shape
    (2, 3)
    """
    return (std * jax.random.normal(key, tuple(shape), jnp.float32)).astype(dtype)


def xavier_uniform(
    shape: Sequence[int], *, key: PRNGKey, gain: float = 1.0, dtype: DType = jnp.float32
) -> jax.Array:
    """Glorot uniform: ``W ~ U(-a, a)``, ``a = gain · sqrt(6 / (fan_in + fan_out))``."""
    fan_in, fan_out = fans(shape)
    a = gain * math.sqrt(6.0 / (fan_in + fan_out))
    u = jax.random.uniform(key, tuple(shape), jnp.float32, -a, a)
    return u.astype(dtype)


def xavier_normal(
    shape: Sequence[int], *, key: PRNGKey, gain: float = 1.0, dtype: DType = jnp.float32
) -> jax.Array:
    """Glorot normal: ``W ~ N(0, σ²)``, ``σ = gain · sqrt(2 / (fan_in + fan_out))``."""
    fan_in, fan_out = fans(shape)
    std = gain * math.sqrt(2.0 / (fan_in + fan_out))
    return normal(shape, key=key, std=std, dtype=dtype)


def _kaiming_std(shape: Sequence[int], gain: float, mode: str) -> float:
    fan_in, fan_out = fans(shape)
    if mode not in ("fan_in", "fan_out"):
        raise ConfigError(f"kaiming mode must be 'fan_in' or 'fan_out', got {mode!r}")
    fan = fan_in if mode == "fan_in" else fan_out
    return gain / math.sqrt(fan)


def kaiming_normal(
    shape: Sequence[int],
    *,
    key: PRNGKey,
    gain: float = math.sqrt(2.0),
    mode: str = "fan_in",
    dtype: DType = jnp.float32,
) -> jax.Array:
    """He normal: ``W ~ N(0, σ²)``, ``σ = gain / sqrt(fan)`` (gain √2 suits ReLU)."""
    return normal(shape, key=key, std=_kaiming_std(shape, gain, mode), dtype=dtype)


def kaiming_uniform(
    shape: Sequence[int],
    *,
    key: PRNGKey,
    gain: float = math.sqrt(2.0),
    mode: str = "fan_in",
    dtype: DType = jnp.float32,
) -> jax.Array:
    """He uniform: ``W ~ U(-a, a)``, ``a = gain · sqrt(3 / fan)``."""
    a = math.sqrt(3.0) * _kaiming_std(shape, gain, mode)
    u = jax.random.uniform(key, tuple(shape), jnp.float32, -a, a)
    return u.astype(dtype)


__all__ = [
    "fans",
    "kaiming_normal",
    "kaiming_uniform",
    "normal",
    "xavier_normal",
    "xavier_uniform",
]
