"""Global-norm clipping in low precision and on empty inputs (float64 reference)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from entrenar import optim as eo
from entrenar.autograd import Tensor

RNG = np.random.default_rng(3)
# 4096 entries: a sum of squares kept in bfloat16 (8 significant bits) is off by
# about 0.4%, so only a float32 accumulation meets the 1e-5 tolerance below.
G = RNG.normal(size=(64, 64)).astype(np.float32)


def _norm64(*arrays: np.ndarray) -> float:
    return float(np.sqrt(sum(np.sum(np.asarray(a, np.float64) ** 2) for a in arrays)))


def test_global_norm_of_bfloat16_leaves_is_accumulated_in_float32():
    tree = {"a": jnp.asarray(G, jnp.bfloat16), "b": jnp.asarray(G[:3], jnp.float16)}
    norm = eo.global_norm(tree)
    assert norm.dtype == jnp.float32
    expected = _norm64(tree["a"].astype(jnp.float32), tree["b"].astype(jnp.float32))
    assert float(norm) == pytest.approx(expected, rel=1e-5)


def test_global_norm_of_an_empty_tree_is_a_strong_float32_zero():
    norm = eo.global_norm({})
    assert float(norm) == 0.0
    assert norm.dtype == jnp.float32
    # weak-typed, it would turn into bfloat16 when combined with bfloat16 values
    assert not norm.weak_type


def test_clip_by_global_norm_keeps_bfloat16_updates_in_bfloat16():
    g = {"w": jnp.asarray(G, jnp.bfloat16)}
    tx = eo.clip_by_global_norm(1.0)
    (out, _) = tx.update(g, tx.init(None))
    assert out["w"].dtype == jnp.bfloat16
    assert _norm64(out["w"].astype(jnp.float32)) == pytest.approx(1.0, rel=1e-2)


def test_clip_grad_norm_keeps_bfloat16_grads_in_bfloat16():
    w = Tensor(jnp.zeros((64, 64), jnp.bfloat16), requires_grad=True)
    w.grad = jnp.asarray(G, jnp.bfloat16)
    before = _norm64(w.grad.astype(jnp.float32))
    norm = eo.clip_grad_norm([w], 2.0)
    assert float(norm) == pytest.approx(before, rel=1e-5)
    assert w.grad.dtype == jnp.bfloat16
    assert _norm64(w.grad.astype(jnp.float32)) == pytest.approx(2.0, rel=1e-2)


def test_clip_grad_norm_without_any_grad_returns_a_float32_zero_scalar():
    w = Tensor([1.0, 2.0], requires_grad=True)  # no backward: w.grad is None
    norm = eo.clip_grad_norm([w], 1.0)
    assert norm.shape == () and norm.dtype == jnp.float32 and float(norm) == 0.0
    assert w.grad is None
