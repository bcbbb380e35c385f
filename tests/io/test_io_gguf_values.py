"""GGUF values validated where they enter: hyperparameters, special ids, field types.

Each case rewrites one metadata field (or one tensor's type) of a tiny valid Llama
GGUF written by entrenar itself and checks the loader refuses it with a
`FormatError` (or `UnsupportedError`) naming the file and the key.
"""

import jax
import numpy as np
import pytest

from entrenar.data import load_fast_tokenizer
from entrenar.errors import FormatError, UnsupportedError
from entrenar.io import load_llama_gguf, load_tokenizer, read_gguf, save_llama_gguf
from entrenar.io.gguf_reader import GGUFField
from entrenar.io.gguf_reader import GGUFValueType as T
from entrenar.io.gguf_writer import GGUFTensor, tensor_from_array, write_gguf
from entrenar.nn import LlamaConfig

CONFIG = LlamaConfig(
    vocab_size=8,
    hidden_size=32,
    intermediate_size=32,
    num_layers=2,
    num_heads=2,
    num_kv_heads=1,
    max_position_embeddings=64,
)
TOKENIZER = {
    "tokenizer.ggml.model": GGUFField("gpt2", T.STRING),
    "tokenizer.ggml.pre": GGUFField("gpt2", T.STRING),
    "tokenizer.ggml.tokens": GGUFField(
        ["<s>", "</s>", "a", "b", "ab", "\u0120", "c", "<pad>"], T.ARRAY, T.STRING
    ),
    "tokenizer.ggml.token_type": GGUFField([3, 3, 1, 1, 1, 1, 1, 3], T.ARRAY, T.INT32),
    "tokenizer.ggml.merges": GGUFField(["a b"], T.ARRAY, T.STRING),
    "tokenizer.ggml.bos_token_id": GGUFField(0, T.UINT32),
    "tokenizer.ggml.eos_token_id": GGUFField(1, T.UINT32),
    "tokenizer.ggml.padding_token_id": GGUFField(7, T.UINT32),
}


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A tiny Q8_0 Llama with a tokenizer: the GGUFFile every case rewrites."""
    d = tmp_path_factory.mktemp("gguf")
    params = jax.tree_util.tree_map(np.asarray, CONFIG.init(jax.random.key(0)))
    save_llama_gguf(d / "plain.gguf", CONFIG, params, tensor_type="Q8_0")
    g = read_gguf(d / "plain.gguf")
    write_gguf(d / "base.gguf", {**g.fields, **TOKENIZER}, _tensors(g))
    return read_gguf(d / "base.gguf")


def _tensors(g, **retyped):
    out = {n: GGUFTensor(g.raw(n), t.shape, t.type_id) for n, t in g.tensors.items()}
    return out | retyped


def _rewrite(base, path, fields=None, tensors=None):
    write_gguf(path, {**base.fields, **(fields or {})}, tensors or _tensors(base))
    return str(path)


def test_the_base_file_loads(base):
    config, _, _ = load_llama_gguf(base)
    assert (config.rope_theta, config.num_layers) == (10000.0, 2)
    tok = load_fast_tokenizer(base)
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (0, 1, 7)


F32, U32, U64 = T.FLOAT32, T.UINT32, T.UINT64
HYPER = [
    ("llama.rope.freq_base", float("nan"), F32),
    ("llama.rope.freq_base", 0.0, F32),
    ("llama.rope.freq_base", -1.0, F32),
    ("llama.rope.freq_base", float("inf"), F32),
    ("llama.attention.layer_norm_rms_epsilon", float("nan"), F32),
    ("llama.attention.layer_norm_rms_epsilon", -1.0, F32),
    ("llama.attention.layer_norm_rms_epsilon", 0.0, F32),
    ("llama.context_length", 2**63, U64),
    ("llama.context_length", 0, U32),
    ("llama.attention.head_count", 2**40, U64),
    ("llama.attention.head_count_kv", 3, U32),  # 2 heads: not a multiple
    ("llama.attention.key_length", 2**20, U32),
    ("llama.block_count", 1.5, F32),
    ("llama.embedding_length", True, T.BOOL),
]


@pytest.mark.parametrize(("key", "value", "vtype"), HYPER)
def test_bad_hyperparameters_are_format_errors_naming_file_and_key(
    base, tmp_path, key, value, vtype
):
    path = _rewrite(base, tmp_path / "bad.gguf", {key: GGUFField(value, vtype)})
    with pytest.raises(FormatError) as e:
        load_llama_gguf(path)
    assert str(e.value).startswith(path)
    assert key in str(e.value) or "inconsistent" in str(e.value)


@pytest.mark.parametrize(("value", "ok"), [(2**31 - 1, True), (2**31, False)])
def test_a_key_without_its_own_limit_is_below_2_to_the_31(tmp_path, value, ok):
    """As `check_config_values` has a config's integers: in ``[0, 2**31)``."""
    from entrenar.io.gguf_meta import INT_LIMITS, meta_int

    key = "llama.expert_count"
    assert key.split(".", 1)[1] not in INT_LIMITS
    path = tmp_path / "m.gguf"
    write_gguf(path, {key: GGUFField(value, U32)}, {})
    g = read_gguf(path)
    if ok:
        assert meta_int(g, key) == value
        return
    with pytest.raises(
        FormatError, match=rf"m\.gguf: metadata '{key}' = {value} is over"
    ):
        meta_int(g, key)


