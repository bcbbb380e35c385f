"""Properties: convergence on convex quadratics, frozen leaves, accumulation, dtypes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from optim_helpers import problem

from entrenar import optim as eo
from entrenar.errors import ConfigError, ShapeError
from entrenar.tree import tree_size

# name -> (optimizer with a settable rate, lr range where it must converge, steps)
OPTIMIZERS = {
    "sgd": (lambda: eo.sgd(0.1), (0.02, 0.5)),
    "sgd_momentum": (lambda: eo.sgd(0.1, 0.9), (0.005, 0.05)),
    "sgd_nesterov": (lambda: eo.sgd(0.1, 0.9, nesterov=True), (0.005, 0.05)),
    "adam": (lambda: eo.adam(0.1), (0.01, 0.1)),
    "adamw": (lambda: eo.adamw(0.1, weight_decay=1e-4), (0.01, 0.1)),
}
DIM = 8
STEPS = 1500


def _quadratic_runner(name):
    """Jitted ``run(curv, center, lr) -> θ`` from θ=0; lr is traced (one compile).

    The rate is annealed to 0 with ``set_lr`` inside the loop (cosine), so that Adam's
    constant-rate oscillation of size ~lr dies out and the end point is the minimum.
    """
    tx = OPTIMIZERS[name][0]()

    @jax.jit
    def run(curv, center, lr):
        params = jnp.zeros(DIM, jnp.float32)
        state = eo.set_lr(tx.init(params), lr)

        def body(carry, t):
            p, s = carry
            s = eo.set_lr(s, lr * 0.5 * (1 + jnp.cos(jnp.pi * t / STEPS)))
            u, s = tx.update(curv * (p - center), s, p)  # ∇ ½Σ a(θ - c)²
            return (eo.apply_updates(p, u), s), None

        (p, _), _ = jax.lax.scan(
            body, (params, state), jnp.arange(STEPS, dtype=jnp.float32)
        )
        return p

    return run


RUNNERS: dict = {}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
@given(
    data=st.data(),
    seed=st.integers(0, 2**16),
)
def test_every_optimizer_minimizes_a_random_convex_quadratic(name, data, seed):
    lo, hi = OPTIMIZERS[name][1]
    lr = data.draw(st.floats(lo, hi), label="lr")
    rng = np.random.default_rng(seed)
    curv = rng.uniform(0.5, 2.0, DIM).astype(np.float32)
    center = rng.uniform(-1.0, 1.0, DIM).astype(np.float32)
    run = RUNNERS.setdefault(name, _quadratic_runner(name))
    final = np.asarray(run(curv, center, jnp.float32(lr)))
    wd_bias = 1e-4 * 1.0 / 0.5 if name == "adamw" else 0.0  # decay shifts the optimum
    np.testing.assert_allclose(final, center, atol=2e-3 + wd_bias)


# ---- frozen leaves: no update, no state ---------------------------------------


@settings(max_examples=10)
@given(mask_bits=st.lists(st.booleans(), min_size=6, max_size=6))
def test_frozen_leaves_never_change_and_hold_no_state(mask_bits):
    params0, grad_fn = problem(3)
    names = [n for n, _ in _named(params0)]
    trainable = dict(zip(names, mask_bits))
    tx = eo.freeze(eo.adamw(0.05, weight_decay=0.1), lambda n, x: trainable[n])
    state = tx.init(params0)
    n_trainable = sum(x.size for n, x in _named(params0) if trainable[n])
    # Adam keeps m and v for trainable leaves only (+ count and lr scalars).
    assert tree_size(state) == 2 * n_trainable + 2
    params = params0
    for t in range(3):
        u, state = tx.update(grad_fn(params, t), state, params)
        params = eo.apply_updates(params, u)
    for (n, p), (_, p0) in zip(_named(params), _named(params0)):
        if not trainable[n]:
            np.testing.assert_array_equal(np.asarray(p), np.asarray(p0))
        else:
            assert not np.array_equal(np.asarray(p), np.asarray(p0))


def _named(tree):
    from entrenar.tree import tree_named_leaves

    return tree_named_leaves(tree)


def test_masked_passes_through_and_freeze_zeroes():
    p = {"w": jnp.ones(2), "b": jnp.ones(2)}
    g = {"w": jnp.full(2, 3.0), "b": jnp.full(2, 3.0)}
    mask = {"w": True, "b": False}
    u, _ = eo.masked(eo.scale(2.0), mask).update(
        g, eo.masked(eo.scale(2.0), mask).init(p)
    )
    assert u["w"].tolist() == [6.0, 6.0] and u["b"].tolist() == [3.0, 3.0]
    tx = eo.freeze(eo.scale(2.0), mask)
    u, _ = tx.update(g, tx.init(p), p)
    assert u["b"].tolist() == [0.0, 0.0]


def test_bad_masks_are_clear_errors():
    p = {"w": jnp.ones(2), "b": jnp.ones(2)}
    with pytest.raises(ShapeError, match="mask"):
        eo.freeze(eo.adam(0.1), {"w": True}).init(p)
    with pytest.raises(ConfigError, match="Python bools"):
        eo.freeze(eo.adam(0.1), {"w": jnp.array([True, False]), "b": True}).init(p)


# ---- accumulation -------------------------------------------------------------


def _linear_loss(params, batch):
    x, y = batch
    pred = x @ params["w"] + params["b"]  # (B,)
    return jnp.mean((pred - y) ** 2)


@given(k=st.sampled_from([1, 2, 4, 8]))
def test_microbatched_grads_do_not_depend_on_the_split(k):
    kx, ky = jax.random.split(jax.random.key(0))
    batch = (jax.random.normal(kx, (16, 3)), jax.random.normal(ky, (16,)))
    params = {"w": jnp.array([0.5, -1.0, 2.0]), "b": jnp.float32(0.1)}
    loss, grads = jax.jit(eo.microbatched_value_and_grad(_linear_loss, k))(
        params, batch
    )
    want_loss, want = jax.value_and_grad(_linear_loss)(params, batch)
    np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-5)
    jax.tree_util.tree_map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
        grads,
        want,
    )


def test_accumulated_update_equals_one_big_batch_update():
    kx, ky = jax.random.split(jax.random.key(1))
    batch = (jax.random.normal(kx, (12, 3)), jax.random.normal(ky, (12,)))
    params = {"w": jnp.array([0.5, -1.0, 2.0]), "b": jnp.float32(0.1)}
    big = eo.adam(0.1)
    u_big, _ = big.update(jax.grad(_linear_loss)(params, batch), big.init(params))
    tx = eo.accumulate(eo.adam(0.1), 3)
    s = tx.init(params)
    for i in range(3):
        micro = jax.tree_util.tree_map(lambda x, i=i: x[4 * i : 4 * i + 4], batch)
        u, s = tx.update(jax.grad(_linear_loss)(params, micro), s)
        if i < 2:
            assert all(float(jnp.abs(x).max()) == 0.0 for x in jax.tree.leaves(u))
    jax.tree_util.tree_map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5), u, u_big
    )


def test_microbatches_weighted_by_loss_weight_equal_the_whole_batch():
    """Unequal micro-batches: weighted loss, gradient and metrics; a key for each."""
    x = jnp.asarray([1.0, 2.0, 0.0, 0.0, 3.0, 4.0, 5.0, 0.0])  # 0 = padding

    def f(w, b, *, key=None):
        n = jnp.sum(b != 0).astype(jnp.float32)
        loss = jnp.sum((b * w) ** 2) / jnp.maximum(n, 1.0)
        u = jnp.float32(0) if key is None else jax.random.uniform(key)
        return loss, {"loss_weight": n, "u": u}

    key = jax.random.key(3)
    vg = eo.microbatched_value_and_grad(f, 4, has_aux=True)
    (loss, aux), g = vg(jnp.float32(0.5), x, key=key)
    (want, _), want_g = jax.value_and_grad(f, has_aux=True)(0.5, x)
    us = [jax.random.uniform(jax.random.fold_in(key, i)) for i in range(4)]
    want_u = (2 * us[0] + 2 * us[2] + us[3]) / 5  # weights 2, 0, 2, 1
    np.testing.assert_allclose([loss, g, aux["u"]], [want, want_g, want_u], rtol=1e-6)
    assert float(aux["loss_weight"]) == 5.0


def test_microbatches_must_divide_the_batch():
    f = eo.microbatched_value_and_grad(_linear_loss, 3)
    with pytest.raises(ShapeError, match="multiple of 3"):
        f({"w": jnp.ones(3), "b": jnp.float32(0)}, (jnp.ones((4, 3)), jnp.ones(4)))


# ---- state dtype --------------------------------------------------------------


def test_bf16_moments_halve_memory_and_track_float32():
    params0, grad_fn = problem(5, noise=0.1)
    results = {}
    for dtype in (None, jnp.bfloat16):
        tx = eo.adamw(0.01, state_dtype=dtype)
        state = tx.init(params0)
        results[dtype] = state
        p = params0
        step = jax.jit(lambda p, s, t, tx=tx: tx.update(grad_fn(p, t), s, p))
        for t in range(50):
            u, state = step(p, state, t)
            p = eo.apply_updates(p, u)
        results[(dtype, "p")] = p
        results[(dtype, "s")] = state
    s16 = results[(jnp.bfloat16, "s")][0]
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves((s16.mu, s16.nu)))
    from entrenar.tree import tree_bytes

    s32 = results[(None, "s")][0]
    assert tree_bytes((s16.mu, s16.nu)) * 2 == tree_bytes((s32.mu, s32.nu))
    jax.tree_util.tree_map(
        lambda a, b: np.testing.assert_allclose(a, b, atol=2e-2),
        results[(jnp.bfloat16, "p")],
        results[(None, "p")],
    )


def test_bf16_params_take_float32_updates():
    p = {"w": jnp.ones(4, jnp.bfloat16)}
    tx = eo.adam(0.1)
    u, _ = tx.update({"w": jnp.ones(4, jnp.bfloat16)}, tx.init(p))
    new = eo.apply_updates(p, u)
    assert new["w"].dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(new["w"], np.float32), 0.9, atol=1e-2)


def test_weight_decay_needs_params():
    tx = eo.adamw(0.1)
    with pytest.raises(ConfigError, match="params"):
        tx.update(jnp.ones(2), tx.init(jnp.ones(2)))
