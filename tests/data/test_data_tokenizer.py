"""FastTokenizer (Hugging Face tokenizers) gives the reference BPETokenizer's ids."""

import random
import signal

import pytest
from hypothesis import given
from hypothesis import strategies as st

from entrenar.data import FastTokenizer, token_bytes
from entrenar.errors import FormatError, UnsupportedError
from entrenar.io import BPETokenizer, load_tokenizer, smollm2_path
from entrenar.io.tokenizer import bytes_to_unicode, gpt2_split

pytest.importorskip("tokenizers")


SAMPLES = [
    "Hello, world! How are you doing today?",
    "I'm sure you're right; we've seen they'll do it, he'd say. 'S 'LL",
    "   leading spaces",
    "trailing spaces   ",
    "a\n\nb\t\tc\r\nd",
    "x = 12345 + 3.14159 - 0.5e-10, 2024-01-15 12:30:45",
    "def f(x):\n    return x ** 2  # square\n",
    "Ünïcödé 日本語のテキスト 中文 한국어 Ελληνικά русский עברית العربية",
    "emoji 😀👍🏽 🇪🇸 ok ❤️ ١٢٣ ४५६ ²³ ½ Ⅻ",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n",
    "<|endoftext|><repo_name>x<file_sep>",
    "x\u00a0y\u3000z\u2009w \u0301combining e\u0301 tab\tsep\vvt\fff",
    "",
    " ",
    "  \n  ",
]
PIECES = [*"the of and to in is München naïve café".split(), " ", "  ", "\n", "\t",
          "0", "42", "3.5", ",", "'s", "!?", "é", "日本", "😀", "<|im_start|>", "'",
          "\u00a0", "=>"]  # fmt: skip


def _corpus() -> list[str]:
    rng = random.Random(0)
    return SAMPLES + [
        "".join(rng.choice(PIECES) for _ in range(rng.randint(1, 12)))
        for _ in range(300)
    ]


# Any Unicode text but lone surrogates (not encodable, so not text to tokenize).
TEXT = st.text(st.characters(exclude_categories=["Cs"]), max_size=40)
TOY_PIECES = [*"ab 12'\n\t.,é日😀", "'s", "  ", "the", "hello"]
ASCIIISH = st.lists(st.sampled_from(TOY_PIECES), max_size=12).map("".join)


# ---------------------------------------------------------------- a toy vocabulary
def _toy() -> BPETokenizer:
    """Every byte, some merges (including a space-word and digits), two specials."""
    b2u = bytes_to_unicode()
    tokens = [b2u[b] for b in range(256)]
    merges = ["Ġ t", "h e", "Ġt he", "1 2", "l l", "e ll", "h ell", "hell o", "' s"]
    for m in merges:
        tokens.append(m.replace(" ", ""))
    tokens += ["<|end|>", "<user>"]
    types = [1] * (len(tokens) - 2) + [3, 4]
    return BPETokenizer(tuple(tokens), tuple(merges), tuple(types), pre="gpt2",
                        bos_id=len(tokens) - 2, eos_id=len(tokens) - 2)  # fmt: skip


TOY = _toy()
TOY_FAST = FastTokenizer(TOY)


@given(TEXT)
def test_toy_random_text(s):
    assert TOY_FAST.encode(s) == TOY.encode(s)


@given(st.lists(st.one_of(ASCIIISH, st.sampled_from(["<|end|>", "<user>"]))))
def test_toy_specials(parts):
    s = "".join(parts)
    for special in (False, True):
        assert TOY_FAST.encode(s, special=special) == TOY.encode(s, special=special)
    assert TOY_FAST.encode(s, add_bos=True) == TOY.encode(s, add_bos=True)


def test_toy_cases():
    for s in ["the hello 12 12345 it's", "  the\n\n the", "hello<|end|>the<user>x"]:
        for special in (False, True):
            assert TOY_FAST.encode(s, special=special) == TOY.encode(s, special=special)
    ids = TOY.encode("hello<|end|><user>", special=True)
    assert ids[-2:] == [TOY.tokens.index("<|end|>"), TOY.tokens.index("<user>")]
    assert TOY_FAST.decode(ids) == TOY.decode(ids) == "hello<user>"
    assert TOY_FAST.decode(ids, special=True) == "hello<|end|><user>"
    with pytest.raises(FormatError, match="outside the vocabulary"):
        TOY_FAST.decode([10**6])


def test_a_long_word_merges_in_bounded_time():
    """50 kB without a space is one piece; its merges once took O(n^2) (minutes)."""

    def too_slow(*_):
        raise TimeoutError("BPETokenizer.encode of a 50 kB word took over 20 s")

    s = "hello" * 10_000 + "\u00e9\u65e5" * 5_000
    old = signal.signal(signal.SIGALRM, too_slow)
    signal.setitimer(signal.ITIMER_REAL, 20)
    try:
        ids = TOY.encode(s)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    assert ids == TOY_FAST.encode(s)
    assert TOY.decode(ids) == s


def test_no_merge_across_a_byte_without_a_token():
    """llama.cpp drops a byte with no token (SmolLM2 lacks 0x16) after merging.

    So no merge crosses it (llama.cpp's ids: tests/io/test_tokenizer_variants.py).
    """
    b2u = bytes_to_unicode()
    tokens = [b2u[b] for b in range(256) if b != 0x16] + ['"{']
    tok = BPETokenizer(tuple(tokens), ('" {',), (1,) * len(tokens))
    for s in ['"\x16{', 'a"\x16{', '"{"\x16{ \x16"{']:
        assert FastTokenizer(tok).encode(s) == tok.encode(s), s
    assert tok.encode('"\x16{') == [tokens.index('"'), tokens.index("{")]


