"""The weight-node protocol: what every kind of weight answers, array or node.

A weight in a parameter tree is a plain array or a *weight node*: a frozen dataclass
registered with `register_weight_node` (``QuantizedWeight``, ``LoRAWeight``,
``Bfloat16Weight``, ``TiedEmbedding``). Each node type registers its rules in its
own package, as it registers its `entrenar.nn.weight_matmul` rule:

    logical_shape(w)   the shape of the tensor w stands for, e.g. (*lead, out, in)
    logical_dtype(w)   its dtype (a quantized node's original dtype)
    to_dense(w)        its values as one array of that shape and dtype
    nbytes(w)          bytes as stored (codes, scales, factors, bit patterns)
    is_weight_node(x)  True for a node: the ``is_leaf`` that keeps nodes whole

so code above ``nn`` sizes, compares and folds weights without naming a node type.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np

NodeType = TypeVar("NodeType", bound=type)

STATIC = {"static": True}
"""Field metadata of a node's static fields (aux data: never traced)."""


@functools.singledispatch
def is_weight_node(x: Any) -> bool:
    """Whether ``x`` is a registered weight node (False for arrays and containers).

    Example:
        >>> import jax.numpy as jnp
        >>> is_weight_node(jnp.ones(2)), is_weight_node({"w": jnp.ones(2)})
        (False, False)
    """
    return False


@functools.singledispatch
def logical_shape(w: Any) -> tuple[int, ...]:
    """The shape of the tensor ``w`` stands for (an array's, or a node's logical one).

    Example:
        >>> import jax
        >>> logical_shape(jax.ShapeDtypeStruct((4, 3), "float32")), logical_shape(2.5)
        ((4, 3), ())
    """
    shape = getattr(w, "shape", None)
    return tuple(int(s) for s in (np.shape(w) if shape is None else shape))


@functools.singledispatch
def logical_dtype(w: Any) -> np.dtype:
    """The dtype of the tensor ``w`` stands for (a Python scalar: JAX's default).

    Example:
        >>> import jax.numpy as jnp
        >>> logical_dtype(jnp.ones(2, jnp.bfloat16)).name, logical_dtype(2.5).name
        ('bfloat16', 'float32')
    """
    dtype = getattr(w, "dtype", None)
    return np.dtype(jnp.asarray(w).dtype if dtype is None else dtype)


@functools.singledispatch
def to_dense(w: Any) -> Any:
    """The values ``w`` stands for as one array: an array is its own value.

    Nodes give an array of ``logical_shape(w)`` and ``logical_dtype(w)``
    (dequantized, folded, read from their bit patterns).
    """
    return w


@functools.singledispatch
def nbytes(w: Any) -> int:
    """Bytes ``w`` is stored in: a node counts every array it holds.

    Example:
        >>> import jax.numpy as jnp
        >>> nbytes(jnp.ones((2, 3), jnp.bfloat16)), nbytes(2.5)
        (12, 4)
    """
    if is_weight_node(w):
        return sum(nbytes(a) for a in jax.tree_util.tree_leaves(w))
    return math.prod(logical_shape(w)) * logical_dtype(w).itemsize


def register_weight_node(cls: NodeType) -> NodeType:
    """Register the frozen dataclass ``cls`` as a weight node (a class decorator).

    Its fields marked ``metadata=STATIC`` are aux data; the others are its children,
    in field order, under the pytree key ``metadata["key"]`` (default: the field's
    name). `is_weight_node` answers True for ``cls``.
    """
    fields = dataclasses.fields(cls)
    static = tuple(f.name for f in fields if f.metadata.get("static"))
    data = [f for f in fields if not f.metadata.get("static")]
    children = tuple(f.name for f in data)
    keys = tuple(jax.tree_util.GetAttrKey(f.metadata.get("key", f.name)) for f in data)

    def flatten(w: Any) -> tuple[list[Any], tuple[Any, ...]]:
        return [getattr(w, n) for n in children], tuple(getattr(w, n) for n in static)

    def flatten_with_keys(w: Any) -> tuple[list[Any], tuple[Any, ...]]:
        values, aux = flatten(w)
        return list(zip(keys, values)), aux

    def unflatten(aux: tuple[Any, ...], values: Any) -> Any:
        return cls(**dict(zip(children, values)), **dict(zip(static, aux)))

    jax.tree_util.register_pytree_with_keys(cls, flatten_with_keys, unflatten, flatten)
    is_weight_node.register(cls, lambda _: True)
    return cls


__all__ = [
    "STATIC",
    "is_weight_node",
    "logical_dtype",
    "logical_shape",
    "nbytes",
    "register_weight_node",
    "to_dense",
]
