"""The leaves being merged: their names, layer layout, weight nodes and checks.

A tree is flattened to ``{dotted name: leaf}`` with weight nodes (`LoRAWeight`,
`QuantizedWeight`, ...) kept whole and sized by `entrenar.nn`'s weight-node
protocol. A leaf under a stacked key (``layers``, ``h`` not followed by an index)
has a leading layer axis ``L`` (specs/conventions.md) and is merged layer by layer;
a leaf named ``...layers.{i}...`` (Hugging Face's flat names) is layer ``i`` of
``N``, ``N`` counted over the tree. `Layout` records both, with each layer's Hugging
Face name and depth fraction for parameter schedules.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from entrenar.errors import CompatibilityError, DTypeError, ShapeError
from entrenar.lora.names import stacked_split
from entrenar.nn import STACKED_KEYS, is_weight_node, logical_dtype, logical_shape
from entrenar.tree import key_path_str, list_index
from entrenar.types import PyTree


@dataclasses.dataclass(frozen=True)
class Layout:
    """How a leaf splits into layers.

    Attributes:
        stacked: the leaf's axis 0 is the layer axis.
        layer_names: Hugging Face name of each layer's tensor (one entry for a leaf
            that is not stacked: its own name).
        fractions: each layer's depth fraction ``i / (N - 1)`` (1 when ``N = 1``; 0
            for tensors outside the layers, as mergekit).
    """

    stacked: bool
    layer_names: tuple[str, ...]
    fractions: tuple[float, ...]


def _indexed_layer(name: str) -> tuple[str, int] | None:
    """``("model.layers", 3)`` for ``model.layers.3.mlp.up_proj.weight``, else None."""
    parts = name.split(".")
    for j, p in enumerate(parts[:-1]):
        index = list_index(parts[j + 1])
        if p in STACKED_KEYS and index is not None:
            return ".".join(parts[: j + 1]), index
    return None


def _fraction(i: int, n: int) -> float:
    return i / (n - 1) if n > 1 else 1.0


def layouts(shapes: Mapping[str, tuple[int, ...]]) -> dict[str, Layout]:
    """The `Layout` of every leaf, from the names and logical shapes of a tree.

    >>> out = layouts({"model.layers.w": (3, 2), "model.norm.weight": (2,)})
    >>> out["model.layers.w"].layer_names
    ('model.layers.0.w', 'model.layers.1.w', 'model.layers.2.w')
    >>> out["model.layers.w"].fractions, out["model.norm.weight"].fractions
    ((0.0, 0.5, 1.0), (0.0,))
    """
    depth: dict[str, int] = {}
    for name in shapes:
        hit = _indexed_layer(name)
        if hit:
            depth[hit[0]] = max(depth.get(hit[0], 0), hit[1] + 1)
    out = {}
    for name, shape in shapes.items():
        split = stacked_split(name)
        if split and len(shape) >= 1:
            n = shape[0]
            names = tuple(f"{split[0]}.{i}.{split[1]}" for i in range(n))
            out[name] = Layout(True, names, tuple(_fraction(i, n) for i in range(n)))
            continue
        hit = _indexed_layer(name)
        frac = _fraction(hit[1], depth[hit[0]]) if hit else 0.0
        out[name] = Layout(False, (name,), (frac,))
    return out


def num_layers(shapes: Mapping[str, tuple[int, ...]]) -> int:
    """The depth of a tree: its stacked leaves' axis 0 or its largest layer index + 1.

    >>> num_layers({"model.layers.w": (4, 2)}), num_layers({"h.2.w": (2,)})
    (4, 3)
    """
    depth = 0
    for name, shape in shapes.items():
        hit = _indexed_layer(name)
        if hit:
            depth = max(depth, hit[1] + 1)
        elif stacked_split(name) and shape:
            depth = max(depth, shape[0])
    return depth


def named_leaves(tree: PyTree) -> tuple[dict[str, Any], Any]:
    """``({dotted name: leaf}, treedef)`` with weight nodes kept whole."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_weight_node)
    return {key_path_str(p): x for p, x in flat}, treedef


def is_floating(dtype: np.dtype) -> bool:
    """Whether a dtype is a float (bfloat16 included)."""
    return bool(np.issubdtype(dtype, np.floating)) or dtype.name == "bfloat16"


def check_leaves(
    labels: Sequence[str], leaves: Sequence[Mapping[str, Any]], *, same_dtype: bool
) -> None:
    """Raise unless every tree has the same leaf names, shapes (and dtypes).

    Raises:
        CompatibilityError: the names differ (the message lists them).
        ShapeError: a leaf's shapes differ (naming the leaf and the trees).
        DTypeError: a leaf's dtypes differ, when ``same_dtype``.
    """
    ref_label, ref = labels[0], leaves[0]
    for label, tree in zip(labels[1:], leaves[1:]):
        missing = sorted(set(ref) - set(tree))
        extra = sorted(set(tree) - set(ref))
        if missing or extra:
            raise CompatibilityError(
                f"{label} and {ref_label} differ in structure: {label} lacks "
                f"{missing[:5]}{' ...' if len(missing) > 5 else ''} and has extra "
                f"{extra[:5]}{' ...' if len(extra) > 5 else ''}; merge models of one "
                "architecture and size"
            )
        for name, x in tree.items():
            s, s0 = logical_shape(x), logical_shape(ref[name])
            if s != s0:
                raise ShapeError(
                    f"leaf {name!r}: {label} has shape {s} but {ref_label} has {s0}; "
                    "models of different sizes cannot be merged"
                )
            d, d0 = logical_dtype(x), logical_dtype(ref[name])
            if same_dtype and d != d0:
                raise DTypeError(
                    f"leaf {name!r}: {label} is {d.name} but {ref_label} is "
                    f"{d0.name}; cast the models to one dtype first"
                )


def same_values(name: str, values: Iterable[Any]) -> Any:
    """The common value of a non-float leaf, or `DTypeError` if the models differ."""
    values = list(values)
    first = values[0]
    if any(isinstance(v, jax.core.Tracer) for v in values):
        return first
    for v in values[1:]:
        if not np.array_equal(np.asarray(v), np.asarray(first)):
            raise DTypeError(
                f"leaf {name!r} is {logical_dtype(first).name}, which cannot be "
                "merged, and the models' values differ"
            )
    return first


__all__ = [
    "Layout",
    "check_leaves",
    "is_floating",
    "layouts",
    "named_leaves",
    "num_layers",
    "same_values",
]
