"""EnsembleDistiller: the mixture / averaged-logit targets against numpy."""

import jax
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from entrenar.distill import EnsembleDistiller, distillation_loss
from entrenar.errors import ConfigError, ShapeError


def np_softmax(z):
    e = np.exp(z - z.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def _logits(seed, k=3, shape=(4, 6)):
    rng = np.random.default_rng(seed)
    return [rng.normal(size=shape).astype(np.float32) * 3 for _ in range(k)]


@pytest.mark.parametrize("mode", ["probs", "logits"])
@given(st.floats(0.5, 10.0), st.integers(1, 4), st.integers(0, 1000))
def test_identical_teachers_equal_one_teacher(mode, temperature, k, seed):
    (t,) = _logits(seed, k=1)
    (s,) = _logits(seed + 1, k=1)
    y = np.arange(4) % 6
    ens = EnsembleDistiller((1.0,) * k, temperature, mode)
    np.testing.assert_allclose(
        float(ens(s, [t] * k, y, alpha=0.6)),
        float(distillation_loss(s, t, y, temperature, 0.6)),
        rtol=1e-5,
    )


def test_probs_mode_is_the_weighted_mixture():
    ts = _logits(0)
    weights, temperature = (1.0, 2.0, 5.0), 2.5
    ens = EnsembleDistiller(weights, temperature)
    got = np.asarray(jax.nn.softmax(ens.teacher_logits(ts) / temperature))
    w = np.asarray(weights) / sum(weights)
    want = sum(
        wi * np_softmax(t.astype(np.float64) / temperature) for wi, t in zip(w, ts)
    )
    np.testing.assert_allclose(got, want, rtol=1e-5)


def test_logits_mode_averages_logits():
    ts = _logits(1)
    ens = EnsembleDistiller((1.0, 1.0, 2.0), 3.0, mode="logits")
    want = (ts[0] + ts[1] + 2 * ts[2]) / 4
    np.testing.assert_allclose(np.asarray(ens.teacher_logits(ts)), want, rtol=1e-6)
    # a stacked (K, ..., C) array works like the list
    np.testing.assert_allclose(
        np.asarray(ens.teacher_logits(np.stack(ts))), want, rtol=1e-6
    )


def test_zero_weight_teacher_has_no_influence():
    ts = _logits(2)
    a = EnsembleDistiller((1.0, 0.0, 1.0), 2.0).teacher_logits(ts)
    b = EnsembleDistiller((1.0, 1.0), 2.0).teacher_logits([ts[0], ts[2]])
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_gradient_reaches_student_only():
    ts = _logits(3)
    (s,) = _logits(4, k=1)
    y = np.zeros(4, np.int32)
    ens = EnsembleDistiller((1.0, 1.0, 1.0), 2.0)
    gs, gt = jax.grad(lambda s_, t_: ens(s_, t_, y, 0.5), argnums=(0, 1))(s, ts)
    assert np.any(np.asarray(gs)) and not any(np.any(np.asarray(g)) for g in gt)


def test_errors():
    with pytest.raises(ConfigError, match="weights"):
        EnsembleDistiller((), 2.0)
    with pytest.raises(ConfigError, match="weights"):
        EnsembleDistiller((1.0, -1.0), 2.0)
    with pytest.raises(ConfigError, match="mode"):
        EnsembleDistiller((1.0,), 2.0, mode="median")
    with pytest.raises(ConfigError, match="temperature"):
        EnsembleDistiller((1.0,), 0.0)
    with pytest.raises(ShapeError, match="2 weights but got 3"):
        EnsembleDistiller((1.0, 1.0), 2.0).teacher_logits(_logits(5))
