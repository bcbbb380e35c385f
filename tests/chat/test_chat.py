"""ChatModel: template, special tokens, end of turn, streaming, length, exact match."""

import dataclasses
import itertools
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from entrenar.chat import ChatModel, end_of_turn_ids, exact_match, stream_text
from entrenar.errors import ConfigError, ShapeError
from entrenar.io import BPETokenizer, HFTokenizer
from entrenar.io.tokenizer import bytes_to_unicode
from entrenar.nn import generate

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "io"))
import hf_cases

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
B2U = bytes_to_unicode()
START, END = 256, 257  # <|im_start|>, <|im_end|>
TOKENIZER = BPETokenizer(
    tokens=(*(B2U[b] for b in range(256)), "<|im_start|>", "<|im_end|>"),
    merges=(),
    token_types=(1,) * 256 + (3, 3),
    eos_id=END,
)


@dataclasses.dataclass(frozen=True)
class TableLM:
    """A real (if tiny) causal LM: the next token's logits depend on the last token."""

    max_position_embeddings: int = 64

    def apply(self, table, tokens):
        return table[tokens]  # (B, T, V)

    def init_cache(self, batch, max_len):
        return jnp.zeros((), jnp.int32)

    def apply_cached(self, table, tokens, cache):
        return table[tokens], cache + tokens.shape[1]


def table(chain):
    """Random logits, except that ``a -> b`` for each pair of ``chain`` wins."""
    t = np.random.default_rng(0).normal(size=(258, 258)).astype(np.float32)
    for a, b in itertools.pairwise(chain):
        t[a, b] = 20.0
    return jnp.asarray(t)


# After "assistant\n" the model says "OKé" (é is two bytes) and ends the turn.
REPLY = [ord("\n"), ord("O"), ord("K"), 0xC3, 0xA9, END]
CHAT = ChatModel(TableLM(), table(REPLY), TOKENIZER, chat_template=CHATML)


def test_prompt_is_the_template_with_control_tokens_parsed():
    ids = CHAT.encode("Hi")
    text = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert CHAT.render("Hi") == text
    assert ids.count(START) == 2 and ids.count(END) == 1  # one token each
    assert ids == TOKENIZER.encode(text, special=True)
    assert len(TOKENIZER.encode(text)) == len(text.encode())  # as plain text: bytes


def test_reply_stops_at_the_end_of_turn_token():
    r = CHAT.reply("Hi")
    assert r.text == "OKé" and r.finish_reason == "stop"
    assert r.token_ids == (ord("O"), ord("K"), 0xC3, 0xA9, END)
    assert end_of_turn_ids(TOKENIZER) == (END,)
    short = CHAT.reply("Hi", max_new_tokens=2)
    assert short.text == "OK" and short.finish_reason == "length"
    # The library default of nn.generate without stop tokens runs to the limit.
    ids = jnp.asarray([CHAT.encode("Hi")], jnp.int32)
    assert generate(CHAT.model, CHAT.params, ids, max_new_tokens=8).shape == (1, 8)


def test_the_generation_config_eos_ids_end_a_reply(tmp_path):
    """Llama 3's folder lists <|end_of_text|> and <|eot_id|>; EOS is <|eot_id|>."""
    hf_cases.write_tokenizer(tmp_path, "llama")
    tok = HFTokenizer.from_folder(tmp_path)
    end_of_text, eot = (tok.tokens.index(t) for t in ("<|end_of_text|>", "<|eot_id|>"))
    assert tok.eos_id == eot and set(end_of_turn_ids(tok)) == {eot, end_of_text}
    prompt = tok.encode("Hi")
    # The model says " fox" and then <|end_of_text|>.
    chain = [prompt[-1], *tok.encode(" fox")[1:], end_of_text]
    assert len(set(chain)) == len(chain)
    t = np.random.default_rng(0).normal(size=(len(tok.tokens),) * 2)
    for a, b in itertools.pairwise(chain):
        t[a, b] = 20.0
    chat = ChatModel(TableLM(), jnp.asarray(t, jnp.float32), tok)
    r = chat.reply("Hi", chat=False, max_new_tokens=20)
    assert r.text == " fox" and r.finish_reason == "stop"
    assert r.token_ids[-1] == end_of_text


