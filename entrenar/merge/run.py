"""Run a merge recipe over model files: read through `entrenar.io`, write atomically.

Safetensors files and Hugging Face folders are memory-mapped, so a merge reads each
tensor when its turn comes; a ``.safetensors`` or folder output is written as it is
merged (`merge_streamed`), each leaf and its inputs' pages released once written, so
memory holds a few leaves, not the model. GGUF, JSON and YAML models are loaded by
`entrenar.io.load_model` (a llama.cpp GGUF dequantized to float32) and each input
tensor is released once merged; other outputs are merged in memory first. The
output format follows the output path's extension (``.safetensors``, ``.gguf``,
``.json``, ``.yaml``); any other path is a Hugging Face folder (``model.safetensors``
plus the base folder's ``config.json`` and tokenizer files), the only output of a
merge whose base is such a folder.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import shutil
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from entrenar import lora
from entrenar.errors import ConfigError, FormatError, UnsupportedError
from entrenar.io import (
    Model,
    ModelFormat,
    ModelMetadata,
    SaveConfig,
    atomic_write,
    detect_format,
    flatten_params,
    load_model,
    read_safetensors,
    save_model,
    save_safetensors,
    unflatten_params,
)
from entrenar.io.bounded import MAX_CONFIG_BYTES, read_json
from entrenar.io.hf_folder import MAX_INDEX_BYTES
from entrenar.io.hf_mxfp4 import (
    MXFP4Stack,
    mxfp4_stacks,
    read_mxfp4_stacks,
    write_mxfp4_stacks,
)
from entrenar.io.lock import OutputLock
from entrenar.io.model import STORAGE_DTYPES
from entrenar.io.safetensors_io import (
    header_metadata,
    metadata_from_header,
    release_pages,
    write_safetensors_stream,
)
from entrenar.merge import noise
from entrenar.merge.engine import Plan, merge_leaf
from entrenar.merge.leaves import (
    check_leaves,
    is_floating,
    layouts,
    named_leaves,
    num_layers,
    same_values,
)
from entrenar.merge.recipe import METHODS, ModelRef, Recipe, load_recipe, parse_recipe
from entrenar.merge.schedule import map_setting
from entrenar.nn import multimodal
from entrenar.nn.weight_node import logical_dtype, logical_shape

HF_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
)
"""Files copied from a Hugging Face base folder into an output folder."""


@dataclasses.dataclass
class Source:
    """An opened input model: metadata and ``{dotted name: array}`` (maybe mapped)."""

    path: str
    metadata: ModelMetadata
    leaves: dict[str, Any]
    folder: str | None = None
    mxfp4: bool = False  # a folder whose expert stacks are MXFP4 pairs


def _json_object(path: str, where: str, max_bytes: int) -> dict[str, Any]:
    """``path``'s JSON object, read within `entrenar.io.bounded`'s limits.

    Raises:
        FormatError: a file over ``max_bytes``, too deep, not JSON or not an
            object, naming ``where`` (the recipe key) and the file.
    """
    try:
        value = read_json(path, max_bytes=max_bytes)
    except FormatError as e:
        raise FormatError(f"{where}{e}") from None
    if not isinstance(value, dict):
        raise FormatError(f"{where}{path}: want a JSON object")
    return value


def _open_folder(folder: str, where: str) -> Source:
    """A Hugging Face folder: ``model.safetensors`` or the shards of its index.

    Raises:
        FormatError: no weights file, a missing shard or an unreadable index or
            ``config.json``, naming ``where`` (the recipe key) and the file.
    """
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.exists(index):
        weight_map = _json_object(index, where, MAX_INDEX_BYTES).get("weight_map")
        if not isinstance(weight_map, dict):
            raise FormatError(f"{where}{index}: 'weight_map' must map names to files")
        files = sorted({str(v) for v in weight_map.values()})
    elif os.path.isfile(os.path.join(folder, "model.safetensors")):
        files = ["model.safetensors"]
    else:
        raise FormatError(
            f"{where}{folder}: a model folder needs model.safetensors (or "
            "model.safetensors.index.json and its shards); it has neither"
        )
    leaves: dict[str, Any] = {}
    for name in files:
        if os.path.basename(name) != name:
            raise FormatError(f"{index}: shard name {name!r} must be a plain file name")
        shard = os.path.join(folder, name)
        if not os.path.isfile(shard):
            raise FormatError(f"{where}{index}: shard {name!r} is missing")
        leaves.update(read_safetensors(shard)[0])
    arch = "custom"
    cfg = os.path.join(folder, "config.json")
    if os.path.exists(cfg):
        arch = str(_json_object(cfg, where, MAX_CONFIG_BYTES).get("model_type", arch))
    meta = ModelMetadata(os.path.basename(os.path.normpath(folder)), arch)
    stacks = read_mxfp4_stacks(leaves, f"{where}{folder}")
    mxfp4 = any(isinstance(v, MXFP4Stack) for v in stacks.values())
    return Source(folder, meta, stacks, folder, mxfp4)


def open_model(ref: ModelRef) -> Source:
    """Open ``ref``'s model (and fold its adapter) for reading leaf by leaf.

    Raises:
        FormatError: a missing or unreadable model (the message names the recipe
            key, when the recipe gave one, and the file).
    """
    path = ref.path
    where = f"{ref.key}: " if ref.key else ""
    if os.path.isdir(path):
        src = _open_folder(path, where)
    elif not os.path.exists(path):
        raise FormatError(f"{where}{path}: no such model file or folder")
    elif detect_format(path) == ModelFormat.SAFETENSORS:
        tensors, meta = read_safetensors(path)
        src = Source(path, metadata_from_header(meta, path), dict(tensors))
    else:
        model = load_model(path)
        src = Source(path, model.metadata, named_leaves(model.params)[0])
    if ref.adapter:
        src.leaves = _fold_adapter(ref.adapter, src)
    return src


def _fold_adapter(adapter: str, src: Source) -> dict[str, Any]:
    """``src``'s leaves with ``adapter`` folded in, under their stored names.

    A vision-language folder (`entrenar.nn.multimodal`) stores its language model
    as ``language_model.model.*`` or ``model.language_model.*``, and its PEFT
    adapter names modules as the ConditionalGeneration model does: the adapter is
    folded into the language model under the text family's names, and the vision
    tower and projector pass through unchanged.
    """
    wrapper = multimodal.wrapper(src.metadata.architecture) if src.folder else None
    if wrapper is None:
        params = lora.load_adapter(adapter, unflatten_params(src.leaves))
        return named_leaves(lora.fold(params))[0]
    split = multimodal.split_tensors(src.leaves, src.path, wrapper.model_type)
    text = unflatten_params({t: src.leaves[s] for t, s in split.text.items()})
    params = lora.load_adapter(adapter, text, wrapper=wrapper.model_type)
    folded = named_leaves(lora.fold(params))[0]
    leaves = {name: src.leaves[name] for name in split.skipped}
    leaves.update((split.text[t], v) for t, v in folded.items())
    return leaves


def build_plan(recipe: Recipe, refs: Sequence[ModelRef]) -> Plan:
    """The `Plan` a recipe describes, with mergekit's per-method defaults."""
    spec = METHODS[recipe.merge_method]
    if spec["kind"] == "slerp":
        if recipe.parameters.get("t") is None:
            raise ConfigError("slerp needs parameters.t")
        return Plan("slerp", t=recipe.parameters["t"])
    weights = []
    for r in refs:
        w = recipe.setting(r, "weight")
        if w is None:
            raise ConfigError(f"{recipe.merge_method}: model {r.path} needs a weight")
        weights.append(w)
    if spec["kind"] == "linear":
        return Plan(
            "linear", weights=tuple(weights), normalize=recipe.flag("normalize")
        )
    density = tuple(recipe.setting(r, "density", 1.0) for r in refs)
    return Plan(
        "task_vectors",
        weights=tuple(weights),
        density=density if spec.get("trim") else None,
        keep=density if spec.get("drop") else None,
        lam=recipe.parameters.get("lambda", 1.0),
        elect=bool(spec.get("elect")),
        normalize=recipe.flag("normalize"),
        rescale=recipe.flag("rescale"),
        key=jax.random.key(recipe.random_seed) if spec.get("drop") else None,
    )


