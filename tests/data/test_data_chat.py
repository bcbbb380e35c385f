"""Chat templates render as transformers renders them; labels cover only replies."""

import sys
from pathlib import Path

import numpy as np
import pytest

from entrenar.data import (
    FastTokenizer,
    apply_chat_template,
    assistant_spans,
    encode_records,
    load_chat_template,
    render_chat,
)
from entrenar.errors import FormatError, TemplateError
from entrenar.io import HFTokenizer, smollm2_path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "io")]
import chat_templates  # noqa: E402  (tests/data)
import hf_cases  # noqa: E402  (tests/io)

CHAT = [
    {"role": "user", "content": "What is the capital of Zorbia?"},
    {"role": "assistant", "content": "Quuxville."},
    {"role": "user", "content": "And its river?"},
    {"role": "assistant", "content": "The Blorp, 12 km long."},
]
SYSTEM = [{"role": "system", "content": "Be brief."}, *CHAT[:2]]
SMOL_DEFAULT = (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by "
    "Hugging Face<|im_end|>\n"
)
# A template that uses what transformers' environment adds: tojson, loop controls,
# raise_exception, {% generation %}, trim_blocks/lstrip_blocks whitespace control.
FANCY = """{{ bos_token }}
{% for m in messages %}
  {% if m.role not in ['system', 'user', 'assistant'] %}
    {{ raise_exception('unknown role ' + m.role) }}
  {% endif %}
  {% if m.role == 'system' %}{% continue %}{% endif %}
  [{{ m.role | upper }}] {{ m | tojson }}
  {% if m.role == 'assistant' %}{% generation %}{{ m.content }}{{ eos_token }}
{% endgeneration %}{% endif %}
{% endfor %}
{% if add_generation_prompt %}[ASSISTANT]{% endif %}"""


@pytest.fixture(scope="module")
def tok():
    return FastTokenizer.from_gguf(smollm2_path())


def _tokenizers(folder, style):
    """The tokenizers of one tiny Hugging Face folder: entrenar's, transformers'."""
    transformers = pytest.importorskip("transformers")
    hf_cases.write_tokenizer(folder, style)
    auto = transformers.AutoTokenizer.from_pretrained(folder)
    return HFTokenizer.from_folder(folder), auto


def _ids(encoded):
    """The ids of ``apply_chat_template(tokenize=True)`` (a list or a mapping)."""
    return list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)


@pytest.mark.slow
def test_smollm2_template_renders_expected_text():
    template = load_chat_template(smollm2_path())
    text = render_chat(CHAT[:2], template, add_generation_prompt=False)
    assert text == (
        SMOL_DEFAULT + "<|im_start|>user\nWhat is the capital of Zorbia?<|im_end|>\n"
        "<|im_start|>assistant\nQuuxville.<|im_end|>\n"
    )
    prompt = render_chat(SYSTEM[:2], template, add_generation_prompt=True)
    assert prompt == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nWhat is the capital of Zorbia?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


@pytest.mark.slow
@pytest.mark.parametrize("template", ["smollm2", FANCY])
@pytest.mark.parametrize("messages", [CHAT, SYSTEM, CHAT[:1]])
@pytest.mark.parametrize("gen", [False, True])
def test_matches_transformers_apply_chat_template(tok, template, messages, gen):
    transformers = pytest.importorskip("transformers")
    if template == "smollm2":
        template = tok.chat_template
    hf = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok._hf[1],
        bos_token=tok.tokens[tok.bos_id],
        eos_token=tok.tokens[tok.eos_id],
    )
    hf.chat_template = template
    want = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
    got = render_chat(
        messages,
        template,
        add_generation_prompt=gen,
        bos_token=tok.tokens[tok.bos_id],
        eos_token=tok.tokens[tok.eos_id],
    )
    assert got == want
    ids = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=gen)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    assert tok.encode(got, special=True) == list(ids)


def test_template_errors_and_sandbox():
    with pytest.raises(TemplateError, match="unknown role tool"):
        render_chat([{"role": "tool", "content": "x"}], FANCY)
    with pytest.raises(TemplateError, match="line 1"):
        render_chat(CHAT, "{% for m in messages %}")
    escape = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    with pytest.raises(TemplateError, match=r"unsafe|access"):
        render_chat(CHAT, escape)
    with pytest.raises(FormatError, match=r"messages\[1\]: 'content' must be a string"):
        render_chat([CHAT[0], {"role": "assistant"}], FANCY)


