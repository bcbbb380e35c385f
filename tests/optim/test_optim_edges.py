"""Edges of the transformations: sign, k = 1, low precision, messages, map_updates."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from entrenar import optim as eo
from entrenar.autograd import Tensor, backward
from entrenar.errors import ConfigError

U = {"w": jnp.array([1.0, -2.0, 4.0]), "b": jnp.array([0.5])}


def test_map_updates_applies_fn_to_every_leaf():
    tx = eo.map_updates(lambda u: 3.0 * u)
    out, _ = tx.update(U, tx.init(U))
    np.testing.assert_array_equal(np.asarray(out["w"]), [3.0, -6.0, 12.0])
    np.testing.assert_array_equal(np.asarray(out["b"]), [1.5])


@pytest.mark.parametrize("flip_sign, sign", [(True, -1.0), (False, 1.0)])
def test_scale_by_learning_rate_sign(flip_sign, sign):
    tx = eo.scale_by_learning_rate(0.25, flip_sign=flip_sign)
    out, _ = tx.update(U, tx.init(U))
    np.testing.assert_array_equal(
        np.asarray(out["w"]), sign * 0.25 * np.asarray(U["w"])
    )


def test_accumulate_every_step_is_the_inner_transformation():
    inner = eo.adam(0.1)
    tx, ref = eo.accumulate(inner, 1), inner
    s, r = tx.init(U), ref.init(U)
    for t in range(3):
        g = {k: v * (t + 1) for k, v in U.items()}
        u, s = tx.update(g, s, U)
        v, r = ref.update(g, r, U)
        for k in U:
            np.testing.assert_allclose(np.asarray(u[k]), np.asarray(v[k]), rtol=1e-6)


def test_accumulate_refuses_k_below_one_naming_it():
    with pytest.raises(ConfigError, match=r"^every_k must be at least 1, got 0$"):
        eo.accumulate(eo.sgd(0.1), 0)


def test_accumulate_keeps_bfloat16_gradients_and_updates_in_bfloat16():
    params = {"w": jnp.zeros(3, jnp.bfloat16)}
    tx = eo.accumulate(eo.sgd(1.0), 2)
    s = tx.init(params)
    assert s.mini_step.dtype == jnp.int32
    g1 = {"w": jnp.array([1.0, 2.0, 3.0], jnp.bfloat16)}
    g2 = {"w": jnp.array([3.0, 4.0, 5.0], jnp.bfloat16)}
    u1, s = tx.update(g1, s, params)
    assert u1["w"].dtype == jnp.bfloat16 and s.acc_grads["w"].dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(u1["w"], np.float32), [0.0, 0.0, 0.0])
    u2, s = tx.update(g2, s, params)
    assert u2["w"].dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(u2["w"], np.float32), [-2.0, -3.0, -4.0])
    assert int(s.mini_step) == 0


def test_set_lr_on_a_schedule_says_what_to_do():
    s = eo.sgd(eo.constant_schedule(0.1)).init(U)
    with pytest.raises(
        ConfigError,
        match=r"^the learning rate follows a schedule and cannot be set; build the "
        r"optimizer with a number as learning rate to use set_lr$",
    ):
        eo.set_lr(s, 0.5)


def test_stateful_step_updates_a_tensor_listed_twice_once():
    w = Tensor([1.0, 2.0], requires_grad=True)
    backward((w * w).sum() * 0.5)  # grad = w
    eo.SGD(0.5).step([w, w])
    np.testing.assert_allclose(np.asarray(w.data), [0.5, 1.0])  # not [0.25, 0.5]


def test_stateful_optimizer_refuses_a_schedule_and_says_what_to_do():
    with pytest.raises(
        ConfigError,
        match=r"^lr must be a number, got function; to follow a schedule call "
        r"opt\.set_lr\(schedule\(step\)\) each step \(e\.g\. CosineScheduler\)$",
    ):
        eo.SGD(lambda step: 0.1)
