"""GRPO's advantages and loss types equal the paper's / TRL's formulas in numpy.

The numpy side is written from Shao et al. 2024 (eqs. 3-4: group-normalised
advantages, the PPO-clipped surrogate, the k3 KL estimate) and the aggregations
TRL 1.16 documents for ``loss_type`` (Liu et al. 2025's Dr. GRPO, Yu et al.
2025's DAPO token mean), in float64 with per-token loops, never from entrenar's
code.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from entrenar.errors import ConfigError, ShapeError
from entrenar.preference import GRPO_LOSS_TYPES, group_advantages, grpo_loss


def paper_advantages(r, g, scale):
    """Per completion: (r − group mean) / (std + 1e-4), std with Bessel's n − 1."""
    out = []
    for i, ri in enumerate(r):
        group = r[(i // g) * g : (i // g + 1) * g]
        mean = sum(group) / g
        pool = r if scale == "batch" else group
        mu = sum(pool) / len(pool)
        std = (sum((x - mu) ** 2 for x in pool) / (len(pool) - 1)) ** 0.5
        out.append(ri - mean if scale == "none" else (ri - mean) / (std + 1e-4))
    return np.array(out)


def paper_loss(
    kind, lp, old, ref, adv, mask, beta, el, eh, lmax, n_items=None, corrected=True
):
    """Per token −min(ρA, clip(ρ)A) + β ρ(e^d − d − 1), aggregated per loss type.

    ``corrected``: the k3 term weighted by ρ (DeepSeek-V3.2), else plain.
    """
    b, t = lp.shape
    per = np.zeros((b, t))
    for i in range(b):
        for j in range(t):
            rho = np.exp(lp[i, j] - old[i, j])
            rho_c = min(max(rho, 1 - el), 1 + eh)
            per[i, j] = -min(rho * adv[i], rho_c * adv[i])
            if beta:
                d = ref[i, j] - lp[i, j]
                per[i, j] += beta * (np.exp(d) - d - 1) * (rho if corrected else 1.0)
    if kind == "grpo":
        return np.mean(
            [(per[i] * mask[i]).sum() / max(mask[i].sum(), 1) for i in range(b)]
        )
    if kind == "bnpo":
        return (per * mask).sum() / mask.sum()
    if kind == "dr_grpo":
        return (per * mask).sum() / (b * lmax)
    return (per * mask).sum() / (mask.sum() if n_items is None else n_items)


def sample(seed, b=6, t=5):
    rng = np.random.default_rng(seed)
    lp = -rng.uniform(0.1, 3.0, (b, t))
    old = lp + rng.normal(0, 0.3, (b, t))  # ratios around 1, some clipped
    ref = lp + rng.normal(0, 0.5, (b, t))
    adv = rng.normal(0, 1, b)
    lengths = rng.integers(1, t + 1, b)
    mask = (np.arange(t)[None] < lengths[:, None]).astype(np.float64)
    return lp, old, ref, adv, mask


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_advantages_are_the_papers(scale):
    r = np.random.default_rng(1).normal(size=12)
    r[4:8] = 0.5  # a group with no spread: advantage 0, counted in frac_zero_std
    adv, m = group_advantages(r, 4, scale)
    np.testing.assert_allclose(adv, paper_advantages(list(r), 4, scale), rtol=1e-12)
    assert m["reward"] == pytest.approx(r.mean())
    assert m["reward_std"] == pytest.approx(np.std(r, ddof=1))
    assert m["frac_reward_zero_std"] == (0.0 if scale == "batch" else 1 / 3)


def test_unscorable_completions_are_left_out_and_get_no_advantage():
    """TRL: a completion no reward function scored (NaN) gets no advantage.

    It is left out of its group's mean and std (``nanmean``, ``nanstd``).
    """
    r = np.array([1.0, np.nan, 0.0, 2.0, 0.5, 0.5, 0.5, 0.5])
    adv, m = group_advantages(r, 4)
    want = paper_advantages([1.0, 0.0, 2.0], 3, "group")
    np.testing.assert_allclose(adv[[0, 2, 3]], want, rtol=1e-12)
    assert adv[1] == 0.0 and not np.any(adv[4:])
    assert m["reward"] == pytest.approx(np.nanmean(r))
    assert m["frac_reward_zero_std"] == 0.5


@pytest.mark.parametrize("kind", GRPO_LOSS_TYPES)
@pytest.mark.parametrize(
    ("beta", "corrected"), [(0.0, True), (0.04, True), (0.04, False)]
)
def test_loss_and_metrics_are_the_papers(kind, beta, corrected):
    jax.config.update("jax_enable_x64", True)
    try:
        lp, old, ref, adv, mask = sample(0)
        el, eh = 0.2, 0.28
        loss, m = grpo_loss(
            jnp.asarray(lp), jnp.asarray(old), jnp.asarray(ref), jnp.asarray(adv),
            jnp.asarray(mask), beta=beta, epsilon=el, epsilon_high=eh,
            loss_type=kind, max_completion_length=7, use_bias_correction_kl=corrected,
        )  # fmt: skip
        want = paper_loss(
            kind, lp, old, ref, adv, mask, beta, el, eh, 7, corrected=corrected
        )
        np.testing.assert_allclose(float(loss), want, rtol=1e-12)
        rho = np.exp(lp - old)
        low = (rho < 1 - el) & (adv[:, None] < 0)
        high = (rho > 1 + eh) & (adv[:, None] > 0)
        tok = lambda x: (x * mask).sum() / mask.sum()  # noqa: E731
        seq = (low * mask).sum(1) / mask.sum(1), (high * mask).sum(1) / mask.sum(1)
        want_m = {
            "clip_ratio/low_mean": tok(low), "clip_ratio/high_mean": tok(high),
            "clip_ratio/region_mean": tok(low | high),
            "clip_ratio/low_min": seq[0].min(), "clip_ratio/high_max": seq[1].max(),
        }  # fmt: skip
        if beta:
            d = ref - lp
            want_m["kl"] = tok((np.exp(d) - d - 1) * (rho if corrected else 1.0))
        assert set(m) == set(want_m)
        assert 0 < want_m["clip_ratio/region_mean"] < 1  # the sample clips some
        for k, v in want_m.items():
            np.testing.assert_allclose(float(m[k]), v, rtol=1e-12, err_msg=k)
    finally:
        jax.config.update("jax_enable_x64", False)


@pytest.mark.parametrize("kind", GRPO_LOSS_TYPES)
def test_gradient_matches_finite_differences(kind):
    """D loss / d logps (float64) equals central differences; none reaches old/ref."""
    jax.config.update("jax_enable_x64", True)
    try:
        lp, old, ref, adv, mask = sample(3, b=3, t=4)

        old_j, ref_j = jnp.asarray(old), jnp.asarray(ref)

        def f(x, o=old_j, r=ref_j):
            return grpo_loss(x, o, r, jnp.asarray(adv), jnp.asarray(mask), beta=0.1,
                             loss_type=kind, max_completion_length=5)[0]  # fmt: skip

        x = jnp.asarray(lp)
        g = np.asarray(jax.grad(f)(x))
        h = 1e-6
        fd = np.zeros_like(lp)
        for i in np.ndindex(lp.shape):
            fd[i] = (float(f(x.at[i].add(h))) - float(f(x.at[i].add(-h)))) / (2 * h)
        np.testing.assert_allclose(g, fd, rtol=1e-5, atol=1e-9)
        assert not np.any(g[mask == 0])  # padding gets no gradient
        assert not np.any(np.asarray(jax.grad(lambda o: f(x, o))(jnp.asarray(old))))
        assert not np.any(
            np.asarray(jax.grad(lambda r: f(x, jnp.asarray(old), r))(jnp.asarray(ref)))
        )
    finally:
        jax.config.update("jax_enable_x64", False)


@settings(max_examples=25, deadline=None)
@given(adv=st.floats(-5, 5), n=st.integers(1, 6))
def test_on_policy_gradient_is_the_policy_gradient(adv, n):
    """One pass per generation (``π_old = π_θ`` detached): REINFORCE.

    ρ = 1 and, for ``grpo``, ∇ = −A / n per token: the group-baseline policy gradient.
    """
    lp = jnp.full((1, n), -1.3)
    g = _grpo_gradient(lp, jnp.array([adv]), jnp.ones((1, n)))
    np.testing.assert_allclose(np.asarray(g), -adv / n, rtol=1e-6, atol=1e-7)


@jax.jit
def _grpo_gradient(lp, adv, mask):
    """``∂ grpo_loss / ∂ lp``, one program per shape (op by op: one per operation)."""

    def loss(x):
        return grpo_loss(x, None, None, adv, mask, loss_type="grpo")[0]

    return jax.grad(loss)(lp)


def test_dapo_normaliser_is_the_generation_batchs_token_count():
    lp, old, ref, adv, mask = sample(5)
    loss, _ = grpo_loss(jnp.asarray(lp, jnp.float32), jnp.asarray(old, jnp.float32),
                        None, jnp.asarray(adv, jnp.float32), jnp.asarray(mask),
                        num_items=40.0)  # fmt: skip
    want = paper_loss("dapo", lp, old, ref, adv, mask, 0.0, 0.2, 0.2, 0, n_items=40.0)
    np.testing.assert_allclose(float(loss), want, rtol=1e-5)


def test_bad_settings_are_named():
    one = jnp.zeros((2, 3))
    a = jnp.zeros(2)
    with pytest.raises(ConfigError, match="loss_type 'ppo'"):
        grpo_loss(one, None, None, a, one, loss_type="ppo")
    with pytest.raises(ConfigError, match="dr_grpo' needs max_completion_length"):
        grpo_loss(one, None, None, a, one, loss_type="dr_grpo")
    with pytest.raises(ConfigError, match="epsilon must be in"):
        grpo_loss(one, None, None, a, one, epsilon=1.5)
    with pytest.raises(ShapeError, match="needs the reference"):
        grpo_loss(one, None, None, a, one, beta=0.1)
    with pytest.raises(ShapeError, match=r"advantages must be \(B,\)"):
        grpo_loss(one, None, None, jnp.zeros(3), one)
    with pytest.raises(ShapeError, match="G = num_generations >= 2"):
        group_advantages(np.zeros(5), 2)
    with pytest.raises(ConfigError, match="scale_rewards 'std'"):
        group_advantages(np.zeros(4), 2, "std")


@settings(max_examples=40, deadline=None)
@given(
    r=st.lists(st.floats(-100, 100), min_size=8, max_size=8),
    a=st.floats(0.1, 10.0),
    b=st.floats(-50, 50),
)
def test_group_advantages_sum_to_zero_and_ignore_affine_rescaling(r, a, b):
    """Each group's advantages sum to 0, and ignore ``a r + b`` (a > 0).

    Up to TRL's 1e-4 in the denominator, negligible against a spread over 1.
    """
    r = np.asarray(r)
    adv, _ = group_advantages(r, 4)
    np.testing.assert_allclose(adv.reshape(2, 4).sum(axis=1), 0.0, atol=1e-9)
    std = r.reshape(2, 4).std(axis=1, ddof=1)
    if np.all(std > 1.0):  # the 1e-4 negligible against the spread
        adv2, _ = group_advantages(a * r + b, 4)
        np.testing.assert_allclose(adv2, adv, rtol=1e-3, atol=1e-3)