@pytest.mark.slow
def test_assistant_spans_are_the_replies():
    template = load_chat_template(smollm2_path())
    text, spans = assistant_spans(CHAT, template)
    assert [text[a:b] for a, b in spans] == [
        "Quuxville.<|im_end|>\n",
        "The Blorp, 12 km long.<|im_end|>\n",
    ]


@pytest.mark.slow
def test_template_that_rewrites_history_is_refused(tok):
    # Only the last assistant turn shows its content: renders don't extend each other.
    t = (
        "{% for m in messages %}{{ m.role }}:"
        "{% if m.role != 'assistant' or loop.last %}{{ m.content }}{% endif %}\n"
        "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
    )
    where = r"record 1, column 'messages': messages\[1\]"
    with pytest.raises(FormatError, match=where):
        encode_records([{"messages": CHAT}], tok, format="chat", chat_template=t)


@pytest.mark.slow
def test_chat_labels_only_on_assistant_turns(tok):
    [(ids, labels)] = encode_records([{"messages": CHAT}], tok, format="chat")
    text = render_chat(CHAT, tok.chat_template)
    assert ids.tolist() == tok.encode(text, special=True)  # tokenized as for inference
    trained = labels != -100
    np.testing.assert_array_equal(labels[trained], ids[trained])
    # The trained tokens are exactly the two replies with their end-of-turn.
    runs = np.flatnonzero(np.diff(np.concatenate([[0], trained, [0]]).astype(int)))
    pieces = [tok.decode(ids[a:b], special=True) for a, b in zip(runs[::2], runs[1::2])]
    assert pieces == ["Quuxville.<|im_end|>\n", "The Blorp, 12 km long.<|im_end|>\n"]


@pytest.mark.slow
def test_prompt_completion_labels_only_on_completion(tok):
    recs = [
        {"prompt": "Q: What is 2+2?\nA:", "completion": " 4"},
        {"prompt": "The capital of Zorbia is", "completion": " Quuxville."},
    ]
    for (ids, labels), r in zip(encode_records(recs, tok, format="prompt_completion"),
                                recs):  # fmt: skip
        assert ids.tolist() == [*tok.encode(r["prompt"] + r["completion"]), 2]
        trained = labels != -100
        first = int(np.argmax(trained))
        assert not trained[:first].any() and trained[first:].all()
        assert tok.decode(ids[:first]) == r["prompt"]
        assert tok.decode(ids[first:], special=True) == r["completion"] + "<|im_end|>"
    # Plain text: every token is trained, an EOS closes each document.
    [(ids, labels)] = encode_records([{"text": "Hello there."}], tok, format="text")
    assert labels.tolist() == ids.tolist() == [*tok.encode("Hello there."), 2]


@pytest.mark.slow
def test_apply_chat_template_for_generation(tok):
    ids = apply_chat_template(tok, CHAT[:1])
    text = render_chat(CHAT[:1], tok.chat_template, add_generation_prompt=True)
    assert ids == tok.encode(text, special=True)
    assert text.endswith("<|im_start|>assistant\n")
    assert tok.decode(ids, special=True) == text


def test_labels_with_a_bos_and_specials():
    from entrenar.io import BPETokenizer
    from entrenar.io.tokenizer import bytes_to_unicode

    b2u = bytes_to_unicode()
    tokens = (*[b2u[b] for b in range(256)], "<s>", "</s>", "<|u|>")
    tok = BPETokenizer(tokens, (), (1,) * 256 + (3, 3, 3), bos_id=256, eos_id=257,
                       add_bos=True)  # fmt: skip
    [(ids, labels)] = encode_records(
        [{"prompt": "é?", "completion": "ok"}], tok, format="prompt_completion"
    )
    assert ids.tolist() == [256, 195, 169, 63, 111, 107, 257]  # BOS, é is two bytes
    assert labels.tolist() == [-100, -100, -100, -100, 111, 107, 257]
    t = "{% for m in messages %}<|u|>{{ m.content }}{% endfor %}"
    msgs = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    gen = "{% if add_generation_prompt %}<|u|>{% endif %}"
    # With a generation prompt, the turn's header is prompt; without one, it is the
    # model's to produce.
    for template, want in [(t + gen, [-100] * 4 + [98]), (t, [-100] * 3 + [258, 98])]:
        [(ids, labels)] = encode_records(
            [{"messages": msgs}], tok, format="chat", chat_template=template
        )
        assert ids.tolist() == [256, 258, 97, 258, 98]
        assert labels.tolist() == want


