"""Write the hostile-input corpus of tests/test_hostile_inputs.py (issue 35).

    python tools/make_hostile_corpus.py                  # into tests/data/hostile/
    python tools/make_hostile_corpus.py --out /tmp/hostile

Every file is small and made here, deterministically, from a tiny valid file written
by entrenar's own writers (a one-layer Llama GGUF of width 8 with an 8-token
byte-level BPE tokenizer, a safetensors model, a PEFT adapter, a JSON model, a run
config): truncated and bit-flipped GGUFs, GGUFs with bad hyperparameters, tokenizer
fields and chat templates, bad JSON/YAML model files, bad safetensors headers, bad
adapter folders, YAML alias bombs, hostile JSONL/CSV data and merge recipes.

``MANIFEST.json`` lists each case: its ``path`` (relative to the folder), the public
``loaders`` the test feeds it through, ``expect`` (``"error"``, or ``"ok"`` for the
valid controls), ``match`` (a piece of the message, usually the key at fault),
``names_file`` (whether the message must name the file) and a ``why``. Running the
script again gives the same bytes (the test checks it).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import struct
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from entrenar import io, nn
from entrenar.io.gguf_reader import GGUFField, GGUFFile
from entrenar.io.gguf_reader import GGUFValueType as T
from entrenar.io.gguf_writer import GGUFTensor, tensor_from_array, write_gguf
from entrenar.nn import LlamaConfig

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "data" / "hostile"
CONFIG = LlamaConfig(
    vocab_size=8,
    hidden_size=8,
    intermediate_size=8,
    num_layers=1,
    num_heads=2,
    num_kv_heads=1,
    max_position_embeddings=32,
    tie_word_embeddings=True,
)
"""The tiny Llama every GGUF case is made from (head dimension 4)."""
TOKENS = ["<s>", "</s>", "a", "b", "ab", "\u0120", "c", "<pad>"]
CHAT = (
    "{% for m in messages %}<s>{{ m.role }}\n{{ m.content }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant\n{% endif %}"
)
TOKENIZER = {
    "tokenizer.ggml.model": GGUFField("gpt2", T.STRING),
    "tokenizer.ggml.pre": GGUFField("gpt2", T.STRING),
    "tokenizer.ggml.tokens": GGUFField(TOKENS, T.ARRAY, T.STRING),
    "tokenizer.ggml.token_type": GGUFField([3, 3, 1, 1, 1, 1, 1, 3], T.ARRAY, T.INT32),
    "tokenizer.ggml.merges": GGUFField(["a b"], T.ARRAY, T.STRING),
    "tokenizer.ggml.bos_token_id": GGUFField(0, T.UINT32),
    "tokenizer.ggml.eos_token_id": GGUFField(1, T.UINT32),
    "tokenizer.ggml.padding_token_id": GGUFField(7, T.UINT32),
    "tokenizer.chat_template": GGUFField(CHAT, T.STRING),
}
PEFT_PREFIX = "base_model.model.model.layers.0.self_attn.q_proj"
DEEP_OPEN, DEEP_CLOSE = "[" * 1500, "]" * 1500
"""Lists nested deeper than Python's recursion limit (1,000) lets its parsers go."""


