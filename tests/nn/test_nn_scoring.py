"""`entrenar.nn.token_logprobs` against the log-softmax of the model's own logits."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from entrenar import nn
from entrenar.errors import ConfigError, ShapeError
from entrenar.nn.scoring import BUCKET, token_logprobs

FAMILIES = [a.name for a in nn.architectures() if a.tiny is not None]


def _reference(model, params, ids, start, top):
    """log_softmax of `apply`'s whole logits, in float64 on the host."""
    z = np.asarray(model.apply(params, jnp.asarray(ids)[None]), np.float64)[0]
    m = z.max(-1, keepdims=True)
    lp = z - m - np.log(np.exp(z - m).sum(-1, keepdims=True))
    rows = lp[start - 1 : len(ids) - 1]  # (N, V): position t-1 predicts token t
    own = rows[np.arange(len(rows)), ids[start:]]
    order = np.argsort(-rows, axis=-1, kind="stable")[:, :top]
    return own, order, np.take_along_axis(rows, order, -1)


@pytest.mark.parametrize("family", FAMILIES)
def test_scores_equal_the_log_softmax_of_apply(family):
    """Every family's head (soft caps, logit scales, tied or not) as `apply` has it.

    70 tokens: two buckets of padding and two chunks of scored positions.
    """
    model = nn.architecture(family).tiny()
    params = model.init(jax.random.key(0))
    ids = np.random.default_rng(1).integers(0, model.vocab_size, 70)
    got = token_logprobs(model, params, ids, start=3, top=4)
    own, top_ids, top_lp = _reference(model, params, ids, 3, 4)
    np.testing.assert_allclose(got.logprobs, own, atol=2e-5)
    np.testing.assert_allclose(got.top_logprobs, top_lp, atol=2e-5)
    near_ties = np.abs(np.diff(top_lp, axis=-1)).min() < 1e-5
    if not near_ties:
        np.testing.assert_array_equal(got.top_ids, top_ids)


def _llama():
    model = nn.architecture("llama").tiny()
    return model, model.init(jax.random.key(0))


def test_a_prefix_scores_the_same_as_inside_a_longer_sequence():
    """Padding after the last token changes no score (causal attention)."""
    model, params = _llama()
    ids = np.random.default_rng(2).integers(0, model.vocab_size, BUCKET + 9)
    whole = token_logprobs(model, params, ids, top=2)
    part = token_logprobs(model, params, ids[:20], top=2)
    np.testing.assert_allclose(part.logprobs, whole.logprobs[:19], atol=1e-6)
    np.testing.assert_array_equal(part.top_ids, whole.top_ids[:19])


def test_vocab_limit_leaves_out_padded_rows():
    model, params = _llama()
    ids = np.asarray([1, 2, 3, 4])
    free = token_logprobs(model, params, ids, top=model.vocab_size // 8)
    limit = int(free.top_ids.max())  # the largest id among the top: cut it off
    cut = token_logprobs(model, params, ids, top=3, vocab_limit=limit)
    assert (cut.top_ids < limit).all()
    assert (cut.logprobs > free.logprobs).all()  # the mass of the rows left out


def test_longrope_padding_stays_below_the_switch():
    """Phi-3's factors depend on the length: 60 tokens score as 60, not as 64."""
    model = nn.architecture("phi3").tiny()
    if model.rope_type != "longrope":
        pytest.skip("the tiny phi3 config has no longrope")
    model = dataclasses.replace(
        model, rope_original_max_position_embeddings=62, max_position_embeddings=128
    )
    params = model.init(jax.random.key(0))
    ids = np.random.default_rng(3).integers(0, model.vocab_size, 60)
    got = token_logprobs(model, params, ids)
    own, _, _ = _reference(model, params, ids, 1, 0)
    np.testing.assert_allclose(got.logprobs, own, atol=2e-5)


@pytest.mark.parametrize(
    ("kwargs", "error", "words"),
    [
        ({"ids": [5]}, ShapeError, "at least 2"),
        ({"start": 0}, ShapeError, "start must be"),
        ({"start": 4}, ShapeError, "start must be"),
        ({"top": 21}, ConfigError, "top must be"),
        ({"chunk": 7}, ConfigError, "chunk must divide"),
        ({"ids": [1, 10**6]}, ShapeError, "outside the vocabulary"),
        ({"ids": [1, -1]}, ShapeError, "outside the vocabulary"),
    ],
)
def test_bad_arguments_are_refused(kwargs, error, words):
    model, params = _llama()
    args = {"ids": [1, 2, 3, 4], **kwargs}
    with pytest.raises(error, match=words):
        token_logprobs(model, params, args.pop("ids"), **args)
