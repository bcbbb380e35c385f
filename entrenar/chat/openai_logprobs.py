r"""OpenAI's ``logprobs`` objects for `entrenar.chat.server`, token by token.

The log-probabilities are the raw model's (no temperature, top-k/p or penalties,
as vLLM's default): a generated token's come from the decoding step that chose it
(`entrenar.nn.StepLogprobs`, as vLLM's sampler reports them), an echoed prompt's
from one forward pass over it (`entrenar.nn.token_logprobs`). Two shapes:

- completions (OpenAI's legacy API, what lm-evaluation-harness reads)::

      {"tokens": [str], "token_logprobs": [float | None],
       "top_logprobs": [{str: float} | None], "text_offset": [int]}

  one entry per token listed: the generated ones (the end-of-turn token included
  when one came), after the prompt's with ``echo``; the prompt's first token has no
  context, so its log-probability and alternatives are None. Each ``top_logprobs``
  dict holds the ``logprobs`` most likely tokens and the chosen one (so up to
  ``logprobs + 1`` entries, as OpenAI's). ``text_offset``: where each token's text
  starts in the choice's ``text`` (the tokens' texts laid end to end);
- chat: ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token",
  "logprob", "bytes"}]}], "refusal": None}`` for the generated tokens but a
  closing end-of-turn token (the reply's text never shows it).

A token's text is its bytes decoded as UTF-8, or ``"bytes:\xNN..."`` when they are
part of a character (OpenAI's convention); ``-inf`` is reported as -9999.0, as vLLM
does (JSON has no infinity).

`ChoiceLogprobs` writes a choice's object run by run (the prompt's with ``echo``,
then the generated tokens as a stream sends them); each entry depends only on its
token and its text offset, so the runs' lists joined (`join_logprobs`) are the
object of the whole choice, exactly.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from entrenar.nn.sampling import TokenLogprobs

NO_PROBABILITY = -9999.0
"""The log-probability reported for an impossible token (JSON has no ``-inf``)."""


def _finite(x: float) -> float:
    return float(x) if math.isfinite(x) else NO_PROBABILITY


class TokenTexts:
    """Each token's text and bytes for a tokenizer, cached per request."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.table = getattr(tokenizer, "token_bytes", None)
        self.cache: dict[int, tuple[str, bytes]] = {}

    def __call__(self, tok: int) -> tuple[str, bytes]:
        """``(text, bytes)`` of token ``tok`` (module docstring)."""
        if tok not in self.cache:
            if self.table is not None and 0 <= tok < len(self.table):
                raw = self.table[tok]
            else:
                raw = self.tokenizer.decode([tok], special=True).encode("utf-8")
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:  # part of a character
                text = "bytes:" + "".join(f"\\x{c:02x}" for c in raw)
            self.cache[tok] = (text, raw)
        return self.cache[tok]


def completion_logprobs(
    texts: TokenTexts,
    ids: Sequence[int],
    scores: TokenLogprobs,
    *,
    offset: int = 0,
    context: bool = True,
) -> dict[str, Any]:
    """The legacy ``logprobs`` of tokens ``ids`` (module docstring).

    ``scores`` scored each token (``scores`` may hold more entries: the first
    ``len(ids)`` are read); ``offset``: the ``text_offset`` of the first token.
    ``context=False``: ``ids[0]`` begins the sequence (an echoed prompt's first
    token): nothing predicts it, its entries are None and ``scores`` scored the
    tokens after it.
    """
    tokens: list[str] = []
    lps: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    offsets: list[int] = []
    at = offset
    for j, tok in enumerate(ids):
        text = texts(tok)[0]
        tokens.append(text)
        offsets.append(at)
        at += len(text)
        if j == 0 and not context:  # nothing predicts the first token
            lps.append(None)
            tops.append(None)
            continue
        k = j if context else j - 1
        own = _finite(scores.logprobs[k])
        lps.append(own)
        top = {texts(int(t))[0]: _finite(lp)
               for t, lp in zip(scores.top_ids[k], scores.top_logprobs[k])}  # fmt: skip
        top.setdefault(text, own)
        tops.append(top)
    return {
        "tokens": tokens,
        "token_logprobs": lps,
        "top_logprobs": tops,
        "text_offset": offsets,
    }


def chat_logprobs(
    texts: TokenTexts, ids: Sequence[int], scores: TokenLogprobs
) -> dict[str, Any]:
    """Chat's ``logprobs`` of the generated ``ids`` (``scores`` scored each).

    ``scores`` may hold more entries: the first ``len(ids)`` are read.
    """

    def entry(tok: int, lp: float) -> dict[str, Any]:
        text, raw = texts(tok)
        return {"token": text, "logprob": _finite(lp), "bytes": list(raw)}

    content = []
    for k, tok in enumerate(ids):
        item = entry(tok, scores.logprobs[k])
        item["top_logprobs"] = [
            entry(int(t), lp)
            for t, lp in zip(scores.top_ids[k], scores.top_logprobs[k])
        ]
        content.append(item)
    return {"content": content, "refusal": None}


def empty_scores(top: int) -> TokenLogprobs:
    """Scores of no token (a reply with nothing to score)."""
    return TokenLogprobs(
        np.zeros(0, np.float32), np.zeros((0, top), np.int32), np.zeros((0, top))
    )


def listed_ids(ids: Sequence[int], stops: Sequence[int], chat: bool) -> list[int]:
    """The generated ``ids`` a choice's ``logprobs`` lists (module docstring).

    Completions list them all; chat leaves out a closing end-of-turn token (one of
    ``stops``: generation ends there, so only the last can be one).
    """
    out = list(ids)
    if chat and out and out[-1] in stops:
        return out[:-1]
    return out


def join_logprobs(parts: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    """One ``logprobs`` object of runs of a choice: their lists joined in order.

    None when there are no runs (a stream chunk that carries no token).
    """
    if not parts:
        return None
    out: dict[str, Any] = {}
    for part in parts:
        for k, v in part.items():
            out[k] = out.get(k, []) + v if isinstance(v, list) else v
    return out


class ChoiceLogprobs:
    """One choice's ``logprobs`` objects, run by run (module docstring).

    ``chat``: chat's ``content`` entries; else the legacy lists, whose
    ``text_offset`` goes on from one run to the next (counted from the choice's
    start).
    """

    def __init__(self, tokenizer: Any, chat: bool) -> None:
        self.texts, self.chat = TokenTexts(tokenizer), chat
        self.offset = 0  # text_offset of the next token (completions)

    def run(
        self, ids: Sequence[int], scores: TokenLogprobs, *, context: bool = True
    ) -> dict[str, Any]:
        """The object of the next tokens ``ids`` (``scores`` as `completion_logprobs`).

        ``context=False``: the echoed prompt, its first token unscored.
        """
        if self.chat:
            return chat_logprobs(self.texts, ids, scores)
        out = completion_logprobs(
            self.texts, ids, scores, offset=self.offset, context=context
        )
        self.offset += sum(len(t) for t in out["tokens"])
        return out


__all__ = [
    "NO_PROBABILITY",
    "ChoiceLogprobs",
    "TokenTexts",
    "chat_logprobs",
    "completion_logprobs",
    "empty_scores",
    "join_logprobs",
    "listed_ids",
]
