"""Q4_K_M-style GGUFs kept as stored: mixed-type layers, quantized embedding and head.

References are independent of the code under test: `entrenar.io.ggml_dequant`'s
numpy decoders (bit for bit ``gguf.quants``) for the values, and the dense float32
model of the same file (``load_llama_gguf`` without ``keep_quantized``) for the
products, gradients, losses and a QLoRA step.
"""

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from entrenar import lora
from entrenar.io import load_llama_gguf, read_gguf
from entrenar.io.ggml_dequant import GGML_TYPE_IDS, dequantize_ggml
from entrenar.lora import LoRAConfig
from entrenar.nn import LlamaConfig
from entrenar.nn.layers import embedding
from entrenar.nn.linear import linear
from entrenar.nn.losses import chunked_causal_lm_loss
from entrenar.nn.weight_node import logical_shape, to_dense
from entrenar.quant import GGMLWeight
from entrenar.quant.ggml_mixed import MixedGGMLWeight, mixed_ggml_weight
from entrenar.tree import assert_trees_allclose

sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))
import scale_models

RNG = np.random.default_rng(0)
MAKERS = {k: make for k, (_, make) in scale_models.BLOCKS.items()}
PER_BLOCK = {k: per for k, (per, _) in scale_models.BLOCKS.items()}


