"""Function calls: `parse_tool_calls` and `entrenar serve --tool-call-parser`."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from entrenar.chat import ChatModel
from entrenar.chat.tool_calls import ToolCall, parse_tool_calls
from entrenar.errors import ConfigError

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_chat import END, TOKENIZER
from test_chat_server import _serve, post

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


def test_an_unknown_parser_is_refused():
    with pytest.raises(ValueError, match="hermes"):
        parse_tool_calls("x", "xml")


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet='<>/tool_cal{}[]":;, \\abn', max_size=300))
def test_any_text_is_parsed_or_left_as_content(text):
    for parser in ("hermes", "llama3_json"):
        found = parse_tool_calls(text, parser)
        assert found is None or all(isinstance(c, ToolCall) for c in found[1])


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
    ({"tools": TOOLS, "stream": True}, "tools", "not supported with stream"),
    ({"tools": [{"type": "function"}]}, "tools[0]", "expected"),
    ({"tools": "get_weather"}, "tools", "list"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [{}]}]},
     "messages[0].tool_calls[0]", "expected"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]},
     "messages[0].tool_calls[0].function.arguments", "JSON"),
]  # fmt: skip


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
