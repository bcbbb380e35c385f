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
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from entrenar import data
from entrenar.chat.session import ChatModel
from entrenar.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class ExactMatch:
    """Result of `exact_match`.

    Attributes:
        accuracy: ``correct / total``.
        correct: records whose every reply greedy decoding reproduces exactly.
        total: records evaluated.
        hits: per record, whether it counted.
    """

    accuracy: float
    correct: int
    total: int
    hits: tuple[bool, ...]


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


def exact_match(
    chat: ChatModel,
    records: Sequence[Mapping[str, Any]] | data.Records,
    *,
    batch_size: int = 16,
) -> ExactMatch:
    """Fraction of chat records whose replies greedy decoding reproduces exactly.

    Args:
        chat: the model, tokenizer and template to evaluate.
        records: chat records (``{"messages": [...]}``), e.g. from
            `entrenar.data.load_records` of a JSONL file.
        batch_size: records per forward pass (rows are padded to one length, so
            the forward pass compiles once).

    Raises:
        ConfigError: a record without an assistant reply.
    """
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