def test_a_template_bos_is_the_only_bos():
    """Llama 3, Mistral and Gemma templates begin with {{ bos_token }}: one BOS."""
    from entrenar.io import BPETokenizer
    from entrenar.io.tokenizer import bytes_to_unicode

    b2u = bytes_to_unicode()
    tokens = (*[b2u[b] for b in range(256)], "<s>", "</s>", "<|u|>")
    tok = BPETokenizer(tokens, (), (1,) * 256 + (3, 3, 3), bos_id=256, eos_id=257,
                       add_bos=True)  # fmt: skip
    t = "{{ bos_token }}{% for m in messages %}<|u|>{{ m.content }}{% endfor %}"
    t += "{% if add_generation_prompt %}<|u|>{% endif %}"
    msgs = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    [(ids, labels)] = encode_records(
        [{"messages": msgs}], tok, format="chat", chat_template=t
    )
    assert ids.tolist() == [256, 258, 97, 258, 98]
    assert labels.tolist() == [-100] * 4 + [98]
    assert apply_chat_template(tok, msgs[:1], chat_template=t) == [256, 258, 97, 258]
    # Without the template's BOS, the tokenizer's own is added as before.
    no_bos = apply_chat_template(
        tok, msgs[:1], chat_template=t[len("{{ bos_token }}") :]
    )
    assert no_bos == [256, 258, 97, 258]


@pytest.mark.parametrize("family", ["llama", "gemma"])
def test_chat_ids_equal_transformers_apply_chat_template(family, tmp_path):
    """A Hugging Face folder's chat ids (prompt and training) as transformers'."""
    from entrenar.chat import ChatModel

    tok, auto = _tokenizers(tmp_path, family)
    msgs = hf_cases.MESSAGES
    for gen, turns in [(True, msgs), (False, msgs[:2])]:
        want = auto.apply_chat_template(turns, tokenize=True, add_generation_prompt=gen)
        assert apply_chat_template(tok, turns, add_generation_prompt=gen) == _ids(want)
    assert ChatModel(None, None, tok).encode(msgs) == apply_chat_template(tok, msgs)
    [(ids, _)] = encode_records([{"messages": msgs[:2]}], tok, format="chat")
    assert ids.tolist() == _ids(auto.apply_chat_template(msgs[:2], tokenize=True))


@pytest.mark.parametrize(
    ("template", "style"),
    [("chatml", "qwen2_split"), ("phi3", "qwen2_split"), ("gemma", "gemma")],
)
@pytest.mark.parametrize("turns", [2, 4])
def test_generation_blocks_are_the_trained_tokens_as_in_trl(template, style, turns,
                                                            tmp_path):  # fmt: skip
    """A template with ``{% generation %}`` blocks trains exactly their tokens.

    TRL's ``assistant_only_loss`` trains the tokens transformers'
    ``apply_chat_template(return_assistant_tokens_mask=True)`` marks; entrenar
    located the replies by rendering prefixes instead, which trained other tokens
    (not ChatML's newline after the role) and refused Phi-3's multi-turn chats.
    """
    tok, auto = _tokenizers(tmp_path, style)
    t = chat_templates.TRAINING_TEMPLATES[template]
    msgs = CHAT[:turns]
    want = auto.apply_chat_template(
        msgs, chat_template=t, return_dict=True, return_assistant_tokens_mask=True
    )
    [(ids, labels)] = encode_records([{"messages": msgs}], tok, format="chat",
                                     chat_template=t)  # fmt: skip
    assert ids.tolist() == list(want["input_ids"])
    mask = np.asarray(want["assistant_masks"], bool)
    assert mask.sum() > turns and labels.tolist() == np.where(mask, ids, -100).tolist()


