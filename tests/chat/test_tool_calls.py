"""Function calls: `parse_tool_calls` and `entrenar serve --tool-call-parser`."""

from __future__ import annotations

import dataclasses
import itertools
import json
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from entrenar.chat import ChatModel
from entrenar.chat.tool_calls import (
    MARKERS,
    PARSERS,
    ToolCall,
    ToolCallStream,
    _opening,
    parse_tool_calls,
)
from entrenar.errors import ConfigError
from entrenar.nn.generate import partial_stop

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_chat import END, TOKENIZER
from test_chat_server import _serve, post, stream_equals_whole

CALL = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
WEATHER = ToolCall("get_weather", '{"city": "Paris"}')


@pytest.mark.parametrize(
    ("text", "want"),
    [
        (f"<tool_call>\n{CALL}\n</tool_call>", (None, [WEATHER])),
        (f"Let me check.\n<tool_call>{CALL}</tool_call>\n<tool_call>\n"
         '{"name": "f", "arguments": {}}\n</tool_call>\n',
         ("Let me check.", [WEATHER, ToolCall("f", "{}")])),
        ('<tool_call>{"name": "f", "arguments": "{\\"a\\": [1, 2]}"}</tool_call>',
         (None, [ToolCall("f", '{"a": [1, 2]}')])),  # arguments as a JSON string
        ("no call here", None),
        (f"<tool_call>\n{CALL}", None),  # cut off by max_tokens
        (f"<tool_call>{CALL}</tool_call> and then some", None),  # text after
        ("<tool_call>{not json}</tool_call>", None),
        ('<tool_call>{"arguments": {}}</tool_call>', None),  # no name
        ('<tool_call>{"name": "f", "arguments": [1]}</tool_call>', None),
        ("<tool_call>" + "[" * 40 + "]" * 40 + "</tool_call>", None),  # too deep
    ],
)  # fmt: skip
def test_hermes(text, want):
    assert parse_tool_calls(text, "hermes") == want


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ('{"name": "get_weather", "parameters": {"city": "Paris"}}', (None, [WEATHER])),
        ('<|python_tag|>{"name": "get_weather", "arguments": {"city": "Paris"}}',
         (None, [WEATHER])),
        ('{"name": "f", "parameters": {"s": "a;b}"}}; {"name": "g", "parameters": {}}',
         (None, [ToolCall("f", '{"s": "a;b}"}'), ToolCall("g", "{}")])),
        ("The weather is fine.", None),
        ('{"name": "f", "parameters": {}} trailing', None),
        ('{"name": "f"', None),
    ],
)  # fmt: skip
def test_llama3_json(text, want):
    assert parse_tool_calls(text, "llama3_json") == want


MISTRAL = '[{"name": "get_weather", "arguments": {"city": "Paris"}}]'


@pytest.mark.parametrize(
    ("text", "want"),
    [
        (f"[TOOL_CALLS]{MISTRAL}", (None, [WEATHER])),
        (f"[TOOL_CALLS] {MISTRAL}\n", (None, [WEATHER])),
        (MISTRAL, (None, [WEATHER])),  # the control token left out of the text
        (f"Let me check.[TOOL_CALLS]{MISTRAL}", ("Let me check.", [WEATHER])),
        ('[TOOL_CALLS][{"name": "f", "arguments": {}}, {"name": "g", "arguments": '
         '"{\\"a\\": 1}"}]', (None, [ToolCall("f", "{}"), ToolCall("g", '{"a": 1}')])),
        ("The weather is fine.", None),
        ("[1] The weather is fine.", None),
        ("[TOOL_CALLS][]", None),  # no call
        ('[TOOL_CALLS]{"name": "f", "arguments": {}}', None),  # not a list
        (f"[TOOL_CALLS]{MISTRAL} trailing", None),
        ('[TOOL_CALLS][{"name": "f", "arguments": [1]}]', None),
        ('[TOOL_CALLS][{"name": "f", "arguments": {}}', None),  # cut off
    ],
)  # fmt: skip
def test_mistral(text, want):
    assert parse_tool_calls(text, "mistral") == want


