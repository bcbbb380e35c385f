"""String arrays (vocabularies) read at once: the values of the one-by-one reader."""

import gguf
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from entrenar.errors import FormatError
from entrenar.io import GGUFField, GGUFValueType, gguf_reader, read_gguf, write_gguf

V = GGUFValueType


def _vocab(rng: np.random.Generator, n: int) -> list[str]:
    """``n`` strings of 1 to 60 characters, ASCII and 2-4 byte UTF-8."""
    alphabet = list("abcdefghijklmnopqrstuvwxyz .,<>") + list("ĠĊéü✓→€中文") + ["😀"]
    sizes = rng.integers(1, 61, n)
    return ["".join(rng.choice(alphabet, k)) for k in sizes]


def _write(path, **arrays: list[str]) -> None:
    fields = {"general.architecture": GGUFField("test", V.STRING)}
    fields |= {k: GGUFField(v, V.ARRAY, V.STRING) for k, v in arrays.items()}
    fields["after"] = GGUFField(7, V.UINT32)  # a field after the arrays
    write_gguf(path, fields, {})


def _one_by_one(path, monkeypatch) -> dict:
    with monkeypatch.context() as m:
        m.setattr(gguf_reader, "FAST_STRINGS", 1 << 62)
        return read_gguf(path).metadata


def test_a_vocabulary_reads_at_once_as_the_gguf_package_reads_it(tmp_path):
    rng = np.random.default_rng(0)
    tokens, merges = _vocab(rng, 3000), _vocab(rng, 2500)
    tokens[5] = "x" * 255  # the longest string the fast path reads
    path = tmp_path / "v.gguf"
    _write(path, tokens=tokens, merges=merges)
    g = read_gguf(path)
    ref = gguf.GGUFReader(path)
    assert g.metadata["tokens"] == tokens == ref.fields["tokens"].contents()
    assert g.metadata["merges"] == merges == ref.fields["merges"].contents()
    assert g.metadata["after"] == 7
    # it took the fast path: the array's strings come out of `_chain` + `_decode`
    raw = np.fromfile(path, np.uint8)
    start = raw.tobytes().index(b"tokens") + len("tokens") + 4 + 4 + 8
    got = gguf_reader._chain(raw, start, raw.size, len(tokens))
    assert got is not None and gguf_reader._decode(*got[1:]) == tokens


def test_a_vocabulary_is_decoded_when_first_read(tmp_path):
    """Parsing keeps a vocabulary's bytes; its strings are made at the first read."""
    rng = np.random.default_rng(3)
    tokens, short = _vocab(rng, 3000), _vocab(rng, 10)
    path = tmp_path / "v.gguf"
    _write(path, tokens=tokens, short=short)
    g = read_gguf(path)
    field = g.fields["tokens"]
    assert "not decoded yet" in repr(field)  # the parse made no strings
    assert "not decoded yet" not in repr(g.fields["short"])  # short: read at once
    path.write_bytes(b"")  # the strings come from the parse's copy, not the file
    assert g.metadata["tokens"] == tokens and field.value is field.value
    assert "not decoded yet" not in repr(field)
    assert field == GGUFField(tokens, V.ARRAY, V.STRING)
    assert field != GGUFField(tokens[:-1], V.ARRAY, V.STRING)


@pytest.mark.parametrize(
    "odd",
    [
        "y" * 256,  # a length byte over 255
        "",  # an empty string
        "a\0\0\0\0\0\0\0\0b",  # seven zero bytes inside
        "a\0b",  # one zero byte
        b"\xc3(\xff".decode("utf-8", "surrogateescape"),  # invalid UTF-8
        b"\x80abc".decode("utf-8", "surrogateescape"),  # a continuation byte first
        b"ab\xe2\x82".decode("utf-8", "surrogateescape"),  # a character cut short
    ],
)
def test_strings_the_fast_path_cannot_read_fall_back_to_the_same_values(
    tmp_path, monkeypatch, odd
):
    rng = np.random.default_rng(1)
    tokens = _vocab(rng, 2000)
    tokens[1000] = odd
    tokens[1001] = "€" + odd  # after a multi-byte character
    path = tmp_path / "v.gguf"
    _write(path, tokens=tokens)
    assert read_gguf(path).metadata["tokens"] == tokens
    assert _one_by_one(path, monkeypatch)["tokens"] == tokens


_TEXT = st.one_of(
    st.text(max_size=12),
    st.binary(max_size=12).map(lambda b: b.decode("utf-8", "surrogateescape")),
)


@settings(max_examples=60, deadline=None)
@given(st.lists(_TEXT, min_size=1, max_size=40))
def test_any_strings_read_back_as_written(tmp_path_factory, strings):
    """Arbitrary text and bytes, through the fast path where it applies."""
    path = tmp_path_factory.mktemp("s") / "v.gguf"
    _write(path, tokens=strings)
    old = gguf_reader.FAST_STRINGS
    gguf_reader.FAST_STRINGS = 1  # every array tries the fast path
    try:
        got = read_gguf(path).metadata
    finally:
        gguf_reader.FAST_STRINGS = old
    assert got["tokens"] == strings and got["after"] == 7


def test_a_truncated_vocabulary_names_the_field(tmp_path):
    path = tmp_path / "v.gguf"
    tokens = _vocab(np.random.default_rng(2), 3000)
    _write(path, tokens=tokens)
    data = path.read_bytes()
    cut = data.index(tokens[2000].encode()) + 2  # inside string 2000
    path.write_bytes(data[:cut])
    with pytest.raises(FormatError, match=r"v\.gguf.*'tokens'"):
        read_gguf(path)


def test_lengths_that_do_not_chain_are_read_one_by_one(tmp_path, monkeypatch):
    """A length one short: the candidates (every ``n, 0 x 7``) no longer chain."""
    path = tmp_path / "v.gguf"
    _write(path, tokens=["abc", "de"] * 4)
    data = bytearray(path.read_bytes())
    at = data.index(b"\x03\0\0\0\0\0\0\0abc")
    data[at] = 2  # "ab", then a length read from "c" and the next header
    path.write_bytes(bytes(data))
    monkeypatch.setattr(gguf_reader, "FAST_STRINGS", 1)
    raw = np.frombuffer(bytes(data), np.uint8)
    assert gguf_reader._chain(raw, at, raw.size, 8) is None
    with pytest.raises(FormatError, match="'tokens'"):  # as one by one: too long
        read_gguf(path)
