"""The requests of OpenAI's API that `entrenar.chat.server` answers, checked.

`parse_request` turns a decoded JSON body of ``POST /v1/chat/completions``
(``chat``) or ``POST /v1/completions`` into a `Request`, or raises `RequestError`
with the HTTP status and OpenAI's error fields (``param`` names the field). Every
field the server reads is checked for type and range; fields it does not know are
ignored, as OpenAI does; options that would change the answer and are not
implemented (``best_of`` > 1, ``suffix``, ``functions``, a ``tool_choice`` other
than ``auto`` / ``none``, frequency and presence penalties) are refused rather than
ignored. Every option combines with ``stream`` (``logprobs``, ``echo``, ``n`` > 1,
a batch of prompts, ``tools``), as in OpenAI's and vLLM's servers.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from entrenar.errors import FormatError
from entrenar.io.bounded import parse_json

MAX_STOP_STRINGS = 4
"""OpenAI's limit on ``stop`` strings."""

MAX_STOP_CHARS = 256
"""Longest stop string accepted."""

MAX_PROMPTS = 64
"""Most choices one request may ask for: prompts of a completion batch times ``n``."""

MAX_TOOLS = 128
"""Most ``tools`` a request may list, and most ``tool_calls`` in one message."""

MAX_LOGPROBS = 20
"""Most alternatives per token (``logprobs`` / ``top_logprobs``; OpenAI's limit)."""

ROLES = ("system", "developer", "user", "assistant", "tool")
"""The message roles a chat request may use (``developer`` is OpenAI's newer name for
``system``, passed to the template as ``system``)."""


class RequestError(Exception):
    """A request the server refuses: the HTTP status and OpenAI's error fields."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        kind: str = "invalid_request_error",
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind
        self.code = code

    def body(self) -> dict[str, Any]:
        """OpenAI's error object."""
        return {
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.code,
            }
        }


def field_error(param: str, message: str) -> RequestError:
    """A 400 naming the field ``param``."""
    return RequestError(400, f"{param}: {message}", param)


def _number(
    body: Mapping[str, Any], name: str, default: float, lo: float, hi: float
) -> float:
    """A number field in ``[lo, hi]`` (absent or null: ``default``)."""
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise field_error(name, f"expected a number, got {v!r:.40}")
    if not lo <= v <= hi:
        raise field_error(name, f"must be between {lo} and {hi}, got {v}")
    return float(v)


def _integer(body: Mapping[str, Any], name: str, lo: int, hi: int) -> int | None:
    """An integer field in ``[lo, hi]``, or None when absent or null."""
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise field_error(name, f"expected an integer, got {v!r:.40}")
    if not lo <= v <= hi:
        raise field_error(name, f"must be between {lo} and {hi}, got {v}")
    return v


def _flag(body: Mapping[str, Any], name: str) -> bool:
    v = body.get(name)
    if v is not None and not isinstance(v, bool):
        raise field_error(name, f"expected true or false, got {v!r:.40}")
    return bool(v)


def _stop(body: Mapping[str, Any]) -> tuple[str, ...]:
    """``stop``: a string or a list of at most `MAX_STOP_STRINGS` strings."""
    v = body.get("stop")
    if v is None:
        return ()
    stops = [v] if isinstance(v, str) else v
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise field_error(
            "stop", f"expected a string or a list of strings, got {v!r:.40}"
        )
    if len(stops) > MAX_STOP_STRINGS:
        raise field_error(
            "stop", f"at most {MAX_STOP_STRINGS} strings, got {len(stops)}"
        )
    if any(not s or len(s) > MAX_STOP_CHARS for s in stops):
        raise field_error(
            "stop", f"each string must have 1 to {MAX_STOP_CHARS} characters"
        )
    return tuple(stops)


