"""Learning-rate schedules: pure functions of the step count.

A schedule is any ``fn(step) -> lr``; ``step`` is a Python int or an int32 array (a
tracer under ``jax.jit``) counting the updates already applied, and ``lr`` is a float32
scalar. Every optimizer accepts a schedule wherever it accepts a number.

Formulas (``t`` the step, clipped to the schedule's range) are in specs/optimizers.md.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias

import jax
import jax.numpy as jnp

from entrenar.errors import ConfigError

Schedule: TypeAlias = Callable[[Any], jax.Array]
"""``fn(step) -> learning rate`` (float32 scalar)."""


def _step(count: Any) -> jax.Array:
    return jnp.asarray(count).astype(jnp.float32)


def _positive_steps(name: str, steps: int) -> None:
    if int(steps) <= 0:
        raise ConfigError(f"{name} must be a positive number of steps, got {steps}")


def constant(value: float) -> Schedule:
    """``lr(t) = value``.

    >>> float(constant(0.1)(7))
    0.10000000149011612
    """

    def schedule(count: Any) -> jax.Array:
        return jnp.full(jnp.shape(count), value, jnp.float32)

    return schedule


def linear(
    init_value: float,
    end_value: float,
    transition_steps: int,
    transition_begin: int = 0,
) -> Schedule:
    """Linear interpolation from ``init_value`` to ``end_value``.

    ``lr(t) = end + (init - end) · (1 - τ / transition_steps)`` with
    ``τ = clip(t - transition_begin, 0, transition_steps)``.

    >>> float(linear(1.0, 0.0, 10)(5))
    0.5
    """
    _positive_steps("transition_steps", transition_steps)

    def schedule(count: Any) -> jax.Array:
        tau = jnp.clip(_step(count) - transition_begin, 0.0, transition_steps)
        frac = 1.0 - tau / transition_steps
        return (init_value - end_value) * frac + end_value

    return schedule


def cosine(init_lr: float, total_steps: int, min_lr: float = 0.0) -> Schedule:
    """Cosine annealing with a floor (Loshchilov & Hutter, 2017, SGDR).

    ``lr(t) = min_lr + (init_lr - min_lr) · ½ (1 + cos(π · min(t, T) / T))``,
    ``T = total_steps``; ``lr(t) = min_lr`` for ``t ≥ T``.

    >>> [round(float(cosine(1.0, 10, 0.1)(t)), 4) for t in (0, 5, 10, 20)]
    [1.0, 0.55, 0.1, 0.1]
    """
    _positive_steps("total_steps", total_steps)

    def schedule(count: Any) -> jax.Array:
        t = jnp.minimum(_step(count), total_steps)
        cos = 0.5 * (1.0 + jnp.cos(math.pi * t / total_steps))
        return min_lr + (init_lr - min_lr) * cos

    return schedule


def exponential_decay(
    init_lr: float,
    decay_rate: float,
    transition_steps: int = 1,
    *,
    staircase: bool = False,
    transition_begin: int = 0,
) -> Schedule:
    """``lr(t) = init_lr · rate^(τ / transition_steps)``, ``τ = max(t - begin, 0)``.

    With ``staircase`` the exponent is rounded down, so the rate drops in steps.

    >>> round(float(exponential_decay(1.0, 0.5, 2)(4)), 6)
    0.25
    """
    _positive_steps("transition_steps", transition_steps)

    def schedule(count: Any) -> jax.Array:
        tau = jnp.maximum(_step(count) - transition_begin, 0.0)
        p = tau / transition_steps
        if staircase:
            p = jnp.floor(p)
        return init_lr * jnp.power(jnp.float32(decay_rate), p)

    return schedule


def step_decay(init_lr: float, step_size: int, gamma: float = 0.1) -> Schedule:
    """Step decay (PyTorch's ``StepLR``): ``lr(t) = init_lr · γ^⌊t / step_size⌋``.

    >>> [round(float(step_decay(1.0, 3, 0.5)(t)), 4) for t in (0, 2, 3, 7)]
    [1.0, 1.0, 0.5, 0.25]
    """
    return exponential_decay(init_lr, gamma, step_size, staircase=True)


def join_schedules(
    schedules: Sequence[Schedule], boundaries: Sequence[int]
) -> Schedule:
    """Run ``schedules[i]`` from ``boundaries[i-1]``, each restarted at step 0.

    ``lr(t) = s_i(t - b_{i-1})`` for ``b_{i-1} ≤ t < b_i`` (``b_{-1} = 0``).

    >>> s = join_schedules([constant(1.0), linear(1.0, 0.0, 4)], [2])
    >>> [float(s(t)) for t in (0, 1, 2, 4, 9)]
    [1.0, 1.0, 1.0, 0.5, 0.0]
    """
    if len(boundaries) != len(schedules) - 1:
        raise ConfigError(
            f"join_schedules needs one boundary fewer than schedules, got "
            f"{len(schedules)} schedules and {len(boundaries)} boundaries"
        )

    def schedule(count: Any) -> jax.Array:
        step = jnp.asarray(count)
        out = schedules[0](step)
        for boundary, sched in zip(boundaries, schedules[1:]):
            out = jnp.where(step < boundary, out, sched(step - boundary))
        return out

    return schedule


def warmup(
    schedule: Schedule | float, warmup_steps: int, init_lr: float = 0.0
) -> Schedule:
    """Linear warm-up from ``init_lr`` to ``schedule(0)``, then ``schedule``.

    ``lr(t) = init_lr + (s(0) - init_lr) · t / W`` for ``t < W``, else ``s(t - W)``.
    ``warmup(cosine(peak, T - W, end), W)`` is optax's
    ``warmup_cosine_decay_schedule(0, peak, W, T, end)``.

    >>> s = warmup(cosine(1.0, 10), 5)
    >>> [round(float(s(t)), 3) for t in (0, 1, 5, 10, 15)]
    [0.0, 0.2, 1.0, 0.5, 0.0]
    """
    _positive_steps("warmup_steps", warmup_steps)
    after = constant(schedule) if isinstance(schedule, (int, float)) else schedule
    peak = float(after(0))
    return join_schedules([linear(init_lr, peak, warmup_steps), after], [warmup_steps])


@dataclass(frozen=True)
class CosineScheduler:
    """The original object API: ``CosineScheduler(0.1, 0.001, 1000).get_lr(step)``.

    It is the schedule `cosine(initial_lr, total_steps, min_lr)`, and is itself
    callable as a schedule.

    >>> sched = CosineScheduler(initial_lr=0.1, min_lr=0.0, total_steps=100)
    >>> round(sched.get_lr(50), 6)
    0.05
    """

    initial_lr: float
    min_lr: float
    total_steps: int

    def __post_init__(self) -> None:
        _positive_steps("total_steps", self.total_steps)

    def __call__(self, step: Any) -> jax.Array:
        """The learning rate at ``step`` as a float32 array (traceable)."""
        return cosine(self.initial_lr, self.total_steps, self.min_lr)(step)

    def get_lr(self, step: int) -> float:
        """The learning rate at ``step`` as a Python float."""
        return float(self(step))


__all__ = [
    "CosineScheduler",
    "Schedule",
    "constant",
    "cosine",
    "exponential_decay",
    "join_schedules",
    "linear",
    "step_decay",
    "warmup",
]