_FILE_FORMATS = {
    ".safetensors": ModelFormat.SAFETENSORS,
    ".gguf": ModelFormat.GGUF,
    ".json": ModelFormat.JSON,
    ".yaml": ModelFormat.YAML,
    ".yml": ModelFormat.YAML,
}  # output extensions written as one model file; any other output is a folder


def _output_format(output: str) -> ModelFormat | None:
    return _FILE_FORMATS.get(os.path.splitext(output)[1].lower())


def _write(model: Model, output: str, base: Source, out_dtype: str | None) -> None:
    fmt = _output_format(output)
    if fmt is not None:
        kind = {"float16": "F16", "bfloat16": "BF16"}.get(out_dtype or "", "F32")
        save_model(model, output, SaveConfig(fmt, gguf_tensor_type=kind))
        return
    if base.folder is None:
        raise ConfigError(
            f"{output}: a folder output needs a Hugging Face folder as the base "
            "model; name a .safetensors or .gguf file instead"
        )
    os.makedirs(output, exist_ok=True)
    tensors = flatten_params(model.params)
    if base.mxfp4:  # the merged expert stacks as MXFP4 again, as the base's
        tensors = write_mxfp4_stacks(tensors)
    save_safetensors(
        tensors, os.path.join(output, "model.safetensors"), {"format": "pt"}
    )
    _copy_hf_files(base.folder, output)


