"""An OpenAI-compatible HTTP server for a `ChatModel` (``entrenar serve``).

`make_server` returns a `http.server.ThreadingHTTPServer` (standard library only)
that answers the part of OpenAI's API that chat tools use, as llama.cpp's
``llama-server`` and vLLM do:

- ``GET /v1/models``: the one model served, under its name;
- ``POST /v1/chat/completions``: ``messages`` rendered through the model's chat
  template (`ChatModel.reply`); ``max_tokens`` (or ``max_completion_tokens``),
  ``temperature``, ``top_p``, ``seed``, ``stop``, ``n``, ``stream``
  (Server-Sent Events: ``data: {...}`` chunks, then ``data: [DONE]``) with
  ``stream_options.include_usage``; vLLM's ``top_k``, ``min_p`` and
  ``repetition_penalty`` too;
- ``POST /v1/completions``: a ``prompt`` continued as plain text (what ``entrenar
  generate`` without ``--chat`` does), the same options; the prompt a string or
  token ids, or a batch of either (one choice each), ``echo`` (the prompt's text
  first; ``max_tokens`` may then be 0);
- ``tools`` (chat): function schemas passed to the chat template; with a
  ``tool_call_parser`` (``entrenar serve --tool-call-parser hermes``, the model's
  format: `entrenar.chat.tool_calls`) a reply holding calls comes back as OpenAI's
  ``message.tool_calls`` with ``finish_reason: "tool_calls"`` (streamed: content
  until a call could begin, then the calls in one ``delta.tool_calls`` chunk,
  `entrenar.chat.tool_calls.ToolCallStream`); assistant messages may carry
  ``tool_calls`` and ``tool`` messages their results;
- ``logprobs`` (completions: the number of alternatives; chat: ``logprobs`` and
  ``top_logprobs``): each listed token's log-probability under the raw model and
  its most likely alternatives (`entrenar.chat.openai_logprobs`), what
  lm-evaluation-harness's ``local-completions`` model reads: a generated token's
  from the decoding step that chose it, an echoed prompt's from one forward pass;
  streamed, each chunk carries the entries of the tokens that made its text, as
  they are generated (the prompt's first with ``echo``), so the chunks' entries
  joined are the unstreamed reply's;
- every option streams: with ``n`` > 1 or a batch of prompts the choices are
  generated and sent one after another, each chunk under its choice's ``index``,
  each choice ending with its own ``finish_reason`` chunk, ``usage`` once at the end;
- ``GET /health``: ``{"status": "ok"}``.

With an ``api_key`` (``entrenar serve --api-key``, or ``ENTRENAR_API_KEY``), every
``/v1/`` route requires the header ``Authorization: Bearer <api_key>`` (what
OpenAI's clients send for their ``api_key``), compared in constant time
(`secrets.compare_digest`); a missing or wrong key is a 401 with OpenAI's body
(``code: "invalid_api_key"``), before the body is read. ``/health`` stays open (as
in llama.cpp's ``llama-server`` and vLLM), for load balancers.

Replies carry OpenAI's fields (``id``, ``object``, ``created``, ``model``,
``choices[index, message | delta | text, finish_reason]``, ``usage``;
`entrenar.chat.openai_response` builds them and a stream's chunks). A greedy
request (``temperature`` 0, the default) gives `ChatModel.reply`'s text token for
token; a sampled one draws with ``jax.random.key(seed)``, so the same seed gives the
same text (no seed: a random one).

Every request is untrusted, and nothing it sends can hang the server:

- the request (its line, headers and body) must arrive within ``2 *
  socket_timeout`` of the connection, each read within ``socket_timeout``
  (`_DeadlineReader`): a client that trickles its headers a byte at a time
  (slowloris) is cut off then, one that trickles its body gets a 408;
- the body needs a ``Content-Length`` (411 without), at most ``max_body_bytes`` (413);
- it is strict UTF-8 JSON, an object nested at most `MAX_JSON_DEPTH` deep
  (`entrenar.io.bounded.parse_json`);
- each field the server reads is checked (type and range;
  `entrenar.chat.openai_request`) and a bad one is a 400
  with OpenAI's error body ``{"error": {"message", "type", "param", "code"}}`` naming
  it; fields it does not know are ignored, as OpenAI does; options that would change
  the answer and are not implemented (``best_of`` > 1, ``suffix``, ``functions``,
  frequency and presence penalties) are refused rather than ignored; a stream checks
  every prompt before its header;
- ``max_tokens`` is at most ``max_tokens_limit`` and must fit the context with the
  prompt (400 otherwise; absent: the smaller of the two);
- one generation runs at a time (a lock: the model's compiled decoding is shared);
  a request waits for it at most ``queue_timeout`` seconds (503 after), and at most
  ``max_connections`` connections are served at once (503 beyond);
- a client that stops reading a stream meets the socket timeout, and the generation
  ends there.
"""

