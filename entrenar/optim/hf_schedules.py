"""Hugging Face's named schedules (``lr_scheduler_type``), as functions of the step.

Each is ``transformers.get_scheduler(name, ...)``'s rate: ``peak · λ(t)`` with ``λ``
the library's lambda and ``t`` the updates already applied (``LambdaLR`` gives the
update at optimizer step ``t`` the rate ``peak · λ(t)``: 0 at the first update of a
warm-up, ``peak · (W - 1) / W`` at its last). ``W`` is the warm-up, ``T`` the run's
updates, ``p = (t - W) / max(1, T - W)`` the progress of the decay, clipped to
``[0, 1]`` (past ``T`` the library's cosines climb again; no update of the run uses
those rates). Formulas in specs/optimizers.md.

``linear``, ``cosine`` and ``constant_with_warmup`` are optax's schedules with
`warmup` (`entrenar.optim.schedule_config`), which give the same rates.
"""

from __future__ import annotations

import math
from typing import Any, Literal

import jax
import jax.numpy as jnp

from entrenar.errors import ConfigError
from entrenar.optim.schedules import Schedule

Shape = Literal["linear", "cosine", "1-sqrt"]
"""A warm-up's or decay's curve in `warmup_stable_decay_schedule`."""
CURVES: tuple[str, ...] = ("linear", "cosine", "1-sqrt")


def _t(count: Any) -> jax.Array:
    return jnp.asarray(count).astype(jnp.float32)


def _ramp(t: jax.Array, warmup_steps: int) -> jax.Array:
    """``t / max(1, W)``: the warm-up factor of every schedule here."""
    return t / max(1, warmup_steps)


def _progress(t: jax.Array, warmup_steps: int, total_steps: int) -> jax.Array:
    """``clip((t - W) / max(1, T - W), 0, 1)``."""
    return jnp.clip((t - warmup_steps) / max(1, total_steps - warmup_steps), 0.0, 1.0)


def _check_steps(warmup_steps: int, total_steps: int) -> None:
    if int(warmup_steps) < 0 or int(total_steps) <= int(warmup_steps):
        raise ConfigError(
            f"total_steps ({total_steps}) must exceed warmup_steps ({warmup_steps}) "
            "and warmup_steps must be >= 0"
        )


def cosine_with_restarts_schedule(
    peak: float, warmup_steps: int, total_steps: int, num_cycles: int = 1
) -> Schedule:
    """Cosine with ``num_cycles`` hard restarts to ``peak`` (SGDR's warm restarts).

    ``λ(t) = ½ (1 + cos(π · ((c · p) mod 1)))`` after warm-up, 0 once ``p = 1``
    (HF's ``cosine_with_restarts``).

    >>> s = cosine_with_restarts_schedule(1.0, 0, 10, num_cycles=2)
    >>> [round(float(s(t)), 3) for t in (0, 4, 5, 9, 10)]
    [1.0, 0.095, 1.0, 0.095, 0.0]
    """
    _check_steps(warmup_steps, total_steps)
    if int(num_cycles) < 1:
        raise ConfigError(f"num_cycles must be >= 1, got {num_cycles}")

    def schedule(count: Any) -> jax.Array:
        t = _t(count)
        p = _progress(t, warmup_steps, total_steps)
        cos = 0.5 * (1.0 + jnp.cos(math.pi * jnp.mod(num_cycles * p, 1.0)))
        decay = jnp.where(p >= 1.0, 0.0, cos)
        return peak * jnp.where(t < warmup_steps, _ramp(t, warmup_steps), decay)

    return schedule


def polynomial_schedule(
    peak: float,
    warmup_steps: int,
    total_steps: int,
    end_value: float = 1e-7,
    power: float = 1.0,
) -> Schedule:
    """Polynomial decay from ``peak`` to ``end_value`` (BERT's, fairseq's).

    ``lr(t) = (peak - end) · (1 - p)^power + end`` after warm-up, ``end`` past ``T``
    (HF's ``polynomial``, ``lr_end`` = ``end_value``).

    >>> s = polynomial_schedule(1.0, 0, 10, end_value=0.0, power=2.0)
    >>> [round(float(s(t)), 3) for t in (0, 5, 10, 20)]
    [1.0, 0.25, 0.0, 0.0]
    """
    _check_steps(warmup_steps, total_steps)
    if not peak > end_value:
        raise ConfigError(
            f"polynomial: end_value ({end_value}) must be below the peak rate ({peak})"
        )

    def schedule(count: Any) -> jax.Array:
        t = _t(count)
        remaining = 1.0 - _progress(t, warmup_steps, total_steps)
        decay = (peak - end_value) * jnp.power(remaining, power) + end_value
        return jnp.where(t < warmup_steps, peak * _ramp(t, warmup_steps), decay)

    return schedule


def inverse_sqrt_schedule(
    peak: float, warmup_steps: int, timescale: int | None = None
) -> Schedule:
    """Inverse square root (Vaswani et al., 2017; big_vision's ``rsqrt``).

    ``λ(t) = 1 / sqrt((t + s - W) / s)`` after warm-up, ``s = timescale`` (default
    ``W``, else 10 000): ``peak`` at ``t = W`` (HF's ``inverse_sqrt``).

    >>> s = inverse_sqrt_schedule(1.0, 4)
    >>> [round(float(s(t)), 3) for t in (0, 2, 4, 16)]
    [0.0, 0.5, 1.0, 0.5]
    """
    scale = timescale if timescale is not None else (warmup_steps or 10_000)
    if int(scale) < 1 or int(warmup_steps) < 0:
        raise ConfigError(
            f"inverse_sqrt needs timescale >= 1 and warmup_steps >= 0, got "
            f"{timescale} and {warmup_steps}"
        )

    def schedule(count: Any) -> jax.Array:
        t = _t(count)
        decay = jax.lax.rsqrt(jnp.maximum(t + (scale - warmup_steps), 1.0) / scale)
        return peak * jnp.where(t < warmup_steps, _ramp(t, warmup_steps), decay)

    return schedule


