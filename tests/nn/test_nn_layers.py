"""Layers, initialisers, rotary embeddings and the MLP model against numpy."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from entrenar.errors import ConfigError, DTypeError, ShapeError
from entrenar.nn import (
    MLP,
    apply_rope,
    dot_product_attention,
    dropout,
    embedding,
    gated_mlp,
    init,
    kaiming_normal,
    kaiming_uniform,
    layer_norm,
    normal,
    rms_norm,
    xavier_normal,
    xavier_uniform,
)

RNG = np.random.default_rng(0)


def test_norms_match_numpy():
    x = RNG.normal(size=(3, 5)).astype(np.float32)
    w, b = RNG.normal(size=5).astype(np.float32), RNG.normal(size=5).astype(np.float32)
    mu, var = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)
    want = (x - mu) / np.sqrt(var + 1e-5) * w + b
    np.testing.assert_allclose(layer_norm(jnp.asarray(x), w, b), want, rtol=1e-5)
    want = x / np.sqrt((x**2).mean(-1, keepdims=True) + 1e-6) * w
    np.testing.assert_allclose(rms_norm(jnp.asarray(x), w), want, rtol=1e-5)
    assert rms_norm(jnp.asarray(x, jnp.bfloat16), jnp.asarray(w)).dtype == jnp.bfloat16


def test_embedding_and_errors():
    table = jnp.arange(12.0).reshape(4, 3)
    np.testing.assert_array_equal(embedding(table, jnp.array([[3, 1]]))[0, 0], table[3])
    with pytest.raises(DTypeError):
        embedding(table, jnp.array([1.0]))


def test_dropout_statistics_and_keys():
    x = jnp.ones((200, 100))
    y = dropout(x, 0.25, key=jax.random.key(0))
    kept = np.asarray(y != 0)
    assert abs(kept.mean() - 0.75) < 0.01
    np.testing.assert_allclose(np.asarray(y)[kept], 1 / 0.75, rtol=1e-6)
    np.testing.assert_array_equal(y, dropout(x, 0.25, key=jax.random.key(0)))
    assert not np.array_equal(y, dropout(x, 0.25, key=jax.random.key(1)))
    np.testing.assert_array_equal(dropout(x, 1.0, key=jax.random.key(0)), 0 * x)
    with pytest.raises(ConfigError, match="key"):
        dropout(x, 0.5, key=None)
    with pytest.raises(ConfigError):
        dropout(x, 1.5, key=jax.random.key(0))


@pytest.mark.parametrize(
    ("fn", "std"),
    [
        (xavier_uniform, math.sqrt(2 / (300 + 200))),
        (xavier_normal, math.sqrt(2 / (300 + 200))),
        (kaiming_uniform, math.sqrt(2 / 300)),
        (kaiming_normal, math.sqrt(2 / 300)),
        (normal, 0.02),
    ],
)
def test_initialiser_statistics(fn, std):
    w = np.asarray(fn((2, 200, 300), key=jax.random.key(3)))  # (lead, out, in)
    assert w.shape == (2, 200, 300)
    assert abs(w.mean()) < 0.05 * std
    assert abs(w.std() / std - 1) < 0.02
    np.testing.assert_array_equal(w, fn((2, 200, 300), key=jax.random.key(3)))
    assert fn((4, 3), key=jax.random.key(0), dtype=jnp.bfloat16).dtype == jnp.bfloat16
    if "uniform" in fn.__name__:
        assert np.abs(w).max() <= std * math.sqrt(3) * (1 + 1e-6)


def test_init_errors():
    with pytest.raises(ShapeError):
        init.fans(())
    with pytest.raises(ConfigError):
        kaiming_normal((3, 3), key=jax.random.key(0), mode="fan_avg")


def test_rope_matches_complex_rotation():
    # Half-split RoPE = multiplying (x[i] + i x[i + d/2]) by exp(i p θ^(-2i/d)).
    x = RNG.normal(size=(1, 5, 2, 8)).astype(np.float32)
    got = np.asarray(apply_rope(jnp.asarray(x), jnp.arange(5), 30.0))
    z = x[..., :4] + 1j * x[..., 4:]
    ang = np.arange(5)[:, None] * 30.0 ** (-np.arange(0, 8, 2) / 8)
    r = z * np.exp(1j * ang)[None, :, None, :]
    np.testing.assert_allclose(got, np.concatenate([r.real, r.imag], -1), atol=1e-5)


def test_rope_gradient_is_the_inverse_rotation():
    """RoPE is orthogonal, so its VJP rotates back: ``∂⟨rope(x), w⟩/∂x = rope⁻¹(w)``.

    The custom VJP computes that directly; checked here against the rotation by the
    opposite angles and against autodiff of the plain formula.
    """
    x = jnp.asarray(RNG.normal(size=(2, 5, 3, 8)), jnp.float32)
    w = jnp.asarray(RNG.normal(size=(2, 5, 3, 8)), jnp.float32)
    pos = jnp.arange(5)
    got = jax.grad(lambda x: jnp.sum(apply_rope(x, pos, 100.0) * w))(x)
    np.testing.assert_allclose(got, apply_rope(w, -pos, 100.0), rtol=1e-5, atol=1e-6)

    def plain(x):
        from entrenar.nn.rope import rope_angles, rotate_half

        ang = rope_angles(pos, 8, 100.0, jnp.float32)
        ang = jnp.concatenate([ang, ang], -1)[None, :, None]
        return x * jnp.cos(ang) + rotate_half(x) * jnp.sin(ang)

    want = jax.grad(lambda x: jnp.sum(plain(x) * w))(x)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


@given(st.integers(0, 50), st.integers(0, 50))
def test_rope_scores_depend_on_relative_position(p, shift):
    q = jnp.asarray(RNG.normal(size=(1, 1, 1, 4)), jnp.float32)
    k = jnp.asarray(RNG.normal(size=(1, 1, 1, 4)), jnp.float32)

    def score(pq, pk):
        qr = apply_rope(q, jnp.array([pq]), 100.0)
        kr = apply_rope(k, jnp.array([pk]), 100.0)
        return float(jnp.sum(qr * kr))

    assert math.isclose(score(p + 3, p), score(shift + 3, shift), abs_tol=1e-4)


def test_gqa_equals_repeated_kv_heads():
    q = jnp.asarray(RNG.normal(size=(2, 3, 6, 4)), jnp.float32)
    k = jnp.asarray(RNG.normal(size=(2, 5, 2, 4)), jnp.float32)
    v = jnp.asarray(RNG.normal(size=(2, 5, 2, 4)), jnp.float32)
    mask = jnp.asarray(RNG.random((3, 5)) < 0.7).at[:, 0].set(True)
    got = dot_product_attention(q, k, v, mask)
    kr, vr = jnp.repeat(k, 3, axis=2), jnp.repeat(v, 3, axis=2)
    s = np.einsum("bthd,bshd->bhts", q, kr) / 2.0
    s = np.where(np.asarray(mask), s, -np.inf)
    pr = np.exp(s - s.max(-1, keepdims=True))
    want = np.einsum("bhts,bshd->bthd", pr / pr.sum(-1, keepdims=True), vr)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    with pytest.raises(ShapeError, match="multiple"):
        dot_product_attention(q[:, :, :5], k, v, mask)


def test_gated_mlp_and_mlp_model_match_numpy():
    x = RNG.normal(size=(4, 3)).astype(np.float32)
    wg, wu = RNG.normal(size=(5, 3)), RNG.normal(size=(5, 3))
    wd = RNG.normal(size=(3, 5))
    g = x @ wg.T
    want = (g / (1 + np.exp(-g)) * (x @ wu.T)) @ wd.T
    got = gated_mlp(jnp.asarray(x), jnp.asarray(wg), jnp.asarray(wu), jnp.asarray(wd))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)

    m = MLP((3, 6, 5, 2), activation="tanh")
    p = m.init(jax.random.key(0))
    h = x
    for k, layer in enumerate(p["layers"]):
        h = h @ np.asarray(layer["weight"]).T + np.asarray(layer["bias"])
        h = np.tanh(h) if k < 2 else h
    np.testing.assert_allclose(m.apply(p, jnp.asarray(x)), h, rtol=1e-5, atol=1e-6)
    md = MLP((3, 6, 2), dropout=0.5)
    pd = md.init(jax.random.key(0))
    a = md.apply(pd, jnp.asarray(x), key=jax.random.key(1))
    np.testing.assert_array_equal(
        a, md.apply(pd, jnp.asarray(x), key=jax.random.key(1))
    )
    with pytest.raises(ShapeError, match=r"\(\.\.\., 3\)"):
        m.apply(p, jnp.ones((2, 4)))
    for bad in (dict(sizes=(3,)), dict(sizes=(3, 2), activation="swish")):
        with pytest.raises(ConfigError):
            MLP(**bad)