class Corpus:
    """Writes files under ``out`` and records one manifest entry per case."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.cases: list[dict[str, Any]] = []

    def path(self, rel: str) -> Path:
        """``out/rel``, its folder created."""
        p = self.out / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        return p

    def write(self, rel: str, data: bytes | str) -> Path:
        """Write ``data`` (text as UTF-8) to ``out/rel``."""
        p = self.path(rel)
        p.write_bytes(data.encode("utf-8") if isinstance(data, str) else data)
        return p

    def case(
        self,
        rel: str,
        loaders: str | list[str],
        why: str,
        *,
        match: str = "",
        expect: str = "error",
        names_file: bool = True,
    ) -> None:
        """Record that ``rel`` fed through each of ``loaders`` gives ``expect``."""
        self.cases.append(
            {
                "path": rel,
                "loaders": [loaders] if isinstance(loaders, str) else loaders,
                "expect": expect,
                "match": match,
                "names_file": names_file,
                "why": why,
            }
        )


# --------------------------------------------------------------------------- GGUF
def _params() -> dict[str, Any]:
    """Weights of `CONFIG` from a seeded numpy generator (norms are ones)."""
    rng = np.random.default_rng(0)

    def leaf(path: tuple[str, ...], shape: tuple[int, ...]) -> np.ndarray:
        if "norm" in path[-2]:
            return np.ones(shape, np.float32)
        return (0.5 * rng.standard_normal(shape)).astype(np.float32)

    def walk(node: Any, path: tuple[str, ...]) -> Any:
        if isinstance(node, tuple):
            return leaf(path, node)
        return {k: walk(v, (*path, k)) for k, v in node.items()}

    return walk(CONFIG.param_shapes(), ())


def _tensors(g: GGUFFile) -> dict[str, GGUFTensor]:
    return {n: GGUFTensor(g.raw(n), t.shape, t.type_id) for n, t in g.tensors.items()}


def base_gguf(tmp: Path) -> GGUFFile:
    """The valid tiny Llama GGUF (F32) with a tokenizer and a chat template."""
    io.save_llama_gguf(
        tmp / "plain.gguf", CONFIG, _params(), tensor_type="F16", name="hostile-base"
    )
    g = io.read_gguf(tmp / "plain.gguf")
    write_gguf(tmp / "base.gguf", {**g.fields, **TOKENIZER}, _tensors(g))
    return io.read_gguf(tmp / "base.gguf")


def _gguf(c: Corpus, rel: str, g: GGUFFile, fields: dict[str, GGUFField]) -> None:
    """``g`` with ``fields`` replaced (tensors kept)."""
    write_gguf(c.path(rel), {**g.fields, **fields}, _tensors(g))


def _tokenizer_gguf(c: Corpus, rel: str, fields: dict[str, GGUFField]) -> None:
    """A tokenizer-only GGUF (no tensors) with ``fields`` replaced."""
    arch = {"general.architecture": GGUFField("llama", T.STRING)}
    write_gguf(c.path(rel), {**arch, **TOKENIZER, **fields}, {})


def _layout(data: bytes) -> dict[str, int]:
    """Byte offsets of the parts of a GGUF written by `write_gguf` (see its docs).

    Keys: ``key:<name>`` (its u64 length), ``type:<name>``, ``value:<name>``, and
    ``ndims:<tensor>``, ``ggml:<tensor>``, ``offset:<tensor>``.
    """
    size = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
    pos, out = 24, {}
    n_tensors, n_kv = struct.unpack_from("<QQ", data, 8)

    def string(p: int) -> tuple[str, int]:
        (n,) = struct.unpack_from("<Q", data, p)
        return data[p + 8 : p + 8 + n].decode("utf-8"), p + 8 + n

    def skip(p: int, vtype: int) -> int:
        if vtype == 8:
            return string(p)[1]
        if vtype != 9:
            return p + size[vtype]
        item, count = struct.unpack_from("<IQ", data, p)
        p += 12
        for _ in range(count):
            p = skip(p, item)
        return p

    for _ in range(n_kv):
        out_key = pos
        key, pos = string(pos)
        out[f"key:{key}"], out[f"type:{key}"] = out_key, pos
        (vtype,) = struct.unpack_from("<I", data, pos)
        out[f"value:{key}"] = pos + 4
        pos = skip(pos + 4, vtype)
    for _ in range(n_tensors):
        name, pos = string(pos)
        out[f"ndims:{name}"] = pos
        (nd,) = struct.unpack_from("<I", data, pos)
        out[f"ggml:{name}"] = pos + 4 + 8 * nd
        out[f"offset:{name}"] = pos + 8 + 8 * nd
        pos += 16 + 8 * nd
    out["tensor_table_end"] = pos
    return out


def _flip(data: bytes, at: int, mask: int) -> bytes:
    b = bytearray(data)
    b[at] ^= mask
    return bytes(b)


def gguf_cases(c: Corpus, g: GGUFFile) -> None:
    """Truncated, bit-flipped and bad-valued GGUFs of the tiny Llama."""
    data = Path(g.path).read_bytes()
    at = _layout(data)
    first = next(iter(g.tensors))
    second = list(g.tensors)[1]
    c.write("gguf/valid.gguf", data)
    c.case("gguf/valid.gguf", ["gguf_model", "tokenizer", "fast_tokenizer",
                               "chat_template"],
           "the valid control every GGUF case is made from", expect="ok")  # fmt: skip
    cuts = {
        "truncated_header": (20, "too short"),
        "truncated_metadata": (at["key:llama.context_length"] + 5, "remain"),
        "truncated_tensor_table": (at["tensor_table_end"] - 10, "remain"),
        "truncated_data": (len(data) - 20, "truncated"),
    }
    for name, (cut, match) in cuts.items():
        c.write(f"gguf/{name}.gguf", data[:cut])
        c.case(f"gguf/{name}.gguf", ["gguf_model", "fast_tokenizer"],
               f"the file cut at byte {cut}", match=match)  # fmt: skip
    flips = {
        "flip_magic": (0, 0x01, "not b'GGUF'"),
        "flip_version": (4, 0x40, "version"),
        "flip_tensor_count": (15, 0x10, "tensors"),
        "flip_key_length": (at["key:general.architecture"] + 6, 0x01, "remain"),
        "flip_value_type": (at["type:general.architecture"], 0x40, "value type"),
        "flip_rope_exponent": (at["value:llama.rope.freq_base"] + 3, 0x40,
                               "llama.rope.freq_base"),
        "flip_head_count": (at["value:llama.attention.head_count"], 0x01,
                            "llama.attention.head_count"),
        "flip_tensor_ndims": (at[f"ndims:{first}"], 0x08, "n_dims"),
        "flip_tensor_type": (at[f"ggml:{first}"], 0x10, "ggml type"),
        "flip_tensor_offset": (at[f"offset:{second}"], 0x01, "alignment"),
    }  # fmt: skip
    for name, (pos, mask, match) in flips.items():
        c.write(f"gguf/{name}.gguf", _flip(data, pos, mask))
        c.case(f"gguf/{name}.gguf", "gguf_model",
               f"byte {pos} XOR {mask:#04x}", match=match)  # fmt: skip
    bad: dict[str, tuple[str, GGUFField]] = {
        "rope_nan": ("llama.rope.freq_base", GGUFField(float("nan"), T.FLOAT32)),
        "rope_zero": ("llama.rope.freq_base", GGUFField(0.0, T.FLOAT32)),
        "rope_negative": ("llama.rope.freq_base", GGUFField(-1.0, T.FLOAT32)),
        "rope_inf": ("llama.rope.freq_base", GGUFField(float("inf"), T.FLOAT32)),
        "eps_nan": (
            "llama.attention.layer_norm_rms_epsilon",
            GGUFField(float("nan"), T.FLOAT32),
        ),
        "eps_negative": (
            "llama.attention.layer_norm_rms_epsilon",
            GGUFField(-1.0, T.FLOAT32),
        ),
        "context_huge": ("llama.context_length", GGUFField(2**63, T.UINT64)),
        "kv_heads_not_dividing": (
            "llama.attention.head_count_kv",
            GGUFField(3, T.UINT32),
        ),
        "block_count_string": ("llama.block_count", GGUFField("1", T.STRING)),
        "vocab_float": ("llama.vocab_size", GGUFField(8.0, T.FLOAT32)),
    }
    for name, (key, field) in bad.items():
        _gguf(c, f"gguf/{name}.gguf", g, {key: field})
        match = "inconsistent" if name == "kv_heads_not_dividing" else key
        c.case(f"gguf/{name}.gguf", "gguf_model",
               f"{key} = {field.value!r}", match=match)  # fmt: skip
    _mixed_types(c, g)


def _mixed_types(c: Corpus, g: GGUFFile) -> None:
    """Two layers, the second's q_proj in F32: llama.cpp's mixes do this; it loads."""
    two = dataclasses.replace(CONFIG, num_layers=2)
    params = _params()
    for leaf in _leaves(params["model"]["layers"]):
        leaf["weight"] = np.concatenate([leaf["weight"]] * 2)
    with tempfile.TemporaryDirectory() as d:
        io.save_llama_gguf(
            Path(d) / "two.gguf", two, params, tensor_type="F16", name="hostile-mixed"
        )
        g2 = io.read_gguf(Path(d) / "two.gguf")
        tensors = _tensors(g2)
        name = "blk.1.attn_q.weight"
        tensors[name] = tensor_from_array(g2.tensor(name), "F32")
        write_gguf(c.path("gguf/mixed_layer_types.gguf"), g2.fields, tensors)
    c.case("gguf/mixed_layer_types.gguf", "gguf_model",
           "blk.0 attn_q in F16, blk.1 in F32: dequantized layer by layer",
           expect="ok")  # fmt: skip


def _leaves(tree: dict[str, Any]) -> list[dict[str, Any]]:
    """The dicts holding a ``weight`` under ``tree``."""
    if "weight" in tree:
        return [tree]
    return [x for v in tree.values() for x in _leaves(v)]


def tokenizer_cases(c: Corpus) -> None:
    """Tokenizer-only GGUFs with bad ``tokenizer.ggml.*`` fields."""
    bad = {
        "bos_out_of_vocab": ("tokenizer.ggml.bos_token_id", GGUFField(8, T.UINT32)),
        "eos_negative": ("tokenizer.ggml.eos_token_id", GGUFField(-1, T.INT32)),
        "padding_id_string": (
            "tokenizer.ggml.padding_token_id",
            GGUFField("7", T.STRING),
        ),
        "unknown_id_huge": (
            "tokenizer.ggml.unknown_token_id",
            GGUFField(2**40, T.UINT64),
        ),
        "token_type_scalar": ("tokenizer.ggml.token_type", GGUFField(1, T.INT32)),
        "merges_integers": (
            "tokenizer.ggml.merges",
            GGUFField([1, 2], T.ARRAY, T.INT32),
        ),
        "tokens_not_array": ("tokenizer.ggml.tokens", GGUFField("abc", T.STRING)),
        "token_invalid_utf8": (  # the reader keeps byte 0xff as a lone surrogate
            "tokenizer.ggml.tokens",
            GGUFField([*TOKENS[:7], "\udcff"], T.ARRAY, T.STRING),
        ),
        "merge_invalid_utf8": (
            "tokenizer.ggml.merges",
            GGUFField(["a \udcff"], T.ARRAY, T.STRING),
        ),
        "template_invalid_utf8": (
            "tokenizer.chat_template",
            GGUFField("{{ '\udcff' }}", T.STRING),
        ),
    }
    for name, (key, field) in bad.items():
        _tokenizer_gguf(c, f"tokenizer/{name}.gguf", {key: field})
        loaders = ["tokenizer", "fast_tokenizer"]
        if name == "tokens_not_array":  # `entrenar info` counts the tokens
            loaders.append("info")
        c.case(f"tokenizer/{name}.gguf", loaders,
               f"{key} = {field.value!r}", match=key)  # fmt: skip
    scores = "tokenizer.ggml.scores"  # read by SentencePiece-style tokenizers only
    spm = {"tokenizer.ggml.model": GGUFField("llama", T.STRING),
           scores: GGUFField(0.5, T.FLOAT32)}  # fmt: skip
    _tokenizer_gguf(c, "tokenizer/scores_scalar.gguf", spm)
    c.case("tokenizer/scores_scalar.gguf", "fast_tokenizer",
           f"model 'llama' with {scores} = 0.5", match=scores)  # fmt: skip


def template_cases(c: Corpus) -> None:
    """Tokenizer GGUFs whose ``tokenizer.chat_template`` attacks the renderer."""
    templates = {
        "nested_range": (
            "{% for i in range(10**6) %}{% for j in range(10**6) %}x"
            "{% endfor %}{% endfor %}",
            "a hang without a budget",
        ),
        "include": ("{% include 'secrets.txt' %}", "templates read no files"),
        "division_by_zero": ("{{ 1/0 }}", "ZeroDivisionError"),
        "recursive_macro": (
            "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
            "RecursionError",
        ),
        "huge_center": ("{{ 'x' | center(2**33) }}", "an 8 GiB string"),
    }
    for name, (template, why) in templates.items():
        field = GGUFField(template, T.STRING)
        _tokenizer_gguf(c, f"template/{name}.gguf", {"tokenizer.chat_template": field})
        # The template is rendered from a string: the error names the template,
        # not the GGUF it came from.
        c.case(f"template/{name}.gguf", "chat_template", why, names_file=False)


# ----------------------------------------------------------- JSON/YAML/safetensors
def _model_doc(dtype: Any, shape: Any, data: Any) -> dict[str, Any]:
    return {
        "format": "entrenar.model",
        "format_version": 1,
        "metadata": {"name": "hostile"},
        "tensors": {"enc.w": {"dtype": dtype, "shape": shape, "data": data}},
    }


def model_cases(c: Corpus) -> None:
    """JSON and YAML model files with hostile values, nesting or bytes."""
    c.write("model/valid.json", json.dumps(_model_doc("float32", [2], [1.0, 2.5])))
    c.case("model/valid.json", "model", "the valid control", expect="ok")
    docs = {
        "null_in_float.json": (_model_doc("float32", [2], [1.0, None]), "null"),
        "true_in_int8.json": (_model_doc("int8", [2], [1, True]), "'True' (bool)"),
        "float_in_int8.json": (_model_doc("int8", [2], [1, 2.7]), "'2.7' (float)"),
        "dtype_list.json": (_model_doc(["float32"], [1], [1.0]), "dtype ['float32']"),
    }
    for name, (doc, match) in docs.items():
        c.write(f"model/{name}", json.dumps(doc))
        c.case(f"model/{name}", "model", match, match=match)
    c.write(
        "model/float_in_int8.yaml",
        "format: entrenar.model\nformat_version: 1\nmetadata: {name: h}\n"
        "tensors:\n  enc.w: {dtype: int8, shape: [2], data: [1, 2.7]}\n",
    )
    c.case("model/float_in_int8.yaml", "model", "2.7 in int8", match="'2.7' (float)")
    c.write(
        "model/dtype_list.yaml",
        "format: entrenar.model\nformat_version: 1\nmetadata: {name: h}\n"
        "tensors:\n  enc.w: {dtype: [float32], shape: [1], data: [1.0]}\n",
    )
    c.case("model/dtype_list.yaml", "model", "a dtype given as a list",
           match="dtype ['float32']")  # fmt: skip
    deep = json.dumps(_model_doc("float32", [1], [0.0])).replace(
        "[0.0]", DEEP_OPEN + DEEP_CLOSE
    )
    c.write("model/deep.json", deep)
    c.case("model/deep.json", "model", "1,500 nested lists")
    huge = json.dumps(_model_doc("int64", [1], [0])).replace("[0]", f"[{'9' * 5000}]")
    c.write("model/huge_int.json", huge)
    c.case("model/huge_int.json", "model", "a 5,000-digit integer")
    c.write("model/truncated.json", json.dumps(_model_doc("float32", [2], [1, 2]))[:60])
    c.case("model/truncated.json", "model", "JSON cut short")
    c.write("model/invalid_utf8.yaml", b"format: entrenar.model\nname: \xff\xfe\n")
    c.case("model/invalid_utf8.yaml", "model", "bytes that are not UTF-8")
    c.write("model/alias_bomb.yaml", _alias_bomb("format: entrenar.model\n"))
    c.case("model/alias_bomb.yaml", "model", "9 levels of 9 aliases")


def _alias_bomb(head: str = "") -> str:
    """YAML whose aliases nest nine deep (9⁹ leaves once expanded)."""
    lines = [head + "a0: &a0 [x, x, x, x, x, x, x, x, x]"]
    for i in range(1, 10):
        refs = ", ".join([f"*a{i - 1}"] * 9)
        lines.append(f"a{i}: &a{i} [{refs}]")
    return "\n".join(lines) + "\n"


def _safetensors(header: Any, data: bytes = b"", raw: bytes | None = None) -> bytes:
    """A safetensors file: u64 length, the JSON header (or ``raw``), ``data``."""
    head = raw if raw is not None else json.dumps(header).encode("utf-8")
    return struct.pack("<Q", len(head)) + head + data


def safetensors_cases(c: Corpus) -> None:
    """Safetensors files whose header lies about lengths, offsets, dtypes."""
    ok = {"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}
    data = np.arange(2, dtype="<f4").tobytes()
    c.write("safetensors/valid.safetensors", _safetensors(ok, data))
    c.case("safetensors/valid.safetensors", ["model", "safetensors"],
           "the valid control", expect="ok")  # fmt: skip
    bad = {
        "header_length_huge": (
            struct.pack("<Q", 2**62) + b"{}" + data,
            "header length",
        ),
        "header_not_json": (_safetensors(None, data, raw=b"{not json}"), "JSON"),
        "header_a_list": (_safetensors([1, 2], data), ""),
        "header_invalid_utf8": (_safetensors(None, data, raw=b'{"\xff": 1}'), ""),
        "header_deep": (
            _safetensors(
                None,
                data,
                raw=b'{"a":' + DEEP_OPEN.encode() + DEEP_CLOSE.encode() + b"}",
            ),
            "",
        ),
        "unknown_dtype": (
            _safetensors({"w": {**ok["w"], "dtype": "F128"}}, data),
            "tensor 'w': dtype",
        ),
        "offsets_past_end": (
            _safetensors({"w": {**ok["w"], "data_offsets": [0, 800]}}, data),
            "",
        ),
        "negative_shape": (
            _safetensors({"w": {**ok["w"], "shape": [-2]}}, data),
            "",
        ),
        "overlapping": (
            _safetensors(
                {
                    "w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                    "v": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]},
                },
                data,
            ),
            "",
        ),
        "metadata_not_strings": (
            _safetensors({**ok, "__metadata__": {"a": [1]}}, data),
            "__metadata__",
        ),
    }
    for name, (blob, match) in bad.items():
        c.write(f"safetensors/{name}.safetensors", blob)
        c.case(f"safetensors/{name}.safetensors", ["model", "safetensors"],
               name.replace("_", " "), match=match)  # fmt: skip
    custom = {"model_config": {"sizes": [2, 1]}, "tokenizer": 7}
    built = {"format": "entrenar.model", "name": "m", "architecture": "mlp",
             "version": "0.1.0", "custom": json.dumps(custom)}  # fmt: skip
    tensors = {
        "layers.0.weight": {"dtype": "F32", "shape": [1, 2], "data_offsets": [0, 8]},
        "layers.0.bias": {"dtype": "F32", "shape": [1], "data_offsets": [8, 12]},
    }
    blob = _safetensors({**tensors, "__metadata__": built}, bytes(12))
    c.write("safetensors/tokenizer_a_number.safetensors", blob)
    c.case("safetensors/tokenizer_a_number.safetensors", "built",
           "custom.tokenizer = 7 (os.path.exists(7) tests a file descriptor)",
           match="custom.tokenizer")  # fmt: skip
    custom = {"model_config": {"sizes": [2, 1000]}}  # the tensors say [2, 1]
    built = {**built, "custom": json.dumps(custom)}
    blob = _safetensors({**tensors, "__metadata__": built}, bytes(12))
    c.write("safetensors/config_not_the_tensors.safetensors", blob)
    c.case("safetensors/config_not_the_tensors.safetensors", ["built", "header"],
           "model_config sizes [2, 1000] beside tensors of [2, 1]",
           match="stored model_config makes (1000,)")  # fmt: skip


# ------------------------------------------------------------------------ adapters
def adapter_config(**changes: Any) -> dict[str, Any]:
    """A PEFT LoRA config of rank 2 on q_proj, with ``changes``."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": 2,
        "lora_alpha": 4.0,
        "lora_dropout": 0.0,
        "target_modules": ["q_proj"],
        "rank_pattern": {},
        "alpha_pattern": {},
        "bias": "none",
        "use_dora": False,
        **changes,
    }


