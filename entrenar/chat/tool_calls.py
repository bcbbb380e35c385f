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
  control token the reply's text leaves out.

A reply whose call does not parse (invalid JSON, no ``name``, arguments that are not
an object, a block cut off by ``max_tokens``) has no calls: all of it is content,
as vLLM answers then. The JSON is parsed within `entrenar.io.bounded`'s limits
(depth `MAX_DEPTH`); the text is the reply's, so at most ``max_tokens`` tokens.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any

from entrenar.errors import FormatError
from entrenar.io.bounded import parse_json

PARSERS = ("hermes", "llama3_json")
"""The tool-call formats `parse_tool_calls` reads."""

MAX_DEPTH = 32
"""Deepest JSON nesting accepted in a call."""


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
    raise ValueError(f"unknown tool-call parser {parser!r}; one of {PARSERS}")


__all__ = ["MAX_DEPTH", "PARSERS", "ToolCall", "parse_tool_calls"]
