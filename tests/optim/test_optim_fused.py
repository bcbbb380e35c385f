"""AdamW's one-pass ``apply`` (entrenar/optim/fused.py): the chain's values."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from entrenar import native
from entrenar import optim as eo
from entrenar.optim.fused import adamw_apply

HAVE_KERNEL = native.load("adamw")


def _params():
    k = jax.random.key(0)
    return {
        "w": jax.random.normal(k, (300, 700)),  # above the kernel's per-task size
        "b": jnp.zeros((7,)),
        "h": jax.random.normal(k, (50,)).astype(jnp.bfloat16),  # the JAX path
        "empty": jnp.zeros((0, 3)),
    }


def _grads(params, i):
    key = jax.random.fold_in(jax.random.key(1), i)
    return jax.tree_util.tree_map(
        lambda x: jax.random.normal(key, x.shape).astype(x.dtype), params
    )


def _tx(**kw):
    schedule = eo.warmup_cosine_decay_schedule(0.0, 1e-2, 10, 100)
    return eo.adamw(schedule, weight_decay=0.1, mask=lambda n, x: x.ndim > 1, **kw)


def _both(tx, steps, apply_fn=None):
    """(update + apply_updates, apply) after ``steps`` steps from the same start."""
    params = _params()
    apply_fn = apply_fn or tx.apply

    @jax.jit
    def chain(p, s, g):
        updates, s = tx.update(g, s, p)
        return eo.apply_updates(p, updates), s

    fused = jax.jit(apply_fn)
    p1 = p2 = params
    s1 = s2 = tx.init(params)
    for i in range(steps):
        g = _grads(params, i)
        p1, s1 = chain(p1, s1, g)
        p2, s2 = fused(g, s2, p2)
    return (p1, s1), (p2, s2)


def _leaves_close(a, b, rtol):
    for (path, x), y in zip(
        jax.tree_util.tree_flatten_with_path(a)[0], jax.tree_util.tree_leaves(b)
    ):
        x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
        assert x.shape == y.shape and x.dtype == y.dtype, jax.tree_util.keystr(path)
        err = np.max(np.abs(x - y), initial=0.0) / max(np.max(np.abs(y), initial=0), 1)
        assert err <= rtol, f"{jax.tree_util.keystr(path)}: {err:.2e}"


def test_jax_path_is_the_chain_bit_for_bit():
    tx = _tx()
    plain = adamw_apply(
        0.9, 0.999, 1e-8, 0.0, 0.1, lambda n, x: x.ndim > 1,
        eo.add_decayed_weights(0.1, lambda n, x: x.ndim > 1),
        eo.scale_by_learning_rate(
            eo.warmup_cosine_decay_schedule(0.0, 1e-2, 10, 100)
        ),
    )  # fmt: skip
    with native.policy("jax"):
        (p1, s1), (p2, s2) = _both(tx, 30, plain)
    assert jax.tree_util.tree_structure(s1) == jax.tree_util.tree_structure(s2)
    for a, b in zip(
        jax.tree_util.tree_leaves((p1, s1)), jax.tree_util.tree_leaves((p2, s2))
    ):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_apply_equals_update_then_apply_updates():
    """The default ``apply`` (kernel where it builds) agrees to float32 rounding."""
    (p1, s1), (p2, s2) = _both(_tx(), 100)
    _leaves_close(p2, p1, 2e-6)
    _leaves_close(s2, s1, 2e-6)
    # the bfloat16 leaf takes the JAX path: identical
    np.testing.assert_array_equal(np.asarray(p1["h"]), np.asarray(p2["h"]))
    assert int(s2[0].count) == 100


def test_apply_gradients_falls_back_to_update_for_plain_transforms():
    tx = eo.chain(eo.clip_by_global_norm(1.0), eo.adam(0.1))
    assert tx.apply is None
    p = {"w": jnp.ones(3)}
    g = {"w": jnp.array([3.0, 0.0, -4.0])}
    new, state = eo.apply_gradients(tx, g, tx.init(p), p)
    u, expected_state = tx.update(g, tx.init(p), p)
    np.testing.assert_array_equal(new["w"], eo.apply_updates(p, u)["w"])
    assert int(state[1][0].count) == int(expected_state[1][0].count) == 1


def test_state_dtype_bfloat16_moments_take_the_jax_path():
    tx = eo.adamw(0.01, state_dtype=jnp.bfloat16)
    (p1, s1), (p2, s2) = _both(tx, 5)
    for a, b in zip(
        jax.tree_util.tree_leaves((p1, s1)), jax.tree_util.tree_leaves((p2, s2))
    ):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.skipif(not HAVE_KERNEL, reason="no C++ compiler: the kernel is off")
def test_float32_leaves_call_the_kernel_in_place():
    tx = eo.adamw(0.01)
    p = {"w": jnp.ones((1000,)), "h": jnp.ones((4,), jnp.bfloat16)}
    s = tx.init(p)
    step = jax.jit(
        lambda p, s, g: eo.apply_gradients(tx, g, s, p), donate_argnums=(0, 1)
    )
    text = step.lower(p, s, p).compile().as_text()
    assert text.count('custom_call_target="entrenar_adamw"') == 1  # w only
    # θ, m, v of w (f32[1000]) updated in place (the XLA of jax 0.8 also copies the
    # bfloat16 leaf's 4-value moments, which the kernel does not touch)
    assert "f32[1000]{0} copy(" not in text.split("ENTRY")[1]


@pytest.mark.skipif(not HAVE_KERNEL, reason="no C++ compiler: the kernel is off")
def test_kernel_splits_large_leaves_across_threads_correctly():
    """A leaf of 2^20 + 5 values: several spans, an uneven tail; same as JAX's."""
    n = (1 << 20) + 5
    tx = eo.adamw(1e-3, weight_decay=0.01)
    p = {"w": jnp.linspace(-1, 1, n)}
    g = {"w": jnp.cos(jnp.arange(n, dtype=jnp.float32))}
    s = tx.init(p)
    ref = adamw_apply(
        0.9, 0.999, 1e-8, 0.0, 0.01, None,
        eo.add_decayed_weights(0.01), eo.scale_by_learning_rate(1e-3),
    )  # fmt: skip
    got, _ = jax.jit(tx.apply)(g, s, p)
    with native.policy("jax"):
        want, _ = jax.jit(ref)(g, s, p)
    np.testing.assert_allclose(got["w"], want["w"], rtol=1e-6, atol=1e-7)


def test_without_the_kernel_adamw_still_steps():
    """ENTRENAR_NATIVE=0 or no compiler: the same step through XLA, no custom call."""
    code = textwrap.dedent(
        """
        import jax, jax.numpy as jnp
        from entrenar import native, optim
        tx = optim.adamw(0.1)
        p = {"w": jnp.ones(3)}
        f = jax.jit(lambda p, s, g: optim.apply_gradients(tx, g, s, p))
        new, _ = f(p, tx.init(p), {"w": jnp.ones(3)})
        assert not native.load("adamw")
        assert "entrenar_adamw" not in f.lower(p, tx.init(p), p).as_text()
        print(round(float(new["w"][0]), 4))
        """
    )
    for env in ({"ENTRENAR_NATIVE": "0"}, {"CXX": "", "PATH": "/nonexistent"}):
        out = subprocess.run(
            [sys.executable, "-c", code],
            env={**os.environ, **env},
            capture_output=True,
            text=True,
            check=True,
        )
        assert out.stdout.strip() == "0.899"  # 1 - 0.1 · (1 + 0.01 · 1)
