"""Generation refuses requests beyond the model's context and streams its steps."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from entrenar.errors import ShapeError
from entrenar.nn import (
    LlamaConfig,
    context_length,
    decode_step,
    generate,
    generate_stream,
)
from entrenar.nn.generate import prefill

# tiny models: compiled without most XLA optimizations (cold cache 9.6 -> 7.7 CPU-s)
pytestmark = pytest.mark.usefixtures("quick_compiles")

TINY = LlamaConfig(
    vocab_size=32, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2,
    num_kv_heads=1, max_position_embeddings=16,
)  # fmt: skip
PARAMS = TINY.init(jax.random.key(0))
PROMPT = jnp.arange(1, 11, dtype=jnp.int32)[None]  # (1, 10)


def test_beyond_the_context_is_refused_before_any_computation():
    assert context_length(TINY) == 16
    before = decode_step._cache_size(), prefill._cache_size()
    with pytest.raises(ShapeError, match=r"10 tokens.*= 17 exceeds.*context of 16.*6"):
        generate(TINY, PARAMS, PROMPT, max_new_tokens=7)
    with pytest.raises(ShapeError, match="context of 16"):
        generate_stream(TINY, PARAMS, PROMPT, max_new_tokens=9000)  # not iterated
    assert (decode_step._cache_size(), prefill._cache_size()) == before  # no work
    assert generate(TINY, PARAMS, PROMPT, max_new_tokens=6).shape == (1, 6)


def test_a_prompt_that_fills_the_context_is_told_to_shorten():
    """Before: "ask for at most 0 new tokens (or shorten the prompt)"."""
    long = jnp.ones((1, 16), jnp.int32)
    with pytest.raises(ShapeError) as e:
        generate(TINY, PARAMS, long, max_new_tokens=1)
    assert str(e.value).endswith(
        "exceeds the model's context of 16 tokens; the prompt alone fills it: "
        "shorten it to fewer than 16 tokens"
    )
    with pytest.raises(ShapeError, match=r"; ask for at most 6 new tokens$"):
        generate(TINY, PARAMS, PROMPT, max_new_tokens=7)


def test_stream_yields_the_steps_generate_returns():
    kw = dict(max_new_tokens=6, temperature=1.0, key=jax.random.key(3))
    steps = list(generate_stream(TINY, PARAMS, PROMPT, **kw))
    assert all(s.shape == (1,) for s in steps)
    np.testing.assert_array_equal(
        np.stack(steps, axis=1), generate(TINY, PARAMS, PROMPT, **kw)
    )


@pytest.mark.parametrize(
    ("scaling", "context"),
    [
        ({}, 16),
        ({"rope_type": "linear", "rope_factor": 2.0}, 32),
        ({"rope_type": "dynamic", "rope_factor": 4.0}, 64),
        ({"rope_type": "yarn", "rope_factor": 4.0,
          "rope_original_max_position_embeddings": 16}, 64),
        ({"rope_type": "yarn", "rope_factor": 2.0,  # max_position already extended
          "rope_original_max_position_embeddings": 4}, 16),
        ({"rope_type": "llama3", "rope_factor": 8.0,  # states the extended length
          "rope_original_max_position_embeddings": 4}, 16),
    ],
)  # fmt: skip
def test_rotary_scaling_extends_the_context_as_vllm_does(scaling, context):
    """Scaled configs reach past max_position_embeddings.

    Before, a Qwen2.5-style yarn config (max_position_embeddings 32,768, factor 4)
    refused generation past 32,768 and dynamic NTK scaling could never act.
    """
    import dataclasses

    config = dataclasses.replace(TINY, **scaling)
    assert context_length(config) == context
    params = config.init(jax.random.key(0))
    out = generate(config, params, PROMPT, max_new_tokens=context - 10)
    assert out.shape == (1, context - 10)
    with pytest.raises(ShapeError, match=f"context of {context}"):
        generate(config, params, PROMPT, max_new_tokens=context - 9)
