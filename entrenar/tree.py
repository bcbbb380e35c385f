"""Small helpers over pytrees: counting, sizing, comparing, naming leaves by path."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from entrenar.errors import ShapeError
from entrenar.types import PyTree


def tree_size(tree: PyTree) -> int:
    """Number of scalar elements over all array leaves.

    >>> import jax.numpy as jnp
    >>> tree_size({"w": jnp.zeros((3, 4)), "b": jnp.zeros(4)})
    16
    """
    return sum(int(np.prod(np.shape(x))) for x in jax.tree_util.tree_leaves(tree))


def tree_bytes(tree: PyTree) -> int:
    """Bytes held by all array leaves, as stored (packed codes count as stored).

    >>> import jax.numpy as jnp
    >>> tree_bytes({"w": jnp.zeros((3, 4), jnp.float32), "m": jnp.zeros(4, jnp.uint8)})
    52
    """
    total = 0
    for x in jax.tree_util.tree_leaves(tree):
        dtype = np.dtype(getattr(x, "dtype", np.asarray(x).dtype))
        total += int(np.prod(np.shape(x))) * dtype.itemsize
    return total


def key_path_str(path: tuple[Any, ...]) -> str:
    """Dotted name of a pytree key path, as Hugging Face names modules.

    >>> import jax
    >>> paths = jax.tree_util.tree_flatten_with_path({"a": {"b": [1, 2]}})[0]
    >>> [key_path_str(p) for p, _ in paths]
    ['a.b.0', 'a.b.1']
    """
    parts = []
    for k in path:
        if isinstance(k, jax.tree_util.DictKey):
            parts.append(str(k.key))
        elif isinstance(k, jax.tree_util.SequenceKey):
            parts.append(str(k.idx))
        elif isinstance(k, jax.tree_util.GetAttrKey):
            parts.append(k.name)
        elif isinstance(k, jax.tree_util.FlattenedIndexKey):
            parts.append(str(k.key))
        else:  # pragma: no cover - future key types
            parts.append(str(k))
    return ".".join(parts)


def list_index(part: str) -> int | None:
    """The list position a part of a dotted name stands for, else None.

    In memory a list position is a bare number (``layers.3.weight``, from
    `key_path_str`); in a stored file it is bracketed (``layers.[3].weight``, from
    `entrenar.io.flatten_params`). Both mean one layer, not a stacked key.

    >>> list_index("3"), list_index("[3]"), list_index("q_proj")
    (3, 3, None)
    """
    if part.isdigit():
        return int(part)
    if len(part) > 2 and part[0] == "[" and part[-1] == "]" and part[1:-1].isdigit():
        return int(part[1:-1])
    return None


def tree_named_leaves(tree: PyTree, is_leaf: Callable[[Any], bool] | None = None):
    """List of ``(dotted_name, leaf)`` pairs in flattening order."""
    flat, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)
    return [(key_path_str(p), leaf) for p, leaf in flat]


def assert_trees_allclose(
    actual: PyTree,
    expected: PyTree,
    *,
    rtol: float = 1e-6,
    atol: float = 0.0,
    err_msg: str = "",
) -> None:
    """Assert two pytrees have the same structure and leaf-wise close values.

    The failure message names the first leaf (by its dotted path) that differs.

    Raises:
        AssertionError: structures, shapes or values differ.
    """
    a_flat, a_def = jax.tree_util.tree_flatten_with_path(actual)
    e_flat, e_def = jax.tree_util.tree_flatten_with_path(expected)
    if a_def != e_def:  # type: ignore[operator]
        raise AssertionError(
            f"{err_msg} tree structures differ:\n  actual:   {a_def}\n"
            f"  expected: {e_def}"
        )
    for (path, a), (_, e) in zip(a_flat, e_flat):
        name = key_path_str(path) or "<root>"
        a_np, e_np = np.asarray(a), np.asarray(e)
        if a_np.shape != e_np.shape:
            raise AssertionError(
                f"{err_msg} leaf {name!r}: shape {a_np.shape} != {e_np.shape}"
            )
        np.testing.assert_allclose(
            a_np.astype(np.float64) if a_np.dtype.kind == "V" else a_np,
            e_np,
            rtol=rtol,
            atol=atol,
            err_msg=f"{err_msg} leaf {name!r}",
        )


def check_same_structure(a: PyTree, b: PyTree, what: str = "trees") -> None:
    """Raise `ShapeError` unless ``a`` and ``b`` match in structure and shapes."""
    a_flat, a_def = jax.tree_util.tree_flatten_with_path(a)
    b_flat, b_def = jax.tree_util.tree_flatten_with_path(b)
    if a_def != b_def:  # type: ignore[operator]
        raise ShapeError(f"{what} have different structures: {a_def} vs {b_def}")
    for (path, x), (_, y) in zip(a_flat, b_flat):
        if np.shape(x) != np.shape(y):
            raise ShapeError(
                f"{what} differ at {key_path_str(path)!r}: shape {np.shape(x)} "
                f"vs {np.shape(y)}"
            )


__all__ = [
    "assert_trees_allclose",
    "check_same_structure",
    "key_path_str",
    "list_index",
    "tree_bytes",
    "tree_named_leaves",
    "tree_size",
]
