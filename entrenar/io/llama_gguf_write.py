"""Write an entrenar Llama (e.g. merged after fine-tuning) as a llama.cpp GGUF.

Metadata: every field of the ``source`` GGUF (tokenizer, chat template, general.*)
is copied with its type; the ``llama.*`` shape fields are rewritten from the config
and ``general.file_type`` from the tensor type. Tensors: norms are F32 (as llama.cpp
writes them); matrices are stored in ``tensor_type`` (F32, F16, BF16, Q8_0, Q4_0,
Q4_1), quantized by `entrenar.quant` (bit-exact with llama.cpp's reference
quantizers). A weight already held as a `QuantizedWeight` of that scheme is written
as is. q/k rows are permuted to llama.cpp's order (see `entrenar.io.llama_gguf`).
"""

from __future__ import annotations

import functools
import os
from typing import Any

import jax
import numpy as np

from entrenar.errors import ConfigError, FormatError, QuantizationError
from entrenar.io.ggml_dequant import GGML_TYPE_IDS
from entrenar.io.gguf_reader import GGUFField, GGUFFile, GGUFValueType, read_gguf
from entrenar.io.gguf_writer import GGUFTensor, tensor_from_array, write_gguf
from entrenar.io.llama_gguf import GLOBAL_NAMES, LAYER_NAMES, permute_qk
from entrenar.nn import LlamaConfig
from entrenar.quant import QuantizedWeight, dequantize, quantize, to_ggml
from entrenar.types import Params

TENSOR_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1")
"""Tensor types `save_llama_gguf` writes."""
FILE_TYPES = {"F32": 0, "F16": 1, "Q4_0": 2, "Q4_1": 3, "Q8_0": 7, "BF16": 32}
"""llama.cpp's ``general.file_type`` (``llama_ftype``) of each tensor type."""


def _leaf(tree: Any, path: tuple[str, ...]) -> Any:
    for k in path:
        if not isinstance(tree, dict) or k not in tree:
            return None
        tree = tree[k]
    return tree["weight"]


@functools.cache
def _quantize_jit() -> Any:
    """`entrenar.quant.quantize`, compiled once per shape and scheme."""
    return jax.jit(quantize, static_argnums=1)


def _to_bytes(w: Any, kind: str, name: str) -> np.ndarray:
    """Stored bytes of ``w: (..., rows, cols)`` in ``kind``, as ``(..., rows, nb)``."""
    if kind in ("Q8_0", "Q4_0", "Q4_1"):
        if not (isinstance(w, QuantizedWeight) and w.scheme == kind.lower()):
            a = dequantize(w, np.float32) if isinstance(w, QuantizedWeight) else w
            a = np.asarray(a, np.float32)
            if not np.isfinite(a).all():
                raise QuantizationError(f"{name} holds NaN or Inf; cannot write {kind}")
            w = jax.device_get(_quantize_jit()(a, kind.lower()))
        raw, _ = to_ggml(w)
        return raw.reshape(*w.shape[:-1], -1)
    if isinstance(w, QuantizedWeight):
        w = dequantize(w, np.float32)
    t = tensor_from_array(w, kind)
    return t.raw.reshape(*t.shape[:-1], -1)


def _order_key(name: str) -> tuple[int, int, str]:
    """token_embd, blk.0.*, blk.1.*, ..., output_norm, output."""
    if name.startswith("blk."):
        return (1, int(name.split(".")[1]), name)
    return (0 if name.startswith("token_embd") else 2, 0, name)


def _metadata(source: GGUFFile | None, config: LlamaConfig, kind: str, name: str):
    fields: dict[str, GGUFField] = dict(source.fields) if source else {}
    u32, f32, s = GGUFValueType.UINT32, GGUFValueType.FLOAT32, GGUFValueType.STRING
    fields["general.architecture"] = GGUFField("llama", s)
    if name or "general.name" not in fields:
        fields["general.name"] = GGUFField(name or "entrenar-llama", s)
    new = {
        "llama.vocab_size": (config.vocab_size, u32),
        "llama.context_length": (config.max_position_embeddings, u32),
        "llama.embedding_length": (config.hidden_size, u32),
        "llama.feed_forward_length": (config.intermediate_size, u32),
        "llama.block_count": (config.num_layers, u32),
        "llama.attention.head_count": (config.num_heads, u32),
        "llama.attention.head_count_kv": (config.num_kv_heads, u32),
        "llama.rope.dimension_count": (config.hd, u32),
        "llama.rope.freq_base": (config.rope_theta, f32),
        "llama.attention.layer_norm_rms_epsilon": (config.rms_norm_eps, f32),
        "general.file_type": (FILE_TYPES[kind], u32),
    }
    for k in ("llama.attention.key_length", "llama.attention.value_length"):
        if k in fields or config.hd != config.hidden_size // config.num_heads:
            new[k] = (config.hd, u32)  # llama.cpp's default is D / H
    for k, (v, t) in new.items():
        fields[k] = GGUFField(v, t)
    return fields


