"""ChatModel: sampling options, stop strings, batched replies, decoded exact match."""

import itertools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from entrenar.chat import ChatModel, exact_match
from entrenar.errors import ConfigError
from entrenar.io import BPETokenizer
from entrenar.io.tokenizer import bytes_to_unicode

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
B2U = bytes_to_unicode()
END = 257  # <|im_end|>
TOKENIZER = BPETokenizer(
    tokens=(*(B2U[b] for b in range(256)), "<|im_start|>", "<|im_end|>"),
    merges=(),
    token_types=(1,) * 256 + (3, 3),
    eos_id=END,
)


def record(reply, question="Hi"):
    return {"messages": [{"role": "user", "content": question},
                         {"role": "assistant", "content": reply}]}  # fmt: skip


class Pos(NamedTuple):
    """A cache that is only a position: enough for ragged batches."""

    pos: jax.Array


class PosTableLM(NamedTuple):
    """The next token's logits depend on the last token; the cache has a pos."""

    max_position_embeddings: int = 64

    def apply(self, table, tokens):
        return table[tokens]

    def init_cache(self, batch, max_len):
        return Pos(jnp.zeros((), jnp.int32))

    def apply_cached(self, table, tokens, cache):
        return table[tokens], Pos(cache.pos + tokens.shape[1])


def table(*chains):
    t = np.random.default_rng(0).normal(size=(258, 258)).astype(np.float32)
    for chain in chains:
        for a, b in itertools.pairwise(chain):
            t[a, b] = 20.0
    return jnp.asarray(t)


def ids(text):
    return [ord(c) for c in text]


# After "assistant\n" the model says "ABC-DE FG" and ends the turn.
REPLY = "ABC-DE FG"
CHAT = ChatModel(
    PosTableLM(), table([*ids("\n" + REPLY), END]), TOKENIZER, chat_template=CHATML
)


def test_stop_strings_cut_exactly_and_stream_holds_them_back():
    assert CHAT("Hi") == REPLY
    for stop, want in [("C-D", "AB"), ("-DE", "ABC"), ("E F", "ABC-D"), ("A", "")]:
        r = CHAT.reply("Hi", stop=[stop, "zz"])
        assert r.text == want and r.finish_reason == "stop", stop
        pieces = list(CHAT.stream("Hi", stop=[stop]))
        assert "".join(pieces) == want
        assert all(stop not in p for p in pieces)
    assert CHAT.reply("Hi", stop=["nowhere"]).text == REPLY


def test_replies_batch_ragged_prompts_as_alone():
    convs = ["Hi", "Is it?", "A longer question, is it?", "Hm"]
    alone = [CHAT.reply(c) for c in convs]
    assert [r.text for r in alone] == [REPLY] * 4
    for bs in (1, 3, 8):
        assert CHAT.replies(convs, batch_size=bs) == alone
    got = CHAT.replies(convs, batch_size=4, stop=["-"])
    assert [r.text for r in got] == ["ABC"] * 4


def test_sampling_options_reach_the_decoder():
    kw = dict(temperature=1.0, top_k=3, min_p=0.1, repetition_penalty=1.1)
    a = CHAT.reply("Hi", key=jax.random.key(0), **kw)
    assert a == CHAT.reply("Hi", key=jax.random.key(0), **kw)
    assert "".join(CHAT.stream("Hi", key=jax.random.key(0), **kw)) == a.text
    greedy = CHAT.reply("Hi")
    assert CHAT.reply("Hi", key=jax.random.key(1), temperature=1.0, top_k=1) == greedy
    with pytest.raises(ConfigError, match="unknown generation option"):
        CHAT.stream("Hi", top_q=0.5)
    with pytest.raises(ConfigError, match="min_p"):
        CHAT.reply("Hi", temperature=1.0, min_p=2.0, key=jax.random.key(0))


def test_decoded_exact_match_equals_the_teacher_forced_one():
    recs = [record(REPLY), record("ABC"), record("no"), record(REPLY, "Right?"),
            record(REPLY + "!")]  # fmt: skip
    forced = exact_match(CHAT, recs, batch_size=2)
    assert list(forced.hits) == [True, False, False, True, False]
    for bs in (1, 2, 16):
        dec = exact_match(CHAT, recs, batch_size=bs, generate=True)
        assert dec.hits == forced.hits and dec.correct == 2
        assert dec.replies[0] == dec.replies[1] == (REPLY,)  # the model's reply


def test_ids_past_the_tokenizer_are_never_chosen():
    """A model padded past its tokenizer (Qwen2.5: 151,936 rows, 151,665 tokens).

    Here the padded ids 258..263 score highest after every token; before, greedy
    chose one and decoding raised "token id 260 is outside the vocabulary".
    """
    t = np.random.default_rng(0).normal(size=(264, 264)).astype(np.float32)
    for a, b in itertools.pairwise([*ids("\n" + REPLY), END]):
        t[a, b] = 20.0
    t[:, 258:] = 30.0  # (264, 264): the padding outscores every real token
    padded = ChatModel(PosTableLM(), jnp.asarray(t), TOKENIZER, chat_template=CHATML)
    assert padded("Hi") == REPLY
    sampled = padded.reply("Hi", key=jax.random.key(0), temperature=1.0, top_k=8)
    assert sampled.text == REPLY  # the real chain's 20 beats the rest once masked
