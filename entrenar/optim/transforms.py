"""The pieces optimizers are built from: ``scale_by_adam``, ``trace``, weight decay.

Each is a `GradientTransformation` whose per-leaf rule is written once and lifted to
the pytree (one ``tree_map`` per step, computing every output of the rule together).
Moments may be stored in a narrower dtype than the parameters (e.g. ``bfloat16`` for
half the memory); the arithmetic runs in the gradient's dtype and only the stored
state is rounded.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from entrenar.errors import ConfigError
from entrenar.optim.base import (
    EmptyState,
    GradientTransformation,
    safe_increment,
    stateless,
    tree_zeros_like,
)
from entrenar.optim.masking import masked
from entrenar.types import OptState, Params, Updates


class ScaleByAdamState(NamedTuple):
    """State of `scale_by_adam`."""

    count: jax.Array  # type: ignore[assignment]  # () int32, steps taken
    mu: Updates  # first moment m, like params (in mu_dtype)
    nu: Updates  # second moment v, like params (in nu_dtype)


class TraceState(NamedTuple):
    """State of `trace` (the momentum buffer)."""

    trace: Updates


def unzip_leaves(treedef: Any, outs: list[tuple[Any, ...]], n: int) -> list[Any]:
    """``n`` trees of ``treedef`` from a list of per-leaf ``n``-tuples."""
    return [
        jax.tree_util.tree_unflatten(treedef, [o[i] for o in outs]) for i in range(n)
    ]


def adam_bias_corrections(
    count: jax.Array, b1: float, b2: float
) -> tuple[jax.Array, jax.Array]:
    """``(1 - β1^t, 1 - β2^t)`` in float32 for the (incremented) ``count`` ``t``."""
    t = count.astype(jnp.float32)
    return 1.0 - jnp.power(jnp.float32(b1), t), 1.0 - jnp.power(jnp.float32(b2), t)


def adam_rule(
    g: jax.Array,
    m: jax.Array,
    v: jax.Array,
    bc1: jax.Array,
    bc2: jax.Array,
    b1: float,
    b2: float,
    eps: float,
    eps_root: float,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One leaf of `scale_by_adam`: ``(u, m', v')``, the moments in their own dtypes."""
    m_new = (1 - b1) * g + b1 * m.astype(g.dtype)
    v_new = (1 - b2) * (g * g) + b2 * v.astype(g.dtype)
    m_hat = m_new / bc1.astype(g.dtype)
    v_hat = v_new / bc2.astype(g.dtype)
    u = m_hat / (jnp.sqrt(v_hat + eps_root) + eps)
    return u, m_new.astype(m.dtype), v_new.astype(v.dtype)


def scale_by_adam(
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    eps_root: float = 0.0,
    *,
    mu_dtype: Any = None,
    nu_dtype: Any = None,
) -> GradientTransformation:
    r"""Adam's direction (Kingma & Ba, 2015, "Adam", Algorithm 1), without the rate.

    .. math::
        m_t = β_1 m_{t-1} + (1-β_1) g_t,\quad v_t = β_2 v_{t-1} + (1-β_2) g_t^2

        u_t = \frac{m_t / (1-β_1^t)}{\sqrt{v_t / (1-β_2^t) + ε_{root}} + ε}

    Args:
        b1: decay of the first moment.
        b2: decay of the second moment.
        eps: added to the denominator outside the square root.
        eps_root: added inside the square root (0 in the paper).
        mu_dtype: dtype to store ``m`` in (default: the parameter's).
        nu_dtype: dtype to store ``v`` in (default: the parameter's).

    Example:
        >>> import jax.numpy as jnp
        >>> tx = scale_by_adam()
        >>> u, s = tx.update(jnp.array([3.0, -0.5]), tx.init(jnp.zeros(2)))
        >>> [round(x, 4) for x in u.tolist()], int(s.count)
        ([1.0, -1.0], 1)
    """

    def init(params: Params) -> ScaleByAdamState:
        return ScaleByAdamState(
            count=jnp.zeros([], jnp.int32),
            mu=tree_zeros_like(params, mu_dtype),
            nu=tree_zeros_like(params, nu_dtype),
        )

    def update(
        updates: Updates, state: OptState, params: Params | None = None
    ) -> tuple[Updates, OptState]:
        del params
        count = safe_increment(state.count)
        bc1, bc2 = adam_bias_corrections(count, b1, b2)  # () each

        g_leaves, treedef = jax.tree_util.tree_flatten(updates)
        m_leaves = jax.tree_util.tree_leaves(state.mu)
        v_leaves = jax.tree_util.tree_leaves(state.nu)
        outs = [
            adam_rule(g, m, v, bc1, bc2, b1, b2, eps, eps_root)
            for g, m, v in zip(g_leaves, m_leaves, v_leaves)
        ]
        u, mu, nu = unzip_leaves(treedef, outs, 3)
        return u, ScaleByAdamState(count=count, mu=mu, nu=nu)

    return GradientTransformation(init, update)


