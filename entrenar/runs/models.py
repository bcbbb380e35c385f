"""Models named by a config: built from an architecture spec or read from a file.

A `BuiltModel` is the model config object (`entrenar.nn.MLP`, `GPT2Config` or
`LlamaConfig`, which is also the model: ``apply(params, x)``), its params, and for a
language model the tokenizer. A Hugging Face folder or a llama.cpp GGUF of any
registered family is read with its own tokenizer (``tokenizer.json`` or the GGUF's
``tokenizer.ggml.*``). Files written by `save_built` keep the architecture in the
metadata (``custom["model_config"]``, or ``custom["llama_config"]`` for a
`LlamaConfig` family, its ``architecture`` field naming the family, as `entrenar.io`
writes it), so `load_built` rebuilds the same model.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np

from entrenar import data, io, lora, native, nn, quant
from entrenar.config.sections import ModelSection
from entrenar.config.spec import arch_config
from entrenar.errors import ConfigError, EntrenarError, FormatError
from entrenar.io.safetensors_io import metadata_from_header
from entrenar.lora.config import BASE_BLOCK
from entrenar.lora.transform import quantizes_untargeted
from entrenar.lora.transform import selects as lora_selects
from entrenar.nn.hf_names import HostQuantize, Quantize, quantize_leaves
from entrenar.quant.nf4 import quantize_nf4_host
from entrenar.quant.weight import check_blocks, check_finite
from entrenar.tree import key_path_str
from entrenar.types import Params


@dataclasses.dataclass(frozen=True)
class BuiltModel:
    """A model ready to train or run.

    Attributes:
        architecture: the registered family (``"mlp"``, ``"gpt2"``, ``"llama"``,
            ``"qwen2"``, ...).
        config: the model (``config.apply(params, inputs)``).
        params: its parameter tree.
        tokenizer: a language model's tokenizer (None for an mlp).
        source: the file it was read from (None when built from scratch).
        custom: the file's ``custom`` metadata (e.g. a tabular model's feature
            normalisation), empty otherwise.
    """

    architecture: str
    config: Any
    params: Params
    tokenizer: Any = None
    source: str | None = None
    custom: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def is_lm(self) -> bool:
        """Whether this is a language model (tokens in, logits out)."""
        return self.architecture != "mlp"

    @property
    def is_decoder(self) -> bool:
        """Whether the config is a `LlamaConfig` family (llama.cpp's kind of model)."""
        return isinstance(self.config, nn.LlamaConfig)

    @property
    def gguf_source(self) -> str | None:
        """The llama.cpp GGUF it was read from (its tokenizer and metadata), or None."""
        return self.source if self.source and self.source.endswith(".gguf") else None

    @property
    def tokenizer_source(self) -> str | None:
        """The file or folder its tokenizer was read from, or None.

        What an entrenar model file's ``custom["tokenizer"]`` names (resolved
        against the file's folder), else the GGUF or Hugging Face folder the model
        was read from; None without a tokenizer or a source. A model file written
        from this model names it (`tokenizer_ref`) so that it is read back with it.
        """
        if self.tokenizer is None or self.source is None:
            return None
        tok = self.custom.get("tokenizer")
        if isinstance(tok, str):
            return os.path.join(os.path.dirname(os.path.abspath(self.source)), tok)
        return self.source if self.gguf_source or os.path.isdir(self.source) else None

    def stored_config(self) -> dict[str, Any]:
        """``{"model_config" or, a `LlamaConfig`'s, "llama_config": fields}``."""
        key = "llama_config" if self.is_decoder else "model_config"
        fields = dataclasses.asdict(self.config).items()
        return {key: {k: list(v) if isinstance(v, tuple) else v for k, v in fields}}


def from_scratch(
    section: ModelSection, *, key: Any, shapes_only: bool = False
) -> BuiltModel:
    """Initialise ``section.architecture`` with the sizes in ``section.config``.

    ``shapes_only``: the params are `jax.ShapeDtypeStruct` leaves (nothing allocated).
    """
    assert section.architecture is not None  # ModelSection.check guarantees it
    sizes = dict(section.config)
    sizes.setdefault("param_dtype", section.dtype)
    config = arch_config(section.architecture, sizes, "model.config")
    params = jax.eval_shape(config.init, key) if shapes_only else config.init(key)
    return BuiltModel(section.architecture, config, params)


def load_built(
    path: str,
    *,
    keep_quantized: bool = False,
    dtype: str = "float32",
    quantize: Quantize | None = None,
) -> BuiltModel:
    """Read a model file or folder into a `BuiltModel`.

    Args:
        path: a llama.cpp ``.gguf`` or a Hugging Face folder of any registered
            family (with its tokenizer), or a file written by `save_built` /
            `entrenar.io.save_model` with the architecture in its metadata (and, for
            a language model, ``custom["tokenizer"]``: a GGUF or tokenizer folder
            relative to the model file's folder, loaded when it exists).
        keep_quantized: keep a GGUF's quantized projection weights as they are.
        dtype: dtype of the loaded (dequantized) parameters.
        quantize: the leaves to quantize, and how (`base_quantizer` for a QLoRA
            run); a GGUF or Hugging Face folder quantizes them as it streams them
            in (`entrenar.io.load_hf_folder`), never holding a float copy.

    Raises:
        FormatError: a file whose architecture cannot be told, or a bad file.
    """
    if os.path.isdir(path):
        info, params = io.load_hf_folder(path, dtype=dtype, quantize=quantize)
        name = info.architecture.name
        return BuiltModel(name, info.config, params, info.tokenizer(), path)
    if io.detect_format(path) == io.ModelFormat.GGUF:
        g = io.read_gguf(path)
        if "entrenar.version" not in g.fields:
            config, params, _ = io.load_llama_gguf(
                g, keep_quantized=keep_quantized, dtype=dtype, quantize=quantize
            )
            name = nn.architecture_of(config).name
            return BuiltModel(name, config, params, _gguf_tokenizer(g), path)
    model = io.load_model(path)
    custom = model.metadata.custom
    tree = lists_from_dicts(model.params)
    if isinstance(custom.get("quantization"), Mapping):
        tree = io.restore_quantized(tree, custom["quantization"], path)
    arch, config = _stored_config(path, model.metadata)
    _check_stored_shapes(config, tree, path)
    params = quantize_leaves(jax.tree_util.tree_map(jax.numpy.asarray, tree), quantize)
    tokenizer = _stored_tokenizer(path, custom)
    return BuiltModel(arch, config, params, tokenizer, path, dict(custom))


def base_quantizer(config: lora.LoRAConfig | None) -> Quantize | None:
    """The bases a QLoRA run quantizes, for the load to quantize as it reads them.

    A leaf is quantized when `lora.apply` with ``config`` would wrap and quantize it
    (or, with ``quantize_untargeted``, quantize it unwrapped), by the same call
    (`entrenar.quant.quantize`, NF4 with double quantization), so
    `lora.apply` then finds those bases quantized and keeps them: the tree equals
    quantizing after the load, bit for bit, without a float copy of the model. A
    leaf `lora.apply` would refuse is left to it (its error, as before). None when
    ``config`` quantizes nothing.

    The choice is made from the leaf's path and shape alone, as `lora.apply` makes
    it (`entrenar.lora.transform.selects`, then the quantizer's block check), with
    nothing traced. The function returned for a leaf also quantizes host arrays
    without an XLA program where the native NF4 kernel runs (`BaseQuantize.on_host`).
    """
    if config is None or not config.enabled or config.quantize_base == "none":
        return None
    scheme: str = config.quantize_base
    fn = BaseQuantize(scheme)

    def quantize(path: str, shape: tuple[int, ...]) -> Callable[[Any], Any] | None:
        try:
            chosen = lora_selects(path, shape, config)
            if chosen:
                check_blocks(shape, BASE_BLOCK, scheme)  # what quantize would refuse
        except EntrenarError:  # a target lora.apply refuses: its error, later
            return None
        return fn if chosen or quantizes_untargeted(path, shape, config) else None

    return quantize


@dataclasses.dataclass(frozen=True)
class BaseQuantize:
    """A QLoRA base's quantizer: ``quant.quantize(w, scheme)`` (NF4 with DQ).

    ``on_host(src, dtype)``: a `HostQuantize` for numpy arrays of dtype ``src``
    standing for their values cast to ``dtype`` (an exact cast: bfloat16 bytes loaded
    as float32) with no XLA program, giving the node this call gives for the cast
    array, bit for bit; None where that cannot run (not NF4, the native kernel off,
    another dtype).
    """

    scheme: str

    def __call__(self, w: Any) -> Any:
        """``w`` quantized as `lora.apply` quantizes a base."""
        return quant.quantize(
            w, self.scheme, block_size=BASE_BLOCK, double_quant=self.scheme == "nf4"
        )

    def on_host(self, src: Any, dtype: Any) -> HostQuantize | None:
        """The host form of this quantizer for ``src`` arrays (class docstring)."""
        if (
            self.scheme != "nf4"
            or native.library("nf4_quantize", np.dtype(src)) is None
        ):
            return None
        return functools.partial(_nf4_on_host, dtype=np.dtype(dtype))


def _nf4_on_host(w: Any, into: Any = None, *, dtype: np.dtype) -> Any:
    """NF4 with DQ of a host array by the native kernel, as `quant.quantize` does.

    ``into``: numpy arrays to write the node into (`entrenar.nn.hf_names.HostQuantize`).
    """
    done = quantize_nf4_host(
        w, block_size=BASE_BLOCK, double_quant=True, dtype=dtype, out=into
    )
    if done is None:  # the kernel went off (the policy changed) since asked
        node = quant.quantize(np.asarray(w, dtype), "nf4", double_quant=True)
        if into is None:
            return node
        leaves = jax.tree_util.tree_leaves
        for dst, src in zip(leaves(into), leaves(node), strict=True):
            dst[...] = np.asarray(src)
        return into
    node, finite = done
    if not finite:
        check_finite(w, "nf4")  # raises, naming the first NaN/Inf
    return node


def _check_stored_shapes(config: Any, tree: Any, path: str) -> None:
    """The tensors of an entrenar file against the params its stored config makes.

    A ``model_config`` that disagrees with the tensors (``n_embd`` 10**9 beside
    weights of 96) would load and fail at the first forward with a reshape
    ``TypeError``, or run with another depth than the config says.

    Raises:
        FormatError: the first tensor missing, extra or of another shape.
    """

    def shapes(t: Any) -> dict[str, tuple[int, ...]]:
        leaves = jax.tree_util.tree_flatten_with_path(t, is_leaf=nn.is_weight_node)[0]
        return {key_path_str(k): tuple(nn.logical_shape(v)) for k, v in leaves}

    want, got = shapes(_shapes(config, path)), shapes(tree)
    for name in sorted(want.keys() | got.keys()):
        if want.get(name) != got.get(name):
            raise FormatError(
                f"{path}: tensor {name!r} has shape {got.get(name)}, its stored "
                f"model_config makes {want.get(name)} (None: absent); the file's "
                "metadata does not describe its tensors"
            )


def _stored_config(path: str, meta: io.ModelMetadata) -> tuple[str, Any]:
    """The architecture and model config an entrenar file's metadata names."""
    custom, arch = meta.custom, meta.architecture
    if isinstance(custom.get("llama_config"), Mapping):
        fields = custom["llama_config"]
        arch = str(fields.get("architecture", "llama"))
    elif isinstance(custom.get("model_config"), Mapping) and arch in (
        nn.architecture_names()
    ):
        fields = custom["model_config"]
    else:
        raise FormatError(
            f"{path}: its metadata does not say which model it holds (architecture "
            f"{arch!r}, no custom.model_config); save models with "
            "entrenar.runs.save_built or give model.architecture and model.config"
        )
    return arch, arch_config(arch, fields, f"{path}: model_config")


def tokenizer_ref(tokenizer: str, model_file: str) -> str:
    """``custom["tokenizer"]`` of ``model_file``: ``tokenizer`` relative to its folder.

    `load_built` resolves it against the folder of the file that stores it.
    """
    folder = os.path.dirname(os.path.abspath(model_file))
    return os.path.relpath(os.path.abspath(tokenizer), folder)


def _stored_tokenizer(path: str, custom: Mapping[str, Any]) -> Any:
    """The tokenizer ``custom["tokenizer"]`` names (relative to the file), or None."""
    tok = custom.get("tokenizer")
    if tok is None:
        return None
    if not isinstance(tok, str):  # os.path.exists(7) would test file descriptor 7
        raise FormatError(
            f"{path}: its metadata's custom.tokenizer = {str(tok)[:40]!r} is not a "
            "path; save models with entrenar.runs.save_built"
        )
    tok = os.path.join(os.path.dirname(os.path.abspath(path)), tok)
    return data.load_fast_tokenizer(tok) if os.path.exists(tok) else None


def read_header(path: str) -> BuiltModel:
    """What `load_built` reads from ``path``, from the file's header alone.

    The params are shapes (`jax.ShapeDtypeStruct`, from ``config.init``), so a
    100 MB GGUF is checked in a fraction of a second: a llama.cpp GGUF's magic,
    version, metadata and tensor table (`entrenar.io.read_llama_header`), a Hugging
    Face folder's ``config.json``, shard index and safetensors headers (and its
    tokenizer), an entrenar safetensors
    file's header. Other entrenar files (JSON, YAML, GGUF) are loaded whole. The
    tokenizer is loaded as `load_built` loads it.

    Raises:
        FormatError: a file `load_built` would refuse for its header.
    """
    if os.path.isdir(path):
        info = io.read_hf_folder(path)
        config: Any = info.config
        tok = info.tokenizer()
        return BuiltModel(
            info.architecture.name, config, _shapes(config, path), tok, path
        )
    fmt = io.detect_format(path)
    if fmt == io.ModelFormat.GGUF:
        g = io.read_gguf(path)
        if "entrenar.version" not in g.fields:
            _, config = io.read_llama_header(g)
            tok = _gguf_tokenizer(g)
            name = nn.architecture_of(config).name
            return BuiltModel(name, config, _shapes(config, path), tok, path)
    if fmt != io.ModelFormat.SAFETENSORS:
        return load_built(path)
    tensors, header = io.read_safetensors(path)
    meta = metadata_from_header(header, path)
    arch, config = _stored_config(path, meta)
    if not isinstance(meta.custom.get("quantization"), Mapping):  # else split
        tree = lists_from_dicts(io.unflatten_params(tensors))
        _check_stored_shapes(config, tree, path)  # as load_built does
    tok = _stored_tokenizer(path, meta.custom)
    return BuiltModel(arch, config, _shapes(config, path), tok, path, dict(meta.custom))


def _shapes(config: Any, path: str) -> Any:
    """The params ``config.init`` makes, as `jax.ShapeDtypeStruct` leaves.

    Raises:
        FormatError: sizes in ``path``'s config that no array can have (a
            ``hidden_size`` of 2**63 makes JAX raise a TypeError).
    """
    try:
        return jax.eval_shape(config.init, jax.random.key(0))
    except (TypeError, ValueError, OverflowError) as e:
        raise FormatError(
            f"{path}: its config gives shapes no array can have "
            f"({str(e).splitlines()[0][:120]}); check the config's sizes"
        ) from None


def _gguf_tokenizer(g: io.GGUFFile) -> Any:
    """A llama.cpp GGUF's own tokenizer (`entrenar.data.FastTokenizer`), or None."""
    has_tok = "tokenizer.ggml.tokens" in g.metadata
    return data.load_fast_tokenizer(g) if has_tok else None


def build_model(
    section: ModelSection,
    *,
    key: Any,
    header_only: bool = False,
    quantize: Quantize | None = None,
) -> BuiltModel:
    """The model a ``model:`` section names: loaded from its path or from scratch.

    ``header_only``: read only the file's header (`read_header`), the params as
    shapes; every check but those of the tensors' bytes is the same. ``quantize``:
    the leaves a file's load quantizes as it reads them (`base_quantizer`); a model
    built from scratch is not quantized here.
    """
    if section.path is None:
        built = from_scratch(section, key=key, shapes_only=header_only)
    else:
        try:
            if header_only:
                built = read_header(section.path)
            else:
                built = load_built(
                    section.path,
                    keep_quantized=section.keep_quantized,
                    dtype=section.dtype,
                    quantize=quantize,
                )
        except EntrenarError as e:
            raise type(e)(f"model.path: {e}") from None
        if section.architecture not in (None, built.architecture):
            raise ConfigError(
                f"model.architecture: {section.architecture!r} but {section.path} "
                f"holds a {built.architecture} model"
            )
    if section.tokenizer is not None:
        built = dataclasses.replace(
            built, tokenizer=data.load_fast_tokenizer(section.tokenizer)
        )
    return with_precision(built, section)


LLAMA_OPTIONS = ("remat_saved_dtype", "mlp_chunk_elements")
"""The `LlamaConfig` fields ``model.llama_options`` may set: how a step computes and
what it keeps, never a size (LlamaConfig checks the values)."""


def with_precision(built: BuiltModel, section: ModelSection) -> BuiltModel:
    """Apply the LlamaConfig options of ``model`` (``matmul_dtype`` and others).

    ``matmul_dtype``, ``remat_policy``, ``tied_head_copy`` and ``llama_options``
    (the fields of `LLAMA_OPTIONS`, declared once, in `LlamaConfig`).
    """
    unknown = sorted(set(section.llama_options) - set(LLAMA_OPTIONS))
    if unknown:
        raise ConfigError(
            f"model.llama_options: {unknown} cannot be set here; it takes "
            f"{', '.join(LLAMA_OPTIONS)}"
        )
    if (
        section.matmul_dtype == "float32"
        and section.remat_policy is None
        and section.tied_head_copy
        and not section.llama_options
    ):
        return built
    if not built.is_decoder:
        raise ConfigError(
            f"model.matmul_dtype / model.remat_policy / model.tied_head_copy / "
            f"model.llama_options apply to a Llama-style decoder "
            f"(llama, qwen2, ...), not {built.architecture}; remove them"
        )
    md = section.matmul_dtype
    matmul_dtype = nn.auto_matmul_dtype() if md == "auto" else md
    try:
        config = dataclasses.replace(
            built.config,
            matmul_dtype=None if matmul_dtype == "float32" else matmul_dtype,
            remat_policy=section.remat_policy,
            tied_head_copy=section.tied_head_copy,
            **section.llama_options,
        )
    except ConfigError as e:
        raise ConfigError(f"model: {e}") from None
    return dataclasses.replace(built, config=config)


def save_built(
    built: BuiltModel,
    params: Params,
    path: str,
    *,
    fmt: str = "safetensors",
    name: str = "model",
    training_config: Mapping[str, Any] | None = None,
    extra: Mapping[str, Any] | None = None,
) -> None:
    """Write ``params`` of ``built`` so that `load_built` reads the model back.

    Lists in the tree (an mlp's layers) are stored as dicts keyed ``"0"``, ``"1"``...
    (names ``layers.0.weight``); ``extra`` goes into the metadata's ``custom``.
    """
    custom = built.stored_config()
    if built.is_decoder and built.gguf_source:
        custom["gguf_source"] = built.gguf_source
    custom.update(extra or {})
    meta = io.ModelMetadata(
        name=name,
        architecture=built.architecture,
        training_config=dict(training_config or {}),
        custom=custom,
    )
    tree = dicts_from_lists(params)
    io.save_model(io.Model(meta, tree), path, io.SaveConfig(io.ModelFormat(fmt)))


def dicts_from_lists(tree: Any) -> Any:
    """Lists in a param tree as dicts keyed by position (``"0"``, ``"1"``, ...)."""
    if isinstance(tree, Mapping):
        return {k: dicts_from_lists(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return {str(i): dicts_from_lists(v) for i, v in enumerate(tree)}
    return tree


def lists_from_dicts(tree: Any) -> Any:
    """The inverse of `dicts_from_lists`: dicts keyed ``"0".."n-1"`` become lists."""
    if not isinstance(tree, Mapping):
        return tree
    out = {k: lists_from_dicts(v) for k, v in tree.items()}
    if (
        out
        and all(k.isdigit() for k in out)
        and sorted(map(int, out)) == list(range(len(out)))
    ):
        return [out[str(i)] for i in range(len(out))]
    return out


__all__ = [
    "BASE_BLOCK",
    "BaseQuantize",
    "BuiltModel",
    "base_quantizer",
    "build_model",
    "dicts_from_lists",
    "from_scratch",
    "lists_from_dicts",
    "load_built",
    "read_header",
    "save_built",
    "tokenizer_ref",
]
