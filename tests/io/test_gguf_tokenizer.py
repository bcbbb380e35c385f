"""A Hugging Face tokenizer written into a GGUF (entrenar.io.gguf_tokenizer).

Each tiny tokenizer style of hf_cases.py is written with a tiny model by
`save_llama_gguf(tokenizer=...)`; entrenar reading the file back must give llama.cpp's
ids (recorded by tests/oracles/make_gguf_tokenizer_reference.py in
tests/data/llama_cpp_gguf_tokenizer.json, or live where llama-cpp-python runs), and
the Hugging Face tokenizer the same ids but for the documented cases (specs/io.md).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import hf_cases
import llama_cpp_cases
import pytest

from entrenar import io
from entrenar.data import FastTokenizer, load_fast_tokenizer
from entrenar.errors import FormatError, UnsupportedError
from entrenar.io.gguf_reader import GGUFField, GGUFValueType, read_gguf
from entrenar.io.gguf_tokenizer import (
    PRE_TOKENIZERS,
    gguf_tokenizer_fields,
    hf_json_from_gguf,
    pre_tokenizer_name,
    space_prefix,
)
from entrenar.io.gguf_writer import write_gguf
from entrenar.runs.export import gguf_tokenizer
from entrenar.runs.models import BuiltModel

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "oracles" / "make_gguf_tokenizer_reference.py"
RECORD = ROOT / "data" / "llama_cpp_gguf_tokenizer.json"
sys.path.insert(0, str(SCRIPT.parent))
import make_gguf_tokenizer_reference as oracle  # noqa: E402

NFC_TEXT = "cafe\u0301 (decomposed accent)"
HF_DIFFERS = {("qwen2_split", NFC_TEXT)}
"""Where the Hugging Face tokenizer and llama.cpp disagree (specs/io.md): Qwen2's NFC
normalizer, which llama.cpp does not run."""


def _write(tmp: Path, style: str) -> tuple[io.HFTokenizer, Path]:
    """The style's tokenizer and the tiny model GGUF entrenar writes with it."""
    hf_cases.write_tokenizer(tmp / style, style)
    tok = io.HFTokenizer.from_folder(tmp / style)
    config = dataclasses.replace(
        llama_cpp_cases.family_config(oracle.STYLE_FAMILY[style]),
        vocab_size=tok.vocab_size + 3,  # padded with unused tokens
    )
    path = tmp / f"{style}.gguf"
    params = llama_cpp_cases.family_params(config)
    io.save_llama_gguf(path, config, params, tokenizer=tok)
    return tok, path


def _read_back(path: Path):
    """A GGUF's tokenizer by `load_fast_tokenizer`, of the class that reads it.

    `HFTokenizer.from_gguf` where `FastTokenizer` does not read the fields: model
    'llama', pre 'llama-bpe' and 'qwen2'.
    """
    tok = load_fast_tokenizer(path)
    md = read_gguf(path).metadata
    fast = md["tokenizer.ggml.pre"] in ("gpt-2", "smollm")
    assert isinstance(tok, FastTokenizer if fast else io.HFTokenizer)
    return tok


def _check(record: dict, tmp: Path) -> None:
    for style, want in record["styles"].items():
        hf_cases.write_tokenizer(tmp / style, style)
        text = (tmp / style / "tokenizer.json").read_text(encoding="utf-8")
        if oracle.vocab_digest(text) != want["vocab_sha256"]:
            pytest.skip(f"{style}: this tokenizers trains another tiny vocabulary")
        tok, path = _write(tmp, style)
        fields = gguf_tokenizer_fields(tok, vocab_size=tok.vocab_size)
        assert oracle.fields_digest(fields) == want["fields_sha256"], style
        back = _read_back(path)
        assert back.encode("Hello") == want["with_bos"], style
        hf_diffs = set()
        for case in want["cases"]:
            args = dict(add_bos=False, special=case["special"])
            assert back.encode(case["text"], **args) == case["ids"], (style, case)
            if tok.encode(case["text"], **args) != case["ids"]:
                hf_diffs.add((style, case["text"]))
        assert hf_diffs == {d for d in HF_DIFFERS if d[0] == style}


def test_recorded_llama_cpp_ids(tmp_path):
    record = json.loads(RECORD.read_text(encoding="utf-8"))
    assert set(record["styles"]) == set(oracle.STYLE_FAMILY)
    assert {c["text"] for c in record["styles"]["llama"]["cases"]} == set(
        hf_cases.GGUF_TEXTS
    )
    _check(record, tmp_path)


def test_live_llama_cpp_ids(tmp_path):
    python = os.environ.get("ENTRENAR_LLAMA_PYTHON", sys.executable)
    probe = subprocess.run([python, "-c", "import llama_cpp"], capture_output=True)
    if probe.returncode:
        pytest.skip(f"llama_cpp is not importable by {python}")
    cmd = [sys.executable, str(SCRIPT), "--out", str(tmp_path / "rec")]
    p = subprocess.run(
        [*cmd, "--llama-python", python], capture_output=True, text=True, timeout=600
    )
    if p.returncode < 0:
        pytest.skip(f"the llama.cpp subprocess died from signal {-p.returncode}")
    assert p.returncode == 0, p.stderr[-2000:]
    _check(json.loads((tmp_path / "rec" / oracle.RECORD).read_text("utf-8")), tmp_path)


