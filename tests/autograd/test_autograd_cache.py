"""The bounded program cache and the shape buckets for changing shapes (issue 20)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import entrenar.autograd as ag
from entrenar.autograd import Tensor, backward, bucket, cache, engine, ops
from entrenar.errors import ConfigError


@pytest.fixture(autouse=True)
def fresh_cache():
    engine.clear_caches()
    old = ag.set_cache_size(ag.DEFAULT_CACHE_SIZE)
    yield
    ag.set_cache_size(old)
    engine.clear_caches()


def leaf(v):
    return Tensor(np.asarray(v, np.float32), requires_grad=True)


# ---- the LRU cache -----------------------------------------------------------------
def test_program_cache_is_lru_and_bounded():
    c = cache.ProgramCache(max_size=3)
    for k in "abc":
        c.put(k, len)
    assert c.get("a") is len  # a becomes the most recently used
    c.put("d", len)  # evicts b, the least recently used
    assert c.keys() == ["c", "a", "d"]
    c.put("e", len)
    assert c.keys() == ["a", "d", "e"] and c.counts["evictions"] == 2
    c.resize(1)
    assert c.keys() == ["e"] and len(c) == 1
    c.resize(0)
    c.put("f", len)
    assert len(c) == 0 and c.get("f") is None


def chain(x, k):
    """A graph whose structure differs for each k (k multiplications)."""
    for _ in range(k):
        x = x * 1.5
    return x.sum()


def test_engine_never_holds_more_than_the_bound():
    assert ag.set_cache_size(4) == ag.DEFAULT_CACHE_SIZE
    x = leaf([1.0, 2.0])
    for k in range(1, 9):
        backward(chain(x, k))
        assert ag.cache_info().size <= 4
        np.testing.assert_allclose(x.grad, [1.5**k] * 2, rtol=1e-6)
        x.zero_grad()
    info = ag.cache_info()
    assert info.size == 4 and info.max_size == 4 and info.evictions == 4
    # the four most recent structures are the ones kept, least recent first
    kept = [len(key[1][0]) for key in cache.programs.keys()]  # instructions: k + 1
    assert kept == [6, 7, 8, 9]


def test_recently_used_program_survives_eviction():
    ag.set_cache_size(2)
    x = leaf([1.0])
    backward(chain(x, 1))
    backward(chain(x, 2))
    backward(chain(x, 1))  # a hit: chain 1 becomes the most recent
    assert ag.cache_info().hits == 1
    backward(chain(x, 3))  # evicts chain 2
    misses = ag.cache_info().misses
    backward(chain(x, 1))
    assert ag.cache_info().misses == misses  # still compiled
    backward(chain(x, 2))
    assert ag.cache_info().misses == misses + 1  # was evicted


def test_cache_size_zero_still_computes():
    ag.set_cache_size(0)
    x = leaf([2.0, 3.0])
    for _ in range(2):
        backward((x * x).sum())
    np.testing.assert_allclose(x.grad, [8.0, 12.0])
    assert ag.cache_info().size == 0


@pytest.mark.parametrize("bad", [-1, 2.5, "8", True])
def test_set_cache_size_rejects_bad_values(bad):
    with pytest.raises(ConfigError, match="non-negative int"):
        ag.set_cache_size(bad)


# ---- shape buckets -------------------------------------------------------------------
def test_bucket_sizes():
    sizes = [bucket.bucket_size(s) for s in range(1, 2000)]
    assert all(p >= s for s, p in zip(range(1, 2000), sizes))
    assert all(p <= max(16, 1.5 * s) for s, p in zip(range(3, 2000), sizes[2:]))
    assert len(set(sizes)) <= 20  # few programs for 2,000 sizes


def issue_loss(n):
    w = Tensor(np.linspace(-1, 1, n, dtype=np.float32), requires_grad=True)
    x = Tensor(np.arange(n, dtype=np.float32))
    return w, ((w * x + 1.0) * (w * x + 1.0)).sum()


def test_changing_shapes_run_in_buckets_with_exact_gradients():
    grads = {}
    for n in [1, 2, *range(3, 40, 3)]:
        w, loss = issue_loss(n)
        backward(loss)
        grads[n] = np.asarray(w.grad)
    info = ag.cache_info()
    assert info.bucketed == 13  # every size after the first two
    assert info.misses == 2 + 4  # two exact programs, buckets 16, 24, 32 and 48
    for n, g in grads.items():
        wv = np.linspace(-1, 1, n, dtype=np.float32)
        xv = np.arange(n, dtype=np.float32)
        np.testing.assert_array_equal(g, 2 * (wv * xv + 1) * xv)


def seq_step(emb, w1, b, w2, scale, ids, onehot):
    """Embedding, matmul, broadcast bias, max/exp/log, mean, transpose, division."""
    h = (emb[ids] @ w1 + b).tanh()  # (T, H)
    z = (h @ w2).T.T  # (T, V)
    m = z.max(axis=-1, keepdims=True)  # (T, 1)
    lse = (z - m).exp().sum(axis=-1, keepdims=True).log() + m
    return ((lse - z) * onehot).mean() * 3.0 + (scale / (h * h + 1.0)).sum()


def seq_step_jnp(emb, w1, b, w2, scale, ids, onehot):
    """The same function in jnp: the reference differentiated by jax.grad."""
    h = jnp.tanh(emb[ids] @ w1 + b)
    z = h @ w2
    m = z.max(axis=-1, keepdims=True)
    lse = jnp.log(jnp.exp(z - m).sum(axis=-1, keepdims=True)) + m
    return ((lse - z) * onehot).mean() * 3.0 + (scale / (h * h + 1.0)).sum()


def seq_args(t, rng):
    v, d = 5, 4
    params = [
        rng.normal(size=(v, d)).astype(np.float32),
        rng.normal(size=(d, 6)).astype(np.float32),
        rng.normal(size=(6,)).astype(np.float32),
        rng.normal(size=(6, v)).astype(np.float32),
        np.float32(0.7),  # a scalar parameter broadcast over padded axes (NaN trap)
    ]
    ids = rng.integers(0, v, t).astype(np.int32)
    return params, ids, np.eye(v, dtype=np.float32)[rng.integers(0, v, t)]


def test_bucketed_gradients_equal_exact_and_jax_grad():
    rng = np.random.default_rng(0)
    for t in [7, 9, 11, 13]:  # the first two compile exactly, 11 and 13 share a bucket
        params, ids, onehot = seq_args(t, rng)
        tensors = [leaf(p) for p in params]
        before = ag.cache_info().bucketed
        backward(seq_step(*tensors, ids, onehot))
        assert ag.cache_info().bucketed == before + (t >= 11)
        want = jax.grad(seq_step_jnp, argnums=(0, 1, 2, 3, 4))(*params, ids, onehot)
        for tensor, g in zip(tensors, want):
            np.testing.assert_allclose(tensor.grad, g, rtol=2e-5, atol=1e-6)
            assert np.isfinite(np.asarray(tensor.grad)).all()


def test_padding_never_leaks_nan_into_gradients():
    for n in [3, 4, 5, 6]:  # 5 and 6 run padded with zeros: log(0), 1/0 there
        x = leaf(np.arange(1, n + 1))
        b = leaf(2.0)
        backward((ag.log(x) + b / x).sum() * b)
        xv = np.arange(1, n + 1, dtype=np.float32)
        np.testing.assert_allclose(x.grad, 2.0 * (1 / xv - 2.0 / xv**2), rtol=1e-6)
        np.testing.assert_allclose(b.grad, np.sum(np.log(xv) + 4.0 / xv), rtol=1e-5)
    assert ag.cache_info().bucketed == 2


def test_forward_values_and_seeds_are_unpadded():
    for n in [3, 4, 5]:
        x = leaf(np.arange(n))
        y = x * 2.0 + 1.0
        np.testing.assert_array_equal(y.numpy(), 2.0 * np.arange(n) + 1.0)
        backward(y, np.ones(n, np.float32) * 3.0)
        np.testing.assert_array_equal(x.grad, np.full(n, 6.0))
    assert ag.cache_info().bucketed == 2  # n = 5: the forward and the seeded backward


def test_ops_without_padding_rule_are_compiled_exactly():
    for n in [4, 6, 8, 10]:
        x = leaf(np.arange(n))
        backward((ag.concatenate([x, x * x]) * 3.0).sum())
        np.testing.assert_array_equal(x.grad, 3.0 + 6.0 * np.arange(n))
    info = ag.cache_info()
    assert info.bucketed == 0 and info.misses == 4


def test_a_settled_shape_is_promoted_to_an_exact_program(monkeypatch):
    monkeypatch.setattr(engine, "PROMOTE_AFTER", 3)
    for n in [3, 4, 5, 5, 5, 5, 5]:
        backward(issue_loss(n)[1])
    assert ("grad", engine.build(issue_loss(5)[1], for_grad=True).key) in cache.programs
    assert ag.cache_info().bucketed == 2  # the third n = 5 in a row compiled its own


def test_no_buckets_inside_jit():
    @jax.jit
    def grad_of(w):
        t = Tensor(w, requires_grad=True)
        backward((t * t).sum())
        return t.grad

    for n in [3, 4, 5, 6]:
        np.testing.assert_allclose(grad_of(jnp.ones(n)), 2 * np.ones(n))
    assert ag.cache_info().bucketed == 0


# ---- shape inference without tracing -------------------------------------------------
SHAPES = st.lists(st.integers(1, 4), min_size=0, max_size=3).map(tuple)


@given(SHAPES, SHAPES, st.booleans())
def test_rule_shapes_match_eval_shape(a, b, keep):
    f32 = jnp.float32

    def check(op, static, *shapes):
        sigs = [ops.Aval(s, np.dtype(f32)) for s in shapes]
        rule = ops._rule_shape(op, static, sigs)
        try:
            want = ops._eval_shape(op, static, sigs).shape
        except ValueError:  # ShapeError: the rule must not accept it either
            assert rule is None
            return
        assert rule in (None, want)

    check(ops.ADD, (), a, b)
    check(ops.MATMUL, (), a, b)
    check(ops.SUM, (("axis", -1 if a else None), ("keepdims", keep)), a)
    check(ops.MAX, (("axis", None), ("keepdims", keep)), a)
    check(ops.TRANSPOSE, (("axes", None),), a)


@pytest.mark.parametrize(
    ("op", "static", "shapes", "want"),
    [
        (ops.ADD, (), [(3, 1), (4,)], (3, 4)),
        (ops.MATMUL, (), [(2, 3, 4), (4, 5)], (2, 3, 5)),
        (ops.MATMUL, (), [(3, 4), (6, 4, 5)], (6, 3, 5)),
        (ops.SUM, (("axis", None), ("keepdims", False)), [(2, 3)], ()),
        (ops.MEAN, (("axis", (0, 2)), ("keepdims", True)), [(2, 3, 4)], (1, 3, 1)),
        (ops.MAX, (("axis", -1), ("keepdims", False)), [(2, 3)], (2,)),
        (ops.GETITEM, (("spec", (("array", 0),)),), [(7, 5), (2, 3)], (2, 3, 5)),
        (ops.TRANSPOSE, (("axes", (1, 2, 0)),), [(2, 3, 4)], (3, 4, 2)),
    ],
)
def test_the_shape_rules_know_the_common_ops(op, static, shapes, want):
    # the engine infers these shapes without tracing (no jax.eval_shape per op)
    sigs = [ops.Aval(s, np.dtype(np.int32 if i else np.float32)) for i, s in
            enumerate(shapes)]  # fmt: skip
    assert ops._rule_shape(op, static, sigs) == want


def test_the_shape_rules_leave_empty_maxima_and_bad_axes_to_jax():
    f32 = np.dtype(np.float32)
    for axis in (2, -3, 0.5):
        static = (("axis", axis), ("keepdims", False))
        assert ops._rule_shape(ops.SUM, static, [ops.Aval((2, 3), f32)]) is None
    static = (("axis", 0), ("keepdims", False))
    assert ops._rule_shape(ops.MAX, static, [ops.Aval((0, 3), f32)]) is None
    assert ops._rule_shape(ops.SUM, static, [ops.Aval((0, 3), f32)]) == (3,)


def test_buckets_differentiate_whichever_input_requires_grad():
    for grad_a in (True, False):
        for n in [3, 4, 5]:  # n = 5 runs in the bucket of 16
            av, bv = np.arange(n, dtype=np.float32), np.full(n, 2.0, np.float32)
            a, b = (
                Tensor(av, requires_grad=grad_a),
                Tensor(bv, requires_grad=not grad_a),
            )
            backward((a * b * a).sum())
            got = (a if grad_a else b).grad
            np.testing.assert_array_equal(got, 2 * av * bv if grad_a else av * av)
    assert ag.cache_info().bucketed == 2


def test_a_loss_read_before_backward_is_right_in_a_bucket():
    # once a structure was differentiated, reading its loss runs forward and backward
    # in one call; in a loop of changing shapes that call runs padded (bucketed)
    for n in [3, 4, 5, 6, 7]:
        w = leaf(np.linspace(-1, 1, n))
        loss = ((w * w) * 3.0).sum()
        want = 3.0 * np.sum(np.linspace(-1, 1, n, dtype=np.float32) ** 2)
        fused = engine.stats["fused"]
        np.testing.assert_allclose(float(loss.numpy()), want, rtol=1e-6)
        assert engine.stats["fused"] == fused + (n > 3)  # one fused call per read
        backward(loss)
        np.testing.assert_allclose(w.grad, 6.0 * np.linspace(-1, 1, n), rtol=1e-6)
    assert ag.cache_info().bucketed >= 3 and engine.stats["fused"] >= 3
    assert engine.stats["compiles"] == ag.cache_info().misses  # one count, two names


def test_max_over_two_varying_axes_ignores_the_padding():
    # every value is negative, so a padded zero that leaked into the max would win
    rng = np.random.default_rng(0)
    for n in [3, 4, 5, 6, 7]:
        xv = -1.0 - rng.random((n, n + 1)).astype(np.float32)
        x = leaf(xv)
        rows = x.max(axis=1)  # (n,)
        backward((rows * 2.0).sum() + x.max())
        np.testing.assert_array_equal(rows.numpy(), xv.max(axis=1))
        want = 2.0 * (xv == xv.max(axis=1, keepdims=True)) + (xv == xv.max())
        np.testing.assert_array_equal(x.grad, want)
    assert ag.cache_info().bucketed >= 2
