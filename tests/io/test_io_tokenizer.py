"""BPE tokenizer from GGUF fields against llama.cpp and Hugging Face `tokenizers`.

llama.cpp's token ids are recorded in tests/data/llama_cpp_reference.json (how: see
test_io_llama_gguf.py and tests/oracles/make_llama_cpp_reference.py, which made them
with llama-cpp-python 0.3.36): every string of the corpus with and without special
tokens, and 200 random Unicode strings drawn once with hypothesis. The "live" variant
runs llama.cpp now, in a subprocess.
"""

import pytest
from hypothesis import given
from hypothesis import strategies as st
from llama_cpp_cases import corpus, reference

from entrenar.errors import UnsupportedError
from entrenar.io import BPETokenizer, load_tokenizer, read_gguf, smollm2_path
from entrenar.io.tokenizer import gpt2_split, pre_tokenize

CORPUS = corpus()
RANDOM_TEXT = st.text(
    st.characters(codec="utf-8", exclude_categories=["Cs", "Cn"]), max_size=40
)


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(smollm2_path())


@pytest.fixture(
    scope="module", params=["recorded", pytest.param("live", marks=pytest.mark.slow)]
)
def llama_tokens(request):
    """llama.cpp's ids: ``{"corpus": [[s, ids, ids_special]], "random_text": ...}``."""
    return reference(request.param)[0]["tokens"]


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
def test_matches_llama_cpp(tok, llama_tokens, special):
    assert [c[0] for c in llama_tokens["corpus"]] == CORPUS  # recorded for this corpus
    assert len(CORPUS) == 326
    for s, ids, ids_special in llama_tokens["corpus"]:
        assert tok.encode(s, special=special) == (ids_special if special else ids), s


@pytest.mark.slow
def test_matches_hf_tokenizers(tok, hf_tok):
    for s in CORPUS:
        if "<|" in s or "<repo" in s:  # specials are plain text for both here
            continue
        assert tok.encode(s) == hf_tok.encode(s).ids, s


@pytest.mark.slow
def test_random_text_matches_llama_cpp(tok, llama_tokens):
    assert len(llama_tokens["random_text"]) >= 150
    for s, ids in llama_tokens["random_text"]:
        assert tok.encode(s) == ids, s


@pytest.mark.slow
@given(RANDOM_TEXT)
def test_random_text_matches_hf_tokenizers(tok, hf_tok, s):
    assert tok.encode(s) == hf_tok.encode(s).ids


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