def _copy_hf_files(folder: str, output: str) -> None:
    """Copy the base folder's `HF_FILES` (config, tokenizer) into ``output``."""
    for name in HF_FILES:
        src = os.path.join(folder, name)
        if os.path.exists(src):
            with open(src, "rb") as f, atomic_write(os.path.join(output, name)) as g:
                shutil.copyfileobj(f, g)


def _as_recipe(recipe: Recipe | Mapping[str, Any] | str | os.PathLike[str]) -> Recipe:
    if isinstance(recipe, Recipe):
        return recipe
    if isinstance(recipe, Mapping):
        return parse_recipe(recipe, os.getcwd())
    return load_recipe(recipe)


def run_recipe(
    recipe: Recipe | Mapping[str, Any] | str | os.PathLike[str],
    output: str | os.PathLike[str] | None = None,
    *,
    stream: bool = True,
) -> Model:
    """Run a merge recipe (a `Recipe`, a mapping, or a YAML path).

    Args:
        recipe: what to merge (entrenar.merge.recipe documents the YAML).
        output: where to write the merged model (format from the extension; a
            folder for Hugging Face layout); None writes nothing.
        stream: write a ``.safetensors`` or folder output leaf by leaf as it is
            merged (`merge_streamed`: memory holds one leaf, not the model);
            False merges the whole model in memory first (the same file).

    Returns:
        The merged `Model` (the base's metadata; params in the inputs' layout).

    Raises:
        EntrenarError: a bad recipe or models that cannot be merged (`ConfigError`,
            `FormatError`, `UnsupportedError`, `CompatibilityError`, `ShapeError`,
            `DTypeError`), each naming the key, file or leaf; a `ConfigError` when
            another run is writing ``output`` (`entrenar.io.lock`).
    """
    recipe = _as_recipe(recipe)
    if output is None:
        return _merge(recipe, None, stream)
    output = os.fspath(output)
    with OutputLock(output, folder=_output_format(output) is None):
        return _merge(recipe, output, stream)


