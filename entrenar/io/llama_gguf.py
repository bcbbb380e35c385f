"""Llama models in GGUF: llama.cpp's names, q/k row permutation, load and save.

Names (``N`` = layer)::

    token_embd.weight          model.embed_tokens.weight
    blk.N.attn_norm.weight     model.layers.N.input_layernorm.weight
    blk.N.attn_q/k/v.weight    model.layers.N.self_attn.q_proj/k_proj/v_proj.weight
    blk.N.attn_output.weight   model.layers.N.self_attn.o_proj.weight
    blk.N.ffn_norm.weight      model.layers.N.post_attention_layernorm.weight
    blk.N.ffn_gate/up/down     model.layers.N.mlp.gate_proj/up_proj/down_proj.weight
    output_norm.weight         model.norm.weight
    output.weight              lm_head.weight   (absent: tied to token_embd)

llama.cpp applies rotary embeddings to interleaved pairs ``(x[2i], x[2i+1])``; Hugging
Face to halves ``(x[i], x[i + d/2])``. Its converter therefore permutes the rows of
``q_proj`` (``n = H`` heads) and ``k_proj`` (``n = KV``) of each head::

    gguf = hf.reshape(n, 2, d/2, D).swapaxes(1, 2).reshape(n·d, D)

so GGUF row ``h·d + 2i + j`` is Hugging Face row ``h·d + j·d/2 + i``. The loader
applies the inverse, the writer the permutation itself. Rows are whole quantization
blocks, so quantized tensors are permuted in their raw bytes.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any

import jax.numpy as jnp
import numpy as np

from entrenar.errors import ConfigError, FormatError, UnsupportedError
from entrenar.io.ggml_dequant import dequantize_ggml
from entrenar.io.gguf_reader import GGUFFile, GGUFValueType, read_gguf
from entrenar.io.tokenizer import BPETokenizer
from entrenar.nn import LlamaConfig
from entrenar.quant import from_ggml
from entrenar.types import Params

LAYER_NAMES = {
    "attn_norm": ("input_layernorm",),
    "attn_q": ("self_attn", "q_proj"),
    "attn_k": ("self_attn", "k_proj"),
    "attn_v": ("self_attn", "v_proj"),
    "attn_output": ("self_attn", "o_proj"),
    "ffn_norm": ("post_attention_layernorm",),
    "ffn_gate": ("mlp", "gate_proj"),
    "ffn_up": ("mlp", "up_proj"),
    "ffn_down": ("mlp", "down_proj"),
}
"""GGUF per-layer tensor stem -> path under ``params["model"]["layers"]``."""
GLOBAL_NAMES = {
    "token_embd": ("model", "embed_tokens"),
    "output_norm": ("model", "norm"),
    "output": ("lm_head",),
}
"""GGUF global tensor stem -> path in the param tree (``.weight`` follows)."""
KEEP_QUANTIZED = ("Q8_0", "Q4_0", "Q4_1")
"""ggml types `load_llama_gguf(keep_quantized=True)` keeps as `QuantizedWeight`."""


def permute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Hugging Face -> llama.cpp row order of ``w: (..., n·d, X)`` (axis -2 rows).

    >>> permute_qk(np.arange(8).reshape(4, 2), 1)[:, 0].tolist()  # rows 0 2 1 3
    [0, 4, 2, 6]
    """
    *lead, rows, x = w.shape
    w = w.reshape(*lead, n_heads, 2, rows // n_heads // 2, x)  # (.., n, 2, d/2, X)
    return np.swapaxes(w, -2, -3).reshape(*lead, rows, x)


def unpermute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Inverse of `permute_qk`: llama.cpp -> Hugging Face row order.

    >>> w = np.arange(16).reshape(8, 2)
    >>> bool((unpermute_qk(permute_qk(w, 2), 2) == w).all())
    True
    """
    *lead, rows, x = w.shape
    w = w.reshape(*lead, n_heads, rows // n_heads // 2, 2, x)  # (.., n, d/2, 2, X)
    return np.swapaxes(w, -2, -3).reshape(*lead, rows, x)


INT_LIMITS = {
    "llama.vocab_size": 1 << 24,
    "llama.embedding_length": 1 << 20,
    "llama.feed_forward_length": 1 << 22,
    "llama.block_count": 1 << 12,
    "llama.attention.head_count": 1 << 12,
    "llama.attention.head_count_kv": 1 << 12,
    "llama.attention.key_length": 1 << 16,
    "llama.context_length": 1 << 27,
}
"""Largest value entrenar accepts for each integer ``llama.*`` hyperparameter."""
FLOAT_RANGES = {
    "llama.rope.freq_base": (1.0, 1e12),
    "llama.attention.layer_norm_rms_epsilon": (0.0, 1.0),
}
"""Open interval ``(low, high)`` a float ``llama.*`` hyperparameter must lie in."""


def _meta_int(g: GGUFFile, key: str, default: int | None = None) -> int:
    """An integer hyperparameter: present (or defaulted), ``0 < value <= limit``."""
    f = g.fields.get(key)
    if f is None:
        if default is None:
            raise FormatError(f"{g.path}: metadata {key!r} is missing")
        return default
    limit = INT_LIMITS.get(key, 1 << 31)
    if isinstance(f.value, bool) or not isinstance(f.value, int) or f.value <= 0:
        raise FormatError(f"{g.path}: metadata {key!r} = {f.value!r}, want an int > 0")
    if f.value > limit:
        raise FormatError(
            f"{g.path}: metadata {key!r} = {f.value} is over the limit of {limit}; "
            "the file is corrupt or not a model entrenar can load"
        )
    return int(f.value)


def _meta_float(g: GGUFFile, key: str, default: float) -> float:
    """A float hyperparameter: a finite number inside `FLOAT_RANGES`' interval."""
    f = g.fields.get(key)
    if f is None:
        return default
    if f.type not in (GGUFValueType.FLOAT32, GGUFValueType.FLOAT64):
        raise FormatError(f"{g.path}: metadata {key!r} = {f.value!r} is not a float")
    low, high = FLOAT_RANGES[key]
    value = float(f.value)
    if not (math.isfinite(value) and low < value < high):
        raise FormatError(
            f"{g.path}: metadata {key!r} = {value!r}, want a finite number in "
            f"({low:g}, {high:g}); the file is corrupt"
        )
    return value


def _head_dim(g: GGUFFile, hidden: int, heads: int) -> int:
    """``attention.key_length`` (default ``hidden / heads``), checked for consistency.

    ``rope.dimension_count`` and ``attention.value_length``, when given, must equal it.

    Raises:
        FormatError: no key length and a width that ``heads`` does not divide.
        UnsupportedError: rotary embeddings over part of a head, or values of another
            width than keys (entrenar's Llama rotates and projects whole heads).
    """
    if "llama.attention.key_length" in g.fields:
        head_dim = _meta_int(g, "llama.attention.key_length")
    elif hidden % heads:
        raise FormatError(
            f"{g.path}: metadata 'llama.embedding_length' = {hidden} is not a "
            f"multiple of 'llama.attention.head_count' = {heads} and "
            "'llama.attention.key_length' is missing"
        )
    else:
        head_dim = hidden // heads
    for key in ("llama.rope.dimension_count", "llama.attention.value_length"):
        if key in g.fields and _meta_int(g, key) != head_dim:
            raise UnsupportedError(
                f"{g.path}: metadata {key!r} = {g.fields[key].value} differs from "
                f"the head dimension {head_dim}; entrenar's Llama needs them equal"
            )
    return head_dim


def llama_config_from_gguf(g: GGUFFile) -> LlamaConfig:
    """The `LlamaConfig` described by a GGUF file's ``llama.*`` metadata.

    Every integer is checked against `INT_LIMITS`, every float against
    `FLOAT_RANGES`, and the shapes against each other (heads divide the width, KV
    heads divide the heads, an even head dimension).

    Raises:
        FormatError: missing, out-of-range or inconsistent fields (named in the
            message).
        UnsupportedError: another architecture, rope scaling or partial rotary.
    """
    arch = g.fields.get("general.architecture")
    if arch is None or arch.value != "llama":
        raise UnsupportedError(
            f"{g.path}: general.architecture is {arch and arch.value!r}; only 'llama' "
            "GGUF files load into entrenar.nn.Llama"
        )
    scaling = g.fields.get("llama.rope.scaling.type")
    if scaling is not None and scaling.value not in ("none", ""):
        raise UnsupportedError(f"{g.path}: rope scaling {scaling.value!r}")
    if "rope_freqs.weight" in g.tensors:
        raise UnsupportedError(f"{g.path}: rope_freqs.weight (rope scaling)")
    heads = _meta_int(g, "llama.attention.head_count")
    hidden = _meta_int(g, "llama.embedding_length")
    emb = g.tensors.get("token_embd.weight")
    n_vocab = emb.shape[0] if emb is not None and len(emb.shape) == 2 else None
    head_dim = _head_dim(g, hidden, heads)
    try:
        return LlamaConfig(
            vocab_size=_meta_int(g, "llama.vocab_size", n_vocab),
            hidden_size=hidden,
            intermediate_size=_meta_int(g, "llama.feed_forward_length"),
            num_layers=_meta_int(g, "llama.block_count"),
            num_heads=heads,
            num_kv_heads=_meta_int(g, "llama.attention.head_count_kv", heads),
            head_dim=head_dim,
            rope_theta=_meta_float(g, "llama.rope.freq_base", 10000.0),
            rms_norm_eps=_meta_float(g, "llama.attention.layer_norm_rms_epsilon", 1e-5),
            tie_word_embeddings="output.weight" not in g.tensors,
            max_position_embeddings=_meta_int(g, "llama.context_length", 2048),
        )
    except ConfigError as e:
        raise FormatError(f"{g.path}: inconsistent llama.* metadata: {e}") from None


def _expected(config: LlamaConfig) -> dict[str, tuple[tuple[str, ...], tuple]]:
    """GGUF name -> (param path, numpy shape of one tensor) for every tensor."""
    shapes = config.param_shapes()
    out: dict[str, tuple[tuple[str, ...], tuple]] = {}
    for stem, path in GLOBAL_NAMES.items():
        node: Any = shapes
        for k in path:
            node = node.get(k) if isinstance(node, dict) else None
        if node is not None:
            out[f"{stem}.weight"] = (path, tuple(node["weight"]))
    layers = shapes["model"]["layers"]
    for stem, path in LAYER_NAMES.items():
        node = layers
        for k in path:
            node = node[k]
        for i in range(config.num_layers):
            out[f"blk.{i}.{stem}.weight"] = (path, tuple(node["weight"][1:]))
    return out


def _check_tensors(g: GGUFFile, config: LlamaConfig) -> None:
    want = _expected(config)
    for name, (_, shape) in want.items():
        if name not in g.tensors:
            raise FormatError(f"{g.path}: tensor {name!r} is missing")
        if g.tensors[name].shape != shape:
            raise FormatError(
                f"{g.path}: tensor {name!r} has shape {g.tensors[name].shape}, the "
                f"llama.* metadata implies {shape}"
            )
    extra = sorted(set(g.tensors) - set(want))
    if extra:
        raise FormatError(f"{g.path}: unexpected tensors {extra[:5]} for a Llama")


def read_llama_header(
    path: str | os.PathLike[str] | GGUFFile,
) -> tuple[GGUFFile, LlamaConfig]:
    """A llama.cpp Llama GGUF's header, checked without reading any tensor data.

    The magic, version and metadata (`read_gguf`), the hyperparameters
    (`llama_config_from_gguf`) and the tensor table: every tensor the config
    implies is there with its shape, and no other. `load_llama_gguf` starts with it.

    Raises:
        FormatError: not a GGUF, a corrupt header, or a tensor table that does not
            fit the metadata.
        UnsupportedError: not a Llama, or a GGUF version other than 2 and 3.
    """
    g = path if isinstance(path, GGUFFile) else read_gguf(path)
    config = llama_config_from_gguf(g)
    _check_tensors(g, config)
    return g, config


def _stack_rows(g: GGUFFile, names: list[str], n_perm: int | None) -> np.ndarray:
    """Raw bytes of ``names`` as ``(L, rows, row_bytes)``, q/k rows un-permuted."""
    rows = np.stack([g.raw(n).reshape(g.tensors[n].shape[0], -1) for n in names])
    return unpermute_qk(rows, n_perm) if n_perm else rows


def load_llama_gguf(
    path: str | os.PathLike[str] | GGUFFile,
    keep_quantized: bool = False,
    *,
    dtype: str = "float32",
) -> tuple[LlamaConfig, Params, dict[str, Any]]:
    """Load a llama.cpp Llama GGUF into entrenar's stacked param tree.

    Args:
        path: the ``.gguf`` file (or a `GGUFFile` already read).
        keep_quantized: keep the layers' projection weights stored as Q8_0, Q4_0 or
            Q4_1 as `entrenar.quant.QuantizedWeight` nodes (for QLoRA); everything
            else (norms, embeddings, other types) is dequantized.
        dtype: dtype of the dequantized leaves.

    Returns:
        ``(config, params, tokenizer_info)``: the tree of ``config.param_shapes()``
        (q/k rows in Hugging Face order) and the ``tokenizer.*`` metadata (build a
        tokenizer with `BPETokenizer.from_gguf_metadata`).

    Raises:
        FormatError: a corrupt file or tensors that do not fit the metadata.
        UnsupportedError: not a Llama, rope scaling, or an undecodable tensor type.
    """
    g, config = read_llama_header(path)
    config = dataclasses.replace(config, param_dtype=dtype)
    perm = {"attn_q": config.num_heads, "attn_k": config.num_kv_heads}
    params: dict[str, Any] = {"model": {"layers": {}}}

    def put(path: tuple[str, ...], value: Any, root: dict[str, Any]) -> None:
        for k in path:
            root = root.setdefault(k, {})
        root["weight"] = value

    for stem, path_ in GLOBAL_NAMES.items():
        name = f"{stem}.weight"
        if name in g.tensors:
            put(path_, jnp.asarray(g.tensor(name), dtype=dtype), params)
    for stem, path_ in LAYER_NAMES.items():
        names = [f"blk.{i}.{stem}.weight" for i in range(config.num_layers)]
        types = {g.tensors[n].type_name for n in names}
        shape = (config.num_layers, *g.tensors[names[0]].shape)
        (t,) = types if len(types) == 1 else (None,)
        if keep_quantized and t in KEEP_QUANTIZED and len(shape) == 3:
            raw = _stack_rows(g, names, perm.get(stem))  # (L, rows, row_bytes)
            value: Any = from_ggml(raw.reshape(-1), t, shape)
        else:  # layer by layer: llama.cpp's mixes (Q4_K_M) differ in row bytes
            layers = [
                dequantize_ggml(
                    _stack_rows(g, [n], perm.get(stem))[0],  # (rows, row_bytes)
                    g.tensors[n].type_id,
                    shape[1:],
                )
                for n in names
            ]
            value = jnp.asarray(np.stack(layers), dtype=dtype)  # (L, *shape)
        put(path_, value, params["model"]["layers"])
    info = {k: v for k, v in g.metadata.items() if k.startswith("tokenizer.")}
    return config, params, info


def load_tokenizer(path: str | os.PathLike[str] | GGUFFile) -> BPETokenizer:
    """The `BPETokenizer` of a GGUF file (from its ``tokenizer.ggml.*`` fields)."""
    g = path if isinstance(path, GGUFFile) else read_gguf(path)
    return BPETokenizer.from_gguf_metadata(g.metadata, g.path)


__all__ = [
    "GLOBAL_NAMES",
    "KEEP_QUANTIZED",
    "LAYER_NAMES",
    "llama_config_from_gguf",
    "load_llama_gguf",
    "load_tokenizer",
    "permute_qk",
    "read_llama_header",
    "unpermute_qk",
]
