"""The optimizer protocol: `GradientTransformation`, `chain`, `apply_updates`.

An optimizer is a pair of pure functions (the protocol optax defined, so the two
libraries interoperate in both directions)::

    state = tx.init(params)
    updates, state = tx.update(grads, state, params)
    params = apply_updates(params, updates)          # params + updates

States are NamedTuples named ``<Name>State`` holding arrays only, so a state is a pytree
that ``jax.jit`` traces, donates and checkpoints like the parameters.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

import jax
import jax.numpy as jnp

from entrenar.errors import ConfigError
from entrenar.types import OptState, Params, PyTree, Updates


class TransformInitFn(Protocol):
    """``init(params) -> state``."""

    def __call__(self, params: Params) -> OptState: ...  # noqa: D102


class TransformUpdateFn(Protocol):
    """``update(updates, state, params=None) -> (updates, state)``."""

    def __call__(  # noqa: D102
        self, updates: Updates, state: OptState, params: Params | None = None
    ) -> tuple[Updates, OptState]: ...


class TransformApplyFn(Protocol):
    """``apply(grads, state, params) -> (new_params, new_state)``."""

    def __call__(  # noqa: D102
        self, grads: Updates, state: OptState, params: Params
    ) -> tuple[Params, OptState]: ...


class GradientTransformation(NamedTuple):
    """A pure optimizer (or a piece of one): ``(init, update)``.

    Attributes:
        init: ``init(params) -> state``; the state holds arrays only.
        update: ``update(updates, state, params=None) -> (updates, new_state)``;
            a pure function, safe under ``jax.jit``; ``params`` is needed only by
            transforms that read the parameters (weight decay).
        apply: optional ``apply(grads, state, params) -> (new_params, new_state)``,
            equal to ``update`` followed by `apply_updates` but done in one pass
            (`adamw` sets it: `entrenar.optim.fused`); use it through
            `apply_gradients`, which falls back to ``update`` + `apply_updates`.

    Any object with ``init`` and ``update`` of these signatures (an optax
    ``GradientTransformation`` included) can be used where one is expected.
    """

    init: TransformInitFn
    update: TransformUpdateFn
    apply: TransformApplyFn | None = None


class EmptyState(NamedTuple):
    """The state of a stateless transformation (it holds nothing)."""


class MaskedNode(NamedTuple):
    """Placeholder for a masked-out leaf: a pytree node with no leaves (no memory)."""


def identity() -> GradientTransformation:
    """The transformation that returns the updates unchanged.

    >>> import jax.numpy as jnp
    >>> tx = identity()
    >>> tx.update({"w": jnp.ones(2)}, tx.init(None))[0]["w"].tolist()
    [1.0, 1.0]
    """
    return stateless(lambda updates, params: updates)


def stateless(
    fn: Callable[[Updates, Params | None], Updates],
) -> GradientTransformation:
    """A transformation from a pure function ``fn(updates, params) -> updates``.

    >>> import jax.numpy as jnp
    >>> neg = stateless(lambda u, p: jax.tree_util.tree_map(jnp.negative, u))
    >>> neg.update(jnp.ones(2), neg.init(None))[0].tolist()
    [-1.0, -1.0]
    """

    def init(params: Params) -> EmptyState:
        del params
        return EmptyState()

    def update(
        updates: Updates, state: OptState, params: Params | None = None
    ) -> tuple[Updates, OptState]:
        return fn(updates, params), state

    return GradientTransformation(init, update)


def chain(*transforms: Any) -> GradientTransformation:
    r"""Compose transformations: the updates flow through them in order.

    The state is the tuple of the pieces' states. Pieces may be entrenar or optax
    transformations (anything with ``init`` and ``update``).

    .. math:: u \leftarrow T_n(\dots T_2(T_1(g)))

    Example:
        >>> import jax.numpy as jnp
        >>> from entrenar.optim import scale, scale_by_adam
        >>> tx = chain(scale_by_adam(), scale(-0.1))
        >>> u, s = tx.update({"w": jnp.array([2.0])}, tx.init({"w": jnp.zeros(1)}))
        >>> round(float(u["w"][0]), 4)
        -0.1
    """
    pieces = tuple(transforms)

    def init(params: Params) -> tuple[OptState, ...]:
        return tuple(t.init(params) for t in pieces)

    def update(
        updates: Updates, state: OptState, params: Params | None = None
    ) -> tuple[Updates, OptState]:
        if len(state) != len(pieces):
            raise ConfigError(
                f"chain of {len(pieces)} transformations got a state with "
                f"{len(state)} parts; create the state with this chain's init()"
            )
        new_state = []
        for t, s in zip(pieces, state):
            updates, s = t.update(updates, s, params)
            new_state.append(s)
        return updates, tuple(new_state)

    return GradientTransformation(init, update)


def apply_updates(params: Params, updates: Updates) -> Params:
    """Add the updates to the parameters, keeping each parameter's dtype.

    The sum is taken in the wider of the two dtypes, then cast back to the
    parameter's dtype (so bf16 parameters may take float32 updates). ``None`` leaves
    (absent parameters) stay ``None``.

    >>> import jax.numpy as jnp
    >>> apply_updates({"w": jnp.ones(2)}, {"w": jnp.full(2, -0.5)})["w"].tolist()
    [0.5, 0.5]
    """

    def add(p: Any, u: Any) -> Any:
        if p is None:
            return None
        p = jnp.asarray(p)
        dtype = jnp.promote_types(p.dtype, jnp.asarray(u).dtype)
        return (p.astype(dtype) + jnp.asarray(u).astype(dtype)).astype(p.dtype)

    return jax.tree_util.tree_map(add, params, updates, is_leaf=lambda x: x is None)


def apply_gradients(
    tx: Any, grads: Updates, state: OptState, params: Params
) -> tuple[Params, OptState]:
    """One optimizer step: ``(new_params, new_state)``.

    ``tx.apply`` when the transformation has one (one pass over the parameters and
    the state, `entrenar.optim.fused`), else ``tx.update`` then `apply_updates`; the
    two give the same values.

    >>> import jax.numpy as jnp
    >>> from entrenar.optim import sgd
    >>> tx = sgd(0.5)
    >>> p, _ = apply_gradients(tx, jnp.ones(1), tx.init(jnp.ones(1)), jnp.ones(1))
    >>> p.tolist()
    [0.5]
    """
    fused = getattr(tx, "apply", None)
    if fused is not None:
        return fused(grads, state, params)
    updates, state = tx.update(grads, state, params)
    return apply_updates(params, updates), state


def tree_zeros_like(tree: PyTree, dtype: Any = None) -> PyTree:
    """Zeros with the structure and shapes of ``tree`` (in ``dtype`` if given)."""
    return jax.tree_util.tree_map(lambda x: jnp.zeros_like(x, dtype=dtype), tree)


def safe_increment(count: jax.Array) -> jax.Array:
    """``count + 1``, saturating at the largest int32 (so it never wraps to < 0)."""
    big = jnp.iinfo(jnp.int32).max
    return jnp.where(count < big, count + 1, big).astype(jnp.int32)


__all__ = [
    "EmptyState",
    "GradientTransformation",
    "MaskedNode",
    "TransformApplyFn",
    "TransformInitFn",
    "TransformUpdateFn",
    "apply_gradients",
    "apply_updates",
    "chain",
    "identity",
    "safe_increment",
    "stateless",
    "tree_zeros_like",
]
