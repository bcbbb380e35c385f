"""Ragged prompts decoded together equal each prompt decoded alone."""

import jax
import numpy as np
import pytest

from entrenar.errors import ConfigError
from entrenar.nn import GPT2Config, LlamaConfig, decode_step, generate
from entrenar.nn.generate import (
    PREFIX_BUCKET,
    find_stop,
    partial_stop,
    prefill,
    share_prefix,
)

LLAMA = LlamaConfig(
    vocab_size=50, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
    num_kv_heads=2, rope_theta=100.0, max_position_embeddings=64,
)  # fmt: skip
GPT2 = GPT2Config(vocab_size=50, n_positions=64, n_embd=32, n_layer=2, n_head=4)
LENGTHS = (5, 13, 1, 8)

# tiny models: compiled without most XLA optimizations (cold cache 29.0 -> 20.0 CPU-s)
pytestmark = pytest.mark.usefixtures("quick_compiles")


def noisy_params(model, seed=0):
    """Random params with large enough weights that the logits have clear maxima."""
    p = model.init(jax.random.key(seed))
    leaves, tdef = jax.tree_util.tree_flatten(p)
    keys = jax.random.split(jax.random.key(seed + 1), len(leaves))
    big = [x + 0.3 * jax.random.normal(k, x.shape) for k, x in zip(keys, leaves)]
    return jax.tree_util.tree_unflatten(tdef, big)


def prompts(vocab, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(1, vocab, size=n).tolist() for n in LENGTHS]


@pytest.mark.parametrize("model", [LLAMA, GPT2], ids=["llama", "gpt2"])
def test_ragged_batch_equals_each_prompt_alone(model):
    params = noisy_params(model)
    rows = prompts(50)
    together = np.asarray(generate(model, params, rows, max_new_tokens=10))
    assert together.shape == (len(rows), 10)
    for i, r in enumerate(rows):
        alone = np.asarray(generate(model, params, [r], max_new_tokens=10))
        np.testing.assert_array_equal(together[i], alone[0], err_msg=f"row {i}")


def test_ragged_rows_stop_each_on_their_own():
    params = noisy_params(LLAMA)
    rows = prompts(50, seed=1)
    free = np.asarray(generate(LLAMA, params, rows, max_new_tokens=12))
    stop = int(free[1, 3])  # row 1 stops at its 4th token (others maybe earlier)
    out = np.asarray(
        generate(
            LLAMA, params, rows, max_new_tokens=12, stop_tokens=[stop], pad_token=-1
        )
    )
    for i in range(len(rows)):
        hits = np.nonzero(free[i] == stop)[0]
        n = hits[0] + 1 if len(hits) else 12
        np.testing.assert_array_equal(out[i, :n], free[i, :n])
        assert (out[i, n:] == -1).all()
    ends = [np.nonzero(f == stop)[0][:1] + 1 for f in free]
    assert out.shape[1] == max(int(e[0]) if len(e) else 12 for e in ends)


def test_sampled_rows_draw_as_alone_and_reproduce():
    params = noisy_params(LLAMA)
    rows = prompts(50, seed=2)
    kw = dict(max_new_tokens=8, temperature=1.0, top_p=0.9, key=jax.random.key(5))
    a = np.asarray(generate(LLAMA, params, rows, **kw))
    np.testing.assert_array_equal(a, generate(LLAMA, params, rows, **kw))
    np.testing.assert_array_equal(a[:1], generate(LLAMA, params, rows[:1], **kw))


def test_repetition_penalty_counts_the_prompt():
    params = noisy_params(LLAMA)
    rows = prompts(50, seed=3)
    plain = np.asarray(generate(LLAMA, params, rows, max_new_tokens=16))
    pen = np.asarray(
        generate(LLAMA, params, rows, max_new_tokens=16, repetition_penalty=1e6)
    )
    for r, p, q in zip(rows, pen, plain):  # a huge penalty: nothing seen comes back
        seen = set(r)
        for t in p.tolist():
            assert t not in seen
            seen.add(t)
        assert len(set(q.tolist()) | set(r)) < len(r) + 16  # plain decoding repeats


def test_one_compilation_per_bucket():
    params = noisy_params(LLAMA)
    generate(LLAMA, params, prompts(50, seed=4), max_new_tokens=6)
    before = decode_step._cache_size(), prefill._cache_size()
    other = [[3] * 2, [4] * 11, [5] * 7, [6] * 9]  # other lengths, same bucket
    generate(LLAMA, params, other, max_new_tokens=5)
    assert (decode_step._cache_size(), prefill._cache_size()) == before


def test_stop_strings_end_rows_across_token_boundaries():
    class Letters:  # token i is the letter chr(97 + i % 26)
        @staticmethod
        def decode(ids):
            return "".join(chr(97 + i % 26) for i in ids)

    params = noisy_params(LLAMA)
    rows = prompts(50, seed=5)
    free = np.asarray(generate(LLAMA, params, rows, max_new_tokens=10))
    text = Letters.decode(free[0].tolist())
    stop = text[3:5]  # spans the 4th and 5th tokens
    first = text.find(stop)
    out = np.asarray(
        generate(
            LLAMA,
            params,
            rows,
            max_new_tokens=10,
            stop_strings=[stop],
            tokenizer=Letters(),
            pad_token=-1,
        )
    )
    assert out[0, : first + 2].tolist() == free[0, : first + 2].tolist()
    assert (out[0, first + 2 :] == -1).all()
    with pytest.raises(ConfigError, match="tokenizer"):
        generate(LLAMA, params, rows, max_new_tokens=2, stop_strings=["x"])


def test_find_and_partial_stop():
    assert find_stop("ab\ncd", ["\n", "c"]) == 2
    assert find_stop("abc", ["x"]) is None
    assert find_stop("xx-yy", ["-"], start=3) is None
    assert partial_stop("2024-01<", ["<|im_end|>", "<b"]) == 1
    assert partial_stop("ok <|im", ["<|im_end|>"]) == 4
    assert partial_stop("done", ["\n\n"]) == 0


@pytest.mark.parametrize("model", [LLAMA, GPT2], ids=["llama", "gpt2"])
def test_a_shared_prefix_is_run_once_and_changes_nothing(model):
    params = noisy_params(model)
    rng = np.random.default_rng(6)
    head = rng.integers(1, 50, size=PREFIX_BUCKET + 3).tolist()
    rows = [head + rng.integers(1, 50, size=n).tolist() for n in (3, 9, 1, 6)]
    before = share_prefix._cache_size()
    together = np.asarray(generate(model, params, rows, max_new_tokens=8))
    assert share_prefix._cache_size() == before + 1  # the prefix went this way
    for i, r in enumerate(rows):
        alone = np.asarray(generate(model, params, [r], max_new_tokens=8))
        np.testing.assert_array_equal(together[i], alone[0], err_msg=f"row {i}")
    pen = np.asarray(
        generate(model, params, rows, max_new_tokens=8, repetition_penalty=1e6)
    )
    for r, p in zip(rows, pen):  # the shared tokens count as seen too
        assert not set(p.tolist()) & set(r)
