"""Type aliases shared across entrenar.

They document intent in signatures; at run time they are plain aliases.
"""

from __future__ import annotations

from typing import Any, TypeAlias

import jax
import numpy as np

Array: TypeAlias = jax.Array
"""A JAX array (possibly a tracer under `jax.jit`)."""

ArrayLike: TypeAlias = jax.Array | np.ndarray | np.generic | float | int | bool
"""Anything `jnp.asarray` accepts without copying a Python list."""

PRNGKey: TypeAlias = jax.Array
"""A JAX random key (`jax.random.key` or a legacy uint32[2] key)."""

PyTree: TypeAlias = Any
"""A nested structure of dicts, lists, tuples, NamedTuples and registered nodes."""

Params: TypeAlias = PyTree
"""Model parameters: a pytree whose leaves are arrays (or weight nodes)."""

Grads: TypeAlias = PyTree
"""Gradients: a pytree with the structure of the parameters it differentiates."""

Updates: TypeAlias = PyTree
"""Optimizer updates, added to parameters by `entrenar.optim.apply_updates`."""

OptState: TypeAlias = PyTree
"""Optimizer state: a NamedTuple (or tuple of them) of arrays."""

Shape: TypeAlias = tuple[int, ...]
DType: TypeAlias = Any

__all__ = [
    "Array",
    "ArrayLike",
    "DType",
    "Grads",
    "OptState",
    "PRNGKey",
    "Params",
    "PyTree",
    "Shape",
    "Updates",
]
