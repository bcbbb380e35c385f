"""distillation_loss vs a numpy transcription of Hinton et al. (2015) and torch.

Also finite differences and the closed-form gradient.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from entrenar import check_gradient
from entrenar.distill import (
    DistillationLoss,
    distillation_loss,
    distillation_terms,
    soft_targets,
)
from entrenar.errors import ConfigError, ShapeError
from entrenar.nn.losses import cross_entropy, kl_divergence


def np_softmax(z):
    z = z - z.max(-1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(-1, keepdims=True)


def np_distill(s, t, y, temperature, alpha, ignore_index=-100, reduction="mean"):
    """The paper's formula, written out in float64 numpy."""
    s, t = np.asarray(s, np.float64), np.asarray(t, np.float64)
    y = np.asarray(y)
    p = np_softmax(t / temperature)
    q = np_softmax(s / temperature)
    kl = np.sum(p * (np.log(p) - np.log(q)), axis=-1)
    valid = y != ignore_index
    safe = np.where(valid, y, 0)
    ce = -np.log(np.take_along_axis(np_softmax(s), safe[..., None], -1)[..., 0])
    per = np.where(valid, alpha * temperature**2 * kl + (1 - alpha) * ce, 0.0)
    if reduction == "none":
        return per
    if reduction == "sum":
        return per.sum()
    return per.sum() / max(valid.sum(), 1)


def test_soft_targets_figures_and_the_books_erratum():
    z = jnp.array([2.0, 1.0, 0.1])
    for temperature, want in (
        (1.0, [0.659, 0.242, 0.099]),
        (3.0, [0.445, 0.319, 0.236]),
    ):
        got = [round(float(p), 3) for p in soft_targets(z, temperature)]
        assert got == want
    # softmax(z / T) keeps log(p0/p1) / log(p1/p2) = (z0-z1)/(z1-z2) = 1/0.9 at every
    # T; the book's [0.422, 0.307, 0.271] gives 2.55, so it is softmax at no T.
    book = np.array([0.422, 0.307, 0.271])
    ratio = np.log(book[0] / book[1]) / np.log(book[1] / book[2])
    assert abs(ratio - 1 / 0.9) > 1.0
    for temperature in (0.5, 1.0, 3.0, 10.0):
        p = np.asarray(soft_targets(z, temperature), np.float64)
        assert np.log(p[0] / p[1]) / np.log(p[1] / p[2]) == pytest.approx(1 / 0.9, 1e-4)


def _case(seed, shape=(3, 5, 7), ignore_some=True):
    rng = np.random.default_rng(seed)
    s = rng.normal(size=shape).astype(np.float32) * 2
    t = rng.normal(size=shape).astype(np.float32) * 2
    y = rng.integers(0, shape[-1], size=shape[:-1]).astype(np.int32)
    if ignore_some:
        y[0, :2] = -100
    return s, t, y


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize(("temperature", "alpha"), [(1.0, 0.5), (3.0, 0.9), (7.5, 0.0)])
def test_matches_numpy_transcription(reduction, temperature, alpha):
    s, t, y = _case(0)
    got = distillation_loss(s, t, y, temperature, alpha, reduction=reduction)
    want = np_distill(s, t, y, temperature, alpha, reduction=reduction)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-6)


def test_matches_torch_hinton_implementation():
    torch = pytest.importorskip("torch")
    f = torch.nn.functional
    s, t, y = _case(1, shape=(16, 10), ignore_some=False)
    temperature, alpha = 4.0, 0.7
    ts, tt, ty = torch.tensor(s), torch.tensor(t), torch.tensor(y, dtype=torch.long)
    kd = f.kl_div(
        f.log_softmax(ts / temperature, -1),
        f.softmax(tt / temperature, -1),
        reduction="batchmean",
    )
    want = alpha * temperature**2 * kd + (1 - alpha) * f.cross_entropy(ts, ty)
    got = distillation_loss(s, t, y, temperature, alpha)
    np.testing.assert_allclose(float(got), float(want), rtol=1e-5)


def test_where_mask_and_ignore_index_count_alike():
    s, t, y = _case(2, ignore_some=False)
    where = np.ones(y.shape, bool)
    where[1] = False
    y_ign = y.copy()
    y_ign[1] = -100
    a = distillation_loss(s, t, y, 2.0, 0.3, where=where)
    b = distillation_loss(s, t, y_ign, 2.0, 0.3)
    np.testing.assert_allclose(float(a), float(b), rtol=1e-6)
    # the soft term too: with alpha = 1 the ignored rows must not count
    c = distillation_loss(s, t, y_ign, 2.0, 1.0)
    d = distillation_loss(s[[0, 2]], t[[0, 2]], y[[0, 2]], 2.0, 1.0)
    np.testing.assert_allclose(float(c), float(d), rtol=1e-6)


def test_all_positions_ignored_gives_zero_not_nan():
    s, t, y = _case(3)
    y[:] = -100
    assert float(distillation_loss(s, t, y, 2.0, 0.5)) == 0.0


