"""ProgressiveDistiller: schedule order, projections, hidden losses against numpy."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from entrenar import check_gradient
from entrenar.distill import ProgressiveDistiller
from entrenar.errors import ConfigError, ShapeError


def test_schedule_moves_from_lower_to_upper_layers():
    pd = ProgressiveDistiller((1, 2, 3), (2, 4, 6), stage_steps=10)
    rows = [pd.pair_weights(n).tolist() for n in (0, 9, 10, 19, 20, 1000)]
    assert rows == [
        [1.0, 0.0, 0.0],
        [1.0, 0.0, 0.0],
        [1.0, 1.0, 0.0],
        [1.0, 1.0, 0.0],
        [1.0, 1.0, 1.0],
        [1.0, 1.0, 1.0],
    ]
    single = ProgressiveDistiller(
        (1, 2, 3), (2, 4, 6), stage_steps=10, cumulative=False
    )
    rows = [single.pair_weights(n).tolist() for n in (0, 10, 25, 1000)]
    assert rows == [[1, 0, 0], [0, 1, 0], [0, 0, 1], [0, 0, 1]]
    # the first active pair is always the lowest, and stages never move down
    stages = [int(pd.stage(n)) for n in range(0, 60, 3)]
    assert stages == sorted(stages) and stages[0] == 0
    # a traced step gives the same weights (one compiled step for all stages)
    jitted = jax.jit(pd.pair_weights)
    assert jitted(jnp.int32(15)).tolist() == [1.0, 1.0, 0.0]


def _hidden(rng, widths, shape=(2, 5)):
    return tuple(rng.normal(size=(*shape, w)).astype(np.float32) for w in widths)


def test_projection_only_where_widths_differ_and_loss_matches_numpy():
    rng = np.random.default_rng(0)
    s_widths, t_widths = (4, 8, 8), (4, 16, 16, 8)
    pd = ProgressiveDistiller((0, 1, 2), (0, 2, 3), loss="mse", stage_steps=1)
    proj = pd.init_projection(s_widths, t_widths, key=jax.random.key(0))
    assert sorted(proj) == ["1"] and proj["1"]["weight"].shape == (16, 8)
    hs, ht = _hidden(rng, s_widths), _hidden(rng, t_widths)
    got = np.asarray(pd.pair_losses(hs, ht, proj))
    w = np.asarray(proj["1"]["weight"], np.float64)
    want = [
        np.mean((hs[0] - ht[0]) ** 2),
        np.mean((hs[1].astype(np.float64) @ w.T - ht[2]) ** 2),
        np.mean((hs[2] - ht[3]) ** 2),
    ]
    np.testing.assert_allclose(got, want, rtol=1e-5)


def test_cosine_loss_and_mask():
    rng = np.random.default_rng(1)
    hs, ht = _hidden(rng, (6,)), _hidden(rng, (6,))
    where = np.array([[True] * 5, [True, True, False, False, False]])
    pd = ProgressiveDistiller((0,), (0,), loss="cosine")
    got = float(pd.pair_losses(hs, ht, {}, where=where)[0])
    a, b = hs[0].astype(np.float64), ht[0].astype(np.float64)
    cos = np.sum(a * b, -1) / np.linalg.norm(a, axis=-1) / np.linalg.norm(b, axis=-1)
    want = np.mean(1 - cos[where])
    assert got == pytest.approx(want, rel=1e-5)
    # scaling the student's state leaves the cosine loss unchanged
    scaled = (hs[0] * 7.0,)
    assert float(pd.pair_losses(scaled, ht, {}, where=where)[0]) == pytest.approx(
        got, rel=1e-5
    )


def test_hidden_loss_is_mean_of_active_pairs():
    rng = np.random.default_rng(2)
    hs, ht = _hidden(rng, (3, 3)), _hidden(rng, (3, 3))
    pd = ProgressiveDistiller((0, 1), (0, 1), stage_steps=5)
    per = np.asarray(pd.pair_losses(hs, ht, {}))
    assert float(pd.hidden_loss(hs, ht, {}, 0)) == pytest.approx(per[0], rel=1e-6)
    assert float(pd.hidden_loss(hs, ht, {}, 5)) == pytest.approx(per.mean(), rel=1e-6)


@pytest.mark.parametrize("loss", ["mse", "cosine"])
def test_gradients_of_student_state_and_projection(loss):
    rng = np.random.default_rng(3)
    pd = ProgressiveDistiller((0,), (0,), loss=loss)
    hs = rng.normal(size=(2, 3, 4))
    ht = rng.normal(size=(2, 3, 5))
    w = rng.normal(size=(5, 4))

    def f(h, w_):
        return pd.pair_losses((h,), (jnp.asarray(ht, h.dtype),), {"0": {"weight": w_}})[
            0
        ]

    assert check_gradient(f, [hs, w], eps=1e-6, api="jax")
    g_teacher = jax.grad(
        lambda t: pd.pair_losses((hs,), (t,), {"0": {"weight": w}})[0]
    )(jnp.asarray(ht, jnp.float32))
    assert not np.any(np.asarray(g_teacher))


def test_errors():
    with pytest.raises(ConfigError, match="as many"):
        ProgressiveDistiller((1, 2), (3,))
    with pytest.raises(ConfigError, match="increasing"):
        ProgressiveDistiller((2, 1), (1, 2))
    with pytest.raises(ConfigError, match="loss"):
        ProgressiveDistiller((1,), (1,), loss="kl")
    with pytest.raises(ConfigError, match="stage_steps"):
        ProgressiveDistiller((1,), (1,), stage_steps=0)
    pd = ProgressiveDistiller((1,), (5,))
    with pytest.raises(ConfigError, match="teacher layer 5 is out of range"):
        pd.init_projection((4, 4), (4, 4, 4), key=jax.random.key(0))
    rng = np.random.default_rng(4)
    with pytest.raises(ShapeError, match="init_projection"):
        pd.pair_losses(_hidden(rng, (4, 4)), _hidden(rng, (4,) * 5 + (8,)), {})