from __future__ import annotations

import dataclasses
import io
import json
import logging
import secrets
import threading
import time
import uuid
from collections.abc import Generator, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from entrenar.chat.openai_logprobs import (
    ChoiceLogprobs,
    empty_scores,
    join_logprobs,
    listed_ids,
)
from entrenar.chat.openai_request import (
    Request,
    RequestError,
    field_error,
    parse_request,
)
from entrenar.chat.openai_response import (
    ChoiceStream,
    Item,
    add_usage,
    choice_entry,
    tool_calls,
)
from entrenar.chat.session import ChatModel, Reply
from entrenar.chat.tool_calls import (
    PARSERS,
    parse_tool_calls,
)
from entrenar.errors import (
    ConfigError,
    FormatError,
    ShapeError,
    TemplateError,
)
from entrenar.io.bounded import parse_json
from entrenar.nn import context_length
from entrenar.nn.sampling import TokenLogprobs
from entrenar.nn.scoring import token_logprobs

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 1 << 20
"""Largest request body accepted by default (1 MiB; ``max_body_bytes``)."""

MAX_JSON_DEPTH = 16
"""Deepest nesting of a request's JSON (a chat request needs 4: body, messages,
message, content parts)."""

DEFAULT_MAX_TOKENS_LIMIT = 2048
"""The most tokens one request may ask for by default (``max_tokens_limit``)."""


