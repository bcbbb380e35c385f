"""Masks: apply a transformation to some leaves only; freeze the others.

A mask is either a pytree of Python bools with the structure of the params, or a
predicate ``fn(name, leaf) -> bool`` on each leaf's dotted key path (the Hugging Face
module name, e.g. ``"layers.self_attn.q_proj.weight"``). Masked-out leaves are replaced
by `MaskedNode` (a pytree node with no leaves) before the inner transformation sees
them, so the inner transformation keeps **no state** for them: no memory.

- `masked` (optax's semantics): masked-out updates pass through unchanged. Used for
  "weight decay on matrices only".
- `freeze`: masked-out leaves are frozen: their update is zero.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from entrenar.errors import ConfigError, ShapeError
from entrenar.optim.base import GradientTransformation, MaskedNode
from entrenar.tree import key_path_str
from entrenar.types import OptState, Params, PyTree, Updates

Mask = PyTree | Callable[[str, Any], bool]
"""A pytree of bools like the params, or a predicate ``fn(name, leaf) -> bool``."""


class MaskedState(NamedTuple):
    """State of `masked` / `freeze`: the inner state over the selected leaves."""

    inner_state: OptState


def resolve_mask(mask: Mask, tree: PyTree) -> PyTree:
    """The mask as a pytree of Python bools with the structure of ``tree``.

    >>> import jax.numpy as jnp
    >>> p = {"w": jnp.ones((2, 2)), "b": jnp.ones(2)}
    >>> resolve_mask(lambda name, x: name.endswith("w"), p)
    {'b': False, 'w': True}

    Raises:
        ShapeError: a mask tree whose structure differs from ``tree``.
        ConfigError: mask values that are not Python bools.
    """
    if callable(mask):
        flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
        return jax.tree_util.tree_unflatten(
            treedef, [bool(mask(key_path_str(path), leaf)) for path, leaf in flat]
        )
    t_def = jax.tree_util.tree_structure(tree)
    m_def = jax.tree_util.tree_structure(mask)
    if t_def != m_def:  # type: ignore[operator]
        raise ShapeError(
            f"the mask's structure {m_def} differs from the parameters' {t_def}; "
            "give one bool per parameter leaf, or a predicate fn(name, leaf)"
        )
    for path, m in jax.tree_util.tree_flatten_with_path(mask)[0]:
        if not isinstance(m, (bool, np.bool_)):
            raise ConfigError(
                f"mask value at {key_path_str(path)!r} is {type(m).__name__}; masks "
                "hold Python bools (they decide the state's structure, so they must "
                "be static)"
            )
    return jax.tree_util.tree_map(bool, mask)


def mask_tree(tree: PyTree, mask: PyTree) -> PyTree:
    """``tree`` with every leaf whose mask is False replaced by `MaskedNode()`."""
    return jax.tree_util.tree_map(
        lambda keep, x: x if keep else MaskedNode(), mask, tree
    )


def _wrap(inner: Any, mask: Mask, frozen_update: bool) -> GradientTransformation:
    def init(params: Params) -> MaskedState:
        m = resolve_mask(mask, params)
        return MaskedState(inner.init(mask_tree(params, m)))

    def update(
        updates: Updates, state: OptState, params: Params | None = None
    ) -> tuple[Updates, OptState]:
        m = resolve_mask(mask, updates if params is None else params)
        sub_params = None if params is None else mask_tree(params, m)
        new_u, inner_state = inner.update(
            mask_tree(updates, m), state.inner_state, sub_params
        )

        def pick(keep: bool, new: Any, old: Any) -> Any:
            if keep:
                return new
            return jnp.zeros_like(old) if frozen_update else old

        return jax.tree_util.tree_map(pick, m, new_u, updates), MaskedState(inner_state)

    return GradientTransformation(init, update)


def masked(inner: Any, mask: Mask) -> GradientTransformation:
    """Apply ``inner`` where ``mask`` is True; elsewhere pass updates through.

    The inner transformation holds state only for the selected leaves.

    Example:
        >>> import jax.numpy as jnp
        >>> from entrenar.optim import add_decayed_weights
        >>> p = {"w": jnp.ones(1), "b": jnp.ones(1)}
        >>> tx = masked(add_decayed_weights(0.5), {"w": True, "b": False})
        >>> u, _ = tx.update({"w": jnp.zeros(1), "b": jnp.zeros(1)}, tx.init(p), p)
        >>> u["w"].tolist(), u["b"].tolist()
        ([0.5], [0.0])
    """
    return _wrap(inner, mask, frozen_update=False)


def freeze(inner: Any, trainable: Mask) -> GradientTransformation:
    """Train the leaves where ``trainable`` is True; freeze the others.

    Frozen leaves get a zero update (exactly: ``θ + 0 = θ``) and no optimizer state.

    Example:
        >>> import jax.numpy as jnp
        >>> from entrenar.optim import adam
        >>> p = {"base": jnp.ones(3), "lora_a": jnp.ones(3)}
        >>> tx = freeze(adam(0.1), lambda name, x: name.startswith("lora"))
        >>> s = tx.init(p)
        >>> u, s = tx.update(p, s, p)
        >>> u["base"].tolist(), "base" in s.inner_state[0].mu
        ([0.0, 0.0, 0.0], True)
        >>> s.inner_state[0].mu["base"]
        MaskedNode()
    """
    return _wrap(inner, trainable, frozen_update=True)


_NO_DECAY = re.compile(
    r"bias|layernorm|rmsnorm|(?:^|\.)norm(?:$|\.)|_norm(?:$|\.)"  # HF's names
    r"|(?:^|\.)ln_\w+(?:$|\.)"  # GPT-2's LayerNorm modules (HF: by type)
)


def hf_decay_mask(name: str, leaf: Any = None) -> bool:
    """Whether Hugging Face's Trainer decays the leaf ``name``: not biases nor norms.

    ``transformers.Trainer.get_decay_parameter_names`` leaves out every parameter
    whose lowercased name contains ``bias``, ``layernorm``, ``rmsnorm``, a module
    named ``norm`` or ending in ``_norm``, and those of ``nn.LayerNorm`` modules
    (GPT-2's ``ln_1``, ``ln_2``, ``ln_f``). A mask for `entrenar.optim.adamw`'s
    and `entrenar.optim.sgd`'s weight decay; a run's ``optimizer:`` uses it unless
    ``decay_norms_and_biases: true``.

    >>> [hf_decay_mask(n) for n in ("model.layers.mlp.up_proj.weight",
    ...  "model.norm.weight", "model.layers.self_attn.q_norm.weight",
    ...  "model.layers.self_attn.q_proj.bias", "transformer.h.ln_1.weight")]
    [True, False, False, False, False]
    """
    del leaf
    return _NO_DECAY.search(name.lower()) is None


__all__ = [
    "Mask",
    "MaskedState",
    "freeze",
    "hf_decay_mask",
    "mask_tree",
    "masked",
    "resolve_mask",
]
