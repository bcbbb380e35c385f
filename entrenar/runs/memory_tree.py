"""The tree a training run will hold, from the model file's header alone.

`run_tree` gives what `entrenar.runs.run.prepare` builds, as `jax.ShapeDtypeStruct`
leaves and weight nodes (nothing allocated), and what the streaming load holds on
top of it while it reads (and quantizes) one leaf: the inputs of
`entrenar.runs.memory_plan`.
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from entrenar import io, lora, quant
from entrenar.config.spec import TrainSpec
from entrenar.io.llama_gguf import KEEP_QUANTIZED, _expected  # load_llama_gguf's rules
from entrenar.io.read_ahead import LEAD_BYTES  # the folder load's read ahead
from entrenar.nn.hf_names import (
    QUANTIZE_AHEAD,
    Quantize,
    quantize_leaves,
    stacked_split,
)
from entrenar.nn.weight_node import is_weight_node, logical_shape
from entrenar.quant.ggml import BLOCK_BYTES
from entrenar.quant.ggml_mixed import ROW_FORMATS, MixedGGMLWeight, row_bytes
from entrenar.quant.kquant import FORMATS
from entrenar.runs.models import BuiltModel, base_quantizer
from entrenar.tree import key_path_str, tree_bytes


def _gguf_tree(
    path: str, dtype: str, keep: bool, quantize: Quantize | None
) -> tuple[Any, list[tuple[int, int]], int]:
    """A GGUF's tree as `load_llama_gguf` leaves it, as shapes; leaf load costs.

    With ``keep``, the rules of `load_llama_gguf`: a stacked projection whose
    layers are all K-quant/BF16/F16 (or a mix of row types) stays as its rows'
    bytes (`GGMLWeight`, `MixedGGMLWeight`: ``(L, rows, widest row)`` uint8 and a
    type per layer), one of Q8_0/Q4_0/Q4_1 as `from_ggml`'s node; the embedding
    and ``lm_head`` alike when of a kept type (`KEEP_QUANTIZED`: a K-quant's bytes,
    a Q8_0/Q4_0/Q4_1 node); everything else in ``dtype``.

    Also the bytes of the mixes' rooms never written (a narrower layer's room
    past its packed bytes: addressed, never resident; `entrenar.quant.ggml_mixed`).
    """
    g, config = io.read_llama_header(path)
    by_hf = {hf: name for name, (hf, _) in _expected(g, config).items() if hf}
    itemsize = np.dtype(dtype).itemsize
    unused: list[int] = []  # each mix's room never written

    def kept(types: list[str], shape: tuple[int, ...]) -> Any:
        kinds = tuple(sorted(set(types)))
        cols = shape[-1]
        if set(kinds) <= set(ROW_FORMATS) and (len(kinds) > 1 or kinds[0] in FORMATS):
            width = max(row_bytes(t, cols) for t in kinds)
            data = jax.ShapeDtypeStruct((*shape[:-1], width), np.uint8)
            if len(kinds) == 1:
                return quant.GGMLWeight(data, kinds[0])
            unused.append(shape[-2] * sum(width - row_bytes(t, cols) for t in types))
            layer_kind = jax.ShapeDtypeStruct(shape[:1], np.int32)
            return MixedGGMLWeight(data, layer_kind, kinds, cols)
        if len(kinds) == 1 and kinds[0] in KEEP_QUANTIZED:
            return _ggml_node(kinds[0], shape)
        return None

    def leaf(path_: str, shape: tuple[int, ...]) -> Any:
        node = None
        if keep and path_.startswith("model.layers.") and len(shape) == 3:
            stem = path_.removeprefix("model.layers.")
            names = [by_hf[f"model.layers.{i}.{stem}"] for i in range(shape[0])]
            node = kept([g.tensors[n].type_name for n in names], shape)
        elif keep and len(shape) == 2 and path_ in by_hf:
            t = g.tensors[by_hf[path_]].type_name
            node = kept([t], shape) if t in KEEP_QUANTIZED else None
        return jax.ShapeDtypeStruct(shape, dtype) if node is None else node

    tree, costs = _build(config.param_shapes(), leaf, quantize, itemsize)
    return tree, costs, sum(unused)


def _ggml_node(ggml_type: str, shape: tuple[int, ...]) -> Any:
    """`from_ggml`'s node of a ``(..., rows, cols)`` tensor, as shapes (one row)."""
    cols = shape[-1]
    raw = np.zeros(cols // 32 * BLOCK_BYTES[ggml_type], np.uint8)
    one = quant.from_ggml(raw, ggml_type, (1, cols))  # arrays (1, k)
    return jax.tree_util.tree_map(
        lambda a: jax.ShapeDtypeStruct((*shape[:-1], *a.shape[1:]), a.dtype), one
    )


def _build(
    shapes: dict[str, Any],
    make: Callable[[str, tuple[int, ...]], Any],
    quantize: Quantize | None,
    itemsize: int,
) -> tuple[Any, list[tuple[int, int]]]:
    """The tree of ``make(path, shape)`` leaves, each quantized as ``quantize`` says.

    Also ``(final bytes, transient bytes)`` of each leaf in load order: a float leaf
    holds itself; a quantized one its float fill, the quantizer's temporaries and
    its node (`_quantize_cost`); a quantized stack of layers ``(L, ...)`` only the
    layers in flight, `QUANTIZE_AHEAD` + 1 of them (`entrenar.nn.hf_names.
    stream_layers` fills and quantizes it a layer at a time: counting the whole
    float stack planned 19 GB of transient for Qwen3-30B-A3B's NF4 experts, which
    the load never holds).
    """
    costs: list[tuple[int, int]] = []

    def walk(tree: dict[str, Any], prefix: str) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for k, v in tree.items():
            path = f"{prefix}{k}"
            if isinstance(v, dict):
                out[k] = walk(v, f"{path}.")
                continue
            if isinstance(v, list):  # unstacked layers (DeepSeek's), each whole
                out[k] = [walk(x, f"{path}.{i}.") for i, x in enumerate(v)]
                continue
            shape = tuple(int(s) for s in v)
            node = make(path, shape)
            fn = None
            if isinstance(node, jax.ShapeDtypeStruct) and quantize is not None:
                fn = quantize(path, shape)
            if fn is None:
                costs.append((tree_bytes(node), 0))
            elif stacked_split(path) is not None and len(shape) > 2:
                layer = jax.ShapeDtypeStruct((1, *shape[1:]), node.dtype)
                temp = _quantize_cost(fn, layer)[1]
                node = jax.eval_shape(fn, node)
                fill = math.prod(shape[1:]) * itemsize + temp
                costs.append((tree_bytes(node), (QUANTIZE_AHEAD + 1) * fill))
            else:
                node, temp = _quantize_cost(fn, node)
                costs.append((tree_bytes(node), math.prod(shape) * itemsize + temp))
            out[k] = node
        return out

    return walk(shapes, ""), costs


@functools.lru_cache(maxsize=64)
def _quantize_temp(
    func: Any, kw: tuple[tuple[str, Any], ...], shape: tuple[int, ...], dtype: str
) -> tuple[Any, int]:
    """The node (shapes) and XLA's temporaries of ``func(leaf, **kw)``, compiled."""
    fn = functools.partial(func, **dict(kw))
    arg = jax.ShapeDtypeStruct(shape, dtype)
    stats = jax.jit(fn).lower(arg).compile().memory_analysis()
    temp = int(stats.temp_size_in_bytes) if stats is not None else 0
    return jax.eval_shape(fn, arg), temp


def _quantize_cost(fn: Any, leaf: jax.ShapeDtypeStruct) -> tuple[Any, int]:
    """The quantized node of ``leaf`` (shapes) and the quantizer's temporaries."""
    if isinstance(fn, functools.partial) and not fn.args:
        kw = tuple(sorted(fn.keywords.items()))
        return _quantize_temp(fn.func, kw, tuple(leaf.shape), str(leaf.dtype))
    return _quantize_temp(fn, (), tuple(leaf.shape), str(leaf.dtype))


def _in_flight(folder: Any, quantize: Quantize | None) -> int:
    """What a folder's streaming load holds besides its tree while it quantizes.

    `entrenar.nn.hf_names.stream_layers` quantizes up to `QUANTIZE_AHEAD` layers on
    worker threads while it reads the next: each such layer is resident as the
    file's mapped pages and, for a mixture of experts, as the ``(E, out, in)``
    stack made of its experts' tensors (`entrenar.nn.moe_families.ExpertStack`),
    both in the file's dtype; and the read ahead faults in up to `LEAD_BYTES` of
    the shards beyond what the load has released. `_build`'s bound (the layers in
    flight in the model's dtype, with the quantizer's temporaries) covers this in
    float32, not for large bfloat16 experts (measured: 4 layers of 8 experts
    2048 x 512 in bfloat16 peaked 0.070 GB over the tree, where the leaf is
    0.067 GB).
    """
    if quantize is None:
        return 0
    wide = max(
        (
            np.dtype(a.dtype).itemsize
            for f in folder.files
            for a in io.read_safetensors(f)[0].values()  # mapped, not read
        ),
        default=4,
    )
    layer = 0

    def walk(tree: dict[str, Any], prefix: str) -> None:
        nonlocal layer
        for k, v in tree.items():
            path_ = f"{prefix}{k}"
            if isinstance(v, dict):
                walk(v, f"{path_}.")
                continue
            if isinstance(v, list):  # unstacked layers: each leaf is read whole
                for i, x in enumerate(v):
                    walk(x, f"{path_}.{i}.")
                continue
            shape = tuple(int(n) for n in v)
            if stacked_split(path_) is None:  # an unstacked leaf: `_build` counts it
                continue
            if prefix.startswith("model.layers.") and quantize(path_, shape):
                copies = 2 if len(shape) == 4 else 1  # experts: pages and stack
                layer = max(layer, copies * math.prod(shape[1:]) * wide)

    walk(folder.config.param_shapes(), "")
    if not layer:
        return 0
    lead = min(LEAD_BYTES, sum(os.path.getsize(f) for f in folder.files))
    return (QUANTIZE_AHEAD + 1) * layer + lead


def _loaded(
    spec: TrainSpec, built: BuiltModel, quantize: Quantize | None
) -> tuple[Any, bool, int, int]:
    """``(tree, kept, transient, unused)``: the tree the load leaves (shapes).

    ``kept``: whether the run keeps that tree beside the one `lora.apply` makes (a
    model built from scratch: `BuiltModel` holds its float leaves, which LoRA then
    quantizes); ``transient``: the most the leaf being read adds (`_build`);
    ``unused``: bytes of the tree never resident (`_gguf_tree`).
    """
    section = spec.model
    assert section is not None
    dtype = section.dtype
    itemsize = np.dtype(dtype).itemsize
    path = section.path

    def plain(path_: str, shape: tuple[int, ...]) -> Any:
        return jax.ShapeDtypeStruct(shape, dtype)

    if path is not None and os.path.isdir(path):
        folder = io.read_hf_folder(path)
        shapes = folder.config.param_shapes()
        tree, costs = _build(shapes, plain, quantize, itemsize)
        transient = max((t for _, t in costs), default=0)
        return tree, False, max(transient, _in_flight(folder, quantize)), 0
    if path is not None and built.gguf_source and built.is_decoder:
        tree, costs, unused = _gguf_tree(path, dtype, section.keep_quantized, quantize)
        return tree, False, max((t for _, t in costs), default=0), unused
    # From scratch (`lora.apply` quantizes later), or an entrenar file (read whole,
    # then quantized: the float tree is the transient).
    tree = built.params
    if path is None or quantize is None:
        return tree, path is None and quantize is not None, 0, 0
    return (
        jax.eval_shape(lambda t: quantize_leaves(t, quantize), tree),
        False,
        (tree_bytes(tree)),
        0,
    )


def run_tree(
    spec: TrainSpec, built: BuiltModel, c: lora.LoRAConfig | None
) -> tuple[Any, int, int, int]:
    """``(params, weights, adapters, load transient)`` of `prepare`'s tree.

    ``params`` as shapes; the bytes of its weights and of its LoRA factors; the
    most the load adds while it reads (and quantizes) a leaf. The weights count
    what is resident: a mix's unused room is not (`_gguf_tree`).
    """
    quantize = base_quantizer(c)
    tree, kept, transient, unused = _loaded(spec, built, quantize)
    if c is None:
        return tree, tree_bytes(tree) - unused, 0, transient
    scheme = None if c.quantize_base == "none" else c.quantize_base
    params = jax.eval_shape(
        lambda t: lora.apply(t, c, key=jax.random.key(1), quantize=scheme), tree
    )
    adapters = tree_bytes(lora.split(params)[0])
    if not kept:
        return params, tree_bytes(params) - adapters - unused, adapters, transient
    # from scratch: `BuiltModel` keeps the float tree, LoRA quantizes its bases
    assert quantize is not None
    temps = [
        _quantize_cost(fn, x)[1]
        for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]
        if (fn := quantize(key_path_str(p), tuple(x.shape))) is not None
    ]
    weights = tree_bytes(tree) + _quantized_bytes(params)
    return params, weights, adapters, max(temps, default=0)