@dataclasses.dataclass
class Server:
    """What the request handler serves: the model, its name and the limits.

    Attributes:
        chat_model: the `ChatModel` that answers.
        model_name: the ``model`` of every reply and of ``/v1/models``.
        max_tokens_limit: the most tokens a request may ask for.
        max_body_bytes: the largest request body.
        socket_timeout: seconds one read or write on a connection may wait.
        queue_timeout: seconds a request waits for the generation in progress.
        api_key: the key ``/v1/`` routes require, or None (module docstring).
        tool_call_parser: the format of the model's function calls
            (`entrenar.chat.tool_calls.PARSERS`), or None: requests with
            ``tools`` are refused.
        lock: one generation at a time.
    """

    chat_model: ChatModel
    model_name: str
    max_tokens_limit: int = DEFAULT_MAX_TOKENS_LIMIT
    max_body_bytes: int = MAX_BODY_BYTES
    socket_timeout: float = 30.0
    queue_timeout: float = 300.0
    api_key: str | None = dataclasses.field(default=None, repr=False)
    tool_call_parser: str | None = None
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))

    def max_new_tokens(self, request: Request, prompt_tokens: int) -> int:
        """``max_tokens`` checked against the limit and the room left in the context.

        Absent: the smaller of ``max_tokens_limit`` and the room left.
        """
        name = request.max_tokens_field
        param = "messages" if request.chat else "prompt"
        ctx = context_length(self.chat_model.model)
        room = self.max_tokens_limit if ctx is None else ctx - prompt_tokens
        if room < (request.max_tokens != 0):
            raise field_error(
                param,
                f"the prompt is {prompt_tokens} tokens and fills the "
                f"model's context of {ctx} tokens; shorten it",
            )
        n = request.max_tokens
        if n == 0 and room >= 0:  # echo: the prompt's log-probabilities only
            return 0
        if n is None:
            return min(self.max_tokens_limit, room)
        if n > self.max_tokens_limit:
            raise field_error(
                name,
                f"{n} is more than this server's limit of "
                f"{self.max_tokens_limit} tokens",
            )
        if n > room:
            raise field_error(
                name,
                f"the prompt ({prompt_tokens} tokens) plus {n} new tokens "
                f"exceeds the model's context of {ctx} tokens",
            )
        return n

    def check(self, request: Request, prompt: Any) -> int:
        """Raise the `RequestError` that generating for ``prompt`` would.

        Returns the ``max_new_tokens`` of its generation. A stream checks every
        prompt before it sends its header.
        """
        if request.tools is not None and self.tool_call_parser is None:
            raise field_error(
                "tools",
                "this server reads no function calls: start it with "
                f"--tool-call-parser ({' or '.join(PARSERS)}, the model's format)",
            )
        try:
            prompt_tokens = len(self._prompt_ids(request, prompt))
        except (FormatError, TemplateError, ShapeError, ConfigError) as e:
            param = "messages" if request.chat else "prompt"
            raise RequestError(400, str(e), param) from None
        return self.max_new_tokens(request, prompt_tokens)

    def generate(
        self, request: Request, prompt: Any, sample: int = 0
    ) -> Generator[Item, None, None]:
        """The reply's text pieces to ``prompt``, then its `Reply`.

        Each piece comes with its `ReplyStream`, whose ``ids`` are the tokens
        generated so far (those that made it and the ones before) and, with
        ``logprobs``, whose `ReplyStream.logprobs` are theirs. ``sample``: which of
        the request's ``n`` choices (its key is folded in).

        Callers hold ``lock``. The checks (template, length) raise before the
        first piece.
        """
        import jax

        cm = self.chat_model
        n = self.check(request, prompt)
        try:
            key = None
            if request.options["temperature"] > 0:
                seed = secrets.randbits(63) if request.seed is None else request.seed
                key = jax.random.key(seed)
                if sample:
                    key = jax.random.fold_in(key, sample)
            stream = cm.stream_reply(
                prompt,
                tools=request.tools,
                max_new_tokens=n,
                chat=request.chat,
                key=key,
                logprobs=request.logprobs,
                **request.options,
            )
        except (FormatError, TemplateError, ShapeError, ConfigError) as e:
            param = "messages" if request.chat else "prompt"
            raise RequestError(400, str(e), param) from None
        for piece in stream:
            yield piece, stream
        assert stream.reply is not None
        yield stream.reply

    def choice(
        self, request: Request, prompt: Any, index: int, sample: int = 0
    ) -> tuple[dict, Reply]:
        """One whole choice of a request that does not stream, and its `Reply`.

        With ``echo`` the prompt's text comes first; with ``logprobs`` the tokens'
        log-probabilities (`entrenar.chat.openai_logprobs`).
        """
        pieces = self.generate(request, prompt, sample)
        try:
            *parts, reply = list(pieces)
        finally:
            pieces.close()
        assert isinstance(reply, Reply)
        text = "".join(p[0] for p in parts if isinstance(p, tuple))
        if request.echo:
            text = self.echo_text(prompt) + text
        out = choice_entry(request.chat, text, reply.finish_reason, False, index=index)
        if request.tools is not None and self.tool_call_parser is not None:
            found = parse_tool_calls(text, self.tool_call_parser)
            if found is not None:
                content, calls = found
                out["message"]["content"] = content
                out["message"]["tool_calls"] = tool_calls(calls, self.tool_call_parser)
                out["finish_reason"] = "tool_calls"
        if request.logprobs is not None:
            out["logprobs"] = self.logprobs(request, prompt, reply)
        return out, reply

    def echo_text(self, prompt: Any) -> str:
        """The text ``echo`` puts before a completion: the prompt's, or its ids'."""
        if isinstance(prompt, str):
            return prompt
        cm = self.chat_model
        return cm.tokenizer.decode(cm.encode(prompt, chat=False))

    def _prompt_ids(self, request: Request, prompt: Any) -> list[int]:
        """The prompt's token ids, as the generation reads it."""
        return self.chat_model.encode(
            prompt, chat=request.chat, tools=request.tools if request.chat else None
        )

    def prompt_logprobs(
        self, request: Request, prompt: Any
    ) -> tuple[list[int], TokenLogprobs]:
        """An echoed prompt's ids and the scores of each but the first.

        One forward pass over the prompt (`entrenar.nn.token_logprobs`).
        """
        cm = self.chat_model
        ids = self._prompt_ids(request, prompt)
        top = request.logprobs or 0
        if len(ids) < 2:
            return ids, empty_scores(top)
        return ids, token_logprobs(
            cm.model, cm.params, ids, start=1, top=top,
            vocab_limit=len(cm.tokenizer.tokens),
            decode_activations=cm.decode_activations,
        )  # fmt: skip

    def logprobs(self, request: Request, prompt: Any, reply: Reply) -> dict:
        """The ``logprobs`` object of one whole choice (module `openai_logprobs`).

        The echoed prompt's (`prompt_logprobs`), then the generated tokens' from
        the decoding (`Reply.logprobs`): chat's leave out a closing end-of-turn
        token (`listed_ids`).
        """
        out = ChoiceLogprobs(self.chat_model.tokenizer, request.chat)
        parts = []
        if request.echo:
            parts.append(out.run(*self.prompt_logprobs(request, prompt), context=False))
        gen = listed_ids(reply.token_ids, self.chat_model.stops, request.chat)
        assert reply.logprobs is not None  # asked by `generate`
        parts.append(out.run(gen, reply.logprobs))
        joined = join_logprobs(parts)
        assert joined is not None
        return joined


