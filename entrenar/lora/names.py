"""Hugging Face module names of (possibly stacked) weight leaves.

A parameter tree names its leaves by dotted key paths (`entrenar.tree.key_path_str`).
The leaf ``<module>.weight`` belongs to the Hugging Face module ``<module>``. Stacked
layers (the leaves under a ``layers`` key, GPT-2's ``h``, not followed by a layer
index) carry a leading axis ``L``; layer ``i`` is the module with ``layers.{i}`` in
its name (specs/conventions.md).
"""

from __future__ import annotations

from typing import Any

import jax

from entrenar import nn
from entrenar.lora.weight import LoRAWeight
from entrenar.tree import key_path_str, list_index

STACKED_KEYS: tuple[str, ...] = nn.STACKED_KEYS
"""Dict keys under which transformer layers are stacked along axis 0."""


def is_weight_leaf(x: Any) -> bool:
    """Leaves of LoRA's traversals: arrays and weight nodes, never containers.

    Dicts, lists and tuples (NamedTuples included) are walked; any other registered
    node (``LoRAWeight``, ``QuantizedWeight``) is one weight, treated as a whole.
    """
    if isinstance(x, LoRAWeight):
        return True
    return x is not None and not isinstance(x, dict | list | tuple)


def stacked_split(
    path: str, stacked_keys: tuple[str, ...] = STACKED_KEYS
) -> tuple[str, str] | None:
    """``("model.layers", "self_attn.q_proj.weight")`` for a stacked leaf, else None.

    >>> stacked_split("model.layers.self_attn.q_proj.weight")
    ('model.layers', 'self_attn.q_proj.weight')
    >>> stacked_split("model.layers.3.self_attn.q_proj.weight") is None
    True
    >>> stacked_split("layers.[0].weight") is None  # a stored list position
    True
    """
    parts = path.split(".")
    for j, p in enumerate(parts[:-1]):
        if p in stacked_keys and list_index(parts[j + 1]) is None:
            return ".".join(parts[: j + 1]), ".".join(parts[j + 1 :])
    return None


def hf_modules(
    path: str, shape: tuple[int, ...], stacked_keys: tuple[str, ...] = STACKED_KEYS
) -> list[str]:
    """Hugging Face module names of the weight at ``path``; ``[]`` if not a weight.

    Args:
        path: dotted key path of the leaf, ending in ``.weight``.
        shape: the leaf's logical shape (``(L, out, in)`` when stacked).
        stacked_keys: the keys under which layers are stacked.

    >>> hf_modules("model.layers.mlp.up_proj.weight", (2, 8, 4))
    ['model.layers.0.mlp.up_proj', 'model.layers.1.mlp.up_proj']
    >>> hf_modules("lm_head.weight", (10, 4))
    ['lm_head']
    """
    if not path.endswith(".weight") or len(shape) < 2:
        return []
    module = path[: -len(".weight")]
    split = stacked_split(module + ".weight", stacked_keys)
    if split is None:
        return [module]
    head, tail = split
    tail = tail[: -len(".weight")]
    return [f"{head}.{i}.{tail}" for i in range(shape[0])]


def leaf_shape(x: Any) -> tuple[int, ...]:
    """Logical shape of an array, a ``jax.ShapeDtypeStruct`` or a weight node."""
    shape = getattr(x, "shape", None)
    return tuple(int(s) for s in shape) if shape is not None else ()


def named_weight_leaves(params: Any) -> list[tuple[str, Any]]:
    """``(dotted_path, leaf)`` pairs with weight nodes kept whole."""
    flat, _ = jax.tree_util.tree_flatten_with_path(params, is_leaf=is_weight_leaf)
    return [(key_path_str(p), leaf) for p, leaf in flat]


__all__ = [
    "STACKED_KEYS",
    "hf_modules",
    "is_weight_leaf",
    "leaf_shape",
    "named_weight_leaves",
    "stacked_split",
]