def write_opened(
    recipe: Recipe,
    sources: Sequence[Source],
    output: str | os.PathLike[str],
    *,
    memo: dict[str, Any] | None = None,
) -> Model:
    """`run_recipe` of inputs already opened by `open_inputs` (a search's best).

    ``output`` is locked as `run_recipe` locks it; the model is merged in memory
    (`merge_inputs`, ``sources`` left whole) and written.
    """
    output = os.fspath(output)
    _check_output(output, sources)
    with OutputLock(output, folder=_output_format(output) is None):
        return merge_inputs(recipe, sources, output, keep_inputs=True, memo=memo)


def _check_output(output: str | None, sources: Sequence[Source]) -> None:
    """Refuse a model file as the output of a merge whose base is a folder.

    Its tensors keep the folder's Hugging Face names and no architecture: neither
    entrenar nor llama.cpp could run such a file. A folder output is read as the
    base folder is.
    """
    base = sources[0]
    if output is None or base.folder is None or _output_format(output) is None:
        return
    raise ConfigError(
        f"{output}: the base model {base.path} is a Hugging Face folder, so the "
        "merge is written as one (model.safetensors beside the base's config.json "
        "and tokenizer): give an output path without a file extension (then "
        "`entrenar quantize FOLDER -o model.gguf` for a GGUF)"
    )


def _merge(recipe: Recipe, output: str | None, stream: bool) -> Model:
    """`run_recipe` once its output is locked."""
    sources = open_inputs(recipe)
    _check_output(output, sources)
    streams = _output_format(output or "") in (None, ModelFormat.SAFETENSORS)
    if stream and output is not None and streams and _streamable(sources):
        return merge_streamed(recipe, sources, output)
    return merge_inputs(recipe, sources, output)


def merged_refs(recipe: Recipe) -> list[ModelRef]:
    """The models merged onto the base (the recipe's models less the base)."""
    base = (
        recipe.base_model if METHODS[recipe.merge_method]["kind"] != "linear" else None
    )
    return [
        r
        for r in recipe.models
        if base is None or (r.path, r.adapter) != (base.path, base.adapter)
    ]


def layout_ref(recipe: Recipe) -> ModelRef:
    """The model whose layout and metadata the merge keeps (`open_inputs`' first).

    The base model, or for a method without one (linear) the first model.
    """
    kind = METHODS[recipe.merge_method]["kind"]
    if kind != "linear" and recipe.base_model is not None:
        return recipe.base_model
    refs = merged_refs(recipe)
    if not refs:
        raise ConfigError("the recipe lists no model besides the base")
    return refs[0]


def open_inputs(recipe: Recipe) -> list[Source]:
    """Open a recipe's models (the base first when its method has one), checked.

    Task vectors that are mostly re-quantization noise are corrected here, or
    refused, as ``recipe.quantized`` says (`entrenar.merge.noise`).
    """
    kind = METHODS[recipe.merge_method]["kind"]
    base_ref = recipe.base_model if kind != "linear" else None
    refs = merged_refs(recipe)
    if kind == "slerp" and len(refs) != 1:
        raise ConfigError("slerp merges base_model with exactly one other model")
    if not refs:
        raise ConfigError("the recipe lists no model besides the base")
    sources = ([open_model(base_ref)] if base_ref else []) + [
        open_model(r) for r in refs
    ]
    check_leaves(
        [s.path for s in sources],
        [s.leaves for s in sources],
        same_dtype=not recipe.dtype,
    )
    if base_ref is not None and kind == "task_vectors" and recipe.quantized != "keep":
        for i, r in enumerate(refs):
            _requantized(recipe, base_ref, r, sources, i + 1)
    shapes = {k: logical_shape(v) for k, v in sources[0].leaves.items()}
    span = recipe.models[0].layer_range
    if span is not None:
        depth = num_layers(shapes)
        if span[0] != 0 or span[1] != depth:
            raise UnsupportedError(
                f"layer_range {list(span)}: only a slice over all {depth} layers is "
                "supported"
            )
    return sources