# ---------------------------------------------------------------------------
# HTTP


class _DeadlineReader(io.RawIOBase):
    """A connection's bytes, every one of them by ``deadline`` (`time.monotonic`).

    The socket timeout bounds one read; this bounds them all, so a client sending
    a byte just within each timeout cannot hold a connection (and one of the
    ``max_connections`` slots) for ever. Past the deadline a read raises
    `TimeoutError` (``http.server`` then drops the connection; `_read_json`
    answers 408). Each read waits at most ``timeout``, which the socket keeps
    afterwards for the replies it writes.
    """

    def __init__(self, sock: Any, timeout: float, deadline: float) -> None:
        super().__init__()
        self.sock, self.timeout, self.deadline = sock, timeout, deadline

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the request came too slowly")
        self.sock.settimeout(min(self.timeout, left))
        try:
            return int(self.sock.recv_into(buffer))
        finally:
            self.sock.settimeout(self.timeout)


class _Handler(BaseHTTPRequestHandler):
    """The routes of the module docstring."""

    server: _HTTPServer
    server_version = "entrenar"
    protocol_version = "HTTP/1.0"  # one request per connection: nothing held idle

    def setup(self) -> None:
        super().setup()
        timeout = self.server.app.socket_timeout
        self.connection.settimeout(timeout)
        self.rfile.close()  # the socket's own file: closed, or it keeps the socket open
        self.rfile = io.BufferedReader(
            _DeadlineReader(self.connection, timeout, time.monotonic() + 2 * timeout)
        )

    def log_message(self, format: str, *args: Any) -> None:
        log.info("%s %s", self.address_string(), format % args)

    # -- sending

    def _send_json(
        self, status: int, obj: Any, headers: dict[str, str] | None = None
    ) -> None:
        data = json.dumps(obj, ensure_ascii=False).encode()
        self.send_response(status)
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _send_error(self, e: RequestError) -> None:
        self.close_connection = True
        self._send_json(e.status, e.body())

    def _event(self, obj: Any) -> None:
        text = obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)
        self.wfile.write(f"data: {text}\n\n".encode())
        self.wfile.flush()

    # -- routes

    def _authorized(self, path: str) -> bool:
        """Whether the request may use ``path``; a 401 was sent if not."""
        key = self.server.app.api_key
        if key is None or not path.startswith("/v1/"):
            return True
        given = self.headers.get("Authorization", "")
        scheme, _, token = given.partition(" ")
        if scheme.lower() == "bearer" and secrets.compare_digest(
            token.strip().encode(), key.encode()
        ):
            return True
        error = RequestError(
            401,
            "a missing or wrong API key: send the header 'Authorization: Bearer "
            "<key>' with the server's --api-key",
            None,
            "invalid_request_error",
            code="invalid_api_key",
        )
        self.close_connection = True
        self._send_json(error.status, error.body(), {"WWW-Authenticate": "Bearer"})
        return False

    def do_GET(self) -> None:
        app = self.server.app
        path = self.path.split("?", 1)[0]
        if not self._authorized(path):
            return
        if path == "/health":
            self._send_json(200, {"status": "ok"})
        elif path == "/v1/models":
            self._send_json(
                200,
                {
                    "object": "list",
                    "data": [
                        {
                            "id": app.model_name,
                            "object": "model",
                            "created": app.created,
                            "owned_by": "entrenar",
                        }
                    ],
                },
            )
        else:
            self._send_error(
                RequestError(404, f"no route GET {path:.100}", None, "not_found_error")
            )

    def do_POST(self) -> None:
        path = self.path.split("?", 1)[0]
        routes = {"/v1/chat/completions": True, "/v1/completions": False}
        self._streaming = False
        if not self._authorized(path):
            return
        try:
            if path not in routes:
                raise RequestError(
                    404, f"no route POST {path:.100}", None, "not_found_error"
                )
            request = parse_request(self._read_json(), chat=routes[path])
            self._answer(request)
        except RequestError as e:
            if self._streaming:  # a choice after the first (its checks passed)
                self._event(e.body())
            else:
                self._send_error(e)
        except OSError as e:  # the client went away or stalled (timeouts included)
            log.info("%s: connection ended: %s", self.address_string(), e)
            self.close_connection = True
        except Exception:  # a bug or a failed generation: a 500, not a dropped line
            log.exception("%s %s failed", self.command, path)
            failed = RequestError(
                500,
                "the generation failed (see the server's log)",
                None,
                "server_error",
            )
            if self._streaming:
                self._event(failed.body())
            else:
                self._send_error(failed)

    def _read_json(self) -> Any:
        """The body, within the limits of the module docstring."""
        app = self.server.app
        if self.headers.get("Transfer-Encoding"):
            raise RequestError(411, "send the body with a Content-Length, not chunked")
        length = self.headers.get("Content-Length")
        if length is None:
            raise RequestError(411, "a Content-Length header is required")
        digits = length.strip()
        if not (digits.isascii() and digits.isdigit()):  # not "²", "+5", "-1", "1e3"
            raise RequestError(400, f"bad Content-Length {length!r:.40}")
        # 19 digits or more: past any limit (and past what int() converts, at 4300)
        n = int(digits) if len(digits.lstrip("0")) <= 18 else 10**18
        if n > app.max_body_bytes:
            raise RequestError(
                413, f"the body is {n} bytes; at most {app.max_body_bytes} are accepted"
            )
        chunks, got = [], 0
        while got < n:  # within the request's deadline (`_DeadlineReader`)
            try:
                chunk = self.rfile.read1(min(n - got, 1 << 16))
            except TimeoutError:
                raise RequestError(408, "the body came too slowly") from None
            if not chunk:
                raise RequestError(400, f"the body ended after {got} of {n} bytes")
            chunks.append(chunk)
            got += len(chunk)
        try:
            text = b"".join(chunks).decode("utf-8")
        except UnicodeDecodeError as e:
            raise RequestError(
                400, f"the body is not UTF-8 ({e.reason} at byte {e.start})"
            ) from None
        try:
            return parse_json(text, "the body", max_depth=MAX_JSON_DEPTH)
        except FormatError as e:
            raise RequestError(400, str(e)) from None

    def _answer(self, request: Request) -> None:
        """Generate under the lock, and send the reply or the stream."""
        app = self.server.app
        if not app.lock.acquire(timeout=app.queue_timeout):
            raise RequestError(
                503, "the server is busy; try again later", None, "server_busy"
            )
        rid = ("chatcmpl-" if request.chat else "cmpl-") + uuid.uuid4().hex
        head = {"id": rid, "created": int(time.time()), "model": app.model_name}
        try:
            if not request.stream:
                self._whole(request, head)
                return
            for prompt in request.prompts[1:]:  # every prompt, before any header
                app.check(request, prompt)
            pieces = app.generate(request, request.prompts[0])
            try:
                first = next(pieces)  # the first prompt's checks run here
                self._stream(request, head, _chain(first, pieces))
            finally:
                pieces.close()  # a client gone mid-stream: the decoding ends here
        finally:
            app.lock.release()

    def _whole(self, request: Request, head: dict[str, Any]) -> None:
        """Every prompt's choice, then one reply (nothing is sent on an error)."""
        choices: list[dict[str, Any]] = []
        usage = dict.fromkeys(("prompt_tokens", "completion_tokens", "total_tokens"), 0)
        for i, prompt in enumerate(request.prompts):
            for j in range(request.n):  # OpenAI's order: prompt by prompt
                choice, reply = self.server.app.choice(
                    request, prompt, i * request.n + j, j
                )
                choices.append(choice)
                add_usage(usage, reply, j)
        kind = "chat.completion" if request.chat else "text_completion"
        self._send_json(
            200, {**head, "object": kind, "choices": choices, "usage": usage}
        )

    def _stream(
        self,
        request: Request,
        head: dict[str, Any],
        first: Generator[Item, None, None],
    ) -> None:
        """Every choice's chunks, one choice after another, then usage and [DONE].

        ``first``: the pieces of the first choice, already started.
        """
        app = self.server.app
        self.close_connection = True
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.end_headers()
        self._streaming = True
        kind = "chat.completion.chunk" if request.chat else "text_completion"
        usage = dict.fromkeys(("prompt_tokens", "completion_tokens", "total_tokens"), 0)
        for i, prompt in enumerate(request.prompts):
            for j in range(request.n):
                pieces = first if i == j == 0 else app.generate(request, prompt, j)
                try:
                    chunks = ChoiceStream(
                        app, request, prompt, i * request.n + j, pieces
                    )
                    for entry in chunks:
                        self._event({**head, "object": kind, "choices": [entry]})
                    reply = chunks.reply
                    assert reply is not None  # the entries were exhausted
                finally:
                    pieces.close()
                add_usage(usage, reply, j)
        if request.include_usage:
            self._event({**head, "object": kind, "choices": [], "usage": usage})
        self._event("[DONE]")


