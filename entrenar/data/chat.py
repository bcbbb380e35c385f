"""Chat templates: the model's own Jinja template, rendered as Hugging Face does.

A GGUF carries its chat template in ``tokenizer.chat_template``. `render_chat` renders
it in a sandboxed Jinja environment set up like ``transformers``'
``apply_chat_template``: ``ImmutableSandboxedEnvironment(trim_blocks=True,
lstrip_blocks=True)`` with the ``loopcontrols`` extension, a ``{% generation %}`` tag,
a ``tojson`` filter that does not escape HTML, and ``raise_exception`` /
``strftime_now``. The variables are ``messages``, ``add_generation_prompt``,
``tools`` and ``documents`` (None unless given, as transformers passes them: a
template's ``{% if tools is not none %}`` takes its branch without tools), the
special tokens' texts (``bos_token``, ``eos_token``, ...) and any extra keywords.
The template is untrusted code: it renders within the budget of
`entrenar.data.sandbox` (steps, time, ``range`` length, output size), and any failure
is a `TemplateError`.

`assistant_spans` finds which characters of a rendered conversation belong to the
assistant turns (the text the model must learn to produce). A template with
``{% generation %}`` blocks (TRL's ``*_training.jinja`` templates) marks them itself:
the spans are the blocks' output (`generation_spans`), the tokens transformers'
``return_assistant_tokens_mask`` marks and TRL's ``assistant_only_loss`` trains.
Otherwise, for each assistant message ``i`` it renders ``messages[:i]`` with the
generation prompt (text ``P``) and ``messages[:i + 1]`` without (text ``Q``); the
turn is ``Q[len(P):]``. This needs a template whose renderings extend each other
(``Q`` starts with ``P`` and the whole conversation starts with ``Q``), as ChatML
templates such as SmolLM2's do; otherwise it raises, naming the message.
"""

from __future__ import annotations

import contextvars
import functools
import os
import re
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

from entrenar.data.sandbox import BoundedEnvironment, render
from entrenar.errors import FormatError, TemplateError
from entrenar.io.gguf_reader import GGUFFile, read_gguf

Message = Mapping[str, Any]

_GENERATION: contextvars.ContextVar[tuple[str, str] | None] = contextvars.ContextVar(
    "generation_marks", default=None
)
"""While set, ``{% generation %}`` wraps its body in these two marks."""

_HAS_GENERATION = re.compile(r"{%-?\s*generation\s*-?%}")


@functools.lru_cache(maxsize=1)
def chat_environment() -> Any:
    """The sandboxed Jinja environment chat templates render in (module docstring)."""
    import jinja2
    import jinja2.ext

    class Generation(jinja2.ext.Extension):
        """``{% generation %}...{% endgeneration %}``: renders its body."""

        tags = {"generation"}  # noqa: RUF012 (jinja2 declares it so)

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            call = self.call_method("_body")
            return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

        def _body(self, caller: Any) -> str:
            body, marks = str(caller()), _GENERATION.get()
            return body if marks is None else marks[0] + body + marks[1]

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    env = BoundedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[Generation, jinja2.ext.loopcontrols],
    )
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env


@functools.lru_cache(maxsize=16)
def _compile(template: str) -> Any:
    import jinja2

    try:
        return chat_environment().from_string(template)
    except jinja2.TemplateSyntaxError as e:
        raise TemplateError(f"chat template line {e.lineno}: {e.message}") from None
    except (ValueError, OverflowError, RecursionError, MemoryError) as e:
        raise TemplateError(f"chat template: cannot compile it ({e})") from None


def check_messages(messages: Any, where: str = "messages") -> list[dict[str, Any]]:
    """``messages`` as a list of ``{"role": str, "content": str, ...}`` dicts, or raise.

    A message's other keys go to the template as they are (``tool_calls``,
    ``reasoning_content``, ``name``); its ``content`` may also be a list of parts
    (``[{"type": "text", "text": ...}]``), and null or absent in a message with
    ``tool_calls`` (an OpenAI-style tool call), as transformers passes them.
    """
    if not isinstance(messages, Sequence) or isinstance(messages, str):
        raise FormatError(f"{where}: expected a list of messages, got {messages!r:.40}")
    out = []
    for j, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise FormatError(f"{where}[{j}]: expected an object, got {m!r:.40}")
        if not isinstance(m.get("role"), str):
            raise FormatError(
                f"{where}[{j}]: 'role' must be a string, got {m.get('role')!r:.40}"
            )
        content = m.get("content")
        call = content is None and bool(m.get("tool_calls"))
        if not (isinstance(content, (str, list)) or call):
            raise FormatError(
                f"{where}[{j}]: 'content' must be a string (or a list of parts, or "
                f"null beside tool_calls), got {content!r:.40}"
            )
        out.append(dict(m))
    return out