def test_an_unknown_parser_is_refused():
    with pytest.raises(ValueError, match="hermes"):
        parse_tool_calls("x", "xml")


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet='<>/tool_cal{}[]":;, \\abn', max_size=300))
def test_any_text_is_parsed_or_left_as_content(text):
    for parser in PARSERS:
        found = parse_tool_calls(text, parser)
        assert found is None or all(isinstance(c, ToolCall) for c in found[1])


def _streamed(text: str, cuts: list[int], parser: str) -> tuple[list[str], str, list]:
    """The content pieces `ToolCallStream` sends for ``text`` cut at ``cuts``."""
    bounds = [0, *sorted({min(c, len(text)) for c in cuts}), len(text)]
    stream = ToolCallStream(parser)
    sent = [stream.feed(text[a:b]) for a, b in itertools.pairwise(bounds)]
    rest, calls = stream.finish()
    return [p for p in sent if p], rest, calls


PIECES = ["<tool_call>", "</tool_call>", CALL, "\n", " ", "Hi", "<tool", "<", "{",
          '{"name": "f", "parameters": {}}', "<|python_tag|>", ";", "[", "[TOOL",
          "[TOOL_CALLS]"]  # fmt: skip
CALLS = ["", f"<tool_call>{CALL}</tool_call>", f"<tool_call>\n{CALL}\n</tool_call>\n",
         f"<tool_call>{CALL}</tool_call> <tool_call>{CALL}</tool_call>",
         '{"name": "f", "parameters": {}}; {"name": "g", "parameters": {}}',
         "<|python_tag|>" + CALL, "[TOOL_CALLS]" + MISTRAL, MISTRAL]  # fmt: skip


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.sampled_from(PIECES), max_size=6),
    st.sampled_from(CALLS),
    st.lists(st.integers(0, 200), max_size=16),
)
def test_a_streamed_reply_gives_the_whole_replys_calls(parts, calls, cuts):
    """Any text cut anywhere: the content sent and the calls are the whole text's.

    (`parse_tool_calls` strips the content before calls; a stream sends its leading
    whitespace before it knows.)
    """
    text = "".join(parts) + calls
    for parser in PARSERS:
        sent, rest, got = _streamed(text, cuts, parser)
        found = parse_tool_calls(text, parser)
        content = "".join(sent) + rest
        if found is None:
            assert content == text and got == []
            continue
        assert got == found[1]
        assert content.lstrip() == (found[0] or "")  # no part of a call was sent


def test_content_streams_until_a_call_could_begin():
    text = f"Let me check.\n<tool_call>{CALL}</tool_call>"
    sent, rest, calls = _streamed(text, list(range(len(text))), "hermes")
    assert "".join(sent) == "Let me check." and rest == "" and calls == [WEATHER]
    # a piece per character; a space waits for the next (it may precede a call)
    assert sent == ["L", "e", "t", " m", "e", " c", "h", "e", "c", "k", "."]
    sent, rest, calls = _streamed("a <tool b", list(range(9)), "hermes")
    assert sent == ["a", " <tool", " b"] and calls == []  # "<tool" held, then sent
    sent, rest, calls = _streamed("The weather", list(range(11)), "llama3_json")
    assert "".join(sent) == "The weather" and rest == "" and calls == []


