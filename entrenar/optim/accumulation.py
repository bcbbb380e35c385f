r"""Gradient accumulation: one optimizer step per ``k`` micro-batches, averaged.

Two forms, both averaging (not summing) so that, for a loss that is a mean over
examples, the loss and the update do not depend on how a batch is split:

- `accumulate(inner, k)`: a transformation fed one micro-batch gradient per call. It
  keeps the running mean :math:`\bar g_n = (g_n + (n-1)\,\bar g_{n-1}) / n` and, on
  every ``k``-th call, passes :math:`\bar g_k` to ``inner``; other calls return zero
  updates and leave ``inner``'s state unchanged (optax's ``MultiSteps``).
- `microbatched_value_and_grad(fn, k)`: splits one batch into ``k`` micro-batches inside
  a single jitted computation (``lax.scan``), so only one micro-batch's activations are
  alive at a time, and returns the mean loss and mean gradient.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from entrenar.errors import ConfigError, ShapeError
from entrenar.optim.base import GradientTransformation, tree_zeros_like
from entrenar.types import OptState, Params, PyTree, Updates


class AccumulateState(NamedTuple):
    """State of `accumulate`."""

    mini_step: jax.Array  # () int32 in [0, k): micro-batches seen in this step
    acc_grads: Updates  # running mean of the micro-batch gradients
    inner_state: OptState


def accumulate(inner: Any, every_k: int) -> GradientTransformation:
    """Apply ``inner`` once every ``every_k`` calls, to the mean of their gradients.

    Example:
        >>> import jax.numpy as jnp
        >>> from entrenar.optim import sgd
        >>> tx = accumulate(sgd(1.0), 2)
        >>> s = tx.init(jnp.zeros(1))
        >>> u1, s = tx.update(jnp.array([1.0]), s)
        >>> u2, s = tx.update(jnp.array([3.0]), s)
        >>> u1.tolist(), u2.tolist()
        ([0.0], [-2.0])
    """
    if int(every_k) < 1:
        raise ConfigError(f"every_k must be at least 1, got {every_k}")
    k = int(every_k)

    def init(params: Params) -> AccumulateState:
        return AccumulateState(
            mini_step=jnp.zeros([], jnp.int32),
            acc_grads=tree_zeros_like(params),
            inner_state=inner.init(params),
        )

    def update(
        updates: Updates, state: OptState, params: Params | None = None
    ) -> tuple[Updates, OptState]:
        n = state.mini_step
        nf = n.astype(jnp.float32)
        acc = jax.tree_util.tree_map(
            lambda g, a: (
                (g + nf.astype(g.dtype) * a.astype(g.dtype))
                / (nf + 1.0).astype(g.dtype)
            ),
            updates,
            state.acc_grads,
        )
        out_shape = jax.eval_shape(inner.update, acc, state.inner_state, params)[0]

        def emit(operands: Any) -> Any:
            acc, inner_state, params = operands
            u, inner_state = inner.update(acc, inner_state, params)
            return u, inner_state, tree_zeros_like(acc)

        def hold(operands: Any) -> Any:
            acc, inner_state, _ = operands
            zeros = jax.tree_util.tree_map(
                lambda s: jnp.zeros(s.shape, s.dtype), out_shape
            )
            return zeros, inner_state, acc

        u, inner_state, acc = jax.lax.cond(
            n == k - 1, emit, hold, (acc, state.inner_state, params)
        )
        acc = jax.tree_util.tree_map(
            lambda a, o: a.astype(o.dtype), acc, state.acc_grads
        )
        return u, AccumulateState((n + 1) % k, acc, inner_state)

    return GradientTransformation(init, update)


def _split(batch: PyTree, k: int) -> PyTree:
    def leaf(x: jax.Array) -> jax.Array:
        b = x.shape[0] if x.ndim else 0
        if b == 0 or b % k:
            raise ShapeError(
                f"cannot split a batch leaf of shape {x.shape} into {k} micro-batches: "
                f"its leading axis must be a positive multiple of {k}"
            )
        return x.reshape(k, b // k, *x.shape[1:])  # (k, B/k, ...)

    return jax.tree_util.tree_map(leaf, batch)


def microbatched_value_and_grad(
    fn: Callable[..., jax.Array], num_microbatches: int
) -> Callable[[Params, PyTree], tuple[jax.Array, Updates]]:
    """``f(params, batch) -> (mean loss, mean grads)`` over ``k`` micro-batches.

    ``fn(params, micro_batch)`` must return the *mean* loss of its micro-batch; every
    leaf of ``batch`` is split along its leading axis (``B`` divisible by ``k``). The
    result equals ``jax.value_and_grad(fn)(params, batch)`` up to rounding.

    Example:
        >>> import jax.numpy as jnp
        >>> f = lambda w, x: jnp.mean((x * w) ** 2)
        >>> x = jnp.arange(4.0)
        >>> loss, g = microbatched_value_and_grad(f, 2)(jnp.float32(1.0), x)
        >>> (float(loss), float(g)) == tuple(map(float, jax.value_and_grad(f)(1.0, x)))
        True
    """
    k = int(num_microbatches)
    if k < 1:
        raise ConfigError(f"num_microbatches must be at least 1, got {k}")
    vg = jax.value_and_grad(fn)

    def run(params: Params, batch: PyTree) -> tuple[jax.Array, Updates]:
        micro = _split(batch, k)
        zero = (jnp.zeros([], jnp.float32), tree_zeros_like(params))

        def body(carry: Any, mb: PyTree) -> tuple[Any, None]:
            loss, grads = vg(params, mb)
            tot_loss, tot = carry
            tot = jax.tree_util.tree_map(jnp.add, tot, grads)
            return (tot_loss + loss.astype(jnp.float32), tot), None

        (loss, grads), _ = jax.lax.scan(body, zero, micro)
        return loss / k, jax.tree_util.tree_map(lambda g: g / k, grads)

    return run


__all__ = ["AccumulateState", "accumulate", "microbatched_value_and_grad"]