def test_an_odd_head_dimension_is_inconsistent(base, tmp_path):
    fields = {
        "llama.attention.key_length": GGUFField(15, U32),
        "llama.rope.dimension_count": GGUFField(15, U32),
    }
    path = _rewrite(base, tmp_path / "odd.gguf", fields)
    with pytest.raises(FormatError, match=r"inconsistent llama\.\* metadata"):
        load_llama_gguf(path)


def test_partial_rotary_is_unsupported(base, tmp_path):
    fields = {"llama.rope.dimension_count": GGUFField(8, U32)}  # head_dim is 16
    path = _rewrite(base, tmp_path / "rope.gguf", fields)
    with pytest.raises(UnsupportedError, match=r"llama\.rope\.dimension_count"):
        load_llama_gguf(path)


TOKEN_FIELDS = [
    ("tokenizer.ggml.bos_token_id", GGUFField(8, U32), "outside the vocabulary"),
    ("tokenizer.ggml.eos_token_id", GGUFField(2**32 - 1, U32), "outside"),
    ("tokenizer.ggml.padding_token_id", GGUFField("7", T.STRING), "want an integer"),
    ("tokenizer.ggml.padding_token_id", GGUFField(-1, T.INT32), "outside"),
    ("tokenizer.ggml.unknown_token_id", GGUFField(100, U32), "outside"),
    ("tokenizer.ggml.token_type", GGUFField(1, T.INT32), "want an array"),
    (
        "tokenizer.ggml.token_type",
        GGUFField(["1"] * 8, T.ARRAY, T.STRING),
        "want int",
    ),
    ("tokenizer.ggml.merges", GGUFField([1, 2], T.ARRAY, T.INT32), "want str"),
    ("tokenizer.ggml.tokens", GGUFField(3, U32), "want an array"),
    (
        "tokenizer.ggml.pre",
        GGUFField(["gpt2"], T.ARRAY, T.STRING),
        "not a UTF-8 string",
    ),
    ("tokenizer.ggml.add_bos_token", GGUFField("yes", T.STRING), "not a boolean"),
    (  # invalid UTF-8 bytes, which the reader keeps as lone surrogates
        "tokenizer.ggml.tokens",
        GGUFField(
            ["<s>", "</s>", "a", "b", "ab", "\u0120", "c", "\udcff"], T.ARRAY, T.STRING
        ),
        "[7] = '\\udcff' is not valid UTF-8",
    ),
    ("tokenizer.ggml.merges", GGUFField(["a \udcff"], T.ARRAY, T.STRING), "UTF-8"),
    ("tokenizer.chat_template", GGUFField("\udcff", T.STRING), "not a UTF-8 string"),
]


@pytest.mark.parametrize(("key", "field", "message"), TOKEN_FIELDS)
@pytest.mark.parametrize("loader", [load_tokenizer, load_fast_tokenizer])
def test_bad_tokenizer_fields_are_format_errors_naming_file_and_key(
    base, tmp_path, key, field, message, loader
):
    path = _rewrite(base, tmp_path / "tok.gguf", {key: field})
    with pytest.raises(FormatError) as e:
        loader(path)
    assert str(e.value).startswith(f"{path}: {key}")
    assert message in str(e.value)


def test_layers_of_mixed_types_load_layer_by_layer(base, tmp_path):
    """llama.cpp's mixes (Q4_K_M) store some layers in another type."""
    name = "blk.1.attn_q.weight"
    f32 = tensor_from_array(base.tensor(name), "F32")
    path = _rewrite(
        base, tmp_path / "mixed.gguf", tensors=_tensors(base, **{name: f32})
    )
    assert {
        read_gguf(path).tensors[f"blk.{i}.attn_q.weight"].type_name for i in (0, 1)
    } == {
        "Q8_0",
        "F32",
    }
    for keep in (False, True):
        _, mixed, _ = load_llama_gguf(path, keep_quantized=keep)
        _, plain, _ = load_llama_gguf(base)
        got = mixed["model"]["layers"]["self_attn"]["q_proj"]["weight"]
        want = plain["model"]["layers"]["self_attn"]["q_proj"]["weight"]
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
