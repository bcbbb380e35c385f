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

With ``logprobs`` each entry carries the log-probabilities of the tokens generated
since the entry before (`entrenar.chat.openai_logprobs.ChoiceLogprobs`), as the
decoding steps compute them (`ReplyStream.logprobs`): a piece's entry carries the
tokens that made its text, sent as soon as they are generated (the prompt's, with
``echo``, from one forward pass first); the last entry any tokens left (a closing
stop token of a completion, the tokens of a stop string). Joined, they are the
unstreamed reply's (`Server.logprobs`), exactly: both are the same decoding's.
"""

from __future__ import annotations

import secrets
import string
import uuid
from collections.abc import Iterator
from typing import Any, Protocol

from entrenar.chat.openai_logprobs import ChoiceLogprobs, listed_ids
from entrenar.chat.openai_request import Request
from entrenar.chat.session import ChatModel, Reply, ReplyStream
from entrenar.chat.tool_calls import ToolCall, ToolCallStream
from entrenar.nn.sampling import TokenLogprobs

ALPHANUMERIC = string.ascii_letters + string.digits

Item = tuple[str, ReplyStream] | Reply
"""What `Server.generate` yields: a text piece and the stream that made it (its
``ids``, the tokens generated so far, and their `ReplyStream.logprobs`), or the
`Reply` at the end."""


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


class ChoiceSource(Protocol):
    """What `ChoiceStream` reads of `entrenar.chat.server.Server`."""

    chat_model: ChatModel
    tool_call_parser: str | None

    def prompt_logprobs(
        self, request: Request, prompt: Any
    ) -> tuple[list[int], TokenLogprobs]:
        """An echoed prompt's ids and the scores of each but the first."""
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
        stops = app.chat_model.stops
        lp = None
        if request.logprobs is not None:
            lp = ChoiceLogprobs(app.chat_model.tokenizer, chat)
        sent = 0  # generated tokens whose entries were sent

        def entry(
            text: str | None,
            made: ReplyStream | Reply | None = None,
            **fields: Any,
        ) -> dict:
            """A chunk's choice, with the entries of ``made``'s new tokens.

            With ``logprobs``: those of the (listed) tokens ``made`` has generated
            since the chunk before.
            """
            nonlocal sent
            out = choice_entry(chat, text, None, True, index=self.index)
            out.update(fields)
            if lp is not None and made is not None:
                ids = made.ids if isinstance(made, ReplyStream) else made.token_ids
                end = len(listed_ids(ids, stops, chat))
                if end > sent:
                    scores = (made.logprobs(sent, end) if isinstance(made, ReplyStream)
                              else _cut(made.logprobs, sent, end))  # fmt: skip
                    out["logprobs"] = lp.run(ids[sent:end], scores)
                    sent = end
            return out

        if chat:
            yield entry("", delta={"role": "assistant", "content": ""})
        if request.echo:
            out = entry(app.echo_text(self.prompt))
            if lp is not None:
                ids, scores = app.prompt_logprobs(request, self.prompt)
                out["logprobs"] = lp.run(ids, scores, context=False)
            yield out
        tools = None
        if request.tools is not None and app.tool_call_parser is not None:
            tools = ToolCallStream(app.tool_call_parser)
        reply: Reply | None = None
        for item in self.pieces:
            if isinstance(item, Reply):
                reply = item
                break
            piece, made = item
            if tools is not None:
                piece = tools.feed(piece)
            if piece:
                yield entry(piece, made)
        assert reply is not None  # `Server.generate` ends with it
        finish: str = reply.finish_reason
        if tools is not None:
            rest, calls = tools.finish()
            if rest:
                yield entry(rest, reply)
            if calls:
                yield entry(None, reply, delta={"tool_calls": [
                    {"index": k, **call}
                    for k, call in enumerate(tool_calls(calls, tools.parser))
                ]})  # fmt: skip
                finish = "tool_calls"
        yield entry(None, reply, finish_reason=finish)
        self.reply = reply


def _cut(scores: TokenLogprobs | None, start: int, stop: int) -> TokenLogprobs:
    """Entries ``start:stop`` of a `Reply`'s log-probabilities."""
    assert scores is not None  # the reply was asked for them
    return TokenLogprobs(*(x[start:stop] for x in scores))


__all__ = [
    "ALPHANUMERIC",
    "ChoiceSource",
    "ChoiceStream",
    "Item",
    "add_usage",
    "call_id",
    "choice_entry",
    "tool_calls",
    "usage",
]