class RescanStream:
    """The stream before session 29, kept as the oracle of `ToolCallStream.feed`.

    It re-joined the whole text and re-scanned its held end for each piece.
    """

    def __init__(self, parser: str) -> None:
        self.parser, self.text, self.sent = parser, "", 0
        self.calls_at: int | None = None
        self.mode: str | None = None

    def feed(self, piece: str) -> str:
        before = len(self.text)
        self.text += piece
        end = self._safe(before)
        if end <= self.sent:
            return ""
        out, self.sent = self.text[self.sent : end], end
        return out

    def _safe(self, before: int) -> int:
        text = self.text
        if self.mode is None:
            self.mode = _opening(text.lstrip(), self.parser)
            if self.mode is None:
                return 0
        marker = MARKERS.get(self.parser)
        if self.mode == "calls":
            return 0
        if marker is None:
            return len(text)
        if self.calls_at is None:
            at = text.find(marker, max(0, before - len(marker) + 1))
            self.calls_at = None if at < 0 else at
        end = self.calls_at
        if end is None:
            end = len(text) - partial_stop(text[-len(marker) :], [marker])
        while end > self.sent and text[end - 1].isspace():
            end -= 1
        return end


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.sampled_from([*PIECES, "  ", "\n\n", " \t ", "x ", " <tool_call", "|>"]),
        max_size=10,
    ),
    st.sampled_from(CALLS),
    st.lists(st.integers(0, 200), max_size=24),
)
def test_a_stream_sends_the_pieces_the_rescanning_stream_sent(parts, calls, cuts):
    """The linear `ToolCallStream` sends what the quadratic one did, piece by piece."""
    text = "".join(parts) + calls
    bounds = [0, *sorted({min(c, len(text)) for c in cuts}), len(text)]
    for parser in PARSERS:
        new, old = ToolCallStream(parser), RescanStream(parser)
        for a, b in itertools.pairwise(bounds):
            assert new.feed(text[a:b]) == old.feed(text[a:b]), (parser, text, a, b)
        assert new.sent == old.sent


@pytest.mark.parametrize("parser", PARSERS)
def test_a_long_held_reply_streams_in_linear_time(parser, deadline):
    """200,000 one-character pieces: spaces held before a call, a call held whole.

    (The rescanning stream took 10 s of CPU for 20,000 spaces, 4x that for twice
    as many.)
    """
    n = 200_000
    for text in (
        "Hi" + " " * n + f"<tool_call>{CALL}</tool_call>",
        "<|python_tag|>" + " " * n + "Hi",
        "[" + " " * n + "]",
        "ab " * n,
    ):
        stream = ToolCallStream(parser)
        with deadline(10):
            sent = "".join(map(stream.feed, text))
            rest, calls = stream.finish()
        whole = parse_tool_calls(text, parser)
        if whole is None:
            assert sent + rest == text and calls == []
        else:
            assert calls == whole[1] and (sent + rest).lstrip() == (whole[0] or "")


def test_many_open_tags_are_parsed_in_one_pass():
    """No backtracking: 20,000 unclosed blocks are rejected at once."""
    assert parse_tool_calls("<tool_call>" * 20_000, "hermes") is None


# ---------------------------------------------------------------------------
# The server