def _cosine_factor(p: jax.Array, num_cycles: float) -> jax.Array:
    """``½ (1 + cos(2π · c · p))``: half a period (a decay to 0) at ``c = ½``."""
    return 0.5 * (1.0 + jnp.cos(2.0 * math.pi * num_cycles * p))


def cosine_with_min_lr_schedule(
    peak: float,
    warmup_steps: int,
    total_steps: int,
    min_lr_ratio: float,
    num_cycles: float = 0.5,
) -> Schedule:
    """Cosine from ``peak`` to ``min_lr_ratio · peak`` after warm-up.

    ``λ(t) = max(0, ½ (1 + cos(2π · c · p)) · (1 - r) + r)``, ``r = min_lr_ratio``
    (HF's ``cosine_with_min_lr``; ``r = 0`` is HF's ``cosine`` with ``num_cycles``).

    >>> s = cosine_with_min_lr_schedule(1.0, 2, 12, 0.1)
    >>> [round(float(s(t)), 3) for t in (0, 1, 2, 7, 12)]
    [0.0, 0.5, 1.0, 0.55, 0.1]
    """
    _check_steps(warmup_steps, total_steps)

    def schedule(count: Any) -> jax.Array:
        t = _t(count)
        p = _progress(t, warmup_steps, total_steps)
        f = _cosine_factor(p, num_cycles) * (1.0 - min_lr_ratio) + min_lr_ratio
        decay = jnp.maximum(f, 0.0)
        return peak * jnp.where(t < warmup_steps, _ramp(t, warmup_steps), decay)

    return schedule


def _rise(kind: Shape, x: jax.Array) -> jax.Array:
    """A warm-up's curve from 0 to 1 as ``x`` goes from 0 to 1."""
    if kind == "cosine":
        return 0.5 * (1.0 - jnp.cos(math.pi * x))
    if kind == "1-sqrt":
        return 1.0 - jnp.sqrt(1.0 - x)
    return x


def _fall(kind: Shape, q: jax.Array, num_cycles: float) -> jax.Array:
    """A decay's curve from 1 to 0 as ``q`` goes from 0 to 1."""
    if kind == "cosine":
        return _cosine_factor(q, num_cycles)
    if kind == "1-sqrt":
        return 1.0 - jnp.sqrt(q)
    return 1.0 - q


def warmup_stable_decay_schedule(
    peak: float,
    warmup_steps: int,
    stable_steps: int,
    decay_steps: int,
    warmup_type: Shape = "linear",
    decay_type: Shape = "cosine",
    min_lr_ratio: float = 0.0,
    num_cycles: float = 0.5,
) -> Schedule:
    """Warm-up, stable, decay (WSD; Hu et al., 2024, MiniCPM; Hägele et al., 2024).

    With ``r = min_lr_ratio``: ``λ = r + (1 - r) · w(t / W)`` in the warm-up, 1 for
    ``stable_steps``, then ``r + (1 - r) · d(q)`` over ``decay_steps`` (``q`` the
    decay's progress), ``r`` after. Curves: linear ``w(x) = x``, ``d(q) = 1 - q``;
    cosine ``w(x) = ½ (1 - cos(π x))``, ``d(q) = ½ (1 + cos(2π · c · q))``; 1-sqrt
    ``w(x) = 1 - sqrt(1 - x)``, ``d(q) = 1 - sqrt(q)`` (HF's
    ``warmup_stable_decay``).

    >>> s = warmup_stable_decay_schedule(1.0, 2, 3, 4, decay_type="linear")
    >>> [round(float(s(t)), 3) for t in (0, 1, 2, 4, 5, 7, 9, 12)]
    [0.0, 0.5, 1.0, 1.0, 1.0, 0.5, 0.0, 0.0]
    """
    for name, n in (("warmup", warmup_steps), ("stable", stable_steps)):
        if int(n) < 0:
            raise ConfigError(f"{name}_steps must be >= 0, got {n}")
    if int(decay_steps) < 0:
        raise ConfigError(f"decay_steps must be >= 0, got {decay_steps}")
    for name, kind in (("warmup_type", warmup_type), ("decay_type", decay_type)):
        if kind not in CURVES:
            raise ConfigError(f"{name} {kind!r}: use one of {list(CURVES)}")
    r = min_lr_ratio
    start, end = warmup_steps + stable_steps, warmup_steps + stable_steps + decay_steps

    def schedule(count: Any) -> jax.Array:
        t = _t(count)
        up = _rise(warmup_type, jnp.clip(_ramp(t, warmup_steps), 0.0, 1.0))
        q = jnp.clip((t - start) / max(1, decay_steps), 0.0, 1.0)
        down = _fall(decay_type, q, num_cycles)
        lam = jnp.where(
            t < warmup_steps,
            jnp.maximum(up * (1.0 - r) + r, 0.0),
            jnp.where(
                t < start,
                1.0,
                jnp.where(t < end, jnp.maximum(down * (1.0 - r) + r, 0.0), r),
            ),
        )
        return peak * lam

    return schedule


__all__ = [
    "cosine_with_min_lr_schedule",
    "cosine_with_restarts_schedule",
    "inverse_sqrt_schedule",
    "polynomial_schedule",
    "warmup_stable_decay_schedule",
]