def render_chat(
    messages: Sequence[Message],
    template: str,
    *,
    add_generation_prompt: bool = False,
    **variables: Any,
) -> str:
    """Render ``messages`` through a Jinja chat ``template``.

    Args:
        messages: ``[{"role": "user", "content": "Hi"}, ...]``.
        template: the template text (e.g. `load_chat_template` of a GGUF).
        add_generation_prompt: end with the opening of an assistant turn, for
            inference.
        **variables: more template variables (``bos_token``, ``eos_token``,
            ``tools``; ``tools`` and ``documents`` are None unless given).

    Raises:
        FormatError: malformed ``messages``.
        TemplateError: a template that does not compile, fails while rendering or
            exceeds its budget (`entrenar.data.sandbox`: steps, time, ``range``
            length, output size).

    >>> t = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
    >>> render_chat([{"role": "user", "content": "Hi"}], t)
    '<user>Hi'
    """
    msgs = check_messages(messages)
    compiled = _compile(template)
    context: dict[str, Any] = {"messages": msgs, "tools": None, "documents": None}
    context["add_generation_prompt"] = add_generation_prompt
    return render(compiled, {**context, **variables})


def assistant_spans(
    messages: Sequence[Message], template: str, **variables: Any
) -> tuple[str, list[tuple[int, int]]]:
    r"""The rendered conversation and the ``[start, end)`` characters of each reply.

    See the module docstring for how the spans are found.

    >>> t = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    >>> t += "{% if add_generation_prompt %}assistant: {% endif %}"
    >>> msgs = [{"role": "user", "content": "1+1?"},
    ...         {"role": "assistant", "content": "2"}]
    >>> text, spans = assistant_spans(msgs, t)
    >>> [text[a:b] for a, b in spans]
    ['2\n']
    """
    msgs = check_messages(messages)
    full = render_chat(msgs, template, **variables)
    if _HAS_GENERATION.search(template):
        return full, generation_spans(msgs, template, full, **variables)
    spans = []
    for i, m in enumerate(msgs):
        if m["role"] != "assistant":
            continue
        p = render_chat(msgs[:i], template, add_generation_prompt=True, **variables)
        q = render_chat(msgs[: i + 1], template, **variables)
        if not q.startswith(p) or not full.startswith(q):
            raise FormatError(
                f"messages[{i}]: the chat template does not render the conversation "
                "as a sequence of turns that extend each other, so the assistant turn "
                "cannot be located; give a chat template that marks the replies with "
                "{% generation %} blocks (as TRL's training templates do), or use "
                "format='prompt_completion' instead"
            )
        spans.append((len(p), len(q)))
    return full, spans


def generation_spans(
    messages: Sequence[Message], template: str, text: str, **variables: Any
) -> list[tuple[int, int]]:
    """The ``[start, end)`` characters of ``text`` its ``{% generation %}`` blocks gave.

    ``text`` is the conversation rendered; it is rendered again with each block's
    output between two marks that ``text`` does not contain, and the marks give the
    spans (as transformers' ``return_assistant_tokens_mask`` finds them, which TRL's
    ``assistant_only_loss`` trains on). Nested blocks count as their outermost one.
    """
    n = 0
    while (marks := (f"\ue000{n}\ue001", f"\ue002{n}\ue003"))[0] in text or (
        marks[1] in text
    ):
        n += 1
    token = _GENERATION.set(marks)
    try:
        marked = render_chat(messages, template, **variables)
    finally:
        _GENERATION.reset(token)
    spans: list[tuple[int, int]] = []
    pieces = re.split(f"({re.escape(marks[0])}|{re.escape(marks[1])})", marked)
    plain, depth, start = [], 0, 0
    at = 0
    for piece in pieces:
        if piece in marks:
            opening = piece == marks[0]
            if opening and depth == 0:
                start = at
            depth += 1 if opening else -1
            if not opening and depth == 0 and at > start:
                spans.append((start, at))
        else:
            plain.append(piece)
            at += len(piece)
    if depth or "".join(plain) != text:
        raise TemplateError(
            "chat template: its {% generation %} blocks do not render as they would "
            "without marks (a block inside a filtered or captured value?), so the "
            "replies cannot be located"
        )
    return spans


def load_chat_template(path: str | os.PathLike[str] | GGUFFile) -> str:
    """The ``tokenizer.chat_template`` of a GGUF file (`FormatError` if absent)."""
    g = path if isinstance(path, GGUFFile) else read_gguf(path)
    template = g.metadata.get("tokenizer.chat_template")
    if not isinstance(template, str):
        raise FormatError(
            f"{g.path}: no tokenizer.chat_template; pass a template explicitly"
        )
    return template


__all__ = [
    "assistant_spans",
    "chat_environment",
    "check_messages",
    "load_chat_template",
    "render_chat",
]