def _kind(x: Any) -> str:
    """How a leaf is held: ``NF4``, ``Q4_K``, ``Q4_K+Q6_K`` (a mix), ``float32``."""
    for attr in ("scheme", "ggml_type"):
        if isinstance(getattr(x, attr, None), str):
            return str(getattr(x, attr)).upper()
    if isinstance(getattr(x, "types", None), tuple):
        return "+".join(x.types)
    return str(x.dtype)


def describe(tree: Any) -> str:
    """``"1,170.3M parameters as leaves: 8 float32, 4 NF4"``."""
    kinds: dict[str, int] = {}
    params = 0
    for x in weight_nodes(tree):
        kinds[_kind(x)] = kinds.get(_kind(x), 0) + 1
        params += math.prod(logical_shape(x))
    held = ", ".join(
        f"{n} {k}" for k, n in sorted(kinds.items(), key=lambda kv: -kv[1])
    )
    return f"{params / 1e6:,.1f}M parameters as leaves: {held}"


def weight_nodes(tree: Any) -> list[Any]:
    """The weights of a tree: arrays and weight nodes (a LoRA weight's parts)."""

    def held(x: Any) -> bool:
        return is_weight_node(x) and not isinstance(x, lora.LoRAWeight)

    return jax.tree_util.tree_leaves(tree, is_leaf=held)


def _quantized_bytes(tree: Any) -> int:
    is_q = lambda x: isinstance(x, quant.QuantizedWeight)  # noqa: E731
    return sum(
        tree_bytes(x) for x in jax.tree_util.tree_leaves(tree, is_leaf=is_q) if is_q(x)
    )


__all__ = ["describe", "run_tree", "weight_nodes"]
