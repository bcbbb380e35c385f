"""The native attention kernel (entrenar/kernels/attention.cc) against the JAX path.

The reference is `_attention_jax` in float64 (its own gradients by autodiff), so the
kernel's float32 forward and backward are checked against an independent, more
precise computation; a finite-difference check covers the backward pass directly.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from entrenar import native
from entrenar.nn import LlamaConfig, attention
from entrenar.nn.attention import causal_mask, dot_product_attention

pytestmark = pytest.mark.skipif(
    not native.load("attention"), reason="no C++ compiler: the kernel is off"
)


def _inputs(seed, b, t, s, h, kv, d, dv, mask_kind):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((b, t, h, d)).astype(np.float32)
    k = rng.standard_normal((b, s, kv, d)).astype(np.float32)
    v = rng.standard_normal((b, s, kv, dv)).astype(np.float32)
    if mask_kind == "causal":
        mask = np.asarray(causal_mask(jnp.arange(t) + (s - t), s))
    elif mask_kind == "random":
        mask = rng.random((b, t, s)) < 0.6
    elif mask_kind == "empty_row":
        mask = np.array(causal_mask(jnp.arange(t) + (s - t), s))
        mask[min(2, t - 1)] = False  # a query that may attend nowhere
    else:
        mask = None
    w = rng.standard_normal((b, t, h, dv)).astype(np.float32)  # output cotangent
    return q, k, v, mask, w


def _reference(q, k, v, mask, w):
    """Output and gradients of ``Σ w · attention`` by the JAX path in float64."""
    with jax.enable_x64():
        args = [jnp.asarray(x, jnp.float64) for x in (q, k, v, w)]
        m = None if mask is None else jnp.asarray(mask)
        out, grads = _reference64(*args, m)
        return np.asarray(out), [np.asarray(g) for g in grads]


@jax.jit
def _reference64(q, k, v, w, mask):
    # one compiled program per shape: run op by op, float64 compiled each of its
    # dozens of operations apart (about 2 s a case on 2 cores, cold cache)
    scale = 1.0 / q.shape[-1] ** 0.5

    def f(q, k, v):
        return attention._attention_jax(q, k, v, mask, None, scale, None)

    out, vjp = jax.vjp(f, q, k, v)
    return out, vjp(w)


def _native(q, k, v, mask, w):
    m = None if mask is None else jnp.asarray(mask)
    assert attention._native_ok(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), m, None)

    def f(q, k, v):
        return dot_product_attention(q, k, v, m)

    out = jax.jit(f)(q, k, v)
    grads = jax.jit(jax.grad(lambda *a: jnp.sum(f(*a) * w), (0, 1, 2)))(q, k, v)
    return np.asarray(out), [np.asarray(g) for g in grads]


CASES = [
    # b, t, s, h, kv, d, dv, mask
    (2, 7, 7, 4, 2, 8, 8, "causal"),
    (4, 128, 128, 9, 3, 64, 64, "causal"),  # SmolLM2's attention
    (1, 33, 40, 3, 1, 20, 24, "random"),  # d, dv not whole vectors; (B, T, S) mask
    (2, 5, 9, 2, 2, 16, 16, None),
    (2, 6, 6, 2, 1, 16, 16, "empty_row"),
    (1, 1, 37, 6, 2, 16, 16, "causal"),  # one decoding step against a cache
]


@pytest.mark.parametrize("case", CASES, ids=[str(c) for c in CASES])
def test_native_attention_matches_float64_reference(case):
    q, k, v, mask, w = _inputs(0, *case)
    want, want_grads = _reference(q, k, v, mask, w)
    got, got_grads = _native(q, k, v, mask, w)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=2e-6)
    for name, g, r in zip("qkv", got_grads, want_grads, strict=True):
        scale = np.abs(r).max() + 1e-12
        np.testing.assert_allclose(g / scale, r / scale, atol=2e-6, err_msg=f"d{name}")


@settings(max_examples=8)  # each example compiles six small programs
@given(
    st.integers(1, 2),
    st.integers(1, 9),
    st.integers(1, 19),
    st.sampled_from([(1, 1), (2, 1), (4, 2), (3, 3)]),
    st.integers(1, 33),
    st.sampled_from(["causal", "random", "empty_row", None]),
)
def test_native_attention_any_shape(b, t, s, heads, d, mask_kind):
    h, kv = heads
    s = max(s, t)
    q, k, v, mask, w = _inputs(1, b, t, s, h, kv, d, d, mask_kind)
    want, want_grads = _reference(q, k, v, mask, w)
    got, got_grads = _native(q, k, v, mask, w)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=3e-6)
    for g, r in zip(got_grads, want_grads, strict=True):
        np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-5)


def test_native_attention_gradient_matches_finite_differences():
    q, k, v, mask, w = _inputs(2, 1, 6, 6, 2, 1, 8, 8, "causal")
    f = jax.jit(lambda q, k, v: jnp.sum(dot_product_attention(q, k, v, mask) * w))
    grads = jax.grad(f, (0, 1, 2))(q, k, v)
    rng = np.random.default_rng(3)
    eps = 1e-2
    for i, g in enumerate(grads):
        direction = rng.standard_normal(g.shape).astype(np.float32)
        args_hi, args_lo = [q, k, v], [q, k, v]
        args_hi[i] = args_hi[i] + eps * direction
        args_lo[i] = args_lo[i] - eps * direction
        fd = (float(f(*args_hi)) - float(f(*args_lo))) / (2 * eps)
        assert fd == pytest.approx(float(np.sum(np.asarray(g) * direction)), rel=2e-3)


@pytest.mark.parametrize("case", CASES[:3], ids=[str(c) for c in CASES[:3]])
def test_native_attention_with_bfloat16_products_matches_the_jax_path(case):
    """``matmul_dtype="bfloat16"``: q, k, v and the probabilities rounded alike."""
    q, k, v, mask, w = _inputs(6, *case)
    m = None if mask is None else jnp.asarray(mask)
    scale = 1.0 / q.shape[-1] ** 0.5

    def native_f(q, k, v):
        return dot_product_attention(q, k, v, m, matmul_dtype="bfloat16")

    def jax_f(q, k, v):
        return attention._attention_jax(q, k, v, m, None, scale, "bfloat16")

    got, want = jax.jit(native_f)(q, k, v), jax.jit(jax_f)(q, k, v)
    # a probability one float32 ulp apart can round to a neighbouring bfloat16 (one
    # bfloat16 ulp, 2^-8 relative): rare, and within bfloat16's precision
    np.testing.assert_allclose(got, want, atol=2e-3)
    close = np.isclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=3e-6)
    assert close.mean() > 0.99
    plain = jax.jit(lambda q, k, v: dot_product_attention(q, k, v, m))(q, k, v)
    assert np.max(np.abs(np.asarray(plain) - np.asarray(want))) > 1e-3  # rounded
    # gradients: the JAX path also rounds the cotangents to bfloat16; the kernel
    # keeps them float32, so the two agree to bfloat16's precision
    ga = jax.jit(jax.grad(lambda *a: jnp.sum(native_f(*a) * w), (0, 1, 2)))(q, k, v)
    gb = jax.jit(jax.grad(lambda *a: jnp.sum(jax_f(*a) * w), (0, 1, 2)))(q, k, v)
    for a, b in zip(ga, gb, strict=True):
        scale_g = float(jnp.abs(b).max())
        np.testing.assert_allclose(a / scale_g, b / scale_g, atol=2e-2)


@pytest.mark.parametrize(
    "md, p", [(None, 1 / 6), ("bfloat16", float(jnp.bfloat16(1 / 6)))]
)
def test_a_query_with_no_allowed_key_gives_dv_from_the_forward_s_weights(md, p):
    # such a query attends uniformly to all S keys; with bfloat16 products the forward
    # multiplies V by bf16(1/S), so dv = bf16(1/S) Σ_t do[t] (1/6 is not a bfloat16)
    q, k, v, _, w = _inputs(5, 1, 3, 6, 2, 1, 8, 8, None)
    mask = jnp.zeros((3, 6), bool)

    def loss(v):
        return jnp.sum(dot_product_attention(q, k, v, mask, matmul_dtype=md) * w)

    dv = jax.grad(loss)(v)  # (1, S, 1, d)
    want = p * np.sum(w, axis=(1, 2))  # (1, d): every key gets the same
    np.testing.assert_allclose(dv[0, :, 0], np.repeat(want, 6, 0), rtol=1e-6)


def test_native_attention_under_vmap():
    q, k, v, mask, _ = _inputs(4, 3, 5, 5, 2, 1, 8, 8, "causal")
    got = jax.vmap(lambda q, k, v: dot_product_attention(q, k, v, mask))(
        q[:, None], k[:, None], v[:, None]
    )[:, 0]
    want = attention._attention_jax(q, k, v, jnp.asarray(mask), None, 8**-0.5, None)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_native_attention_is_skipped_where_it_does_not_apply():
    q, k, v, mask, _ = _inputs(5, 1, 4, 4, 2, 1, 8, 8, "causal")
    q, k, v, m = jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(mask)
    assert attention._native_ok(q, k, v, m, None)
    assert not attention._native_ok(q, k, v, m, jnp.zeros((1, 2, 4, 4)))  # a bias
    assert not attention._native_ok(q.astype(jnp.bfloat16), k, v, m, None)
    assert not attention._native_ok(q, k, v, m, None, "float16")
    assert attention._native_ok(q, k, v, m, None, "bfloat16")
    assert not attention._native_ok(q, k, v, m[None, None], None)  # a 4-d mask
    assert not attention._native_ok(q[:, :0], k, v, m[:0], None)  # nothing to attend


@pytest.mark.parametrize("policy", ["dots_saveable", None])
def test_remat_policy_keeps_the_kernels_forward(policy):
    """``dots_saveable`` saves the kernel's inputs, output and log-sum-exp.

    They carry `attention.ATTENTION_NAME`, so the backward pass does not run the
    forward kernel again.
    """
    cfg = LlamaConfig(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        remat_policy=policy,
    )
    params = cfg.init(jax.random.key(0))
    tokens = jnp.arange(16).reshape(2, 8) % 64

    def loss(p):
        return jnp.mean(cfg.apply(p, tokens) ** 2)

    hlo = jax.jit(jax.grad(loss)).lower(params).compile().as_text()
    assert hlo.count('custom_call_target="entrenar_attention_fwd"') == 1
    assert hlo.count('custom_call_target="entrenar_attention_bwd"') == 1