def _chain(first: Item, rest: Iterator[Item]) -> Generator[Item, None, None]:
    yield first
    yield from rest


class _HTTPServer(ThreadingHTTPServer):
    """`ThreadingHTTPServer` with the `Server` it serves and a connection bound."""

    daemon_threads = True
    block_on_close = False

    def __init__(
        self, address: tuple[str, int], app: Server, max_connections: int
    ) -> None:
        self.app = app
        self.slots = threading.BoundedSemaphore(max_connections)
        super().__init__(address, _Handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self.slots.acquire(blocking=False):  # too many: refuse at once
            try:
                request.settimeout(1.0)
                body = json.dumps(
                    RequestError(
                        503,
                        "too many connections; try again later",
                        None,
                        "server_busy",
                    ).body()
                )
                request.sendall(
                    f"HTTP/1.0 503 Service Unavailable\r\nContent-Type: "
                    f"application/json\r\nContent-Length: {len(body)}\r\n\r\n"
                    f"{body}".encode()
                )
            except OSError:
                pass
            self.shutdown_request(request)
            return
        super().process_request(request, client_address)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.slots.release()


def make_server(
    chat_model: ChatModel,
    *,
    host: str = "127.0.0.1",
    port: int = 8080,
    model_name: str = "entrenar",
    max_tokens_limit: int = DEFAULT_MAX_TOKENS_LIMIT,
    max_body_bytes: int = MAX_BODY_BYTES,
    socket_timeout: float = 30.0,
    queue_timeout: float = 300.0,
    max_connections: int = 32,
    api_key: str | None = None,
    tool_call_parser: str | None = None,
) -> ThreadingHTTPServer:
    """An HTTP server answering OpenAI's API with ``chat_model`` (module docstring).

    Run it with ``serve_forever()`` (in a thread, or the main one); ``port=0`` takes a
    free port (``server.server_address[1]``); ``shutdown()`` then ``server_close()``
    stops it.

    Args:
        chat_model: the model that answers.
        host: the address to listen on (the default answers this machine only).
        port: the port (0: any free one).
        model_name: the model's name in replies and ``/v1/models``.
        max_tokens_limit: the most tokens one request may ask for.
        max_body_bytes: the largest request body (413 beyond).
        socket_timeout: seconds one read or write on a connection may wait.
        queue_timeout: seconds a request waits for the generation in progress.
        max_connections: connections served at once (503 beyond).
        api_key: the key every ``/v1/`` request must send as ``Authorization:
            Bearer <api_key>`` (module docstring); None: no key.
        tool_call_parser: the model's function-call format for requests with
            ``tools`` (`entrenar.chat.tool_calls.PARSERS`); None: such requests
            are refused.

    Raises:
        ConfigError: a limit below 1, an empty or non-printable-ASCII key, or an
            unknown tool-call parser.
    """
    if tool_call_parser is not None and tool_call_parser not in PARSERS:
        raise ConfigError(
            f"make_server: tool_call_parser must be one of {PARSERS}, got "
            f"{tool_call_parser!r}"
        )
    if api_key is not None and not (
        api_key and api_key.isascii() and api_key.isprintable() and " " not in api_key
    ):
        raise ConfigError(
            "make_server: api_key must be a non-empty string of printable ASCII "
            "characters without spaces (an HTTP header carries it)"
        )
    for name, v in (
        ("max_tokens_limit", max_tokens_limit),
        ("max_body_bytes", max_body_bytes),
        ("max_connections", max_connections),
        ("socket_timeout", socket_timeout),
        ("queue_timeout", queue_timeout),
    ):
        if not v > 0:
            raise ConfigError(f"make_server: {name} must be > 0, got {v}")
    app = Server(
        chat_model,
        model_name,
        max_tokens_limit=max_tokens_limit,
        max_body_bytes=max_body_bytes,
        socket_timeout=socket_timeout,
        queue_timeout=queue_timeout,
        api_key=api_key,
        tool_call_parser=tool_call_parser,
    )
    return _HTTPServer((host, port), app, max_connections)


__all__ = [
    "DEFAULT_MAX_TOKENS_LIMIT",
    "MAX_BODY_BYTES",
    "MAX_JSON_DEPTH",
    "Server",
    "make_server",
]
