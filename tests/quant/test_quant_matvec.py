"""Decoding products from stored weights (`entrenar.quant.matvec`, ggml_matvec.cc).

Every format's few-row product, through the native kernel and through the pure-JAX
path, against ``x`` times the dequantized float32 matrix (computed in numpy from the
dequantizer's values); the kernel's gradient; the Q8_0 head of a tied embedding;
greedy generation from the stored weights of a tiny Llama against its dequantized
float32 model, with one compiled step for all tokens.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from entrenar import native, nn
from entrenar.nn import LlamaConfig, decode_step, generate
from entrenar.nn.bf16_weight import Bfloat16Weight, TiedEmbedding
from entrenar.nn.generate import prefill
from entrenar.quant import matvec
from entrenar.quant.ggml import from_ggml, quantize_ggml, to_ggml
from entrenar.quant.kquant import FORMATS, GGMLWeight

HALF_AT = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}
"""Byte offsets of each K-quant block's float16 scales (d, dmin)."""


def raw_blocks(kind: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """``(rows, row_bytes)`` GGUF bytes of ``kind``: random codes, small scales."""
    rng = np.random.default_rng(seed)
    if kind in ("BF16", "F16"):
        w = rng.standard_normal((rows, cols)).astype(np.float32)
        return w.astype(jnp.bfloat16 if kind == "BF16" else np.float16).view(np.uint8)
    fmt = FORMATS[kind]
    raw = rng.integers(0, 256, (rows, cols // fmt.block_size, fmt.type_size), np.uint8)
    for at in HALF_AT[kind]:
        half = (rng.standard_normal(raw.shape[:2]) * 2e-2).astype(np.float16)
        raw[..., at : at + 2] = half[..., None].view(np.uint8)
    return raw.reshape(rows, -1)


KERNEL = native.reason("ggml_matvec")
ROWS, COLS = 80, 512  # COLS: two K-quant super-blocks


def weight(kind: str, seed: int = 0):
    """A ``(ROWS, COLS)`` weight of ``kind`` with random values."""
    if kind in matvec.GGML_TYPES:
        node = from_ggml(raw_blocks(kind, ROWS, COLS, seed), kind, (ROWS, COLS))
        assert isinstance(node, GGMLWeight)
        return node
    w = np.random.default_rng(seed).standard_normal((ROWS, COLS)).astype(np.float32)
    if kind == "bf16_weight":
        return Bfloat16Weight.from_array(w)
    return quantize_ggml(w, kind)


KINDS = ["q8_0", "q4_0", "q4_1", "Q4_K", "Q5_K", "Q6_K", "BF16", "F16", "bf16_weight"]
TARGET = {
    k: "entrenar_q_matvec" if k.islower() else "entrenar_ggml_matvec" for k in KINDS
}
TARGET["bf16_weight"] = "entrenar_ggml_matvec"


def reference(w, x: np.ndarray) -> np.ndarray:
    """``x Ŵᵀ`` in float64 from the dequantizer's float32 values."""
    dense = np.asarray(matvec.dense(w, jnp.float32), np.float64)  # (out, in)
    return x.astype(np.float64) @ dense.T


@pytest.mark.parametrize("policy", ["auto", "jax"])
@pytest.mark.parametrize("n", [1, 12])
@pytest.mark.parametrize("kind", KINDS)
def test_product_equals_the_dequantized_product(kind, n, policy):
    if policy == "auto" and KERNEL is not None:
        pytest.skip(f"the kernel is off here: {KERNEL}")
    w = weight(kind, seed=n)
    x = np.random.default_rng(n).standard_normal((n, COLS)).astype(np.float32)
    with native.policy(policy):
        f = jax.jit(nn.linear)
        text = f.lower(jnp.asarray(x), w).as_text()
        assert (TARGET[kind] in text) == (policy == "auto")
        y = np.asarray(f(jnp.asarray(x), w))
    want = reference(w, x)
    # float32 sums of COLS products: error within a few ulps of the summed magnitudes
    scale = (
        np.abs(x).astype(np.float64)
        @ np.abs(np.asarray(matvec.dense(w, jnp.float32), np.float64)).T
    )
    assert y.shape == (n, ROWS) and y.dtype == np.float32
    assert np.all(np.abs(y - want) <= 4e-6 * scale + 1e-30)


def test_leading_axes_and_many_rows():
    """``x: (B, T, in)`` keeps its axes; past FEW_ROWS the JAX path takes over."""
    w = weight("q4_1")
    x = np.random.default_rng(3).standard_normal((2, 3, COLS)).astype(np.float32)
    y = nn.linear(jnp.asarray(x), w)
    np.testing.assert_allclose(y, reference(w, x), rtol=1e-4, atol=1e-3)
    many = jnp.ones((matvec.FEW_ROWS + 1, COLS), jnp.float32)
    assert not matvec.applies(w, many)
    assert "matvec" not in jax.jit(nn.linear).lower(many, w).as_text()


@pytest.mark.skipif(KERNEL is not None, reason=f"the kernel is off here: {KERNEL}")
@pytest.mark.parametrize("kind", ["q4_1", "Q6_K", "bf16_weight"])
def test_gradient_is_the_dequantized_products(kind):
    w = weight(kind)
    x = jnp.asarray(np.random.default_rng(4).standard_normal((3, COLS)), jnp.float32)
    dense = matvec.dense(w, jnp.float32)

    g = jnp.asarray(np.random.default_rng(5).standard_normal((3, ROWS)), jnp.float32)
    _, pull = jax.vjp(lambda x: nn.linear(x, w), x)
    want = np.asarray(g, np.float64) @ np.asarray(dense, np.float64)  # g Ŵ
    np.testing.assert_allclose(
        pull(g)[0], want, rtol=1e-4, atol=1e-4 * np.abs(want).max()
    )


def test_q8_0_head_requantizes_to_the_stored_bytes():
    """A dequantized Q8_0 table quantized again gives back the file's bytes."""
    stored = quantize_ggml(np.random.default_rng(5).standard_normal((64, 96)), "q8_0")
    table = matvec.dense(stored, jnp.float32)  # what the GGUF loader keeps
    params = {"model": {"embed_tokens": {"weight": table}}}
    head = matvec.quantize_tied_head(params)["model"]["embed_tokens"]["weight"]
    assert isinstance(head, matvec.QuantizedTiedEmbedding)
    assert isinstance(head, TiedEmbedding)  # the models' embedding lookup reads .table
    np.testing.assert_array_equal(to_ggml(head.head_t)[0], to_ggml(stored)[0])
    np.testing.assert_array_equal(head.table, table)
    with pytest.raises(KeyError, match="lm_head"):
        matvec.quantize_tied_head(params, name="lm_head.weight")


def _tiny():
    cfg = LlamaConfig(
        vocab_size=97, hidden_size=64, intermediate_size=128, num_layers=2,
        num_heads=4, num_kv_heads=2, max_position_embeddings=128,
        tie_word_embeddings=True,
    )  # fmt: skip
    params = cfg.init(jax.random.key(0))
    leaves, tdef = jax.tree_util.tree_flatten(params)  # weights with clear maxima
    keys = jax.random.split(jax.random.key(1), len(leaves))
    leaves = [x + 0.5 * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)]
    return cfg, jax.tree_util.tree_unflatten(tdef, leaves)


def _stored(params, scheme):
    """Projections quantized to ``scheme`` (stacked per layer), the head to Q8_0."""

    def convert(path, leaf):
        if "_proj" in jax.tree_util.keystr(path) and leaf.ndim == 3:
            return quantize_ggml(leaf, scheme)  # (L, out, in)
        return leaf

    return matvec.quantize_tied_head(jax.tree_util.tree_map_with_path(convert, params))


def _dense(cfg, stored):
    """The untied float32 model with the stored weights' values.

    The embedding lookup reads the float table, the head the Q8_0 values (the tied
    table is read two ways).
    """

    def value(leaf):
        return matvec.dense(leaf, jnp.float32) if matvec.supported(leaf) else leaf

    params = jax.tree_util.tree_map(value, stored, is_leaf=matvec.supported)
    tied = stored["model"]["embed_tokens"]["weight"]
    params["model"]["embed_tokens"] = {"weight": tied.table}
    params["lm_head"] = {"weight": matvec.dense(tied.head_t, jnp.float32)}
    return dataclasses.replace(cfg, tie_word_embeddings=False), params


@pytest.mark.parametrize("scheme", ["q8_0", "q4_0", "q4_1"])
def test_greedy_generation_from_stored_weights(scheme):
    """Same tokens as the dequantized float32 model; one compiled step for all."""
    cfg, params = _tiny()
    stored = _stored(params, scheme)
    prompt = [[5, 17, 3, 90, 41], [8, 8, 2]]
    before = decode_step._cache_size(), prefill._cache_size()
    got = generate(cfg, stored, prompt, max_new_tokens=12)
    after = decode_step._cache_size(), prefill._cache_size()
    assert (after[0] - before[0], after[1] - before[1]) == (1, 1)
    dense_cfg, dense = _dense(cfg, stored)
    with native.policy("jax"):
        want = generate(dense_cfg, dense, prompt, max_new_tokens=12)
    np.testing.assert_array_equal(got, want)
    assert len(set(np.asarray(got).ravel().tolist())) > 3  # not one repeated token
