"""`generate_stream(logprobs=StepLogprobs(k))`: each step's raw log-probabilities.

Checked against the float64 log-softmax of the model's own logits: a bigram table
(the logits of a step are the table's row of the token before: exact), sampled with
every filter on (the scores are the raw model's, not the filtered distribution),
and a tiny Llama decoding ragged prompts with a shared prefix, whose scores equal
``apply`` over the prompt and the tokens chosen.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from entrenar.errors import ConfigError
from entrenar.nn import LlamaConfig, StepLogprobs, decode_step, generate
from entrenar.nn.generate import PREFIX_BUCKET, prefill
from entrenar.nn.sampling import MAX_TOP

pytestmark = pytest.mark.usefixtures("quick_compiles")


@dataclasses.dataclass(frozen=True)
class Bigram:
    """Next-token logits are the table's row of the last token."""

    vocab: int = 7

    def init_cache(self, batch, max_len):
        return jnp.zeros((), jnp.int32)

    def apply_cached(self, table, tokens, cache):
        return table[tokens], cache + tokens.shape[1]  # (B, T, V)


def log_softmax64(z, limit=None):
    z = np.asarray(z, np.float64)
    if limit is not None:
        z = np.where(np.arange(z.shape[-1]) < limit, z, -np.inf)
    m = z.max(-1, keepdims=True)
    return z - m - np.log(np.exp(z - m).sum(-1, keepdims=True))


def test_sampled_bigram_scores_are_the_raw_log_softmax():
    """Temperature, top-k/p and a penalty change the draw, not the scores."""
    table = jnp.asarray(np.random.default_rng(0).normal(size=(7, 7)) * 2, jnp.float32)
    prompt = jnp.asarray([[1, 2], [3, 0], [6, 6]], jnp.int32)
    kw = dict(max_new_tokens=6, key=jax.random.key(3), temperature=0.7, top_k=4,
              top_p=0.9, repetition_penalty=1.3, vocab_limit=6)  # fmt: skip
    sink = StepLogprobs(top=3)
    out = np.asarray(generate(Bigram(), table, prompt, logprobs=sink, **kw))
    np.testing.assert_array_equal(out, generate(Bigram(), table, prompt, **kw))
    assert len(sink.steps) == out.shape[1] == 6
    prev = np.asarray(prompt[:, -1])
    for s, step in enumerate(sink.steps):
        want = log_softmax64(np.asarray(table)[prev], limit=6)  # (B, V)
        rows = np.arange(len(prev))
        np.testing.assert_allclose(step.logprobs, want[rows, out[:, s]], atol=1e-6)
        order = np.argsort(-want, axis=-1, kind="stable")[:, :3]
        np.testing.assert_array_equal(step.top_ids, order)
        np.testing.assert_allclose(
            step.top_logprobs, np.take_along_axis(want, order, -1), atol=1e-6
        )
        assert step.top_ids.max() < 6  # the padded id is never an alternative
        prev = out[:, s]


def noisy_llama():
    model = LlamaConfig(
        vocab_size=40, hidden_size=32, intermediate_size=48, num_layers=2,
        num_heads=4, num_kv_heads=2, rope_theta=100.0, max_position_embeddings=96,
    )  # fmt: skip
    p = model.init(jax.random.key(0))
    leaves, tdef = jax.tree_util.tree_flatten(p)
    keys = jax.random.split(jax.random.key(1), len(leaves))
    big = [x + 0.3 * jax.random.normal(k, x.shape) for k, x in zip(keys, leaves)]
    return model, jax.tree_util.tree_unflatten(tdef, big)


def test_ragged_llama_rows_score_as_the_whole_forward():
    """Shared prefix, rows of different lengths, one ending at a stop token."""
    model, params = noisy_llama()
    rng = np.random.default_rng(2)
    head = rng.integers(1, 40, size=PREFIX_BUCKET).tolist()
    rows = [head + rng.integers(1, 40, size=n).tolist() for n in (3, 9, 1)]
    free = np.asarray(generate(model, params, rows, max_new_tokens=8))
    stop = int(free[1, 2])  # row 1 ends at its third token
    sink = StepLogprobs(top=2)
    kw = dict(max_new_tokens=8, stop_tokens=[stop], pad_token=-1, logprobs=sink)
    out = np.asarray(generate(model, params, rows, **kw))
    for i, r in enumerate(rows):
        gen = [int(t) for t in out[i] if t != -1]
        got = sink.row(i, 0, len(gen))
        seq = jnp.asarray(r + gen)[None]
        want = log_softmax64(model.apply(params, seq)[0])[len(r) - 1 : -1]
        n = np.arange(len(gen))
        np.testing.assert_allclose(got.logprobs, want[n, gen], atol=2e-5)
        np.testing.assert_allclose(
            got.top_logprobs, -np.sort(-want, axis=-1)[:, :2], atol=2e-5
        )
        assert got.top_ids.shape == (len(gen), 2)
    assert (out[1, 3:] == -1).all()


def test_top_is_cut_on_the_host_and_compiled_once():
    """Any 1 <= top <= 20 runs the same programs; 0 its own; out of range refused."""
    table = jnp.asarray(np.random.default_rng(1).normal(size=(30, 30)), jnp.float32)
    prompt = jnp.zeros((2, 1), jnp.int32)
    generate(Bigram(30), table, prompt, max_new_tokens=3, logprobs=StepLogprobs(2))
    before = decode_step._cache_size(), prefill._cache_size()
    five = StepLogprobs(top=5)
    generate(Bigram(30), table, prompt, max_new_tokens=3, logprobs=five)
    assert (decode_step._cache_size(), prefill._cache_size()) == before
    assert five.steps[0].top_ids.shape == (2, 5)
    none = StepLogprobs()
    generate(Bigram(30), table, prompt, max_new_tokens=3, logprobs=none)
    assert none.steps[0].top_ids.shape == (2, 0)
    assert none.row(0, 3, 3).logprobs.shape == (0,)  # no steps: empty
    with pytest.raises(ConfigError, match="top"):
        StepLogprobs(top=MAX_TOP + 1)
