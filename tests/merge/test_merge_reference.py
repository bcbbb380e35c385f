"""Each method against a numpy transcription of its paper, leaf by leaf, to 1e-6."""

import jax
import np_merge
import numpy as np
import pytest
from merge_helpers import finetuned, leaves, make_tree

from entrenar import merge
from entrenar.merge.engine import leaf_key
from entrenar.tree import assert_trees_allclose

TOL = {"rtol": 1e-6, "atol": 1e-6}


@pytest.fixture(scope="module")
def trees():
    base = make_tree(0)
    return base, [finetuned(base, s) for s in (1, 2, 3)]


def _check(out, base, models, fn, *args, **kw):
    got = leaves(out)
    ms = [leaves(m) for m in models]
    for name, b in leaves(base).items():
        want = np_merge.by_layer(fn, name, b, [m[name] for m in ms], *args, **kw)
        np.testing.assert_allclose(np.asarray(got[name]), want, **TOL, err_msg=name)
        assert got[name].dtype == b.dtype


@pytest.mark.parametrize("normalize", [True, False])
def test_ties_matches_paper(trees, normalize):
    base, models = trees
    density, weights = [0.3, 0.5, 0.9], [1.0, 0.5, 2.0]
    out = merge.ties(base, models, density, weights, lam=0.8, normalize=normalize)
    _check(out, base, models, np_merge.ties, density, weights, 0.8, normalize)


def test_ties_unweighted_is_the_paper(trees):
    base, models = trees
    out = merge.ties(base, models, 0.2)
    _check(out, base, models, np_merge.ties, [0.2] * 3, [1.0] * 3)


def test_task_arithmetic_matches_paper(trees):
    base, models = trees
    out = merge.task_arithmetic(base, models, [0.3, 0.3, 0.4], lam=1.5)
    _check(out, base, models, np_merge.task_arithmetic, [0.3, 0.3, 0.4], 1.5)


@pytest.mark.parametrize(
    ("use_ties", "rescale"), [(False, True), (True, True), (False, False)]
)
def test_dare_matches_paper_with_documented_masks(use_ties, rescale):
    rng = np.random.default_rng(0)
    base = {"model": {"layers": {"w": rng.normal(size=(3, 4, 6)).astype(np.float32)}}}
    base["b"] = rng.normal(size=7).astype(np.float32)
    models = [finetuned(base, s) for s in (1, 2, 3)]
    key, rates, weights = jax.random.key(7), [0.5, 0.3, 0.9], [1.0, 2.0, 0.5]
    out = merge.dare(
        base, models, rates, key=key, weights=weights, ties=use_ties, rescale=rescale
    )
    got, ms = leaves(out), [leaves(m) for m in models]
    for name, b in leaves(base).items():
        # The documented key: fold_in(fold_in(key, crc32(name)), i).
        keys = leaf_key(key, name, 3)
        masks = [
            np.asarray(jax.random.bernoulli(keys[i], 1 - p, b.shape))
            for i, p in enumerate(rates)
        ]
        thetas = [m[name] for m in ms]
        want = np_merge.dare(
            b, thetas, masks, rates, weights, ties=use_ties, rescale=rescale
        )
        np.testing.assert_allclose(np.asarray(got[name]), want, **TOL, err_msg=name)
        assert 0 < sum(m.sum() for m in masks) < 3 * b.size  # something dropped


def test_dare_drops_the_stated_fraction_and_keeps_the_mean():
    base = {"w": np.zeros(200_000, np.float32)}
    ft = {"w": np.ones(200_000, np.float32)}
    out = np.asarray(merge.dare(base, [ft], 0.7, key=jax.random.key(3))["w"])
    kept = out != 0
    assert abs(kept.mean() - 0.3) < 0.005
    np.testing.assert_allclose(out[kept], 1 / 0.3, rtol=1e-6)
    assert abs(out.mean() - 1.0) < 0.02  # E[m tau / (1 - p)] = tau


@pytest.mark.parametrize("t", [0.0, 0.25, 0.5, 1.0])
def test_slerp_matches_shoemake(trees, t):
    _, models = trees
    a, b = models[0], models[1]
    out = merge.slerp(a, b, t)
    got, la, lb = leaves(out), leaves(a), leaves(b)
    for name, x in la.items():
        if ".layers." in f".{name}.":
            want = np.stack([np_merge.slerp(x[i], lb[name][i], t) for i in range(3)])
        else:
            want = np_merge.slerp(x, lb[name], t)
        np.testing.assert_allclose(np.asarray(got[name]), want, **TOL, err_msg=name)


