"""The next-token choice: repetition penalty, temperature, top-k, top-p, min-p.

`Sampling` holds the options; `process_logits` turns raw logits into the filtered
scores whose softmax is the sampling distribution, in Hugging Face's order and with
its formulas (`RepetitionPenaltyLogitsProcessor`, then `TemperatureLogitsWarper`,
`TopKLogitsWarper`, `TopPLogitsWarper`, `MinPLogitsWarper`); `choose` draws one
token per row inside ``jit`` (row ``r`` with key ``fold_in(key, r)``), or takes the
argmax when greedy. `raw_logprobs` reports the chosen tokens' log-probabilities
under the raw logits (before any of those steps), and the most likely alternatives:
what `entrenar.nn.token_logprobs` and a decoding step asked for them return.
Everything is array code over the whole vocabulary: no Python loop per token. The
exact math is in ``specs/models.md`` (Generation).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from entrenar.errors import ConfigError
from entrenar.types import PRNGKey

Structure = tuple[bool, int | None, bool, bool, bool, int | None]
"""`Sampling.structure`: greedy, top_k, top_p?, min_p?, penalized, vocab_limit."""

MAX_TOP = 20
"""The most alternatives per token (OpenAI's ``top_logprobs`` limit)."""


class TokenLogprobs(NamedTuple):
    """Scores of ``N`` tokens, each given the tokens before it (`raw_logprobs`).

    Attributes:
        logprobs: ``(N,)`` float32, ``log p(x_t | x_<t)`` for each scored token.
        top_ids: ``(N, top)`` int32, the most likely tokens at that position.
        top_logprobs: ``(N, top)`` float32, their log-probabilities (descending).
    """

    logprobs: np.ndarray
    top_ids: np.ndarray
    top_logprobs: np.ndarray


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How the next token is chosen; the defaults are greedy decoding.

    Attributes:
        temperature: softmax temperature; 0 is greedy (argmax).
        top_k: keep the k highest scores.
        top_p: keep the smallest set of most likely tokens whose mass reaches p
            (of tokens tied at its edge, the higher ids).
        min_p: keep tokens whose probability is at least ``min_p`` times the top one's.
        repetition_penalty: ``θ``; scores of tokens already seen (prompt included)
            are divided by ``θ`` when positive, multiplied when negative.
        vocab_limit: ids at or past it are never chosen (greedy or sampled): the
            tokenizer's size when the model's embedding has padded rows past it
            (Qwen2.5: 151,936 rows for 151,665 tokens), which no text decodes to.
    """

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    vocab_limit: int | None = None

    def __post_init__(self) -> None:
        """Check the ranges (`ConfigError` naming the option)."""
        if not self.temperature >= 0:
            raise ConfigError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k is not None and self.top_k <= 0:
            raise ConfigError(f"top_k must be positive, got {self.top_k}")
        if self.top_p is not None and not 0.0 < self.top_p <= 1.0:
            raise ConfigError(f"top_p must lie in (0, 1], got {self.top_p}")
        if self.min_p is not None and not 0.0 <= self.min_p <= 1.0:
            raise ConfigError(f"min_p must lie in [0, 1], got {self.min_p}")
        if self.repetition_penalty is not None and not self.repetition_penalty > 0:
            raise ConfigError(
                f"repetition_penalty must be > 0, got {self.repetition_penalty}"
            )
        if self.vocab_limit is not None and self.vocab_limit < 1:
            raise ConfigError(f"vocab_limit must be positive, got {self.vocab_limit}")

    @property
    def greedy(self) -> bool:
        """True when the choice is the argmax (``temperature == 0``)."""
        return self.temperature == 0

    @property
    def penalized(self) -> bool:
        """True when a repetition penalty applies (it needs the seen tokens)."""
        return self.repetition_penalty is not None and self.repetition_penalty != 1.0

    def structure(self) -> Structure:
        """The static part (what is computed): one compilation per structure."""
        return (self.greedy, self.top_k, self.top_p is not None,
                self.min_p is not None, self.penalized, self.vocab_limit)  # fmt: skip

    def values(self) -> jax.Array:
        """The traced part: ``[temperature, 1 - top_p, min_p, penalty]`` float32.

        ``1 - top_p`` is taken in float64 before the rounding to float32, as
        transformers compares with it, so a cumulated mass that lands on it
        exactly (ties) drops the same tokens.
        """
        return jnp.asarray(
            [self.temperature or 1.0, 1.0 - (self.top_p or 1.0), self.min_p or 0.0,
             self.repetition_penalty or 1.0], jnp.float32,
        )  # fmt: skip


def process_logits(
    logits: jax.Array, seen: jax.Array | None, values: jax.Array, structure: Structure
) -> jax.Array:
    """Filtered scores ``(B, V)`` float32: removed tokens at ``-inf``.

    ``logits: (B, V)``; ``seen: (B, V)`` bool, the tokens already in each row (for
    the penalty); ``values`` and ``structure`` from `Sampling`. Ids at or past the
    vocabulary limit are removed first; greedy structures then apply only the
    penalty (the filters keep the argmax).
    """
    greedy, top_k, use_top_p, use_min_p, penalized, limit = structure
    temperature, below, min_p, penalty = values[0], values[1], values[2], values[3]
    z = logits.astype(jnp.float32)  # (B, V)
    neg = jnp.float32(-jnp.inf)
    if limit is not None and limit < z.shape[-1]:
        z = jnp.where(jnp.arange(z.shape[-1]) < limit, z, neg)  # (B, V)
    if penalized and seen is not None:
        z = jnp.where(seen, jnp.where(z < 0, z * penalty, z / penalty), z)
    if greedy:
        return z
    z = z / temperature
    if top_k is not None:
        kth = jax.lax.top_k(z, min(top_k, z.shape[-1]))[0][:, -1:]  # (B, 1)
        z = jnp.where(z < kth, neg, z)
    if use_top_p:  # HF: ascending sort, drop while the cumulated mass <= 1 - p
        order = jnp.argsort(z, axis=-1, stable=True)  # (B, V); ties: lower id first
        srt = jnp.take_along_axis(z, order, axis=-1)  # (B, V) ascending
        cum = jnp.cumsum(jax.nn.softmax(srt, axis=-1), axis=-1)
        drop = (cum <= below).at[:, -1].set(False)  # the top token stays
        rows = jnp.arange(z.shape[0])[:, None]  # (B, 1)
        drop = jnp.zeros_like(drop).at[rows, order].set(drop)  # back to token order
        z = jnp.where(drop, neg, z)
    if use_min_p:
        probs = jax.nn.softmax(z, axis=-1)
        top = jnp.max(probs, axis=-1, keepdims=True)
        z = jnp.where(probs < min_p * top, neg, z)
    return z


def choose(
    logits: jax.Array,
    seen: jax.Array | None,
    key: PRNGKey | None,
    values: jax.Array,
    structure: Structure,
) -> jax.Array:
    """The next token of each row ``(B,)``; row ``r`` draws with ``fold_in(key, r)``."""
    z = process_logits(logits, seen, values, structure)
    if structure[0] or key is None:
        return jnp.argmax(z, axis=-1).astype(jnp.int32)
    rows = jnp.arange(z.shape[0], dtype=jnp.uint32)
    keys = jax.vmap(jax.random.fold_in, in_axes=(None, 0))(key, rows)
    draw = jax.vmap(jax.random.categorical)(keys, z)  # (B,)
    return draw.astype(jnp.int32)


def sample_logits(
    logits: jax.Array,
    *,
    key: PRNGKey | None,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    min_p: float | None = None,
    repetition_penalty: float | None = None,
    seen: jax.Array | None = None,
) -> jax.Array:
    """Draw one token per row of ``logits: (B, V)`` -> ``(B,)`` int32.

    ``temperature == 0`` is greedy (argmax, no key needed). Otherwise the scores of
    `process_logits` are sampled: repetition penalty on the ``seen: (B, V)`` tokens,
    division by the temperature, the ``top_k`` largest, the nucleus ``top_p``
    (Holtzman et al., 2020), and the ``min_p`` floor relative to the top token.

    >>> sample_logits(jnp.array([[0.0, 2.0, 1.0]]), key=None, temperature=0).tolist()
    [1]
    """
    s = Sampling(temperature, top_k, top_p, min_p, repetition_penalty)
    if not s.greedy and key is None:
        raise ConfigError("sampling with temperature > 0 needs key=...")
    return choose(logits, seen, key, s.values(), s.structure())


def raw_logprobs(
    logits: jax.Array,
    tokens: jax.Array,
    top: int,
    vocab_limit: int | jax.Array | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Log-probabilities of ``tokens: (N,)`` under ``logits: (N, V)``, and the best.

    With ``z`` the logits in float32, ids at or past ``vocab_limit`` set to
    ``-inf`` (rows of a padded embedding)::

        lp = z - logsumexp(z)        own[n] = lp[n, tokens[n]]

    and the ``top`` largest ``lp[n]`` with their ids (`jax.lax.top_k`: descending,
    ties to the smaller id; all ``V`` when ``top > V``). The raw model's
    probabilities: no temperature, filter or penalty (vLLM's default
    ``raw_logprobs``). Returns ``own (N,)``, ``top_ids (N, top)`` int32 and
    ``top_lp (N, top)``; ``top`` is static.

    >>> own, ids, lp = raw_logprobs(jnp.log(jnp.array([[0.5, 0.25, 0.25]])),
    ...                             jnp.array([2]), top=2)
    >>> own.tolist(), ids.tolist(), lp.tolist()
    ([-1.3862943649291992], [[0, 1]], [[-0.6931471824645996, -1.3862943649291992]])
    """
    z = logits.astype(jnp.float32)  # (N, V)
    if vocab_limit is not None:
        z = jnp.where(jnp.arange(z.shape[-1]) < vocab_limit, z, -jnp.inf)
    lp = z - jax.nn.logsumexp(z, axis=-1, keepdims=True)  # (N, V)
    own = jnp.take_along_axis(lp, tokens[:, None], axis=-1)[:, 0]  # (N,)
    if top == 0:
        n = z.shape[0]
        return own, jnp.zeros((n, 0), jnp.int32), jnp.zeros((n, 0), jnp.float32)
    top_lp, top_ids = jax.lax.top_k(lp, min(top, z.shape[-1]))  # (N, top)
    return own, top_ids.astype(jnp.int32), top_lp


def seen_tokens(ids: jax.Array, valid: jax.Array, vocab: int) -> jax.Array:
    """``(B, V)`` bool: which tokens occur among ``ids: (B, T)`` where ``valid``."""
    b = ids.shape[0]
    rows = jnp.broadcast_to(jnp.arange(b)[:, None], ids.shape)
    seen = jnp.zeros((b, vocab), bool)
    return seen.at[rows, jnp.clip(ids, 0, vocab - 1)].max(valid)


__all__ = [
    "MAX_TOP",
    "Sampling",
    "TokenLogprobs",
    "choose",
    "process_logits",
    "raw_logprobs",
    "sample_logits",
    "seen_tokens",
]
