"""Properties every merge must have (hypothesis), on small fixed-shape trees."""

import jax
import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from entrenar import merge
from entrenar.tree import assert_trees_allclose

seeds = st.integers(0, 2**32 - 1)
weights = st.floats(0.1, 3.0)
densities = st.floats(0.05, 1.0)


def tree(seed: int) -> dict:
    rng = np.random.default_rng(seed)
    return {
        "model": {"layers": {"w": rng.normal(size=(2, 3, 4)).astype(np.float32)}},
        "head": rng.normal(size=5).astype(np.float32),
    }


def equal(a, b):
    assert_trees_allclose(a, b, rtol=0, atol=0)


@given(seeds, st.lists(weights, min_size=2, max_size=2), densities, seeds)
def test_identical_models_give_that_model(seed, ws, density, key):
    m = tree(seed)
    equal(merge.task_arithmetic(m, [m, m], ws), m)
    equal(merge.ties(m, [m, m], density, ws), m)
    equal(merge.dare(m, [m, m], 1 - density, key=jax.random.key(key), weights=ws), m)
    equal(merge.dare(m, [m, m], 0.5, key=jax.random.key(key), ties=True), m)
    assert_trees_allclose(merge.linear([m, m], ws), m, rtol=1e-6, atol=1e-6)
    assert_trees_allclose(merge.slerp(m, m, density), m, rtol=1e-6, atol=1e-6)


@given(seeds, seeds)
def test_slerp_endpoints(seed_a, seed_b):
    a, b = tree(seed_a), tree(seed_b)
    equal(merge.slerp(a, b, 0.0), a)
    equal(merge.slerp(a, b, 1.0), b)


@given(
    seeds,
    st.lists(weights, min_size=3, max_size=3),
    st.lists(densities, min_size=3, max_size=3),
    st.permutations(range(3)),
)
def test_ties_and_task_arithmetic_ignore_model_order(seed, ws, ds, perm):
    base, models = tree(seed), [tree(seed + i + 1) for i in range(3)]
    pm = [models[i] for i in perm]
    pw = [ws[i] for i in perm]
    pd = [ds[i] for i in perm]
    tol = {"rtol": 1e-6, "atol": 1e-6}
    assert_trees_allclose(
        merge.ties(base, pm, pd, pw), merge.ties(base, models, ds, ws), **tol
    )
    assert_trees_allclose(
        merge.task_arithmetic(base, pm, pw),
        merge.task_arithmetic(base, models, ws),
        **tol,
    )


@given(seeds, st.lists(weights, min_size=2, max_size=2), st.floats(0.1, 2.0), seeds)
def test_dare_without_drop_is_task_arithmetic(seed, ws, lam, key):
    base, models = tree(seed), [tree(seed + 1), tree(seed + 2)]
    out = merge.dare(base, models, 0.0, key=jax.random.key(key), weights=ws, lam=lam)
    want = merge.task_arithmetic(base, models, ws, lam=lam)
    assert_trees_allclose(out, want, rtol=1e-6, atol=1e-6)


@given(seeds, st.floats(0.1, 0.9), seeds)
def test_same_key_same_dare(seed, p, key):
    base, models = tree(seed), [tree(seed + 1), tree(seed + 2)]
    first = merge.dare(base, models, p, key=jax.random.key(key), ties=True)
    equal(merge.dare(base, models, p, key=jax.random.key(key), ties=True), first)
    other = merge.dare(base, models, p, key=jax.random.key(key + 1), ties=True)
    assert not np.array_equal(
        other["model"]["layers"]["w"], first["model"]["layers"]["w"]
    )
