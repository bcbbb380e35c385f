"""The KV cache: in-place writes of the new entries, per-row positions."""

import dataclasses
import functools
import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from entrenar import nn
from entrenar.errors import ShapeError
from entrenar.nn import GPT2Config, LlamaConfig
from entrenar.nn.attention import (
    cache_positions,
    causal_mask,
    read_cache,
    write_cache,
)
from entrenar.nn.generate import decode_step
from entrenar.nn.sampling import Sampling

LLAMA = LlamaConfig(
    vocab_size=50, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
    num_kv_heads=2, rope_theta=100.0, max_position_embeddings=64,
)  # fmt: skip
GEMMA = nn.architecture("gemma3").tiny()  # mixed sliding / full layers, local rotary
GPT2 = GPT2Config(vocab_size=50, n_positions=64, n_embd=32, n_layer=2, n_head=4)
MODELS = [LLAMA, GEMMA, GPT2]
IDS = ["llama", "gemma3", "gpt2"]


def test_write_cache_writes_only_the_new_entries():
    buf = jnp.arange(3 * 2 * 6 * 1 * 2, dtype=jnp.float32).reshape(3, 2, 6, 1, 2)
    new = -jnp.ones((2, 2, 1, 2), jnp.float32)  # (B, T, KV, d)
    want = np.array(buf)
    want[1, :, 3:5] = -1
    out = write_cache(buf, new, jnp.int32(1), jnp.int32(3))  # one position, all rows
    np.testing.assert_array_equal(out, want)
    want = np.array(buf)
    want[2, 0, 4:6], want[2, 1, 0:2] = -1, -1
    out = write_cache(buf, new, jnp.int32(2), jnp.asarray([4, 0]))  # per row
    np.testing.assert_array_equal(out, want)
    np.testing.assert_array_equal(read_cache(out, jnp.int32(2)), want[2])
    want[0, 0, 5] = -1  # a per-row write past the end is dropped
    out = write_cache(jnp.asarray(want), new, jnp.int32(0), jnp.asarray([5, 4]))
    want[0, 1, 4:6] = -1
    np.testing.assert_array_equal(out, want)


def test_per_row_positions_and_masks():
    assert cache_positions(jnp.int32(2), 3).tolist() == [2, 3, 4]
    pos = cache_positions(jnp.asarray([2, 0]), 2)
    assert pos.tolist() == [[2, 3], [0, 1]]
    mask = causal_mask(pos, 4)  # (B, T, S)
    assert mask.shape == (2, 2, 4)
    np.testing.assert_array_equal(mask[0], causal_mask(pos[0], 4))
    np.testing.assert_array_equal(mask[1], causal_mask(pos[1], 4))
    with pytest.raises(ShapeError, match="scalar or"):
        cache_positions(jnp.zeros((2, 2), jnp.int32), 1)


@functools.partial(jax.jit, static_argnums=0)  # one program per model and shape
def _step(model, params, tokens, cache):
    return model.apply_cached(params, tokens, cache)


@functools.partial(jax.jit, static_argnums=0)  # eager: a compile per weight shape
def _init(model, key):
    return model.init(key)


@pytest.mark.usefixtures("quick_compiles")
@pytest.mark.parametrize("model", MODELS, ids=IDS)
def test_per_row_cache_equals_each_row_alone(model):
    """Rows at different positions in one cache get the logits they get alone."""
    params = _init(model, jax.random.key(0))
    rng = np.random.default_rng(0)
    lens = (7, 3, 12)  # past the tiny sliding windows (4)
    s = 16
    alone = []
    for n in lens:
        toks = jnp.asarray(rng.integers(1, 50, size=(1, n + 2)), jnp.int32)
        cache = model.init_cache(1, s)
        _, cache = _step(model, params, toks[:, :n], cache)
        logits, cache = _step(model, params, toks[:, n:], cache)  # 2 new tokens
        alone.append((toks, logits[0], cache))
    # the same rows together: each prompt right-padded, then rewound to its length
    b, tb = len(lens), max(lens)
    ids = np.zeros((b, tb), np.int32)
    for i, n in enumerate(lens):
        ids[i, :n] = alone[i][0][0, :n]
    cache = model.init_cache(b, s)._replace(pos=jnp.zeros((b,), jnp.int32))
    _, cache = _step(model, params, jnp.asarray(ids), cache)
    cache = cache._replace(pos=jnp.asarray(lens, jnp.int32))
    nxt = jnp.concatenate([a[0][:, n:] for a, n in zip(alone, lens)])  # (B, 2)
    logits, cache = _step(model, params, nxt, cache)
    assert cache.pos.tolist() == [n + 2 for n in lens]
    for i, (n, a) in enumerate(zip(lens, alone)):
        np.testing.assert_allclose(logits[i], a[1], rtol=2e-5, atol=2e-5)
        np.testing.assert_allclose(
            cache.k[:, i, : n + 2], a[2].k[:, 0, : n + 2], rtol=2e-5, atol=2e-5
        )


@pytest.mark.usefixtures("quick_compiles")
@pytest.mark.parametrize("model", MODELS, ids=IDS)
def test_equal_per_row_positions_equal_a_scalar_one(model):
    params = _init(model, jax.random.key(1))
    toks = jnp.asarray(np.random.default_rng(1).integers(1, 50, size=(2, 5)))
    one = model.init_cache(2, 8)._replace(pos=jnp.int32(2))
    rows = one._replace(pos=jnp.full((2,), 2, jnp.int32))
    a, ca = _step(model, params, toks, one)
    b, cb = _step(model, params, toks, rows)
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(ca.k, cb.k)
    assert ca.pos.shape == () and cb.pos.tolist() == [7, 7]


def decode_step_hlo(b: int, s: int, rows: bool, model: Any = None) -> str:
    """The compiled program of a greedy `decode_step` of ``model`` (3 layers).

    Batch ``b``, cache length ``s`` (`LLAMA`'s keys/values ``f32[3, b, s, 2, 8]``),
    one position for all rows or (``rows``) one per row.
    """
    if model is None:
        model = dataclasses.replace(LLAMA, num_layers=3)
    params = model.init(jax.random.key(0))
    cache = model.init_cache(b, s)
    if rows:
        cache = cache._replace(pos=jnp.zeros((b,), jnp.int32))
    sampling = Sampling(0.0, None, None, None, None)
    lowered = decode_step.lower(
        model, params, jnp.ones((b,), jnp.int32), cache, None, jnp.zeros((b,), bool),
        None, jnp.int32(1), sampling.values(), jnp.zeros((0,), jnp.int32),
        jnp.int32(0), structure=sampling.structure(),
    )  # fmt: skip
    return lowered.compile().as_text()


@pytest.mark.parametrize("rows", [False, True], ids=["scalar_pos", "per_row_pos"])
def test_a_decode_step_does_not_copy_the_cache(rows):
    """The compiled step updates the donated cache in place: no whole-cache copy."""
    b, s = 4, 32
    hlo = decode_step_hlo(b, s, rows)
    shape = re.escape(f"f32[3,{b},{s},2,8]")
    copies = re.findall(rf"= {shape}\S* copy\(", hlo)
    assert not copies, copies