def _adapter(c: Corpus, name: str, config_text: bytes | str) -> str:
    rng = np.random.default_rng(1)
    tensors = {
        f"{PEFT_PREFIX}.lora_A.weight": rng.standard_normal((2, 8)).astype(np.float32),
        f"{PEFT_PREFIX}.lora_B.weight": np.zeros((8, 2), np.float32),
    }
    folder = f"adapter/{name}"
    io.save_safetensors(
        tensors, c.path(f"{folder}/adapter_model.safetensors"), {"format": "pt"}
    )
    c.write(f"{folder}/adapter_config.json", config_text)
    return folder


def adapter_cases(c: Corpus) -> None:
    """PEFT adapter folders whose ``adapter_config.json`` is hostile."""
    folder = _adapter(c, "valid", json.dumps(adapter_config(), indent=1))
    c.case(folder, "adapter", "the valid control", expect="ok")
    configs: dict[str, tuple[bytes | str, str]] = {
        "config_a_list": (json.dumps([adapter_config()]), "a JSON list"),
        "config_a_string": (json.dumps("LORA"), "a JSON string"),
        "dropout_dora": (
            json.dumps(adapter_config(lora_dropout="DORA")),
            'lora_dropout "DORA"',
        ),
        "dropout_inf": (json.dumps(adapter_config(lora_dropout=float("inf"))), "inf"),
        "dropout_five": (json.dumps(adapter_config(lora_dropout=5)), "5"),
        "alpha_nan": (json.dumps(adapter_config(lora_alpha=float("nan"))), "NaN"),
        "deep": (
            json.dumps(adapter_config(target_modules="X")).replace(
                '"X"', DEEP_OPEN + DEEP_CLOSE
            ),
            "1,500 nested lists",
        ),
        "rank_pattern_catastrophic": (
            json.dumps(adapter_config(rank_pattern={"(.*.*.*.*.*.*.*.*.*.*)*$x": 4})),
            "a regex key that backtracks for ever",
        ),
        "rank_pattern_invalid_regex": (
            json.dumps(adapter_config(rank_pattern={"q_proj(": 4})),
            "an unbalanced parenthesis",
        ),
        "alpha_pattern_a_list": (
            json.dumps(adapter_config(alpha_pattern=["q_proj"])),
            "alpha_pattern as a list",
        ),
        "invalid_utf8": (b'{"peft_type": "LORA", "r": 2, "x": "\xff"}', "not UTF-8"),
    }
    for name, (text, why) in configs.items():
        folder = _adapter(c, name, text)
        c.case(folder, "adapter", why)


