"""`load_llama_gguf(keep_quantized=True)` keeps a Q8_0/Q4_0/Q4_1 embedding as stored.

A tiny Llama is written with `save_llama_gguf(..., tensor_type=kind)` (embedding and
``lm_head`` in ``kind`` too), tied and untied. The kept tree is compared with the
dequantized load of the same file (`load_llama_gguf` without ``keep_quantized``), an
independent decoder (`entrenar.io.ggml_dequant`, numpy).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from entrenar import lora, nn
from entrenar.io import load_llama_gguf, read_gguf, save_llama_gguf
from entrenar.io.gguf_reader import GGUFFile
from entrenar.lora import LoRAConfig
from entrenar.nn import TiedEmbedding, to_bfloat16_weights
from entrenar.quant import QuantizedWeight, dequantize
from entrenar.quant.matvec import QuantizedTiedEmbedding, quantize_tied_head
from entrenar.train.model_loss import causal_lm_loss_fn
from entrenar.tree import assert_trees_allclose

CONFIG = nn.LlamaConfig(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    max_position_embeddings=32,
)
EMBED = "model.embed_tokens.weight"


def _config(tied: bool, matmul_dtype: str | None = None) -> nn.LlamaConfig:
    return dataclasses.replace(
        CONFIG, tie_word_embeddings=tied, matmul_dtype=matmul_dtype
    )


@pytest.fixture(scope="module", params=["Q8_0", "Q4_0", "Q4_1"])
def kind(request):
    return request.param


@pytest.fixture(scope="module", params=[True, False], ids=["tied", "untied"])
def tied(request):
    return request.param


@pytest.fixture(scope="module")
def gguf(tmp_path_factory, kind, tied):
    cfg = _config(tied)
    path = tmp_path_factory.mktemp("kept") / f"tiny-{kind}-{tied}.gguf"
    save_llama_gguf(path, cfg, cfg.init(jax.random.key(0)), tensor_type=kind)
    return str(path)


def _bits(a) -> np.ndarray:
    return np.asarray(a, np.float32).view(np.uint32)


def test_the_embedding_and_head_are_kept_as_stored(gguf, kind, tied):
    config, kept, _ = load_llama_gguf(gguf, keep_quantized=True)
    _, dense, _ = load_llama_gguf(gguf)
    names = [("model", "embed_tokens")] + ([] if tied else [("lm_head",)])
    for keys in names:
        w, ref = kept, dense
        for k in (*keys, "weight"):
            w, ref = w[k], ref[k]
        assert isinstance(w, QuantizedWeight) and w.scheme == kind.lower(), keys
        np.testing.assert_array_equal(_bits(dequantize(w)), _bits(ref))
    assert config.tie_word_embeddings == tied
    # the non-streaming reference load keeps the same node
    _, whole, _ = load_llama_gguf(gguf, keep_quantized=True, stream=False)
    assert_trees_allclose(whole, kept, rtol=0, atol=0)


def test_kept_logits_equal_the_dequantized_tree(gguf):
    config, kept, _ = load_llama_gguf(gguf, keep_quantized=True)
    _, dense, _ = load_llama_gguf(gguf)
    tokens = jax.random.randint(jax.random.key(1), (2, 9), 0, CONFIG.vocab_size)
    got = jax.jit(config.apply)(kept, tokens)  # (2, 9, V)
    want = jax.jit(config.apply)(dense, tokens)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("kind", "matmul_dtype"),
    [("Q8_0", None), ("Q8_0", "bfloat16"), ("Q4_0", "bfloat16"), ("Q4_1", "bfloat16")],
    indirect=["kind"],
)  # one float32 step per tiedness is enough
def test_a_qlora_step_equals_the_dequantized_trees(gguf, kind, tied, matmul_dtype):
    """One SGD step of LoRA on the kept base, frozen half as the Trainer reads it.

    Under bfloat16 matmuls the frozen half goes through `to_bfloat16_weights`
    (the Trainer's ``_compute_frozen``): a tied kept embedding becomes a
    `TiedEmbedding` of the node, with the head the dense table would have.
    """
    _, kept, _ = load_llama_gguf(gguf, keep_quantized=True)
    _, dense, _ = load_llama_gguf(gguf)
    cfg = _config(tied, matmul_dtype)
    loss_fn = causal_lm_loss_fn(cfg)
    tokens = jax.random.randint(jax.random.key(2), (2, 12), 0, CONFIG.vocab_size)
    lcfg = LoRAConfig(rank=4, alpha=8, targets=("q_proj", "v_proj"))

    def step(base):
        params = lora.apply(base, lcfg, key=jax.random.key(3))
        params = jax.tree_util.tree_map(  # B != 0: the bases' input-grads count
            lambda w: w.replace(b=w.b + 0.01) if isinstance(w, lora.LoRAWeight) else w,
            params,
            is_leaf=lambda w: isinstance(w, lora.LoRAWeight),
        )
        trainable, frozen = lora.split(params)
        if matmul_dtype is not None:
            frozen = to_bfloat16_weights(frozen, tied_embedding=EMBED if tied else None)

        def loss(t):
            return loss_fn(lora.combine(t, frozen), {"input_ids": tokens}, key=None)[0]

        value, grads = jax.jit(jax.value_and_grad(loss))(trainable)
        updated = jax.tree_util.tree_map(lambda p, g: p - 0.1 * g, trainable, grads)
        after = jax.jit(loss)(updated)
        return frozen, value, grads, after

    frozen_k, loss_k, grads_k, after_k = step(kept)
    _, loss_d, grads_d, after_d = step(dense)
    if matmul_dtype is not None and tied:
        emb = frozen_k["model"]["embed_tokens"]["weight"]
        assert isinstance(emb, TiedEmbedding) and isinstance(emb.table, QuantizedWeight)
    np.testing.assert_allclose(loss_k, loss_d, rtol=1e-6)
    if matmul_dtype is not None and not tied:
        # the untied kept head: `ggml_head`'s one pass over the vocabulary, whose
        # gradient sums probabilities rounded to bfloat16, against the dense tree's
        # native softmax cross-entropy (``p - onehot`` rounded to bfloat16): apart
        # by bfloat16 rounding (2^-8) of each gradient's scale
        for a, b in zip(jax.tree.leaves(grads_k), jax.tree.leaves(grads_d)):
            assert np.abs(a - b).max() <= 1e-2 * np.abs(b).max()
        np.testing.assert_allclose(after_k, after_d, rtol=1e-4)
    else:  # the same head and rows: float32 rounding
        assert_trees_allclose(grads_k, grads_d, rtol=1e-4, atol=1e-6)
        np.testing.assert_allclose(after_k, after_d, rtol=1e-6)
    assert float(after_k) != float(loss_k)


@pytest.mark.parametrize("tied", [True], ids=["tied"], indirect=True)
def test_the_tied_head_is_read_in_the_embeddings_own_type(gguf, kind, tied):
    """`quantize_tied_head` leaves a kept Q* embedding as it is (llama.cpp's head)."""
    _, kept, _ = load_llama_gguf(gguf, keep_quantized=True)
    _, dense, _ = load_llama_gguf(gguf)
    table = kept["model"]["embed_tokens"]["weight"]
    head = quantize_tied_head(kept)["model"]["embed_tokens"]["weight"]
    assert head is table  # no copy, whatever the scheme asked
    wrapped = {"model": {"embed_tokens": {"weight": TiedEmbedding.from_array(table)}}}
    assert quantize_tied_head(wrapped)["model"]["embed_tokens"]["weight"] is table
    ref = quantize_tied_head(dense)["model"]["embed_tokens"]["weight"]
    assert isinstance(ref, QuantizedTiedEmbedding) and ref.head_t.scheme == "q8_0"
    if kind == "Q8_0":  # the dense table quantized back: the file's bytes
        np.testing.assert_array_equal(ref.head_t.codes, table.codes)
        np.testing.assert_array_equal(ref.head_t.scales, table.scales)
    tokens = jnp.array([[1, 2, 3]])
    config = _config(True)
    got = config.apply(quantize_tied_head(kept), tokens)
    want = config.apply(dense, tokens)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_a_kept_tree_writes_back_the_same_bytes(gguf, kind, tmp_path):
    config, kept, _ = load_llama_gguf(gguf, keep_quantized=True)
    out = tmp_path / "again.gguf"
    save_llama_gguf(out, config, kept, source=gguf, tensor_type=kind)
    src, back = read_gguf(gguf), read_gguf(out)
    assert set(back.tensors) == set(src.tensors)
    for name, t in src.tensors.items():
        assert back.tensors[name].type_id == t.type_id, name
        np.testing.assert_array_equal(back.raw(name), src.raw(name), name)
    # and in another type: the node's values requantized
    save_llama_gguf(tmp_path / "f32.gguf", config, kept, tensor_type="F32")
    _, f32, _ = load_llama_gguf(tmp_path / "f32.gguf")
    _, dense, _ = load_llama_gguf(gguf)
    assert_trees_allclose(f32, dense, rtol=0, atol=0)


def test_the_load_keeps_the_configs_order_and_the_non_streaming_tree(gguf):
    """Stacked leaves are filled a layer at a time, after the build: in their places."""

    def order(tree):
        if not isinstance(tree, dict):
            return None
        return [(k, order(v)) for k, v in tree.items()]

    config, streamed, _ = load_llama_gguf(gguf)
    _, whole, _ = load_llama_gguf(gguf, stream=False)
    assert order(streamed) == order(config.param_shapes())
    for a, b in zip(jax.tree.leaves(streamed), jax.tree.leaves(whole), strict=True):
        np.testing.assert_array_equal(_bits(a), _bits(b))


@pytest.mark.parametrize("keep", [True, False], ids=["kept", "dequantized"])
def test_the_layers_are_read_in_the_files_order(gguf, keep, monkeypatch):
    """Every leaf's layer i before any leaf's layer i + 1, as llama.cpp stores them."""
    seen: list[str] = []
    raw, read_into = GGUFFile.raw, GGUFFile.read_into

    def raw_(self, name):
        seen.append(name)
        return raw(self, name)

    def read_into_(self, name, *args, **kwargs):
        seen.append(name)
        return read_into(self, name, *args, **kwargs)

    monkeypatch.setattr(GGUFFile, "raw", raw_)
    monkeypatch.setattr(GGUFFile, "read_into", read_into_)
    config, _, _ = load_llama_gguf(gguf, keep_quantized=keep)
    layers = [int(n.split(".")[1]) for n in seen if n.startswith("blk.")]
    assert layers == sorted(layers)
    assert set(layers) == set(range(config.num_layers))
