"""Sampling rules and the generation loop (stop tokens, keys)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from entrenar.errors import ConfigError
from entrenar.nn import decode_step, generate, sample_logits
from entrenar.nn.generate import prefill

PROBS = np.array([0.5, 0.3, 0.15, 0.05])
LOGITS = jnp.asarray(np.tile(np.log(PROBS), (4000, 1)), jnp.float32)  # (N, V)


def draws(**kw):
    return np.asarray(sample_logits(LOGITS, key=jax.random.key(0), **kw))


def freqs(x):
    return np.bincount(x, minlength=4) / len(x)


def test_temperature_one_samples_the_softmax():
    np.testing.assert_allclose(freqs(draws(temperature=1.0)), PROBS, atol=0.03)


def test_temperature_sharpens():
    want = PROBS**2 / np.sum(PROBS**2)
    np.testing.assert_allclose(freqs(draws(temperature=0.5)), want, atol=0.03)


def test_top_k_and_top_p_restrict_the_support():
    f = freqs(draws(temperature=1.0, top_k=2))
    np.testing.assert_allclose(f, [0.625, 0.375, 0, 0], atol=0.03)
    assert f[2:].sum() == 0
    f = freqs(draws(temperature=1.0, top_p=0.7))  # 0.5 < 0.7 <= 0.8: two tokens
    assert f[2:].sum() == 0 and f[1] > 0.3
    f = freqs(draws(temperature=1.0, top_p=0.5))  # the top token alone reaches 0.5
    np.testing.assert_array_equal(f, [1, 0, 0, 0])
    f = freqs(draws(temperature=1.0, top_p=0.85))
    assert f[3] == 0 and f[2] > 0.1


def test_greedy_needs_no_key_and_sampling_does():
    assert draws(temperature=0.0).tolist() == [0] * 4000
    with pytest.raises(ConfigError, match="key"):
        sample_logits(LOGITS, key=None, temperature=1.0)
    with pytest.raises(ConfigError):
        draws(temperature=1.0, top_p=0.0)
    with pytest.raises(ConfigError):
        draws(temperature=1.0, top_k=0)


@dataclasses.dataclass(frozen=True)
class Bigram:
    """A real (if tiny) language model: next-token logits depend on the last token."""

    vocab: int = 6

    def init_cache(self, batch, max_len):
        return jnp.zeros((), jnp.int32)

    def apply_cached(self, table, tokens, cache):
        return table[tokens], cache + tokens.shape[1]  # (B, T, V)


def test_stop_tokens_pad_rows_and_end_early():
    # token i -> i + 1 deterministically; 3 is the stop token.
    table = jnp.asarray(np.eye(6, k=1)[:, :6] * 10.0, jnp.float32)
    prompt = jnp.array([[0, 1], [4, 0]], jnp.int32)
    out = np.asarray(
        generate(
            Bigram(), table, prompt, max_new_tokens=8, stop_tokens=[3], pad_token=5
        )
    )
    assert out.tolist() == [[2, 3, 5], [1, 2, 3]]


def test_sampled_generation_is_reproducible_from_its_key():
    table = jnp.asarray(np.random.default_rng(0).normal(size=(6, 6)), jnp.float32)
    prompt = jnp.zeros((3, 1), jnp.int32)
    kw = dict(max_new_tokens=10, temperature=1.0, top_k=4, top_p=0.9)
    a = generate(Bigram(), table, prompt, key=jax.random.key(1), **kw)
    b = generate(Bigram(), table, prompt, key=jax.random.key(1), **kw)
    c = generate(Bigram(), table, prompt, key=jax.random.key(2), **kw)
    np.testing.assert_array_equal(a, b)
    assert a.shape == (3, 10) and not np.array_equal(a, c)
    with pytest.raises(ConfigError, match="key"):
        generate(Bigram(), table, prompt, max_new_tokens=2, temperature=0.5)


def test_one_compiled_step_per_token():
    table = jnp.asarray(np.random.default_rng(1).normal(size=(7, 7)), jnp.float32)
    before = decode_step._cache_size(), prefill._cache_size()
    out = generate(
        Bigram(vocab=7), table, jnp.zeros((2, 3), jnp.int32), max_new_tokens=9
    )
    assert out.shape == (2, 9)
    after = decode_step._cache_size(), prefill._cache_size()
    assert (after[0] - before[0], after[1] - before[1]) == (1, 1)  # prompt, (B, 1)
