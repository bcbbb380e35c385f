"""`cached_attention`: a layer of the stacked KV cache, read in place.

The reference is the sliced path it replaces, `dot_product_attention` on
`read_cache`'s copy of the layer: equal bit for bit (the native kernel reads the same
floats, only where they lie), for every layer (each filled with other values, so a
wrong layer offset shows), every mask form and the bfloat16 products. The decode
step's compiled program must hold no ``(B, S, KV, d)`` value (the copy of a layer).
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_nn_attention_cache import decode_step_hlo

from entrenar import native
from entrenar.errors import ShapeError
from entrenar.nn import GPT2Config
from entrenar.nn.attention import (
    cached_attention,
    causal_mask,
    dot_product_attention,
    read_cache,
)

KERNEL = native.load("attention")
L, B, S, KV, D, H = 3, 2, 40, 2, 16, 4


def _buffers(t):
    rng = np.random.default_rng(t)
    q = jnp.asarray(rng.standard_normal((B, t, H, D)), jnp.float32)
    kb = jnp.asarray(rng.standard_normal((L, B, S, KV, D)), jnp.float32)
    vb = jnp.asarray(rng.standard_normal((L, B, S, KV, D)), jnp.float32)
    return q, kb, vb


def _mask(kind, t):
    if kind == "scalar_pos":  # (T, S): positions 5 .. 5 + t - 1
        return causal_mask(5 + jnp.arange(t, dtype=jnp.int32), S)
    if kind == "per_row_pos":  # (B, T, S): rows at 3 and 30
        pos = jnp.asarray([3, 30], jnp.int32)[:, None] + jnp.arange(t)[None]
        return causal_mask(pos.astype(jnp.int32), S)
    return None


@pytest.mark.parametrize("policy", ["auto", "jax"])
@pytest.mark.parametrize("matmul_dtype", [None, "bfloat16"])
@pytest.mark.parametrize("mask_kind", ["scalar_pos", "per_row_pos", "none"])
@pytest.mark.parametrize("t", [1, 3])
def test_equals_the_sliced_path_bit_for_bit(policy, matmul_dtype, mask_kind, t):
    q, kb, vb = _buffers(t)
    mask = _mask(mask_kind, t)

    def fast(q, kb, vb, layer):
        return cached_attention(q, kb, vb, layer, mask, matmul_dtype=matmul_dtype)

    def sliced(q, kb, vb, layer):
        k, v = read_cache(kb, layer), read_cache(vb, layer)  # (B, S, KV, d)
        return dot_product_attention(
            q, k, v, mask, matmul_dtype=matmul_dtype, impl="reference"
        )

    with native.policy(policy):
        outs = []
        for layer in range(L):
            a = jax.jit(fast)(q, kb, vb, jnp.int32(layer))
            b = jax.jit(sliced)(q, kb, vb, jnp.int32(layer))
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
            outs.append(np.asarray(a))
    assert not np.array_equal(outs[0], outs[1])  # the layers differ


def test_scale_and_softcap_follow_the_sliced_path():
    q, kb, vb = _buffers(2)
    mask = _mask("scalar_pos", 2)
    for how in ({"scale": 0.3}, {"softcap": 2.0}):
        a = cached_attention(q, kb, vb, jnp.int32(1), mask, **how)
        b = dot_product_attention(
            q, read_cache(kb, 1), read_cache(vb, 1), mask, impl="reference", **how
        )
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_gradients_equal_the_sliced_path():
    q, kb, vb = _buffers(2)
    mask = _mask("per_row_pos", 2)
    w = jnp.asarray(np.random.default_rng(9).standard_normal((B, 2, H, D)))

    def fast(q, kb, vb):
        return jnp.sum(w * cached_attention(q, kb, vb, jnp.int32(2), mask))

    def sliced(q, kb, vb):
        k, v = read_cache(kb, 2), read_cache(vb, 2)
        return jnp.sum(w * dot_product_attention(q, k, v, mask, impl="reference"))

    ga = jax.grad(fast, argnums=(0, 1, 2))(q, kb, vb)
    gb = jax.grad(sliced, argnums=(0, 1, 2))(q, kb, vb)
    for a, b in zip(ga, gb, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)
    assert not np.any(np.asarray(ga[1])[:2])  # only layer 2's keys get a gradient


def test_bad_shapes_are_named():
    q, kb, vb = _buffers(1)
    with pytest.raises(ShapeError, match=r"k, v \(L, B, S, KV, d\)"):
        cached_attention(q, kb[0], vb[0], jnp.int32(0), None)
    with pytest.raises(ShapeError, match="multiple of key/value heads"):
        cached_attention(q[:, :, :3], kb, vb, jnp.int32(0), None)


@pytest.mark.skipif(not KERNEL, reason="no C++ compiler: the kernel is off")
def test_the_kernel_refuses_a_layer_out_of_range():
    q, kb, vb = _buffers(1)
    with pytest.raises(Exception, match="layer out of range"):
        np.asarray(jax.jit(cached_attention)(q, kb, vb, jnp.int32(L), None))


GPT2_3 = GPT2Config(vocab_size=50, n_positions=64, n_embd=32, n_layer=3, n_head=4)


@pytest.mark.skipif(not KERNEL, reason="no C++ compiler: the kernel is off")
@pytest.mark.parametrize("rows", [False, True], ids=["scalar_pos", "per_row_pos"])
@pytest.mark.parametrize(
    ("model", "heads"), [(None, 2), (GPT2_3, 4)], ids=["llama", "gpt2"]
)
def test_a_decode_step_copies_no_layer_of_the_cache(rows, model, heads):
    """No ``(B, S, KV, d)`` value in the compiled step: layers are read in place."""
    b, s = 2, 32
    hlo = decode_step_hlo(b, s, rows, model)
    layer = re.escape(f"f32[{b},{s},{heads},8]")  # one layer's keys or values
    assert not re.findall(rf"= {layer}\S* ", hlo)
    assert "entrenar_attention_cached" in hlo


@pytest.mark.skipif(not KERNEL, reason="no C++ compiler: the kernel is off")
@pytest.mark.parametrize("s", [40, 64, 7])
def test_rows_read_in_place_equal_rows_of_a_copied_head(s):
    """The kernel's two forward paths agree bit for bit.

    A call of up to 8 query rows (one block) reads keys and values where they lie;
    one of more rows copies each head's keys (transposed) and values first. Rows go
    in blocks of 8, and a block's softmax sums over the union of its rows' key
    ranges, so the 9-row call's first 8 rows (copied) must equal the same 8 rows
    alone (in place), and its ninth row the ninth alone.
    """
    rng = np.random.default_rng(s)
    t = 9
    q = jnp.asarray(rng.standard_normal((B, t, H, D)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((B, s, KV, D)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((B, s, KV, D)), jnp.float32)
    pos = rng.integers(0, s, size=(B, t)).astype(np.int32)
    mask = causal_mask(jnp.asarray(pos), s)  # (B, T, S)
    mask = mask.at[0, 4].set(False)  # a row that may attend nowhere
    whole = np.asarray(dot_product_attention(q, k, v, mask, impl="reference"))
    for rows in (slice(0, 8), slice(8, 9)):
        part = dot_product_attention(
            q[:, rows], k, v, mask[:, rows], impl="reference"
        )  # (B, 8 or 1, H, d)
        np.testing.assert_array_equal(np.asarray(part), whole[:, rows])
