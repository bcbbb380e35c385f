"""Family chat templates render as transformers' ``apply_chat_template`` renders them.

`render_chat` against ``transformers.utils.chat_template_utils.render_jinja_template``
(what ``apply_chat_template`` calls) on templates in the style of Llama 3.1, Qwen2.5,
Qwen3, Mistral, Gemma 2/3, Phi-3, SmolLM2 and gpt-oss's harmony format
(`chat_templates`): a user turn, a system
message, several turns, with and without the generation prompt, with tools; a
template that refuses a conversation raises `TemplateError` with its message.
"""

import re
import sys
from pathlib import Path

import pytest

from entrenar.data import assistant_spans, render_chat
from entrenar.errors import FormatError, TemplateError

sys.path.insert(0, str(Path(__file__).resolve().parent))
from chat_templates import FAMILY_TEMPLATES

utils = pytest.importorskip("transformers.utils.chat_template_utils")

SPECIAL = dict(bos_token="<s>", eos_token="</s>", pad_token="<pad>")
CONVERSATIONS = {
    "user": [{"role": "user", "content": "Hi  there "}],
    "system": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
    ],
    "turns": [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "<think>\nx\n</think>\n\nb"},
        {"role": "user", "content": "ü 日本 {{ x }}\n"},
    ],
    "no_system": [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b"},
        {"role": "user", "content": "c"},
    ],
    "not_alternating": [
        {"role": "user", "content": "a"},
        {"role": "user", "content": "b"},
    ],
}
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {}}}]


def _transformers(messages, template, **kw):
    """The transformers rendering, or the TemplateError message it raises."""
    import jinja2

    try:
        out = utils.render_jinja_template([messages], chat_template=template, **kw)
    except jinja2.TemplateError as e:
        return TemplateError, str(e)
    return out[0][0]


@pytest.mark.parametrize("family", FAMILY_TEMPLATES)
@pytest.mark.parametrize("conversation", CONVERSATIONS)
@pytest.mark.parametrize("gen", [False, True])
def test_family_templates_render_as_transformers(family, conversation, gen):
    template, messages = FAMILY_TEMPLATES[family], CONVERSATIONS[conversation]
    want = _transformers(messages, template, add_generation_prompt=gen, **SPECIAL)
    if isinstance(want, tuple):  # the template refuses the conversation
        with pytest.raises(TemplateError, match=re.escape(f"chat template: {want[1]}")):
            render_chat(messages, template, add_generation_prompt=gen, **SPECIAL)
        return
    got = render_chat(messages, template, add_generation_prompt=gen, **SPECIAL)
    assert got == want


@pytest.mark.parametrize("family", ["llama31", "qwen25", "qwen3"])
def test_tools_render_as_transformers(family):
    template, messages = FAMILY_TEMPLATES[family], CONVERSATIONS["system"]
    want = _transformers(messages, template, tools=TOOLS, **SPECIAL)
    got = render_chat(messages, template, tools=TOOLS, **SPECIAL)
    assert got == want and '"name": "f"' in got


def test_no_tools_is_none_as_in_transformers():
    """The transformers renderer passes tools=None and documents=None by default."""
    template = (
        "{% if tools is not none %}[TOOLS]{{ tools | tojson }}{% endif %}"
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
        "{% if documents is not none %}[DOCS]{% endif %}"
    )
    messages = CONVERSATIONS["user"]
    assert render_chat(messages, template) == _transformers(messages, template)
    assert render_chat(messages, template) == "<user>Hi  there "
    assert render_chat(messages, template, tools=TOOLS).startswith("[TOOLS][{")


HARMONY_TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather at a place.",
    "parameters": {"type": "object", "required": ["place"], "properties": {
        "place": {"type": "string"},
        "unit": {"type": "string", "enum": ["c", "f"], "default": "c"},
        "days": {"type": "array", "items": {"type": "integer"}},
        "where": {"type": "object", "required": ["lat"], "properties": {
            "lat": {"type": "number"}, "lon": {"type": ["number", "null"]}}},
    }},
}}]  # fmt: skip
HARMONY_CHAT = [
    {"role": "system", "content": "Answer in French."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "thinking": "Need the tool.", "tool_calls": [
        {"type": "function", "function": {
            "name": "get_weather", "arguments": {"place": "Paris", "days": [1]}}}]},
    {"role": "tool", "content": "{\"temp\": 20}"},
    {"role": "assistant", "thinking": "20 degrees.", "content": "Il fait 20 °C."},
]  # fmt: skip


HARMONY_KW = {"reasoning_effort": "high", "builtin_tools": ["browser", "python"]}


@pytest.mark.parametrize("cut", [2, 4, 5])
@pytest.mark.parametrize("kw", [{}, HARMONY_KW])
def test_harmony_channels_tools_and_thinking_render_as_transformers(cut, kw):
    """gpt-oss's harmony format renders as transformers renders it.

    Tool namespaces (recursive macros), analysis and final channels, a tool call and
    its result, kwargs; with the generation prompt when the conversation ends on a
    user or tool turn.
    """
    template = FAMILY_TEMPLATES["harmony"]
    messages = HARMONY_CHAT[:cut]
    gen = messages[-1]["role"] != "assistant"
    want = _transformers(messages, template, tools=HARMONY_TOOLS,
                         add_generation_prompt=gen, **kw)  # fmt: skip
    got = render_chat(messages, template, tools=HARMONY_TOOLS,
                      add_generation_prompt=gen, **kw)  # fmt: skip
    assert got == want
    assert 'unit?: "c" | "f", // default: "c"' in got
    assert "where?: {\nlat: number, lon?: number | null}" in got
    if cut == 5:  # the last reply keeps its analysis channel, the call's is dropped
        assert got.endswith(
            "<|start|>assistant<|channel|>analysis<|message|>20 degrees.<|end|>"
            "<|start|>assistant<|channel|>final<|message|>Il fait 20 °C.<|return|>"
        )
        assert "Need the tool." not in got


def test_harmony_refusals_and_reply_spans():
    """Harmony's refusals, and which replies training can locate.

    The template's own refusal is a TemplateError with its message; a single reply
    is located for training, and a conversation whose earlier replies render
    otherwise than as the last (``<|end|>`` vs ``<|return|>``) is refused by name.
    """
    template = FAMILY_TEMPLATES["harmony"]
    tagged = "<|channel|>final<|message|>b"
    bad = [{"role": "user", "content": "a"}, {"role": "assistant", "content": tagged}]
    with pytest.raises(TemplateError, match="'thinking' field"):
        render_chat(bad, template)
    one = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    text, spans = assistant_spans(one, template)
    assert [text[a:b] for a, b in spans] == ["<|channel|>final<|message|>b<|return|>"]
    two = [*one, {"role": "user", "content": "c"}, {**one[1], "content": "d"}]
    with pytest.raises(FormatError, match=r"messages\[1\].*generation"):
        assistant_spans(two, template)
