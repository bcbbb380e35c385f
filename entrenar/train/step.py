"""The jitted training and evaluation steps.

A loss function has the signature ``loss_fn(params, batch, *, key) -> loss`` or
``-> (loss, metrics)``, with ``params`` the whole tree, ``batch`` a dict of arrays and
``key`` the step's dropout key (``None`` at evaluation). One that also has a ``step``
keyword gets the optimizer step (traced; a schedule inside the loss, such as
`entrenar.distill.ProgressiveDistiller`'s stages; at evaluation, the state's step).
A metric named ``"loss_weight"`` is the number of terms the loss is a mean over
(valid tokens, say); micro-batches and evaluation batches are weighted by it (1 if
none), so a token-level mean stays a token-level mean however the batch is split.
A loss whose terms are means over different counts (a distiller's tokens and
positions) has a ``counts(batch)`` method and a ``totals`` keyword (`takes_totals`):
the step gives it ``counts`` of the whole batch, and sums the micro-batches' shares.

``train_step(state, batch) -> (state, metrics)`` runs, in one jitted computation
whose trainable parameters and optimizer state are donated: the per-step key
``fold_in(state.key, state.step)``; value and gradient w.r.t. the trainable half only,
over ``grad_accum`` micro-batches (`entrenar.optim.microbatched_value_and_grad`, a
``lax.scan`` over the batch split along its leading axis); the global gradient norm;
optional clipping; the optimizer update.
Metrics: ``loss``, ``grad_norm`` (before clipping), ``lr`` (when the optimizer state
holds one), ``tokens`` (for batches with ``attention_mask`` or ``input_ids``),
``finite`` and the loss function's own metrics.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from entrenar import distributed
from entrenar.errors import ConfigError, ShapeError
from entrenar.optim import (
    apply_gradients,
    apply_updates,
    clip_by_global_norm,
    get_lr,
    global_norm,
    microbatched_value_and_grad,
)
from entrenar.train.state import TrainState, combine
from entrenar.types import Params, PyTree

LossFn = Callable[..., Any]
Metrics = dict[str, jax.Array]


def takes_step(loss_fn: LossFn) -> bool:
    """Whether ``loss_fn`` has a ``step`` keyword (a schedule inside the loss).

    >>> takes_step(lambda p, b, *, key, step=None: 0.0), takes_step(lambda p, b: 0.0)
    (True, False)
    """
    try:
        params = inspect.signature(loss_fn).parameters
    except (TypeError, ValueError):  # builtins without a signature
        return False
    step = params.get("step")
    return step is not None and step.kind in (
        step.KEYWORD_ONLY,
        step.POSITIONAL_OR_KEYWORD,
    )


def takes_totals(loss_fn: LossFn) -> bool:
    """Whether ``loss_fn`` has ``counts(batch)`` and a ``totals`` keyword.

    Such a loss, given ``totals=counts(whole batch)``, returns a micro-batch's share
    of the whole batch's loss (`entrenar.optim.microbatched_value_and_grad`'s
    ``summed``); a wrapper (`functools.wraps`) is looked through.
    """
    inner = inspect.unwrap(loss_fn)
    if not callable(getattr(inner, "counts", None)):
        return False
    try:
        totals = inspect.signature(loss_fn).parameters.get("totals")
    except (TypeError, ValueError):
        return False
    return totals is not None and totals.kind in (
        totals.KEYWORD_ONLY,
        totals.POSITIONAL_OR_KEYWORD,
    )


def call_loss(
    loss_fn: LossFn,
    params: Params,
    batch: PyTree,
    key: Any,
    step: Any = None,
    totals: Any = None,
) -> tuple[jax.Array, Metrics]:
    """``(loss, metrics)`` from a loss function's result, float32.

    ``metrics["loss_weight"]`` is the loss function's weight (1 if it reports none),
    not differentiated.

    ``step`` (the optimizer step being taken) is passed only to a loss function
    that `takes_step`, such as a progressive distiller's.
    """
    kwargs: dict[str, Any] = {} if totals is None else {"totals": totals}
    if step is not None and takes_step(loss_fn):
        kwargs["step"] = step
    out = loss_fn(params, batch, key=key, **kwargs)
    loss, aux = out if isinstance(out, tuple) else (out, {})
    if jnp.ndim(loss) != 0:
        raise ShapeError(
            f"loss_fn must return a scalar loss (or (loss, metrics)); got shape "
            f"{tuple(jnp.shape(loss))}: reduce it, e.g. with jnp.mean"
        )
    aux = {k: jnp.asarray(v, jnp.float32) for k, v in dict(aux).items()}
    w = aux.get("loss_weight", jnp.float32(1.0))
    aux["loss_weight"] = jax.lax.stop_gradient(w)
    return jnp.asarray(loss, jnp.float32), aux


def batch_tokens(batch: PyTree) -> jax.Array | None:
    """Tokens in a batch: ``sum(attention_mask)``, else ``input_ids.size``."""
    if not isinstance(batch, dict):
        return None
    if "attention_mask" in batch:
        return jnp.sum(jnp.asarray(batch["attention_mask"]).astype(jnp.int32))
    if "input_ids" in batch:
        return jnp.int32(jnp.size(batch["input_ids"]))
    return None


def make_train_step(
    loss_fn: LossFn,
    optimizer: Any,
    *,
    grad_accum: int = 1,
    clip: float | None = None,
    skip_nonfinite: bool = False,
    mesh: Any = None,
    rules: distributed.ShardingRules | None = None,
) -> Callable[[TrainState, PyTree], tuple[TrainState, Metrics]]:
    """A pure, jitted, donated ``train_step(state, batch) -> (state, metrics)``.

    Args:
        loss_fn: ``loss_fn(params, batch, *, key) -> loss | (loss, metrics)``.
        optimizer: an ``(init, update)`` pair (entrenar.optim or optax) over the
            trainable half of a state from ``TrainState.create`` (which does the
            partition; the step only differentiates ``state.trainable``).
        grad_accum: micro-batches per step; the batch's leading axis is split in
            ``grad_accum`` equal parts, run one after another (``lax.scan``).
        clip: clip the gradient to this global norm before the optimizer.
        skip_nonfinite: when the loss or the gradient norm is not finite, keep the
            trainable params and optimizer state unchanged (the step counter still
            advances); ``metrics["finite"]`` tells which steps were skipped. The
            update runs in a `jax.lax.cond` branch: ``where(finite, new, old)``
            kept the old θ, m, v alive beside the new ones, so XLA copied all three
            (the native AdamW kernel updates them in place): 4 trainable-sized
            temporaries instead of 1 (the gradient), 10 GB of Qwen3-30B-A3B's
            expert-adapter step and 3× a full fine-tuning's parameters.
        mesh: a `jax.sharding.Mesh` from `entrenar.distributed.make_mesh` (the
            state placed by `distributed.shard_state`): each batch is split over
            its devices, and the gradients, new params and optimizer state are
            constrained to ``rules``' layout (specs/distributed.md).
        rules: `distributed.ShardingRules` (default ones if None).

    The arrays of ``state.trainable`` and ``state.opt_state`` are donated: use the
    returned state, not the one passed in.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from entrenar.optim import sgd
        >>> loss = lambda p, b, *, key: jnp.mean((b["x"] * p["w"] - b["y"]) ** 2)
        >>> s = TrainState.create({"w": jnp.float32(0.0)}, sgd(0.1),
        ...                       key=jax.random.key(0))
        >>> step = make_train_step(loss, sgd(0.1))
        >>> s, m = step(s, {"x": jnp.ones(4), "y": 2 * jnp.ones(4)})
        >>> float(m["loss"]), float(s.trainable["w"]), int(s.step)
        (4.0, 0.4000000059604645, 1)
    """
    k = int(grad_accum)
    if k < 1:
        raise ConfigError(f"grad_accum must be at least 1, got {grad_accum}")
    if clip is not None and not clip > 0:
        raise ConfigError(f"clip must be a positive norm or None, got {clip}")
    clipper = None if clip is None else clip_by_global_norm(float(clip))
    shares = takes_totals(loss_fn)

    def step(
        trainable: Params, opt_state: Any, frozen: Params, count: Any, root: Any,
        batch: PyTree,
    ) -> tuple[Params, Any, Any, Metrics]:  # fmt: skip
        key = jax.random.fold_in(root, count)

        # a loss counted two ways gets the whole batch's counts (takes_totals)
        totals = inspect.unwrap(loss_fn).counts(batch) if shares else None

        def f(t: Params, mb: PyTree, *, key: Any) -> tuple[jax.Array, Metrics]:
            return call_loss(loss_fn, combine(t, frozen), mb, key, count, totals)

        vg = microbatched_value_and_grad(f, k, has_aux=True, summed=shares)
        (loss, aux), grads = vg(trainable, batch, key=key)
        del aux["loss_weight"]
        if mesh is not None:  # FSDP: each device keeps its slice (reduce-scatter)
            layout = distributed.param_sharding(trainable, mesh, rules)
            grads = distributed.constrain(grads, layout)
        gnorm = global_norm(grads)
        metrics: Metrics = {"loss": loss, "grad_norm": gnorm, **aux}
        try:
            metrics["lr"] = jnp.asarray(get_lr(opt_state), jnp.float32)
        except ConfigError:
            pass
        tokens = batch_tokens(batch)
        if tokens is not None:
            metrics["tokens"] = tokens
        if clipper is not None:
            grads, _ = clipper.update(grads, clipper.init(None))

        def update() -> tuple[Params, Any]:
            if mesh is None:  # AdamW: one pass over θ, m, v (entrenar.optim.fused)
                return apply_gradients(optimizer, grads, opt_state, trainable)
            # sharded leaves: XLA's partitioner places the plain update
            updates, new_opt = optimizer.update(grads, opt_state, trainable)
            return apply_updates(trainable, updates), new_opt

        finite = jnp.isfinite(loss) & jnp.isfinite(gnorm)
        metrics["finite"] = finite
        if skip_nonfinite:  # a branch, not where(finite, new, old): see below
            keep = lambda: (trainable, opt_state)  # noqa: E731
            new_train, new_opt = jax.lax.cond(finite, update, keep)
        else:
            new_train, new_opt = update()
        if mesh is not None:  # the state keeps its layout from step to step
            new_train = distributed.constrain(new_train, layout)
            new_opt = distributed.constrain(
                new_opt,
                distributed.opt_state_sharding(opt_state, trainable, mesh, rules),
            )
        return new_train, new_opt, count + 1, metrics

    jitted = jax.jit(step, donate_argnums=(0, 1))

    def train_step(state: TrainState, batch: PyTree) -> tuple[TrainState, Metrics]:
        if mesh is not None:
            batch = distributed.shard_batch(batch, mesh)
        t, o, count, metrics = jitted(
            state.trainable, state.opt_state, state.frozen, state.step, state.key,
            batch,
        )  # fmt: skip
        return TrainState(t, state.frozen, o, count, state.key), metrics

    train_step.jitted = jitted  # type: ignore[attr-defined]
    return train_step


def make_eval_step(
    loss_fn: LossFn, *, mesh: Any = None
) -> Callable[[TrainState | Params, PyTree], Metrics]:
    """A jitted ``eval_step(state_or_params, batch) -> metrics`` (``key=None``).

    With a ``mesh``, a batch whose rows split over its devices is split, any other
    is replicated.

    Metrics: ``loss``, ``loss_weight`` (1 unless the loss function reports one, for
    weighting batches in a mean) and the loss function's own metrics.

    Example:
        >>> import jax.numpy as jnp
        >>> ev = make_eval_step(lambda p, b, *, key: jnp.sum(p * b["x"]))
        >>> float(ev(jnp.float32(2.0), {"x": jnp.ones(3)})["loss"])
        6.0
    """

    @jax.jit
    def run(params: Params, batch: PyTree, step: Any) -> Metrics:
        loss, aux = call_loss(loss_fn, params, batch, None, step)
        return {"loss": loss, **aux}

    def eval_step(state: TrainState | Params, batch: PyTree) -> Metrics:
        params, step = state, None
        if isinstance(state, TrainState):
            params, step = state.params, state.step
        if mesh is not None:
            batch = distributed.place_batch(batch, mesh)
        return run(params, batch, step)

    return eval_step


__all__ = [
    "LossFn",
    "Metrics",
    "batch_tokens",
    "call_loss",
    "make_eval_step",
    "make_train_step",
    "takes_step",
    "takes_totals",
]