def test_slerp_schedule_is_interpolated_over_depth(trees):
    _, models = trees
    a, b = leaves(models[0]), leaves(models[1])
    schedule = [0.0, 1.0, 0.2]  # layers at depth 0, 0.5, 1 -> t = 0, 1, 0.2
    out = leaves(merge.slerp(models[0], models[1], schedule))
    name = "model.layers.up_proj.weight"
    for i, t in enumerate([0.0, 1.0, 0.2]):
        want = np_merge.slerp(a[name][i], b[name][i], t)
        np.testing.assert_allclose(np.asarray(out[name][i]), want, **TOL)
    # Tensors outside the layers take the schedule's first value (mergekit's rule).
    np.testing.assert_array_equal(out["lm_head.weight"], a["lm_head.weight"])


def test_slerp_falls_back_to_linear():
    a = {"w": np.array([1.0, 2.0, 3.0], np.float32)}
    colinear = {"w": np.array([2.0, 4.0, 6.0001], np.float32)}
    zero = {"w": np.zeros(3, np.float32)}
    for b in (colinear, zero):
        got = np.asarray(merge.slerp(a, b, 0.3)["w"])
        want = 0.7 * a["w"].astype(np.float64) + 0.3 * b["w"]
        np.testing.assert_allclose(got, want, **TOL)


@pytest.mark.parametrize("normalize", [True, False])
def test_linear_matches_soup(trees, normalize):
    _, models = trees
    out = merge.linear(models, [0.2, 0.3, 0.5], normalize=normalize)
    got, ms = leaves(out), [leaves(m) for m in models]
    for name in got:
        want = np_merge.linear([m[name] for m in ms], [0.2, 0.3, 0.5], normalize)
        np.testing.assert_allclose(np.asarray(got[name]), want, **TOL, err_msg=name)


def test_per_leaf_programs_are_jitted_once_per_shape(trees):
    base, models = trees
    from entrenar.merge import kernels

    merge.ties(base, models, 0.5)
    before = kernels.merged_task_vector._cache_size()
    merge.ties(base, [finetuned(base, 9), *models[1:]], [0.4, 0.6, 0.1])
    assert kernels.merged_task_vector._cache_size() == before


def test_trim_keeps_the_k_largest_magnitudes_and_their_ties():
    import jax.numpy as jnp

    from entrenar.merge.kernels import trim_top_k

    rng = np.random.default_rng(5)
    x = rng.normal(size=(3, 1000)).astype(np.float32)
    x[0, :10] = [
        30,
        -30,
        30,
        0,
        -0.0,
        1e-40,
        -1e-40,
        9,
        9,
        -9,
    ]  # ties, zeros, subnormals
    for k in ([1, 0, 1000], [3, 500, 999], [5, 17, 2]):
        got = np.asarray(trim_top_k(jnp.asarray(x), jnp.asarray(k, jnp.int32)))
        for row, kk in zip(range(3), k):
            mag = np.abs(x[row])
            kth = np.sort(mag)[::-1][kk - 1] if kk else np.inf
            want = np.where(mag >= kth, x[row], 0)
            np.testing.assert_array_equal(got[row], want)
    # Three values tie at |30| for k = 1: all three are kept (the paper's rule).
    got = trim_top_k(jnp.asarray(x[:1]), jnp.asarray([1], jnp.int32))
    assert int(np.count_nonzero(got)) == 3


def test_methods_trace_under_jit(trees):
    base, models = trees
    a, b = models[0], models[1]
    key = jax.random.key(1)

    @jax.jit
    def all_methods(base, a, b):
        return (
            merge.ties(base, [a, b], 0.4, [1.0, 2.0]),
            merge.dare(base, [a, b], 0.5, key=key, ties=True),
            merge.slerp(a, b, [0.0, 0.3, 1.0]),
            merge.linear([a, b], [1.0, 3.0]),
        )

    eager = (
        merge.ties(base, [a, b], 0.4, [1.0, 2.0]),
        merge.dare(base, [a, b], 0.5, key=key, ties=True),
        merge.slerp(a, b, [0.0, 0.3, 1.0]),
        merge.linear([a, b], [1.0, 3.0]),
    )
    for got, want in zip(all_methods(base, a, b), eager):
        assert_trees_allclose(got, want, rtol=1e-6, atol=1e-6)
