"""A target predicted from a padded position: gradients against transformers.

A left-padded row whose labels are its tokens (padding -100) keeps its first real
token as the label of the last padded position, and transformers counts it; so
does entrenar. That position's query row has every key masked (its own and the
earlier ones are padding, the later ones causal): the row attends uniformly to all
values in both (transformers' eager attention adds ``finfo.min``, entrenar's a
finite ``-1e30``), so the losses agree. transformers' eager gradient does not: it
passes the softmax Jacobian through ``s + min`` back to ``q`` and ``k``, though the
forward does not depend on them there. entrenar's gradient is the derivative of the
forward, as transformers' own central differences say, and equals transformers'
autograd once those rows are recomputed from detached ``q`` and ``k``
(`moe_cases.EAGER`, the same forward bit for bit). specs/models.md, "Attention".
The MoE families' full gradients on this batch: test_moe_training.py.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from entrenar import nn
from entrenar.train import causal_lm_loss_fn

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
import moe_cases  # noqa: E402  (needs torch and transformers)

pytestmark = pytest.mark.usefixtures("quick_compiles")


def _hf_loss(model, tokens, mask, labels):
    t = torch.from_numpy
    return model(t(tokens), attention_mask=t(mask), labels=t(labels))


@pytest.mark.parametrize("family", ["llama", "qwen2_moe"])
def test_transformers_eager_gradient_is_not_its_derivative(family):
    """The stock eager gradient of transformers against its central differences."""
    config, _, stock = moe_cases.models(family, attention="eager")
    _, _, fixed = moe_cases.models(family)
    tokens, mask, labels = moe_cases.batch(config.vocab_size)
    out = _hf_loss(stock, tokens, mask, labels)
    ref = _hf_loss(fixed, tokens, mask, labels)
    assert torch.equal(out.logits, ref.logits)  # the same forward, bit for bit
    out.loss.backward()
    ref.loss.backward()
    name = "model.layers.0.self_attn.k_proj.weight"
    p, q = dict(stock.named_parameters())[name], dict(fixed.named_parameters())[name]
    d = torch.from_numpy(np.random.default_rng(1).normal(size=p.shape).astype("f4"))
    d /= d.norm()
    eps = 1e-2  # float32 losses: steps of 1e-3 resolve the slope to 2e-4 only
    with torch.no_grad():
        p += eps * d
        up = _hf_loss(stock, tokens, mask, labels).loss.item()
        p -= 2 * eps * d
        down = _hf_loss(stock, tokens, mask, labels).loss.item()
    diff = (up - down) / (2 * eps)
    autograd, derivative = float((p.grad * d).sum()), float((q.grad * d).sum())
    assert abs(diff - derivative) < 0.1 * abs(autograd - derivative)


@pytest.mark.parametrize("padding", ["left", "middle"])
def test_dense_gradients_equal_transformers(padding):
    """Llama, every gradient, a target predicted from a padded position."""
    config, params, model = moe_cases.models("llama")
    tokens, mask, labels = moe_cases.batch(config.vocab_size)
    if padding == "middle":  # padded keys behind the queries: no row fully masked
        mask = np.ones_like(mask)
        mask[1, 4:6] = 0
        labels = np.where(mask == 1, tokens, -100)
    _hf_loss(model, tokens, mask, labels).loss.backward()
    batch = {
        "input_ids": jnp.asarray(tokens),
        "attention_mask": jnp.asarray(mask.astype(bool)),
        "labels": jnp.asarray(labels),
    }
    grads = nn.to_hf_names(jax.grad(
        lambda p: causal_lm_loss_fn(config)(p, batch, key=None)[0]
    )(params))  # fmt: skip
    want = {n: p.grad.numpy() for n, p in model.named_parameters()}
    assert set(grads) == set(want)
    for name, g in grads.items():
        err = np.abs(np.asarray(g) - want[name]).max() / np.abs(want[name]).max()
        assert err < 5e-6, name