TEMPLATE = (
    "{% if tools %}<|im_start|>system\n<tools>{{ tools | tojson }}</tools><|im_end|>\n"
    "{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>"
    "{{ c.function | tojson }}</tool_call>{% endfor %}"
    "{% else %}{{ m.content }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CITY = {"type": "object", "properties": {"city": {"type": "string"}}}
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": CITY}}]  # fmt: skip
ASK = [{"role": "user", "content": "Weather in Paris?"}]


@dataclasses.dataclass(frozen=True)
class ScriptLM:
    """A causal LM whose next token is a script's, by position after ``start``."""

    start: int
    max_position_embeddings: int = 1024

    def _logits(self, table, pos):
        return table[jnp.clip(pos - (self.start - 1), 0, table.shape[0] - 1)]

    def apply(self, table, tokens):
        return self._logits(table, jnp.arange(tokens.shape[1]))[None]

    def init_cache(self, batch, max_len):
        return jnp.zeros((), jnp.int32)

    def apply_cached(self, table, tokens, cache):
        pos = cache + jnp.arange(tokens.shape[1])
        return self._logits(table, pos)[None], cache + tokens.shape[1]


def _scripted(text: str, messages, tools) -> ChatModel:
    """A `ChatModel` that answers ``messages`` (with ``tools``) with ``text``."""
    script = [*text.encode(), END]
    table = np.full((len(script), 258), -20.0, np.float32)
    table[np.arange(len(script)), script] = 20.0
    probe = ChatModel(
        ScriptLM(0), jnp.asarray(table), TOKENIZER, chat_template=TEMPLATE
    )
    start = len(probe.encode(messages, tools=tools))
    return dataclasses.replace(probe, model=ScriptLM(start))


@pytest.fixture(scope="module")
def tools_url():
    chat = _scripted(f"<tool_call>\n{CALL}\n</tool_call>", ASK, TOOLS)
    server, url = _serve(chat, tool_call_parser="hermes")
    yield url, chat
    server.shutdown()
    server.server_close()


def test_a_call_comes_back_as_tool_calls(tools_url):
    url, chat = tools_url
    status, out = post(url + "/v1/chat/completions", {"messages": ASK, "tools": TOOLS})
    assert status == 200, out
    choice = out["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    message = choice["message"]
    assert message["content"] is None
    (call,) = message["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert out["usage"]["prompt_tokens"] == len(chat.encode(ASK, tools=TOOLS))


def test_without_tools_the_same_text_is_content(tools_url):
    url, _ = tools_url
    status, out = post(url + "/v1/chat/completions", {"messages": ASK})
    assert status == 200, out
    assert out["choices"][0]["finish_reason"] == "stop"
    assert "tool_calls" not in out["choices"][0]["message"]


def test_a_calls_result_goes_back_to_the_template(tools_url):
    """A call's arguments (a JSON string) reach the template as a mapping."""
    url, chat = tools_url
    fn = {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    turn = [*ASK,
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function", "function": fn}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "18 C"}]  # fmt: skip
    status, out = post(url + "/v1/chat/completions", {"messages": turn, "tools": TOOLS})
    assert status == 200, out
    rendered = chat.render([*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"type": "function", "function": {"name": "get_weather",
                                          "arguments": {"city": "Paris"}}}]}],
        tools=TOOLS)  # fmt: skip
    assert (
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}' in rendered
    )
    as_mapping = [*turn[:1], {**turn[1], "tool_calls": [
        {"type": "function", "function": {**fn, "arguments": {"city": "Paris"}}}]},
        turn[2]]  # fmt: skip
    want = len(chat.encode(as_mapping, tools=TOOLS))  # a string would be escaped
    assert out["usage"]["prompt_tokens"] == want


BAD_TOOLS = [
    ({"tools": TOOLS, "tool_choice": "required"}, "tool_choice", '"auto" and "none"'),
    ({"tools": [{"type": "function"}]}, "tools[0]", "expected"),
    ({"tools": "get_weather"}, "tools", "list"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [{}]}]},
     "messages[0].tool_calls[0]", "expected"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]},
     "messages[0].tool_calls[0].function.arguments", "JSON"),
]  # fmt: skip


STREAMED = [
    ("hermes", f"<tool_call>\n{CALL}\n</tool_call>", "tool_calls"),
    ("hermes", f"Let me check.\n<tool_call>{CALL}</tool_call>\n", "tool_calls"),
    ("hermes", f"<tool_call>{CALL}</tool_call><tool_call>{CALL}</tool_call>",
     "tool_calls"),
    ("hermes", "<tool_call>{not json}</tool_call>", "stop"),  # falls back to content
    ("hermes", "It is 18 C <tool in Paris.", "stop"),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris"}}',
     "tool_calls"),
    ("llama3_json", "The weather is fine.", "stop"),
    ("llama3_json", '{"name": "f", "parameters": {}} trailing', "stop"),
    ("mistral", f"[TOOL_CALLS]{MISTRAL}", "tool_calls"),
    ("mistral", f"Let me check. [TOOL_CALLS]{MISTRAL}", "tool_calls"),
    ("mistral", MISTRAL, "tool_calls"),
    ("mistral", "[TOOL_CALLS] oops", "stop"),
    ("mistral", "It is [18] C [TOOL", "stop"),
]  # fmt: skip


