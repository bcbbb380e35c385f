"""`TrainState`: everything a training run carries from one step to the next.

The parameters are kept as two halves (the idea of `entrenar.lora.split`): the
``trainable`` half, which is differentiated and updated, and the ``frozen`` half, which
is only read. Both keep the tree's structure with ``None`` where the other half holds
the leaf, so ``combine(trainable, frozen)`` is the whole tree and optimizers run on
``trainable`` directly (they keep no state for frozen weights). Which leaves are
trainable is one of:

- ``None``: every leaf (``frozen`` is ``None``);
- ``"lora"``: the LoRA adapters ``A``, ``B`` (`entrenar.lora.split`);
- a mask: a tree of Python bools like the params, or a predicate
  ``fn(dotted_name, leaf) -> bool`` (`entrenar.optim.resolve_mask`).

The step counter and the root key make randomness a function of the step: step ``t``
uses ``fold_in(key, t)``, so a resumed run draws what an uninterrupted one would.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from entrenar import lora
from entrenar.errors import ConfigError
from entrenar.optim import resolve_mask
from entrenar.types import OptState, Params, PRNGKey

Trainable = Any
"""``None`` (all), ``"lora"``, a bool tree like the params, or ``fn(name, leaf)``."""


def partition(params: Params, trainable: Trainable = None) -> tuple[Params, Params]:
    """Split ``params`` into ``(trainable, frozen)`` halves (see the module docstring).

    Example:
        >>> import jax.numpy as jnp
        >>> t, f = partition({"w": jnp.ones(2), "b": jnp.zeros(2)}, {"w": True,
        ...                  "b": False})
        >>> t["b"] is None, f["w"] is None
        (True, True)
    """
    if trainable is None:
        return params, None
    if isinstance(trainable, str):
        if trainable != "lora":
            raise ConfigError(
                f"trainable must be None, 'lora', a bool tree or a predicate; got "
                f"{trainable!r}"
            )
        t, f = lora.split(params)
        if not jax.tree_util.tree_leaves(t):
            raise ConfigError(
                "trainable='lora' but the params hold no LoRA adapter; wrap weights "
                "first with entrenar.lora.apply(params, LoRAConfig(...), key=...)"
            )
        return t, f
    mask = resolve_mask(trainable, params)
    if not any(jax.tree_util.tree_leaves(mask)):
        raise ConfigError("the trainable mask selects no parameter")
    t = jax.tree_util.tree_map(lambda m, x: x if m else None, mask, params)
    f = jax.tree_util.tree_map(lambda m, x: None if m else x, mask, params)
    return t, f


_take = jax.jit(lambda x: x, donate_argnums=0)


def _owned(x: Any) -> jax.Array:
    """``x`` in memory XLA owns, so that a train step can update it in place.

    A loaded leaf aliases the load's page-aligned host buffer (`to_device`); XLA
    cannot donate memory it does not own, so a step given it would write its output
    beside it: a second trainable half at the first step's peak. The donated
    identity costs nothing for an array XLA owns (the output is the input) and
    copies one that it does not, whose buffer goes with ``x`` (deleted): one leaf
    at a time, not the half.
    """
    return jax.block_until_ready(
        _take(x if isinstance(x, jax.Array) else jnp.asarray(x))
    )


def combine(trainable: Params, frozen: Params) -> Params:
    """Inverse of `partition`: the whole tree (``lora.combine`` covers both kinds)."""
    if frozen is None:
        return trainable
    return lora.combine(trainable, frozen)


class TrainState(NamedTuple):
    """The state of a run, a pytree (jit it, donate it, checkpoint it).

    Attributes:
        trainable: the differentiated half of the params.
        frozen: the rest (``None`` when everything trains).
        opt_state: the optimizer's state over ``trainable``.
        step: ``()`` int32, optimizer steps taken.
        key: the root random key; step ``t`` uses ``fold_in(key, t)``.
    """

    trainable: Params
    frozen: Params
    opt_state: OptState
    step: jax.Array
    key: PRNGKey

    @classmethod
    def create(
        cls,
        params: Params,
        optimizer: Any,
        *,
        key: PRNGKey,
        trainable: Trainable = None,
        copy: bool = True,
    ) -> TrainState:
        """A state at step 0.

        The trainable half is copied (the train step donates it, so the caller's
        arrays stay usable); the frozen half is shared, never donated. With
        ``copy=False`` the state takes the caller's trainable arrays (they are
        deleted), moved a leaf at a time into memory XLA owns where they alias a
        host buffer (`_owned`), so that the trainable half is never held twice (a
        full fine-tuning's whole model), not even by the first step.

        Example:
            >>> import jax, jax.numpy as jnp
            >>> from entrenar.optim import sgd
            >>> k = jax.random.key(0)
            >>> s = TrainState.create({"w": jnp.ones(2)}, sgd(0.1), key=k)
            >>> int(s.step), s.frozen is None
            (0, True)
        """
        t, f = partition(params, trainable)
        t = jax.tree_util.tree_map(
            lambda x: jnp.array(x, copy=True) if copy else _owned(x), t
        )
        if not jnp.issubdtype(jnp.asarray(key).dtype, jax.dtypes.prng_key):
            key = jax.random.wrap_key_data(jnp.asarray(key))
        return cls(t, f, optimizer.init(t), jnp.zeros([], jnp.int32), key)

    @property
    def params(self) -> Params:
        """The whole parameter tree."""
        return combine(self.trainable, self.frozen)


__all__ = ["TrainState", "Trainable", "combine", "partition"]