# ------------------------------------------------------------ Hugging Face folders
def hf_tokenizer_json(merge: tuple[str, str] = ("a", "b"), **model: Any) -> str:
    """A tiny byte-level BPE ``tokenizer.json`` (`TOKENS`, one ``merge``)."""
    byte_level = {"type": "ByteLevel", "add_prefix_space": False,
                  "trim_offsets": True, "use_regex": True}  # fmt: skip
    doc: dict[str, Any] = {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": [],
        "normalizer": None, "pre_tokenizer": byte_level, "post_processor": None,
        "decoder": byte_level,
        "model": {"type": "BPE", "vocab": {t: i for i, t in enumerate(TOKENS)},
                  "merges": [list(merge)], **model},
    }  # fmt: skip
    return json.dumps(doc)


def hf_cases(c: Corpus) -> None:
    """Hugging Face folders whose ``tokenizer.json`` or ``config.json`` is hostile."""
    c.write("hf/tokenizer_valid/tokenizer.json", hf_tokenizer_json())
    c.case("hf/tokenizer_valid", "fast_tokenizer", "the valid control", expect="ok")
    # tokenizers joins a merge (a, b) into a + b[len(prefix):] (bytes), unchecked
    tokenizers = {
        "prefix_longer_than_merge": (("a", "b"), "##", "a Rust panic"),
        "prefix_inside_a_character": (
            ("a", "\u0120"),  # 2 bytes in UTF-8, cut after the first
            "x",
            "a Rust abort of the process",
        ),
    }
    for name, (merge, prefix, why) in tokenizers.items():
        text = hf_tokenizer_json(merge, continuing_subword_prefix=prefix)
        c.write(f"hf/{name}/tokenizer.json", text)
        c.case(f"hf/{name}", "fast_tokenizer", why,
               match="continuing_subword_prefix")  # fmt: skip
    configs: dict[str, tuple[dict[str, Any], str]] = {  # wrong config.json fields
        "rope_scaling_a_number": ({"rope_scaling": 8}, "rope_scaling"),
        "rope_parameters_a_list": ({"rope_parameters": ["yarn"]}, "rope_parameters"),
        "hidden_size_inf": ({"hidden_size": float("inf")}, "infinity"),
        "context_inf": ({"max_position_embeddings": float("inf")}, "infinity"),
        "rms_norm_eps_nan": ({"rms_norm_eps": float("nan")}, "eps must be a finite"),
        "rope_theta_negative": ({"rope_theta": -1.0}, "theta must be a finite"),
    }
    for name, (fields, match) in configs.items():
        hf = {**CONFIG.to_hf_config(), **fields}
        c.write(f"hf/{name}/config.json", json.dumps(hf, indent=1))
        c.case(f"hf/{name}", "hf_folder", f"{fields}", match=match)
    folder = c.path("hf/hidden_size_huge")
    io.save_hf_folder(folder, CONFIG, _params())
    hf = {**CONFIG.to_hf_config(), "hidden_size": 2**63}
    c.write("hf/hidden_size_huge/config.json", json.dumps(hf, indent=1))
    c.case("hf/hidden_size_huge", "info", "hidden_size 2**63 beside weights of 8",
           match="config")  # fmt: skip
    gemma3 = nn.architecture("gemma3")
    assert gemma3.to_hf is not None and gemma3.tiny is not None
    rope = {"full_attention": {"rope_type": "default"}, "sliding_attention": [1]}
    hf = {**gemma3.to_hf(gemma3.tiny()), "rope_parameters": rope}
    c.write("hf/gemma3_sliding_rope_a_list/config.json", json.dumps(hf, indent=1))
    c.case("hf/gemma3_sliding_rope_a_list", "hf_folder", f"{rope}",
           match="rope_parameters.sliding_attention")  # fmt: skip


