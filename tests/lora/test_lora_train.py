"""Fine-tuning a tiny Llama with LoRA and QLoRA: what training changes, what not."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from entrenar import lora, optim, quant
from entrenar.lora import LoRAConfig
from entrenar.nn import LlamaConfig
from entrenar.nn.losses import causal_lm_loss

CFG = LlamaConfig(
    vocab_size=32,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    max_position_embeddings=32,
)
LORA = LoRAConfig(rank=4, alpha=8.0, targets="all-linear")
STEPS = 40


def batch():
    """Sequences counting up modulo V from random starts: learnable from context."""
    starts = np.random.default_rng(0).integers(0, CFG.vocab_size, size=(8, 1))
    return jnp.asarray((starts + np.arange(17)) % CFG.vocab_size, jnp.int32)


def loss_fn(params, tokens):
    return causal_lm_loss(CFG.apply(params, tokens), tokens)  # next-token CE


def finetune(params):
    """Adam on the trainable half only; returns (params, losses)."""
    trainable, frozen = lora.split(params)
    opt = optim.adam(1e-2)

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(t, state, f, tokens):
        loss, g = jax.value_and_grad(lambda t: loss_fn(lora.combine(t, f), tokens))(t)
        upd, state = opt.update(g, state, t)
        return optim.apply_updates(t, upd), state, loss

    state, tokens, losses = opt.init(trainable), batch(), []
    for _ in range(STEPS):
        trainable, state, loss = step(trainable, state, frozen, tokens)
        losses.append(float(loss))
    return lora.combine(trainable, frozen), losses


@pytest.fixture(scope="module")
def base():
    return CFG.init(jax.random.key(0))


@pytest.fixture(scope="module")
def lora_run(base):
    return finetune(lora.apply(base, LORA, key=jax.random.key(1)))


def test_lora_finetune_learns_and_leaves_frozen_weights_bit_identical(base, lora_run):
    params, losses = lora_run
    assert losses[-1] < 0.7 * losses[0], losses
    _, frozen = lora.split(params)
    flat_base = jax.tree_util.tree_leaves(base)
    flat_frozen = jax.tree_util.tree_leaves(frozen)
    assert len(flat_base) == len(flat_frozen)
    for a, b in zip(flat_base, flat_frozen):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    merged = lora.fold(params)
    tokens = batch()
    np.testing.assert_allclose(
        CFG.apply(merged, tokens), CFG.apply(params, tokens), atol=1e-5, rtol=1e-5
    )
    node = params["model"]["layers"]["self_attn"]["q_proj"]["weight"]
    assert np.abs(np.asarray(node.b)).max() > 0  # adapters did train


@pytest.mark.slow
def test_qlora_reaches_the_lora_loss_within_5_percent(base, lora_run):
    qp = lora.apply(base, LORA, key=jax.random.key(1), quantize="nf4")
    node = qp["model"]["layers"]["mlp"]["up_proj"]["weight"]
    assert isinstance(node.base, quant.QuantizedWeight) and node.base.double_quant
    assert isinstance(qp["model"]["embed_tokens"]["weight"], jax.Array)
    q_before = jax.tree_util.tree_leaves(lora.split(qp)[1])
    qparams, q_losses = finetune(qp)
    _, lora_losses = lora_run
    assert abs(q_losses[-1] - lora_losses[-1]) <= 0.05 * lora_losses[-1], (
        q_losses[-1],
        lora_losses[-1],
    )
    for a, b in zip(q_before, jax.tree_util.tree_leaves(lora.split(qparams)[1])):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))  # codes frozen
    # Merge: dequantize + add (dense), or requantize with the error reported.
    tokens = batch()
    dense = lora.fold(qparams)
    assert isinstance(dense["model"]["layers"]["mlp"]["up_proj"]["weight"], jax.Array)
    np.testing.assert_allclose(
        CFG.apply(dense, tokens), CFG.apply(qparams, tokens), atol=1e-4, rtol=1e-4
    )
    requant, errors = lora.fold_and_requantize(qparams)
    up = requant["model"]["layers"]["mlp"]["up_proj"]["weight"]
    assert isinstance(up, quant.QuantizedWeight) and up.scheme == "nf4"
    assert set(errors) == {
        f"model.layers.{g}.{m}.weight"
        for g, ms in (("self_attn", "qkvo"), ("mlp", ("gate", "up", "down")))
        for m in (f"{x}_proj" for x in ms)
    }
    e = errors["model.layers.mlp.up_proj.weight"]
    ref = (
        quant.dequantize(up)
        - lora.fold(qparams)["model"]["layers"]["mlp"]["up_proj"]["weight"]
    )
    assert e.max_abs == pytest.approx(float(jnp.max(jnp.abs(ref))), rel=1e-5)
    assert 0 < e.relative_rms < 0.2
