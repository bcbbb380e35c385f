"""`entrenar.nn.softmax_xent`: the native kernel and the JAX path against float64.

The reference computes ``lse``, ``nll`` and ``softmax - onehot`` in float64 with
numpy; ``dz`` must then be that value rounded to bfloat16 (one rounding step of
slack where the float32 exponential lands next to a rounding boundary).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from entrenar import native
from entrenar.nn import softmax_xent as sx

needs_kernel = pytest.mark.skipif(
    not native.load("softmax_xent"), reason="no C++ compiler: the kernel is off"
)


def _reference(z: np.ndarray, y: np.ndarray):
    z64 = z.astype(np.float64)
    mx = z64.max(axis=1, keepdims=True)
    lse = mx[:, 0] + np.log(np.exp(z64 - mx).sum(axis=1))
    dz = np.exp(z64 - lse[:, None])
    nll = np.full(len(y), np.nan)
    for n, label in enumerate(y):
        if 0 <= label < z.shape[1]:
            nll[n] = lse[n] - z64[n, label]
            dz[n, label] -= 1.0
    return nll, lse, dz


def _check(z: np.ndarray, y: np.ndarray, got) -> None:
    nll, lse, dz = (np.asarray(a, np.float64) for a in got)
    ref_nll, ref_lse, ref_dz = _reference(z, y)
    np.testing.assert_allclose(lse, ref_lse, rtol=2e-6, atol=2e-6)
    # nll = lse - z[y] cancels: float32 keeps lse to ~eps |lse|
    slack = 5e-6 + 2.0**-21 * np.abs(ref_lse)
    finite = np.isfinite(ref_nll)
    assert np.all(np.abs(nll - ref_nll)[finite] <= slack[finite])
    assert np.all(np.isnan(nll[~finite]))
    rounded = np.asarray(jnp.asarray(ref_dz, jnp.float32).astype(jnp.bfloat16), float)
    # at most one bfloat16 step (2^-8 relative) where float32 exp sits on a boundary
    # at the label, p - 1 cancels in float32 (as in JAX): an absolute 2 eps there
    at_label = np.zeros(dz.shape, bool)
    ok = (y >= 0) & (y < z.shape[1])
    at_label[np.flatnonzero(ok), y[ok]] = True
    bound = np.abs(ref_dz) * 2.0**-7 + 1e-30 + at_label * 2.0**-22
    np.testing.assert_array_less(np.abs(dz - rounded), bound)
    normal = np.abs(ref_dz) > 1e-30  # the kernel's exp flushes below e^-87.3 to 0
    if normal.sum() > 1000:
        assert np.mean(dz[normal] == rounded[normal]) > 0.99


def _inputs(seed: int, n: int, v: int, scale: float):
    rng = np.random.default_rng(seed)
    z = (scale * rng.standard_normal((n, v))).astype(np.float32)
    y = rng.integers(0, v, n).astype(np.int32)
    return z, y


@needs_kernel
@settings(max_examples=25, deadline=None)
@given(
    n=st.integers(1, 19),
    v=st.integers(1, 300),
    scale=st.sampled_from([0.1, 1.0, 8.0, 40.0]),
    seed=st.integers(0, 2**16),
)
def test_kernel_matches_float64(n, v, scale, seed):
    z, y = _inputs(seed, n, v, scale)
    out = jax.jit(lambda z, y: sx.softmax_xent(z, y, jnp.bfloat16))(z, y)
    assert out[2].dtype == jnp.bfloat16
    _check(z, y, out)


@needs_kernel
def test_kernel_is_the_path_taken():
    z, y = _inputs(0, 4, 33, 1.0)
    hlo = jax.jit(lambda z, y: sx.softmax_xent(z, y, jnp.bfloat16)).lower(z, y)
    assert "entrenar_softmax_xent" in hlo.as_text()


def test_jax_path_matches_float64():
    z, y = _inputs(1, 6, 97, 4.0)
    assert not sx._native_ok(jnp.asarray(z), jnp.asarray(y), jnp.float32)
    nll, lse, dz = sx.softmax_xent(jnp.asarray(z), jnp.asarray(y), jnp.float32)
    ref_nll, ref_lse, ref_dz = _reference(z, y)
    np.testing.assert_allclose(nll, ref_nll, rtol=2e-6, atol=5e-6)
    np.testing.assert_allclose(lse, ref_lse, rtol=2e-6, atol=5e-6)
    np.testing.assert_allclose(dz, ref_dz, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("dz_dtype", [jnp.bfloat16, jnp.float32])
def test_label_out_of_range_gives_nan_loss(dz_dtype):
    z, y = _inputs(2, 3, 10, 1.0)
    y[1] = 10  # one past the vocabulary
    y[2] = -5
    nll, lse, dz = jax.jit(lambda z, y: sx.softmax_xent(z, y, dz_dtype))(z, y)
    assert np.isfinite(nll[0]) and np.isnan(nll[1]) and np.isnan(nll[2])
    assert np.all(np.asarray(dz, np.float32)[1:] >= 0)  # no -1 anywhere
    np.testing.assert_allclose(np.asarray(lse), _reference(z, y)[1], rtol=2e-6)


@needs_kernel
def test_kernel_large_vocabulary_and_extremes():
    z, y = _inputs(3, 9, 49152, 3.0)
    z[0, :] = -1e4  # a flat row far from zero
    z[1, 5] = 80.0  # one logit dominates: dz ~ 0 except -~0 at the label
    y[1] = 5
    _check(z, y, jax.jit(lambda z, y: sx.softmax_xent(z, y, jnp.bfloat16))(z, y))
