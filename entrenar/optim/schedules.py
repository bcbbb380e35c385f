"""Learning-rate schedules: pure functions of the step count.

A schedule is any ``fn(step) -> lr``; ``step`` is a Python int or an int32 array (a
tracer under ``jax.jit``) counting the updates already applied, and ``lr`` is a float32
scalar. Every optimizer accepts a schedule wherever it accepts a number. Names,
argument orders and semantics are optax's, so a schedule ports between the two.

Formulas (``t`` the step, clipped to the schedule's range) are in specs/optimizers.md.
Hugging Face's named schedules are in `entrenar.optim.hf_schedules`; a run's YAML file
names either (``scheduler: {name: cosine_decay}``): `entrenar.optim.schedule_config`.
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


def constant_schedule(value: float) -> Schedule:
    """``lr(t) = value``.

    >>> float(constant_schedule(0.1)(7))
    0.10000000149011612
    """

    def schedule(count: Any) -> jax.Array:
        return jnp.full(jnp.shape(count), value, jnp.float32)

    return schedule


def linear_schedule(
    init_value: float,
    end_value: float,
    transition_steps: int,
    transition_begin: int = 0,
) -> Schedule:
    """Linear interpolation from ``init_value`` to ``end_value``.

    ``lr(t) = end + (init - end) · (1 - τ / transition_steps)`` with
    ``τ = clip(t - transition_begin, 0, transition_steps)``.

    >>> float(linear_schedule(1.0, 0.0, 10)(5))
    0.5
    """
    _positive_steps("transition_steps", transition_steps)

    def schedule(count: Any) -> jax.Array:
        tau = jnp.clip(_step(count) - transition_begin, 0.0, transition_steps)
        frac = 1.0 - tau / transition_steps
        return (init_value - end_value) * frac + end_value

    return schedule


def _cosine(init_value: float, decay_steps: int, end_value: float) -> Schedule:
    """``end + (init - end) · ½ (1 + cos(π · min(t, T) / T))``, ``T = decay_steps``."""
    _positive_steps("decay_steps", decay_steps)

    def schedule(count: Any) -> jax.Array:
        t = jnp.minimum(_step(count), decay_steps)
        cos = 0.5 * (1.0 + jnp.cos(math.pi * t / decay_steps))
        return end_value + (init_value - end_value) * cos

    return schedule


def cosine_decay_schedule(
    init_value: float, decay_steps: int, alpha: float = 0.0
) -> Schedule:
    """Cosine annealing (Loshchilov & Hutter, 2017, SGDR) to ``alpha · init_value``.

    ``lr(t) = init · ((1 - α) · ½ (1 + cos(π · min(t, T) / T)) + α)``,
    ``T = decay_steps``; ``lr(t) = α · init`` for ``t ≥ T``.

    >>> [round(float(cosine_decay_schedule(1.0, 10, 0.1)(t)), 4) for t in (0, 5, 10)]
    [1.0, 0.55, 0.1]
    """
    return _cosine(init_value, decay_steps, alpha * init_value)


def warmup_cosine_decay_schedule(
    init_value: float,
    peak_value: float,
    warmup_steps: int,
    decay_steps: int,
    end_value: float = 0.0,
) -> Schedule:
    """Linear warm-up from ``init_value`` to ``peak_value``, then cosine to the end.

    ``decay_steps`` counts the whole schedule, warm-up included (optax's meaning):
    ``lr(t) = init + (peak - init) · t / W`` for ``t < W``, then the cosine from
    ``peak`` to ``end`` over ``decay_steps - W`` steps.

    >>> s = warmup_cosine_decay_schedule(0.0, 1.0, 5, 15)
    >>> [round(float(s(t)), 3) for t in (0, 1, 5, 10, 15)]
    [0.0, 0.2, 1.0, 0.5, 0.0]
    """
    if int(decay_steps) <= int(warmup_steps):
        raise ConfigError(
            f"decay_steps ({decay_steps}) counts the warm-up too and must exceed "
            f"warmup_steps ({warmup_steps})"
        )
    cos = _cosine(peak_value, decay_steps - warmup_steps, end_value)
    return warmup(cos, warmup_steps, init_value)


def exponential_decay(
    init_value: float,
    transition_steps: int,
    decay_rate: float,
    transition_begin: int = 0,
    staircase: bool = False,
) -> Schedule:
    """``lr(t) = init · rate^(τ / transition_steps)``, ``τ = max(t - begin, 0)``.

    With ``staircase`` the exponent is rounded down, so the rate drops in steps.

    >>> round(float(exponential_decay(1.0, 2, 0.5)(4)), 6)
    0.25
    """
    _positive_steps("transition_steps", transition_steps)

    def schedule(count: Any) -> jax.Array:
        tau = jnp.maximum(_step(count) - transition_begin, 0.0)
        p = tau / transition_steps
        if staircase:
            p = jnp.floor(p)
        return init_value * jnp.power(jnp.float32(decay_rate), p)

    return schedule


def step_decay(init_value: float, step_size: int, gamma: float = 0.1) -> Schedule:
    """Step decay (PyTorch's ``StepLR``): ``lr(t) = init · γ^⌊t / step_size⌋``.

    >>> [round(float(step_decay(1.0, 3, 0.5)(t)), 4) for t in (0, 2, 3, 7)]
    [1.0, 1.0, 0.5, 0.25]
    """
    return exponential_decay(init_value, step_size, gamma, staircase=True)


def join_schedules(
    schedules: Sequence[Schedule], boundaries: Sequence[int]
) -> Schedule:
    """Run ``schedules[i]`` from ``boundaries[i-1]``, each restarted at step 0.

    ``lr(t) = s_i(t - b_{i-1})`` for ``b_{i-1} ≤ t < b_i`` (``b_{-1} = 0``).

    >>> s = join_schedules([constant_schedule(1.0), linear_schedule(1.0, 0.0, 4)], [2])
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
    schedule: Schedule | float, warmup_steps: int, init_value: float = 0.0
) -> Schedule:
    """Linear warm-up from ``init_value`` to ``schedule(0)``, then ``schedule``.

    ``lr(t) = init + (s(0) - init) · t / W`` for ``t < W``, else ``s(t - W)``.
    Any schedule can be warmed up this way; `warmup_cosine_decay_schedule` is the
    common case.

    >>> s = warmup(cosine_decay_schedule(1.0, 10), 5)
    >>> [round(float(s(t)), 3) for t in (0, 1, 5, 10, 15)]
    [0.0, 0.2, 1.0, 0.5, 0.0]
    """
    _positive_steps("warmup_steps", warmup_steps)
    after = (
        constant_schedule(schedule) if isinstance(schedule, (int, float)) else schedule
    )
    peak = float(after(0))
    ramp = linear_schedule(init_value, peak, warmup_steps)
    return join_schedules([ramp, after], [warmup_steps])


@dataclass(frozen=True)
class CosineScheduler:
    """The book's object API: ``CosineScheduler(0.1, 0.001, 1000).get_lr(step)``.

    Cosine annealing from ``initial_lr`` to ``min_lr`` (an absolute floor) over
    ``total_steps``; callable as a schedule. Equal to
    ``cosine_decay_schedule(initial_lr, total_steps, alpha=min_lr / initial_lr)``.

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
        return _cosine(self.initial_lr, self.total_steps, self.min_lr)(step)

    def get_lr(self, step: int) -> float:
        """The learning rate at ``step`` as a Python float."""
        return float(self(step))


__all__ = [
    "CosineScheduler",
    "Schedule",
    "constant_schedule",
    "cosine_decay_schedule",
    "exponential_decay",
    "join_schedules",
    "linear_schedule",
    "step_decay",
    "warmup",
    "warmup_cosine_decay_schedule",
]
