"""``apply_cached(..., logits_at=i)``: the logits of one position a row (prefill).

The head on each row's last prompt token only must give that position's logits of the
full ``(B, T, V)`` call (to float32 rounding: the head multiplies ``B`` rows instead
of ``B T``) and the same cache, bit for bit.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from entrenar import nn

MODELS = {
    "llama": nn.LlamaConfig(
        vocab_size=50, hidden_size=32, intermediate_size=64, num_layers=2,
        num_heads=4, num_kv_heads=2, max_position_embeddings=32,
    ),
    "gpt2": nn.GPT2Config(
        vocab_size=50, n_positions=32, n_embd=32, n_layer=2, n_head=4,
        initializer_range=0.2,
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(MODELS))
def test_logits_at_is_that_position_of_the_full_call(name):
    model = MODELS[name]
    params = model.init(jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (3, 7), 0, 50)  # (B, T)
    at = jnp.asarray([6, 2, 4], jnp.int32)  # (B,)
    cache = model.init_cache(3, 16)._replace(pos=jnp.asarray([0, 3, 5], jnp.int32))
    full, c_full = model.apply_cached(params, tokens, cache)  # (B, T, V)
    one, c_one = model.apply_cached(params, tokens, cache, logits_at=at)  # (B, 1, V)
    assert one.shape == (3, 1, 50)
    want = np.asarray(full)[np.arange(3), np.asarray(at)]  # (B, V)
    np.testing.assert_allclose(np.asarray(one[:, 0]), want, rtol=1e-5, atol=1e-5)
    for a, b in zip(jax.tree.leaves(c_full), jax.tree.leaves(c_one), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_prefill_uses_it():
    from entrenar.nn.generate import _takes_logits_at

    assert all(_takes_logits_at(m) for m in MODELS.values())

    class Older:  # a model of the protocol before logits_at: the full call
        def apply_cached(self, params, tokens, cache):
            raise NotImplementedError

    assert not _takes_logits_at(Older())
