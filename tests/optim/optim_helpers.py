"""Shared fixtures for the optimizer tests: a mixed-shape pytree, a convex problem."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

SHAPES = {
    "embed": {"weight": (7, 3)},
    "layers": [{"w": (3, 4), "b": (4,)}, {"w": (2, 2, 2), "b": (1,)}],
    "scale": (),
}


def random_tree(key: jax.Array, scale: float = 1.0) -> dict:
    """A pytree with the structure of SHAPES and N(0, scale²) leaves."""
    leaves, treedef = jax.tree_util.tree_flatten(
        SHAPES, is_leaf=lambda x: isinstance(x, tuple)
    )
    keys = jax.random.split(key, len(leaves))
    return jax.tree_util.tree_unflatten(
        treedef,
        [scale * jax.random.normal(k, s, jnp.float32) for k, s in zip(keys, leaves)],
    )


@functools.cache
def problem(seed: int = 0, noise: float = 0.5):
    """(params0, grad_fn(params, step)) for ½Σ a (θ - c)² plus a step-dependent wobble.

    The wobble ``noise · sin(ω t + φ)`` (fixed random ω, φ per element) stands in for
    minibatch noise and is cheap to compile (no PRNG in the step).
    """
    k0, ka, kc, kw, kp = jax.random.split(jax.random.key(seed), 5)
    params0 = random_tree(k0)
    curv = jax.tree_util.tree_map(lambda x: 0.5 + jnp.abs(x), random_tree(ka))
    center = random_tree(kc)
    omega = random_tree(kw)
    phase = random_tree(kp, 3.0)

    def grad_fn(params, step):
        t = jnp.asarray(step).astype(jnp.float32)
        return jax.tree_util.tree_map(
            lambda p, a, c, w, f: a * (p - c) + noise * jnp.sin(w * t + f),
            params,
            curv,
            center,
            omega,
            phase,
        )

    return params0, grad_fn
