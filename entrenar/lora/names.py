"""Hugging Face module names of (possibly stacked) weight leaves.

A parameter tree names its leaves by dotted key paths (`entrenar.tree.key_path_str`).
The leaf ``<module>.weight`` belongs to the Hugging Face module ``<module>``. Stacked
layers (the leaves under a ``layers`` key, GPT-2's ``h``, not followed by a layer
index) carry a leading axis ``L``; layer ``i`` is the module with ``layers.{i}`` in
its name (specs/conventions.md).
"""

from __future__ import annotations

from typing import Any

from entrenar import nn
from entrenar.nn.hf_names import stacked_split
from entrenar.nn.weight_node import is_weight_node
from entrenar.tree import tree_named_leaves

STACKED_KEYS: tuple[str, ...] = nn.STACKED_KEYS
"""Dict keys under which transformer layers are stacked along axis 0."""


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


def named_weight_leaves(params: Any) -> list[tuple[str, Any]]:
    """``(dotted_path, leaf)`` pairs with weight nodes kept whole."""
    return tree_named_leaves(params, is_leaf=is_weight_node)


__all__ = [
    "STACKED_KEYS",
    "hf_modules",
    "named_weight_leaves",
    "stacked_split",
]
