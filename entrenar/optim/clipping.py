r"""Gradient clipping by global norm: a transformation, and the Tensor-API function.

.. math::
    \|g\| = \sqrt{\textstyle\sum_{\text{leaves}} \sum_i g_i^2},\qquad
    g \leftarrow g \cdot \frac{c}{\|g\|} \;\text{ if } \|g\| > c

(Pascanu et al., 2013, "On the difficulty of training recurrent neural networks").
The norm is accumulated in float32 whatever the gradients' dtype.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from entrenar.errors import ConfigError
from entrenar.optim.base import GradientTransformation, stateless
from entrenar.types import PyTree


def global_norm(tree: PyTree) -> jax.Array:
    """The L2 norm of all leaves together, as a float32 scalar.

    >>> import jax.numpy as jnp
    >>> float(global_norm({"a": jnp.array([3.0]), "b": jnp.array([[4.0]])}))
    5.0
    """
    leaves = jax.tree_util.tree_leaves(tree)
    sq = [jnp.sum(jnp.square(x.astype(jnp.float32))) for x in leaves]
    return jnp.sqrt(sum(sq, jnp.float32(0.0)))


def _clip(tree: PyTree, max_norm: Any, norm: jax.Array) -> PyTree:
    small = norm < max_norm

    def leaf(t: jax.Array) -> jax.Array:
        scaled = (t / norm.astype(t.dtype)) * jnp.asarray(max_norm, t.dtype)
        return jax.lax.select(small, t, scaled)

    return jax.tree_util.tree_map(leaf, tree)


def _check_max_norm(max_norm: float) -> None:
    if not max_norm > 0:
        raise ConfigError(f"max_norm must be positive, got {max_norm}")


def clip_by_global_norm(max_norm: float) -> GradientTransformation:
    """Rescale the updates so their global norm is at most ``max_norm`` (no state).

    Example:
        >>> import jax.numpy as jnp
        >>> tx = clip_by_global_norm(1.0)
        >>> u, _ = tx.update({"w": jnp.array([3.0, 4.0])}, tx.init(None))
        >>> [round(x, 4) for x in u["w"].tolist()]
        [0.6, 0.8]
    """
    _check_max_norm(max_norm)

    return stateless(
        lambda updates, params: _clip(updates, max_norm, global_norm(updates))
    )


@jax.jit
def _clip_list(grads: list[jax.Array], max_norm: jax.Array) -> tuple[Any, jax.Array]:
    norm = global_norm(grads)
    return _clip(grads, max_norm, norm), norm


def clip_grad_norm(tensors: Sequence[Any], max_norm: float) -> jax.Array:
    """Clip the ``.grad`` of ``tensors`` in place to a global norm of ``max_norm``.

    Tensors whose ``.grad`` is None are skipped. One jitted call for the whole list.

    Args:
        tensors: `entrenar.autograd.Tensor` objects (anything with ``.grad``).
        max_norm: the largest allowed global norm.

    Returns:
        The global norm *before* clipping (float32 scalar array).

    Example:
        >>> from entrenar.autograd import Tensor, backward
        >>> w = Tensor([3.0, 4.0], requires_grad=True)
        >>> backward((w * w).sum() * 0.5)
        >>> float(clip_grad_norm([w], 1.0)), [round(x, 4) for x in w.grad.tolist()]
        (5.0, [0.6, 0.8])
    """
    _check_max_norm(max_norm)
    live = [t for t in tensors if t.grad is not None]
    if not live:
        return jnp.zeros([], jnp.float32)
    clipped, norm = _clip_list([t.grad for t in live], jnp.float32(max_norm))
    for t, g in zip(live, clipped):
        t.grad = g
    return norm


__all__ = ["clip_by_global_norm", "clip_grad_norm", "global_norm"]
