"""`chunked_causal_lm_loss` equals `causal_lm_loss` of the whole logits."""

from __future__ import annotations

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from entrenar import lora, nn
from entrenar.errors import ConfigError, ShapeError
from entrenar.nn import LlamaConfig, causal_lm_loss, linear
from entrenar.nn.losses import chunked_causal_lm_loss
from entrenar.train.model_loss import causal_lm_loss_fn


def _inputs() -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    rng = np.random.default_rng(0)
    h = jnp.asarray(rng.standard_normal((3, 7, 16)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((50, 16)), jnp.float32)
    labels = rng.integers(0, 50, (3, 7))
    labels[0, 3] = labels[2, 6] = -100
    mask = np.ones((3, 7), bool)
    mask[1, 5:] = False
    return h, w, jnp.asarray(labels, jnp.int32), jnp.asarray(mask)


def _weighted(out: jax.Array) -> jax.Array:
    """A scalar that depends on every entry of ``out`` differently."""
    return jnp.sum(
        out * jnp.arange(1, out.size + 1, dtype=out.dtype).reshape(out.shape)
    )


@pytest.mark.parametrize("chunk", [1, 5, 18, 64])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_equals_whole_logits_loss_and_gradients(chunk: int, reduction: str) -> None:
    h, w, labels, mask = _inputs()

    def whole(h: jax.Array, w: jax.Array) -> jax.Array:
        out = causal_lm_loss(linear(h, w), labels, reduction, loss_mask=mask)
        return jnp.sum(
            out * jnp.arange(1, out.size + 1, dtype=out.dtype).reshape(out.shape)
        )

    def chunked(h: jax.Array, w: jax.Array) -> jax.Array:
        out = chunked_causal_lm_loss(
            h, w, labels, reduction, loss_mask=mask, chunk=chunk
        )
        return jnp.sum(
            out * jnp.arange(1, out.size + 1, dtype=out.dtype).reshape(out.shape)
        )

    np.testing.assert_allclose(chunked(h, w), whole(h, w), rtol=1e-6)
    ga = jax.grad(chunked, argnums=(0, 1))(h, w)
    gb = jax.grad(whole, argnums=(0, 1))(h, w)
    for a, b in zip(ga, gb):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=2e-5)


def test_llama_features_and_output_weight_give_apply_loss() -> None:
    cfg = LlamaConfig(
        vocab_size=40,
        hidden_size=32,
        intermediate_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
    )
    params = cfg.init(jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (2, 9), 0, 40)
    ref = causal_lm_loss(cfg.apply(params, tokens), tokens)
    got = chunked_causal_lm_loss(
        cfg.features(params, tokens), cfg.output_weight(params), tokens, chunk=4
    )
    np.testing.assert_allclose(got, ref, rtol=1e-6)
    assert cfg.output_weight(params) is params["lm_head"]["weight"]
    tied = dataclasses.replace(cfg, tie_word_embeddings=True)
    assert tied.output_weight(params) is params["model"]["embed_tokens"]["weight"]
    with pytest.raises(ShapeError, match="lm_head"):
        cfg.output_weight({"model": params["model"]})


def test_bad_arguments() -> None:
    h, w, labels, _ = _inputs()
    with pytest.raises(ConfigError, match="chunk"):
        chunked_causal_lm_loss(h, w, labels, chunk=0)
    with pytest.raises(ShapeError, match="labels"):
        chunked_causal_lm_loss(h, w, labels[:, 1:])