@pytest.mark.parametrize(
    ("style", "model", "pre"),
    [
        ("llama", "gpt2", "gpt-2"),
        ("llama3_split", "gpt2", "llama-bpe"),
        ("qwen2_split", "gpt2", "qwen2"),
        ("mistral", "llama", "default"),
        ("gemma", "llama", "default"),
    ],
)
def test_fields_of_each_style(style, model, pre, tmp_path):
    tok, path = _write(tmp_path, style)
    md = read_gguf(path).metadata
    assert md["tokenizer.ggml.model"] == model and md["tokenizer.ggml.pre"] == pre
    n = tok.vocab_size
    assert md["tokenizer.ggml.tokens"][:n] == tok.tokens
    assert md["tokenizer.ggml.tokens"][n:] == [f"[PAD{i}]" for i in range(n, n + 3)]
    assert md["tokenizer.ggml.token_type"][:n] == list(tok.token_types)
    assert md["tokenizer.ggml.token_type"][n:] == [5, 5, 5]
    assert md["tokenizer.chat_template"] == tok.chat_template
    assert md["tokenizer.ggml.add_bos_token"] == tok.add_bos
    assert md["tokenizer.ggml.add_eos_token"] is False
    assert md.get("tokenizer.ggml.bos_token_id") == tok.bos_id
    assert md["tokenizer.ggml.eos_token_id"] == tok.eos_id
    assert md.get("tokenizer.ggml.padding_token_id") == tok.pad_id
    if model == "gpt2":
        assert "tokenizer.ggml.scores" not in md
        assert len(md["tokenizer.ggml.merges"]) == len(
            json.loads(tok.text)["model"]["merges"]
        )
    else:
        assert md["tokenizer.ggml.add_space_prefix"] == (style != "gemma")
        assert md["tokenizer.ggml.unknown_token_id"] == tok.tokens.index("<unk>")
        assert "tokenizer.ggml.merges" not in md
        scores = md["tokenizer.ggml.scores"]
        first = json.loads(tok.text)["model"]["merges"][0]
        assert scores[tok.tokens.index("".join(first))] == 0.0
        assert min(scores) == 1 - len(json.loads(tok.text)["model"]["merges"])


def test_a_gguf_tokenizer_writes_its_own_fields_again(tmp_path):
    _, path = _write(tmp_path, "llama")
    fast = load_fast_tokenizer(path)
    assert isinstance(fast, FastTokenizer)
    again = gguf_tokenizer_fields(fast)
    md = read_gguf(path).metadata
    for key, f in again.items():
        assert md[key] == f.value, key


def _doc(style: str) -> dict:
    return json.loads(hf_cases.tokenizer_json(hf_cases.STYLES[style]))


def test_an_unknown_pre_tokenizer_is_refused():
    doc = _doc("llama3_split")
    split = doc["pre_tokenizer"]["pretokenizers"][0]
    split["pattern"]["Regex"] = r"\p{L}+|\s+"
    with pytest.raises(UnsupportedError, match=r"matches no llama\.cpp pre-tokenizer"):
        pre_tokenizer_name(doc)
    doc = _doc("llama")
    doc["normalizer"] = {"type": "Lowercase"}
    with pytest.raises(UnsupportedError, match="Lowercase"):
        pre_tokenizer_name(doc)
    assert set(PRE_TOKENIZERS) == {"gpt-2", "smollm", "llama-bpe", "qwen2"}


def test_a_smollm_pre_tokenizer_is_named():
    doc = _doc("llama")
    doc["pre_tokenizer"] = {
        "type": "Sequence",
        "pretokenizers": [
            {"type": "Digits", "individual_digits": True},
            doc["pre_tokenizer"],
        ],
    }
    assert pre_tokenizer_name(doc) == "smollm"


@pytest.mark.parametrize("change", ["wordlevel", "no_byte_fallback", "split"])
def test_tokenizers_llama_cpp_cannot_run_are_refused(change, tmp_path):
    doc = _doc("mistral")
    if change == "wordlevel":
        import tokenizers as hf

        model = hf.models.WordLevel({"<s>": 0, "a": 1}, unk_token="a")
        doc = json.loads(hf.Tokenizer(model).to_str())
    elif change == "no_byte_fallback":
        doc["model"]["byte_fallback"] = False
    else:
        doc["pre_tokenizer"] = {"type": "Metaspace", "replacement": "\u2581",
                                "prepend_scheme": "always", "split": True}  # fmt: skip
    tok = io.HFTokenizer(json.dumps(doc), {"bos_token": "<s>"})
    with pytest.raises(UnsupportedError):
        gguf_tokenizer_fields(tok)


