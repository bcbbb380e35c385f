"""Stacked parameter trees <-> flat Hugging Face names.

Transformer layers are stored stacked along a leading axis under one key (``layers``
for Llama, ``h`` for GPT-2); the Hugging Face name of layer ``i`` inserts ``.{i}``
after that key::

    params["model"]["layers"]["self_attn"]["q_proj"]["weight"][3]
        <-> "model.layers.3.self_attn.q_proj.weight"

A weight may be a registered node (LoRA, quantized) instead of an array: it is sliced
per layer with `jax.tree_util.tree_map`, so each flat entry is a node of one layer.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from entrenar.errors import FormatError, ShapeError
from entrenar.types import DType, Params

STACKED_KEYS = ("layers", "h")
"""Dict keys whose subtree is stacked along a leading layer axis."""

IGNORED_SUFFIXES = ("rotary_emb.inv_freq", ".attn.bias", ".attn.masked_bias")
"""Buffers some checkpoints store that are derived, not parameters."""


class HasParamShapes(Protocol):
    """A model config that can list its parameter shapes as a nested dict."""

    num_layers: int

    def param_shapes(self) -> dict[str, Any]:
        """Nested dict of shape tuples, stacked leaves with their leading ``L``."""
        ...


def _num_layers(node: Any) -> int:
    leaves = jax.tree_util.tree_leaves(node)
    return int(np.shape(leaves[0])[0])


def to_hf_names(params: Params) -> dict[str, Any]:
    """Flatten a stacked param tree to ``{hf_name: array_or_node}``.

    >>> p = {"model": {"layers": {"w": jnp.zeros((2, 3))}, "norm": jnp.ones(3)}}
    >>> sorted((k, v.shape) for k, v in to_hf_names(p).items())
    [('model.layers.0.w', (3,)), ('model.layers.1.w', (3,)), ('model.norm', (3,))]
    """
    out: dict[str, Any] = {}

    def walk(tree: Any, prefix: str, stacked: bool) -> None:
        for name, sub in tree.items():
            path = f"{prefix}{name}"
            if isinstance(sub, Mapping):
                if name in STACKED_KEYS and not stacked:
                    for i in range(_num_layers(sub)):
                        layer = jax.tree_util.tree_map(lambda a, i=i: a[i], sub)
                        walk(layer, f"{path}.{i}.", True)
                else:
                    walk(sub, f"{path}.", stacked)
            elif isinstance(sub, (list, tuple)):
                walk({str(i): x for i, x in enumerate(sub)}, f"{path}.", stacked)
            else:
                out[path] = sub

    walk(params, "", False)
    return out


def from_hf_names(
    flat: Mapping[str, Any],
    config: HasParamShapes,
    *,
    dtype: DType | None = None,
    strict: bool = True,
) -> Params:
    """Build the stacked param tree of ``config`` from ``{hf_name: array}``.

    Shapes are checked against ``config.param_shapes()`` before anything is stacked.
    ``lm_head.weight`` is ignored when the config ties embeddings (some checkpoints
    store the tied copy), as are derived buffers (`IGNORED_SUFFIXES`).

    Args:
        flat: arrays by Hugging Face name, in the layout ``(out, in)``.
        config: the model config (e.g. `entrenar.nn.LlamaConfig`).
        dtype: cast every array to this dtype; None keeps the stored dtypes.
        strict: raise on names the config does not expect.

    Raises:
        FormatError: a name is missing (or unexpected with ``strict``).
        ShapeError: an array's shape differs from the config's.
    """
    used: set[str] = set()

    def get(name: str, shape: tuple[int, ...]) -> Any:
        if name not in flat:
            raise FormatError(
                f"missing parameter {name!r}; the checkpoint does not match the config "
                f"(expected shape {shape})"
            )
        arr = flat[name]
        if tuple(np.shape(arr)) != tuple(shape):
            raise ShapeError(
                f"parameter {name!r} has shape {tuple(np.shape(arr))}, the config "
                f"expects {tuple(shape)}; check the config against the checkpoint"
            )
        used.add(name)
        return arr

    def build(shapes: Mapping[str, Any], prefix: str, stacked: bool) -> dict:
        tree: dict[str, Any] = {}
        for name, sub in shapes.items():
            path = f"{prefix}{name}"
            if isinstance(sub, Mapping):
                tree[name] = build(sub, f"{path}.", stacked or name.endswith(".__L__"))
            elif stacked:
                layer_prefix, _, rest = path.partition(".__L__.")
                per = [
                    get(f"{layer_prefix}.{i}.{rest}", tuple(sub[1:]))
                    for i in range(sub[0])
                ]
                tree[name] = _cast(jnp.stack([jnp.asarray(a) for a in per]), dtype)
            else:
                tree[name] = _cast(jnp.asarray(get(path, tuple(sub))), dtype)
        return tree

    # Mark the stacked key in paths so a layer's prefix and suffix can be split.
    marked = _mark_stacked(config.param_shapes())
    params = build(marked, "", False)
    params = _unmark(params)
    tied = "lm_head" not in marked
    extra = [
        k
        for k in flat
        if k not in used
        and not (tied and k == "lm_head.weight")
        and not k.endswith(IGNORED_SUFFIXES)
    ]
    if strict and extra:
        raise FormatError(
            f"unexpected parameters {sorted(extra)[:5]} (of {len(extra)}); the "
            "checkpoint has tensors the config does not describe (pass strict=False "
            "to ignore them)"
        )
    return params


def _cast(a: jax.Array, dtype: DType | None) -> jax.Array:
    return a if dtype is None else a.astype(dtype)


def _mark_stacked(shapes: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in shapes.items():
        if isinstance(v, Mapping):
            key = f"{k}.__L__" if k in STACKED_KEYS else k
            out[key] = _mark_stacked(v)
        else:
            out[k] = v
    return out


def _unmark(tree: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in tree.items():
        key = k.removesuffix(".__L__")
        out[key] = _unmark(v) if isinstance(v, Mapping) else v
    return out


__all__ = ["IGNORED_SUFFIXES", "STACKED_KEYS", "from_hf_names", "to_hf_names"]
