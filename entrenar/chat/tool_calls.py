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

    Each character is looked at a bounded number of times, so a reply of ``n``
    characters costs ``O(n)`` however it is cut (one re-scan of the held text per
    piece made 20,000 spaces fed one at a time cost 10 s of CPU, 200,000 about
    17 minutes): the pieces are kept in a list joined once, by `finish`; before
    the reply's opening is known only its start (without leading whitespace, and
    for llama3_json without the whitespace after ``<|python_tag|>``) is kept; in
    content the text held back is whitespace (``blank``: it may precede a call)
    then at most ``len(marker) - 1`` characters that may begin the marker
    (``partial``), so only ``partial`` and the new piece are searched.
    """

    def __init__(self, parser: str) -> None:
        if parser not in PARSERS:
            raise ValueError(f"unknown tool-call parser {parser!r}; one of {PARSERS}")
        self.parser = parser
        self.marker = MARKERS.get(parser)
        self.pieces: list[str] = []  # the whole reply so far
        self.sent = 0  # characters of it sent as content
        self.mode: str | None = None  # "content" or "calls", once known (`_opening`)
        self.head = ""  # mode None: the reply's start as `_opening` reads it
        self.blank: list[str] = []  # content held back: whitespace only
        self.partial = ""  # then held back: an end that may begin the marker
        self.held = False  # the marker seen: the rest is held to `finish`

    def feed(self, piece: str) -> str:
        """Add a piece of the reply; the content that may be sent now."""
        self.pieces.append(piece)
        if self.mode is None:
            head = (self.head + piece).lstrip()
            if head.startswith(PYTHON_TAG):  # the spaces after it change nothing
                head = PYTHON_TAG + head[len(PYTHON_TAG) :].lstrip()
            self.head = head
            self.mode = _opening(head, self.parser)
            if self.mode is None:
                return ""  # only whitespace, or what may still open a call
            piece = "".join(self.pieces)  # nothing sent yet: all of it is new
        if self.mode == "calls" or self.held:
            return ""
        if self.marker is None:
            self.sent += len(piece)
            return piece
        new = self.partial + piece  # the marker cannot begin in blank or sent text
        at = new.find(self.marker)
        if at >= 0:
            self.held, body, self.partial = True, new[:at], ""
        else:
            keep = len(new) - partial_stop(new[-len(self.marker) :], [self.marker])
            body, self.partial = new[:keep], new[keep:]
        solid = body.rstrip()  # the whitespace after it may precede a call
        if not solid:
            self.blank.append(body)
            return ""
        out = "".join(self.blank) + solid
        self.blank = [body[len(solid) :]]
        self.sent += len(out)
        return out

    def finish(self) -> tuple[str, list[ToolCall]]:
        """The content not sent yet and the calls of the whole reply."""
        text = "".join(self.pieces)
        found = parse_tool_calls(text, self.parser)
        if found is None:  # no call, or one that does not parse: all content
            rest, self.sent = text[self.sent :], len(text)
            return rest, []
        content, calls = found
        content, sent = content or "", text[: self.sent].lstrip()
        rest = content[len(sent) :] if content.startswith(sent) else ""
        self.sent = len(text)
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