def test_more_tokens_than_embedding_rows_is_refused(tmp_path):
    hf_cases.write_tokenizer(tmp_path, "qwen")
    tok = io.HFTokenizer.from_folder(tmp_path)
    with pytest.raises(FormatError, match="more than the model's vocab_size 96"):
        gguf_tokenizer_fields(tok, vocab_size=96)


def test_a_source_tokenizer_wins(tmp_path):
    _, source = _write(tmp_path, "llama")
    hf_cases.write_tokenizer(tmp_path / "g", "gemma")
    other = io.HFTokenizer.from_folder(tmp_path / "g")
    g = read_gguf(source)
    config = io.llama_config_from_gguf(g)
    params = llama_cpp_cases.family_params(config)
    out = tmp_path / "out.gguf"
    io.save_llama_gguf(out, config, params, source=g, tokenizer=other)
    md = read_gguf(out).metadata
    assert md["tokenizer.ggml.model"] == "gpt2"
    assert md["tokenizer.ggml.tokens"] == g.metadata["tokenizer.ggml.tokens"]


def test_phi3_names_strip_whitespace_after_chat_tokens():
    """llama.cpp's rule by ``general.name`` (GGUF has no per-token strip flags)."""
    md = {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": ["<unk>", "<s>", "</s>", "<|end|>", "a"],
        "tokenizer.ggml.token_type": [2, 3, 3, 3, 1],
    }
    for name, stripped in (("x-phi3", {"</s>", "<|end|>"}), ("llama", set())):
        doc = json.loads(hf_json_from_gguf(md | {"general.name": name}))
        assert {a["content"] for a in doc["added_tokens"] if a["rstrip"]} == stripped


def test_a_run_exports_the_tokenizer_only_when_it_fits(tmp_path):
    hf_cases.write_tokenizer(tmp_path, "mistral")
    tok = io.HFTokenizer.from_folder(tmp_path)
    config = llama_cpp_cases.family_config("mistral")
    fits = BuiltModel("mistral", config, None, tok, str(tmp_path))
    assert gguf_tokenizer(fits) is tok
    small = dataclasses.replace(fits, config=dataclasses.replace(config, vocab_size=96))
    with pytest.warns(UserWarning, match="without a tokenizer"):
        assert gguf_tokenizer(small) is None


def test_special_ids_and_flags_round_trip(tmp_path):
    tok, path = _write(tmp_path, "phi3")
    back = io.HFTokenizer.from_gguf(path)
    assert (back.bos_id, back.eos_id, back.pad_id) == (1, 3, 3)
    assert back.unk_id == tok.unk_id and back.add_bos and not back.add_eos
    assert back.chat_template == tok.chat_template


def test_a_tokenizer_only_gguf_reads_back(tmp_path):
    hf_cases.write_tokenizer(tmp_path, "gemma")
    tok = io.HFTokenizer.from_folder(tmp_path)
    arch = {"general.architecture": GGUFField("tokenizer", GGUFValueType.STRING)}
    write_gguf(tmp_path / "t.gguf", arch | gguf_tokenizer_fields(tok), {})
    back = io.HFTokenizer.from_gguf(tmp_path / "t.gguf")
    for text in hf_cases.GGUF_TEXTS:
        assert back.encode(text, special=True) == tok.encode(text, special=True)


def test_a_gguf_tokenizer_saved_as_a_folder_writes_the_same_fields(tmp_path):
    """SmolLM2's GGUF tokenizer -> tokenizer.json (entrenar's) -> the same fields."""
    fast = load_fast_tokenizer(io.smollm2_path())
    for name, text in io.tokenizer_files(fast).items():
        (tmp_path / name).write_text(text, encoding="utf-8")
    again = gguf_tokenizer_fields(io.HFTokenizer.from_folder(tmp_path))
    md = read_gguf(io.smollm2_path()).metadata
    assert again["tokenizer.ggml.pre"].value == md["tokenizer.ggml.pre"] == "smollm"
    for key in ("tokens", "token_type", "merges", "bos_token_id", "eos_token_id"):
        assert again[f"tokenizer.ggml.{key}"].value == md[f"tokenizer.ggml.{key}"]
    assert again["tokenizer.chat_template"].value == md["tokenizer.chat_template"]


@pytest.mark.parametrize(
    ("normalizer", "pre", "prefix"),
    [
        (None, {"type": "Metaspace", "prepend_scheme": "first"}, True),
        (None, {"type": "Metaspace", "prepend_scheme": "never"}, False),
        ({"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"}, None,
         False),
    ],
)  # fmt: skip
def test_space_prefix_of_each_spelling(normalizer, pre, prefix):
    if pre is not None:
        pre = pre | {"replacement": "\u2581", "split": False}
    doc = {"normalizer": normalizer, "pre_tokenizer": pre}
    assert space_prefix(doc) is prefix
    with pytest.raises(UnsupportedError, match="spaces are not written"):
        space_prefix({"normalizer": None, "pre_tokenizer": None})
