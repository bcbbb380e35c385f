"""Logit processing equals Hugging Face's; top-k=1 is greedy; seeds reproduce."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from entrenar.errors import ConfigError
from entrenar.nn.sampling import Sampling, process_logits, sample_logits, seen_tokens

torch = pytest.importorskip("torch")
lp = pytest.importorskip("transformers.generation.logits_process")

B, V, T = 6, 300, 12
CASES = [
    Sampling(temperature=0.7),
    Sampling(temperature=1.0, top_k=17),
    Sampling(temperature=1.3, top_p=0.8),
    Sampling(temperature=0.9, min_p=0.05),
    Sampling(temperature=1.0, repetition_penalty=1.3),
    Sampling(temperature=0.5, repetition_penalty=0.8),
    Sampling(temperature=0.8, top_k=40, top_p=0.9, min_p=0.02, repetition_penalty=1.2),
    Sampling(temperature=1.0, top_k=1),
    Sampling(temperature=2.0, top_p=1.0, min_p=0.0),
    Sampling(temperature=1.0, top_k=8, top_p=0.6),  # ties: a mass of exactly 1 - p
]


def hf_scores(s: Sampling, ids: np.ndarray, logits: np.ndarray) -> np.ndarray:
    """The scores after transformers' own processors, in generate's order."""
    procs = []
    if s.repetition_penalty is not None:
        procs.append(lp.RepetitionPenaltyLogitsProcessor(s.repetition_penalty))
    procs.append(lp.TemperatureLogitsWarper(s.temperature))
    if s.top_k is not None:
        procs.append(lp.TopKLogitsWarper(s.top_k))
    if s.top_p is not None:
        procs.append(lp.TopPLogitsWarper(s.top_p))
    if s.min_p is not None:
        procs.append(lp.MinPLogitsWarper(s.min_p))
    ti, z = torch.from_numpy(ids.astype(np.int64)), torch.from_numpy(logits)
    for p in procs:
        z = p(ti, z)
    return z.numpy()


def softmax(z: np.ndarray) -> np.ndarray:
    e = np.exp(z - z.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


@pytest.mark.parametrize("s", CASES, ids=str)
@pytest.mark.parametrize("seed", [0, 1])
def test_filtered_distribution_equals_transformers(s, seed):
    rng = np.random.default_rng(seed)
    logits = (rng.normal(size=(B, V)) * 3).astype(np.float32)
    ids = rng.integers(0, V, size=(B, T))
    seen = seen_tokens(jnp.asarray(ids, jnp.int32), jnp.ones((B, T), bool), V)
    ours = np.asarray(
        process_logits(jnp.asarray(logits), seen, s.values(), s.structure())
    )
    want = hf_scores(s, ids, logits)
    np.testing.assert_array_equal(np.isneginf(ours), np.isneginf(want))
    np.testing.assert_allclose(softmax(ours), softmax(want), atol=1e-6, rtol=0)


@pytest.mark.parametrize("s", CASES, ids=str)
def test_ties_keep_as_many_tokens_as_transformers(s):
    """Integer logits tie everywhere, at the top-k, top-p and min-p boundaries too.

    transformers keeps the smallest set whose mass reaches ``p``; which of the
    tokens tied at its edge it keeps follows torch's (unstable) sort, so the
    kept sets are compared by size and the probabilities sorted.
    """
    rng = np.random.default_rng(5)
    logits = rng.integers(-3, 4, size=(64, 40)).astype(np.float32)
    logits[0, :10] = 9.0  # ten of 0.1: the mass reaches 1 - p = 0.4 exactly
    ids = rng.integers(0, 40, size=(64, T))
    seen = seen_tokens(jnp.asarray(ids, jnp.int32), jnp.ones((64, T), bool), 40)
    ours = np.asarray(
        process_logits(jnp.asarray(logits), seen, s.values(), s.structure())
    )
    want = hf_scores(s, ids, logits)
    np.testing.assert_array_equal(
        np.isneginf(ours).sum(axis=-1), np.isneginf(want).sum(axis=-1)
    )
    np.testing.assert_allclose(
        np.sort(softmax(ours)), np.sort(softmax(want)), atol=1e-6, rtol=0
    )
    if s.top_p is None:  # no sort involved: the same tokens
        np.testing.assert_array_equal(np.isneginf(ours), np.isneginf(want))


def test_greedy_penalty_is_transformers_argmax():
    rng = np.random.default_rng(3)
    logits = rng.normal(size=(B, V)).astype(np.float32)
    ids = rng.integers(0, V, size=(B, T))
    seen = seen_tokens(jnp.asarray(ids, jnp.int32), jnp.ones((B, T), bool), V)
    got = sample_logits(
        jnp.asarray(logits), key=None, temperature=0, repetition_penalty=1.5, seen=seen
    )
    proc = lp.RepetitionPenaltyLogitsProcessor(1.5)
    want = proc(torch.from_numpy(ids), torch.from_numpy(logits)).argmax(-1).numpy()
    np.testing.assert_array_equal(np.asarray(got), want)


def test_top_k_one_is_greedy_and_a_seed_reproduces():
    logits = jax.random.normal(jax.random.key(0), (64, V))
    greedy = sample_logits(logits, key=None, temperature=0)
    for key in range(3):
        one = sample_logits(logits, key=jax.random.key(key), temperature=1.0, top_k=1)
        np.testing.assert_array_equal(one, greedy)
    kw = dict(temperature=1.0, top_p=0.9, min_p=0.01)
    a = sample_logits(logits, key=jax.random.key(7), **kw)
    b = sample_logits(logits, key=jax.random.key(7), **kw)
    c = sample_logits(logits, key=jax.random.key(8), **kw)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)
    # Row r draws with fold_in(key, r): a row draws the same in any batch.
    np.testing.assert_array_equal(
        sample_logits(logits[:5], key=jax.random.key(7), **kw), a[:5]
    )


@pytest.mark.parametrize(
    "bad",
    [
        dict(min_p=1.5),
        dict(min_p=-0.1),
        dict(repetition_penalty=0.0),
        dict(top_p=0.0),
        dict(top_k=0),
        dict(temperature=-1.0),
    ],
)
def test_options_out_of_range_are_refused(bad):
    with pytest.raises(ConfigError):
        Sampling(**{"temperature": 1.0, **bad})


@pytest.mark.parametrize(
    "s", [Sampling(), Sampling(1.0, top_k=5), Sampling(0.7, top_p=0.9)]
)
def test_vocab_limit_removes_the_ids_past_it(s):
    """Scores with ``vocab_limit=L`` are the first ``L`` columns' scores, then -inf."""
    rng = np.random.default_rng(4)
    logits = (rng.normal(size=(B, V)) * 3).astype(np.float32)
    logits[:, V - 3 :] = 50.0  # the padding would win
    limited = dataclasses.replace(s, vocab_limit=V - 3)
    got = np.asarray(
        process_logits(jnp.asarray(logits), None, limited.values(), limited.structure())
    )
    want = np.asarray(
        process_logits(jnp.asarray(logits[:, : V - 3]), None, s.values(), s.structure())
    )
    assert np.isneginf(got[:, V - 3 :]).all()
    np.testing.assert_allclose(softmax(got)[:, : V - 3], softmax(want), atol=1e-6)
    with pytest.raises(ConfigError, match="vocab_limit"):
        Sampling(vocab_limit=0)
