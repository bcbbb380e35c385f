"""AdamW's update and its application in one pass: `adamw_apply`.

``tx.update`` followed by `apply_updates` is the optax protocol; for AdamW it makes
XLA:CPU run three loops (``m``, ``v``, then ``θ``), moving 40 bytes per float32
parameter. `adamw_apply` returns the new parameters and state directly; each float32
leaf goes through the native kernel ``entrenar/kernels/adamw.cc`` (one loop, 28 bytes
per parameter: read θ, g, m, v, write θ, m, v), other leaves through the chain's own
pieces (`adam_rule`, the decay, the rate, `apply_updates`). The math, per leaf
(Loshchilov & Hutter, 2019; specs/optimizers.md)::

    m' = (1-β1) g + β1 m            v' = (1-β2) g² + β2 v
    u  = (m' / (1-β1^t)) / (sqrt(v' / (1-β2^t) + ε_root) + ε) + λ θ
    θ' = θ + u · (-η_t)

which is `scale_by_adam`, `add_decayed_weights`, `scale_by_learning_rate` and
`apply_updates`, operation by operation: the pure-JAX path gives the chain's values
bit for bit, the kernel the same to float32 rounding (it and XLA:CPU may contract
different products into fused multiply-adds; tests/optim/test_optim_fused.py).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from entrenar import native
from entrenar.optim.base import (
    GradientTransformation,
    TransformApplyFn,
    apply_updates,
    safe_increment,
)
from entrenar.optim.masking import Mask, resolve_mask
from entrenar.optim.transforms import (
    ScaleByAdamState,
    adam_bias_corrections,
    adam_rule,
    unzip_leaves,
)
from entrenar.types import OptState, Params, Updates


def _leaf_native(
    p: jax.Array, g: jax.Array, m: jax.Array, v: jax.Array, h: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The kernel: θ, m and v are updated in place when the caller donates them.

    ``h``: ``(1-β1, β1, 1-β2, β2, 1-β1^t, 1-β2^t, ε, ε_root, λ, -η_t)`` float32.
    """
    out = jax.ShapeDtypeStruct(p.shape, jnp.float32)
    call = jax.ffi.ffi_call(
        "entrenar_adamw",
        (out, out, out),
        input_output_aliases={0: 0, 2: 1, 3: 2},
    )
    p_new, m_new, v_new = call(p, g, m, v, h)
    return p_new, m_new, v_new


def _native_ok(p: Any, g: Any, m: Any, v: Any) -> bool:
    """The kernel takes this leaf: equal, non-empty shapes, and `native.use`."""
    return (
        p.shape == g.shape == m.shape == v.shape
        and p.size > 0
        and native.use("adamw", p, g, m, v)
    )


def adamw_apply(
    b1: float,
    b2: float,
    eps: float,
    eps_root: float,
    weight_decay: float,
    mask: Mask | None,
    decay: GradientTransformation,
    rate: GradientTransformation,
) -> TransformApplyFn:
    """The ``apply`` of `entrenar.optim.adamw`'s chain ``(adam, decay, rate)``.

    Args:
        b1: ``β_1``, as in `entrenar.optim.adamw`.
        b2: ``β_2``.
        eps: ``ε``.
        eps_root: ``ε_root``.
        weight_decay: ``λ``.
        mask: the decay mask, as in `entrenar.optim.adamw`.
        decay: the chain's `add_decayed_weights` piece (its state is carried over).
        rate: the chain's `scale_by_learning_rate` piece (gives ``η_t`` and the
            next rate state).

    Whether a leaf takes the kernel is `entrenar.native.use`'s decision (the
    policy, backend, devices and dtypes); ``native.policy("jax")`` forces the
    JAX path.
    """

    def apply(
        grads: Updates, state: OptState, params: Params
    ) -> tuple[Params, OptState]:
        adam_s, decay_s, rate_s = state
        count = safe_increment(adam_s.count)
        c1, c2 = adam_bias_corrections(count, b1, b2)  # () 1 - β1^t, 1 - β2^t
        neg_lr, rate_s = rate.update(jnp.ones((), jnp.float32), rate_s)  # () -η_t
        _, decay_s = decay.update(grads, decay_s, params)  # pure: only its state
        decayed = (
            jax.tree_util.tree_map(lambda _: True, params)
            if mask is None
            else resolve_mask(mask, params)
        )

        def leaf(p: Any, g: Any, m: Any, v: Any, d: bool) -> tuple[Any, Any, Any]:
            wd = weight_decay if d else 0.0
            if _native_ok(p, g, m, v):
                f = jnp.float32
                h = [f(1 - b1), f(b1), f(1 - b2), f(b2), c1, c2, f(eps), f(eps_root)]
                return _leaf_native(p, g, m, v, jnp.stack([*h, f(wd), neg_lr]))
            # the chain's operations: scale_by_adam, add_decayed_weights, the rate
            u, m_new, v_new = adam_rule(g, m, v, c1, c2, b1, b2, eps, eps_root)
            if wd:
                u = u + wd * jnp.asarray(p).astype(u.dtype)
            return apply_updates(p, u * neg_lr.astype(u.dtype)), m_new, v_new

        p_leaves, treedef = jax.tree_util.tree_flatten(params)
        leaves = jax.tree_util.tree_leaves  # the same structure as params
        outs = [
            leaf(*xs)
            for xs in zip(
                p_leaves,
                leaves(grads),
                leaves(adam_s.mu),
                leaves(adam_s.nu),
                leaves(decayed),
                strict=True,
            )
        ]
        new_p, mu, nu = unzip_leaves(treedef, outs, 3)
        return new_p, (ScaleByAdamState(count=count, mu=mu, nu=nu), decay_s, rate_s)

    return apply


__all__ = ["adamw_apply"]
