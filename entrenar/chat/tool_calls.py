"""Function calls in a reply's text, as the model's chat format writes them.

A model trained for tool use (its chat template lists the ``tools`` it may call)
answers with a call in its own format; `parse_tool_calls` finds them, as vLLM's
``--tool-call-parser`` does, for `entrenar serve --tool-call-parser NAME`:

- ``hermes`` (Qwen2.5, Qwen3, QwQ, Hermes 2 Pro / 3, and models trained on their
  templates): each call a JSON object in its own block::

      <tool_call>
      {"name": "get_weather", "arguments": {"city": "Paris"}}
      </tool_call>

  the text before the first block is the reply's content;
- ``llama3_json`` (Llama 3.1 / 3.2 / 3.3 with their JSON tool-calling prompt): the
  whole reply is one object ``{"name": ..., "parameters": {...}}`` (or
  ``"arguments"``), or several separated by ``;``; Llama's ``<|python_tag|>`` is a
  control token the reply's text leaves out;
- ``mistral`` (Mistral 7B Instruct v0.3, Mixtral 8x22B Instruct, Mistral Nemo and
  the models of Mistral's v3 tokenizer, as vLLM's ``mistral`` parser reads them):
  ``[TOOL_CALLS]`` then a JSON list ``[{"name": ..., "arguments": {...}}, ...]``,
  the text before ``[TOOL_CALLS]`` the content. ``[TOOL_CALLS]`` is a control token
  that the reply's text leaves out, so a reply that is such a list is read as the
  calls too. Mistral's chat templates accept only call ids of 9 letters and digits,
  so the server gives these calls such ids (as vLLM does).

A reply whose call does not parse (invalid JSON, no ``name``, arguments that are not
an object, a block cut off by ``max_tokens``) has no calls: all of it is content,
as vLLM answers then. The JSON is parsed within `entrenar.io.bounded`'s limits
(depth `MAX_DEPTH`); the text is the reply's, so at most ``max_tokens`` tokens.

`ToolCallStream` does the same for a streamed reply: its text pieces pass through
as content until a call could be beginning (hermes, mistral: the text from a
``<tool_call>`` / ``[TOOL_CALLS]``, or from an end of the text that could begin one,
and the whitespace before it; llama3_json: a reply whose first non-space character
opens a JSON object or ``<|python_tag|>``; mistral: one whose first opens a list);
what is held back is parsed whole at the end, by
`parse_tool_calls`, and comes back as calls, or as content when it does not parse.
The content streamed then equals the one `parse_tool_calls` gives (but for the
leading whitespace of content followed by calls, which `parse_tool_calls` strips
and a stream has already sent).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any

from entrenar.errors import FormatError
from entrenar.io.bounded import parse_json
from entrenar.nn.generate import partial_stop

PARSERS = ("hermes", "llama3_json", "mistral")
"""The tool-call formats `parse_tool_calls` reads."""

MAX_DEPTH = 32
"""Deepest JSON nesting accepted in a call."""

HERMES_OPEN = "<tool_call>"
PYTHON_TAG = "<|python_tag|>"
MISTRAL_OPEN = "[TOOL_CALLS]"
MARKERS = {"hermes": HERMES_OPEN, "mistral": MISTRAL_OPEN}
"""The text that opens calls anywhere in a reply, by parser."""


@dataclasses.dataclass(frozen=True)
class ToolCall:
    """One function call: its name and its arguments as a JSON object's text.

    (OpenAI's ``function.arguments`` is a string holding JSON.)
    """

    name: str
    arguments: str


def _call(text: str, arguments_keys: tuple[str, ...]) -> ToolCall | None:
    """A ``{"name": str, <arguments key>: object}`` JSON text as a call, or None."""
    try:
        obj = parse_json(text, "a tool call", max_depth=MAX_DEPTH)
    except FormatError:
        return None
    return _call_of(obj, arguments_keys)


def _call_of(obj: Any, arguments_keys: tuple[str, ...]) -> ToolCall | None:
    """A parsed ``{"name": str, <arguments key>: object}`` as a call, or None."""
    if not isinstance(obj, Mapping) or not isinstance(obj.get("name"), str):
        return None
    args: Any = {}
    for key in arguments_keys:
        if key in obj:
            args = obj[key]
            break
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = parse_json(args, "a tool call's arguments", max_depth=MAX_DEPTH)
        except FormatError:
            return None
    if not isinstance(args, Mapping) or not obj["name"]:
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def _hermes(text: str) -> tuple[str | None, list[ToolCall]] | None:
    open_, close = "<tool_call>", "</tool_call>"
    start = text.find(open_)
    if start < 0:
        return None
    calls, at = [], start
    while at < len(text):  # one pass: each block's end searched once (no backtracking)
        if not text.startswith(open_, at):
            if text[at:].strip():  # text between or after the calls
                return None
            break
        end = text.find(close, at + len(open_))
        if end < 0:  # a block cut off
            return None
        call = _call(text[at + len(open_) : end].strip(), ("arguments", "parameters"))
        if call is None:
            return None
        calls.append(call)
        at = end + len(close)
        while at < len(text) and text[at].isspace():
            at += 1
    return text[:start].strip() or None, calls


def _llama3_json(text: str) -> tuple[str | None, list[ToolCall]] | None:
    body = text.strip().removeprefix("<|python_tag|>").strip()
    if not body.startswith("{"):
        return None
    calls = []
    for part in _split_objects(body):
        call = _call(part, ("parameters", "arguments"))
        if call is None:
            return None
        calls.append(call)
    return None, calls


def _mistral(text: str) -> tuple[str | None, list[ToolCall]] | None:
    at = text.find(MISTRAL_OPEN)
    if at >= 0:
        content, body = text[:at].strip() or None, text[at + len(MISTRAL_OPEN) :]
    else:  # the control token left out of the text: a reply that is the list
        content, body = None, text
    body = body.strip()
    if not body.startswith("["):
        return None
    try:
        items = parse_json(body, "tool calls", max_depth=MAX_DEPTH)
    except FormatError:
        return None
    if not isinstance(items, list) or not items:
        return None
    calls = [_call_of(item, ("arguments",)) for item in items]
    if any(c is None for c in calls):
        return None
    return content, [c for c in calls if c is not None]


def _split_objects(body: str) -> list[str]:
    """``{...}; {...}`` as its objects' texts (``;`` inside strings kept)."""
    parts, depth, in_string, escaped, begin = [], 0, False, False, 0
    for i, ch in enumerate(body):
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
        elif ch == ";" and depth == 0:
            parts.append(body[begin:i])
            begin = i + 1
    parts.append(body[begin:])
    return [p.strip() for p in parts]


def parse_tool_calls(
    text: str, parser: str
) -> tuple[str | None, list[ToolCall]] | None:
    """The content and calls of a reply in ``parser``'s format; None: no calls.

    Raises:
        ValueError: an unknown ``parser`` (one of `PARSERS`).
    """
    if parser == "hermes":
        return _hermes(text)
    if parser == "llama3_json":
        return _llama3_json(text)
    if parser == "mistral":
        return _mistral(text)
    raise ValueError(f"unknown tool-call parser {parser!r}; one of {PARSERS}")


class ToolCallStream:
    """A streamed reply's content pieces, then its calls (module docstring).

    `feed` each text piece and send what it returns as content; `finish` gives the
    rest of the content and the calls (``[]``: none, the held text was content).
    """

    def __init__(self, parser: str) -> None:
        if parser not in PARSERS:
            raise ValueError(f"unknown tool-call parser {parser!r}; one of {PARSERS}")
        self.parser = parser
        self.text = ""
        self.sent = 0  # characters of text sent as content
        self.calls_at: int | None = None  # hermes: where the first block opens
        self.mode: str | None = None  # "content" or "calls", once known (`_opening`)

    def feed(self, piece: str) -> str:
        """Add a piece of the reply; the content that may be sent now."""
        before = len(self.text)
        self.text += piece
        end = self._safe(before)
        if end <= self.sent:
            return ""
        out, self.sent = self.text[self.sent : end], end
        return out

    def _safe(self, before: int) -> int:
        """How much of the text is content for sure (``before``: the text's old end)."""
        text = self.text
        if self.mode is None:
            self.mode = _opening(text.lstrip(), self.parser)
            if self.mode is None:
                return 0  # only whitespace, or what may still open a call
        marker = MARKERS.get(self.parser)
        if self.mode == "calls":
            return 0
        if marker is None:
            return len(text)
        if self.calls_at is None:  # search only where the new piece can complete it
            at = text.find(marker, max(0, before - len(marker) + 1))
            self.calls_at = None if at < 0 else at
        end = self.calls_at
        if end is None:
            end = len(text) - partial_stop(text[-len(marker) :], [marker])
        while end > self.sent and text[end - 1].isspace():  # may precede a call
            end -= 1
        return end

    def finish(self) -> tuple[str, list[ToolCall]]:
        """The content not sent yet and the calls of the whole reply."""
        found = parse_tool_calls(self.text, self.parser)
        if found is None:  # no call, or one that does not parse: all content
            rest, self.sent = self.text[self.sent :], len(self.text)
            return rest, []
        content, calls = found
        content, sent = content or "", self.text[: self.sent].lstrip()
        rest = content[len(sent) :] if content.startswith(sent) else ""
        self.sent = len(self.text)
        return rest, calls


def _opening(s: str, parser: str) -> str | None:
    """What a reply beginning ``s`` (no leading space) is, or None: not known yet.

    ``"calls"``: held back to the end; ``"content"``: sent, but from a `MARKERS`
    text on (or what may begin one).
    """
    if not s:
        return None
    if parser == "llama3_json":
        body = s.removeprefix(PYTHON_TAG).lstrip()
        if PYTHON_TAG.startswith(s) or (s.startswith(PYTHON_TAG) and not body):
            return None
        return "calls" if body.startswith("{") else "content"
    if parser == "mistral":  # the list, or its control token when it is shown
        return "calls" if s.startswith("[") else "content"
    return "content"


__all__ = [
    "MAX_DEPTH",
    "PARSERS",
    "ToolCall",
    "ToolCallStream",
    "parse_tool_calls",
]
