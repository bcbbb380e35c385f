"""GGUF K-quant, BF16 and F16 bases kept as stored (`GGMLWeight`).

Values bit for bit against `gguf.quants.dequantize`; the blocked matmul and its
input-gradient against the dense float32 matmul; a QLoRA step on a tiny GGUF whose
projections are K-quants against the same step on its dequantized float32 model.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from entrenar import lora, native, nn
from entrenar.errors import FormatError, ShapeError
from entrenar.io import load_llama_gguf, read_gguf, save_llama_gguf
from entrenar.io.ggml_dequant import GGML_TYPE_IDS, dequantize_ggml
from entrenar.io.gguf_writer import GGUFTensor, write_gguf
from entrenar.io.llama_gguf import KEEP_QUANTIZED
from entrenar.lora import LoRAConfig
from entrenar.nn import LlamaConfig
from entrenar.nn.losses import causal_lm_loss
from entrenar.nn.weight_node import logical_dtype, logical_shape, nbytes, to_dense
from entrenar.quant import GGMLWeight, from_ggml, to_ggml
from entrenar.quant import linear as qlinear
from entrenar.quant.kquant import FORMATS
from entrenar.tree import assert_trees_allclose

TYPES = list(FORMATS)
HALF_AT = {"Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2)}
HALF_AT["Q6_K"] = (208,)
"""Byte offsets of each K-quant block's float16 scales (d, dmin)."""


