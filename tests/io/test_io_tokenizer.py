"""BPE tokenizer from GGUF fields against llama.cpp and Hugging Face `tokenizers`."""

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from entrenar.errors import UnsupportedError
from entrenar.io import BPETokenizer, load_tokenizer, read_gguf, smollm2_path
from entrenar.io.tokenizer import gpt2_split, pre_tokenize

WORDS = """the of and to in is was for on that with as by at from his an were are which
this be has had it not or have one they first its after new who but two been their
Paris München naïve café résumé façade Straße coöperate jalapeño""".split()
SAMPLES = [
    "Hello world",
    "Hello, world! How are you doing today?",
    "I'm sure you're right; we've seen they'll do it, he'd say. 'S 'LL",
    "   leading spaces",
    "trailing spaces   ",
    "a\n\nb\t\tc\r\nd",
    "x = 12345 + 3.14159 - 0.5e-10",
    "2024-01-15 12:30:45 and 1,000,000 people",
    "def f(x):\n    return x ** 2  # square\n",
    "for (int i = 0; i < n; ++i) { sum += a[i]; }",
    "import numpy as np\nprint(np.arange(10).reshape(2, 5))",
    '<div class="main">Hello &amp; welcome</div>',
    "Ünïcödé 日本語のテキスト 中文 한국어 Ελληνικά русский עברית العربية",
    "emoji 😀👍🏽 🇪🇸 ok ❤️",
    "١٢٣ ४५६ digits ²³ ½ Ⅻ",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n",
    "<|endoftext|><repo_name>x<file_sep>",
    "  \n  ",
    "",
    " ",
    "x\u00a0y\u3000z\u2009w",
    "\u0301combining e\u0301",
    "tab\tsep\vvt\fff",
    "$$$ !!! ??? ... --- ___ ***",
    "https://example.com/path?q=1&r=two#frag",
    "CamelCaseWord snake_case_word kebab-case-word",
]


def _corpus() -> list[str]:
    rng = random.Random(0)
    out = list(SAMPLES)
    pieces = [
        *WORDS,
        " ",
        "  ",
        "\n",
        "\t",
        "0",
        "42",
        "3.5",
        ",",
        ".",
        "'s",
        "!?",
        "é",
        "日本",
        "😀",
        "<|im_start|>",
        "()",
        "{}",
        "=>",
        "\u00a0",
        "'",
        "''",
    ]
    for _ in range(300):
        out.append("".join(rng.choice(pieces) for _ in range(rng.randint(1, 12))))
    return out


CORPUS = _corpus()


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(smollm2_path())


@pytest.fixture(scope="module")
def llama_vocab():
    llama_cpp = pytest.importorskip("llama_cpp")
    return llama_cpp.Llama(smollm2_path(), vocab_only=True, verbose=False)


@pytest.fixture(scope="module")
def hf_tok(tok):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {t: i for i, t in enumerate(tok.tokens)}
    merges = [tuple(m.split(" ", 1)) for m in tok.merges]
    t = Tokenizer(models.BPE(vocab, merges))
    t.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    return t


@pytest.mark.slow
@pytest.mark.parametrize("special", [False, True])
def test_matches_llama_cpp(tok, llama_vocab, special):
    assert len(CORPUS) > 300
    for s in CORPUS:
        ref = llama_vocab.tokenize(s.encode("utf-8"), add_bos=False, special=special)
        assert tok.encode(s, special=special) == ref, s


@pytest.mark.slow
def test_matches_hf_tokenizers(tok, hf_tok):
    for s in CORPUS:
        if "<|" in s or "<repo" in s:  # specials are plain text for both here
            continue
        assert tok.encode(s) == hf_tok.encode(s).ids, s


@pytest.mark.slow
@given(
    st.text(st.characters(codec="utf-8", exclude_categories=["Cs", "Cn"]), max_size=40)
)
def test_random_text_matches_llama_cpp(tok, llama_vocab, s):
    ref = llama_vocab.tokenize(s.encode("utf-8"), add_bos=False, special=False)
    assert tok.encode(s) == ref


@pytest.mark.slow
def test_decode_inverts_encode(tok):
    for s in CORPUS[:100]:
        assert tok.decode(tok.encode(s)) == s
    ids = tok.encode("<|im_start|>user", special=True)
    assert ids[0] == 1 and tok.decode(ids) == "user"
    assert tok.decode(ids, special=True) == "<|im_start|>user"


@given(st.text(max_size=30))
def test_gpt2_split_matches_regex(s):
    regex = pytest.importorskip("regex")
    pat = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+"
    pat += r"|\s+(?!\S)|\s+"
    # llama.cpp's whitespace set differs from the regex module's \s on a few
    # control characters; compare on text without them.
    s = "".join(c for c in s if c.isprintable() or c in " \t\n")
    assert gpt2_split(s) == regex.findall(pat, s)
    assert "".join(gpt2_split(s)) == s


def test_pre_tokenize_and_errors():
    assert pre_tokenize("a 12", "smollm") == ["a", " ", "1", "2"]
    assert pre_tokenize("a 12", "gpt2") == ["a", " 12"]
    with pytest.raises(UnsupportedError, match="llama-bpe"):
        pre_tokenize("x", "llama-bpe")
    with pytest.raises(UnsupportedError, match="'llama'"):
        BPETokenizer.from_gguf_metadata({"tokenizer.ggml.model": "llama"})


@pytest.mark.slow
def test_tokenizer_fields_come_from_gguf(tok):
    md = read_gguf(smollm2_path()).metadata
    assert tok.tokens[:3] == ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
    assert len(tok.merges) == len(md["tokenizer.ggml.merges"]) == 48900
    assert (tok.bos_id, tok.eos_id, tok.add_bos, tok.pre) == (1, 2, False, "smollm")