@pytest.mark.parametrize("matmul_dtype", [None, "bfloat16"])
def test_weight_node_head_and_mixed_precision(matmul_dtype: str | None) -> None:
    """A LoRA head takes the rematerialised path; bfloat16 matmuls the fast one."""
    h, w, labels, mask = _inputs()
    rng = np.random.default_rng(1)
    a = jnp.asarray(rng.standard_normal((2, 16)), jnp.float32)
    b = jnp.asarray(rng.standard_normal((50, 2)), jnp.float32)

    def whole(h: jax.Array, a: jax.Array, b: jax.Array) -> jax.Array:
        node = lora.LoRAWeight(w, a, b, alpha=4.0, rank=2)
        z = linear(h, node, matmul_dtype=matmul_dtype)
        return _weighted(causal_lm_loss(z, labels, "none", loss_mask=mask))

    def chunked(h: jax.Array, a: jax.Array, b: jax.Array) -> jax.Array:
        node = lora.LoRAWeight(w, a, b, alpha=4.0, rank=2)
        out = chunked_causal_lm_loss(
            h, node, labels, "none", loss_mask=mask, chunk=4, matmul_dtype=matmul_dtype
        )
        return _weighted(out)

    ga = jax.value_and_grad(chunked, argnums=(0, 1, 2))(h, a, b)
    gb = jax.value_and_grad(whole, argnums=(0, 1, 2))(h, a, b)
    for x, y in zip(jax.tree_util.tree_leaves(ga), jax.tree_util.tree_leaves(gb)):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-4)
    if matmul_dtype is not None:  # plain head: fast path vs whole logits, same dtype
        # A frozen head's dx = g ⊙ (bf16(softmax - onehot) · bf16(W)) is formed in the
        # forward pass, before g is known; the whole-logits path rounds dz ⊙ g. The
        # same numbers for g = 1 (a plain sum), bfloat16-close for other g.
        def grad_h(reduce, head):
            return jax.grad(lambda h: reduce(head(h)))(h)

        def fast(h):
            return chunked_causal_lm_loss(
                h, w, labels, "none", chunk=8, matmul_dtype="bfloat16"
            )

        def ref(h):
            z = linear(h, w, matmul_dtype="bfloat16")
            return causal_lm_loss(z, labels, "none")

        np.testing.assert_allclose(
            grad_h(jnp.sum, fast), grad_h(jnp.sum, ref), rtol=1e-5, atol=1e-5
        )
        got, exact = (
            grad_h(_weighted, fast),
            grad_h(_weighted, lambda h: causal_lm_loss(linear(h, w), labels, "none")),
        )
        err = np.linalg.norm(got - exact) / np.linalg.norm(exact)
        assert err < 1e-2, err


def test_bfloat16_parameters_get_bfloat16_gradients_close_to_float32() -> None:
    """bfloat16 hidden states and head, float32 compute: gradients in their dtypes.

    They agree with the float32 computation on the same (rounded) values.
    """
    h, w, labels, mask = _inputs()
    hb, wb = h.astype(jnp.bfloat16), w.astype(jnp.bfloat16)

    def chunked(h: jax.Array, w: jax.Array) -> jax.Array:
        out = chunked_causal_lm_loss(h, w, labels, "none", loss_mask=mask, chunk=5)
        return _weighted(out)

    loss_b = chunked(hb, wb)
    assert loss_b.dtype == jnp.float32
    dh, dw = jax.grad(chunked, argnums=(0, 1))(hb, wb)
    assert dh.dtype == jnp.bfloat16 and dw.dtype == jnp.bfloat16
    # the float32 reference on the same (bfloat16-rounded) values
    h32, w32 = hb.astype(jnp.float32), wb.astype(jnp.float32)
    np.testing.assert_allclose(loss_b, chunked(h32, w32), rtol=1e-5)
    rh, rw = jax.grad(chunked, argnums=(0, 1))(h32, w32)
    scale_h, scale_w = float(jnp.abs(rh).max()), float(jnp.abs(rw).max())
    np.testing.assert_allclose(dh.astype(jnp.float32), rh, atol=1e-2 * scale_h)
    np.testing.assert_allclose(dw.astype(jnp.float32), rw, atol=1e-2 * scale_w)


