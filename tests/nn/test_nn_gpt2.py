"""GPT-2 against an independent numpy reference and against transformers."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from entrenar.errors import ShapeError
from entrenar.nn import (
    GPT2Config,
    conv1d_transpose,
    from_hf_names,
    generate,
    to_hf_names,
)
from entrenar.tree import assert_trees_allclose

# tiny models: compiled without most XLA optimizations (cold cache 18.2 -> 13.7 CPU-s)
pytestmark = pytest.mark.usefixtures("quick_compiles")

APPLY = jax.jit(lambda c, p, t: c.apply(p, t), static_argnums=0)
TOKENS = np.array([[1, 5, 9, 2, 7, 3], [4, 4, 8, 10, 6, 1]], np.int32)
CFG = GPT2Config(
    vocab_size=11, n_positions=12, n_embd=16, n_layer=2, n_head=4,
    initializer_range=0.2,
)  # fmt: skip


def params(c=CFG, seed=0):
    p = c.init(jax.random.key(seed))
    # Non-zero biases and gains so that every term of the forward pass is tested.
    leaves, tdef = jax.tree_util.tree_flatten(p)
    keys = jax.random.split(jax.random.key(seed + 100), len(leaves))
    noisy = [x + 0.1 * jax.random.normal(k, x.shape) for k, x in zip(keys, leaves)]
    return jax.tree_util.tree_unflatten(tdef, noisy)


def np_ln(x, w, b, eps):
    mu = x.mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(((x - mu) ** 2).mean(-1, keepdims=True) + eps) * w + b


def np_gelu(x):
    return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3)))


def np_gpt2(flat, c, tokens):
    w = {k: np.asarray(v, np.float64) for k, v in flat.items()}
    d, nh = c.n_embd, c.n_head
    hd = d // nh
    out = []
    for seq in tokens:
        t = len(seq)
        h = w["transformer.wte.weight"][seq] + w["transformer.wpe.weight"][:t]
        for i in range(c.n_layer):
            p = f"transformer.h.{i}."

            def lin(x, name, p=p):
                return x @ w[p + name + ".weight"].T + w[p + name + ".bias"]

            x = np_ln(h, w[p + "ln_1.weight"], w[p + "ln_1.bias"], 1e-5)
            qkv = lin(x, "attn.c_attn")
            q, k, v = qkv[:, :d], qkv[:, d : 2 * d], qkv[:, 2 * d :]
            heads = []
            for j in range(nh):
                sl = slice(j * hd, (j + 1) * hd)
                s = q[:, sl] @ k[:, sl].T / np.sqrt(hd)
                s = np.where(np.tril(np.ones((t, t), bool)), s, -np.inf)
                pr = np.exp(s - s.max(1, keepdims=True))
                heads.append(pr / pr.sum(1, keepdims=True) @ v[:, sl])
            h = h + lin(np.concatenate(heads, 1), "attn.c_proj")
            x = np_ln(h, w[p + "ln_2.weight"], w[p + "ln_2.bias"], 1e-5)
            h = h + lin(np_gelu(lin(x, "mlp.c_fc")), "mlp.c_proj")
        h = np_ln(h, w["transformer.ln_f.weight"], w["transformer.ln_f.bias"], 1e-5)
        out.append(h @ w["transformer.wte.weight"].T)
    return np.stack(out)


def test_gpt2_matches_numpy_reference():
    p = params()
    got = APPLY(CFG, p, jnp.asarray(TOKENS))
    assert got.shape == (2, 6, 11) and got.dtype == jnp.float32
    want = np_gpt2(to_hf_names(p), CFG, TOKENS)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-4)


def test_gpt2_matches_transformers():
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    p = params()
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(**CFG.to_hf_config()))
    flat = conv1d_transpose(to_hf_names(p))
    flat["lm_head.weight"] = flat["transformer.wte.weight"]
    state = {k: torch.from_numpy(np.array(v)) for k, v in flat.items()}
    missing, unexpected = hf.load_state_dict(state, strict=False)
    assert not unexpected and all(k.endswith("attn.bias") for k in missing)
    hf.eval()
    with torch.no_grad():
        want = hf(torch.from_numpy(TOKENS.astype(np.int64))).logits.numpy()
    np.testing.assert_allclose(
        np.asarray(APPLY(CFG, p, jnp.asarray(TOKENS))), want, rtol=1e-4, atol=1e-4
    )
    # And back: Hugging Face's state dict loads into the same tree.
    theirs = {k: v.numpy() for k, v in hf.state_dict().items()}
    assert_trees_allclose(from_hf_names(conv1d_transpose(theirs), CFG), p)


def test_gpt2_cached_generation_equals_uncached_argmax():
    p = params(seed=1)
    prompt = jnp.asarray(TOKENS[:, :2])
    got = np.asarray(generate(CFG, p, prompt, max_new_tokens=4))
    seq = prompt
    for _ in range(4):
        nxt = jnp.argmax(APPLY(CFG, p, seq)[:, -1], axis=-1).astype(jnp.int32)
        seq = jnp.concatenate([seq, nxt[:, None]], axis=1)
    np.testing.assert_array_equal(got, np.asarray(seq[:, 2:]))


def test_gpt2_dropout_uses_explicit_keys():
    import dataclasses

    c = dataclasses.replace(CFG, dropout=0.5)
    p = params()
    tok = jnp.asarray(TOKENS)
    a = c.apply(p, tok, key=jax.random.key(1))
    b = c.apply(p, tok, key=jax.random.key(1))
    d = c.apply(p, tok, key=jax.random.key(2))
    np.testing.assert_array_equal(a, b)
    assert not np.allclose(a, d)
    np.testing.assert_allclose(c.apply(p, tok), APPLY(CFG, p, tok), atol=1e-6)


def test_gpt2_errors():
    with pytest.raises(ShapeError, match="n_positions"):
        CFG.apply(params(), jnp.zeros((1, 13), jnp.int32))
    with pytest.raises(ShapeError, match="n_positions"):
        CFG.init_cache(1, 20)
