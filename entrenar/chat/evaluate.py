"""Exact match of greedy replies on a chat dataset, in one forward pass per batch.

For a conversation whose assistant reply has tokens ``y_1 .. y_n`` followed by the
end-of-turn token ``y_{n+1}``, greedy decoding (`ChatModel.reply`) returns exactly
that reply iff, for every ``i <= n + 1``,

    argmax_v p(v | prompt, y_1 .. y_{i-1}) = y_i

(decoding emits ``y_1``; given it, emits ``y_2``; ...; then ends the turn). Those
conditional distributions are the logits of one teacher-forced forward pass over
``prompt + reply``, so the check needs no token-by-token loop: the ``labels`` of
`entrenar.data.encode_records` (format ``"chat"``) mark the reply tokens, and a record
counts when the argmax at every position before a labelled token equals that token,
up to and including the first end-of-turn token of each reply (the template's text
after it, such as a newline, is never generated and is not compared). The two
computations can differ only where two logits tie to float rounding.

``generate=True`` decodes instead: each reply's prompt (the tokens before its
labelled run) is continued greedily by `entrenar.nn.generate`, ``batch_size`` prompts
of different lengths at a time, until the end-of-turn token or as many tokens as the
longest reply has; a reply counts when the generated tokens begin with its tokens.
The two modes agree (same ties aside); decoding also returns the replies' text.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from entrenar import data, nn
from entrenar.chat.session import ChatModel
from entrenar.errors import ConfigError
from entrenar.nn.generate import CACHE_BUCKET


@dataclasses.dataclass(frozen=True)
class ExactMatch:
    """Result of `exact_match`.

    Attributes:
        accuracy: ``correct / total``.
        correct: records whose every reply greedy decoding reproduces exactly.
        total: records evaluated.
        hits: per record, whether it counted.
        replies: with ``generate=True``, per record the decoded text of each of
            its replies (cut at the end-of-turn token); empty otherwise.
    """

    accuracy: float
    correct: int
    total: int
    hits: tuple[bool, ...]
    replies: tuple[tuple[str, ...], ...] = ()


def reply_targets(labels: np.ndarray, stops: Sequence[int]) -> np.ndarray:
    """``labels`` with each labelled run cut after its first stop token.

    >>> reply_targets(np.array([-100, 5, 6, 2, 9, -100]), [2]).tolist()
    [-100, 5, 6, 2, -100, -100]
    """
    out = labels.copy()
    cut = False
    for t, y in enumerate(labels):
        if y == data.IGNORE_INDEX:
            cut = False
        elif cut:
            out[t] = data.IGNORE_INDEX
        elif int(y) in stops:
            cut = True
    return out


@functools.partial(jax.jit, static_argnames=("model",))
def _argmax(model: Any, params: Any, ids: jax.Array) -> jax.Array:
    return jnp.argmax(model.apply(params, ids), axis=-1).astype(jnp.int32)  # (B, T)


def _runs(y: np.ndarray) -> list[tuple[int, int]]:
    """``(start, end)`` of each labelled run of ``y``."""
    at = np.nonzero(y != data.IGNORE_INDEX)[0]
    if not len(at):
        return []
    breaks = np.nonzero(np.diff(at) > 1)[0]
    starts = [int(at[0]), *(int(at[i + 1]) for i in breaks)]
    ends = [*(int(at[i]) + 1 for i in breaks), int(at[-1]) + 1]
    return list(zip(starts, ends, strict=True))


def _decoded(
    chat: ChatModel,
    enc: Sequence[tuple[np.ndarray, np.ndarray]],
    targets: Sequence[np.ndarray],
    batch_size: int,
) -> tuple[list[bool], list[tuple[str, ...]]]:
    """Hits and reply texts of greedy decoding (the ``generate=True`` mode)."""
    items = [(i, enc[i][0][:a], targets[i][a:b])
             for i in range(len(enc)) for a, b in _runs(targets[i])]  # fmt: skip
    n = max(len(y) for _, _, y in items)  # one decode length and one cache length:
    longest = max(len(p) for _, p, _ in items) + n  # one compile for all batches
    cache = -(-longest // CACHE_BUCKET) * CACHE_BUCKET
    cache = min(cache, nn.context_length(chat.model) or cache)
    stops = chat.stops
    ok = [True] * len(enc)
    texts: list[list[str]] = [[] for _ in enc]
    for s in range(0, len(items), batch_size):
        chunk = items[s : s + batch_size]
        prompts = [list(p) for _, p, _ in chunk]
        if len(items) > batch_size:  # a short last batch: fill it, one shape
            prompts += prompts[:1] * (batch_size - len(chunk))
        out = np.asarray(
            nn.generate(
                chat.model,
                chat.params,
                prompts,
                max_new_tokens=n,
                stop_tokens=stops,
                pad_token=-1,
                max_len=cache,
                decode_activations=chat.decode_activations,
            )
        )
        for row, (i, _, y) in zip(out[: len(chunk)], chunk, strict=True):
            got = [int(t) for t in row if t >= 0]
            ok[i] &= got[: len(y)] == [int(t) for t in y]
            texts[i].append(chat.tokenizer.decode([t for t in got if t not in stops]))
    return ok, [tuple(t) for t in texts]


def exact_match(
    chat: ChatModel,
    records: Sequence[Mapping[str, Any]] | data.Records,
    *,
    batch_size: int = 16,
    generate: bool = False,
) -> ExactMatch:
    """Fraction of chat records whose replies greedy decoding reproduces exactly.

    Args:
        chat: the model, tokenizer and template to evaluate.
        records: chat records (``{"messages": [...]}``), e.g. from
            `entrenar.data.load_records` of a JSONL file.
        batch_size: records per forward pass (rows are padded to one length, so
            the forward pass compiles once), or replies decoded at once.
        generate: decode the replies (see the module docstring) instead of one
            teacher-forced pass; slower, and it returns the replies' text.

    Raises:
        ConfigError: a record without an assistant reply.
    """
    if batch_size < 1:
        raise ConfigError(f"batch_size must be >= 1, got {batch_size}")
    enc = data.encode_records(
        records, chat.tokenizer, format="chat", chat_template=chat.template
    )
    if not enc:
        return ExactMatch(0.0, 0, 0, ())
    stops = chat.stops
    targets = [reply_targets(lab, stops) for _, lab in enc]
    for i, y in enumerate(targets):
        if (y == data.IGNORE_INDEX).all():
            raise ConfigError(f"record {i} has no assistant reply to compare")
    if generate:
        decoded, replies = _decoded(chat, enc, targets, batch_size)
        correct = sum(decoded)
        n = len(decoded)
        return ExactMatch(correct / n, correct, n, tuple(decoded), tuple(replies))
    t_max = -(-max(len(ids) for ids, _ in enc) // 8) * 8  # one shape: one compile
    pad = int(getattr(chat.tokenizer, "pad_id", None) or stops[0])
    hits: list[bool] = []
    for s in range(0, len(enc), batch_size):
        chunk = range(s, min(s + batch_size, len(enc)))
        ids = np.full((batch_size, t_max), pad, np.int32)  # (B, T) right-padded
        for row, i in enumerate(chunk):
            ids[row, : len(enc[i][0])] = enc[i][0]
        pred = np.asarray(_argmax(chat.model, chat.params, jnp.asarray(ids)))
        for row, i in enumerate(chunk):
            y = targets[i]
            at = np.nonzero(y != data.IGNORE_INDEX)[0]  # positions of reply tokens
            hits.append(bool((pred[row, at - 1] == y[at]).all()))
    correct = sum(hits)
    return ExactMatch(correct / len(hits), correct, len(hits), tuple(hits))


__all__ = ["ExactMatch", "exact_match", "reply_targets"]
