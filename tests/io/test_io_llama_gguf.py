"""SmolLM2 from its GGUF: logits vs plain numpy and llama.cpp; writing it back.

llama.cpp is a recorded oracle here: nothing in this file loads it into the pytest
process. Its answers lie in tests/data/llama_cpp_reference.json and
tests/data/llama_cpp_logits.npz, made with llama-cpp-python 0.3.36 built with
CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX512=ON -DGGML_AMX_INT8=OFF -DGGML_AMX_TILE=OFF
-DGGML_AMX_BF16=OFF" on an Intel Xeon (the default build crashes there, in decode, with
AMX) by ``python tests/oracles/make_llama_cpp_reference.py --out tests/data
--cmake-args "$CMAKE_ARGS"`` (the JSON's "how" records all this). Each comparison also
runs "live": the same script in a subprocess, skipped with the reason when llama_cpp is
not installed or the subprocess dies from a signal (test_io_llama_cpp_oracle.py).
"""

import hashlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from llama_cpp_cases import PROMPTS, TINY_IDS, reference, tiny_config, tiny_params
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
    unpermuted_rows,
)
from entrenar.nn import LlamaConfig
from entrenar.quant import QuantizedWeight
from entrenar.tree import tree_named_leaves


@pytest.fixture(scope="module")
def smol():
    path = smollm2_path()
    g = read_gguf(path)
    config, params, info = load_llama_gguf(g)
    return path, g, config, params, info, load_tokenizer(g)


@pytest.fixture(
    scope="module", params=["recorded", pytest.param("live", marks=pytest.mark.slow)]
)
def cpp(request):
    """llama.cpp's answers: (JSON record, arrays), recorded or computed now."""
    return reference(request.param)


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
    view = unpermuted_rows(p, 2)  # (2, 2, 2, 3): the same rows, no copy
    assert view.base is not None and np.shares_memory(view, p)
    np.testing.assert_array_equal(view.reshape(8, 3), w)


def test_a_load_does_not_decode_the_vocabulary():
    """The tokens and merges are decoded when read (the tokenizer), not by a load."""
    g = read_gguf(smollm2_path())
    _, _, info = load_llama_gguf(g, keep_quantized=True)
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges"):
        assert "not decoded yet" in repr(g.fields[key])
    assert len(info["tokenizer.ggml.tokens"]) == 49152  # read: decoded now
    assert "not decoded yet" not in repr(g.fields["tokenizer.ggml.tokens"])
    assert load_tokenizer(g).encode("Hello world") == [19556, 905]


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
def test_logits_match_numpy_forward_and_llama_cpp(smol, step, cpp):
    _, _, config, params, _, tok = smol
    record, arrays = cpp
    ids = tok.encode(PROMPTS[0])
    assert ids == record["prompts"][0]["ids"]  # llama.cpp's own tokenization
    ours, _ = _stepwise(step, config, params, ids)
    ref = llama_forward(config, params, ids)  # float64, same dequantized weights
    np.testing.assert_allclose(ours, ref, rtol=0, atol=2e-3)
    ll = arrays["prompt0_logits"].astype(np.float32)  # (T, V); quantized matmuls
    np.testing.assert_array_equal(ours.argmax(-1), ll.argmax(-1))
    assert np.abs(ours - ll).max() < 3.0
    assert np.corrcoef(ours[-1], ll[-1])[0, 1] > 0.995
    assert tok.decode([int(ours[-1].argmax())]) == " Paris"


@pytest.mark.slow
def test_greedy_continuation_matches_llama_cpp(smol, step, cpp):
    _, _, config, params, _, tok = smol
    record, arrays = cpp
    for i, prompt in enumerate(PROMPTS[:2]):
        ids = tok.encode(prompt)
        assert ids == record["prompts"][i]["ids"]
        logits, ours = _stepwise(step, config, params, ids, 6)
        ll = record["prompts"][i]["greedy"]
        # llama.cpp rounds activations to 8 bits in its quantized matmuls, so long
        # greedy paths may part where two tokens are nearly tied.
        assert ours[:4] == ll[:4], (prompt, tok.decode(ours), tok.decode(ll))
        # Along the shared path, our logits of llama.cpp's 8 best tokens are close.
        for j in range(4):
            top = arrays[f"greedy{i}_top_ids"][j]
            mine = logits[len(ids) - 1 + j, top]
            np.testing.assert_allclose(
                mine, arrays[f"greedy{i}_top_logits"][j], rtol=0, atol=1.0
            )
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
def test_tiny_llama_written_runs_in_llama_cpp(smol, tmp_path, kind, cpp):
    _path, g, *_ = smol
    record, arrays = cpp
    config = tiny_config()
    params = tiny_params(config)  # exact in F16 and Q4_0: same file on every machine
    out = tmp_path / f"tiny-{kind}.gguf"
    save_llama_gguf(
        out, config, params, source=g, tensor_type=kind, embedding_type="F16"
    )
    config2, back, _ = load_llama_gguf(out)
    assert config2.num_kv_heads == 2 and not config2.tie_word_embeddings
    for (name, a), (_, b) in zip(tree_named_leaves(params), tree_named_leaves(back)):
        np.testing.assert_array_equal(np.asarray(b), np.asarray(a), err_msg=name)
    ours = np.asarray(config2.apply(back, jnp.asarray([TINY_IDS], jnp.int32))[0])
    # llama.cpp quantizes activations to 8 bits for quantized matmuls.
    tol = 1e-3 if kind.startswith("F") else 2e-2
    cols = arrays["tiny_cols"]  # every 16th token of the vocabulary
    np.testing.assert_allclose(ours[:, cols], arrays[f"tiny_{kind}_logits"], atol=tol)
    top = arrays[f"tiny_{kind}_top_ids"]  # (T, 8): llama.cpp's best tokens
    mine = np.take_along_axis(ours, top, axis=-1)
    np.testing.assert_allclose(mine, arrays[f"tiny_{kind}_top_logits"], atol=tol)
    assert (ours.max(-1) - mine[:, 0] <= tol).all()  # nothing of ours beats them
    # llama.cpp's answers hold for the very bytes it ran: the writer's output must not
    # have changed since they were recorded (else rerun tests/oracles/...).
    digest = hashlib.sha256(out.read_bytes()).hexdigest()
    assert digest == record["tiny"][kind]["sha256"], (
        f"{out.name} differs from the file llama.cpp ran; if the writer changed on "
        "purpose, rerun tests/oracles/make_llama_cpp_reference.py"
    )


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
