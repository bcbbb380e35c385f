"""`entrenar.nn.embedding` of a `QuantizedWeight` table: only the looked-up rows.

The reference is independent of the rule: ``jnp.take`` of the whole table
dequantized (`quant.dequantize`), which is what `embedding` gives for the plain
array. Values are compared bit for bit (NaN rows by position).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from entrenar import nn, quant
from entrenar.errors import ShapeError
from entrenar.quant.api import quantized_rows

# (scheme, quantize options, block size the row length must be a multiple of)
SCHEMES = [
    ("q8_0", {}, 32),
    ("q4_0", {}, 32),
    ("q4_1", {}, 32),
    ("nf4", {"block_size": 32}, 32),
    ("nf4", {"block_size": 64, "double_quant": True}, 64),
    ("int4", {"block_size": 32}, 32),
    ("int8", {"block_size": 32}, 32),
    ("int8", {"granularity": "channel", "axis": -2}, 1),
    ("int8", {"granularity": "channel", "axis": -1, "symmetric": False}, 1),
    ("int8", {"granularity": "tensor"}, 1),
]


def _bits(a) -> np.ndarray:
    """Bit patterns of a float32 array (every NaN alike, so positions compare)."""
    a = np.asarray(a, np.float32)
    return np.where(np.isnan(a), np.uint32(0x7FC00000), a.view(np.uint32))


@settings(max_examples=25, deadline=None)
@given(
    case=st.sampled_from(SCHEMES),
    vocab=st.integers(1, 40),
    blocks=st.integers(1, 3),
    ids=st.lists(st.integers(-45, 45), min_size=0, max_size=12),
    batch=st.sampled_from([(), (1,), (2,)]),
    seed=st.integers(0, 2**16),
)
def test_rows_equal_the_dequantized_table_bit_for_bit(
    case, vocab, blocks, ids, batch, seed
):
    scheme, options, block = case
    dim = 64 * blocks if block == 64 else 32 * blocks
    w = jax.random.normal(jax.random.key(seed), (vocab, dim)) * 0.3
    q = quant.quantize(w, scheme, **options)
    tokens = np.asarray(ids, np.int32)
    if batch == (2,) and tokens.size % 2 == 0:
        tokens = tokens.reshape(2, -1)  # (2, T)
    elif batch == (1,):
        tokens = tokens[None]  # (1, T)
    want = jnp.take(quant.dequantize(q), jnp.asarray(tokens), axis=0)  # (..., D)
    got = nn.embedding(q, jnp.asarray(tokens))
    assert got.shape == (*tokens.shape, dim) and got.dtype == want.dtype
    np.testing.assert_array_equal(_bits(got), _bits(want))
    jitted = jax.jit(nn.embedding)(q, jnp.asarray(tokens))
    np.testing.assert_array_equal(_bits(jitted), _bits(want))
    # the ids jnp.take fills (outside [-V, V)) are NaN rows, the others finite
    bad = (tokens < -vocab) | (tokens >= vocab)
    assert np.isnan(np.asarray(got)).all(-1).tolist() == bad.tolist()


def test_rows_differentiate_through_other_leaves_with_the_table_frozen():
    """A QLoRA-like step: grad w.r.t. a factor after the lookup, table untouched."""
    q = quant.quantize(jax.random.normal(jax.random.key(0), (50, 64)), "q4_1")
    tokens = jnp.array([[3, 7, 49], [0, 1, 2]])
    a = jax.random.normal(jax.random.key(1), (64, 8))

    def loss(a, table):
        h = nn.embedding(table, tokens)  # (2, 3, 64)
        return jnp.sum(jnp.tanh(h @ a))

    g = jax.jit(jax.grad(loss))(a, q)
    ref = jax.grad(loss)(a, quant.dequantize(q))
    # the reference runs op by op, another XLA program: jax 0.12's differs from the
    # jitted one by up to 1.7e-6 (a few float32 ulps of the gradients' sums, |g| <= 2)
    np.testing.assert_allclose(g, ref, rtol=1e-6, atol=5e-6)


def test_rows_feed_bfloat16_matmuls():
    """The training's ``matmul_dtype``: rows in float32, cast by the model."""
    cfg = nn.LlamaConfig(
        vocab_size=64, hidden_size=64, intermediate_size=64, num_layers=1,
        num_heads=2, num_kv_heads=1, max_position_embeddings=16,
        matmul_dtype="bfloat16", tie_word_embeddings=True,
    )  # fmt: skip
    params = cfg.init(jax.random.key(0))
    table = params["model"]["embed_tokens"]["weight"]
    q = quant.quantize(table, "q8_0")
    kept = {**params, "model": {**params["model"], "embed_tokens": {"weight": q}}}
    dense = {**params, "model": {**params["model"], "embed_tokens": {
        "weight": quant.dequantize(q)}}}  # fmt: skip
    tokens = jnp.array([[1, 5, 63, 0]])
    got = jax.jit(cfg.apply)(kept, tokens)
    want = jax.jit(cfg.apply)(dense, tokens)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)


def test_a_stacked_node_is_refused():
    q = quant.quantize(jnp.ones((2, 4, 32)), "q8_0")
    with pytest.raises(ShapeError, match=r"\(V, D\)"):
        quantized_rows(q, jnp.array([0]))
