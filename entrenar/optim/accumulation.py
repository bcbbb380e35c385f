r"""Gradient accumulation: one optimizer step per ``k`` micro-batches, averaged.

Two forms, both averaging (not summing) so that, for a loss that is a mean over
examples, the loss and the update do not depend on how a batch is split:

- `accumulate(inner, k)`: a transformation fed one micro-batch gradient per call. It
  keeps the running mean :math:`\bar g_n = (g_n + (n-1)\,\bar g_{n-1}) / n` and, on
  every ``k``-th call, passes :math:`\bar g_k` to ``inner``; other calls return zero
  updates and leave ``inner``'s state unchanged (optax's ``MultiSteps``).
- `microbatched_value_and_grad(fn, k)`: splits one batch into ``k`` micro-batches inside
  a single jitted computation (``lax.scan``), so only one micro-batch's activations are
  alive at a time, and returns the mean loss and mean gradient (weighted by each
  micro-batch's ``loss_weight`` when ``fn`` reports one). The Trainer's step uses it.
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
    """Every leaf ``(B, ...)`` of ``batch`` reshaped to ``(k, B/k, ...)``."""

    def leaf(x: Any) -> jax.Array:
        x = jnp.asarray(x)
        if x.ndim == 0 or x.shape[0] % k:
            raise ShapeError(
                f"cannot split a batch array of shape {tuple(x.shape)} into {k} "
                f"micro-batches (grad_accum): its leading axis must be a multiple "
                f"of {k}"
            )
        return x.reshape(k, x.shape[0] // k, *x.shape[1:])  # (k, B/k, ...)

    return jax.tree_util.tree_map(leaf, batch)


def microbatched_value_and_grad(
    fn: Callable[..., Any],
    num_microbatches: int,
    *,
    has_aux: bool = False,
    summed: bool = False,
) -> Callable[..., tuple[Any, Updates]]:
    r"""``f(params, batch, key=None) -> (loss, grads)`` over ``k`` micro-batches.

    ``fn(params, micro_batch)`` returns the mean loss of its micro-batch or, with
    ``has_aux``, ``(loss, metrics)`` (a dict of scalars). A metric ``"loss_weight"``
    is the number of terms the loss is a mean over (1 if absent) and weights the
    micro-batches:

    .. math::
        L = \frac{\sum_i w_i L_i}{\sum_i w_i},\qquad
        g = \frac{\sum_i w_i \nabla L_i}{\sum_i w_i}

    (``Σw = 0`` gives ``L = g = 0``); the other metrics are weighted like the loss
    and ``loss_weight`` becomes ``Σ w_i``. Every leaf of ``batch`` is split along its
    leading axis (a multiple of ``k``) and a ``lax.scan`` runs the micro-batches one
    after another, so one micro-batch's activations are alive at a time. For a loss
    that is a mean over examples (or over its ``loss_weight`` terms) the result
    equals ``jax.value_and_grad(fn, has_aux=has_aux)(params, batch)`` up to rounding.
    Given a ``key``, micro-batch ``i`` gets ``key=fold_in(key, i)``. With ``k = 1``
    ``fn`` runs once on the whole batch (with ``key`` itself), unweighted.

    ``summed``: ``fn`` returns each micro-batch's *share* of the whole batch's loss
    (its terms' sums divided by their counts over the whole batch, which it was
    given: `entrenar.train.step.takes_totals`), so ``L = Σ_i L_i``, ``g = Σ_i ∇L_i``,
    the metrics are summed likewise and ``loss_weight`` is ``Σ w_i``. A loss with
    terms counted differently (tokens and positions) is then exact however split.

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

    def weighted(params: Params, mb: PyTree, kw: dict[str, Any]) -> tuple[Any, Any]:
        out = fn(params, mb, **kw)
        loss, aux = out if has_aux else (out, {})
        aux = {n: jnp.asarray(v, jnp.float32) for n, v in aux.items()}
        w = jax.lax.stop_gradient(aux.pop("loss_weight", jnp.float32(1.0)))
        wloss = loss if k == 1 or summed else loss * w.astype(loss.dtype)
        return wloss, (loss, w, aux)

    def run(params: Params, batch: PyTree, key: Any = None) -> tuple[Any, Updates]:
        if k == 1:
            kw = {} if key is None else {"key": key}
            vg = jax.value_and_grad(weighted, has_aux=True)
            (_, (loss, w, aux)), grads = vg(params, batch, kw)
        else:
            loss, w, aux, grads = _scan(
                weighted, params, _split(batch, k), key, summed=summed
            )
        return ((loss, {**aux, "loss_weight": w}) if has_aux else loss), grads

    return run


def _scan(
    weighted: Callable[..., Any],
    params: Params,
    micro: PyTree,
    key: Any,
    *,
    summed: bool = False,
) -> tuple[jax.Array, jax.Array, dict[str, jax.Array], Updates]:
    """Weighted means (sums if ``summed``) of the results of ``weighted``."""
    k = jax.tree_util.tree_leaves(micro)[0].shape[0]

    def kw(i: Any) -> dict[str, Any]:
        return {} if key is None else {"key": jax.random.fold_in(key, i)}

    first = jax.tree_util.tree_map(lambda x: x[0], micro)
    aux_shape = jax.eval_shape(weighted, params, first, kw(0))[1][2]
    zero_aux = {n: jnp.zeros([], jnp.float32) for n in aux_shape}
    carry0 = (jnp.float32(0), jnp.float32(0), zero_aux, tree_zeros_like(params))
    vg = jax.value_and_grad(weighted, has_aux=True)

    def body(carry: Any, xs: Any) -> tuple[Any, None]:
        i, mb = xs
        (wloss, (_, w, aux)), g = vg(params, mb, kw(i))
        s_loss, s_w, s_aux, s_g = carry
        s_aux = {n: s_aux[n] + (aux[n] if summed else w * aux[n]) for n in s_aux}
        s_g = jax.tree_util.tree_map(jnp.add, s_g, g)
        return (s_loss + wloss.astype(jnp.float32), s_w + w, s_aux, s_g), None

    (s_loss, s_w, s_aux, s_g), _ = jax.lax.scan(
        body, carry0, (jnp.arange(k, dtype=jnp.int32), micro)
    )
    if summed:
        return s_loss, s_w, s_aux, s_g
    inv = 1.0 / jnp.maximum(s_w, jnp.float32(1e-30))  # W = 0: loss and grads are 0
    grads = jax.tree_util.tree_map(lambda g: g * inv.astype(g.dtype), s_g)
    return s_loss * inv, s_w, {n: v * inv for n, v in s_aux.items()}, grads


__all__ = ["AccumulateState", "accumulate", "microbatched_value_and_grad"]