@pytest.mark.parametrize("argnums, dots", [((0,), 2), ((0, 1), 4)])
def test_a_frozen_head_forms_each_chunks_logits_once(argnums, dots) -> None:
    # frozen W: logits and dx = (softmax - onehot) W in the forward pass (two dots);
    # a trained W: logits, then logits again, dx and dW in the backward pass (four)
    h, w, labels, _ = _inputs()

    def loss(h: jax.Array, w: jax.Array) -> jax.Array:
        return chunked_causal_lm_loss(h, w, labels, chunk=8, matmul_dtype="bfloat16")

    hlo = jax.jit(jax.grad(loss, argnums)).lower(h, w).compile().as_text()
    assert len(re.findall(r"= \S+ dot\(", hlo)) == dots


def test_bfloat16_weight_head_equals_its_float32_weight_under_bfloat16_matmuls() -> (
    None
):
    from entrenar.nn import Bfloat16Weight

    h, w, labels, mask = _inputs()

    def loss(h: jax.Array, head) -> jax.Array:
        out = chunked_causal_lm_loss(
            h, head, labels, loss_mask=mask, chunk=5, matmul_dtype="bfloat16"
        )
        return out

    got = jax.value_and_grad(loss)(h, Bfloat16Weight.from_array(w))
    want = jax.value_and_grad(loss)(h, w)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-6)
    np.testing.assert_allclose(got[1], want[1], rtol=1e-5, atol=1e-6)
    hlo = jax.jit(jax.grad(loss)).lower(h, Bfloat16Weight.from_array(w)).compile()
    assert len(re.findall(r"= \S+ dot\(", hlo.as_text())) == 2  # the frozen path


def test_soft_capped_logits_give_gemma2s_apply_loss_and_gradients() -> None:
    """Gemma 2's final soft-cap reaches the Trainer's chunked loss."""
    cfg = nn.architecture("gemma2").tiny()
    assert cfg.final_logit_softcapping is not None
    params = cfg.init(jax.random.key(0))
    params = jax.tree.map(lambda a: a * 8, params)  # logits large enough to be capped
    tokens = jax.random.randint(jax.random.key(1), (2, 9), 0, cfg.vocab_size)

    def whole(p):  # the mean over the 2 x 8 predicted tokens
        return causal_lm_loss(cfg.apply(p, tokens), tokens)

    def trainer(p):
        loss, _ = causal_lm_loss_fn(cfg)(p, {"input_ids": tokens}, key=None)
        return loss

    np.testing.assert_allclose(trainer(params), whole(params), rtol=1e-6)
    uncapped = dataclasses.replace(cfg, final_logit_softcapping=None)
    assert abs(float(causal_lm_loss(uncapped.apply(params, tokens), tokens))
               - float(whole(params))) > 1e-2  # fmt: skip
    ga, gb = jax.grad(trainer)(params), jax.grad(whole)(params)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=2e-5), ga, gb)


def test_granite_logits_scaling_reaches_the_trainers_chunked_loss() -> None:
    """Granite's ``logits / logits_scaling`` reaches the Trainer's chunked loss.

    It is in `features`, so the loss equals that of ``apply``'s logits.
    """
    cfg = nn.architecture("granite").tiny()
    assert cfg.logits_scaling not in (None, 1.0)
    params = cfg.init(jax.random.key(0))
    params = jax.tree.map(lambda a: a * 8, params)  # logits far from uniform
    tokens = jax.random.randint(jax.random.key(1), (2, 9), 0, cfg.vocab_size)

    def whole(p):
        return causal_lm_loss(cfg.apply(p, tokens), tokens)

    def trainer(p):
        loss, _ = causal_lm_loss_fn(cfg)(p, {"input_ids": tokens}, key=None)
        return loss

    np.testing.assert_allclose(trainer(params), whole(params), rtol=1e-6)
    unscaled = dataclasses.replace(cfg, logits_scaling=None)
    assert abs(float(causal_lm_loss(unscaled.apply(params, tokens), tokens))
               - float(whole(params))) > 1e-2  # fmt: skip
    ga, gb = jax.grad(trainer)(params), jax.grad(whole)(params)
    close = functools.partial(np.testing.assert_allclose, rtol=1e-4, atol=2e-5)
    jax.tree.map(close, ga, gb)  # float32 rounding: gradients up to ~1 here
