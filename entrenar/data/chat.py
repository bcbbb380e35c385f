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
assistant turns (the text the model must learn to produce): for each assistant
message ``i`` it renders ``messages[:i]`` with the generation prompt (text ``P``) and
``messages[:i + 1]`` without (text ``Q``); the turn is ``Q[len(P):]``. This needs a
template whose renderings extend each other (``Q`` starts with ``P`` and the whole
conversation starts with ``Q``), as ChatML templates such as SmolLM2's do; otherwise
it raises, naming the message.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

from entrenar.data.sandbox import BoundedEnvironment, render
from entrenar.errors import FormatError, TemplateError
from entrenar.io.gguf_reader import GGUFFile, read_gguf

Message = Mapping[str, Any]


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
            return str(caller())

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
    """``messages`` as a list of ``{"role": str, "content": str}`` dicts, or raise."""
    if not isinstance(messages, Sequence) or isinstance(messages, str):
        raise FormatError(f"{where}: expected a list of messages, got {messages!r:.40}")
    out = []
    for j, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise FormatError(f"{where}[{j}]: expected an object, got {m!r:.40}")
        for key in ("role", "content"):
            if not isinstance(m.get(key), str):
                raise FormatError(
                    f"{where}[{j}]: {key!r} must be a string, got {m.get(key)!r:.40}"
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
                "cannot be located; use format='prompt_completion' instead"
            )
        spans.append((len(p), len(q)))
    return full, spans


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
