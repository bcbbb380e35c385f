"""Autoregressive generation with a KV cache: greedy, temperature, top-k, top-p.

Works with any model exposing ``init_cache(batch, max_len)`` and
``apply_cached(params, tokens, cache) -> (logits, cache)`` (`entrenar.nn.LlamaConfig`,
`entrenar.nn.GPT2Config`). The prompt is run once (prefill); every new token then costs
one jitted, cached forward step of a single position. Sampling keys are
``fold_in(key, step)``, so a run is reproducible from its key.

A request longer than the model's context (`context_length`: prompt plus
``max_new_tokens``) is refused before any work, since positions past the context were
never trained and the cache would grow with it. `generate_stream` yields each step's
tokens as they come; `generate` collects them. Neither knows a tokenizer: stopping at
the end of a turn is the caller's ``stop_tokens`` (`entrenar.chat` passes the
model's end-of-turn ids by default).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Sequence
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


def context_length(model: Any) -> int | None:
    """Longest sequence ``model`` was trained for, or None when it does not say.

    Reads ``max_position_embeddings`` (`entrenar.nn.LlamaConfig`) or ``n_positions``
    (`entrenar.nn.GPT2Config`).

    >>> from entrenar.nn import LlamaConfig
    >>> context_length(LlamaConfig.smollm2_135m())
    8192
    """
    for name in ("max_position_embeddings", "n_positions"):
        n = getattr(model, name, None)
        if isinstance(n, int) and n > 0:
            return n
    return None


def check_length(model: Any, prompt_len: int, max_new_tokens: int) -> None:
    """Raise `ShapeError` unless ``prompt_len + max_new_tokens`` fits the context."""
    if max_new_tokens < 0:
        raise ConfigError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    ctx = context_length(model)
    if ctx is not None and prompt_len + max_new_tokens > ctx:
        raise ShapeError(
            f"prompt ({prompt_len} tokens) + max_new_tokens ({max_new_tokens}) = "
            f"{prompt_len + max_new_tokens} exceeds the model's context of {ctx} "
            f"tokens; ask for at most {max(ctx - prompt_len, 0)} new tokens"
            + (" (or shorten the prompt)" if prompt_len >= ctx else "")
        )


def generate_stream(
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
) -> Iterator[np.ndarray]:
    """Yield the next token of each row, ``(B,)`` int, one step at a time.

    Same arguments and rules as `generate` (which collects these steps). The checks
    run when the generator is created, before the first ``next``: a request beyond
    the model's context raises there.
    """
    prompt = jnp.asarray(prompt)
    if prompt.ndim != 2 or prompt.shape[1] == 0:
        raise ShapeError(f"prompt must be (batch, time>=1), got {prompt.shape}")
    if temperature > 0 and key is None:
        raise ConfigError("sampling with temperature > 0 needs key=...")
    t0 = prompt.shape[1]
    check_length(model, t0, max_new_tokens)
    max_len = t0 + max_new_tokens if max_len is None else max_len
    if t0 + max_new_tokens > max_len:
        raise ShapeError(
            f"prompt ({t0}) + max_new_tokens ({max_new_tokens}) exceeds the cache "
            f"length max_len={max_len}"
        )
    sampling = dict(temperature=float(temperature), top_k=top_k, top_p=top_p)
    stops = np.asarray(list(stop_tokens), dtype=np.int64)
    return _steps(
        model, params, prompt, max_new_tokens, key, sampling, stops, pad_token, max_len
    )


def _steps(
    model: Any,
    params: Params,
    prompt: jax.Array,
    max_new_tokens: int,
    key: PRNGKey | None,
    sampling: dict[str, Any],
    stops: np.ndarray,
    pad_token: int,
    max_len: int,
) -> Iterator[np.ndarray]:
    """The decoding loop of `generate_stream` (after its checks)."""
    b = prompt.shape[0]
    cache = model.init_cache(b, max_len)
    done = np.zeros(b, dtype=bool)
    tokens = prompt
    for step in range(max_new_tokens):
        k = None if key is None else jax.random.fold_in(key, step)
        nxt, cache = decode_step(model, params, tokens, cache, k, **sampling)
        row = np.where(done, pad_token, np.asarray(nxt))  # (B,)
        done |= np.isin(row, stops)
        yield row
        if done.all():
            return
        tokens = jnp.asarray(row, jnp.int32)[:, None]  # (B, 1)


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
    generation ends early once every row has stopped. Without ``stop_tokens`` it runs
    all ``max_new_tokens`` steps (`entrenar.chat` stops at the end of a turn).

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

    Raises:
        ShapeError: ``T0 + max_new_tokens`` exceeds the model's `context_length`
            (checked before any computation) or ``max_len``.
        ConfigError: sampling without a key, or a negative ``max_new_tokens``.
    """
    steps = generate_stream(
        model, params, prompt, max_new_tokens=max_new_tokens, key=key,
        temperature=temperature, top_k=top_k, top_p=top_p, stop_tokens=stop_tokens,
        pad_token=pad_token, max_len=max_len,
    )  # fmt: skip
    out = list(steps)
    if not out:
        return jnp.zeros((jnp.shape(prompt)[0], 0), jnp.int32)
    return jnp.asarray(np.stack(out, axis=1), jnp.int32)  # (B, N)


__all__ = [
    "check_length",
    "context_length",
    "decode_step",
    "generate",
    "generate_stream",
    "sample_logits",
]
