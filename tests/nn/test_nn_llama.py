"""Llama against an independent numpy reference and against transformers."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from entrenar.autograd import check_gradient
from entrenar.errors import ShapeError
from entrenar.nn import LlamaConfig, to_hf_names
from entrenar.nn.generate import generate
from entrenar.nn.losses import causal_lm_loss
from entrenar.tree import assert_trees_allclose

APPLY = jax.jit(lambda c, p, t: c.apply(p, t), static_argnums=0)
TOKENS = np.array([[1, 5, 9, 2, 7, 3, 0], [4, 4, 8, 10, 6, 1, 2]], np.int32)


def tiny(**kw):
    base = dict(
        vocab_size=11,
        hidden_size=16,
        intermediate_size=24,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        rope_theta=50.0,
        rms_norm_eps=1e-5,
        initializer_range=0.2,
    )
    return LlamaConfig(**{**base, **kw})


@functools.cache
def tiny_model():
    c = tiny()
    return c, c.init(jax.random.key(1))


# ---------------------------------------------------------------- numpy reference
def np_rms(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def np_rope(x, theta):  # x: (T, d) for one head, positions 0..T-1
    t, d = x.shape
    inv = theta ** (-np.arange(0, d, 2) / d)
    ang = np.arange(t)[:, None] * inv[None, :]  # (T, d/2)
    x1, x2 = x[:, : d // 2], x[:, d // 2 :]
    c, s = np.cos(ang), np.sin(ang)
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=1)


def np_llama(flat, c, tokens):
    w = {k: np.asarray(v, np.float64) for k, v in flat.items()}
    d = c.hd
    out = []
    for seq in tokens:
        h = w["model.embed_tokens.weight"][seq]  # (T, D)
        t = len(seq)
        for i in range(c.num_layers):
            p = f"model.layers.{i}."
            x = np_rms(h, w[p + "input_layernorm.weight"], c.rms_norm_eps)
            q = x @ w[p + "self_attn.q_proj.weight"].T
            k = x @ w[p + "self_attn.k_proj.weight"].T
            v = x @ w[p + "self_attn.v_proj.weight"].T
            heads = []
            for hq in range(c.num_heads):
                g = hq // (c.num_heads // c.num_kv_heads)
                qh = np_rope(q[:, hq * d : (hq + 1) * d], c.rope_theta)
                kh = np_rope(k[:, g * d : (g + 1) * d], c.rope_theta)
                vh = v[:, g * d : (g + 1) * d]
                s = qh @ kh.T / np.sqrt(d)
                s = np.where(np.tril(np.ones((t, t), bool)), s, -np.inf)
                pr = np.exp(s - s.max(axis=1, keepdims=True))
                heads.append(pr / pr.sum(axis=1, keepdims=True) @ vh)
            h = h + np.concatenate(heads, axis=1) @ w[p + "self_attn.o_proj.weight"].T
            x = np_rms(h, w[p + "post_attention_layernorm.weight"], c.rms_norm_eps)
            gate = x @ w[p + "mlp.gate_proj.weight"].T
            up = x @ w[p + "mlp.up_proj.weight"].T
            h = h + (gate / (1 + np.exp(-gate)) * up) @ w[p + "mlp.down_proj.weight"].T
        h = np_rms(h, w["model.norm.weight"], c.rms_norm_eps)
        head = w.get("lm_head.weight", w["model.embed_tokens.weight"])
        out.append(h @ head.T)
    return np.stack(out)


@pytest.mark.parametrize(
    "kw",
    [
        dict(num_kv_heads=2),  # GQA
        dict(num_kv_heads=4, tie_word_embeddings=True),  # plain multi-head
        dict(num_kv_heads=1, head_dim=6),  # MQA, head_dim != D / H
    ],
)
def test_llama_matches_numpy_reference(kw):
    c = tiny(**kw)
    p = c.init(jax.random.key(1))
    got = APPLY(c, p, jnp.asarray(TOKENS))
    assert got.dtype == jnp.float32 and got.shape == (2, 7, 11)
    want = np_llama(to_hf_names(p), c, TOKENS)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-4)


def test_llama_matches_transformers():
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    c = tiny()
    p = c.init(jax.random.key(1))
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**c.to_hf_config()))
    state = {k: torch.from_numpy(np.array(v)) for k, v in to_hf_names(p).items()}
    hf.load_state_dict(state, strict=True)
    with torch.no_grad():
        want = hf(torch.from_numpy(TOKENS.astype(np.int64))).logits.numpy()
    got = np.asarray(APPLY(c, p, jnp.asarray(TOKENS)))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_cached_steps_equal_full_forward():
    c = tiny()
    p = c.init(jax.random.key(3))
    full = APPLY(c, p, jnp.asarray(TOKENS))
    cache = c.init_cache(2, 10)
    l1, cache = c.apply_cached(p, jnp.asarray(TOKENS[:, :4]), cache)
    l2, cache = c.apply_cached(p, jnp.asarray(TOKENS[:, 4:5]), cache)
    l3, cache = c.apply_cached(p, jnp.asarray(TOKENS[:, 5:]), cache)
    assert int(cache.pos) == 7
    got = jnp.concatenate([l1, l2, l3], axis=1)
    np.testing.assert_allclose(got, full, rtol=1e-5, atol=1e-5)


def test_cached_greedy_generation_equals_uncached_argmax():
    c = tiny()
    p = c.init(jax.random.key(4))
    prompt = jnp.asarray(TOKENS[:, :3])
    got = np.asarray(generate(c, p, prompt, max_new_tokens=6))
    seq = prompt
    for _ in range(6):
        nxt = jnp.argmax(APPLY(c, p, seq)[:, -1], axis=-1).astype(jnp.int32)
        seq = jnp.concatenate([seq, nxt[:, None]], axis=1)
    np.testing.assert_array_equal(got, np.asarray(seq[:, 3:]))


def test_padding_mask_matches_shorter_sequence():
    c = tiny()
    p = c.init(jax.random.key(5))
    mask = jnp.asarray(np.arange(7)[None, :] < np.array([[7], [4]]))
    got = c.apply(p, jnp.asarray(TOKENS), mask=mask)
    short = APPLY(c, p, jnp.asarray(TOKENS[1:, :4]))
    np.testing.assert_allclose(got[1, :4], short[0], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got[0], APPLY(c, p, jnp.asarray(TOKENS))[0], atol=1e-6)


def test_remat_and_mixed_precision():
    c = tiny()
    p = c.init(jax.random.key(6))
    tok = jnp.asarray(TOKENS)

    def loss(cfg, params):
        return jnp.mean(cfg.apply(params, tok) ** 2)

    import dataclasses

    cr = dataclasses.replace(c, remat=True)
    v, g = jax.value_and_grad(lambda q: loss(c, q))(p)
    vr, gr = jax.value_and_grad(lambda q: loss(cr, q))(p)
    np.testing.assert_allclose(vr, v, rtol=1e-6)
    assert_trees_allclose(gr, g, rtol=1e-5, atol=1e-7)

    bf = dataclasses.replace(c, dtype="bfloat16")
    logits = APPLY(bf, p, tok)
    assert logits.dtype == jnp.float32
    np.testing.assert_allclose(logits, APPLY(c, p, tok), atol=0.1)
    pb = dataclasses.replace(c, param_dtype="bfloat16").init(jax.random.key(0))
    assert {x.dtype for x in jax.tree_util.tree_leaves(pb)} == {jnp.dtype("bfloat16")}
    assert bf.init_cache(1, 4).k.dtype == jnp.bfloat16


def test_gradients_pass_check_gradient():
    # Every parameter element of a tiny Llama (GQA, untied head), central
    # differences in float64 by entrenar.autograd.check_gradient.
    c = LlamaConfig(
        vocab_size=7, hidden_size=8, intermediate_size=8, num_layers=2,
        num_heads=2, num_kv_heads=1, rope_theta=10.0, initializer_range=0.3,
        dtype="float64",
    )  # fmt: skip
    leaves, treedef = jax.tree_util.tree_flatten(c.init(jax.random.key(7)))
    tok = jnp.asarray(TOKENS[:1, :4] % 7)

    def loss(*xs):
        return causal_lm_loss(
            c.apply(jax.tree_util.tree_unflatten(treedef, xs), tok), tok
        )

    result = check_gradient(loss, leaves, eps=1e-4, rtol=1e-6, atol=1e-8, api="jax")
    assert result.passed, (result.max_error, result.worst)
    assert sum(np.abs(a).sum() > 0 for a in result.analytic) == len(leaves)


def test_bad_inputs():
    c = tiny()
    p = c.init(jax.random.key(0))
    with pytest.raises(ShapeError, match="batch, time"):
        c.apply(p, jnp.zeros(3, jnp.int32))
    with pytest.raises(ShapeError, match="max_len"):
        generate(c, p, jnp.zeros((1, 3), jnp.int32), max_new_tokens=5, max_len=4)


def test_program_size_does_not_grow_with_depth():
    def size(num_layers, remat):
        c = tiny(num_layers=num_layers, remat=remat)
        p = jax.eval_shape(c.init, jax.random.key(0))
        grad = jax.grad(lambda q: jnp.sum(c.apply(q, jnp.asarray(TOKENS))))
        return len(jax.make_jaxpr(grad)(p).eqns)  # one scan, not L layer copies

    for remat in (False, True):
        assert size(2, remat) == size(12, remat)


@pytest.mark.parametrize("policy", [None, "dots_saveable"])
def test_rotary_tables_are_computed_once_not_per_layer(policy):
    # cos/sin computed in the layer body were fused into every elementwise pass that
    # read them, once per (B, T, H, d) element and again in each remat pass
    c = tiny(num_layers=3, remat_policy=policy)
    p = c.init(jax.random.key(0))
    grad = jax.grad(lambda q: jnp.sum(c.apply(q, jnp.asarray(TOKENS))))
    hlo = jax.jit(grad).lower(p).compile().as_text()
    assert hlo.count(" cosine(") == 1 and hlo.count(" sine(") == 1


@settings(max_examples=10)
@given(st.integers(1, 6), st.lists(st.integers(0, 10), min_size=7, max_size=7))
def test_causal_logits_ignore_later_tokens(cut, other):
    c, p = tiny_model()
    changed = TOKENS.copy()
    changed[0, cut:] = other[cut:]
    a = APPLY(c, p, jnp.asarray(TOKENS))
    b = APPLY(c, p, jnp.asarray(changed))
    np.testing.assert_allclose(a[:, :cut], b[:, :cut], rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(a[1], b[1])
