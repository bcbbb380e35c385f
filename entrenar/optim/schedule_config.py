"""`ScheduleConfig`: a run's ``scheduler:`` section, by optax's or Hugging Face's name.

`SCHEDULES` maps ``scheduler.name`` to ``fn(config, peak, total) -> schedule``; adding
one is one ``@SCHEDULES.register(name)``. optax's schedules (`entrenar.optim.schedules`)
take any warm-up from ``init_value``; Hugging Face's (`entrenar.optim.hf_schedules`)
give ``transformers.get_scheduler(name, ...)``'s rate at every update, so a run moved
from a ``TrainingArguments`` with ``lr_scheduler_type: NAME`` and
``lr_scheduler_kwargs`` trains at the same rates. HF's ``linear``, ``cosine`` and
``constant_with_warmup`` are optax's ``linear``, ``cosine_decay`` and ``constant`` with
``warmup_steps``: the same rates (specs/optimizers.md).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from entrenar.errors import ConfigError
from entrenar.optim import hf_schedules as hf
from entrenar.optim.schedules import (
    Schedule,
    constant_schedule,
    cosine_decay_schedule,
    exponential_decay,
    linear_schedule,
    warmup,
    warmup_cosine_decay_schedule,
)
from entrenar.schema import Config, Registry, option

_HF_NAMES = {"cosine": "cosine_decay", "constant_with_warmup": "constant"}
"""Hugging Face's names of optax's schedules with a warm-up (the same rates)."""

_WSD = ("warmup_stable_decay",)
_USERS: dict[str, tuple[str, ...]] = {
    "decay_rate": ("exponential_decay",),
    "staircase": ("exponential_decay",),
    "stable_steps": _WSD,
    "decay_ratio": _WSD,
    "warmup_type": _WSD,
    "decay_type": _WSD,
    "min_lr_ratio": ("cosine_with_min_lr", *_WSD),
    "num_cycles": ("cosine_with_restarts", "cosine_with_min_lr", *_WSD),
    "power": ("polynomial",),
    "timescale": ("inverse_sqrt",),
    "decay_steps": (
        "linear",
        "cosine_decay",
        "warmup_cosine_decay",
        "exponential_decay",
        *_WSD,
    ),
    "end_value": (
        "linear",
        "cosine_decay",
        "warmup_cosine_decay",
        "polynomial",
        "cosine_with_min_lr",
    ),
    "init_value": (
        "constant",
        "linear",
        "cosine_decay",
        "warmup_cosine_decay",
        "exponential_decay",
    ),
}
"""The schedules that read each optional key (set elsewhere it is refused)."""


def _schedule_name(value: object) -> object:
    """Accept optax's spellings (``cosine_decay_schedule``) and HF's (``cosine``)."""
    if isinstance(value, str) and value.lower().endswith("_schedule"):
        value = value[: -len("_schedule")]
    return _HF_NAMES.get(value, value) if isinstance(value, str) else value


def _whole_warmup(value: object) -> object:
    """Refuse HF 5's fractional ``warmup_steps`` (a ratio): say `warmup_ratio`."""
    if isinstance(value, float) and 0.0 < value < 1.0:
        raise ConfigError(
            f"{value} is a fraction of the run (Hugging Face 5's meaning of "
            f"warmup_steps below 1); write warmup_ratio: {value}"
        )
    return value


Curve = Literal["linear", "cosine", "1-sqrt"]