def test_generation_spans_nested_marked_text_and_captured_blocks():
    from entrenar.data.chat import generation_spans

    t = (
        "{% for m in messages %}<{{ m.role }}>{% if m.role == 'assistant' %}"
        "{% generation %}[{% generation %}{{ m.content }}{% endgeneration %}]"
        "{% endgeneration %}{% else %}{{ m.content }}{% endif %}{% endfor %}"
    )
    msgs = [{"role": "user", "content": "\ue0000\ue001x"},  # the first marks' text
            {"role": "assistant", "content": "y"}]  # fmt: skip
    text, spans = assistant_spans(msgs, t)
    assert [text[a:b] for a, b in spans] == ["[y]"]
    captured = (
        "{% for m in messages %}{% set x %}{% generation %}{{ m.content }}"
        "{% endgeneration %}{% endset %}{{ x | length }}{% endfor %}"
    )
    with pytest.raises(TemplateError, match="generation %} blocks do not render"):
        generation_spans(msgs, captured, render_chat(msgs, captured))


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "weather",
            "description": "The weather of a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
            },
        },
    }
]
TOOL_CHAT = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [{"type": "function",
     "function": {"name": "weather", "arguments": {"city": "Paris"}}}]},
    {"role": "tool", "content": "sunny"},
    {"role": "assistant", "content": "It is sunny."},
]  # fmt: skip


@pytest.mark.parametrize("as_text", [False, True])
def test_tool_calls_and_the_tools_column_reach_the_template(as_text, tmp_path):
    """TRL's tool-calling records: ``tools`` column, ``content: null`` tool calls.

    A tool call's null content was refused, and the record's ``tools`` never
    reached the template: the model trained without the tools' definitions that
    transformers (and TRL) render into the system turn.
    """
    import json

    QWEN25 = chat_templates.QWEN25
    tok, auto = _tokenizers(tmp_path, "qwen2_split")
    want = _ids(auto.apply_chat_template(TOOL_CHAT, tools=TOOLS, chat_template=QWEN25))
    tools = json.dumps(TOOLS) if as_text else TOOLS
    [(ids, labels)] = encode_records([{"messages": TOOL_CHAT, "tools": tools}], tok,
                                     format="chat", chat_template=QWEN25)  # fmt: skip
    assert ids.tolist() == want
    trained = tok.decode(ids[labels != -100], special=True)
    call = '<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}\n'
    assert trained == f"{call}</tool_call><|im_end|>\nIt is sunny.<|im_end|>\n"
    with pytest.raises(FormatError, match=r"record 1, column 'tools': invalid JSON"):
        encode_records([{"messages": TOOL_CHAT, "tools": "[{"}], tok, format="chat",
                       chat_template=QWEN25)  # fmt: skip


@pytest.mark.parametrize(("family", "style"), [("qwen25", "qwen2_split"),
                                               ("gemma", "gemma")])  # fmt: skip
def test_conversational_prompt_completion_as_in_trl(family, style, tmp_path):
    """``prompt``/``completion`` message lists: only the completion is trained.

    TRL renders the prompt with the generation prompt (context) and the prompt
    with the completion; the rest is the completion. entrenar refused message
    lists (``expected str``), format ``auto`` included.
    """
    tok, auto = _tokenizers(tmp_path, style)
    t = chat_templates.FAMILY_TEMPLATES[family]
    recs = [{"prompt": CHAT[:3], "completion": CHAT[3:]},
            {"prompt": CHAT[:1], "completion": CHAT[1:2]}]  # fmt: skip

    def ids(messages, **kw):
        return _ids(auto.apply_chat_template(messages, chat_template=t, **kw))

    for fmt in ("prompt_completion", "auto"):
        got = encode_records(recs, tok, format=fmt, chat_template=t)
        for r, (i, labels) in zip(recs, got):
            prompt = ids(r["prompt"], add_generation_prompt=True)
            full = ids([*r["prompt"], *r["completion"]])
            assert i.tolist() == full and full[: len(prompt)] == prompt
            assert labels.tolist() == [-100] * len(prompt) + full[len(prompt) :]
    mixed = [recs[0], {"prompt": "Hi", "completion": "there"}]
    with pytest.raises(FormatError, match=r"record 2: 'prompt' and 'completion' "
                       "must both be message lists"):  # fmt: skip
        encode_records(mixed, tok, format="prompt_completion", chat_template=t)
