"""Schedules against optax and their formulas; the learning rate in the state."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from entrenar import optim as eo
from entrenar.errors import ConfigError

T = np.arange(0, 1200)
NAMES = [
    "constant",
    "cosine",
    "exponential",
    "exponential_staircase_begin",
    "linear",
    "step_decay",
    "warmup_constant_from_float",
    "warmup_cosine",
    "warmup_exponential",
]


def _schedules():  # built inside each test, so tools that trace calls see them
    return {
        "constant": (eo.constant_schedule(0.3), optax.constant_schedule(0.3)),
        "linear": (
            eo.linear_schedule(0.1, 0.01, 500, 100),
            optax.linear_schedule(0.1, 0.01, 500, 100),
        ),
        "cosine": (
            eo.cosine_decay_schedule(0.1, 1000, 0.01),
            optax.cosine_decay_schedule(0.1, 1000, 0.01),
        ),
        "exponential": (
            eo.exponential_decay(0.1, 50, 0.9),
            optax.exponential_decay(0.1, 50, 0.9),
        ),
        "exponential_staircase_begin": (
            eo.exponential_decay(0.1, 50, 0.9, transition_begin=30, staircase=True),
            optax.exponential_decay(0.1, 50, 0.9, transition_begin=30, staircase=True),
        ),
        "step_decay": (
            eo.step_decay(0.1, 300, 0.5),
            optax.exponential_decay(0.1, 300, 0.5, staircase=True),
        ),
        "warmup_cosine": (
            eo.warmup_cosine_decay_schedule(0.0, 0.1, 100, 1000, 0.001),
            optax.warmup_cosine_decay_schedule(0.0, 0.1, 100, 1000, 0.001),
        ),
        "warmup_exponential": (
            eo.warmup(eo.exponential_decay(0.1, 10, 0.99), 50, init_value=0.01),
            optax.warmup_exponential_decay_schedule(0.01, 0.1, 50, 10, 0.99),
        ),
        "warmup_constant_from_float": (
            eo.warmup(0.2, 40, init_value=0.05),
            optax.join_schedules(
                [optax.linear_schedule(0.05, 0.2, 40), optax.constant_schedule(0.2)],
                [40],
            ),
        ),
    }


@pytest.mark.parametrize("name", NAMES)
def test_schedule_matches_optax_at_every_step(name):
    ours, theirs = _schedules()[name]
    with jax.numpy_dtype_promotion("standard"):
        expected = np.array([float(theirs(int(t))) for t in T[::7]])
    actual = np.asarray(jax.jit(ours)(jnp.asarray(T[::7], jnp.int32)))
    assert actual.dtype == np.float32
    np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-9)


def test_cosine_scheduler_is_the_rust_formula():
    sched = eo.CosineScheduler(initial_lr=0.1, min_lr=0.001, total_steps=1000)
    for step in (0, 1, 250, 500, 999, 1000, 5000):
        t = min(step, 1000)
        want = 0.001 + 0.5 * (0.1 - 0.001) * (1 + math.cos(math.pi * t / 1000))
        assert sched.get_lr(step) == pytest.approx(want, rel=1e-6)
    assert float(sched(jnp.int32(500))) == pytest.approx(sched.get_lr(500))


def test_step_decay_is_torch_steplr():
    torch = pytest.importorskip("torch")
    w = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([w], lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    ours = eo.step_decay(0.1, 3, 0.5)
    for t in range(12):
        assert float(ours(t)) == pytest.approx(opt.param_groups[0]["lr"], rel=1e-6)
        opt.step()
        sched.step()


def test_bad_schedule_arguments_are_config_errors():
    with pytest.raises(ConfigError, match="decay_steps"):
        eo.cosine_decay_schedule(0.1, 0)
    with pytest.raises(ConfigError, match="total_steps"):
        eo.CosineScheduler(0.1, 0.0, 0)
    with pytest.raises(ConfigError, match="counts the warm-up"):
        eo.warmup_cosine_decay_schedule(0.0, 0.1, 10, 10)
    # the message starts with the argument's name, as the caller spelled it
    with pytest.raises(ConfigError, match=r"^warmup_steps must be a positive number"):
        eo.warmup(eo.constant_schedule(0.1), -1)
    with pytest.raises(ConfigError, match=r"^transition_steps must be .*, got 0$"):
        eo.linear_schedule(0.1, 0.0, 0)
    with pytest.raises(ConfigError, match=r"^transition_steps must be .*, got 0$"):
        eo.exponential_decay(0.1, 0, 0.5)
    with pytest.raises(ConfigError, match=r"^decay_steps must be"):
        eo.cosine_decay_schedule(0.1, -2)
    with pytest.raises(ConfigError, match="boundary"):
        eo.join_schedules([eo.constant_schedule(0.1)], [3])


# ---- the learning rate in the state ------------------------------------------------


def test_get_and_set_lr_without_recompiling():
    params = {"w": jnp.ones(3)}
    tx = eo.adamw(0.01)
    state = tx.init(params)
    assert float(eo.get_lr(state)) == pytest.approx(0.01)
    traces = []

    @jax.jit
    def step(state, lr):
        traces.append(1)
        state = eo.set_lr(state, lr)
        return tx.update({"w": jnp.ones(3)}, state, params)

    u1, _ = step(state, jnp.float32(0.1))
    u2, s2 = step(state, jnp.float32(0.2))
    assert len(traces) == 1
    assert float(eo.get_lr(s2)) == pytest.approx(0.2)
    # the first Adam step is -lr·(1 + wd·θ)·sign-ish: it scales with lr exactly
    np.testing.assert_allclose(np.asarray(u2["w"]), 2 * np.asarray(u1["w"]), rtol=1e-6)


def test_schedule_state_reports_next_rate_and_refuses_set_lr():
    sched = eo.cosine_decay_schedule(0.1, 10)
    tx = eo.sgd(sched, momentum=0.9)
    s = tx.init(jnp.zeros(2))
    for t in range(4):
        assert float(eo.get_lr(s)) == pytest.approx(float(sched(t)))
        _, s = tx.update(jnp.ones(2), s)
    with pytest.raises(ConfigError, match="schedule"):
        eo.set_lr(s, 0.5)


def test_refresh_lr_names_the_rate_a_changed_schedule_uses_next():
    """A state stepped under one schedule, continued under another (a resume).

    Its stored rate is the old schedule's; after `refresh_lr` `get_lr` names the
    rate the next update applies: SGD's update is -lr·g (g = 1), so the rate is
    read off the update itself; the new schedule by hand: 0.3·(1 - t/10).
    """
    old = eo.sgd(eo.linear_schedule(0.1, 0.0, 4))
    new = eo.sgd(eo.linear_schedule(0.3, 0.0, 10))
    params = {"w": jnp.zeros(2)}
    s = old.init(params)
    for _ in range(3):
        _, s = old.update({"w": jnp.ones(2)}, s, params)
    assert float(eo.get_lr(s)) == pytest.approx(0.1 * (1 - 3 / 4))  # stale
    fresh = eo.refresh_lr(new, s, params)
    assert float(eo.get_lr(fresh)) == pytest.approx(0.3 * (1 - 3 / 10), rel=1e-6)
    u, after = new.update({"w": jnp.ones(2)}, fresh, params)
    np.testing.assert_allclose(-np.asarray(u["w"]), float(eo.get_lr(fresh)), rtol=1e-6)
    assert int(after[-1].count) == 4  # the counts themselves are untouched
    np.testing.assert_array_equal(eo.refresh_lr(new, new.init(params), params)[-1].lr,
                                  new.init(params)[-1].lr)  # fmt: skip
    fixed = eo.adam(0.01).init(params)  # no schedule: the same state
    assert eo.refresh_lr(eo.adam(0.02), fixed, params) is fixed


def test_lr_is_found_through_masks_and_accumulation():
    params = {"w": jnp.ones(3), "b": jnp.ones(1)}
    tx = eo.accumulate(eo.freeze(eo.adam(0.3), {"w": True, "b": False}), 2)
    s = eo.set_lr(tx.init(params), 0.7)
    assert float(eo.get_lr(s)) == pytest.approx(0.7)


def test_lr_of_optax_inject_hyperparams_state():
    tx = optax.inject_hyperparams(optax.adam)(learning_rate=0.1)
    s = tx.init({"w": jnp.ones(2)})
    s = eo.set_lr(s, 0.05)
    assert float(eo.get_lr(s)) == pytest.approx(0.05)


def test_state_without_lr_is_a_clear_error():
    s = eo.scale_by_adam().init(jnp.ones(2))
    with pytest.raises(ConfigError, match="scale_by_learning_rate"):
        eo.get_lr(s)
    with pytest.raises(ConfigError, match="scale_by_learning_rate"):
        eo.set_lr(s, 0.1)
