"""Family chat templates render as transformers' ``apply_chat_template`` renders them.

`render_chat` against ``transformers.utils.chat_template_utils.render_jinja_template``
(what ``apply_chat_template`` calls) on templates in the style of Llama 3.1, Qwen2.5,
Qwen3, Mistral, Gemma 2/3, Phi-3 and SmolLM2 (`chat_templates`): a user turn, a system
message, several turns, with and without the generation prompt, with tools; a
template that refuses a conversation raises `TemplateError` with its message.
"""

import re
import sys
from pathlib import Path

import pytest

from entrenar.data import render_chat
from entrenar.errors import TemplateError

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