def test_a_lone_surrogate_is_a_clear_error():
    r"""A JSON '\ud83d' alone: tokenizers said only 'TextInputSequence must be str'."""
    with pytest.raises(FormatError, match=r"text 0 .* lone surrogate U\+D800 at char"):
        TOY_FAST.encode("a\ud800")
    with pytest.raises(FormatError, match=r"text 1 .* lone surrogate U\+D83D"):
        TOY_FAST.encode_batch(["ok", "a\ud83d"])
    with pytest.raises(FormatError, match=r"lone surrogate U\+D800"):  # not CESU-8 ids
        TOY.encode("a\ud800")


def test_token_bytes_add_up():
    table = token_bytes(TOY.tokens, TOY.token_types)
    s = "the héllo 12 <|end|> 😀"
    ids = TOY.encode(s, special=True)
    assert b"".join(table[i] for i in ids) == s.encode()


def test_bad_vocabularies():
    bad = BPETokenizer(("a", "b"), ("a c",), (1, 1))
    with pytest.raises(FormatError, match=r"merges\[0\] 'a c'"):
        FastTokenizer(bad)
    with pytest.raises(UnsupportedError, match="llama-bpe"):
        FastTokenizer(BPETokenizer(("a",), (), (1,), pre="llama-bpe"))


# ------------------------------------------------------------------ SmolLM2's one
@pytest.fixture(scope="module")
def ref():
    return load_tokenizer(smollm2_path())


@pytest.fixture(scope="module")
def fast():
    return FastTokenizer.from_gguf(smollm2_path())


@pytest.mark.slow
@pytest.mark.parametrize("special", [False, True])
def test_smollm2_corpus(ref, fast, special):
    corpus = _corpus()
    assert len(corpus) > 300
    for s in corpus:
        assert fast.encode(s, special=special) == ref.encode(s, special=special), s
    assert fast.encode_batch(corpus, special=special) == [
        ref.encode(s, special=special) for s in corpus
    ]


@pytest.mark.slow
@given(TEXT)
def test_smollm2_random_text(ref, fast, s):
    assert fast.encode(s) == ref.encode(s)


@pytest.mark.slow
@given(st.lists(st.one_of(TEXT, st.sampled_from(["<|im_start|>", "<|im_end|>"]))))
def test_smollm2_random_chat_text(ref, fast, parts):
    s = "".join(parts)
    assert fast.encode(s, special=True) == ref.encode(s, special=True)
    assert fast.encode(s, special=False) == ref.encode(s, special=False)


@pytest.mark.slow
@given(st.lists(st.integers(0, 49151), max_size=12))
def test_smollm2_decode(ref, fast, ids):
    for special in (False, True):
        assert fast.decode(ids, special=special) == ref.decode(ids, special=special)


@pytest.mark.slow
def test_smollm2_fields(ref, fast):
    ids = fast.encode("<|im_start|>user\nHi<|im_end|>", special=True)
    assert (
        ids[0] == 1
        and ids[-1] == 2
        and ids == ref.encode("<|im_start|>user\nHi<|im_end|>", special=True)
    )
    assert (fast.bos_id, fast.eos_id, fast.pad_id, fast.vocab_size) == (1, 2, 2, 49152)
    assert fast.chat_template.startswith("{% for message in messages %}")


def test_unassigned_code_points_split_like_punctuation():
    # llama.cpp flags unassigned code points UNDEFINED, which its GPT-2 regex takes
    # in ``[^\s\p{L}\p{N}]+`` (tests/io/test_tokenizer_variants.py checks the ids);
    # U+0378 is unassigned, U+1123F a letter since Unicode 15 (Python 3.11: Cn).
    for s in ["x\u0378's", " \u0378\u0378!", "a\u0378b", "\u0378 \u0378"]:
        assert TOY_FAST.encode(s) == TOY.encode(s)
    assert gpt2_split("x\u0378's") == ["x", "\u0378'", "s"]
    assert gpt2_split("a\U0001123fb.") == ["a\U0001123fb", "."]


@given(TEXT, TEXT)
def test_labels_cover_exactly_the_completion(prompt, completion):
    from entrenar.data import encode_records

    for tok in (TOY, TOY_FAST):
        [(ids, labels)] = encode_records(
            [{"prompt": prompt, "completion": completion}], tok,
            format="prompt_completion",
        )  # fmt: skip
        table = token_bytes(TOY.tokens, TOY.token_types)
        trained = labels != -100
        # Context tokens come first, then only trained ones (completion + EOS).
        k = len(trained) - int(trained.sum())
        assert not trained[:k].any() and trained[k:].all()
        head = b"".join(table[i] for i in ids[:k])
        tail = b"".join(table[i] for i in ids[k:-1])
        p, c = prompt.encode(), completion.encode()
        assert head + tail == p + c and p.startswith(head)
        if c:  # the first trained token reaches into the completion
            assert len(head) + len(table[ids[k]]) > len(p)
        else:  # only the EOS is trained
            assert k == len(ids) - 1
