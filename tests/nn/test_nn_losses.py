"""entrenar.nn.losses against PyTorch's losses and float64 numpy transcriptions."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from entrenar.errors import ConfigError, ShapeError
from entrenar.nn import losses

torch = pytest.importorskip("torch")
F = torch.nn.functional

RNG = np.random.default_rng(0)


def _t(x):
    return torch.from_numpy(np.asarray(x))


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_regression_losses_match_torch(reduction):
    p = RNG.normal(size=(4, 5)).astype(np.float32) * 2
    y = RNG.normal(size=(4, 5)).astype(np.float32)
    cases = [
        (losses.mse(p, y, reduction), F.mse_loss(_t(p), _t(y), reduction=reduction)),
        (losses.l1(p, y, reduction), F.l1_loss(_t(p), _t(y), reduction=reduction)),
        (
            losses.huber(p, y, 0.7, reduction),
            F.huber_loss(_t(p), _t(y), reduction=reduction, delta=0.7),
        ),
        (
            losses.binary_cross_entropy_with_logits(p * 10, (y > 0) * 1.0, reduction),
            F.binary_cross_entropy_with_logits(
                _t(p * 10), _t((y > 0) * 1.0), reduction=reduction
            ),
        ),
    ]
    for ours, ref in cases:
        np.testing.assert_allclose(np.asarray(ours), ref.numpy(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("smoothing", [0.0, 0.2])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_cross_entropy_matches_torch_with_ignore_index(reduction, smoothing):
    logits = RNG.normal(size=(3, 4, 7)).astype(np.float32) * 3
    targets = RNG.integers(0, 7, size=(3, 4))
    targets[0, 1] = targets[2, 3] = -100
    ours = losses.cross_entropy(
        logits, jnp.asarray(targets), reduction, label_smoothing=smoothing
    )
    ref = F.cross_entropy(
        _t(logits).permute(0, 2, 1),
        _t(targets),
        reduction=reduction,
        label_smoothing=smoothing,
    )
    np.testing.assert_allclose(np.asarray(ours), ref.numpy(), rtol=1e-5, atol=1e-6)


def test_cross_entropy_where_equals_ignore_index():
    logits = RNG.normal(size=(5, 6)).astype(np.float32)
    targets = jnp.asarray(RNG.integers(0, 6, size=5))
    keep = jnp.array([True, False, True, True, False])
    by_where = losses.cross_entropy(logits, targets, where=keep)
    by_index = losses.cross_entropy(logits, jnp.where(keep, targets, -100))
    np.testing.assert_allclose(by_where, by_index, rtol=1e-6)
    assert float(losses.cross_entropy(logits, jnp.full(5, -100))) == 0.0


def test_causal_lm_loss_is_shifted_masked_mean_in_float64():
    logits = RNG.normal(size=(2, 5, 9))
    labels = RNG.integers(0, 9, size=(2, 5))
    labels[1, 2] = -100
    mask = np.ones((2, 5), bool)
    mask[0, 4] = False
    # Reference: position t predicts labels[t+1]; skip -100 and mask False.
    total, count = 0.0, 0
    for b in range(2):
        for t in range(4):
            y = labels[b, t + 1]
            if y == -100 or not mask[b, t + 1]:
                continue
            z = logits[b, t]
            total += np.log(np.exp(z - z.max()).sum()) + z.max() - z[y]
            count += 1
    with jax.enable_x64():
        ours = losses.causal_lm_loss(
            jnp.asarray(logits), jnp.asarray(labels), loss_mask=jnp.asarray(mask)
        )
        assert ours.dtype == jnp.float64
        np.testing.assert_allclose(float(ours), total / count, rtol=1e-12)


def test_causal_lm_loss_bfloat16_logits_compute_in_float32():
    logits = jnp.asarray(RNG.normal(size=(1, 4, 6)), jnp.bfloat16)
    labels = jnp.array([[1, 2, 3, 4]])
    out = losses.causal_lm_loss(logits, labels)
    assert out.dtype == jnp.float32
    ref = losses.causal_lm_loss(logits.astype(jnp.float32), labels)
    np.testing.assert_allclose(out, ref, rtol=1e-6)


def test_kl_divergence_matches_torch_and_hinton_figures():
    s = RNG.normal(size=(3, 5)).astype(np.float32)
    t = RNG.normal(size=(3, 5)).astype(np.float32)
    for temp in (1.0, 3.0):
        ours = losses.kl_divergence(s, t, temp)
        ref = F.kl_div(
            F.log_softmax(_t(s) / temp, -1),
            F.log_softmax(_t(t) / temp, -1),
            reduction="batchmean",
            log_target=True,
        )
        np.testing.assert_allclose(float(ours), float(ref), rtol=1e-5)
    assert float(losses.kl_divergence(s, s, 2.0)) == 0.0


@settings(max_examples=30, deadline=None)
@given(
    temp=st.floats(0.2, 10.0),
    seed=st.integers(0, 2**16),
)
def test_kl_is_nonnegative_and_zero_only_at_equality(temp, seed):
    r = np.random.default_rng(seed)
    s, t = r.normal(size=(2, 6)) * 3, r.normal(size=(2, 6)) * 3
    kl = float(losses.kl_divergence(s, t, temp))
    assert kl >= -1e-6
    assert float(losses.kl_divergence(s, s + 5.0, temp)) == pytest.approx(0, abs=1e-5)


def test_gradients_match_finite_differences():
    from entrenar import check_gradient

    logits = RNG.normal(size=(2, 3, 5))
    labels = jnp.asarray(RNG.integers(0, 5, size=(2, 3)))
    teacher = RNG.normal(size=(2, 3, 5))
    y = RNG.normal(size=(2, 3, 5))
    fns = {
        "causal_lm": lambda z: losses.causal_lm_loss(z, labels),
        "kl": lambda z: losses.kl_divergence(z, jnp.asarray(teacher), 2.0),
        "huber": lambda z: losses.huber(z, jnp.asarray(y), 0.5),
        "bce": lambda z: losses.binary_cross_entropy_with_logits(
            z, jnp.asarray(y > 0, z.dtype)
        ),
    }
    for name, fn in fns.items():
        result = check_gradient(fn, [jnp.asarray(logits)], api="jax")
        assert result.passed, (name, result)


def test_bad_arguments_name_the_problem():
    with pytest.raises(ShapeError, match="targets"):
        losses.cross_entropy(jnp.zeros((2, 3)), jnp.zeros((3,), jnp.int32))
    with pytest.raises(ShapeError, match="integers"):
        losses.cross_entropy(jnp.zeros((2, 3)), jnp.zeros((2,)))
    with pytest.raises(ShapeError, match=r"labels \(B, T\)"):
        losses.causal_lm_loss(jnp.zeros((2, 3, 4)), jnp.zeros((2, 4), jnp.int32))
    with pytest.raises(ConfigError, match="reduction"):
        losses.mse(jnp.zeros(2), jnp.zeros(2), "avg")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="temperature"):
        losses.kl_divergence(jnp.zeros(2), jnp.zeros(2), 0.0)
    with pytest.raises(ConfigError, match="delta"):
        losses.huber(jnp.zeros(2), jnp.zeros(2), -1.0)


def test_defaults_are_the_documented_ones():
    p = RNG.normal(size=(3, 4)).astype(np.float32) * 3
    y = RNG.normal(size=(3, 4)).astype(np.float32)
    # reduction="mean" by default; huber's delta 1 is smooth L1; KL at T = 1
    assert float(losses.mse(p, y)) == pytest.approx(float(losses.mse(p, y, "mean")))
    assert float(losses.l1(p, y)) == pytest.approx(float(F.l1_loss(_t(p), _t(y))))
    assert float(losses.huber(p, y)) == pytest.approx(
        float(F.smooth_l1_loss(_t(p), _t(y))), rel=1e-6
    )
    assert float(losses.kl_divergence(p, y)) == pytest.approx(
        float(losses.kl_divergence(p, y, 1.0))
    )
    assert float(losses.kl_divergence(p, y)) != pytest.approx(
        float(losses.kl_divergence(p, y, 2.0))
    )


@pytest.mark.parametrize("name", ["mse", "l1", "huber", "bce"])
def test_where_keeps_only_the_selected_entries(name):
    p = RNG.normal(size=(4, 5)).astype(np.float32) * 2
    y = (RNG.normal(size=(4, 5)) > 0).astype(np.float32)
    keep = RNG.random(size=(4, 5)) < 0.6
    fn = {
        "mse": losses.mse,
        "l1": losses.l1,
        "huber": losses.huber,
        "bce": losses.binary_cross_entropy_with_logits,
    }[name]
    full = np.asarray(fn(p, y, reduction="none"))
    # the mean over the kept entries only, and masked entries zeroed under "none"
    assert float(fn(p, y, where=keep)) == pytest.approx(full[keep].mean(), rel=1e-5)
    assert float(fn(p, y, reduction="sum", where=keep)) == pytest.approx(
        full[keep].sum(), rel=1e-5
    )
    np.testing.assert_array_equal(
        np.asarray(fn(p, y, reduction="none", where=keep)), np.where(keep, full, 0.0)
    )


def test_huber_delta_must_be_positive_and_kl_shapes_must_agree():
    with pytest.raises(ConfigError, match=r"^huber delta must be > 0, got 0.0$"):
        losses.huber(jnp.zeros(2), jnp.zeros(2), 0.0)
    with pytest.raises(
        ShapeError,
        match=r"^student logits \(2, 3\) and teacher logits \(2, 4\) must have",
    ):
        losses.kl_divergence(jnp.zeros((2, 3)), jnp.zeros((2, 4)))


def test_mean_over_a_single_kept_entry_is_that_entry():
    values = jnp.array([4.0, 7.0, 9.0])
    only = jnp.array([False, True, False])
    assert float(losses.reduce_loss(values, where=only)) == 7.0
    assert float(losses.reduce_loss(values, where=jnp.zeros(3, bool))) == 0.0


def test_kl_with_a_teacher_probability_that_underflows_to_zero():
    # p = softmax([0, -1e4]) = [1, 0] exactly: the p = 0 term contributes 0, not NaN
    student = jnp.array([[0.3, -0.2]])
    teacher = jnp.array([[0.0, -1e4]])
    expected = -float(jax.nn.log_softmax(student)[0, 0])
    assert float(losses.kl_divergence(student, teacher)) == pytest.approx(expected)


def test_label_smoothing_must_be_below_one_and_messages_name_the_shapes():
    with pytest.raises(
        ConfigError, match=r"^label_smoothing must be in \[0, 1\), got 1"
    ):
        losses.cross_entropy(
            jnp.zeros((2, 3)), jnp.zeros((2,), jnp.int32), label_smoothing=1.0
        )
    with pytest.raises(
        ShapeError,
        match=r"^targets \(2, 5\) must equal logits' shape without its class axis "
        r"\(2, 4\) \(logits \(2, 4, 3\)\)$",
    ):
        losses.cross_entropy(jnp.zeros((2, 4, 3)), jnp.zeros((2, 5), jnp.int32))
