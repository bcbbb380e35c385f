"""PTQ: calibration of activation ranges, and int8 PTQ of a trained MLP."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import entrenar.nn
from entrenar.errors import ConfigError
from entrenar.quant import QuantizedWeight, Range, calibrate, fake_quant_range, ptq

BATCHES = [
    np.random.default_rng(i).standard_normal((8, 32)).astype(np.float32) * (i + 1)
    for i in range(4)
]


def _acts(b):
    return {"x": b, "relu": jnp.maximum(b, 0.0)}


def test_minmax_matches_numpy():
    r = calibrate(_acts, BATCHES, method="minmax")
    allx = np.stack(BATCHES)
    assert isinstance(r["x"], Range)
    np.testing.assert_allclose([r["x"].lo, r["x"].hi], [allx.min(), allx.max()])
    np.testing.assert_allclose(r["relu"].lo, 0.0)


def test_percentile_matches_numpy():
    r = calibrate(_acts, BATCHES, method="percentile", percentile=90.0)
    lo = np.mean([np.percentile(b, 10.0) for b in BATCHES])
    hi = np.mean([np.percentile(b, 90.0) for b in BATCHES])
    np.testing.assert_allclose([r["x"].lo, r["x"].hi], [lo, hi], rtol=1e-5)


def test_moving_average_matches_recurrence():
    r = calibrate(_acts, BATCHES, method="moving_average", momentum=0.75)
    lo, hi = BATCHES[0].min(), BATCHES[0].max()
    for b in BATCHES[1:]:  # PyTorch's MovingAverageMinMaxObserver, c = 0.25
        lo, hi = lo + 0.25 * (b.min() - lo), hi + 0.25 * (b.max() - hi)
    np.testing.assert_allclose([r["x"].lo, r["x"].hi], [lo, hi], rtol=1e-6)


def test_bad_calibration_requests():
    with pytest.raises(ConfigError, match="method"):
        calibrate(_acts, BATCHES, method="kl")
    with pytest.raises(ConfigError, match="at least one batch"):
        calibrate(_acts, [])
    with pytest.raises(ConfigError, match="percentile"):
        calibrate(_acts, BATCHES, method="percentile", percentile=30.0)


# --- PTQ of a trained MLP ----------------------------------------------------------


def _data(key, n):
    kc, kx = jax.random.split(key)
    centres = jax.random.normal(jax.random.key(7), (4, 16)) * 1.2
    y = jax.random.randint(kc, (n,), 0, 4)
    return centres[y] + jax.random.normal(kx, (n, 16)), y


def _forward(p, x, ranges=None):
    """A 16-64-64-4 MLP; with ``ranges``, each layer's input is int8 fake-quantized."""
    acts = {}
    h = x
    for i in range(3):
        acts[f"in{i}"] = h
        if ranges is not None:
            r = ranges[f"in{i}"]
            h = fake_quant_range(h, r.lo, r.hi, bits=8)
        h = entrenar.nn.linear(h, p[f"w{i}"], p[f"b{i}"])
        if i < 2:
            h = jax.nn.relu(h)
    return h, acts


@functools.cache
def _trained():
    """Training data, test data and the trained float MLP (shared by the tests)."""
    x, y = _data(jax.random.key(1), 1024)
    xt, yt = _data(jax.random.key(2), 4096)
    return x, xt, yt, _train(x, y)


def _train(x, y, steps=300, lr=0.1):
    keys = jax.random.split(jax.random.key(0), 3)
    dims = [(64, 16), (64, 64), (4, 64)]
    p = {}
    for i, (k, d) in enumerate(zip(keys, dims)):
        p[f"w{i}"] = jax.random.normal(k, d) / np.sqrt(d[1])
        p[f"b{i}"] = jnp.zeros(d[0])

    def loss(p):
        logits = _forward(p, x)[0]
        return -jnp.mean(jax.nn.log_softmax(logits)[jnp.arange(len(y)), y])

    @jax.jit
    def step(p, m):
        g = jax.grad(loss)(p)
        m = jax.tree_util.tree_map(lambda m, g: 0.9 * m + g, m, g)
        return jax.tree_util.tree_map(lambda p, m: p - lr * m, p, m), m

    m = jax.tree_util.tree_map(jnp.zeros_like, p)
    for _ in range(steps):
        p, m = step(p, m)
    return p


@pytest.mark.parametrize("method", ["minmax", "percentile"])
def test_int8_ptq_of_trained_mlp_loses_under_one_point(method):
    x, xt, yt, params = _trained()
    batches = [x[i : i + 256] for i in range(0, 1024, 256)]
    qparams, ranges = ptq(
        params,
        lambda p, b: _forward(p, b)[1],
        batches,
        scheme="int8",
        method=method,
        granularity="channel",
    )
    assert all(isinstance(qparams[f"w{i}"], QuantizedWeight) for i in range(3))
    assert qparams["b0"] is params["b0"]

    def accuracy(p, r):
        logits = jax.jit(_forward)(p, xt, r)[0]
        return float(jnp.mean(jnp.argmax(logits, -1) == yt))

    acc_float = accuracy(params, None)
    acc_int8 = accuracy(qparams, ranges)
    assert acc_float > 0.8
    assert acc_int8 > acc_float - 0.01, (acc_float, acc_int8)


def test_calibration_setting_boundaries():
    batches = [jnp.array([0.0, 2.0]), jnp.array([-1.0, 4.0])]

    def fn(b):
        return {"h": b}

    # percentile in (50, 100]: 100 averages each batch's min and max; 50 is refused
    r = calibrate(fn, batches, method="percentile", percentile=100)
    assert (float(r["h"].lo), float(r["h"].hi)) == (-0.5, 3.0)
    for bad in (50, 100.5):
        with pytest.raises(ConfigError, match="percentile"):
            calibrate(fn, batches, method="percentile", percentile=bad)
    # momentum in [0, 1): 0 keeps only the last batch, 1 is refused
    r = calibrate(fn, batches, method="moving_average", momentum=0.0)
    assert (float(r["h"].lo), float(r["h"].hi)) == (-1.0, 4.0)
    with pytest.raises(ConfigError, match="momentum"):
        calibrate(fn, batches, method="moving_average", momentum=1.0)
