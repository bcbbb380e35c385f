"""Hugging Face model folders, as users have them, into and out of `entrenar.nn`.

A folder holds ``config.json`` (its ``model_type`` names the family:
`entrenar.nn.architecture_for_hf`, then the family's ``from_hf``), the weights in
``model.safetensors`` or in shards listed by ``model.safetensors.index.json``
(``{"weight_map": {tensor name: shard file}}``), and optionally
``generation_config.json`` (EOS ids) and the tokenizer files
(`entrenar.io.hf_tokenizer`). Tensor names are entrenar's flattened names
(``model.layers.3.self_attn.q_proj.weight``, `entrenar.nn.from_hf_names`); Hugging
Face already uses the half-split rotary layout, so nothing is permuted.

Reading checks everything before any tensor is read: the JSON files within
`entrenar.io.bounded`'s limits, shard names (plain file names that exist), the index
against each shard's header (every tensor in the shard the index names, none twice),
and each safetensors header (`read_safetensors` maps the data without reading it).

`save_hf_folder` writes the same layout (``config.json`` by the family's ``to_hf``,
shards of at most ``max_shard_bytes`` with the index when there are several,
``generation_config.json`` and the tokenizer files), which
``transformers.AutoModelForCausalLM`` and ``AutoTokenizer`` load.

A vision-language folder (Gemma 3 4B+, Mistral Small 3.1/3.2, Ministral 3, LLaVA,
LLaVA-NeXT, Qwen2-VL, Qwen2.5-VL, Qwen3-VL(-MoE): `entrenar.nn.multimodal`) is read as
its language model, the vision tower and projector left on
disk (`HFFolder.multimodal`); its export (``save_hf_folder(..., source=folder)``)
writes the whole folder again, those tensors copied byte for byte.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import math
import os
import warnings
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from entrenar import nn
from entrenar.errors import FormatError, ShapeError, UnsupportedError
from entrenar.io.atomic import atomic_write
from entrenar.io.bounded import MAX_CONFIG_BYTES, read_json, read_text
from entrenar.io.heap import bound_heap
from entrenar.io.hf_mxfp4 import QUANTIZATION_CONFIG, check_hf_expert_type, mxfp4_stacks
from entrenar.io.hf_tokenizer import HFTokenizer, eos_ids_of, tokenizer_files
from entrenar.io.read_ahead import ReadAhead
from entrenar.io.safetensors_io import (
    read_safetensors,
    write_safetensors_stream,
)
from entrenar.nn import multimodal
from entrenar.nn.hf_names import (
    Quantize,
    lazy_hf_names,
    quantize_leaves,
    stream_hf_names,
)
from entrenar.nn.multimodal import Split
from entrenar.nn.weight_node import is_weight_node
from entrenar.types import Params

_LOG = logging.getLogger(__name__)

MAX_INDEX_BYTES = 16 << 20
"""Largest ``model.safetensors.index.json`` read (a 405B model's is about 2 MB)."""
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
DEFAULT_SHARD_BYTES = 4 << 30
"""`save_hf_folder`'s shard size (transformers' ``max_shard_size`` default: 5 GB)."""


@dataclasses.dataclass(frozen=True)
class HFFolder:
    """What a Hugging Face folder's small files say, checked (module docstring).

    Attributes:
        path: the folder.
        architecture: the registered family (`entrenar.nn.Architecture`).
        config: the family's model config.
        files: the safetensors files (full paths), in name order.
        generation: ``generation_config.json`` (``{}`` when absent).
        multimodal: a vision-language folder's split of its tensors
            (`entrenar.nn.multimodal.Split`: the language model's layout, the
            vision tower and projector left on disk); None for a text model.
    """

    path: str
    architecture: Any
    config: Any
    files: tuple[str, ...]
    generation: dict[str, Any]
    multimodal: Split | None = None

    @property
    def skipped_note(self) -> str | None:
        """What a vision-language folder's load leaves out, in one line, or None."""
        mm = self.multimodal
        if mm is None:
            return None
        return (
            f"{self.config.hf_wrapper}: the language model only; the vision tower "
            f"and projector ({len(mm.skipped)} tensors, {mm.skipped_params:,} "
            "parameters) are not loaded (a Hugging Face export copies them back)"
        )

    @property
    def eos_ids(self) -> tuple[int, ...]:
        """``generation_config.json``'s ``eos_token_id``(s)."""
        return eos_ids_of(
            self.generation, os.path.join(self.path, "generation_config.json")
        )

    @property
    def has_tokenizer(self) -> bool:
        """Whether the folder holds a ``tokenizer.json``."""
        return os.path.isfile(os.path.join(self.path, "tokenizer.json"))

    def tokenizer(self) -> HFTokenizer | None:
        """The folder's own tokenizer (`HFTokenizer`), or None without one."""
        return HFTokenizer.from_folder(self.path) if self.has_tokenizer else None


def _json_object(path: str, max_bytes: int = MAX_CONFIG_BYTES) -> dict[str, Any]:
    value = read_json(path, max_bytes=max_bytes, max_depth=None)
    if not isinstance(value, dict):
        raise FormatError(f"{path}: want a JSON object")
    return value


COUNT_LIMITS = {
    "num_layers": 1 << 12,
    "num_heads": 1 << 12,
    "num_kv_heads": 1 << 12,
    "num_experts": 1 << 16,
    "num_experts_per_tok": 1 << 16,
    "n_shared_experts": 1 << 16,
    "n_group": 1 << 16,
    "topk_group": 1 << 16,
    "first_k_dense_replace": 1 << 12,
    "num_nextn_predict_layers": 1 << 12,
}
"""Largest value of a config's counts that a load loops over before it compares the
config with the checkpoint's tensors (the GGUF reader's `INT_LIMITS` for the same
counts); every other integer field is below ``2**31``."""


HF_COUNTS = {
    "vocab_size": None,
    "hidden_size": None,
    "intermediate_size": None,
    "num_hidden_layers": "num_layers",
    "num_attention_heads": "num_heads",
    "num_key_value_heads": "num_kv_heads",
    "head_dim": None,
    "max_position_embeddings": None,
    "original_max_position_embeddings": None,
    "sliding_window": None,
    "sliding_window_pattern": "num_layers",
    "max_window_layers": "num_layers",
    "no_rope_layer_interval": "num_layers",
    "decoder_sparse_step": "num_layers",
    "num_experts": "num_experts",
    "num_local_experts": "num_experts",
    "n_routed_experts": "num_experts",
    "num_experts_per_tok": "num_experts_per_tok",
    "moe_intermediate_size": None,
    "shared_expert_intermediate_size": None,
    "shared_intermediate_size": None,
    "n_shared_experts": "n_shared_experts",
    "n_group": "n_group",
    "topk_group": "topk_group",
    "first_k_dense_replace": "first_k_dense_replace",
    "num_nextn_predict_layers": "num_nextn_predict_layers",
    "q_lora_rank": None,
    "kv_lora_rank": None,
    "qk_nope_head_dim": None,
    "qk_rope_head_dim": None,
    "v_head_dim": None,
    "n_positions": None,
    "n_embd": None,
    "n_layer": "num_layers",
    "n_head": "num_heads",
}
"""The counts and sizes of a ``config.json`` the families read, by key, with the
`COUNT_LIMITS` entry that bounds each (None: below ``2**31``); `check_hf_counts`
checks them before a family's ``from_hf`` loops over any."""

_ROPE_DICTS = ("rope_scaling", "rope_parameters")


def check_hf_counts(hf: Mapping[str, Any], path: str, prefix: str = "") -> None:
    """Refuse a negative or huge count of `HF_COUNTS` in a ``config.json`` dict.

    Looks at the top level and the rope dicts (``rope_scaling``,
    ``rope_parameters`` and its per-layer-type parts), where
    ``original_max_position_embeddings`` lives. Only integers are checked (a
    string or float is the family reader's to refuse). No checkpoint has a
    negative count; today's loads took several silently (a negative
    ``max_position_embeddings`` or ``original_max_position_embeddings`` gave a
    rotary scaling of a negative context; a negative ``n_shared_experts`` a
    shared expert ``-12`` wide) or refused them deep inside under another
    name, and a ``num_hidden_layers`` of ``2**31 - 1`` had Gemma 2's reader
    build a list per layer (minutes, tens of GB) before `check_config_values`.

    Raises:
        FormatError: naming ``path``, the key (under ``prefix``) and its value.
    """
    dicts: list[tuple[str, Mapping[str, Any]]] = [(prefix, hf)]
    for name in _ROPE_DICTS:
        rope = hf.get(name)
        if isinstance(rope, Mapping):
            dicts.append((f"{prefix}{name}.", rope))
            dicts.extend(
                (f"{prefix}{name}.{k}.", v)
                for k, v in rope.items()
                if isinstance(v, Mapping)
            )
    for where, d in dicts:
        for key, field in HF_COUNTS.items():
            x = d.get(key)
            if not isinstance(x, int) or isinstance(x, bool):
                continue
            limit = COUNT_LIMITS.get(field or "", (1 << 31) - 1)
            if not 0 <= x <= limit:
                want = "a count >= 0" if x < 0 else f"at most {limit}"
                raise FormatError(
                    f"{path}: {where}{key} = {x}: want {want}; the config.json is "
                    "corrupt or not a model entrenar can load (compare it with the "
                    "checkpoint's original config.json)"
                )


Kinds = list[tuple[tuple[type, ...], tuple[type, ...]]]
"""A field's types, each with the types of its items when it is a tuple (`_kinds`)."""
_KINDS: dict[str, tuple[type, ...]] = {
    "int": (int,),
    "float": (int, float),
    "str": (str,),
    "bool": (bool,),
    "None": (type(None),),
}


def _kinds(annotation: str) -> Kinds | None:
    """A field's annotation as ``[(types, element types of a tuple)]``, or None.

    None: not one of the plain forms configs use (``int``, ``float | None``,
    ``tuple[str, ...] | None``, ...); such a field is left unchecked.
    """
    out: Kinds = []
    for part in (a.strip() for a in annotation.split("|")):
        inner = part.removeprefix("tuple[").removesuffix(", ...]")
        if part.startswith("tuple[") and inner in _KINDS:
            out.append(((tuple,), _KINDS[inner]))
        elif part in _KINDS:
            out.append((_KINDS[part], ()))
        else:
            return None
    return out


def _fits(x: Any, kinds: Kinds) -> bool:
    """Whether ``x`` is of one of ``kinds`` (a bool is no int or float here)."""
    value: Any = x  # (isinstance below would narrow x to object)
    for types, items in kinds:
        if not isinstance(x, types) or (isinstance(x, bool) and bool not in types):
            continue
        elems: tuple[Any, ...] = value if items else ()  # (a tuple then)
        if all(
            isinstance(v, items) and (bool in items or not isinstance(v, bool))
            for v in elems
        ):
            return True
    return False


def check_field_types(cls: type, values: Mapping[str, Any], where: str) -> None:
    """Refuse a value of ``values`` (config fields by name) not of its field's type.

    A list stands for a tuple (JSON has no tuples).

    Raises:
        FormatError: naming ``where``, the field, its value and the type wanted.
    """
    types = {f.name: str(f.type) for f in dataclasses.fields(cls)}
    for key, value in values.items():
        kinds = _kinds(types[key]) if key in types else None
        as_read = tuple(value) if isinstance(value, list) else value
        if kinds is not None and not _fits(as_read, kinds):
            raise FormatError(
                f"{where}: {key} = {value!r:.60} is not {types[key]}; the file is "
                "corrupt"
            )


def check_config_values(
    config: Any, path: str, source: str = "the config.json"
) -> None:
    """Refuse a config whose values no checkpoint has, before anything uses them.

    Every field must hold its annotated type (a string or a list where a number
    belongs came through a GGUF file's ``entrenar.family`` object, loaded, and
    crashed the first forward pass). Every float field (and float in a tuple
    field) must be finite: a NaN YaRN ``beta_fast`` or an infinite Llama 4
    ``llama_4_scaling_beta`` gave NaN logits from a load that succeeded. Every
    integer must lie in ``[0, 2**31)``, and the counts of `COUNT_LIMITS` below
    their limit: a ``n_routed_experts`` or ``num_hidden_layers`` of 10^9 had the
    load build a name per expert or layer (minutes, gigabytes) before any
    tensor's shape was compared. No integer field is negative (none has a
    negative meaning; `check_hf_counts` names the ``config.json`` keys the
    families read, this catches every field). ``source`` names what the config
    was read from, for the message.

    Raises:
        FormatError: naming ``path``, the field and its value.
    """
    name = type(config).__name__
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        kinds = _kinds(str(f.type))
        if kinds is not None and not _fits(value, kinds):
            raise FormatError(
                f"{path}: {name}.{f.name} = {value!r:.60} is not {f.type}; "
                f"{source} is corrupt"
            )
        limit = COUNT_LIMITS.get(f.name, (1 << 31) - 1)
        for x in value if isinstance(value, tuple) else (value,):
            if isinstance(x, bool):
                continue
            if isinstance(x, float) and not math.isfinite(x):
                raise FormatError(
                    f"{path}: {name}.{f.name} = {x!r}: want a finite number; "
                    f"{source} is corrupt"
                )
            if isinstance(x, int) and not 0 <= x <= limit:
                what = "negative" if x < 0 else f"over the limit of {limit}"
                raise FormatError(
                    f"{path}: {name}.{f.name} = {x} is {what}; {source} is corrupt "
                    "or not a model entrenar can load"
                )


def read_hf_config(folder: str | os.PathLike[str]) -> tuple[Any, Any]:
    """``(architecture, config)`` of a folder's ``config.json``.

    Its counts are checked (`check_hf_counts`) before the family reads them, its
    numbers (`check_config_values`) before it is returned.

    Raises:
        FormatError: no or an invalid ``config.json``, fields of the wrong type, or
            values out of range.
        UnsupportedError: a ``model_type`` no family reads, or a feature the family
            does not implement (named by the family's ``from_hf``).
    """
    path = os.path.join(os.fspath(folder), "config.json")
    if not os.path.isfile(path):
        raise FormatError(
            f"{folder}: no config.json; is it a Hugging Face model folder?"
        )
    hf = _json_object(path)
    wrapper = multimodal.wrapper(hf.get("model_type"))
    prefix = ""
    if wrapper is not None:  # a vision-language folder: its language model
        prefix = "text_config." if isinstance(hf.get("text_config"), dict) else ""
        hf = multimodal.text_config(hf, path)
    check_hf_counts(hf, path, prefix)
    arch = nn.architecture_for_hf(hf, path)
    assert arch.from_hf is not None  # architecture_for_hf returns readers only
    try:
        config = arch.from_hf(hf)
        if wrapper is not None:
            config = dataclasses.replace(config, hf_wrapper=wrapper.model_type)
    except (UnsupportedError, FormatError) as e:
        raise type(e)(f"{path}: {e}") from None
    except (KeyError, TypeError, ValueError, OverflowError) as e:  # missing, mistyped
        raise FormatError(
            f"{path}: cannot read it as a {arch.name} config ({type(e).__name__}: {e})"
        ) from None
    check_config_values(config, path)
    return arch, config


def _weight_files(folder: str) -> tuple[str, ...]:
    """The safetensors files of ``folder``, checked against the index."""
    index = os.path.join(folder, INDEX)
    if not os.path.isfile(index):
        single = os.path.join(folder, SINGLE)
        if not os.path.isfile(single):
            raise FormatError(f"{folder}: neither {SINGLE} nor {INDEX} is there")
        read_safetensors(single)
        return (single,)
    weight_map = _json_object(index, MAX_INDEX_BYTES).get("weight_map")
    if not isinstance(weight_map, dict) or not all(
        isinstance(v, str) for v in weight_map.values()
    ):
        raise FormatError(f"{index}: 'weight_map' must map tensor names to files")
    by_file: dict[str, set[str]] = {}
    for tensor, name in weight_map.items():
        if os.path.basename(name) != name or name in ("", ".", ".."):
            raise FormatError(f"{index}: shard {name!r} must be a plain file name")
        by_file.setdefault(name, set()).add(tensor)
    seen: set[str] = set()
    for name in sorted(by_file):
        path = os.path.join(folder, name)
        if not os.path.isfile(path):
            raise FormatError(f"{index}: names shard {name!r}, which is missing")
        tensors, _ = read_safetensors(path)
        missing = sorted(by_file[name] - set(tensors))
        if missing:
            raise FormatError(
                f"{index}: puts {missing[:3]} in {name}, which does not hold them"
            )
        twice = sorted(seen & set(tensors))
        if twice:
            raise FormatError(f"{folder}: tensors {twice[:3]} are in two shards")
        seen |= set(tensors)
    return tuple(os.path.join(folder, name) for name in sorted(by_file))


def read_hf_folder(folder: str | os.PathLike[str]) -> HFFolder:
    """A folder's config, shards and generation config, checked; no tensor read.

    Raises:
        FormatError: missing or invalid files (named).
        UnsupportedError: a family or feature entrenar does not implement.
    """
    folder = os.fspath(folder)
    if not os.path.isdir(folder):
        raise FormatError(f"{folder}: not a folder")
    arch, config = read_hf_config(folder)
    files = _weight_files(folder)
    gen_path = os.path.join(folder, "generation_config.json")
    generation = _json_object(gen_path) if os.path.isfile(gen_path) else {}
    eos_ids_of(generation, gen_path)
    split = None
    if getattr(config, "hf_wrapper", None) is not None:
        split = multimodal.split_tensors(_headers(files), folder, config.hf_wrapper)
        config = _tied_as_stored(folder, config, "lm_head.weight" in split.text)
    return HFFolder(folder, arch, config, files, generation, split)


def _headers(files: tuple[str, ...]) -> dict[str, Any]:
    """Every tensor of the (checked) safetensors files, memory-mapped, by name."""
    flat: dict[str, Any] = {}
    for file in files:
        flat.update(read_safetensors(file)[0])
    return flat


def _tied_as_stored(folder: str, config: Any, has_head: bool) -> Any:
    """A vision-language model's ``tie_word_embeddings`` as transformers 5 loads it.

    Its ConditionalGeneration class ties the head by the top-level
    ``tie_word_embeddings`` (`multimodal.ties_head`), and does not tie a head
    the checkpoint stores: so the head is tied exactly when the checkpoint has
    none.

    Raises:
        FormatError: no head stored and the config says not to tie.
    """
    if has_head:
        return dataclasses.replace(config, tie_word_embeddings=False)
    top = _json_object(os.path.join(folder, "config.json"))
    if not multimodal.ties_head(top):
        raise FormatError(
            f"{folder}: config.json's tie_word_embeddings is false (or absent, "
            f"false for {top['model_type']}) but the weights hold no lm_head.weight "
            "(language_model.lm_head.weight)"
        )
    return dataclasses.replace(config, tie_word_embeddings=True)


def load_hf_folder(
    folder: str | os.PathLike[str],
    *,
    dtype: str | None = None,
    quantize: Quantize | None = None,
    stream: bool = True,
) -> tuple[HFFolder, Params]:
    """Load a Hugging Face model folder of any registered family.

    The shards are memory-mapped and read tensor by tensor: each stacked leaf is
    filled layer by layer in its final dtype (then quantized, if asked) and the
    file's pages given back before the next is read, so the load holds the final
    tree plus about one stacked leaf (`entrenar.nn.hf_names.stream_hf_names`).

    Args:
        folder: holds ``config.json`` and the safetensors (module docstring).
        dtype: cast every parameter to this dtype; None keeps the stored dtypes.
        quantize: which leaves to quantize as they are read, and how
            (`entrenar.nn.hf_names.Quantize`, e.g. a QLoRA run's frozen bases).
        stream: False reads the way entrenar did before streaming (every tensor
            stacked, then cast, then quantized): the same tree, the whole model in
            memory; the reference the streaming load is tested against.

    Returns:
        ``(folder info, params)``: the stacked param tree of ``info.config``.

    Raises:
        FormatError: missing or invalid files, or tensors that do not fit the config
            (missing, extra, of another shape), naming the folder.
        UnsupportedError: a family or feature entrenar does not implement.
    """
    info = read_hf_folder(folder)
    flat = _headers(info.files)
    if info.multimodal is not None:  # the language model only (HFFolder.skipped_note)
        flat = {name: flat[stored] for name, stored in info.multimodal.text.items()}
        _LOG.info("%s: %s", info.path, info.skipped_note)
        if multimodal.WRAPPERS[info.multimodal.kind].fused_experts:
            flat = multimodal.orient_experts(flat, info.config)  # Qwen3-VL-MoE
    bound_heap(sum(t.nbytes for t in flat.values()))  # big buffers mapped (io.heap)
    convert = info.architecture.from_hf_tensors
    try:
        if convert is not None:  # a family whose checkpoint names differ from its tree
            flat = convert(flat, info.config)
        if stream:
            with ReadAhead() as ahead:  # the files read on a thread as the load goes
                params = stream_hf_names(
                    flat,
                    info.config,
                    dtype=dtype,
                    quantize=quantize,
                    release=ahead.release,
                    read_ahead=ahead.read,
                )
        else:
            params = nn.from_hf_names(flat, info.config, dtype=dtype)
            params = quantize_leaves(params, quantize)
    except (FormatError, ShapeError) as e:
        raise FormatError(f"{info.path}: {e}") from None
    if dtype is not None and hasattr(info.config, "param_dtype"):
        config = dataclasses.replace(info.config, param_dtype=dtype)
        info = dataclasses.replace(info, config=config)
    return info, params


def load_hf_llama(
    folder: str | os.PathLike[str], *, dtype: str | None = None
) -> tuple[Any, Params]:
    """``(config, params)`` of a Hugging Face folder (any family; `load_hf_folder`)."""
    info, params = load_hf_folder(folder, dtype=dtype)
    return info.config, params


def read_hf_llama_header(folder: str | os.PathLike[str]) -> Any:
    """The config of a Hugging Face folder, its files checked (`read_hf_folder`)."""
    return read_hf_folder(folder).config


Spec = tuple[np.dtype, tuple[int, ...]]


def _nbytes(spec: Spec) -> int:
    return math.prod(spec[1]) * spec[0].itemsize


def _shards(specs: dict[str, Spec], max_bytes: int) -> list[dict[str, Spec]]:
    """``specs`` in name order, cut into groups of at most ``max_bytes``."""
    groups: list[dict[str, Spec]] = [{}]
    size = 0
    for name, spec in specs.items():
        if groups[-1] and size + _nbytes(spec) > max_bytes:
            groups.append({})
            size = 0
        groups[-1][name] = spec
        size += _nbytes(spec)
    return groups


def _dense(x: Any) -> Any:
    """A weight node's dense value (a LoRA adapter folded, a base dequantized)."""
    return nn.to_dense(x) if is_weight_node(x) else x


def _cast(x: Any, dtype: Any) -> Any:
    """``x`` as ``dtype`` when both are floating (ids and masks keep theirs)."""
    if dtype is None or not jax.numpy.issubdtype(x.dtype, jax.numpy.floating):
        return x
    return x.astype(dtype)


def _spec(make: Any, dtype: Any = None) -> Spec:
    """``(dtype, shape)`` of ``_dense(make())`` cast, traced, not computed."""
    out = jax.eval_shape(lambda: _cast(jax.numpy.asarray(_dense(make())), dtype))
    return np.dtype(out.dtype), tuple(out.shape)


FLOAT_DTYPES = ("float32", "bfloat16", "float16")
"""The ``torch_dtype`` values `folder_dtype` reports."""


def folder_dtype(folder: str | os.PathLike[str]) -> str | None:
    """A Hugging Face folder's weight dtype: ``config.json``'s ``torch_dtype``.

    (``dtype`` in transformers 5.) None when it names none of `FLOAT_DTYPES`.
    """
    file = os.path.join(os.fspath(folder), "config.json")
    cfg = read_json(file, max_bytes=MAX_CONFIG_BYTES, what="config.json")
    if not isinstance(cfg, dict):
        return None
    named = cfg.get("torch_dtype", cfg.get("dtype"))
    return named if named in FLOAT_DTYPES else None


def save_hf_folder(
    folder: str | os.PathLike[str],
    config: Any,
    params: Params,
    *,
    tokenizer: Any = None,
    generation: dict[str, Any] | None = None,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
    dtype: str | None = None,
    source: str | os.PathLike[str] | None = None,
    expert_type: str | None = None,
) -> str:
    """Write a Hugging Face folder that ``transformers`` loads (module docstring).

    Args:
        folder: created if needed; the files are written atomically one by one.
        config: a registered family's config (`entrenar.nn.architecture_of`).
        params: its param tree: arrays, or weight nodes (a LoRA adapter is folded
            into its base, a quantized base dequantized: `entrenar.nn.to_dense`).
            Each tensor (a layer of a stacked leaf) is made, written and dropped in
            turn (`write_safetensors_stream`), so writing holds one tensor, never a
            dense copy of the model; the files are what writing the dense tree
            (`lora.fold`, then `quant.dequantize_params`) gives, byte for byte.
        tokenizer: an `HFTokenizer` or a GGUF's ``FastTokenizer``, or None.
        generation: ``generation_config.json`` fields; default: the tokenizer's BOS
            and EOS ids (its `stop_ids` too).
        max_shard_bytes: bytes per safetensors shard; more than one shard writes
            ``model.safetensors.index.json``.
        dtype: write the float tensors in this dtype (``"bfloat16"``: each folded
            or trained float32 value rounded to nearest, as ``torch``'s ``.to``);
            None: as they are. ``config.json``'s ``torch_dtype`` says which.
        source: the Hugging Face folder the model was read from. A vision-language
            model's (``config.hf_wrapper``) export is that whole folder again
            (`_wrapped`): its ``config.json`` (``text_config`` updated where the
            model differs), its vision tower and projector copied byte for byte,
            the language model under its key layout, its processor files. Without
            the folder (gone, or another model's) it is written text-only as the
            family's CausalLM, with a `UserWarning` saying so.
        expert_type: ``"MXFP4"``: gpt-oss's expert stacks as the Hub's MXFP4
            blocks and scales, with its ``quantization_config``
            (`entrenar.io.hf_mxfp4`); None: in ``dtype`` like the rest.

    Raises:
        UnsupportedError: the family has no Hugging Face form, or ``expert_type``
            for a family other than gpt-oss.
        ConfigError: an ``expert_type`` other than MXFP4, or expert rows that are
            not whole 32-value blocks.
    """
    folder = os.fspath(folder)
    arch = nn.architecture_of(config)
    if arch.to_hf is None:
        raise UnsupportedError(f"{arch.name} models have no Hugging Face form")
    experts = check_hf_expert_type(config, expert_type)
    wrapped = _wrapper_source(config, source)
    if wrapped is None and getattr(config, "hf_wrapper", None) is not None:
        config = dataclasses.replace(config, hf_wrapper=None)
    os.makedirs(folder, exist_ok=True)
    made = lazy_hf_names(params)  # each tensor made (one layer sliced) when written
    convert = arch.to_hf_tensors
    if wrapped is not None and _fused_experts(wrapped):  # Qwen3-VL-MoE's own names
        made = multimodal.fuse_experts(made, config, _text_shapes(wrapped), _dense)
    elif convert is not None:  # a family whose names differ (still made lazily)
        made = convert(made, config)
    kept: dict[str, Any] = {}  # the vision tower and projector, copied as stored
    if wrapped is not None:
        made, kept = _wrapped(made, wrapped)
    specs = {k: _spec(made[k], dtype) for k in sorted(made)}  # nothing made
    if experts == "MXFP4":
        made, specs = mxfp4_stacks(made, specs)
    specs |= {k: (np.dtype(v.dtype), tuple(v.shape)) for k, v in kept.items()}
    specs = dict(sorted(specs.items()))
    groups = _shards(specs, max_shard_bytes)

    def parts(name: str) -> list[np.ndarray]:
        if name in kept:
            return [np.asarray(kept[name])]
        return [np.asarray(_cast(_dense(made[name]()), dtype))]

    meta = {"format": "pt"}
    if len(groups) == 1:
        write_safetensors_stream(os.path.join(folder, SINGLE), groups[0], parts, meta)
    else:
        weight_map: dict[str, str] = {}
        for i, group in enumerate(groups):
            name = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
            write_safetensors_stream(os.path.join(folder, name), group, parts, meta)
            weight_map |= {k: name for k in group}
        total = sum(_nbytes(spec) for spec in specs.values())
        _write_json(
            os.path.join(folder, INDEX),
            {"metadata": {"total_size": total}, "weight_map": weight_map},
        )
    hf = arch.to_hf(config)
    hf.setdefault("architectures", [arch.hf_class] if arch.hf_class else [])
    if experts == "MXFP4":
        hf["quantization_config"] = copy.deepcopy(QUANTIZATION_CONFIG)
    # numpy's bfloat16 is of kind "V", not "f": named here so a bfloat16 model says so
    dtypes = {
        dt.name for dt, _ in specs.values() if dt.kind == "f" or dt.name == "bfloat16"
    }
    if len(dtypes) == 1:
        hf.setdefault("torch_dtype", dtypes.pop())
    if wrapped is not None:
        hf = _wrapped_config(wrapped, config, hf)
        _copy_processor_files(wrapped.path, folder)
    _write_json(os.path.join(folder, "config.json"), hf)
    gen = dict(generation) if generation is not None else _generation(tokenizer)
    _write_json(os.path.join(folder, "generation_config.json"), gen)
    if tokenizer is not None:
        length = getattr(config, "max_position_embeddings", None)
        for name, text in tokenizer_files(tokenizer, max_length=length).items():
            with atomic_write(os.path.join(folder, name), "w") as f:
                f.write(text)
    return folder


def _wrapper_source(config: Any, source: Any) -> HFFolder | None:
    """The vision-language folder a model was read from, or None (warned).

    None for a text model; for a vision-language one (``config.hf_wrapper``) whose
    ``source`` is not a readable folder of the same ``model_type`` and text
    sizes, a `UserWarning` says the export is text-only.
    """
    kind = getattr(config, "hf_wrapper", None)
    if kind is None:
        return None
    why = "no source folder was given"
    if source is not None:
        why = f"its source folder {os.fspath(source)} is gone"
    if source is not None and os.path.isdir(source):
        try:
            src = read_hf_folder(source)
        except (FormatError, UnsupportedError) as e:
            why = f"its source folder cannot be read ({e})"
        else:
            shapes = src.config.param_shapes() == config.param_shapes()
            if src.multimodal is not None and src.config.hf_wrapper == kind and shapes:
                return src
            why = f"{os.fspath(source)} is not the {kind} folder it was read from"
    hf_class = nn.architecture_of(config).hf_class
    warnings.warn(
        f"a {kind} model's Hugging Face export copies the vision tower and "
        f"projector from the folder it was read from, but {why}: writing the "
        f"language model alone, as {hf_class} (load it with AutoModelForCausalLM)",
        UserWarning,
        stacklevel=3,
    )
    return None


def _fused_experts(src: HFFolder) -> bool:
    """Whether a wrapper stores its experts fused (`multimodal.fuse_experts`)."""
    assert src.multimodal is not None
    return multimodal.WRAPPERS[src.multimodal.kind].fused_experts


def _text_shapes(src: HFFolder) -> dict[str, tuple[int, ...]]:
    """The source's language-model tensor shapes, by text family name."""
    assert src.multimodal is not None
    stored = _headers(src.files)
    return {t: tuple(stored[s].shape) for t, s in src.multimodal.text.items()}


def _wrapped(
    made: dict[str, Any], src: HFFolder
) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(language model in src's layout, vision tensors as stored)``."""
    assert src.multimodal is not None
    layout = src.multimodal.layout
    kind = src.multimodal.kind
    made = {multimodal.wrapped_name(k, layout, kind): v for k, v in made.items()}
    stored = _headers(src.files)
    return made, {name: stored[name] for name in src.multimodal.skipped}


def _wrapped_config(src: HFFolder, config: Any, text: dict[str, Any]) -> dict[str, Any]:
    """The source's ``config.json``, its ``text_config`` updated where needed.

    Updated where ``config`` writes another value than the source's own config
    (``text``: ``config``'s ``to_hf``); ``torch_dtype`` / ``dtype`` where the file
    names one.
    """
    top = _json_object(os.path.join(src.path, "config.json"))
    to_hf = nn.architecture_of(config).to_hf
    assert to_hf is not None
    before = to_hf(src.config)
    fixed = ("architectures", "model_type", "torch_dtype")
    changed = {
        k: v for k, v in text.items() if k not in fixed and before.get(k, v) != v
    }
    if (
        changed
        and "text_config" not in top
        and multimodal.WRAPPERS[str(top["model_type"])].absent is None
    ):  # Qwen2-VL's flat config.json: the text keys at the top
        top.update(changed)
    elif changed:
        top["text_config"] = {**(top.get("text_config") or {}), **changed}
    if "torch_dtype" in text:  # the language model's dtype, where the file names one
        for d in (top, top.get("text_config") or {}):
            for key in ("torch_dtype", "dtype"):
                if key in d:
                    d[key] = text["torch_dtype"]
    return top


PROCESSOR_FILES = (
    "preprocessor_config.json",
    "processor_config.json",
    "video_preprocessor_config.json",
    "chat_template.json",
)
"""A vision-language folder's files an export copies as they are (the image
processor's settings, the processor's chat template)."""


def _copy_processor_files(source: str, folder: str) -> None:
    for name in PROCESSOR_FILES:
        path = os.path.join(source, name)
        if os.path.isfile(path):
            text = read_text(path, max_bytes=MAX_CONFIG_BYTES, what=name)
            with atomic_write(os.path.join(folder, name), "w") as f:
                f.write(text)


def _generation(tokenizer: Any) -> dict[str, Any]:
    """``generation_config.json`` from a tokenizer's special ids."""
    gen: dict[str, Any] = {}
    if tokenizer is None:
        return gen
    if tokenizer.bos_id is not None:
        gen["bos_token_id"] = int(tokenizer.bos_id)
    eos = [int(tokenizer.eos_id)] if tokenizer.eos_id is not None else []
    eos += [i for i in getattr(tokenizer, "stop_ids", ()) if i not in eos]
    if eos:
        gen["eos_token_id"] = eos[0] if len(eos) == 1 else eos
    if getattr(tokenizer, "pad_id", None) is not None:
        gen["pad_token_id"] = int(tokenizer.pad_id)
    return gen


def _write_json(path: str, value: Any) -> None:
    with atomic_write(path, "w") as f:
        json.dump(value, f, indent=2)
        f.write("\n")


__all__ = [
    "COUNT_LIMITS",
    "DEFAULT_SHARD_BYTES",
    "HF_COUNTS",
    "HFFolder",
    "check_config_values",
    "check_field_types",
    "check_hf_counts",
    "load_hf_folder",
    "load_hf_llama",
    "read_hf_config",
    "read_hf_folder",
    "read_hf_llama_header",
    "save_hf_folder",
]