@given(
    st.floats(0.25, 20.0),
    st.floats(0.0, 1.0),
    st.integers(0, 2**31 - 1),
)
def test_properties_over_temperatures_and_alphas(temperature, alpha, seed):
    s, t, y = _case(seed % 1000)
    kl, ce = distillation_terms(s, t, y, temperature)
    assert float(kl) >= -1e-6  # Gibbs' inequality
    # T² scaling of the soft term, and linearity in alpha
    soft = distillation_loss(s, t, y, temperature, 1.0)
    np.testing.assert_allclose(
        float(soft),
        temperature**2 * float(kl_divergence(s, t, temperature, where=y != -100)),
        rtol=1e-5,
        atol=1e-6,
    )
    mixed = distillation_loss(s, t, y, temperature, alpha)
    np.testing.assert_allclose(
        float(mixed),
        alpha * temperature**2 * float(kl) + (1 - alpha) * float(ce),
        rtol=1e-5,
        atol=1e-6,
    )
    # alpha = 0 is the plain cross-entropy, whatever the teacher and temperature
    np.testing.assert_allclose(
        float(distillation_loss(s, t, y, temperature, 0.0)),
        float(cross_entropy(s, y)),
        rtol=1e-6,
    )
    # a student equal to its teacher has zero loss at alpha = 1
    assert abs(float(distillation_loss(t, t, y, temperature, 1.0))) < 1e-6


def _closed_form_grad(s, t, y, temperature, alpha):
    """d/ds of the mean loss: α T (q_T − p_T) + (1 − α)(softmax(s) − onehot(y))."""
    s, t = np.asarray(s, np.float64), np.asarray(t, np.float64)
    valid = y != -100
    p, q = np_softmax(t / temperature), np_softmax(s / temperature)
    onehot = np.eye(s.shape[-1])[np.where(valid, y, 0)]
    g = alpha * temperature * (q - p) + (1 - alpha) * (np_softmax(s) - onehot)
    return np.where(valid[..., None], g, 0.0) / valid.sum()


@pytest.mark.parametrize(("temperature", "alpha"), [(1.0, 0.5), (4.0, 0.8), (2.0, 1.0)])
def test_gradient_closed_form_and_naive_jax_transcription(temperature, alpha):
    s, t, y = _case(4)
    got = jax.grad(lambda s_: distillation_loss(s_, t, y, temperature, alpha))(s)
    np.testing.assert_allclose(
        np.asarray(got), _closed_form_grad(s, t, y, temperature, alpha), atol=1e-6
    )

    def naive(s_):  # the formula with plain softmax/log, no log-softmax
        valid = y != -100
        p = jax.nn.softmax(t / temperature)
        q = jax.nn.softmax(s_ / temperature)
        kl = jnp.sum(p * (jnp.log(p) - jnp.log(q)), -1)
        ce = -jnp.log(
            jnp.take_along_axis(
                jax.nn.softmax(s_), np.where(valid, y, 0)[..., None], -1
            )[..., 0]
        )
        per = alpha * temperature**2 * kl + (1 - alpha) * ce
        return jnp.sum(jnp.where(valid, per, 0.0)) / float(valid.sum())

    np.testing.assert_allclose(
        np.asarray(got), np.asarray(jax.grad(naive)(s)), rtol=1e-4, atol=1e-6
    )


def test_teacher_receives_no_gradient():
    s, t, y = _case(5)
    g = jax.grad(lambda t_: distillation_loss(s, t_, y, 2.0, 0.5))(t)
    assert not np.any(np.asarray(g))


@pytest.mark.parametrize("alpha", [0.0, 0.5, 1.0])
def test_check_gradient_finite_differences(alpha):
    s, t, y = _case(6, shape=(2, 3, 5))
    result = check_gradient(
        lambda s_: distillation_loss(s_, t, y, 2.5, alpha), [s], eps=1e-5, api="jax"
    )
    assert result, result


def test_large_logits_are_stable():
    s = np.array([[1000.0, -1000.0, 0.0]], np.float32)
    t = np.array([[-1000.0, 1000.0, 0.0]], np.float32)
    loss = distillation_loss(s, t, np.array([0]), 1.0, 0.5)
    g = jax.grad(lambda s_: distillation_loss(s_, t, np.array([0]), 1.0, 0.5))(s)
    assert np.isfinite(float(loss)) and np.all(np.isfinite(np.asarray(g)))


def test_distillation_loss_object_and_errors():
    s, t, y = _case(7)
    obj = DistillationLoss(temperature=3.0, alpha=0.25)
    np.testing.assert_allclose(
        float(obj(s, t, y)), float(distillation_loss(s, t, y, 3.0, 0.25)), rtol=1e-7
    )
    with pytest.raises(ConfigError, match="temperature"):
        DistillationLoss(temperature=0.0)
    with pytest.raises(ConfigError, match="alpha"):
        DistillationLoss(alpha=1.5)
    with pytest.raises(ConfigError, match="labels"):
        distillation_loss(s, t, None, 2.0, 0.5)
    with pytest.raises(ShapeError, match="same shape"):
        distillation_loss(s, t[..., :-1], y, 2.0, 0.5)
    # unlabelled transfer data: labels=None with alpha = 1
    np.testing.assert_allclose(
        float(distillation_loss(s, t, None, 2.0, 1.0)),
        4.0 * float(kl_divergence(s, t, 2.0)),
        rtol=1e-6,
    )


def test_jit_one_compile_and_bfloat16_logits():
    s, t, y = _case(8)
    f = jax.jit(distillation_loss, static_argnums=(3, 4))
    a = f(jnp.asarray(s, jnp.bfloat16), jnp.asarray(t, jnp.bfloat16), y, 2.0, 0.5)
    assert a.dtype == jnp.float32
    want = np_distill(
        np.asarray(jnp.asarray(s, jnp.bfloat16), np.float64),
        np.asarray(jnp.asarray(t, jnp.bfloat16), np.float64),
        y,
        2.0,
        0.5,
    )
    np.testing.assert_allclose(float(a), want, rtol=1e-5)