@dataclass(frozen=True)
class ScheduleConfig(Config):
    """A learning-rate schedule: the ``scheduler:`` section of a run.

    Example:
        >>> s = ScheduleConfig("cosine_decay", warmup_steps=2).build(1.0, total=10)
        >>> [round(float(s(t)), 3) for t in (0, 1, 2, 10)]
        [0.0, 0.5, 1.0, 0.0]
    """

    name: Literal[
        "constant", "linear", "cosine_decay", "warmup_cosine_decay",
        "exponential_decay", "cosine_with_restarts", "polynomial", "inverse_sqrt",
        "cosine_with_min_lr", "warmup_stable_decay",
    ] = option(
        "constant",
        normalize=_schedule_name,
        doc="constant, linear, cosine_decay, warmup_cosine_decay, exponential_decay "
        "(optax's; a trailing _schedule is accepted) or Hugging Face's "
        "cosine_with_restarts, polynomial, inverse_sqrt, cosine_with_min_lr, "
        "warmup_stable_decay; HF's cosine and constant_with_warmup are cosine_decay "
        "and constant (the same rates)",
    )  # fmt: skip
    warmup_steps: int = option(
        0,
        ge=0,
        normalize=_whole_warmup,
        doc="steps of linear warm-up to `optimizer.lr` (from `init_value`; HF's "
        "schedules from 0); warmup_cosine_decay needs a warm-up",
    )
    warmup_ratio: float | None = option(
        None,
        ge=0.0,
        lt=1.0,
        doc="warm-up as a fraction of the run's steps, rounded up (HF's "
        "warmup_ratio, HF 5's warmup_steps below 1); instead of warmup_steps",
    )
    decay_steps: int | None = option(
        None,
        ge=1,
        aliases=("num_decay_steps",),
        doc="length of the decay (default: the rest of the run after warm-up); "
        "warmup_cosine_decay counts the warm-up in it (optax's meaning); "
        "exponential_decay: steps per factor of `decay_rate` (default 1)",
    )
    init_value: float = option(0.0, ge=0.0, doc="learning rate at step 0 of warm-up")
    end_value: float | None = option(
        None,
        ge=0.0,
        aliases=("min_lr", "lr_end"),
        doc="rate at the end of the decay (default 0; polynomial: 1e-7, HF's lr_end)",
    )
    decay_rate: float | None = option(
        None, gt=0.0, le=1.0, doc="exponential_decay: factor per `decay_steps`"
    )
    staircase: bool = option(
        False, doc="exponential_decay: drop in whole steps of `decay_steps`"
    )
    min_lr_ratio: float | None = option(
        None,
        ge=0.0,
        le=1.0,
        aliases=("min_lr_rate",),
        doc="cosine_with_min_lr (or end_value), warmup_stable_decay (default 0): "
        "the final rate as a fraction of `optimizer.lr`",
    )
    num_cycles: float | None = option(
        None,
        gt=0.0,
        doc="cosine_with_restarts: restarts (a whole number, default 1); "
        "cosine_with_min_lr, warmup_stable_decay's cosine: periods (default 0.5)",
    )
    power: float | None = option(
        None, gt=0.0, doc="polynomial: exponent of the decay (default 1: linear)"
    )
    timescale: int | None = option(
        None,
        ge=1,
        doc="inverse_sqrt: lr = peak·sqrt(timescale/(t + timescale - warm-up)) "
        "(default: the warm-up, else 10000)",
    )
    stable_steps: int | None = option(
        None,
        ge=0,
        aliases=("num_stable_steps",),
        doc="warmup_stable_decay: steps at the peak (default: the run's rest)",
    )
    decay_ratio: float | None = option(
        None,
        gt=0.0,
        le=1.0,
        doc="warmup_stable_decay: decay as a fraction of the run, rounded up "
        "(instead of decay_steps)",
    )
    warmup_type: Curve | None = option(
        None, doc="warmup_stable_decay: linear (default), cosine or 1-sqrt"
    )
    decay_type: Curve | None = option(
        None, doc="warmup_stable_decay: cosine (default), linear or 1-sqrt"
    )

    def check(self, path: str) -> None:
        """Each key only with a schedule that reads it; required keys present."""
        for key, users in _USERS.items():
            value = getattr(self, key)
            if value not in (None, False, 0.0) and self.name not in users:
                raise ConfigError(
                    f"{path}.{key}: {self.name} does not use {key} (only "
                    f"{', '.join(users)}); remove it"
                )
        if self.warmup_ratio is not None and self.warmup_steps:
            raise ConfigError(
                f"{path}.warmup_ratio: give warmup_steps or warmup_ratio, not both"
            )
        if self.name == "warmup_cosine_decay" and not (
            self.warmup_steps or self.warmup_ratio
        ):
            raise ConfigError(
                f"{path}.warmup_steps: warmup_cosine_decay needs warmup_steps > 0 "
                "(or use cosine_decay)"
            )
        if (self.name == "exponential_decay") != (self.decay_rate is not None):
            raise ConfigError(
                f"{path}.decay_rate: required by exponential_decay and only by it"
            )
        self._check_hf(path)

    def _check_hf(self, path: str) -> None:
        if self.name == "cosine_with_min_lr" and (
            (self.end_value is None) == (self.min_lr_ratio is None)
        ):
            raise ConfigError(
                f"{path}.min_lr_ratio: cosine_with_min_lr needs one of min_lr_ratio "
                "and end_value (min_lr)"
            )
        if self.name == "warmup_stable_decay" and (
            (self.decay_steps is None) == (self.decay_ratio is None)
        ):
            raise ConfigError(
                f"{path}.decay_steps: warmup_stable_decay needs one of decay_steps "
                "(num_decay_steps) and decay_ratio"
            )
        cycles = self.num_cycles
        if self.name == "cosine_with_restarts" and cycles is not None:
            if cycles != int(cycles):
                raise ConfigError(
                    f"{path}.num_cycles: cosine_with_restarts restarts a whole "
                    f"number of times, got {cycles}"
                )

    def build(self, peak: float, total: int) -> Schedule:
        """The schedule to ``peak`` (``optimizer.lr``) in a run of ``total`` steps."""
        return SCHEDULES[self.name](self, peak, total)

    def warmup(self, total: int) -> int:
        """Steps of warm-up: `warmup_steps`, or ``ceil(warmup_ratio · total)``."""
        if self.warmup_ratio is not None:
            return math.ceil(total * self.warmup_ratio)
        return self.warmup_steps

    def decay(self, total: int) -> int:
        """Steps of the decay: `decay_steps`, else the run's after the warm-up."""
        return self.decay_steps or max(total - self.warmup(total), 1)

    def end(self) -> float:
        """`end_value`, 0 if unset."""
        return 0.0 if self.end_value is None else self.end_value

    def warm(self, schedule: Schedule, total: int) -> Schedule:
        """``schedule`` after this config's warm-up (if any)."""
        w = self.warmup(total)
        return warmup(schedule, w, self.init_value) if w else schedule