def _refuse_unsupported(body: Mapping[str, Any]) -> None:
    """Refuse options that would change the answer and are not implemented."""
    if body.get("best_of") is not None and _integer(body, "best_of", 1, 1 << 30) != 1:
        raise field_error("best_of", "only best_of=1 is supported")
    for name in ("frequency_penalty", "presence_penalty"):
        if _number(body, name, 0.0, -2.0, 2.0) != 0:
            raise field_error(
                name, "not supported; use repetition_penalty (vLLM's option)"
            )
    for name in ("suffix", "functions"):
        if body.get(name) not in (None, False, 0, "", []):
            raise field_error(name, "not supported by this server")


def _content(m: Mapping[str, Any], j: int) -> str:
    """A message's ``content``: a string, or the text of its text parts joined."""
    c = m.get("content")
    if isinstance(c, str):
        return c
    where = f"messages[{j}].content"
    if not isinstance(c, list):
        raise field_error(where, f"expected a string or a list of parts, got {c!r:.40}")
    texts = []
    for part in c:
        if not (
            isinstance(part, Mapping)
            and part.get("type") == "text"
            and isinstance(part.get("text"), str)
        ):
            raise field_error(
                where,
                f'only {{"type": "text", "text": ...}} parts are '
                f"supported, got {part!r:.60}",
            )
        texts.append(part["text"])
    return "".join(texts)


def _tool_calls(m: Mapping[str, Any], j: int) -> list[dict[str, Any]]:
    """An assistant message's ``tool_calls``, their arguments as objects.

    OpenAI sends ``function.arguments`` as a JSON string; chat templates read it
    as a mapping (transformers' convention), so it is parsed (as vLLM does).
    """
    where = f"messages[{j}].tool_calls"
    calls = m.get("tool_calls")
    if not isinstance(calls, list) or len(calls) > MAX_TOOLS:
        raise field_error(where, f"expected a list of at most {MAX_TOOLS} calls")
    out = []
    for k, c in enumerate(calls):
        f = c.get("function") if isinstance(c, Mapping) else None
        name = f.get("name") if isinstance(f, Mapping) else None
        if not isinstance(name, str) or not name:
            raise field_error(
                f"{where}[{k}]", 'expected {"type": "function", "function": {"name", '
                '"arguments"}}'
            )  # fmt: skip
        assert isinstance(f, Mapping)
        args = f.get("arguments", "{}")
        if isinstance(args, str):
            try:
                args = parse_json(args, f"{where}[{k}].function.arguments",
                                  max_depth=16)  # fmt: skip
            except FormatError as e:
                raise field_error(f"{where}[{k}].function.arguments", str(e)) from None
        if not isinstance(args, Mapping):
            raise field_error(
                f"{where}[{k}].function.arguments", "expected a JSON object"
            )
        call = {"type": "function", "function": {"name": name, "arguments": args}}
        if isinstance(c.get("id"), str):
            call["id"] = c["id"]
        out.append(call)
    return out


def _tools(body: Mapping[str, Any]) -> tuple[dict[str, Any], ...] | None:
    """``tools`` (function schemas for the template) under ``tool_choice``.

    None when absent, empty, or ``tool_choice: "none"`` (no call is parsed then,
    and the template lists none).
    """
    choice = body.get("tool_choice")
    if choice not in (None, "auto", "none"):
        raise field_error(
            "tool_choice", 'only "auto" and "none" are supported, got '
            f"{choice!r:.40}"
        )  # fmt: skip
    tools = body.get("tools")
    if tools is None or choice == "none":
        return None
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise field_error("tools", f"expected a list of at most {MAX_TOOLS} tools")
    for k, t in enumerate(tools):
        f = t.get("function") if isinstance(t, Mapping) else None
        ok = (
            isinstance(t, Mapping)
            and t.get("type") == "function"
            and isinstance(f, Mapping)
            and isinstance(f.get("name"), str)
            and bool(f["name"])
            and isinstance(f.get("parameters", {}), Mapping)
        )
        if not ok:
            raise field_error(
                f"tools[{k}]", 'expected {"type": "function", "function": {"name", '
                '"description", "parameters"}}'
            )  # fmt: skip
    return tuple(dict(t) for t in tools) or None