# ---------------------------------------------------------- configs, recipes, data
def config_cases(c: Corpus) -> None:
    """Run configs: YAML alias bombs, a self-referencing alias, bad bytes, a NaN."""
    c.write("config/alias_bomb.yaml", _alias_bomb())
    c.case("config/alias_bomb.yaml", "config", "9 levels of 9 aliases (324 bytes)")
    c.write("config/alias_self.yaml", "model: &a {path: *a}\n")
    c.case("config/alias_self.yaml", "config", "an alias inside its own anchor")
    c.write("config/invalid_utf8.yaml", b"model:\n  path: \xff\xfe.gguf\n")
    c.case("config/invalid_utf8.yaml", "config", "bytes that are not UTF-8")
    c.write("config/deep.yaml", "model: " + DEEP_OPEN + DEEP_CLOSE + "\n")
    c.case("config/deep.yaml", "config", "1,500 nested lists")
    c.write("config/tabular_nan.yaml", _tabular_config("../data/nan.csv"))
    c.case("config/tabular_nan.yaml", "validate", "its data holds a NaN cell",
           match="row 3, column 'f2'", names_file=False)  # fmt: skip


def _tabular_config(train: str) -> str:
    return (
        "model:\n  architecture: mlp\n  config: {sizes: [2, 4, 2]}\n"
        f"data:\n  train: {train}\n  target: label\n  batch_size: 2\n"
        "optimizer: {name: adam, lr: 0.01}\n"
        "training: {max_steps: 1, output_dir: /nonexistent/entrenar-hostile-run}\n"
    )


