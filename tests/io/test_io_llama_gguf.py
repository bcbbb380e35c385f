"""SmolLM2 from its GGUF: logits vs plain numpy and llama.cpp; writing it back."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from np_llama import llama_forward

from entrenar.errors import FormatError
from entrenar.io import (
    load_llama_gguf,
    load_tokenizer,
    permute_qk,
    read_gguf,
    save_llama_gguf,
    smollm2_path,
    unpermute_qk,
)
from entrenar.nn import LlamaConfig
from entrenar.quant import QuantizedWeight
from entrenar.tree import tree_named_leaves

PROMPTS = ["The capital of France is", "def add(a, b):\n    return", "Once upon a"]


@pytest.fixture(scope="module")
def smol():
    path = smollm2_path()
    g = read_gguf(path)
    config, params, info = load_llama_gguf(g)
    return path, g, config, params, info, load_tokenizer(g)


@pytest.fixture(scope="module")
def llama_cpp_model():
    llama_cpp = pytest.importorskip("llama_cpp")
    return llama_cpp.Llama(smollm2_path(), logits_all=True, n_ctx=64, verbose=False)


def _llama_cpp_logits(ll, ids):
    ll.reset()
    ll.eval(ids)
    return np.array(ll.scores[: len(ids)])


def _random_params(config):
    rng = np.random.default_rng(0)
    return jax.tree_util.tree_map(
        lambda s: jnp.asarray(0.1 * rng.standard_normal(s), jnp.float32),
        config.param_shapes(),
        is_leaf=lambda x: isinstance(x, tuple),
    )


def _stepwise(step, config, params, ids, n=0):
    """Logits ``(T, V)`` of ``ids`` and ``n`` greedy tokens after them.

    One token per cached step and a fixed cache length: one compiled shape for all.
    """
    assert len(ids) + n <= 32
    cache = config.init_cache(1, 32)
    logits_all, out = [], []
    for i in range(len(ids) + n - 1 if n else len(ids)):
        tok = ids[i] if i < len(ids) else out[-1]
        logits, cache = step(params, jnp.asarray([[tok]], jnp.int32), cache)
        logits_all.append(np.asarray(logits[0, -1]))
        if n and i >= len(ids) - 1:
            out.append(int(np.argmax(logits_all[-1])))
    return np.stack(logits_all), out


@pytest.fixture(scope="module")
def step(smol):
    return jax.jit(smol[2].apply_cached)


@pytest.fixture(scope="module")
def qparams(smol):
    _, g, *_ = smol
    return load_llama_gguf(g, keep_quantized=True)[1]


def test_permutation_inverts_and_moves_rows():
    w = np.arange(8 * 3).reshape(8, 3)  # 2 heads of d=4
    p = permute_qk(w, 2)
    # GGUF row h*d + 2i + j is HF row h*d + j*d/2 + i.
    assert [r // 3 for r in p[:, 0]] == [0, 2, 1, 3, 4, 6, 5, 7]
    np.testing.assert_array_equal(unpermute_qk(p, 2), w)
    stacked = np.stack([w, w + 100])
    np.testing.assert_array_equal(unpermute_qk(permute_qk(stacked, 2), 2), stacked)


@pytest.mark.slow
def test_config_and_tree(smol):
    _, _, config, params, info, _ = smol
    ref = LlamaConfig.smollm2_135m()
    for f in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads"):
        assert getattr(config, f) == getattr(ref, f)
    assert config.tie_word_embeddings and "lm_head" not in params
    shapes = jax.tree_util.tree_map(lambda a: a.shape, params)
    assert shapes == jax.tree_util.tree_map(
        tuple, config.param_shapes(), is_leaf=lambda x: isinstance(x, tuple)
    )
    assert info["tokenizer.ggml.pre"] == "smollm"


@pytest.mark.slow
def test_logits_match_numpy_forward_and_llama_cpp(smol, step, llama_cpp_model):
    _, _, config, params, _, tok = smol
    ids = tok.encode(PROMPTS[0])
    ours, _ = _stepwise(step, config, params, ids)
    ref = llama_forward(config, params, ids)  # float64, same dequantized weights
    np.testing.assert_allclose(ours, ref, rtol=0, atol=2e-3)
    cpp = _llama_cpp_logits(llama_cpp_model, ids)  # quantized matmuls inside
    np.testing.assert_array_equal(ours.argmax(-1), cpp.argmax(-1))
    assert np.abs(ours - cpp).max() < 3.0
    assert np.corrcoef(ours[-1], cpp[-1])[0, 1] > 0.995
    assert tok.decode([int(ours[-1].argmax())]) == " Paris"


@pytest.mark.slow
def test_greedy_continuation_matches_llama_cpp(smol, step, llama_cpp_model):
    _, _, config, params, _, tok = smol
    for prompt in PROMPTS[:2]:
        ids = tok.encode(prompt)
        _, ours = _stepwise(step, config, params, ids, 6)
        ll = llama_cpp_model
        ll.reset()
        ll.eval(ids)
        cpp = []
        for _ in range(6):
            cpp.append(int(np.argmax(ll.scores[ll.n_tokens - 1])))
            ll.eval([cpp[-1]])
        # llama.cpp rounds activations to 8 bits in its quantized matmuls, so long
        # greedy paths may part where two tokens are nearly tied.
        assert ours[:4] == cpp[:4], (prompt, tok.decode(ours), tok.decode(cpp))
        text = tok.decode(ours)
        assert sum(c.isascii() for c in text) >= 0.9 * len(text), text


@pytest.mark.slow
def test_keep_quantized_gives_same_logits(smol, step, qparams):
    _, _, config, params, _, tok = smol
    q = qparams["model"]["layers"]["self_attn"]["q_proj"]["weight"]
    assert isinstance(q, QuantizedWeight) and q.scheme == "q4_1"
    assert q.shape == (30, 576, 576)
    ids = tok.encode(PROMPTS[1])[:3]
    ours_q, _ = _stepwise(step, config, qparams, ids)
    ours, _ = _stepwise(step, config, params, ids)
    np.testing.assert_allclose(ours_q, ours, rtol=0, atol=1e-3)


@pytest.mark.slow
def test_write_back_quantized_is_bit_identical(smol, qparams, tmp_path):
    _, g, config, _, _, _ = smol
    out = tmp_path / "smol.gguf"
    save_llama_gguf(
        out, config, qparams, source=g, tensor_type="Q4_1", embedding_type="Q8_0"
    )
    back = read_gguf(out)
    assert set(back.tensors) == set(g.tensors)
    for name, t in g.tensors.items():
        assert back.tensors[name].type_id == t.type_id, name
        np.testing.assert_array_equal(back.raw(name), g.raw(name), name)
    assert back.fields == g.fields  # values and types, all 33 keys
    assert list(back.tensors) == list(g.tensors)  # llama.cpp's order


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["F32", "Q4_0"])  # Q8_0, Q4_1: bit-identical test
def test_tiny_llama_written_runs_in_llama_cpp(smol, tmp_path, kind):
    llama_cpp = pytest.importorskip("llama_cpp")
    _path, g, *_ = smol
    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        max_position_embeddings=64,
    )
    params = _random_params(config)
    out = tmp_path / f"tiny-{kind}.gguf"
    save_llama_gguf(
        out, config, params, source=g, tensor_type=kind, embedding_type="F16"
    )
    config2, back, _ = load_llama_gguf(out)
    assert config2.num_kv_heads == 2 and not config2.tie_word_embeddings
    tol = {"F32": 0.0, "F16": 1e-3}.get(kind, 0.05)
    for (name, a), (_, b) in zip(tree_named_leaves(params), tree_named_leaves(back)):
        t = 1e-3 if "embed" in name or "lm_head" in name else tol  # F16
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=t, err_msg=name)
    ids = [504, 3575, 282, 4649, 314, 17, 9]
    ours = np.asarray(config2.apply(back, jnp.asarray([ids], jnp.int32))[0])
    ll = llama_cpp.Llama(str(out), logits_all=True, n_ctx=32, verbose=False)
    cpp = _llama_cpp_logits(ll, ids)
    # llama.cpp quantizes activations to 8 bits for quantized matmuls.
    np.testing.assert_allclose(cpp, ours, atol=1e-3 if kind.startswith("F") else 2e-2)


def test_loader_rejects_inconsistent_metadata(tmp_path, smol):
    from entrenar.io import GGUFField, GGUFTensor, GGUFValueType, write_gguf

    _, g, *_ = smol
    fields = dict(g.fields)
    tensors = {
        n: GGUFTensor(g.raw(n), t.shape, t.type_id)
        for n, t in list(g.tensors.items())[:12]
    }
    write_gguf(tmp_path / "bad.gguf", fields, tensors)
    with pytest.raises(FormatError, match=r"bad\.gguf: tensor '.*' is missing"):
        load_llama_gguf(tmp_path / "bad.gguf")
    fields["llama.attention.head_count"] = GGUFField(0, GGUFValueType.UINT32)
    write_gguf(tmp_path / "bad.gguf", fields, tensors)
    with pytest.raises(FormatError, match="head_count"):
        load_llama_gguf(tmp_path / "bad.gguf")
