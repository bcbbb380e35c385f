"""Autoregressive generation with a KV cache: greedy, temperature, top-k, top-p.

Works with any model exposing ``init_cache(batch, max_len)`` and
``apply_cached(params, tokens, cache) -> (logits, cache)`` (`entrenar.nn.LlamaConfig`,
`entrenar.nn.GPT2Config`). The prompt is run once (prefill); every new token then costs
one jitted, cached forward step of a single position. Sampling keys are
``fold_in(key, step)``, so a run is reproducible from its key.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from entrenar.errors import ConfigError, ShapeError
from entrenar.types import Params, PRNGKey


def sample_logits(
    logits: jax.Array,
    *,
    key: PRNGKey | None,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
) -> jax.Array:
    """Draw one token per row of ``logits: (B, V)`` -> ``(B,)`` int32.

    ``temperature == 0`` is greedy (argmax, no key needed). Otherwise the logits are
    divided by the temperature, restricted to the ``top_k`` largest and then to the
    smallest set of most likely tokens whose probability reaches ``top_p`` (nucleus
    sampling, Holtzman et al., 2020), and sampled from the softmax of the rest.

    >>> sample_logits(jnp.array([[0.0, 2.0, 1.0]]), key=None, temperature=0).tolist()
    [1]
    """
    if temperature < 0:
        raise ConfigError(f"temperature must be >= 0, got {temperature}")
    if temperature == 0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if key is None:
        raise ConfigError("sampling with temperature > 0 needs key=...")
    z = logits.astype(jnp.float32) / jnp.float32(temperature)  # (B, V)
    neg = jnp.float32(-jnp.inf)
    if top_k is not None:
        if top_k <= 0:
            raise ConfigError(f"top_k must be positive, got {top_k}")
        kth = jax.lax.top_k(z, min(top_k, z.shape[-1]))[0][:, -1:]  # (B, 1)
        z = jnp.where(z < kth, neg, z)
    if top_p is not None:
        if not 0.0 < top_p <= 1.0:
            raise ConfigError(f"top_p must lie in (0, 1], got {top_p}")
        srt = jnp.sort(z, axis=-1)[:, ::-1]  # (B, V) descending
        probs = jax.nn.softmax(srt, axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs  # mass of strictly better tokens
        kept = jnp.where(before < jnp.float32(top_p), srt, jnp.float32(jnp.inf))
        cutoff = jnp.min(kept, axis=-1, keepdims=True)  # (B, 1) smallest kept logit
        z = jnp.where(z < cutoff, neg, z)
    return jax.random.categorical(key, z, axis=-1).astype(jnp.int32)


@functools.partial(
    jax.jit,
    static_argnames=("model", "temperature", "top_k", "top_p"),
    donate_argnames=("cache",),
)
def decode_step(
    model: Any,
    params: Params,
    tokens: jax.Array,
    cache: Any,
    key: PRNGKey | None,
    *,
    temperature: float,
    top_k: int | None,
    top_p: float | None,
) -> tuple[jax.Array, Any]:
    """Run ``tokens: (B, T)`` through the cache and sample the next token ``(B,)``."""
    logits, cache = model.apply_cached(params, tokens, cache)  # (B, T, V)
    nxt = sample_logits(
        logits[:, -1], key=key, temperature=temperature, top_k=top_k, top_p=top_p
    )
    return nxt, cache


def generate(
    model: Any,
    params: Params,
    prompt: jax.Array,
    *,
    max_new_tokens: int,
    key: PRNGKey | None = None,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    stop_tokens: Sequence[int] = (),
    pad_token: int = 0,
    max_len: int | None = None,
) -> jax.Array:
    """Continue ``prompt: (B, T0)``; return the new tokens ``(B, N)``, ``N <= max_new``.

    A row that emits a stop token keeps it and is padded with ``pad_token`` afterwards;
    generation ends early once every row has stopped.

    Args:
        model: a model config with ``init_cache`` and ``apply_cached``.
        params: its parameters.
        prompt: int token ids ``(B, T0)``, ``T0 >= 1``; all rows have the same length.
        max_new_tokens: at most this many tokens per row.
        key: sampling key; required unless ``temperature == 0`` (greedy).
        temperature: softmax temperature; 0 is greedy argmax.
        top_k: keep only the k most likely tokens.
        top_p: nucleus sampling mass.
        stop_tokens: token ids that end a row.
        pad_token: filler after a row has stopped.
        max_len: cache length; defaults to ``T0 + max_new_tokens``.
    """
    prompt = jnp.asarray(prompt)
    if prompt.ndim != 2 or prompt.shape[1] == 0:
        raise ShapeError(f"prompt must be (batch, time>=1), got {prompt.shape}")
    if temperature > 0 and key is None:
        raise ConfigError("sampling with temperature > 0 needs key=...")
    b, t0 = prompt.shape
    max_len = t0 + max_new_tokens if max_len is None else max_len
    if t0 + max_new_tokens > max_len:
        raise ShapeError(
            f"prompt ({t0}) + max_new_tokens ({max_new_tokens}) exceeds the cache "
            f"length max_len={max_len}"
        )
    sampling = dict(temperature=float(temperature), top_k=top_k, top_p=top_p)
    stops = np.asarray(list(stop_tokens), dtype=np.int64)
    cache = model.init_cache(b, max_len)
    done = np.zeros(b, dtype=bool)
    out: list[np.ndarray] = []
    tokens = prompt
    for step in range(max_new_tokens):
        k = None if key is None else jax.random.fold_in(key, step)
        nxt, cache = decode_step(model, params, tokens, cache, k, **sampling)
        row = np.asarray(nxt)
        row = np.where(done, pad_token, row)
        out.append(row)
        done |= np.isin(row, stops)
        if done.all():
            break
        tokens = jnp.asarray(row, jnp.int32)[:, None]  # (B, 1)
    if not out:
        return jnp.zeros((b, 0), jnp.int32)
    return jnp.asarray(np.stack(out, axis=1), jnp.int32)  # (B, N)


__all__ = ["decode_step", "generate", "sample_logits"]