def test_llama31_eom_id_ends_a_turn():
    tok = BPETokenizer(
        tokens=(*TOKENIZER.tokens, "<|eot_id|>", "<|eom_id|>"),
        merges=(), token_types=(*TOKENIZER.token_types, 3, 3), eos_id=258,
    )  # fmt: skip
    assert end_of_turn_ids(tok) == (258, END, 259)


def test_stream_yields_whole_characters_and_joins_to_the_reply():
    pieces = list(CHAT.stream("Hi"))
    assert pieces == ["O", "K", "é"]  # the lone 0xC3 byte is held back
    assert "".join(pieces) == CHAT("Hi")


def test_logprobs_are_the_decodings_and_stream_as_they_come():
    """``logprobs=k``: the raw log-softmax of each step's logits, stream or whole."""
    reply = CHAT.reply("Hi", logprobs=2)
    prev = [ord("\n"), *reply.token_ids[:-1]]  # the token before each one
    z = np.asarray(CHAT.params, np.float64)[prev]  # (N, V) the table's rows
    want = z - np.log(np.exp(z).sum(-1, keepdims=True))
    n = np.arange(len(prev))
    np.testing.assert_allclose(reply.logprobs.logprobs, want[n, list(reply.token_ids)],
                               atol=1e-5)  # fmt: skip
    np.testing.assert_array_equal(reply.logprobs.top_ids[:, 0], reply.token_ids)
    stream = CHAT.stream_reply("Hi", logprobs=2)
    for _ in stream:  # each piece's tokens are scored when it comes
        got = stream.logprobs(0, len(stream.ids))
        np.testing.assert_array_equal(got.logprobs, reply.logprobs.logprobs[n < len(
            stream.ids)])  # fmt: skip
    assert stream.reply == reply
    np.testing.assert_array_equal(stream.reply.logprobs.top_ids, reply.logprobs.top_ids)
    both = CHAT.replies(["Hi", "Yo"], logprobs=0)  # one length: TableLM has no pos
    assert both[0] == reply and both[0].logprobs.top_ids.shape == (len(prev), 0)
    np.testing.assert_array_equal(both[0].logprobs.logprobs, reply.logprobs.logprobs)
    assert len(both[1].logprobs.logprobs) == len(both[1].token_ids)
    assert CHAT.reply("Hi").logprobs is None
    with pytest.raises(ConfigError, match="logprobs"):
        CHAT.stream_reply("Hi").logprobs(0, 1)


def test_a_batched_reply_cut_by_a_stop_string_ends_at_its_token():
    """Rows go on after one stops at a stop string: its reply keeps no padding."""
    prompts = ["a\n", "zz"]  # row 0 says "OK" and stops at "K"; row 1 goes on
    both = CHAT.replies(prompts, chat=False, stop=["K"], max_new_tokens=8, logprobs=1)
    for prompt, got in zip(prompts, both):
        alone = CHAT.reply(prompt, chat=False, stop=["K"], max_new_tokens=8)
        assert got == alone and len(got.logprobs.logprobs) == len(got.token_ids)
    assert both[0].token_ids == (ord("O"), ord("K"))


@pytest.mark.parametrize("style", ["mistral", "gemma"])
def test_byte_fallback_tokens_stream_as_the_full_decode(style, tmp_path):
    """A stream of <0xNN> tokens joins to their full decode.

    SentencePiece's byte tokens decode a run at once: an unfinished character at
    its end turns the whole run into U+FFFD (transformers' ByteFallback), so the
    stream holds the run back until a token of text ends it. A control token (BOS
    here; ``<unk>``, ``<pad>``) decodes to nothing and the run goes on through it.
    """
    hf_cases.write_tokenizer(tmp_path, style)
    tok = HFTokenizer.from_folder(tmp_path)
    byte = [tok.tokens.index(f"<0x{b:02X}>") for b in range(256)]
    word = tok.encode(" fox")[-1]
    for text in ("日本", "😀€"):
        whole = [byte[b] for b in text.encode()]
        cut = whole + [byte[b] for b in text[0].encode()[:2]]  # a character cut short
        skipped = [byte[ord("A")], tok.bos_id, *cut]  # was "A" then U+FFFD x 3
        for ids in (whole, [*whole, word], cut, [*cut, word], [word, *cut], skipped):
            pieces = list(stream_text(tok, [np.asarray([i]) for i in ids]))
            assert "".join(pieces) == tok.decode(ids), (text, ids, pieces)
            assert "\ufffd" not in "".join(pieces[:-1])  # only the last may hold it


