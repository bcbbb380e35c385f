"""Fused attention (`jax.nn.dot_product_attention`, its XLA form here) vs the reference.

The reference is `entrenar.nn.attention._attention_jax`, the JAX path the models
use where no native kernel runs; on the CPU `implementation=None` picks XLA's form,
the function cuDNN's kernel computes on a GPU. Checked: forward and gradients of
every mask combination the models build (causal flag or dense, padding, packed
segments, sliding windows, GQA, bias, a row with nothing allowed), then each
decoder family with ``attention_impl="fused"`` against ``"reference"`` (logits and
parameter gradients with padding and segments, and KV-cached decoding), and that
``auto`` leaves the CPU's training program as it was.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from entrenar import nn
from entrenar.errors import ConfigError, ShapeError
from entrenar.nn import attention
from entrenar.nn.attention import KVCache, causal_mask, dot_product_attention
from entrenar.nn.fused_attention import fused_attention, resolve_impl, use_fused

TOL = 1e-5


pytestmark = pytest.mark.usefixtures("quick_compiles")


def _qkv(seed, b=2, t=8, h=4, kv=2, d=8):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((b, t, h, d)).astype(np.float32)
    k = rng.standard_normal((b, t, kv, d)).astype(np.float32)
    v = rng.standard_normal((b, t, kv, d)).astype(np.float32)
    w = rng.standard_normal((b, t, h, d)).astype(np.float32)  # output cotangent
    return [jnp.asarray(x) for x in (q, k, v, w)]


def _value_and_grads(f, q, k, v, w):
    out, pull = jax.vjp(f, q, k, v)
    return [out, *pull(w)]


def _check(fused, reference, q, k, v, w, tol=TOL):
    got = _value_and_grads(jax.jit(fused), q, k, v, w)
    want = _value_and_grads(jax.jit(reference), q, k, v, w)
    assert float(jnp.abs(want[0]).max()) > 0.1  # not a degenerate case
    for name, g, r in zip(("out", "dq", "dk", "dv"), got, want):
        np.testing.assert_allclose(g, r, atol=tol, rtol=tol, err_msg=name)


def _masks(b, t, window):
    """``(causal, window, extra mask, dense mask)`` cases the models build."""
    rng = np.random.default_rng(7)
    causal = np.asarray(causal_mask(jnp.arange(t), t))  # (T, T)
    pad = np.ones((b, t), bool)
    pad[1, :3] = False  # left padding
    padm = np.broadcast_to(pad[:, None, :], (b, t, t))
    seg = np.array([[0] * 3 + [1] * (t - 3), [0] * 5 + [1] * (t - 5)])
    segm = seg[:, :, None] == seg[:, None, :]  # (B, T, T)
    idx = np.arange(t)
    near = (idx[:, None] - idx[None, :]) < window  # (T, T)
    rand = rng.random((b, t, t)) < 0.6
    empty = causal.copy()
    empty[2] = False  # a query allowed nowhere
    return {
        "none": (False, None, None, None),
        "causal": (True, None, None, causal),
        "causal_dense": (False, None, causal, causal),
        "causal_pad": (True, None, padm, causal & padm),
        "causal_segments": (True, None, segm, causal & segm),
        "causal_pad_segments": (True, None, padm & segm, causal & padm & segm),
        "causal_window": (True, window, None, causal & near),
        "causal_window_pad": (True, window, padm, causal & near & padm),
        "window_only": (False, window, None, np.broadcast_to(near, (t, t))),
        "random": (False, None, rand, rand),
        "empty_row": (False, None, empty, empty),
    }


@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (4, 1)], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize(
    "case",
    [
        "none",
        "causal",
        "causal_dense",
        "causal_pad",
        "causal_segments",
        "causal_pad_segments",
        "causal_window",
        "causal_window_pad",
        "window_only",
        "random",
        "empty_row",
    ],
)
def test_fused_equals_reference(case, heads):
    h, kv = heads
    q, k, v, w = _qkv(0, h=h, kv=kv)
    b, t = q.shape[:2]
    causal, window, extra, dense = _masks(b, t, window=3)[case]
    scale = 0.3  # not 1/sqrt(d): the argument is honoured

    def fused(q, k, v):
        m = None if extra is None else jnp.asarray(extra)
        return fused_attention(q, k, v, m, causal=causal, window=window, scale=scale)

    def reference(q, k, v):
        m = None if dense is None else jnp.asarray(dense)
        return attention._attention_jax(q, k, v, m, None, scale, None)

    _check(fused, reference, q, k, v, w)


def test_bias_and_4d_mask():
    q, k, v, w = _qkv(1)
    rng = np.random.default_rng(2)
    bias = jnp.asarray(rng.standard_normal((2, 4, 8, 8)).astype(np.float32))
    mask = jnp.asarray(rng.random((2, 1, 8, 8)) < 0.7)  # (B, 1, T, S)

    def fused(q, k, v):
        return fused_attention(q, k, v, mask, bias=bias)

    def reference(q, k, v):
        return attention._attention_jax(q, k, v, mask, bias, 8**-0.5, None)

    _check(fused, reference, q, k, v, w)


def test_dot_product_attention_routes_by_impl():
    q, k, v, w = _qkv(3)
    mask = causal_mask(jnp.arange(8), 8)

    def run(impl, **kw):
        return lambda q, k, v: dot_product_attention(q, k, v, mask, impl=impl, **kw)

    _check(run("fused"), run("reference"), q, k, v, w)
    # soft-capping has no fused form: "fused" is the reference path exactly
    capped = run("fused", softcap=2.0)(q, k, v)
    np.testing.assert_array_equal(capped, run("reference", softcap=2.0)(q, k, v))
    assert not use_fused("fused", jnp.float32, softcap=2.0)
    assert not use_fused("fused", jnp.float64)
    assert resolve_impl("auto") == "reference"  # the tests run on the CPU


def test_bfloat16_products_agree_to_bfloat16_rounding():
    q, k, v, w = _qkv(4)
    mask = causal_mask(jnp.arange(8), 8)

    def fused(q, k, v):
        return fused_attention(q, k, v, None, causal=True, matmul_dtype="bfloat16")

    def reference(q, k, v):
        return attention._attention_jax(q, k, v, mask, None, 8**-0.5, "bfloat16")

    # JAX's own backward pass mixes bfloat16 and float32 (jax.nn's code, traced
    # when the gradient is): it needs JAX's default, standard promotion
    with jax.numpy_dtype_promotion("standard"):
        _check(fused, reference, q, k, v, w, tol=3e-2)


def test_bad_arguments_are_named():
    q, k, v, _ = _qkv(5, t=8)
    with pytest.raises(ShapeError, match="as many queries as keys"):
        fused_attention(q[:, :4], k, v, causal=True)
    with pytest.raises(ShapeError, match="multiple of key/value heads"):
        fused_attention(q[:, :, :3], k, v)
    with pytest.raises(ConfigError, match="attention_impl"):
        nn.LlamaConfig(**_TINY, attention_impl="flash")


# ------------------------------------------------------------------ the models
_TINY = dict(
    vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
    num_kv_heads=2, head_dim=16,
)  # fmt: skip
FAMILIES = [a.name for a in nn.architectures() if a.config_class is nn.LlamaConfig]
T = 10  # longer than the tiny sliding windows (4)


def _model(name, impl):
    config = nn.architecture(name).tiny()
    return dataclasses.replace(config, attention_impl=impl)


def _params(config):
    params = config.init(jax.random.key(0))
    # norm gains and biases away from their 1 / 0 so that every term shows
    leaves, treedef = jax.tree_util.tree_flatten(params)
    keys = jax.random.split(jax.random.key(1), len(leaves))
    leaves = [x + 0.1 * jax.random.normal(kk, x.shape) for x, kk in zip(leaves, keys)]
    return jax.tree_util.tree_unflatten(treedef, leaves)


def _batch(vocab):
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, vocab, (2, T)), jnp.int32)
    mask = np.ones((2, T), bool)
    mask[1, :3] = False  # left padding
    seg = np.array([[0] * 4 + [1] * (T - 4), [0] * T])  # two packed documents
    pos = np.concatenate([np.arange(4), np.arange(T - 4)])[None].repeat(2, 0)
    pos[1] = np.arange(T)
    return tokens, jnp.asarray(mask), jnp.asarray(seg), jnp.asarray(pos, jnp.int32)


def _loss(config):
    def loss(params, tokens, mask, seg, pos):
        logits = config.apply(
            params, tokens, mask=mask, segment_ids=seg, positions=pos
        )  # (B, T, V)
        return jnp.sum(jnp.where(mask[..., None], logits, 0.0) ** 2) / logits.size

    return loss


@pytest.mark.parametrize("name", FAMILIES)
def test_family_fused_equals_reference(name):
    fused, ref = _model(name, "fused"), _model(name, "reference")
    capped = ref.attn_logit_softcapping is not None
    assert fused.uses_fused_attention() is not capped  # Gemma 2: reference always
    params = _params(ref)
    tokens, mask, seg, pos = _batch(ref.vocab_size)
    got = jax.jit(jax.value_and_grad(_loss(fused)))(params, tokens, mask, seg, pos)
    want = jax.jit(jax.value_and_grad(_loss(ref)))(params, tokens, mask, seg, pos)
    assert float(want[0]) > 0.01
    for (path, g), r in zip(
        jax.tree_util.tree_leaves_with_path(got), jax.tree_util.tree_leaves(want)
    ):
        np.testing.assert_allclose(
            g, r, atol=TOL, rtol=TOL, err_msg=jax.tree_util.keystr(path)
        )
    # the padded rows' logits too (no mask applied to the comparison)
    lf = jax.jit(fused.apply)(params, tokens, mask=mask)
    lr = jax.jit(ref.apply)(params, tokens, mask=mask)
    np.testing.assert_allclose(lf, lr, atol=TOL, rtol=TOL)


@pytest.mark.parametrize(
    ("name", "per_row"),
    [(n, False) for n in FAMILIES] + [("llama", True), ("gemma3", True)],
)
def test_family_cached_decoding_fused_equals_reference(name, per_row):
    fused, ref = _model(name, "fused"), _model(name, "reference")
    params = _params(ref)
    tokens = _batch(ref.vocab_size)[0]

    def decode(config):
        step = jax.jit(config.apply_cached)
        cache = config.init_cache(2, T)
        if per_row:  # rows at different positions: masks (B, T, S)
            cache = KVCache(cache.k, cache.v, jnp.asarray([0, 0], jnp.int32))
        out = []
        for t0, t1 in [(0, 5), *((t, t + 1) for t in range(5, T))]:  # prefill, steps
            logits, cache = step(params, tokens[:, t0:t1], cache)
            out.append(np.asarray(logits))
        return np.concatenate(out, 1)

    np.testing.assert_allclose(decode(fused), decode(ref), atol=TOL, rtol=TOL)


def test_auto_leaves_the_cpu_training_program_unchanged():
    """On the CPU ``auto`` is the reference path: the same jaxpr, op for op."""
    config = nn.architecture("mistral").tiny()  # sliding windows, GQA
    params = _params(config)
    tokens, mask, seg, pos = _batch(config.vocab_size)

    def jaxpr(impl):
        loss = _loss(dataclasses.replace(config, attention_impl=impl))
        return str(jax.make_jaxpr(jax.grad(loss))(params, tokens, mask, seg, pos))

    assert jaxpr("auto") == jaxpr("reference")
    assert jaxpr("fused") != jaxpr("reference")  # the switch reaches the model
