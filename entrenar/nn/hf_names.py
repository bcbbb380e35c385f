"""Stacked parameter trees <-> flat Hugging Face names.

Transformer layers are stored stacked along a leading axis under one key (``layers``
for Llama, ``h`` for GPT-2); the Hugging Face name of layer ``i`` inserts ``.{i}``
after that key::

    params["model"]["layers"]["self_attn"]["q_proj"]["weight"][3]
        <-> "model.layers.3.self_attn.q_proj.weight"

A weight may be a registered node (LoRA, quantized) instead of an array: it is sliced
per layer with `jax.tree_util.tree_map`, so each flat entry is a node of one layer.

`stream_hf_names` builds the same tree one leaf at a time: each stacked leaf is filled
layer by layer into an array of its final dtype (or, if `Quantize` says so, each
layer quantized as it is read into its final node's arrays) before the next is read,
so a load from memory-mapped files holds the final tree plus about one stacked leaf,
or one layer of a quantized one (specs/io.md, "Streaming loads").
"""

from __future__ import annotations

import collections
import concurrent.futures
import functools
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from entrenar.errors import FormatError, ShapeError
from entrenar.nn.host_arrays import host_buffer, to_device
from entrenar.nn.registry import architecture, architecture_names
from entrenar.nn.weight_node import is_weight_node
from entrenar.threads import shared_pool
from entrenar.tree import key_path_str, list_index
from entrenar.types import DType, Params

STACKED_KEYS = ("layers", "h")
"""Dict keys whose subtree is stacked along a leading layer axis."""


def stacked_split(
    path: str, stacked_keys: tuple[str, ...] = STACKED_KEYS
) -> tuple[str, str] | None:
    """``("model.layers", "self_attn.q_proj.weight")`` for a stacked leaf, else None.

    A leaf under a stacked key not followed by a layer index carries a leading layer
    axis (specs/conventions.md); every module that asks "is this leaf stacked?"
    (LoRA names, quantization's per-layer axes, sharding rules, merging) reads it here.

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


IGNORED_SUFFIXES = ("rotary_emb.inv_freq", ".attn.bias", ".attn.masked_bias")
"""Buffers some checkpoints store that are derived, not parameters."""

Quantize = Callable[[str, tuple[int, ...]], Callable[[jax.Array], Any] | None]
"""What a load does with a leaf: ``quantize(path, shape)`` is None to keep the leaf an
array, or the function that turns it into its final node (e.g. NF4). ``path`` is the
leaf's dotted tree path (``model.layers.self_attn.q_proj.weight``) and ``shape`` its
whole shape (``(L, out, in)`` when stacked). A stacked leaf is quantized layer by
layer (`StackedLeaf`), so the function must treat a stack layer by layer: ``fn(w)``
has arrays ``(L, ...)`` whose index ``i`` is ``fn(w[i:i+1])``'s, bit for bit (block
formats do; NF4's double quantization does by definition); an unstacked leaf is
passed whole.