def save_llama_gguf(
    path: str | os.PathLike[str],
    config: LlamaConfig,
    params: Params,
    *,
    source: str | os.PathLike[str] | GGUFFile | None = None,
    tensor_type: str = "F32",
    embedding_type: str | None = None,
    name: str = "",
) -> None:
    """Write ``params`` of ``config`` as a llama.cpp-readable GGUF file, atomically.

    Args:
        path: destination ``.gguf``.
        config: the model's `LlamaConfig`.
        params: its stacked param tree (arrays or `QuantizedWeight` nodes; merge LoRA
            adapters first).
        source: the GGUF the model came from: its metadata and tokenizer are copied
            (without one the file has no tokenizer, and llama.cpp cannot run it).
        tensor_type: one of `TENSOR_TYPES` for the matrices. The default, F32, is
            lossless and large: 4 bytes a value, 538 MB for SmolLM2-135M (F16 271 MB,
            Q8_0 145 MB, Q4_1 86 MB). To export a LoRA fine-tune use
            `entrenar.lora.save_folded_gguf` (Q8_0 by default), which checks that the
            type keeps the update: Q4_1 can round a short fine-tune of a 4-bit base
            away.
        embedding_type: type of ``token_embd`` and ``output`` (default
            ``tensor_type``); llama.cpp's own Q4 files keep these in Q8_0 or better.
        name: ``general.name``; default: keep the source's.

    Raises:
        ConfigError: an unknown ``tensor_type``, or a row length that does not split
            into 32-value blocks for a quantized type.
        FormatError: ``params`` lacks a tensor of ``config``.
    """
    kind = tensor_type.upper()
    emb_kind = (embedding_type or tensor_type).upper()
    for k in (kind, emb_kind):
        if k not in TENSOR_TYPES:
            raise ConfigError(f"tensor type {k!r}: expected one of {TENSOR_TYPES}")
    if (kind + emb_kind).count("Q") and (
        config.hidden_size % 32 or config.intermediate_size % 32
    ):
        raise ConfigError(
            f"{kind} needs hidden and intermediate sizes that are multiples of 32; "
            "write F16 or F32 instead"
        )
    src = read_gguf(source) if isinstance(source, (str, os.PathLike)) else source
    params = jax.device_get(params)
    tensors: dict[str, GGUFTensor] = {}
    perm = {"attn_q": config.num_heads, "attn_k": config.num_kv_heads}

    def weight(tree: Any, p: tuple[str, ...]) -> Any:
        w = _leaf(tree, p)
        if w is None:
            raise FormatError(f"params lack {'.'.join(p)}.weight (config {config})")
        return w

    for stem, p in GLOBAL_NAMES.items():
        if stem == "output" and config.tie_word_embeddings:
            continue
        k = "F32" if stem.endswith("norm") else emb_kind
        w = weight(params, p)
        tensors[f"{stem}.weight"] = GGUFTensor(
            _to_bytes(w, k, stem).reshape(-1), tuple(np.shape(w)), GGML_TYPE_IDS[k]
        )
    layers = params["model"]["layers"]
    for stem, p in LAYER_NAMES.items():
        k = "F32" if stem.endswith("norm") else kind
        w = weight(layers, p)
        raw = _to_bytes(w, k, stem)  # (L, rows, row_bytes) or (L, D, 4)
        if stem in perm:
            raw = permute_qk(raw, perm[stem])
        shape = tuple(w.shape[1:])
        for i in range(config.num_layers):
            tensors[f"blk.{i}.{stem}.weight"] = GGUFTensor(
                np.ascontiguousarray(raw[i]).reshape(-1), shape, GGML_TYPE_IDS[k]
            )
    # The source's order when it has the same tensors, else layer by layer.
    same = src is not None and set(src.tensors) == set(tensors)
    order = list(src.tensors) if same and src else sorted(tensors, key=_order_key)
    tensors = {n: tensors[n] for n in order}
    write_gguf(path, _metadata(src, config, kind, name), tensors)


__all__ = ["FILE_TYPES", "TENSOR_TYPES", "save_llama_gguf"]