def _messages(body: Mapping[str, Any]) -> list[dict[str, Any]]:
    """``messages``: a non-empty list of ``{"role", "content"}`` objects.

    An assistant message may carry ``tool_calls`` (then ``content`` may be null);
    a ``tool`` message its ``tool_call_id`` and ``name``.
    """
    msgs = body.get("messages")
    if msgs is None:
        raise field_error("messages", "required (a list of {role, content} objects)")
    if not isinstance(msgs, list) or not msgs:
        raise field_error("messages", f"expected a non-empty list, got {msgs!r:.40}")
    out = []
    for j, m in enumerate(msgs):
        if not isinstance(m, Mapping):
            raise field_error(f"messages[{j}]", f"expected an object, got {m!r:.40}")
        role = m.get("role")
        if role not in ROLES:
            raise field_error(
                f"messages[{j}].role",
                f"expected one of {', '.join(ROLES)}, got {role!r:.40}",
            )
        role = "system" if role == "developer" else role
        msg: dict[str, Any] = {"role": role}
        if role == "assistant" and m.get("tool_calls") is not None:
            msg["tool_calls"] = _tool_calls(m, j)
            msg["content"] = None if m.get("content") is None else _content(m, j)
        else:
            msg["content"] = _content(m, j)
        for key in ("tool_call_id", "name"):
            if role == "tool" and isinstance(m.get(key), str):
                msg[key] = m[key]
        out.append(msg)
    return out


def _is_ids(x: Any) -> bool:
    return (
        isinstance(x, list)
        and bool(x)
        and all(isinstance(i, int) and not isinstance(i, bool) for i in x)
    )


def _prompts(body: Mapping[str, Any]) -> tuple[str | list[int], ...]:
    """``prompt``: a string, a list of token ids, or a list of either (a batch).

    OpenAI's four forms; each prompt of a batch is one choice (``index``).
    """
    p = body.get("prompt")
    if isinstance(p, str) or _is_ids(p):
        p = [p]
    if not isinstance(p, list) or not p:
        raise field_error(
            "prompt",
            f"expected a string, a list of token ids, or a list of either; got "
            f"{p!r:.40}",
        )
    if len(p) > MAX_PROMPTS:
        raise field_error("prompt", f"at most {MAX_PROMPTS} prompts, got {len(p)}")
    for j, one in enumerate(p):
        if not ((isinstance(one, str) and one) or _is_ids(one)):
            raise field_error(
                "prompt",
                f"prompt[{j}]: expected a non-empty string or a non-empty list of "
                f"token ids, got {one!r:.40}",
            )
    return tuple(p)


def _logprobs(body: Mapping[str, Any], chat: bool) -> int | None:
    """How many alternatives per token to report, or None for no ``logprobs``.

    Completions: ``logprobs`` is that number (0 to `MAX_LOGPROBS`). Chat:
    ``logprobs`` is a flag and ``top_logprobs`` the number (it needs the flag).
    """
    if not chat:
        return _integer(body, "logprobs", 0, MAX_LOGPROBS)
    on = _flag(body, "logprobs")
    top = _integer(body, "top_logprobs", 0, MAX_LOGPROBS)
    if top is not None and not on:
        raise field_error("top_logprobs", "needs logprobs: true")
    return (top or 0) if on else None