def layer_bytes(kind: str, rows: int, cols: int) -> np.ndarray:
    """Random valid ``kind`` bytes of a ``(rows, cols)`` tensor, flat uint8."""
    return MAKERS[kind](rows * cols // PER_BLOCK[kind], RNG).reshape(-1)


def reference(raw: np.ndarray, kind: str, rows: int, cols: int) -> np.ndarray:
    return dequantize_ggml(raw, GGML_TYPE_IDS[kind], (rows, cols))


@pytest.mark.parametrize(
    "types", [("Q4_K", "Q6_K", "Q6_K"), ("Q4_0", "Q8_0", "Q4_0")], ids=str
)
def test_mixed_layers_decode_as_gguf_and_multiply_as_the_dense_matrix(types):
    rows, cols = 8, 512
    layers = [(layer_bytes(t, rows, cols), t) for t in types]
    w = mixed_ggml_weight(layers, (len(types), rows, cols))
    assert logical_shape(w) == (len(types), rows, cols)
    dense = np.stack([reference(raw, t, rows, cols) for raw, t in layers])
    np.testing.assert_array_equal(np.asarray(to_dense(w)), dense)
    x = jnp.asarray(RNG.standard_normal((3, cols), np.float32))
    for i in range(len(types)):  # one layer, as the model's scan indexes it

        def f(x, w):
            return jnp.sum(jnp.sin(linear(x, w)))

        y, gx = jax.jit(jax.value_and_grad(f))(x, w[i])
        y_ref, gx_ref = jax.value_and_grad(f)(x, jnp.asarray(dense[i]))
        np.testing.assert_allclose(y, y_ref, rtol=1e-5)
        np.testing.assert_allclose(gx, gx_ref, rtol=1e-5, atol=1e-6)


def test_mixed_weight_refuses_types_it_cannot_decode():
    from entrenar.errors import FormatError

    with pytest.raises(FormatError, match="Q5_0"):
        mixed_ggml_weight([(np.zeros(22, np.uint8), "Q5_0")], (1, 1, 32))
    with pytest.raises(FormatError, match="multiple of 256"):
        mixed_ggml_weight([(np.zeros(144, np.uint8), "Q4_K")], (1, 1, 32))


def test_embedding_decodes_the_looked_up_rows_of_a_kquant_table():
    vocab, d = 16, 256
    raw = layer_bytes("Q4_K", vocab, d)
    table = GGMLWeight(jnp.asarray(raw.reshape(vocab, -1)), "Q4_K")
    tokens = jnp.asarray([[3, 0, 15], [7, 7, 1]])
    dense = reference(raw, "Q4_K", vocab, d)
    got = jax.jit(embedding)(table, tokens)
    np.testing.assert_array_equal(np.asarray(got), dense[np.asarray(tokens)])


@pytest.mark.parametrize("kind", ["Q6_K", "Q4_K"])
def test_quantized_head_loss_and_input_gradient_equal_the_dense_head(kind):
    vocab, d = 1024, 256
    raw = layer_bytes(kind, vocab, d)
    head = GGMLWeight(jnp.asarray(raw.reshape(vocab, -1)), kind)
    dense = jnp.asarray(reference(raw, kind, vocab, d))
    h = jnp.asarray(RNG.standard_normal((2, 9, d), np.float32))
    labels = jnp.asarray(RNG.integers(0, vocab, (2, 9))).at[0, 4].set(-100)
    mask = jnp.ones((2, 9), bool).at[1, 2].set(False)

    def loss(h, w):
        return chunked_causal_lm_loss(h, w, labels, chunk=4, loss_mask=mask)

    value, grad = jax.jit(jax.value_and_grad(loss))(h, head)
    value_ref, grad_ref = jax.value_and_grad(loss)(h, dense)
    np.testing.assert_allclose(value, value_ref, rtol=1e-6)
    np.testing.assert_allclose(grad, grad_ref, rtol=1e-5, atol=1e-8)


TINY = LlamaConfig(
    vocab_size=512, hidden_size=256, intermediate_size=512, num_layers=2,
    num_heads=4, num_kv_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5,
)  # fmt: skip
"""Every matrix whole K-quant super-blocks; layer 1 gets Q6_K attn_v / ffn_down."""


@pytest.fixture(scope="module")
def q4_k_m_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("q4km") / "tiny-q4_k_m.gguf"
    scale_models.write_gguf(str(path), TINY)
    return str(path)


def test_q4_k_m_gguf_loads_kept_as_written(q4_k_m_gguf):
    _, kept, _ = load_llama_gguf(q4_k_m_gguf, keep_quantized=True)
    _, dense, _ = load_llama_gguf(q4_k_m_gguf)
    m = kept["model"]
    assert isinstance(m["embed_tokens"]["weight"], GGMLWeight)
    assert kept["lm_head"]["weight"].ggml_type == "Q6_K"
    down = m["layers"]["mlp"]["down_proj"]["weight"]
    assert isinstance(down, MixedGGMLWeight) and down.types == ("Q4_K", "Q6_K")
    assert np.asarray(down.kind).tolist() == [0, 1]  # llama.cpp's use_more_bits
    g = read_gguf(q4_k_m_gguf)  # each layer's bytes packed at the start of its room
    for i, t in enumerate(down.types):
        stored = np.asarray(g.raw(f"blk.{i}.ffn_down.weight")).reshape(-1)
        assert g.tensors[f"blk.{i}.ffn_down.weight"].type_name == t
        room = np.asarray(down.data[i]).reshape(-1)  # (rows * row_bytes_max,)
        np.testing.assert_array_equal(room[: stored.size], stored)
        assert not room[stored.size :].any() and (i == 1) == (stored.size == room.size)
    kept_dense = jax.tree_util.tree_map(
        to_dense, kept, is_leaf=lambda x: isinstance(x, GGMLWeight | MixedGGMLWeight)
    )
    assert_trees_allclose(kept_dense, dense, rtol=0, atol=0)
    std = float(
        np.std(np.asarray(dense["model"]["layers"]["mlp"]["up_proj"]["weight"]))
    )
    assert 0.015 < std < 0.025  # the writer's scales give Llama-like weights
    qlora = lora.apply(  # quantize_base: nf4 keeps the file's blocks
        kept, LoRAConfig(rank=2, targets="all-linear"), key=jax.random.key(0),
        quantize="nf4",
    )  # fmt: skip
    assert qlora["model"]["layers"]["mlp"]["down_proj"]["weight"].base is down


def test_qlora_step_on_a_q4_k_m_gguf_equals_the_dequantized_model(q4_k_m_gguf):
    """Embedding rows, mixed layers and the head's one-pass loss, end to end."""
    config, kept, _ = load_llama_gguf(q4_k_m_gguf, keep_quantized=True)
    _, dense, _ = load_llama_gguf(q4_k_m_gguf)
    cfg = LoRAConfig(rank=4, alpha=8, targets="all-linear")
    tokens = jax.random.randint(jax.random.key(2), (2, 12), 0, TINY.vocab_size)

    def step(base):
        params = lora.apply(base, cfg, key=jax.random.key(3))
        params = jax.tree_util.tree_map(  # B != 0, so the bases' input-grads count
            lambda w: w.replace(b=w.b + 0.01) if isinstance(w, lora.LoRAWeight) else w,
            params,
            is_leaf=lambda w: isinstance(w, lora.LoRAWeight),
        )
        trainable, frozen = lora.split(params)

        def loss(t):
            p = lora.combine(t, frozen)
            h = config.features(p, tokens)
            return chunked_causal_lm_loss(h, config.output_weight(p), tokens, chunk=8)

        value, grads = jax.jit(jax.value_and_grad(loss))(trainable)
        updated = jax.tree_util.tree_map(lambda p, g: p - 0.1 * g, trainable, grads)
        return value, grads, jax.jit(loss)(updated)

    loss_k, grads_k, after_k = step(kept)
    loss_d, grads_d, after_d = step(dense)
    np.testing.assert_allclose(loss_k, loss_d, rtol=1e-6)
    assert_trees_allclose(grads_k, grads_d, rtol=1e-4, atol=1e-7)
    np.testing.assert_allclose(after_k, after_d, rtol=1e-6)
    assert float(after_k) != float(loss_k)


def test_hf_folder_of_the_writer_loads_with_its_tokenizer(tmp_path):
    """The bfloat16 folder: sharded, indexed, its config and a cut tokenizer."""
    from entrenar.io import HFTokenizer, load_hf_folder

    folder = tmp_path / "tiny-bf16"
    old = scale_models.SHARD_BYTES
    scale_models.SHARD_BYTES = 1 << 20  # several shards of the tiny model
    try:
        scale_models.write_hf_folder(str(folder), TINY)
    finally:
        scale_models.SHARD_BYTES = old
    hf, params = load_hf_folder(folder)
    assert len(hf.files) > 1 and hf.config.vocab_size == TINY.vocab_size
    assert hf.config.num_layers == TINY.num_layers
    up = np.asarray(params["model"]["layers"]["mlp"]["up_proj"]["weight"], np.float32)
    assert up.shape == (2, 512, 256) and 0.019 < float(np.std(up)) < 0.021
    tok = HFTokenizer.from_folder(folder)
    ids = tok.encode("Write 2024-01-05 as words")
    assert ids and max(ids) < TINY.vocab_size  # the tokenizer is cut to the vocab


def test_shapes_are_the_peer_scripts_presets():
    peer = (
        Path(__file__).parents[3] / "shared" / "bench" / "peers" / "torch_llama_lora.py"
    )
    if not peer.exists():
        pytest.skip(f"{peer} is not in this checkout")
    import ast

    tree = ast.parse(peer.read_text())
    presets = next(
        ast.literal_eval(node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Assign)
        and any(getattr(t, "id", None) == "PRESETS" for t in node.targets)
    )
    assert presets == scale_models.SHAPES


def test_read_into_gives_the_mapped_bytes_and_checks_the_size(q4_k_m_gguf):
    from entrenar.errors import FormatError
    from entrenar.io import read_gguf

    g = read_gguf(q4_k_m_gguf)
    for name, t in g.tensors.items():
        out = g.read_into(name, np.empty(t.nbytes, np.uint8))
        np.testing.assert_array_equal(out, np.asarray(g.raw(name)), err_msg=name)
    name, t = next(iter(g.tensors.items()))
    with pytest.raises(FormatError, match=f"{name!r} has {t.nbytes} bytes"):
        g.read_into(name, np.empty(t.nbytes + 1, np.uint8))