def raw_blocks(kind: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """``(rows, row_bytes)`` GGUF bytes of ``kind``.

    The gguf package's quantizer where it has one (BF16, F16), else random bytes
    with finite, small float16 scales (it cannot quantize the K-quants).
    """
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((rows, cols)) * 0.1).astype(np.float32)
    try:
        return gguf_quantize(w, GGMLQuantizationType[kind]).view(np.uint8)
    except NotImplementedError:
        pass
    fmt = FORMATS[kind]
    raw = rng.integers(0, 256, (rows, cols // fmt.block_size, fmt.type_size), np.uint8)
    for at in HALF_AT[kind]:
        half = (rng.standard_normal(raw.shape[:2]) * 2e-4).astype(np.float16)
        raw[..., at : at + 2] = half[..., None].view(np.uint8)
    return raw.reshape(rows, -1)


def random_node(kind: str, rows: int, cols: int, seed: int = 0) -> GGMLWeight:
    node = from_ggml(raw_blocks(kind, rows, cols, seed), kind, (rows, cols))
    assert isinstance(node, GGMLWeight)
    return node


def bits(a) -> np.ndarray:
    return np.asarray(a, np.float32).view(np.uint32)


@pytest.mark.parametrize("kind", TYPES)
def test_values_equal_gguf_dequantize_bit_for_bit(kind):
    raw = raw_blocks(kind, 6, 512)
    want = gguf_dequantize(raw, GGMLQuantizationType[kind])  # (6, 512)
    node = from_ggml(raw, kind, (6, 512))
    assert isinstance(node, GGMLWeight)
    assert logical_shape(node) == (6, 512) and logical_dtype(node) == np.float32
    assert nbytes(node) == raw.size
    np.testing.assert_array_equal(bits(to_dense(node)), bits(want))
    np.testing.assert_array_equal(bits(jax.jit(to_dense)(node)), bits(want))
    # the numpy load path (entrenar.io) runs the same decoders
    numpy = dequantize_ggml(raw, GGML_TYPE_IDS[kind], (6, 512))
    np.testing.assert_array_equal(bits(numpy), bits(want))


@pytest.mark.parametrize("kind", TYPES)
def test_bytes_round_trip_and_stacked_layers_slice(kind):
    raw = raw_blocks(kind, 4, 256).reshape(2, 2, -1)
    node = from_ggml(raw, kind, (2, 2, 256))
    back, got_kind = to_ggml(node)
    assert got_kind == kind
    np.testing.assert_array_equal(back, raw.reshape(-1))
    np.testing.assert_array_equal(to_dense(node[1]), to_dense(node)[1])


def test_bad_bytes_and_shapes_are_refused():
    with pytest.raises(FormatError, match="needs 288 bytes"):
        from_ggml(np.zeros(287, np.uint8), "Q4_K", (2, 256))
    with pytest.raises(FormatError, match="multiple of 256"):
        from_ggml(np.zeros(144, np.uint8), "Q4_K", (2, 128))
    with pytest.raises(ShapeError, match="per layer"):
        nn.linear(jnp.ones((1, 256)), random_node("Q6_K", 4, 256)[None])


@pytest.mark.parametrize("kind", TYPES)
@pytest.mark.parametrize("matmul_dtype", [None, "bfloat16"])
def test_blocked_matmul_and_input_gradient_equal_the_dense_path(
    kind, matmul_dtype, monkeypatch
):
    monkeypatch.setattr(qlinear, "GGML_BLOCK_VALUES", 16 * 512)  # 4 blocks of rows
    node = random_node(kind, 64, 512, seed=1)
    dense = to_dense(node)  # (64, 512) float32
    x = jax.random.normal(jax.random.key(0), (3, 5, 512))
    g = jax.random.normal(jax.random.key(1), (3, 5, 64))

    def product(w):
        return jax.vjp(lambda x: nn.linear(x, w, matmul_dtype=matmul_dtype), x)

    (y, pull), (y_ref, pull_ref) = product(node), product(dense)
    tol = 1e-5 if matmul_dtype is None else 1e-2  # float32 / bfloat16 rounding
    scale = float(jnp.abs(y_ref).max())
    np.testing.assert_allclose(y, y_ref, rtol=0, atol=tol * scale)
    (dx,), (dx_ref,) = pull(g), pull_ref(g)
    scale = float(jnp.abs(dx_ref).max())
    np.testing.assert_allclose(dx, dx_ref, rtol=0, atol=tol * scale)
    assert y.dtype == dx.dtype == jnp.float32


def test_matmul_never_decodes_more_than_a_block_of_rows(monkeypatch):
    monkeypatch.setattr(qlinear, "GGML_BLOCK_VALUES", 8 * 256)
    node = random_node("Q4_K", 32, 256)
    with native.policy("jax"):  # the JAX path (few rows: a native kernel)
        jaxpr = str(jax.make_jaxpr(lambda x: nn.linear(x, node))(jnp.ones((2, 256))))
    assert "f32[8,256]" in jaxpr and "f32[32,256]" not in jaxpr


def test_compiled_product_and_gradient_hold_less_than_the_dense_matrix(monkeypatch):
    monkeypatch.setattr(qlinear, "GGML_BLOCK_VALUES", 8 * 1024)  # 8 of 128 rows
    node = random_node("Q6_K", 128, 1024)
    x = jnp.ones((4, 1024))

    def loss(x, w):  # w an argument: a closed-over node would be constant-folded
        return jnp.sum(nn.linear(x, w))

    def whole(x, w):
        return jnp.sum(x @ to_dense(w).T)

    def temp_bytes(f):
        memory = jax.jit(f).lower(x, node).compile().memory_analysis()
        if memory is None:  # a backend that does not report it
            pytest.skip("no memory analysis on this backend")
        return memory.temp_size_in_bytes

    dense_bytes = 128 * 1024 * 4
    assert temp_bytes(whole) >= dense_bytes  # the measure sees a dense matrix
    assert temp_bytes(loss) < dense_bytes / 4
    assert temp_bytes(jax.grad(loss)) < dense_bytes / 4


PROJECTION_TYPES = {
    "q_proj": "Q4_K",  # q/k rows are permuted on load: whole super-blocks move
    "k_proj": "Q5_K",
    "v_proj": "Q6_K",
    "o_proj": "Q2_K",
    "gate_proj": "Q3_K",
    "up_proj": "BF16",
    "down_proj": "F16",
}
GGUF_STEM = {
    "q_proj": "attn_q",
    "k_proj": "attn_k",
    "v_proj": "attn_v",
    "o_proj": "attn_output",
    "gate_proj": "ffn_gate",
    "up_proj": "ffn_up",
    "down_proj": "ffn_down",
}
CONFIG = LlamaConfig(
    vocab_size=16,
    hidden_size=256,
    intermediate_size=256,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    max_position_embeddings=32,
)


@pytest.fixture(scope="module")
def kquant_gguf(tmp_path_factory):
    """A tiny Llama GGUF whose projections are K-quant, BF16 and F16 tensors."""
    d = tmp_path_factory.mktemp("kquant")
    params = jax.tree_util.tree_map(np.asarray, CONFIG.init(jax.random.key(0)))
    save_llama_gguf(d / "f32.gguf", CONFIG, params)
    g = read_gguf(d / "f32.gguf")
    tensors = {
        n: GGUFTensor(g.raw(n), t.shape, t.type_id) for n, t in g.tensors.items()
    }
    for i, (hf, kind) in enumerate(PROJECTION_TYPES.items()):
        for layer in range(CONFIG.num_layers):
            name = f"blk.{layer}.{GGUF_STEM[hf]}.weight"
            shape = g.tensors[name].shape  # (out, in), numpy order
            raw = raw_blocks(kind, *shape, seed=10 * i + layer)
            tensors[name] = GGUFTensor(raw.reshape(-1), shape, GGML_TYPE_IDS[kind])
    write_gguf(d / "kquant.gguf", g.fields, tensors)
    return str(d / "kquant.gguf")


def test_keep_quantized_list_holds_the_kquant_and_float_types():
    assert set(FORMATS) <= set(KEEP_QUANTIZED)


def test_load_keeps_kquant_bases_equal_to_the_dequantized_load(kquant_gguf):
    _, kept, _ = load_llama_gguf(kquant_gguf, keep_quantized=True)
    _, dense, _ = load_llama_gguf(kquant_gguf)
    for hf, kind in PROJECTION_TYPES.items():
        group = (
            "self_attn"
            if hf.endswith(("q_proj", "k_proj", "v_proj", "o_proj"))
            else "mlp"
        )
        w = kept["model"]["layers"][group][hf]["weight"]
        ref = dense["model"]["layers"][group][hf]["weight"]
        assert isinstance(w, GGMLWeight) and w.ggml_type == kind, hf
        assert logical_shape(w) == ref.shape
        np.testing.assert_array_equal(bits(to_dense(w)), bits(ref), err_msg=hf)


@pytest.mark.parametrize("policy", ["jax", "auto"])
def test_qlora_step_on_kquant_bases_equals_the_dequantized_model(kquant_gguf, policy):
    """One QLoRA step through the kept bases equals the dequantized model's.

    ``auto``: 24 rows take the native decoding kernel (quant.matvec), whose sums
    run in another order; the gradients then differ by float32 rounding amplified
    through attention (measured up to 2e-5 on entries up to 0.2).
    """
    config, kept, _ = load_llama_gguf(kquant_gguf, keep_quantized=True)
    _, dense, _ = load_llama_gguf(kquant_gguf)
    cfg = LoRAConfig(rank=4, alpha=8, targets=tuple(PROJECTION_TYPES))
    tokens = jax.random.randint(jax.random.key(2), (2, 12), 0, CONFIG.vocab_size)

    def step(base):
        params = lora.apply(base, cfg, key=jax.random.key(3))
        params = jax.tree_util.tree_map(  # B != 0, so the bases' input-grads count
            lambda w: w.replace(b=w.b + 0.01) if isinstance(w, lora.LoRAWeight) else w,
            params,
            is_leaf=lambda w: isinstance(w, lora.LoRAWeight),
        )
        trainable, frozen = lora.split(params)

        def loss(t):
            logits = config.apply(lora.combine(t, frozen), tokens)
            return causal_lm_loss(logits, tokens)

        value, grads = jax.jit(jax.value_and_grad(loss))(trainable)
        updated = jax.tree_util.tree_map(lambda p, g: p - 0.1 * g, trainable, grads)
        return value, grads, jax.jit(loss)(updated)

    with native.policy(policy):
        loss_k, grads_k, after_k = step(kept)
    loss_d, grads_d, after_d = step(dense)
    np.testing.assert_allclose(loss_k, loss_d, rtol=1e-6)
    atol = 1e-6 if policy == "jax" else 5e-5
    assert_trees_allclose(grads_k, grads_d, rtol=1e-4, atol=atol)
    np.testing.assert_allclose(after_k, after_d, rtol=1e-6)
    assert float(after_k) != float(loss_k)


def test_kquant_bases_pass_through_qlora_export_and_memory_report(
    kquant_gguf, tmp_path
):
    """QLoRA keeps them, the GGUF writer rewrites them, the report reads them."""
    from entrenar.quant import memory_report

    config, kept, _ = load_llama_gguf(kquant_gguf, keep_quantized=True)
    cfg = LoRAConfig(rank=4, alpha=8, targets=tuple(PROJECTION_TYPES))
    params = lora.apply(kept, cfg, key=jax.random.key(0), quantize="nf4")
    q = params["model"]["layers"]["self_attn"]["q_proj"]["weight"]
    assert isinstance(q.base, GGMLWeight) and q.base.ggml_type == "Q4_K"
    save_llama_gguf(tmp_path / "out.gguf", config, lora.fold(params))
    _, again, _ = load_llama_gguf(tmp_path / "out.gguf")
    ref = to_dense(kept["model"]["layers"]["mlp"]["up_proj"]["weight"])  # BF16
    np.testing.assert_array_equal(
        again["model"]["layers"]["mlp"]["up_proj"]["weight"], ref
    )
    kinds = {e.name: (e.kind, e.bits_per_param) for e in memory_report(kept).entries}
    kind, bits_q = kinds["model.layers.self_attn.q_proj.weight"]
    assert kind == "Q4_K" and bits_q == pytest.approx(4.5)