@dataclasses.dataclass(frozen=True)
class Request:
    """A checked generation request.

    Attributes:
        prompts: the conversation (chat: one), or the texts or token ids to
            continue (completions: a batch, each one choice).
        chat: whether the prompts are rendered through the chat template.
        max_tokens: the field as sent (None: absent), checked against the limits
            once the prompt's length is known (`Server.max_new_tokens`).
        max_tokens_field: its name in the request (``max_tokens`` or
            ``max_completion_tokens``), for the error that names it.
        options: `ChatModel.reply`'s sampling options and ``stop`` (no key).
        seed: the sampling seed (None: a random one).
        stream: answer with Server-Sent Events.
        include_usage: ``stream_options.include_usage``.
        logprobs: alternatives per token to report with each token's
            log-probability, or None: no ``logprobs`` (`_logprobs`).
        echo: completions: the prompt is part of the choice (its text, and its
            tokens' log-probabilities with ``logprobs``).
        n: choices per prompt (sample ``j`` of a seeded request draws with
            ``fold_in(key(seed), j)`` for ``j >= 1``).
        tools: chat: the function schemas the template lists, or None.
    """

    prompts: tuple[str | list[int] | list[dict[str, Any]], ...]
    chat: bool
    max_tokens: int | None
    max_tokens_field: str
    options: dict[str, Any]
    seed: int | None
    stream: bool
    include_usage: bool
    logprobs: int | None = None
    echo: bool = False
    n: int = 1
    tools: tuple[dict[str, Any], ...] | None = None


def parse_request(body: Any, *, chat: bool) -> Request:
    """Check a chat (``chat``) or completion request body; raise `RequestError`."""
    if not isinstance(body, Mapping):
        raise RequestError(400, f"the body must be a JSON object, got {body!r:.40}")
    if body.get("model") is not None and not isinstance(body["model"], str):
        raise field_error("model", f"expected a string, got {body['model']!r:.40}")
    _refuse_unsupported(body)
    prompts = (_messages(body),) if chat else _prompts(body)
    echo = False if chat else _flag(body, "echo")
    if chat and body.get("echo") not in (None, False):
        raise field_error("echo", "only /v1/completions echoes the prompt")
    logprobs = _logprobs(body, chat)
    stream = _flag(body, "stream")
    n = _integer(body, "n", 1, MAX_PROMPTS) or 1
    if n * len(prompts) > MAX_PROMPTS:
        raise field_error(
            "n", f"{len(prompts)} prompts x n={n} is more than {MAX_PROMPTS} choices"
        )
    tools = _tools(body) if chat else None
    if not chat and body.get("tools") is not None:
        raise field_error("tools", "only /v1/chat/completions takes tools")
    name = "max_tokens"
    if chat and body.get("max_completion_tokens") is not None:
        name = "max_completion_tokens"
    max_tokens = _integer(body, name, 0 if echo else 1, 1 << 62)
    temperature = _number(body, "temperature", 0.0, 0.0, 2.0)
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0)
    if top_p == 0:
        raise field_error("top_p", "must be greater than 0")
    options = dict(
        temperature=temperature,
        top_p=None if top_p == 1 else top_p,
        top_k=_integer(body, "top_k", -1, 1 << 30),
        min_p=_number(body, "min_p", 0.0, 0.0, 1.0) or None,
        repetition_penalty=_number(body, "repetition_penalty", 1.0, 0.01, 100.0),
        stop=_stop(body),
    )
    if options["top_k"] in (-1, 0):  # vLLM's "off"
        options["top_k"] = None
    stream_options = body.get("stream_options")
    if stream_options is not None and not isinstance(stream_options, Mapping):
        raise field_error(
            "stream_options", f"expected an object, got {stream_options!r:.40}"
        )
    return Request(
        prompts=prompts,
        chat=chat,
        max_tokens=max_tokens,
        max_tokens_field=name,
        options=options,
        seed=_integer(body, "seed", -(1 << 63), (1 << 63) - 1),
        stream=stream,
        include_usage=_flag(stream_options or {}, "include_usage"),
        logprobs=logprobs,
        echo=echo,
        n=n,
        tools=tools,
    )


__all__ = ["ROLES", "Request", "RequestError", "field_error", "parse_request"]
