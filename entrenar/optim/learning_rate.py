"""Scaling by the learning rate, with the rate kept in the state.

``scale_by_learning_rate(lr)`` multiplies the updates by ``-lr``. The rate lives in the
optimizer state as a float32 array, so it can be logged (`get_lr`) and changed between
steps (`set_lr`) without rebuilding the optimizer or recompiling a jitted step:

- a number gives `LearningRateState(lr)`: every update uses ``state.lr``; `set_lr`
  replaces it;
- a schedule gives `ScheduleState(count, lr)`: the update uses ``schedule(count)``;
  ``state.lr`` holds the rate of the *next* update, for logging. `set_lr` refuses it
  (the schedule would overwrite the value).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from entrenar.errors import ConfigError
from entrenar.optim.base import (
    GradientTransformation,
    safe_increment,
    stateless,
)
from entrenar.optim.schedules import Schedule
from entrenar.types import OptState, Params, Updates


class LearningRateState(NamedTuple):
    """State of `scale_by_learning_rate` with a fixed (settable) rate."""

    lr: jax.Array  # () float32


class ScheduleState(NamedTuple):
    """State of `scale_by_learning_rate` with a schedule."""

    count: jax.Array  # type: ignore[assignment]  # () int32, updates applied
    lr: jax.Array  # () float32, rate of the next update: schedule(count)


def _scale_tree(updates: Updates, factor: jax.Array) -> Updates:
    return jax.tree_util.tree_map(lambda u: u * factor.astype(u.dtype), updates)


def scale(step_size: float) -> GradientTransformation:
    """Multiply the updates by a constant: ``u ← step_size · u`` (no state).

    >>> import jax.numpy as jnp
    >>> tx = scale(-2.0)
    >>> tx.update(jnp.ones(2), tx.init(None))[0].tolist()
    [-2.0, -2.0]
    """
    return stateless(
        lambda updates, params: _scale_tree(updates, jnp.float32(step_size))
    )


def scale_by_learning_rate(
    learning_rate: float | Schedule, *, flip_sign: bool = True
) -> GradientTransformation:
    """``u ← -η_t · u``, ``η_t`` a number or ``schedule(t)``, kept in the state.

    Args:
        learning_rate: a number or a schedule ``fn(step) -> lr``.
        flip_sign: multiply by ``-η`` (descent, the default) instead of ``η``.

    Example:
        >>> import jax.numpy as jnp
        >>> tx = scale_by_learning_rate(0.5)
        >>> s = tx.init(None)
        >>> tx.update(jnp.ones(1), set_lr(s, 0.25))[0].tolist()
        [-0.25]
    """
    sign = -1.0 if flip_sign else 1.0

    if callable(learning_rate):
        schedule = learning_rate

        def init_s(params: Params) -> ScheduleState:
            del params
            count = jnp.zeros([], jnp.int32)
            return ScheduleState(count, jnp.asarray(schedule(count), jnp.float32))

        def update_s(
            updates: Updates, state: OptState, params: Params | None = None
        ) -> tuple[Updates, OptState]:
            del params
            lr = jnp.asarray(schedule(state.count), jnp.float32)
            count = safe_increment(state.count)
            nxt = jnp.asarray(schedule(count), jnp.float32)
            return _scale_tree(updates, sign * lr), ScheduleState(count, nxt)

        return GradientTransformation(init_s, update_s)

    def init(params: Params) -> LearningRateState:
        del params
        return LearningRateState(jnp.asarray(learning_rate, jnp.float32))

    def update(
        updates: Updates, state: OptState, params: Params | None = None
    ) -> tuple[Updates, OptState]:
        del params
        return _scale_tree(updates, sign * state.lr), state

    return GradientTransformation(init, update)


def _is_lr_node(x: Any) -> bool:
    return isinstance(x, (LearningRateState, ScheduleState)) or _is_optax_inject(x)


def _is_optax_inject(x: Any) -> bool:
    # optax.inject_hyperparams states carry a dict ``hyperparams`` with the rate.
    hp = getattr(x, "hyperparams", None)
    return isinstance(hp, dict) and "learning_rate" in hp


def _lr_nodes(state: OptState) -> list[Any]:
    leaves = jax.tree_util.tree_leaves(state, is_leaf=_is_lr_node)
    return [x for x in leaves if _is_lr_node(x)]


def get_lr(state: OptState) -> jax.Array:
    """The learning rate the next update will use (float32 scalar).

    Looks through any nesting (`chain`, masks, accumulation) for the state of
    `scale_by_learning_rate` (or of ``optax.inject_hyperparams``).

    Raises:
        ConfigError: the state holds no learning rate.
    """
    nodes = _lr_nodes(state)
    if not nodes:
        raise ConfigError(
            "this optimizer state holds no learning rate: build the optimizer with "
            "entrenar.optim.scale_by_learning_rate (sgd/adam/adamw do)"
        )
    node = nodes[0]
    if _is_optax_inject(node):
        return jnp.asarray(node.hyperparams["learning_rate"], jnp.float32)
    return node.lr


def refresh_lr(optimizer: Any, state: OptState, params: Params) -> OptState:
    """``state`` whose `ScheduleState` rates are ``optimizer``'s schedule at its count.

    A `ScheduleState` stores ``lr = schedule(count)``, the rate of the next update,
    for `get_lr`; the update computes ``schedule(count)`` anew. A state restored from
    a checkpoint written under another schedule (``scheduler`` changed at resume)
    stores the old schedule's rate, so `get_lr` would name a rate the next update
    does not use. Here one update from ``count - 1`` (its updates ``params`` itself;
    only the rates are returned, so XLA computes nothing else) gives each schedule's
    ``schedule(count)``. Other nodes (a fixed rate, optax's) and a count of 0 are
    kept.
    """

    def is_schedule(x: Any) -> bool:
        return isinstance(x, ScheduleState)

    def schedules(tree: OptState) -> list[ScheduleState]:
        return [n for n in _lr_nodes(tree) if is_schedule(n)]

    if not schedules(state):
        return state

    def rates(st: OptState, p: Params) -> list[jax.Array]:
        back = jax.tree_util.tree_map(
            lambda n: n._replace(count=jnp.maximum(n.count, 1) - 1)
            if is_schedule(n) else n,
            st, is_leaf=_is_lr_node,
        )  # fmt: skip
        _, new = optimizer.update(p, back, p)
        return [
            jnp.where(old.count > 0, n.lr, old.lr)
            for old, n in zip(schedules(st), schedules(new))
        ]

    fresh = iter(jax.jit(rates)(state, params))
    return jax.tree_util.tree_map(
        lambda n: n._replace(lr=next(fresh)) if is_schedule(n) else n,
        state, is_leaf=_is_lr_node,
    )  # fmt: skip


def set_lr(state: OptState, lr: Any) -> OptState:
    """A copy of ``state`` whose next updates use learning rate ``lr``.

    Pure and jit-friendly (``lr`` may be a traced scalar); no recompilation.

    Raises:
        ConfigError: the state holds no settable rate (none at all, or a schedule).
    """
    nodes = _lr_nodes(state)
    if not nodes:
        get_lr(state)  # raises the explanatory error
    if any(isinstance(n, ScheduleState) for n in nodes):
        raise ConfigError(
            "the learning rate follows a schedule and cannot be set; build the "
            "optimizer with a number as learning rate to use set_lr"
        )

    def replace(node: Any) -> Any:
        if isinstance(node, LearningRateState):
            return LearningRateState(jnp.asarray(lr, jnp.float32).reshape(()))
        if _is_optax_inject(node):
            old = node.hyperparams["learning_rate"]
            hp = dict(node.hyperparams)
            hp["learning_rate"] = jnp.asarray(lr, jnp.asarray(old).dtype).reshape(())
            return node._replace(hyperparams=hp)
        return node

    return jax.tree_util.tree_map(replace, state, is_leaf=_is_lr_node)


__all__ = [
    "LearningRateState",
    "ScheduleState",
    "get_lr",
    "refresh_lr",
    "scale",
    "scale_by_learning_rate",
    "set_lr",
]