def trace(
    decay: float, nesterov: bool = False, *, accumulator_dtype: Any = None
) -> GradientTransformation:
    r"""Momentum (Polyak, 1964; Nesterov as in Sutskever et al., 2013).

    .. math::
        b_t = μ b_{t-1} + g_t,\qquad u_t = b_t \;\text{or, with Nesterov,}\;
        u_t = g_t + μ b_t

    This is PyTorch's ``SGD(momentum=μ, dampening=0)`` buffer and optax's ``trace``.

    Args:
        decay: the momentum ``μ``.
        nesterov: use Nesterov's look-ahead form.
        accumulator_dtype: dtype to store the buffer in (default: the parameter's).

    Example:
        >>> import jax.numpy as jnp
        >>> tx = trace(0.9)
        >>> s = tx.init(jnp.zeros(1))
        >>> u, s = tx.update(jnp.ones(1), s)
        >>> u, s = tx.update(jnp.ones(1), s)
        >>> round(float(u[0]), 5)
        1.9
    """

    def init(params: Params) -> TraceState:
        return TraceState(trace=tree_zeros_like(params, accumulator_dtype))

    def update(
        updates: Updates, state: OptState, params: Params | None = None
    ) -> tuple[Updates, OptState]:
        del params

        def rule(g: jax.Array, b: jax.Array) -> tuple[Any, Any]:
            b_new = g + decay * b.astype(g.dtype)
            u = g + decay * b_new if nesterov else b_new
            return u, b_new.astype(b.dtype)

        g_leaves, treedef = jax.tree_util.tree_flatten(updates)
        b_leaves = jax.tree_util.tree_leaves(state.trace)
        outs = [rule(g, b) for g, b in zip(g_leaves, b_leaves)]
        u, buf = unzip_leaves(treedef, outs, 2)
        return u, TraceState(trace=buf)

    return GradientTransformation(init, update)


scale_by_momentum = trace


def add_decayed_weights(
    weight_decay: float,
    mask: Any = None,
) -> GradientTransformation:
    r"""Add ``λ·θ`` to the updates: ``u ← u + λ θ``.

    Placed *after* the adaptive scaling and *before* the learning rate (as in
    `adamw`), this is decoupled weight decay (Loshchilov & Hutter, 2019): the step
    becomes ``θ ← θ - η (u + λ θ)``. Placed before everything (as in `sgd`), it is an
    L2 penalty's gradient.

    Args:
        weight_decay: ``λ``.
        mask: decay only where the mask is True: a pytree of bools like the params
            or a predicate ``fn(name, leaf) -> bool`` on the dotted key path (see
            `entrenar.optim.masked`). Other leaves pass through unchanged.

    Example:
        >>> import jax.numpy as jnp
        >>> tx = add_decayed_weights(0.1)
        >>> u, _ = tx.update(jnp.zeros(1), tx.init(None), jnp.full(1, 2.0))
        >>> round(float(u[0]), 6)
        0.2
    """

    def init(params: Params) -> EmptyState:
        del params
        return EmptyState()

    def update(
        updates: Updates, state: OptState, params: Params | None = None
    ) -> tuple[Updates, OptState]:
        if params is None:
            raise ConfigError(
                "weight decay needs the parameters: call update(grads, state, params)"
            )
        if weight_decay == 0.0:
            return updates, state
        return (
            jax.tree_util.tree_map(
                lambda u, p: u + weight_decay * p.astype(u.dtype), updates, params
            ),
            state,
        )

    tx = GradientTransformation(init, update)
    if mask is not None:
        return masked(tx, mask)
    return tx


def map_updates(fn: Callable[[jax.Array], jax.Array]) -> GradientTransformation:
    """Apply ``fn`` to every update leaf (no state).

    >>> import jax.numpy as jnp
    >>> tx = map_updates(jnp.sign)
    >>> tx.update(jnp.array([-3.0, 2.0]), tx.init(None))[0].tolist()
    [-1.0, 1.0]
    """
    return stateless(lambda updates, params: jax.tree_util.tree_map(fn, updates))


__all__ = [
    "ScaleByAdamState",
    "TraceState",
    "add_decayed_weights",
    "map_updates",
    "scale_by_adam",
    "scale_by_momentum",
    "trace",
]