def merge_inputs(
    recipe: Recipe,
    sources: Sequence[Source],
    output: str | None = None,
    *,
    keep_inputs: bool = False,
    memo: dict[str, Any] | None = None,
) -> Model:
    """Merge the models `open_inputs` opened, as ``recipe`` says, in memory.

    Args:
        recipe: the method and settings (its models must be those opened).
        sources: `open_inputs` of a recipe with the same models.
        output: where to write (see `run_recipe`; not locked here); None: nowhere.
        keep_inputs: leave ``sources`` whole, to merge them again with other
            settings (`entrenar.merge.search`); by default each input leaf is
            released once merged.
        memo: the merged task vectors per leaf, kept between merges that differ
            only in λ (`entrenar.merge.engine.merge_leaf`); None: none kept.
    """
    merger = _LeafMerger(recipe, sources, memo)
    out = {name: merger(name, keep_inputs) for name in list(sources[0].leaves)}
    meta = sources[0].metadata
    if output is not None:
        meta = meta.moved(sources[0].path, output)
    model = Model(meta, unflatten_params(out))
    if output is not None:
        _write(model, output, sources[0], recipe.out_dtype or recipe.dtype)
    return model


class _LeafMerger:
    """``merger(name)``: leaf ``name`` of the opened models, merged (one leaf)."""

    def __init__(
        self,
        recipe: Recipe,
        sources: Sequence[Source],
        memo: dict[str, Any] | None = None,
    ) -> None:
        self.recipe, self.sources, self.memo = recipe, sources, memo
        self.has_base = METHODS[recipe.merge_method]["kind"] != "linear"
        leaves = sources[0].leaves
        self.layouts = layouts({k: logical_shape(v) for k, v in leaves.items()})
        self.plan = build_plan(recipe, merged_refs(recipe))
        self.cast = STORAGE_DTYPES[recipe.dtype] if recipe.dtype else None

    def out_dtype(self, dt: np.dtype) -> np.dtype:
        """The dtype of a merged leaf of dtype ``dt``."""
        if not is_floating(dt):
            return np.dtype(dt)
        r = self.recipe
        return np.dtype(STORAGE_DTYPES[r.out_dtype or r.dtype or dt.name])

    def __call__(self, name: str, keep_inputs: bool = False) -> np.ndarray:
        """Merge leaf ``name``; unless ``keep_inputs``, drop it from the sources."""
        got = [s.leaves[name] if keep_inputs else s.leaves.pop(name)
               for s in self.sources]  # fmt: skip
        xs = [np.asarray(x) if isinstance(x, MXFP4Stack) else x for x in got]
        dt = logical_dtype(xs[0])
        if not is_floating(dt):
            return np.asarray(same_values(name, xs))
        if self.cast is not None:
            xs = [np.asarray(x).astype(self.cast) for x in xs]
        out_dt = self.out_dtype(dt)
        head, rest = (xs[0], xs[1:]) if self.has_base else (None, xs)
        if head is not None and all(np.array_equal(x, head) for x in rest):
            out = np.asarray(head).astype(out_dt)  # zero task vectors: the base
        else:
            out = np.asarray(
                merge_leaf(
                    self.plan, name, self.layouts[name], head, rest, out_dt, self.memo
                )
            )
        if not keep_inputs:
            for x in got:  # a mapped file's pages, read for this leaf, given back
                parts = [x.blocks, x.scales] if isinstance(x, MXFP4Stack) else [x]
                for a in parts:
                    if isinstance(a, np.ndarray):
                        release_pages(a)
        return out


