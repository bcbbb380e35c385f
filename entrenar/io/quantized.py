"""Quantized weights in an `entrenar.io` model file: split into arrays, restored.

A quantized model that is not a llama.cpp GGUF is stored as a model file whose
quantized weights are split into their arrays (``<name>.codes``, ``<name>.scales``,
``<name>.offsets``, ...), with ``custom["quantization"]`` mapping each weight name to
its static fields (scheme, block size, dtype, granularity); `restore_quantized`
rebuilds the `entrenar.quant.QuantizedWeight` nodes. `load_model` reads such a file
as its plain arrays.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from entrenar import quant
from entrenar.errors import FormatError
from entrenar.tree import key_path_str
from entrenar.types import Params

_FIELDS = ("codes", "scales", "offsets", "scale_scales", "scale_offset")


def split_quantized(params: Params) -> tuple[Params, dict[str, Any]]:
    """Params with each `QuantizedWeight` replaced by a dict of its arrays, + its info.

    Returns:
        ``(tree, info)``: ``info[name] = {"scheme", "block_size", "dtype",
        "granularity"}`` for each quantized weight's dotted ``name``.
    """
    info: dict[str, Any] = {}

    def rule(path: Any, x: Any) -> Any:
        if not quant.is_quantized(x):
            return x
        info[key_path_str(path)] = {
            "scheme": x.scheme,
            "block_size": int(x.block_size),
            "dtype": np.dtype(x.dtype).name,
            "granularity": x.granularity,
        }
        return {f: getattr(x, f) for f in _FIELDS if getattr(x, f) is not None}

    tree = jax.tree_util.tree_map_with_path(rule, params, is_leaf=quant.is_quantized)
    return tree, info


def restore_quantized(params: Params, info: Mapping[str, Any], path: str) -> Params:
    """Rebuild the `QuantizedWeight` nodes `split_quantized` took apart."""
    out = params
    for name, fields in info.items():
        parts = name.split(".")
        node: Any = out
        for p in parts[:-1]:
            node = node[int(p)] if isinstance(node, list) else node.get(p)
            if node is None:
                raise FormatError(f"{path}: quantized weight {name!r} is missing")
        arrays = node.get(parts[-1]) if isinstance(node, dict) else None
        if not isinstance(arrays, dict) or "codes" not in arrays:
            raise FormatError(f"{path}: quantized weight {name!r} has no codes")
        try:
            q = quant.QuantizedWeight(
                **{f: arrays.get(f) for f in _FIELDS},
                scheme=str(fields["scheme"]),
                block_size=int(fields["block_size"]),
                dtype=np.dtype(str(fields["dtype"])),
                granularity=str(fields["granularity"]),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise FormatError(f"{path}: quantization of {name!r}: {e}") from None
        node[parts[-1]] = q
    return out


__all__ = ["restore_quantized", "split_quantized"]
