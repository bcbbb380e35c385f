"""Log-probabilities of a sequence's own tokens, and the most likely alternatives.

For token ids ``x_0 .. x_{T-1}`` and the model's logits ``z_t`` at position ``t``
(what it predicts for ``x_{t+1}``)::

    log p(x_t | x_<t) = z_{t-1}[x_t] - logsumexp(z_{t-1})        t = start .. T-1

and the ``top`` largest entries of ``z_{t-1} - logsumexp(z_{t-1})`` with their ids
(ties broken towards the smaller id, as `jax.lax.top_k`). These are the raw model's
probabilities (no temperature, top-k/p or repetition penalty: vLLM's default
``raw_logprobs``), which is what evaluation harnesses compare (lm-evaluation-harness
sums them over a continuation and checks that each token was the most likely one).
``entrenar serve`` reports them as OpenAI's ``logprobs``.

One forward pass over the whole sequence, its features ``(T, D)`` kept, and the
head applied to the scored positions only, ``chunk`` at a time, so the ``(T, V)``
logits are never formed (a 2048-token prompt and a 152k vocabulary would be 1.2 GB
in float32). The sequence is padded to a multiple of `BUCKET` tokens (causal
attention: padding after the last token changes no earlier logit; never past a
longrope switch or a dynamic-NTK start, `entrenar.nn.generate.long_rope_switch`,
where the padded length would change the rotary), so requests of similar lengths
share one compiled program. ``vocab_limit`` leaves out the rows of
an embedding padded past the tokenizer's vocabulary, as generation does.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from entrenar.errors import ConfigError, ShapeError
from entrenar.nn.generate import _round_up, dynamic_rope_start, long_rope_switch
from entrenar.nn.matvec import check_activations, traced_activations
from entrenar.nn.sampling import MAX_TOP, TokenLogprobs, raw_logprobs
from entrenar.types import Params

BUCKET = 64
"""Sequences and scored positions are padded to multiples of this many tokens."""


@functools.partial(
    jax.jit, static_argnames=("model", "top", "chunk", "decode_activations")
)
def _score(
    model: Any,
    params: Params,
    ids: jax.Array,
    at: jax.Array,
    targets: jax.Array,
    vocab_limit: jax.Array,
    *,
    top: int,
    chunk: int,
    decode_activations: str | None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``ids: (1, Tb)``; score ``targets: (N,)`` from the logits at ``at: (N,)``."""
    with traced_activations(decode_activations):
        if hasattr(model, "logits_of_features"):
            h = model.features(params, ids)[0][at]  # (N, D)

            def head(hc: jax.Array) -> jax.Array:
                return model.logits_of_features(params, hc)  # (chunk, V)
        else:  # a model without a separate head: its whole logits
            z = model.apply(params, ids)[0][at]  # (N, V)
            h = z

            def head(hc: jax.Array) -> jax.Array:
                return hc

    def one(xs: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, ...]:
        hc, yc = xs  # (chunk, D), (chunk,)
        return raw_logprobs(head(hc), yc, top, vocab_limit)  # (chunk,), (chunk, top)

    n = at.shape[0]
    chunks = (h.reshape(n // chunk, chunk, -1), targets.reshape(n // chunk, chunk))
    own, top_ids, top_lp = jax.lax.map(one, chunks)
    return own.reshape(n), top_ids.reshape(n, top), top_lp.reshape(n, top)


def token_logprobs(
    model: Any,
    params: Params,
    ids: Sequence[int] | np.ndarray,
    *,
    start: int = 1,
    top: int = 0,
    vocab_limit: int | None = None,
    chunk: int = BUCKET,
    decode_activations: str | None = None,
) -> TokenLogprobs:
    """Score tokens ``start .. T-1`` of ``ids`` given the tokens before each.

    Args:
        model: a decoder config (`entrenar.nn.LlamaConfig` and the families; any
            model with ``apply(params, ids) -> (1, T, V)`` works, with its whole
            logits formed).
        params: its parameters.
        ids: the token ids ``(T,)``, ``T >= 2``.
        start: the first token scored (``1 <= start < T``; token 0 has no context).
        top: the most likely alternatives to return per position (0 to `MAX_TOP`).
        vocab_limit: only ids below it are possible (an embedding padded past the
            tokenizer's vocabulary); None: every row.
        chunk: positions per head product (a divisor of `BUCKET`).
        decode_activations: as in `entrenar.nn.generate`.

    Raises:
        ShapeError: fewer than 2 tokens, ``start`` out of range, or an id outside
            the vocabulary.
        ConfigError: ``top`` or ``chunk`` out of range.
    """
    x = np.asarray(ids)
    if x.ndim != 1 or x.shape[0] < 2 or not np.issubdtype(x.dtype, np.integer):
        raise ShapeError(
            f"ids must be at least 2 integer token ids (T,), got {x.shape}"
        )
    t = x.shape[0]
    if not 1 <= start < t:
        raise ShapeError(f"start must be in [1, {t - 1}] for {t} tokens, got {start}")
    if not 0 <= top <= MAX_TOP:
        raise ConfigError(f"top must be in [0, {MAX_TOP}], got {top}")
    if chunk < 1 or BUCKET % chunk:
        raise ConfigError(f"chunk must divide {BUCKET}, got {chunk}")
    if decode_activations is not None:
        check_activations(decode_activations, "decode_activations")
    limits = [v for v in (getattr(model, "vocab_size", None), vocab_limit) if v]
    limit = min(limits) if limits else None
    if limit is not None and (x.min() < 0 or x.max() >= limit):
        bad = int(x[(x < 0) | (x >= limit)][0])
        raise ShapeError(f"token id {bad} is outside the vocabulary [0, {limit})")
    tb = _round_up(t, BUCKET)
    switch, grows = long_rope_switch(model), dynamic_rope_start(model)
    if switch is not None and t <= switch < tb:
        tb = switch  # padding past L would rotate every token with the long factors
    if grows is not None and tb > grows:
        tb = max(t, grows)  # padding past M would grow the rotary base
    padded = np.zeros((1, tb), np.int32)
    padded[0, :t] = x
    n = t - start
    nb = _round_up(n, BUCKET)
    at = np.full(nb, start - 1, np.int32)  # padding rows score a real position
    at[:n] = np.arange(start - 1, t - 1)
    targets = np.zeros(nb, np.int32)
    targets[:n] = x[start:]
    own, top_ids, top_lp = _score(
        model, params, jnp.asarray(padded), jnp.asarray(at), jnp.asarray(targets),
        jnp.int32(limit if limit is not None else np.iinfo(np.int32).max),
        top=top, chunk=chunk, decode_activations=decode_activations,
    )  # fmt: skip
    return TokenLogprobs(
        np.asarray(own[:n]),
        np.asarray(top_ids[:n, :top]),
        np.asarray(top_lp[:n, :top]),
    )


__all__ = ["BUCKET", "MAX_TOP", "TokenLogprobs", "token_logprobs"]