def _streamable(sources: Sequence[Source]) -> bool:
    """Whether `merge_streamed` can write these leaves.

    They must be plain arrays whose names are the file's own (`flatten_params` of
    the tree gives them back).
    """
    leaves = sources[0].leaves
    if not all(isinstance(x, np.ndarray | jax.Array | MXFP4Stack) for s in sources
               for x in s.leaves.values()):  # fmt: skip
        return False
    stand_ins = {name: np.zeros((0,), np.float32) for name in leaves}
    try:
        return set(flatten_params(unflatten_params(stand_ins))) == set(leaves)
    except FormatError:
        return False


def merge_streamed(recipe: Recipe, sources: Sequence[Source], output: str) -> Model:
    """Merge leaf by leaf into ``output``: a ``.safetensors`` file or a folder.

    Each leaf is merged when its turn in the file comes, written
    (`entrenar.io.write_safetensors_stream`), and released with the input tensors'
    pages, so memory holds one leaf of each input and its merge, never the merged
    model. The file holds the tensors and metadata `merge_inputs` writes, equal
    value for value; the ``__metadata__`` keys may come in another order.

    Returns:
        The merged `Model`, its params memory-mapped from the written file.

    Raises:
        ConfigError: a folder output without a Hugging Face folder as the base.
    """
    lead = sources[0]
    fmt = _output_format(output)
    if fmt is None and lead.folder is None:
        raise ConfigError(
            f"{output}: a folder output needs a Hugging Face folder as the base "
            "model; name a .safetensors or .gguf file instead"
        )
    merger = _LeafMerger(recipe, sources)
    lead_meta = lead.metadata.moved(lead.path, output)
    specs = {
        name: (merger.out_dtype(logical_dtype(x)), tuple(logical_shape(x)))
        for name, x in lead.leaves.items()
    }
    made: dict[str, Callable[[], Any]] = {
        name: functools.partial(merger, name) for name in specs
    }
    if lead.mxfp4:  # the merged expert stacks as MXFP4 again, as the base's
        made, specs = mxfp4_stacks(made, specs)
    if fmt is None:
        os.makedirs(output, exist_ok=True)
        path, meta = os.path.join(output, "model.safetensors"), {"format": "pt"}
    else:
        path, meta = output, header_metadata(lead_meta)
    write_safetensors_stream(path, specs, lambda name: [made[name]()], meta)
    if fmt is None:
        _copy_hf_files(lead.folder or "", output)
    tensors, _ = read_safetensors(path)
    return Model(lead_meta, unflatten_params(tensors))


def _requantized(
    recipe: Recipe, base: ModelRef, ref: ModelRef, sources: list[Source], i: int
) -> None:
    """Check model ``i``'s task vector for re-quantization noise (`merge.noise`).

    A flagged model is replaced in ``sources`` by the base plus the adapter found
    beside its file, or its noisy leaves are corrected in place.

    Raises:
        ConfigError: the task vector is mostly noise and ``recipe.quantized`` is
            ``"refuse"``; the message names the better path.
    """
    src = sources[i]
    report = noise.requantization_noise(src.path, sources[0].leaves, src.leaves)
    if not report.flagged:
        return
    if recipe.quantized == "refuse":
        raise ConfigError(noise.better_path(report))
    adapter = noise.adapter_beside(src.path) if ref.adapter is None else None
    if adapter is not None:
        sources[i] = open_model(ModelRef(base.path, adapter, key=ref.key))
        warnings.warn(
            f"{report.describe()}; merging the base plus the adapter beside it "
            f"({adapter}) instead",
            UserWarning,
            stacklevel=4,
        )
        return
    warnings.warn(
        f"{report.describe()}; corrected: its task vector is taken against the "
        "base rounded onto that grid (quantized: correct). Merging the adapters or "
        "the folded float models keeps more of each fine-tune",
        UserWarning,
        stacklevel=4,
    )
    w = sources[0].leaves
    for name, grid in report.grids.items():
        src.leaves[name] = noise.correct_leaf(w[name], src.leaves[name], grid)


