"""GGUF tokenizer fields, one change at a time, against llama.cpp's recorded ids.

tests/oracles/make_tokenizer_variants_reference.py wrote each variant with gguf-py
(SmolLM2's byte-level BPE fields with one change, or a hand-made SentencePiece-style
vocabulary) and recorded llama-cpp-python 0.3.36's ids for its texts, with and without
special tokens and BOS, and each token's piece; the test writes the same files again
(their fields' digest must match) and reads them with `load_fast_tokenizer`.
"""

import json
import sys
from pathlib import Path

import pytest

from entrenar.data import FastTokenizer, load_fast_tokenizer
from entrenar.errors import UnsupportedError
from entrenar.io import BPETokenizer, smollm2_path
from entrenar.io.gguf_tokenizer import gguf_tokenizer_fields
from entrenar.io.tokenizer import bytes_to_unicode

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "oracles"))
import make_tokenizer_variants_reference as oracle  # noqa: E402

RECORD = json.loads((ROOT / "data" / oracle.RECORD).read_text(encoding="utf-8"))
SMOLLM2 = pytest.mark.slow  # SmolLM2's 49152 tokens: a few seconds each
VARIANTS = [
    pytest.param("pre_default", marks=SMOLLM2),
    pytest.param("pre_missing", marks=SMOLLM2),
    pytest.param("pre_gpt-2", marks=SMOLLM2),
    pytest.param("pre_smollm", marks=SMOLLM2),
    pytest.param("types", marks=SMOLLM2),
    pytest.param("llama3_no_add_bos", marks=SMOLLM2),
    "spm_no_specials",
]


@pytest.fixture(scope="module")
def variant(tmp_path_factory):
    """``variant(name)``: the tokenizer read back from the written file, and its record.

    Built once per variant for the module (ids and pieces read the same file): a
    SmolLM2 variant takes ~2.4 CPU-s to write and read, its checks ~0.05 s.
    """
    built = {}

    def get(name: str):
        if name not in built:
            built[name] = _tokenizer(name, tmp_path_factory.mktemp(name))
        return built[name]

    return get


def _tokenizer(name: str, tmp: Path):
    base, _ = oracle.CHANGES[name]
    if base == "smollm2":
        try:
            smollm2_path()
        except UnsupportedError as e:
            pytest.skip(str(e))
    fields = oracle.variant_fields(name)
    want = RECORD["variants"][name]
    assert oracle.fields_digest(fields) == want["fields_sha256"], name
    oracle.write_gguf(tmp / f"{name}.gguf", fields)
    return load_fast_tokenizer(tmp / f"{name}.gguf"), want


@pytest.mark.parametrize("name", VARIANTS)
def test_ids_as_llama_cpp(name, variant):
    tok, want = variant(name)
    assert want["loads"]
    assert RECORD["texts"] == oracle.texts()
    assert tok.add_bos == want["add_bos"]
    assert tok.bos_id == want["bos"]
    for text, ids in zip(RECORD["texts"], want["ids"]):
        got = [
            tok.encode(text, add_bos=None if add else False, special=special)
            for add in (False, True)
            for special in (False, True)
        ]
        assert got == ids, text
        if isinstance(tok, FastTokenizer):  # and the pure-Python reference
            assert tok.reference.encode(text, add_bos=False) == ids[0], text


@pytest.mark.parametrize("name", VARIANTS)
def test_pieces_as_llama_cpp(name, variant):
    """Each token decodes to llama.cpp's piece.

    SentencePiece-style decoding drops the space of a first ``▁`` (as Hugging Face's
    ``Strip`` decoder and llama.cpp's ``llama_detokenize`` do), which llama.cpp's
    pieces keep.
    """
    tok, want = variant(name)
    spm = oracle.CHANGES[name][0] == "spm"
    for i, pieces in want["pieces"].items():
        if spm and bytes.fromhex(pieces[1]).startswith(b" "):
            pieces = [bytes.fromhex(p)[1:].hex() for p in pieces]
        for special, piece in zip((False, True), pieces):
            text = bytes.fromhex(piece).decode("utf-8", errors="replace")
            assert tok.decode([int(i)], special=special) == text, (i, special)


def test_a_gpt2_pre_is_written_as_llama_cpp_names_it(tmp_path):
    """llama.cpp refuses ``pre`` ``gpt2`` (recorded): entrenar writes ``gpt-2``.

    entrenar reads ``gpt2`` as GPT-2's regex, which llama.cpp names ``gpt-2``.
    """
    assert not RECORD["variants"]["pre_gpt2"]["loads"]
    assert RECORD["variants"]["pre_gpt-2"]["loads"]
    b2u = bytes_to_unicode()
    tokens = tuple(b2u[b] for b in range(256))
    fast = FastTokenizer(BPETokenizer(tokens, (), (1,) * 256, pre="gpt2"))
    assert gguf_tokenizer_fields(fast)["tokenizer.ggml.pre"].value == "gpt-2"