A function may also have a host form, ``fn.on_host(src, dtype)``: None, or a
`HostQuantize` for numpy arrays of dtype ``src`` standing for their values cast to
``dtype`` (exactly), with no XLA program, giving ``fn``'s node bit for bit
(`entrenar.runs.models.BaseQuantize`: the native NF4 kernel). A load then runs it
on each layer where it lies (a memory-mapped file's bfloat16 view), with no float32
copy, no compile and no dispatch."""

HostQuantize = Callable[[np.ndarray, Any], Any]
"""``host(x, into)``: the node of host array ``x`` (numpy arrays); with ``into`` (a
node of C-contiguous numpy arrays shaped as the result, or None) written into
``into``'s arrays and returned."""


class HasParamShapes(Protocol):
    """A model config that can list its parameter shapes as a nested dict."""

    @property
    def num_layers(self) -> int:
        """``L``, the number of stacked layers."""
        ...

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


def lazy_hf_names(params: Params) -> dict[str, Callable[[], Any]]:
    """`to_hf_names` whose values are made when called: ``{hf_name: make}``.

    ``make()`` slices layer ``i`` of a stacked leaf (an array or a node, every array
    of it at ``i``) only then, so a writer that makes, writes and drops one tensor at
    a time holds one layer, never a copy of the tree (numpy leaves are sliced as
    views). The names are `to_hf_names`'s.

    >>> p = {"model": {"layers": {"w": jnp.zeros((2, 3))}, "norm": jnp.ones(3)}}
    >>> {k: v().shape for k, v in lazy_hf_names(p).items()}["model.layers.1.w"]
    (3,)
    """
    out: dict[str, Callable[[], Any]] = {}

    def walk(tree: Any, prefix: str, layer: int | None) -> None:
        for name, sub in tree.items():
            path = f"{prefix}{name}"
            if isinstance(sub, Mapping):
                if name in STACKED_KEYS and layer is None:
                    for i in range(_num_layers(sub)):
                        walk(sub, f"{path}.{i}.", i)
                else:
                    walk(sub, f"{path}.", layer)
            elif isinstance(sub, (list, tuple)):
                walk({str(i): x for i, x in enumerate(sub)}, f"{path}.", layer)
            elif layer is None:
                out[path] = functools.partial(_same, sub)
            else:
                out[path] = functools.partial(_layer_of, sub, layer)

    walk(params, "", None)
    return out


def _same(x: Any) -> Any:
    return x


def _layer_of(leaf: Any, i: int) -> Any:
    """Layer ``i`` of a stacked array or weight node (each of its arrays at ``i``)."""
    return jax.tree_util.tree_map(lambda a: a[i], leaf)


def _tensor_names(config: Any) -> Callable[[Mapping[str, Any], Any], Any] | None:
    """The family's checkpoint-name converter (`Architecture.from_hf_tensors`)."""
    name = getattr(config, "architecture", None)
    if not isinstance(name, str) or name not in architecture_names():
        return None
    return architecture(name).from_hf_tensors


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
    store the tied copy), as are derived buffers (`IGNORED_SUFFIXES`). A family
    whose checkpoint names differ from its tree (a mixture of experts' per-expert or
    fused tensors: `entrenar.nn.Architecture.from_hf_tensors`) has them converted
    first, so a transformers ``state_dict`` of it loads as it is.

    Args:
        flat: arrays by Hugging Face name, in the layout ``(out, in)``.
        config: the model config (e.g. `entrenar.nn.LlamaConfig`).
        dtype: cast every array to this dtype; None keeps the stored dtypes.
        strict: raise on names the config does not expect.

    Raises:
        FormatError: a name is missing (or unexpected with ``strict``).
        ShapeError: an array's shape differs from the config's.
    """
    convert = _tensor_names(config)
    if convert is not None:
        flat = convert(flat, config)
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
            elif isinstance(sub, list):  # unstacked layers, one dict each
                tree[name] = [
                    build(s, f"{path}.{i}.", False) for i, s in enumerate(sub)
                ]
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
    if strict:
        _check_no_extra(flat, used, tied="lm_head" not in marked)
    return params


Reader = Callable[[], Any]
"""Reads one tensor (a layer of a stacked leaf) in its final dtype (a numpy or JAX
array), releasing its source (the mapped file's pages) once copied."""

RowReader = Callable[[int | None, int | None], Any]
"""``read(start, stop)``: rows ``start:stop`` of one tensor in its final dtype (its
source released once copied); ``read(None, None)``: the whole tensor."""

RowFill = Callable[[int, int, np.ndarray], None]
"""``fill(start, stop, out)``: rows ``start:stop`` of one tensor written into ``out``
(a view of its leaf's host buffer) in its final dtype, no temporary of the rows."""

CHUNK_BYTES = 16 << 20
"""Bytes of an unstacked leaf (an embedding) `stream_one` reads at a time."""

QUANTIZE_AHEAD = 2
"""Layers of a quantized stacked leaf in flight in `stream_layers`: each is
quantized by a worker thread (two XLA programs run at once, one a core) while the
next is read from the file."""


def stream_hf_names(
    flat: Mapping[str, Any],
    config: HasParamShapes,
    *,
    dtype: DType | None = None,
    quantize: Quantize | None = None,
    strict: bool = True,
    release: Callable[[Any], None] | None = None,
    read_ahead: Callable[[Sequence[Any]], None] | None = None,
) -> Params:
    """`from_hf_names`, one leaf at a time (module docstring); the same tree.

    Every name and shape is checked before any tensor is read. Each tensor is read
    once, cast as `from_hf_names` casts it (``jnp.asarray(a).astype(dtype)``; in
    numpy where that cast is exact: the same dtype, or float to float32/float64),
    copied into its leaf and ``release``d; a stacked leaf ``quantize`` names is
    quantized layer by layer as read (`StackedLeaf`), an unstacked one whole.

    Args:
        flat: arrays by Hugging Face name that cost nothing until read, e.g. the
            memory-mapped views of `entrenar.io.read_safetensors`.
        config: the model config.
        dtype: the leaves' dtype; None keeps the stored dtypes.
        quantize: which leaves to quantize, and how (`Quantize`); None: none.
        strict: raise on names the config does not expect.
        release: called with each array of ``flat`` once it is copied out (e.g.
            `entrenar.io.release_pages`).
        read_ahead: called with the arrays of ``flat`` in the order the load will
            read them, before it reads them (in two calls: the unstacked leaves,
            then the stacked ones), e.g. `entrenar.io.read_ahead.ReadAhead.read`:
            the files are read on a thread while the load copies and quantizes.

    Raises:
        FormatError: a name is missing (or unexpected with ``strict``).
        ShapeError: an array's shape differs from the config's.
    """
    marked = _mark_stacked(config.param_shapes())
    tree: dict[str, Any] = {}
    leaves: list[tuple[dict[str, Any], str, str, list[str], tuple[int, ...]]] = []

    def check(name: str, shape: tuple[int, ...]) -> str:
        if name not in flat:
            raise FormatError(
                f"missing parameter {name!r}; the checkpoint does not match the config "
                f"(expected shape {shape})"
            )
        if tuple(np.shape(flat[name])) != tuple(shape):
            raise ShapeError(
                f"parameter {name!r} has shape {tuple(np.shape(flat[name]))}, the "
                f"config expects {tuple(shape)}; check the config against the "
                "checkpoint"
            )
        return name

    def walk(shapes: Mapping[str, Any], node: dict, prefix: str, stacked: bool) -> None:
        for name, sub in shapes.items():
            path = f"{prefix}{name}"
            if isinstance(sub, Mapping):
                node[name] = {}
                walk(sub, node[name], f"{path}.", stacked or name.endswith(".__L__"))
            elif isinstance(sub, list):  # unstacked layers, one dict each
                node[name] = [{} for _ in sub]
                for i, s in enumerate(sub):
                    walk(s, node[name][i], f"{path}.{i}.", False)
            elif stacked:
                head, _, rest = path.partition(".__L__.")
                names = [
                    check(f"{head}.{i}.{rest}", tuple(sub[1:])) for i in range(sub[0])
                ]
                leaves.append((node, name, path, names, tuple(sub)))
            else:
                leaves.append((node, name, path, [check(path, tuple(sub))], ()))

    walk(marked, tree, "", False)  # every name and shape checked before any read
    used = {n for *_, names, _ in leaves for n in names}
    if strict:
        _check_no_extra(flat, used, tied="lm_head" not in marked)
    if read_ahead is not None:  # the unstacked leaves first, as read below
        read_ahead([flat[names[0]] for *_, names, shape in leaves if not shape])

    def rows(name: str, final: Any, ring: list[Any] | None = None) -> RowReader:
        """Reads ``name``, a stacked leaf's layer into its leaf's ``ring``.

        Layer ``i`` goes into buffer ``i mod len(ring)``: `stream_layers` is done
        with layer ``i - QUANTIZE_AHEAD`` before it reads layer ``i``.
        """

        def read(start: int | None = None, stop: int | None = None) -> Any:
            view = flat[name] if start is None else flat[name][start:stop]
            if _exact_in_numpy(np.asarray(view).dtype, final):
                a: Any = None
                if ring is not None:
                    a = ring.pop(0)
                    ring.append(a)
                if a is None or a.shape != np.shape(view) or a.dtype != final:
                    a = host_buffer(np.shape(view), final)  # JAX takes it uncopied
                    if ring is not None:
                        ring[-1] = a
                np.copyto(a, view, casting="unsafe")  # exact: same or wider float
            else:
                a = jnp.asarray(view)
                a = a if a.dtype == final else a.astype(final)
                a.block_until_ready()  # copied out (device_put may copy later)
            if release is not None:
                release(view)
            return a

        return read

    def in_place(name: str, final: Any) -> RowFill | None:
        """Rows of ``name`` cast into the leaf's buffer, when exact in numpy."""
        if not _exact_in_numpy(np.dtype(flat[name].dtype), final):
            return None

        def fill(start: int, stop: int, out: np.ndarray) -> None:
            view = flat[name][start:stop]  # (stop - start, ...) as stored
            np.copyto(out, view, casting="unsafe")  # exact: same or wider float
            if release is not None:
                release(view)

        return fill

    def final_dtype(names: list[str]) -> Any:
        final = dtype or jnp.result_type(*(flat[n].dtype for n in names))
        return jax.dtypes.canonicalize_dtype(final)

    def stream_stacked_leaves() -> None:
        """The stacked leaves: a layer at a time, every leaf's layer ``i`` first.

        A shard's order, so the files are read front to back. A leaf read through
        `rows` (cast or quantized by JAX) goes alone, leaf by leaf: its ring of
        layer buffers is one leaf's.
        """
        quantize_ = None if quantize is None else functools.cache(quantize)
        if quantize_ is not None:  # asked once a leaf (it may trace)
            warm_up(
                [
                    (path.replace(".__L__", ""), shape, final_dtype(names))
                    for _, _, path, names, shape in leaves
                    if shape
                ],
                quantize_,
            )
        alone, together = [], []
        for node, name, path, names, shape in leaves:
            if not shape:
                continue
            final = final_dtype(names)
            plain = path.replace(".__L__", "")
            stored = [flat[n] for n in names]
            views = [functools.partial(_same, v) for v in stored]
            raw = _raw_quantize(quantize_, plain, shape, stored, final)
            copy = quantize_ is None or quantize_(plain, tuple(shape)) is None
            if raw is not None or (
                copy and all(_exact_in_numpy(v.dtype, final) for v in stored)
            ):  # each layer quantized where it lies, or cast into the leaf: no copy
                leaf = StackedLeaf(
                    plain, shape, final, views, quantize_, host=raw, release=release
                )  # fmt: skip
                together.append((node, name, names, leaf))
            else:
                alone.append((node, name, plain, names, shape, final))
        if read_ahead is not None:  # in the order read below
            stacks = [names for _, _, names, _ in together]
            read_ahead(
                [flat[n] for _, _, _, names, _, _ in alone for n in names]
                + [flat[stacks[k][i]] for k, i in layer_major(list(map(len, stacks)))]
            )
        for node, name, plain, names, shape, final in alone:
            ring: list[Any] = [None] * (QUANTIZE_AHEAD + 1)  # this leaf's buffers
            layers = [
                functools.partial(rows(n, final, ring), None, None) for n in names
            ]
            leaf = StackedLeaf(plain, shape, final, layers, quantize_)
            (node[name],) = stream_layers([leaf])
        done = stream_layers([leaf for *_, leaf in together])
        for (node, name, _, _), value in zip(together, done, strict=True):
            node[name] = value

    # The unstacked leaves (an embedding, first in a shard) are built on a second
    # thread, their copy overlapping the setup and the layers' stream below.
    tables = []
    for node, name, path, names, shape in leaves:
        node[name] = None  # the key, in the config's order; the leaf comes below
        if not shape:
            n, plain, final = names[0], path.replace(".__L__", ""), final_dtype(names)
            job = _aside().submit(
                stream_one, plain, tuple(flat[n].shape), final, rows(n, final),
                quantize, fill=in_place(n, final),
            )  # fmt: skip
            tables.append((node, name, job))
    try:
        stream_stacked_leaves()
        for node, name, job in tables:
            node[name] = job.result()
    finally:
        concurrent.futures.wait([job for *_, job in tables])  # an error: they end too
    return _unmark(tree)


def on_host(fn: Any, src: Any, dtype: Any) -> HostQuantize | None:
    """``fn``'s host form for ``src`` arrays standing for ``dtype`` (`Quantize`)."""
    form = getattr(fn, "on_host", None)
    return None if form is None else form(np.dtype(src), np.dtype(dtype))


def _raw_quantize(
    quantize: Quantize | None,
    path: str,
    shape: tuple[int, ...],
    views: Sequence[Any],
    final: Any,
) -> HostQuantize | None:
    """The host form that quantizes a stacked leaf's stored layers as they lie.

    None unless ``quantize`` names the leaf, every layer is stored in one dtype
    that casts to ``final`` exactly, and the function has a host form for it.
    """
    fn = None if quantize is None else quantize(path, tuple(shape))
    src = {np.dtype(v.dtype) for v in views}
    if fn is None or len(src) != 1 or not _exact_in_numpy(next(iter(src)), final):
        return None
    return on_host(fn, next(iter(src)), final)


def quantize_leaves(params: Params, quantize: Quantize | None) -> Params:
    """Each array leaf of a loaded tree as ``quantize`` says (stacked leaves whole).

    What a load without streaming does; weight nodes (bases kept quantized from the
    file) stay as they are.
    """
    if quantize is None:
        return params

    def one(path: Any, leaf: Any) -> Any:
        if is_weight_node(leaf):
            return leaf
        fn = quantize(key_path_str(path), tuple(np.shape(leaf)))
        return leaf if fn is None else fn(leaf)

    return jax.tree_util.tree_map_with_path(one, params, is_leaf=is_weight_node)


def stream_one(
    path: str,
    shape: tuple[int, ...],
    dtype: DType,
    read_rows: RowReader,
    quantize: Quantize | None = None,
    chunk_bytes: int | None = None,
    *,
    fill: RowFill | None = None,
) -> Any:
    """A leaf that is not stacked (an embedding), read in chunks of rows.

    A matrix is allocated once and filled ``chunk_bytes`` of rows at a time, so its
    load holds the leaf plus one chunk (nothing more with ``fill``, which writes the
    rows in place); a leaf ``quantize`` names is then quantized whole (as before
    streaming: NF4's double quantization spans the matrix).

    Args:
        path: the leaf's dotted tree path (what ``quantize`` is asked about).
        shape: its shape.
        dtype: the dtype ``read_rows`` returns.
        read_rows: ``read_rows(start, stop)``, rows ``start:stop`` in ``dtype``;
            ``read_rows(None, None)`` the whole tensor.
        quantize: `Quantize`, or None.
        chunk_bytes: bytes of rows read at a time (default `CHUNK_BYTES`).
        fill: `RowFill` of the same rows, used for a matrix instead of
            ``read_rows``.
    """
    if len(shape) < 2:
        a = _on_device(read_rows(None, None))
    else:
        buf = _host_buffer(shape, dtype)  # (shape), filled chunk by chunk
        row_bytes = math.prod(shape[1:]) * np.dtype(dtype).itemsize
        step = max(1, (chunk_bytes or CHUNK_BYTES) // max(1, row_bytes))
        for start in range(0, shape[0], step):
            stop = min(start + step, shape[0])
            if fill is not None:
                fill(start, stop, buf[start:stop])  # (stop-start, ...) in place
            else:
                buf[start:stop] = np.asarray(read_rows(start, stop))
        a = to_device(buf)
    return _quantized(path, a, quantize)


class StackedLeaf:
    """One stacked leaf ``path`` of ``shape = (L, ...)`` filled from its ``L`` layers.

    An array leaf is allocated once on the host in its final dtype, filled layer by
    layer in numpy and handed to JAX once (no copy on the CPU), so the load holds the
    final tree plus this one leaf, and costs no compile or dispatch per layer. A leaf
    ``quantize`` names is quantized layer by layer instead: layer ``i`` is read,
    quantized as ``fn(layer[None])`` (a ``(1, ...)`` stack) on a worker thread, and
    each array of its node written at index ``i`` of the node's stacked host arrays
    (allocated from layer 0's, handed to JAX at the end). This is the node
    ``fn(leaf)`` gives because `Quantize` functions treat a stack layer by layer
    (NF4 by definition: `entrenar.quant.nf4.quantize_nf4`). A function with a host
    form (`Quantize`) runs it instead, on the layers as numpy arrays (no XLA
    program), writing each layer once the arrays exist straight into them.

    Args:
        path: the leaf's dotted tree path (what ``quantize`` is asked about).
        shape: ``(L, *layer_shape)``.
        dtype: the dtype the readers return.
        layers: ``L`` readers, layer ``i`` in order.
        quantize: `Quantize`, or None.
        host: the host form to quantize each layer with (`HostQuantize`), for
            readers that return arrays of another dtype than ``dtype`` (the
            file's bfloat16 standing for float32); default: the function's own
            for ``dtype``, if any.
        release: called with each layer's array once it is copied or quantized (a
            reader that returns a memory-mapped view leaves its pages to this).
    """

    def __init__(
        self,
        path: str,
        shape: tuple[int, ...],
        dtype: DType,
        layers: Sequence[Reader],
        quantize: Quantize | None = None,
        *,
        host: HostQuantize | None = None,
        release: Callable[[Any], None] | None = None,
    ) -> None:
        self.fn = None if quantize is None else quantize(path, tuple(shape))
        self.shape, self.layers, self.release = tuple(shape), layers, release
        self.host = host
        if self.fn is not None and host is None:
            self.host = on_host(self.fn, dtype, dtype)
        self.out: list[np.ndarray] = []  # the node's arrays, each (L, ...), on the host
        self.treedef: Any = None
        if self.fn is None:
            self.out.append(_host_buffer(self.shape, dtype))  # (L, *layer_shape)

    def copy(self, i: int) -> None:
        """Layer ``i`` read and cast into the array leaf (no ``quantize``)."""
        x = self.layers[i]()  # (*layer_shape), or a view it is cast from exactly
        np.copyto(self.out[0][i], np.asarray(x), casting="unsafe")
        if self.release is not None:
            self.release(x)

    def quantized(self, x: Any, into: Any) -> tuple[Any, bool]:
        """Layer ``x``'s node (arrays ``(1, ...)``), in ``into`` if not None."""
        if self.host is None:
            node = jax.block_until_ready(self.fn(x[None]))  # type: ignore[misc]
        else:  # no XLA program: numpy arrays, written into the leaf's once known
            node = self.host(np.asarray(x)[None], into)
        if self.release is not None:
            self.release(x)
        return node, into is not None

    def place(self, i: int) -> Any:
        """Layer ``i``'s views of the node's stacked arrays, once they exist."""
        if self.host is None or not self.out:
            return None
        return jax.tree_util.tree_unflatten(
            self.treedef, [b[i : i + 1] for b in self.out]
        )

    def put(self, i: int, done: tuple[Any, bool]) -> None:
        """Layer ``i``'s quantized node into the stacked arrays (made at layer 0)."""
        node, in_place = done  # in place: a host form wrote it into `out`
        arrays, self.treedef = jax.tree_util.tree_flatten(node)  # each (1, ...)
        if not self.out:
            self.out.extend(
                _host_buffer((self.shape[0], *x.shape[1:]), x.dtype) for x in arrays
            )
        for buf, x in zip(self.out, arrays, strict=True):
            if not in_place:
                buf[i] = np.asarray(x)[0]  # layer i's (...) at i

    def value(self) -> Any:
        """The finished leaf: an array, or the node of stacked arrays, on the device."""
        if self.fn is None:
            return to_device(self.out[0])
        return jax.tree_util.tree_unflatten(
            self.treedef, [to_device(b) for b in self.out]
        )


def layer_major(lengths: Sequence[int]) -> list[tuple[int, int]]:
    """``(leaf k, layer i)`` in `stream_layers`' order for leaves of ``lengths`` layers.

    >>> layer_major([2, 3])
    [(0, 0), (1, 0), (0, 1), (1, 1), (1, 2)]
    """
    depth = max(lengths, default=0)
    return [(k, i) for i in range(depth) for k, n in enumerate(lengths) if i < n]


def stream_layers(leaves: Sequence[StackedLeaf]) -> list[Any]:
    """Fill ``leaves`` a layer at a time: layer ``i`` of each, then layer ``i + 1``.

    In the order a Hugging Face shard or a GGUF stores them, so a load reads its
    files front to back. Array leaves are copied on this thread; worker threads
    quantize `QUANTIZE_AHEAD` layers at a time while this thread reads the next, so
    the load holds the final tree plus ``QUANTIZE_AHEAD + 1`` layers in the load's
    dtype and the quantizations' temporaries. A layer's error (NaN/Inf) is raised as
    is, once the layers in flight are done.

    Returns:
        Each leaf's `StackedLeaf.value`, in order.
    """
    pending: collections.deque[
        tuple[StackedLeaf, int, concurrent.futures.Future[tuple[Any, bool]]]
    ] = collections.deque()
    try:
        for k, i in layer_major([len(leaf.layers) for leaf in leaves]):
            leaf = leaves[k]
            if leaf.fn is None:
                leaf.copy(i)
                continue
            x = leaf.layers[i]()  # read here, now
            job = _workers().submit(leaf.quantized, x, leaf.place(i))
            pending.append((leaf, i, job))
            if len(pending) == QUANTIZE_AHEAD:
                done, j, job = pending.popleft()
                done.put(j, job.result())
        while pending:
            done, j, job = pending.popleft()
            done.put(j, job.result())
    finally:
        concurrent.futures.wait([job for *_, job in pending])  # layers in flight end
    return [leaf.value() for leaf in leaves]


def warm_up(
    stacked: Sequence[tuple[str, tuple[int, ...], DType]], quantize: Quantize
) -> None:
    """Compile, in the background, what `stream_layers` will run on each layer.

    For each distinct ``(layer shape, dtype)`` of the stacked leaves ``quantize``
    names, a worker thread calls its function once on zeros ``(1, *layer_shape)``
    (result dropped), so XLA compiles each program while the load reads the file
    (an embedding, the first layers) instead of on the first layer of each leaf.
    The later calls find the program compiled; the tree is the same. A function
    with a host form for the leaf's dtype (`Quantize`) compiles nothing and is
    skipped.

    Args:
        stacked: ``(path, (L, *layer_shape), dtype)`` of each stacked leaf.
        quantize: the load's `Quantize`.
    """
    seen: set[Any] = set()
    for path, shape, dtype in stacked:
        fn = quantize(path, tuple(shape))
        key = (_identity(fn), tuple(shape[1:]), np.dtype(dtype))
        if fn is None or key in seen or on_host(fn, dtype, dtype) is not None:
            continue
        seen.add(key)
        zeros = host_buffer((1, *shape[1:]), dtype, zeroed=True)  # never resident
        _workers().submit(_call_quietly, fn, zeros)


def _identity(fn: Any) -> Any:
    """What makes two quantize functions the same (a `functools.partial`'s parts)."""
    if isinstance(fn, functools.partial):
        return (fn.func, fn.args, tuple(sorted(fn.keywords.items())))
    return fn


def _call_quietly(fn: Callable[[Any], Any], x: Any) -> None:
    """``fn(x)`` to warm its compile cache; an error is the real call's to raise."""
    try:
        jax.block_until_ready(fn(x))
    except Exception:  # raised again by the layer's own call, with its context
        pass


def _aside() -> concurrent.futures.ThreadPoolExecutor:
    """The thread `stream_hf_names` builds the unstacked leaves on."""
    return shared_pool("load-aside", 1)


def _workers() -> concurrent.futures.ThreadPoolExecutor:
    """The threads `stream_layers` quantizes on, one per layer in flight."""
    return shared_pool("load-quantize", QUANTIZE_AHEAD)


def _exact_in_numpy(src: np.dtype, final: Any) -> bool:
    """Whether numpy's cast of ``src`` to ``final`` is exact (so it equals JAX's).

    The same dtype, or a float (float16, bfloat16, float32) widened to float32 or
    float64: every value is representable, so no rounding happens anywhere.
    """
    final = np.dtype(final)
    if src == final:
        return True
    wide = final in (np.dtype(np.float32), np.dtype(np.float64))
    return (
        wide
        and bool(jnp.issubdtype(src, jnp.floating))
        and final.itemsize > src.itemsize
    )


def _on_device(a: Any) -> jax.Array:
    """A reader's array as a JAX array (a numpy one handed over, no program run)."""
    return a if isinstance(a, jax.Array) else to_device(np.asarray(a))


def _quantized(path: str, a: jax.Array, quantize: Quantize | None) -> Any:
    """``a`` or its node; done (temporaries freed) before the next leaf is read.

    A function's host form (`Quantize`) runs on ``a``'s memory, no XLA program.
    """
    fn = None if quantize is None else quantize(path, tuple(a.shape))
    if fn is None:
        return a
    host = on_host(fn, a.dtype, a.dtype)
    if host is not None:
        return jax.tree_util.tree_map(to_device, host(np.asarray(a), None))
    return jax.block_until_ready(fn(a))


def _host_buffer(shape: tuple[int, ...], dtype: DType) -> np.ndarray:
    """A page-aligned host buffer of ``shape`` that `to_device` takes without a copy.

    Filling a leaf in numpy and handing JAX the finished array once costs no
    compile and no dispatch per layer or chunk (a donated update per part did).
    """
    return host_buffer(shape, np.dtype(jax.dtypes.canonicalize_dtype(dtype)))


def per_layer_shapes(config: HasParamShapes) -> dict[str, tuple[int, ...]]:
    """Hugging Face name -> shape of one tensor, every layer of ``config`` spelt out.

    >>> from entrenar.nn import LlamaConfig
    >>> c = LlamaConfig(vocab_size=8, hidden_size=4, intermediate_size=8,
    ...                 num_layers=2, num_heads=2, num_kv_heads=1)
    >>> per_layer_shapes(c)["model.layers.1.self_attn.k_proj.weight"]
    (2, 4)
    """
    flat: dict[str, tuple[int, ...]] = {}

    def walk(tree: Mapping[str, Any], prefix: str, stacked: bool = True) -> None:
        for k, v in tree.items():
            if isinstance(v, Mapping):
                walk(v, f"{prefix}{k}.", stacked)
            elif isinstance(v, list):  # unstacked layers, one dict each
                for i, sub in enumerate(v):
                    walk(sub, f"{prefix}{k}.{i}.", False)
            elif stacked and prefix.startswith("model.layers."):
                rest = f"{prefix}{k}".removeprefix("model.layers.")
                for i in range(config.num_layers):
                    flat[f"model.layers.{i}.{rest}"] = tuple(v[1:])
            else:
                flat[f"{prefix}{k}"] = tuple(v)

    walk(config.param_shapes(), "")
    return flat


def _check_no_extra(flat: Mapping[str, Any], used: set[str], *, tied: bool) -> None:
    """`FormatError` for names of ``flat`` the config does not describe.

    A tied model's stored ``lm_head.weight`` and derived buffers
    (`IGNORED_SUFFIXES`) are not extra.
    """
    extra = [
        k
        for k in flat
        if k not in used
        and not (tied and k == "lm_head.weight")
        and not k.endswith(IGNORED_SUFFIXES)
    ]
    if extra:
        raise FormatError(
            f"unexpected parameters {sorted(extra)[:5]} (of {len(extra)}); the "
            "checkpoint has tensors the config does not describe (pass strict=False "
            "to ignore them)"
        )


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
        if isinstance(v, list):
            out[key] = [_unmark(x) for x in v]
        else:
            out[key] = _unmark(v) if isinstance(v, Mapping) else v
    return out


__all__ = [
    "IGNORED_SUFFIXES",
    "QUANTIZE_AHEAD",
    "STACKED_KEYS",
    "HostQuantize",
    "Quantize",
    "Reader",
    "RowFill",
    "RowReader",
    "StackedLeaf",
    "from_hf_names",
    "layer_major",
    "lazy_hf_names",
    "on_host",
    "per_layer_shapes",
    "quantize_leaves",
    "stacked_split",
    "stream_hf_names",
    "stream_layers",
    "stream_one",
    "to_hf_names",
    "warm_up",
]
