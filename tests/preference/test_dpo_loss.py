"""DPO's loss types equal the papers' formulas written in numpy; gradients check.

The numpy side is written from the papers (Rafailov et al. 2023 eq. 7; Azar et al.
2023 eq. 17 with TRL's per-token normalisation; Mitchell's cDPO; Chowdhury et al.
2024; SLiC's hinge; ...), in float64 with its own log-sigmoid, never from
entrenar's code.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from entrenar.errors import ConfigError, ShapeError
from entrenar.preference import LOSS_TYPES, dpo_loss


def logsig(x):
    return -np.logaddexp(0.0, -x)


def sig(x):
    return 1.0 / (1.0 + np.exp(-x))


def paper(kind, b, eps, pc, pr, rc, rr, nc, nr):
    """The per-pair loss of each variant, from its paper (float64)."""
    u, v = pc - rc, pr - rr  # log-ratios
    z = b * (u - v)
    if kind == "sigmoid":
        return -(1 - eps) * logsig(z) - eps * logsig(-z)
    if kind == "robust":
        return ((1 - eps) * -logsig(z) - eps * -logsig(-z)) / (1 - 2 * eps)
    if kind == "hinge":
        return np.maximum(0.0, 1 - z)
    if kind == "ipo":
        return (u / nc - v / nr - 1 / (2 * b)) ** 2
    if kind == "sigmoid_norm":
        return -logsig(b * (u / nc - v / nr))
    if kind == "bco_pair":
        return -logsig(b * u) - logsig(-b * v)
    if kind == "nca_pair":
        return -logsig(b * u) - 0.5 * logsig(-b * u) - 0.5 * logsig(-b * v)
    if kind == "sppo_hard":
        return (u - 1 / (2 * b)) ** 2 + (v + 1 / (2 * b)) ** 2
    if kind == "apo_zero":
        return (1 - sig(b * u)) + sig(b * v)
    if kind == "apo_down":
        return sig(b * u) + (1 - sig(b * (u - v)))
    if kind == "exo_pair":  # KL(softmax over {c, r} of β·ratios ‖ (1 − ε, ε))
        q = np.stack([sig(z), sig(-z)])
        p = np.stack([np.full_like(z, 1 - eps), np.full_like(z, eps)])
        return np.sum(q * (np.log(q) - np.log(p)), axis=0)
    raise AssertionError(kind)


def eps_for(kind):
    return {"sigmoid": 0.1, "robust": 0.2, "exo_pair": 1e-3}.get(kind, 0.0)


def sample(seed, n=5):
    rng = np.random.default_rng(seed)
    pc, pr = rng.normal(-20, 6, n), rng.normal(-20, 6, n)
    rc, rr = pc + rng.normal(0, 2, n), pr + rng.normal(0, 2, n)
    nc, nr = rng.integers(1, 30, n).astype(float), rng.integers(1, 30, n).astype(float)
    return pc, pr, rc, rr, nc, nr


def ours(kind, b, eps, pc, pr, rc, rr, nc, nr):
    f = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
    return dpo_loss(
        f(pc), f(pr), f(rc), f(rr), beta=b, loss_type=kind, label_smoothing=eps,
        chosen_tokens=f(nc), rejected_tokens=f(nr),
    )  # fmt: skip


@pytest.mark.parametrize("kind", LOSS_TYPES)
def test_each_loss_type_is_its_papers_formula(kind):
    for seed, b in [(0, 0.1), (1, 0.5), (2, 2.0)]:
        x = sample(seed)
        eps = eps_for(kind)
        loss, _ = ours(kind, b, eps, *x)
        want = np.mean(paper(kind, b, eps, *x))
        np.testing.assert_allclose(float(loss), want, rtol=2e-5, atol=1e-6)


def test_cdpo_without_smoothing_is_dpo_and_the_metrics_are_trls():
    pc, pr, rc, rr, nc, nr = sample(3, n=6)
    b = 0.3
    loss, m = ours("sigmoid", b, 0.0, pc, pr, rc, rr, nc, nr)
    np.testing.assert_allclose(
        float(loss), np.mean(-logsig(b * ((pc - rc) - (pr - rr)))), rtol=1e-5
    )
    want = {
        "rewards/chosen": np.mean(b * (pc - rc)),
        "rewards/rejected": np.mean(b * (pr - rr)),
        "rewards/accuracies": np.mean(b * (pc - rc) > b * (pr - rr)),
        "rewards/margins": np.mean(b * (pc - rc) - b * (pr - rr)),
        "logps/chosen": np.mean(pc),
        "logps/rejected": np.mean(pr),
    }  # fmt: skip
    assert set(m) == set(want)
    for k, v in want.items():
        np.testing.assert_allclose(float(m[k]), v, rtol=1e-5, atol=1e-6, err_msg=k)


@pytest.mark.parametrize("kind", LOSS_TYPES)
def test_gradient_matches_finite_differences(kind):
    """Gradients w.r.t. the policy log-probs (float64) equal central differences."""
    jax.config.update("jax_enable_x64", True)
    try:
        pc, pr, rc, rr, nc, nr = sample(4, n=3)
        eps, b = eps_for(kind), 0.4

        def f(p):
            loss, _ = dpo_loss(p[:3], p[3:], jnp.asarray(rc), jnp.asarray(rr), beta=b,
                               loss_type=kind, label_smoothing=eps,
                               chosen_tokens=jnp.asarray(nc),
                               rejected_tokens=jnp.asarray(nr))  # fmt: skip
            return loss

        p = jnp.asarray(np.concatenate([pc, pr]))
        g = np.asarray(jax.grad(f)(p))
        h = 1e-6
        fd = np.array([
            (float(f(p.at[i].add(h))) - float(f(p.at[i].add(-h)))) / (2 * h)
            for i in range(6)
        ])  # fmt: skip
        np.testing.assert_allclose(g, fd, rtol=1e-5, atol=1e-8)

        # and no gradient reaches the reference
        def f_ref(r):
            return dpo_loss(p[:3], p[3:], r, jnp.asarray(rr), beta=b, loss_type=kind,
                            label_smoothing=eps, chosen_tokens=jnp.asarray(nc),
                            rejected_tokens=jnp.asarray(nr))[0]  # fmt: skip

        gr = jax.grad(f_ref)(jnp.asarray(rc))
        assert not np.any(np.asarray(gr))
    finally:
        jax.config.update("jax_enable_x64", False)


@settings(max_examples=25, deadline=None)
@given(
    beta=st.floats(0.01, 5.0),
    delta=st.floats(-50, 50).filter(lambda d: d == 0 or abs(d) > 1e-3),
)
def test_dpo_loss_is_softplus_of_minus_beta_delta(beta, delta):
    """One pair: −log σ(βΔ) = softplus(−βΔ), positive, decreasing in Δ."""
    loss, m = dpo_loss(jnp.array([delta]), jnp.array([0.0]), jnp.array([0.0]),
                       jnp.array([0.0]), beta=beta)  # fmt: skip
    np.testing.assert_allclose(
        float(loss), np.logaddexp(0, -beta * delta), rtol=1e-5, atol=1e-6
    )
    assert float(m["rewards/accuracies"]) == float(delta * beta > 0)


def test_bad_settings_are_named():
    one = jnp.zeros(2)
    with pytest.raises(ConfigError, match="loss_type 'dpo'"):
        dpo_loss(one, one, one, one, loss_type="dpo")
    with pytest.raises(ConfigError, match="beta must be > 0"):
        dpo_loss(one, one, one, one, beta=0.0)
    with pytest.raises(ConfigError, match="label_smoothing is read by"):
        dpo_loss(one, one, one, one, loss_type="hinge", label_smoothing=0.1)
    with pytest.raises(ConfigError, match=r"\[0, 0.5\)"):
        dpo_loss(one, one, one, one, label_smoothing=0.5)
    with pytest.raises(ShapeError, match="needs the completions' lengths"):
        dpo_loss(one, one, one, one, loss_type="ipo")
    with pytest.raises(ShapeError, match=r"\(B,\) log-probabilities"):
        dpo_loss(jnp.zeros((2, 3)), jnp.zeros((2, 3)), one, one)
