"""Chat labels of Hugging Face tokenizers, aligned by their tokens' character spans.

SentencePiece-style tokenizers (Mistral, Gemma, Phi-3: ``▁`` for spaces, a space
prepended, byte fallback) do not spell the text byte for byte, so labels follow the
spans ``tokenizers`` reports; byte-level ones (Llama 3, Qwen) give the same labels
either way.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from entrenar import data, io
from entrenar.data.formatting import label_segments, label_spans

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "io"))
import hf_cases

CHAT = [{"messages": hf_cases.MESSAGES[:2]}]


@pytest.mark.parametrize("style", sorted(hf_cases.STYLES))
def test_the_trained_tokens_spell_the_reply(style, tmp_path):
    hf_cases.write_tokenizer(tmp_path, style)
    tok = io.HFTokenizer.from_folder(tmp_path)
    [(ids, labels)] = data.encode_records(CHAT, tok, format="chat")
    trained = labels != data.IGNORE_INDEX
    assert np.array_equal(ids[trained], labels[trained])
    reply = tok.decode(ids[trained], special=False)
    assert reply.strip().startswith("Hi, how are you?")
    assert "Hello world" not in tok.decode(ids[trained], special=True)


def test_byte_level_spans_give_the_byte_labels(tmp_path):
    hf_cases.write_tokenizer(tmp_path, "qwen")
    tok = io.HFTokenizer.from_folder(tmp_path)
    segments = [("¿Qué tal? ", False), ("Muy bien, 日本語 ✓", True), (" fin", False)]
    text = "".join(s for s, _ in segments)
    [(ids, spans)] = tok.encode_offsets_batch([text])
    assert ids == tok.encode(text)
    np.testing.assert_array_equal(
        label_spans(ids, spans, segments), label_segments(tok, ids, segments)
    )


def test_an_empty_span_is_never_trained():
    labels = label_spans(
        [1, 5, 6], [(0, 0), (0, 2), (2, 4)], [("ab", True), ("cd", False)]
    )
    assert labels.tolist() == [data.IGNORE_INDEX, 5, data.IGNORE_INDEX]