SCHEDULES: Registry[Callable[[ScheduleConfig, float, int], Schedule]] = Registry(
    "schedule"
)
"""``scheduler.name`` -> ``fn(config, peak, total_steps) -> schedule``."""


@SCHEDULES.register("constant")
def _constant(c: ScheduleConfig, peak: float, total: int) -> Schedule:
    return c.warm(constant_schedule(peak), total)


@SCHEDULES.register("linear")
def _linear(c: ScheduleConfig, peak: float, total: int) -> Schedule:
    return c.warm(linear_schedule(peak, c.end(), c.decay(total)), total)


@SCHEDULES.register("cosine_decay")
def _cosine_decay(c: ScheduleConfig, peak: float, total: int) -> Schedule:
    return c.warm(cosine_decay_schedule(peak, c.decay(total), c.end() / peak), total)


@SCHEDULES.register("warmup_cosine_decay")
def _warmup_cosine(c: ScheduleConfig, peak: float, total: int) -> Schedule:
    steps = c.decay_steps or total  # optax's: decay_steps counts the warm-up
    return warmup_cosine_decay_schedule(
        c.init_value, peak, c.warmup(total), steps, c.end()
    )


@SCHEDULES.register("exponential_decay")
def _exponential(c: ScheduleConfig, peak: float, total: int) -> Schedule:
    assert c.decay_rate is not None  # check: exponential_decay has one
    steps, rate = c.decay_steps or 1, c.decay_rate
    return c.warm(exponential_decay(peak, steps, rate, staircase=c.staircase), total)


@SCHEDULES.register("cosine_with_restarts")
def _restarts(c: ScheduleConfig, peak: float, total: int) -> Schedule:
    cycles = int(c.num_cycles or 1)
    return hf.cosine_with_restarts_schedule(peak, c.warmup(total), total, cycles)


@SCHEDULES.register("polynomial")
def _polynomial(c: ScheduleConfig, peak: float, total: int) -> Schedule:
    end = 1e-7 if c.end_value is None else c.end_value  # HF's lr_end
    return hf.polynomial_schedule(peak, c.warmup(total), total, end, c.power or 1.0)


@SCHEDULES.register("inverse_sqrt")
def _inverse_sqrt(c: ScheduleConfig, peak: float, total: int) -> Schedule:
    return hf.inverse_sqrt_schedule(peak, c.warmup(total), c.timescale)


@SCHEDULES.register("cosine_with_min_lr")
def _cosine_min_lr(c: ScheduleConfig, peak: float, total: int) -> Schedule:
    ratio = c.min_lr_ratio if c.min_lr_ratio is not None else c.end() / peak
    cycles = 0.5 if c.num_cycles is None else c.num_cycles
    return hf.cosine_with_min_lr_schedule(peak, c.warmup(total), total, ratio, cycles)


@SCHEDULES.register("warmup_stable_decay")
def _wsd(c: ScheduleConfig, peak: float, total: int) -> Schedule:
    w = c.warmup(total)
    d = c.decay_steps or math.ceil(total * (c.decay_ratio or 0.0))
    stable = total - w - d if c.stable_steps is None else c.stable_steps
    if stable < 0:
        raise ConfigError(
            f"scheduler: warm-up ({w}) and decay ({d}) steps exceed the run's "
            f"{total} steps; shorten them or set stable_steps"
        )
    return hf.warmup_stable_decay_schedule(
        peak, w, stable, d, c.warmup_type or "linear", c.decay_type or "cosine",
        c.min_lr_ratio or 0.0, 0.5 if c.num_cycles is None else c.num_cycles,
    )  # fmt: skip


__all__ = ["SCHEDULES", "ScheduleConfig"]