def test_a_stop_string_of_byte_tokens_ends_the_row(tmp_path):
    """The euro sign is three <0xNN> tokens: U+FFFD U+FFFD, then one shorter "€".

    The row must stop at the token that completes it, not run to the limit.
    """
    hf_cases.write_tokenizer(tmp_path, "mistral")
    tok = HFTokenizer.from_folder(tmp_path)
    prompt = tok.encode(" fox")
    reply = [tok.tokens.index(f"<0x{b:02X}>") for b in "€".encode()]
    chain = [prompt[-1], *reply, *tok.encode("ok the")[1:]]
    t = np.random.default_rng(0).normal(size=(len(tok.tokens),) * 2)
    for a, b in itertools.pairwise(chain):
        t[a, b] = 20.0
    chat = ChatModel(TableLM(), jnp.asarray(t, jnp.float32), tok)
    r = chat.reply(" fox", chat=False, stop=["€"], max_new_tokens=10)
    assert r.token_ids == tuple(reply) and r.text == "" and r.finish_reason == "stop"


def test_a_request_beyond_the_context_is_refused_up_front():
    n = len(CHAT.encode("Hi"))
    with pytest.raises(ShapeError, match=f"context of 64 tokens.*at most {64 - n}"):
        CHAT.stream("Hi", max_new_tokens=64)  # raises before the first token
    with pytest.raises(ShapeError, match="context"):
        CHAT.reply("Hi", max_new_tokens=9000)
    assert CHAT.reply("Hi", max_new_tokens=64 - n).finish_reason == "stop"
    # The default is capped by what is left of the context.
    never = ChatModel(TableLM(), table([ord("\n"), ord("O"), ord("O")]), TOKENIZER,
                      chat_template=CHATML)  # fmt: skip
    r = never.reply("Hi")
    assert r.finish_reason == "length" and len(r.token_ids) == 64 - n


def record(reply):
    return {"messages": [{"role": "user", "content": "Hi"},
                         {"role": "assistant", "content": reply}]}  # fmt: skip


def test_exact_match_agrees_with_greedy_replies():
    recs = [record("OKé"), record("OK"), record("NO"), record("OKé")]
    em = exact_match(CHAT, recs, batch_size=3)
    greedy = [CHAT.reply(r["messages"][:-1]) for r in recs]
    want = [g.text == r["messages"][1]["content"] and g.finish_reason == "stop"
            for g, r in zip(greedy, recs)]  # fmt: skip
    assert list(em.hits) == want == [True, False, False, True]
    assert (em.correct, em.total, em.accuracy) == (2, 4, 0.5)


def test_plain_text_continuation_skips_the_template():
    ids = CHAT.encode("a\n", chat=False)
    assert ids == [ord("a"), ord("\n")]
    r = CHAT.reply("a\n", chat=False)  # after "\n" the table says "OKé", then EOS
    assert r.text == "OKé" and r.finish_reason == "stop" and r.prompt_tokens == 2
    assert "".join(CHAT.stream("a\n", chat=False)) == "OKé"
    with pytest.raises(ConfigError, match="plain text"):
        CHAT.reply([{"role": "user", "content": "Hi"}], chat=False)


def test_an_empty_plain_prompt_is_refused_up_front():
    """Before: "prompt must be (batch, time>=1), got (1, 0)" at the first token."""
    with pytest.raises(ConfigError, match=r"^the prompt '' gives no tokens; give"):
        CHAT.stream("", chat=False)  # raises before the first token
    assert CHAT.encode("Hi", chat=False) == [ord("H"), ord("i")]
