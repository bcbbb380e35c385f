"""OpenAI's reply objects for `entrenar.chat.server`: choices, usage, stream chunks.

A reply that does not stream has one ``choices`` entry per choice (`choice`) and the
``usage`` of all (`add_usage`: a prompt counts once however many choices it has). A
stream sends each choice as `ChoiceStream`'s entries, one per chunk, one choice
after another (OpenAI's and vLLM's order when ``n`` > 1 or a batch of prompts):

1. chat: ``delta {role: "assistant", content: ""}``; completions with ``echo``:
   the prompt's text (and its tokens' ``logprobs``), as vLLM sends it;
2. each text piece of the generation (`Server.generate`), or what a
   `entrenar.chat.tool_calls.ToolCallStream` lets through of it when the request
   has ``tools``;
3. the content it held back and the calls (one ``delta.tool_calls`` entry with the
   whole arguments of each call), when it found them;
4. the choice's ``finish_reason`` (``"tool_calls"`` when calls came).

With ``logprobs`` the choice is generated whole first, then scored in one pass
(`Server.logprobs`, as a reply that does not stream), and each entry carries the
log-probabilities of the tokens generated since the entry before (`logprobs_slice`
cuts the lists): joined, they are the unstreamed reply's, exactly.
"""

from __future__ import annotations

import secrets
import string
import uuid
from collections.abc import Iterable, Iterator
from typing import Any, Protocol

from entrenar.chat.openai_request import Request
from entrenar.chat.session import ChatModel, Reply
from entrenar.chat.tool_calls import ToolCall, ToolCallStream

ALPHANUMERIC = string.ascii_letters + string.digits

Item = tuple[str, int] | Reply
"""What `Server.generate` yields: a text piece and the tokens generated so far, or
the `Reply` at the end."""


def usage(reply: Reply) -> dict[str, int]:
    """OpenAI's ``usage``: prompt tokens, generated tokens, and their sum.

    The generated tokens include the end-of-turn token when one came (the model
    produced it; `Reply.token_ids`).
    """
    n = len(reply.token_ids)
    return {
        "prompt_tokens": reply.prompt_tokens,
        "completion_tokens": n,
        "total_tokens": reply.prompt_tokens + n,
    }


def choice_entry(
    chat: bool,
    text: str | None,
    finish: str | None,
    stream: bool,
    first: bool = False,
    index: int = 0,
) -> dict[str, Any]:
    """One ``choices`` entry of a reply or a stream chunk."""
    if not chat:
        return {
            "index": index,
            "text": text or "",
            "logprobs": None,
            "finish_reason": finish,
        }
    if not stream:
        return {
            "index": index,
            "message": {"role": "assistant", "content": text},
            "logprobs": None,
            "finish_reason": finish,
        }
    delta: dict[str, Any] = {"role": "assistant"} if first else {}
    if text is not None:
        delta["content"] = text
    return {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}


def call_id(parser: str) -> str:
    """A fresh call ``id``: ``call_`` and 24 hex digits, or 9 letters and digits.

    The second for ``mistral``: Mistral's chat templates accept no other id back
    (vLLM's ids for it).
    """
    if parser == "mistral":
        return "".join(secrets.choice(ALPHANUMERIC) for _ in range(9))
    return "call_" + uuid.uuid4().hex[:24]


def tool_calls(calls: list[ToolCall], parser: str) -> list[dict[str, Any]]:
    """OpenAI's ``tool_calls`` entries of ``calls`` (each a fresh `call_id`)."""
    return [
        {"id": call_id(parser), "type": "function",
         "function": {"name": c.name, "arguments": c.arguments}}
        for c in calls
    ]  # fmt: skip


def add_usage(total: dict[str, int], reply: Reply, sample: int) -> None:
    """Add one choice's `usage` to ``total`` (a prompt counts once: sample 0)."""
    used = usage(reply)
    if sample:
        used["total_tokens"] -= used.pop("prompt_tokens")
    for k, v in used.items():
        total[k] = total.get(k, 0) + v


def logprobs_slice(lp: dict[str, Any], chat: bool, a: int, b: int) -> dict | None:
    """The entries ``a:b`` of a choice's ``logprobs`` object; None when empty."""
    if b <= a:
        return None
    if chat:
        return {"content": lp["content"][a:b], "refusal": None}
    return {k: v[a:b] for k, v in lp.items()}


class ChoiceSource(Protocol):
    """What `ChoiceStream` reads of `entrenar.chat.server.Server`."""

    chat_model: ChatModel
    tool_call_parser: str | None

    def logprobs(self, request: Request, prompt: Any, reply: Reply) -> dict:
        """The ``logprobs`` object of one whole choice."""
        ...

    def echo_text(self, prompt: Any) -> str:
        """The text ``echo`` puts before a completion."""
        ...


class ChoiceStream:
    """The ``choices`` entries of one streamed choice (module docstring).

    Iterate once over the entries (each one chunk's only choice); ``reply`` is the
    choice's `Reply` once they are exhausted (None before).
    """

    def __init__(
        self,
        app: ChoiceSource,
        request: Request,
        prompt: Any,
        index: int,
        pieces: Iterator[Item],
    ) -> None:
        self.app, self.request, self.prompt = app, request, prompt
        self.index, self.pieces = index, pieces
        self.reply: Reply | None = None

    def __iter__(self) -> Iterator[dict[str, Any]]:
        app, request, chat = self.app, self.request, self.request.chat
        items: Iterable[Item] = self.pieces
        lp: dict[str, Any] | None = None
        if request.logprobs is not None:
            items = list(self.pieces)
            last = items[-1]
            assert isinstance(last, Reply)
            lp = app.logprobs(request, self.prompt, last)
        skip = 0  # the prompt's entries, before the generated tokens'
        if request.echo:
            skip = len(app.chat_model.encode(self.prompt, chat=False))
        sent = 0  # logprobs entries sent

        def entry(text: str | None, upto: int | None = None, **fields: Any) -> dict:
            nonlocal sent
            out = choice_entry(chat, text, None, True, index=self.index)
            out.update(fields)
            if lp is not None:
                total = len(lp["content"] if chat else lp["tokens"])
                end = total if upto is None else min(upto, total)
                out["logprobs"] = logprobs_slice(lp, chat, sent, end)
                sent = max(sent, end)
            return out

        if chat:
            yield entry("", 0, delta={"role": "assistant", "content": ""})
        if request.echo:
            yield entry(app.echo_text(self.prompt), skip)
        tools = None
        if request.tools is not None and app.tool_call_parser is not None:
            tools = ToolCallStream(app.tool_call_parser)
        reply: Reply | None = None
        for item in items:
            if isinstance(item, Reply):
                reply = item
                break
            piece, count = item
            if tools is not None:
                piece = tools.feed(piece)
            if piece:
                yield entry(piece, skip + count)
        assert reply is not None  # `Server.generate` ends with it
        finish: str = reply.finish_reason
        if tools is not None:
            rest, calls = tools.finish()
            if rest:
                yield entry(rest)
            if calls:
                yield entry(None, delta={"tool_calls": [
                    {"index": k, **call}
                    for k, call in enumerate(tool_calls(calls, tools.parser))
                ]})  # fmt: skip
                finish = "tool_calls"
        yield entry(None, finish_reason=finish)
        self.reply = reply


__all__ = [
    "ALPHANUMERIC",
    "ChoiceSource",
    "ChoiceStream",
    "Item",
    "add_usage",
    "call_id",
    "choice_entry",
    "logprobs_slice",
    "tool_calls",
    "usage",
]