@pytest.mark.parametrize(("parser", "text", "finish"), STREAMED)
@pytest.mark.parametrize("logprobs", [False, True])
def test_streamed_tool_calls_equal_the_whole_replys(parser, text, finish, logprobs):
    """Through the server: the same content, calls, finish and token entries."""
    chat = _scripted(text, ASK, TOOLS)
    server, url = _serve(chat, tool_call_parser=parser)
    try:
        body = {"messages": ASK, "tools": TOOLS, "logprobs": logprobs}
        out, events = stream_equals_whole(url + "/v1/chat/completions", body)
        assert out["choices"][0]["finish_reason"] == finish
        deltas = [e["choices"][0]["delta"] for e in events[:-2]]
        sent = "".join(d.get("content") or "" for d in deltas)
        calls = [d["tool_calls"] for d in deltas if "tool_calls" in d]
        if finish == "tool_calls":
            assert "<tool_call>" not in sent and "{" not in sent
            assert len(calls) == 1  # every call in one delta, before the finish
            assert [c["index"] for c in calls[0]] == list(range(len(calls[0])))
            assert "tool_calls" in deltas[-2] and deltas[-1] == {}
            ids = [
                c["id"] for c in calls[0] + out["choices"][0]["message"]["tool_calls"]
            ]
            if parser == "mistral":  # what Mistral's templates accept back
                assert all(len(i) == 9 and i.isalnum() for i in ids), ids
            else:
                assert all(i.startswith("call_") for i in ids), ids
        else:
            assert sent == text and calls == []
        if logprobs:  # every token's entry, the closing end-of-turn's left out
            assert len(out["choices"][0]["logprobs"]["content"]) == len(text)
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize(("fields", "param", "words"), BAD_TOOLS)
def test_bad_tool_fields_are_400(tools_url, fields, param, words):
    url, _ = tools_url
    status, out = post(url + "/v1/chat/completions", {"messages": ASK, **fields})
    assert status == 400, out
    assert out["error"]["param"] == param and words in out["error"]["message"], out


def test_a_server_without_a_parser_refuses_tools():
    chat = _scripted("hi", ASK, None)
    server, url = _serve(chat)
    try:
        status, out = post(
            url + "/v1/chat/completions", {"messages": ASK, "tools": TOOLS}
        )
        assert status == 400 and out["error"]["param"] == "tools"
        assert "--tool-call-parser" in out["error"]["message"]
        body = {"messages": ASK, "tools": TOOLS, "tool_choice": "none"}
        assert post(url + "/v1/chat/completions", body)[0] == 200  # none: no tools
        status, out = post(url + "/v1/completions", {"prompt": "x", "tools": TOOLS})
        assert status == 400 and out["error"]["param"] == "tools"
    finally:
        server.shutdown()
        server.server_close()


def test_an_unknown_parser_is_a_config_error():
    from entrenar.chat.server import make_server

    with pytest.raises(ConfigError, match="tool_call_parser"):
        make_server(_scripted("x", ASK, None), port=0, tool_call_parser="xml")


def test_tools_need_the_chat_template():
    with pytest.raises(ConfigError, match="chat=True"):
        _scripted("x", ASK, None).encode("hi", chat=False, tools=TOOLS)


def test_json_of_the_call_arguments_round_trips():
    found = parse_tool_calls(f"<tool_call>{CALL}</tool_call>", "hermes")
    assert found is not None and json.loads(found[1][0].arguments) == {"city": "Paris"}