def recipe_cases(c: Corpus) -> None:
    """Merge recipes with bad values and model folders without weights."""
    c.write("recipe/models/empty/config.json", '{"model_type": "llama"}')
    model = {"model": "../safetensors/valid.safetensors", "parameters": {"weight": 1}}
    recipes = {
        "method_list": ({"merge_method": [], "models": [model]}, "merge_method"),
        "dtype_list": (
            {"merge_method": "linear", "dtype": ["float32"], "models": [model]},
            "dtype",
        ),
        "folder_without_weights": (
            {
                "merge_method": "linear",
                "models": [{"model": "models/empty", "parameters": {"weight": 1}}],
            },
            "models[0].model",
        ),
        "base_folder_without_weights": (
            {"merge_method": "ties", "base_model": "models/empty", "models": [model]},
            "base_model",
        ),
    }
    for name, (doc, match) in recipes.items():
        c.write(f"recipe/{name}.yaml", json.dumps(doc))  # JSON is YAML
        c.case(f"recipe/{name}.yaml", "recipe", match, match=match)
    c.write("recipe/alias_bomb.yaml", _alias_bomb("merge_method: linear\n"))
    c.case("recipe/alias_bomb.yaml", "recipe", "9 levels of 9 aliases")
    c.write("recipe/invalid_utf8.yaml", b"merge_method: \xff\n")
    c.case("recipe/invalid_utf8.yaml", "recipe", "bytes that are not UTF-8")


