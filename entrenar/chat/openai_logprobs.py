r"""OpenAI's ``logprobs`` objects for `entrenar.chat.server`, from `token_logprobs`.

The log-probabilities are the raw model's (`entrenar.nn.token_logprobs`: no
temperature, top-k/p or penalties, as vLLM's default), computed after generation by
one forward pass over the prompt and the generated tokens. Two shapes:

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
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from entrenar.nn.scoring import TokenLogprobs

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
    texts: TokenTexts, ids: Sequence[int], scores: TokenLogprobs | None, first: int
) -> dict[str, Any]:
    """The legacy ``logprobs`` of tokens ``ids[first:]`` (module docstring).

    ``scores`` scored tokens ``max(first, 1):`` (None when there are none).
    """
    tokens: list[str] = []
    lps: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    offsets: list[int] = []
    at = 0
    for j in range(first, len(ids)):
        text = texts(ids[j])[0]
        tokens.append(text)
        offsets.append(at)
        at += len(text)
        if j == 0:  # no context: nothing predicts the first token
            lps.append(None)
            tops.append(None)
            continue
        assert scores is not None
        k = j - max(first, 1)
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
    """Chat's ``logprobs`` of the generated ``ids`` (``scores`` scored each)."""

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


__all__ = [
    "NO_PROBABILITY",
    "TokenTexts",
    "chat_logprobs",
    "completion_logprobs",
    "empty_scores",
]