def files_recipe(
    models: Sequence[str | os.PathLike[str]],
    method: str,
    *,
    base: str | os.PathLike[str] | None = None,
    weights: Sequence[float] | None = None,
    density: float | Sequence[float] | None = None,
    drop_rate: float | None = None,
    t: float | Sequence[float] | None = None,
    lam: float | None = None,
    normalize: bool | None = None,
    dtype: str | None = None,
    seed: int = 0,
    quantized: str = "correct",
) -> Recipe:
    """The `Recipe` of a merge given by arguments (`merge_files` runs it).

    Args:
        models: the models to merge (the base is given separately).
        method: a `entrenar.merge.recipe.METHODS` name.
        base: the base model (SLERP's ``t = 0`` end).
        weights: one weight per model (default 1 each).
        density: TIES/DARE density, one for all or one per model.
        drop_rate: DARE's drop probability (sets ``density = 1 - drop_rate``).
        t: SLERP's ``t``, a number or a per-layer schedule.
        lam: λ.
        normalize: override the method's default.
        dtype: ``float32``, ``float16`` or ``bfloat16``.
        seed: DARE's random seed.
        quantized: ``"correct"``, ``"refuse"`` or ``"keep"`` a task vector that is
            mostly re-quantization noise (`entrenar.merge.noise`).

    Raises:
        ConfigError: conflicting or miscounted arguments, or a recipe they make
            that `parse_recipe` refuses.
    """
    if drop_rate is not None:
        if density is not None:
            raise ConfigError("give density or drop_rate, not both")
        density = map_setting(drop_rate, lambda p: 1.0 - p)
    n = len(models)
    if weights is not None and len(weights) != n:
        raise ConfigError(f"{len(weights)} weights for {n} models")
    if isinstance(density, Sequence) and len(density) != n:
        raise ConfigError(f"{len(density)} densities for {n} models")
    entries = []
    for i, m in enumerate(models):
        params: dict[str, Any] = {}
        if METHODS.get(method, {}).get("kind") in ("linear", "task_vectors"):
            params["weight"] = 1.0 if weights is None else weights[i]
        if density is not None:
            dens = density if not isinstance(density, Sequence) else density[i]
            params["density"] = dens
        entries.append({"model": os.fspath(m), "parameters": params})
    doc: dict[str, Any] = {
        "merge_method": method,
        "models": entries,
        "random_seed": seed,
        "quantized": quantized,
    }
    if base is not None:
        doc["base_model"] = os.fspath(base)
    glob: dict[str, Any] = {}
    for key, value in (("t", t), ("lambda", lam), ("normalize", normalize)):
        if value is not None:
            glob[key] = list(value) if isinstance(value, Sequence) else value
    if glob:
        doc["parameters"] = glob
    if dtype is not None:
        doc["dtype"] = dtype
    return parse_recipe(doc, os.getcwd(), "<merge_files>")


def merge_files(
    models: Sequence[str | os.PathLike[str]],
    method: str,
    output: str | os.PathLike[str] | None = None,
    *,
    stream: bool = True,
    **options: Any,
) -> Model:
    """Merge model files without writing a recipe (what ``entrenar merge`` calls).

    Args:
        models: the models to merge (the base is given separately).
        method: a `entrenar.merge.recipe.METHODS` name.
        output: where to write (see `run_recipe`); None writes nothing.
        stream: see `run_recipe`.
        **options: `files_recipe`'s keywords (``base``, ``weights``, ``density``,
            ``drop_rate``, ``t``, ``lam``, ``normalize``, ``dtype``, ``seed``,
            ``quantized``).
    """
    return run_recipe(files_recipe(models, method, **options), output, stream=stream)


__all__ = [
    "HF_FILES",
    "Source",
    "build_plan",
    "files_recipe",
    "layout_ref",
    "merge_files",
    "merge_inputs",
    "merge_streamed",
    "merged_refs",
    "open_inputs",
    "open_model",
    "run_recipe",
    "write_opened",
]