def data_cases(c: Corpus) -> None:
    """JSONL and CSV data with bad bytes, huge integers, deep nesting, NaN cells."""
    c.write("data/invalid_utf8.jsonl", b'{"text": "ok"}\n{"text": "\xff"}\n')
    c.case("data/invalid_utf8.jsonl", "records", "line 2 is not UTF-8",
           match="line 2")  # fmt: skip
    c.write("data/huge_int.jsonl", '{"text": "ok", "n": ' + "9" * 5000 + "}\n")
    c.case("data/huge_int.jsonl", "records", "a 5,000-digit integer", match="line 1")
    c.write("data/deep.jsonl", '{"text": ' + DEEP_OPEN + DEEP_CLOSE + "}\n")
    c.case("data/deep.jsonl", "records", "1,500 nested lists", match="line 1")
    c.write("data/invalid_utf8.csv", b"text,label\nok,1\n\xff\xfe,0\n")
    c.case("data/invalid_utf8.csv", "records", "row 2 is not UTF-8", match="line 3")
    c.write("data/nan.csv", "f1,f2,label\n1,2,0\n3,4,1\n5,nan,0\n7,8,1\n")
    c.case("data/nan.csv", "tabular", "a NaN cell", match="row 3, column 'f2'")
    c.write("data/inf.jsonl", '{"f1": 1, "f2": 2, "label": 0}\n'
            '{"f1": 1e999, "f2": 2, "label": 1}\n')  # fmt: skip
    c.case("data/inf.jsonl", "tabular", "1e999 (infinite)",
           match="line 2, column 'f1'")  # fmt: skip


SECTIONS: list[Callable[[Corpus], None]] = [
    tokenizer_cases,
    template_cases,
    model_cases,
    safetensors_cases,
    adapter_cases,
    hf_cases,
    config_cases,
    recipe_cases,
    data_cases,
]


def build(out: Path) -> list[dict[str, Any]]:
    """Write the corpus and its ``MANIFEST.json`` into ``out`` (emptied first)."""
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    c = Corpus(out)
    with tempfile.TemporaryDirectory() as tmp:
        gguf_cases(c, base_gguf(Path(tmp)))
    for section in SECTIONS:
        section(c)
    rows = [json.dumps(case, ensure_ascii=False) for case in c.cases]
    manifest = "[\n" + ",\n".join(rows) + "\n]\n"  # one case a line
    (out / "MANIFEST.json").write_text(manifest, encoding="utf-8")
    return c.cases


def main() -> None:
    """Command line: ``--out`` (default tests/data/hostile)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    cases = build(args.out)
    size = sum(p.stat().st_size for p in args.out.rglob("*") if p.is_file())
    print(f"{len(cases)} cases, {size / 1024:.0f} KiB in {args.out}")


if __name__ == "__main__":
    main()
