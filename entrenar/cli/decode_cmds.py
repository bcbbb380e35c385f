"""``entrenar generate``, ``entrenar chat`` and ``entrenar serve``: text from a model.

Both take the same decoding options (`sampling_options`): temperature, top-k, top-p,
min-p, repetition penalty, stop strings and the seed, passed to
`entrenar.chat.ChatModel` (specs/chat.md), and how the weights are multiplied
(`weight_options`: ``--keep-quantized``, ``--decode-activations``).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import click

from entrenar.cli.app import ModelPath, command

DECODE_ACTIVATIONS = ("float32", "int8")
"""``--decode-activations`` choices: `entrenar.nn.matvec.ACTIVATIONS` (not imported
here, so ``entrenar --help`` does not load JAX; a test checks they agree)."""


def weight_options(f: Callable[..., Any]) -> Callable[..., Any]:
    """``--keep-quantized`` and ``--decode-activations`` (generate, chat, eval)."""
    f = click.option(
        "--decode-activations",
        type=click.Choice(DECODE_ACTIVATIONS),
        help="How Q8_0 / Q4_0 / Q4_1 weights kept as stored multiply the "
        "activations: int8 rounds them to 8 bits per 32 values, as llama.cpp "
        "does (faster; a near tie between two tokens can go the other way). "
        "Default: float32 (or ENTRENAR_DECODE_ACTIVATIONS).",
    )(f)
    return click.option(
        "--keep-quantized",
        is_flag=True,
        help="Decode from a GGUF's quantized weights as stored (less memory, "
        "faster decoding) instead of float32 copies; a tied head is read as Q8_0.",
    )(f)


def sampling_options(f: Callable[..., Any]) -> Callable[..., Any]:
    """The decoding options of ``generate`` and ``chat``, as click options."""
    options = [
        click.option(
            "--max-new-tokens",
            type=click.IntRange(min=1),
            help="At most this many tokens (default: entrenar.chat's default, "
            "capped by what is left of the context).",
        ),
        click.option(
            "--temperature",
            type=click.FloatRange(min=0),
            default=0.0,
            show_default=True,
            help="0 is greedy.",
        ),
        click.option(
            "--top-k", type=click.IntRange(min=1), help="Keep the k most likely tokens."
        ),
        click.option(
            "--top-p",
            type=click.FloatRange(0, 1, min_open=True),
            help="Nucleus sampling: the smallest set of tokens with this much mass.",
        ),
        click.option(
            "--min-p",
            type=click.FloatRange(0, 1),
            help="Drop tokens below this fraction of the top token's probability.",
        ),
        click.option(
            "--repetition-penalty",
            type=click.FloatRange(0, min_open=True),
            help="Penalise tokens already seen, prompt included (1: off; 1.1-1.3 "
            "usual).",
        ),
        click.option(
            "--stop",
            multiple=True,
            help="A string that ends the text (not printed); repeat for several.",
        ),
        click.option(
            "--seed",
            type=int,
            default=0,
            show_default=True,
            help="Sampling seed: the same seed gives the same text.",
        ),
        click.option(
            "--adapter",
            type=click.Path(exists=True, file_okay=False),
            help="A PEFT adapter folder to apply to MODEL.",
        ),
        click.option(
            "--tokenizer",
            type=click.Path(exists=True),
            help="A .gguf or Hugging Face folder whose tokenizer to use (default: "
            "MODEL's own).",
        ),
    ]
    for option in reversed(options):
        f = option(f)
    return f


@command("generate")
@click.argument("model", type=ModelPath())
@click.option("--prompt", "-p", required=True, help="The prompt (or user message).")
@click.option(
    "--chat/--no-chat",
    default=False,
    help="Render the prompt through "
    "the model's chat template and stop at its end-of-turn token.",
)
@click.option("--system", help="A system message (with --chat).")
@sampling_options
@weight_options
@click.option("--stream/--no-stream", default=True, help="Print tokens as they come.")
def generate_cmd(
    model: str, prompt: str, chat: bool, system: str | None, stream: bool,
    **options: Any,
) -> None:  # fmt: skip
    """Continue PROMPT with MODEL (a GGUF, HF folder or entrenar model file)."""
    from entrenar.runs.inference import generate_text

    def emit(piece: str) -> None:
        click.echo(piece, nl=False)

    text = generate_text(
        model, prompt, chat=chat, system=system, on_text=emit if stream else None,
        **options,
    )  # fmt: skip
    if stream:
        click.echo()
    else:
        click.echo(text)
    if not text:  # an instruction-tuned model given a bare prompt often ends at once
        hint = "" if chat else "; an instruction-tuned model answers with --chat"
        click.echo(
            f"(no text: the model ended at once, or a --stop string came first{hint})",
            err=True,
        )


@command("chat")
@click.argument("model", type=ModelPath())
@click.option("--system", help="A system message that opens the conversation.")
@sampling_options
@weight_options
def chat_cmd(model: str, system: str | None, **options: Any) -> None:
    """Chat with MODEL: each line read is your message, the reply streams back.

    The conversation is kept and rendered through the model's chat template each
    turn. An empty line or the end of input (Ctrl-D) ends it, and so does a
    conversation that no longer fits the model's context.
    """
    import jax

    from entrenar.errors import ShapeError
    from entrenar.runs.inference import load_chat

    session = load_chat(
        model, adapter=options.pop("adapter"), tokenizer=options.pop("tokenizer"),
        keep_quantized=options.pop("keep_quantized"),
        decode_activations=options.pop("decode_activations"), chat=True,
    )  # fmt: skip
    seed, sampled = options.pop("seed"), options["temperature"] > 0
    stdin = sys.stdin
    messages: list[dict[str, str]] = []
    for turn in range(1 << 62):
        if stdin.isatty():
            click.echo("> ", nl=False)
        line = stdin.readline()
        if not line.strip():
            return
        messages.append({"role": "user", "content": line.rstrip("\n")})
        key = jax.random.fold_in(jax.random.key(seed), turn) if sampled else None
        try:
            pieces = session.stream(messages, system=system, key=key, **options)
        except ShapeError as e:
            click.echo(f"(the conversation is too long to go on: {e})", err=True)
            return
        reply = []
        for piece in pieces:
            click.echo(piece, nl=False)
            reply.append(piece)
        click.echo()
        messages.append({"role": "assistant", "content": "".join(reply)})


@command("serve")
@click.argument("model", type=ModelPath())
@click.option(
    "--adapter",
    type=click.Path(exists=True, file_okay=False),
    help="A PEFT adapter folder to apply to MODEL.",
)
@click.option(
    "--tokenizer",
    type=click.Path(exists=True),
    help="A .gguf or Hugging Face folder whose tokenizer to use (default: MODEL's "
    "own).",
)
@weight_options
@click.option(
    "--host",
    default="127.0.0.1",
    show_default=True,
    help="The address to listen on (0.0.0.0: every interface; set --api-key then).",
)
@click.option(
    "--api-key",
    envvar="ENTRENAR_API_KEY",
    help="A key every /v1/ request must send as 'Authorization: Bearer KEY' (an "
    "OpenAI client's api_key); default: $ENTRENAR_API_KEY, else none. /health stays "
    "open.",
)
@click.option(
    "--tool-call-parser",
    type=click.Choice(["hermes", "llama3_json", "mistral"]),
    help="The model's function-call format, for requests with tools: hermes "
    "(Qwen2.5/3, Hermes), llama3_json (Llama 3.1-3.3) or mistral ([TOOL_CALLS] and a "
    "JSON list: Mistral's v3 tokenizer models). Default: tools refused.",
)
@click.option(
    "--port", type=click.IntRange(0, 65535), default=8080, show_default=True,
    help="The port (0: any free one, printed at the start).",
)  # fmt: skip
@click.option(
    "--max-tokens-limit",
    type=click.IntRange(min=1),
    default=2048,
    show_default=True,
    help="The most tokens one request may ask for (also the default max_tokens, "
    "capped by what is left of the context).",
)
@click.option(
    "--model-name",
    help="The model's name in replies and /v1/models (default: MODEL's file name).",
)
def serve_cmd(
    model: str, adapter: str | None, tokenizer: str | None, keep_quantized: bool,
    decode_activations: str | None, host: str, api_key: str | None,
    tool_call_parser: str | None, port: int, max_tokens_limit: int,
    model_name: str | None,
) -> None:  # fmt: skip
    """Serve MODEL over HTTP with OpenAI's API (/v1/chat/completions and more).

    The routes and limits are those of `entrenar.chat.server` (specs/chat.md):
    POST /v1/chat/completions, POST /v1/completions, GET /v1/models, GET /health.
    One request is generated at a time. Ctrl-C (or SIGTERM) stops the server.
    """
    import os
    import signal

    from entrenar.chat.server import make_server
    from entrenar.runs.inference import load_chat

    session = load_chat(
        model, adapter=adapter, tokenizer=tokenizer, keep_quantized=keep_quantized,
        decode_activations=decode_activations,
    )  # fmt: skip
    name = model_name or os.path.basename(os.path.normpath(model))
    server = make_server(session, host=host, port=port, model_name=name,
                         max_tokens_limit=max_tokens_limit, api_key=api_key,
                         tool_call_parser=tool_call_parser)  # fmt: skip
    if api_key is None and host not in ("127.0.0.1", "localhost", "::1"):
        click.echo(
            f"warning: serving on {host} without --api-key: anyone who can reach "
            "this port can use the model",
            err=True,
        )
    if not getattr(session.tokenizer, "chat_template", None):
        click.echo(
            f"{model} has no chat template: /v1/chat/completions will refuse "
            "requests; /v1/completions continues plain text",
            err=True,
        )
    click.echo(
        f"serving {name} on http://{host}:{server.server_port}/v1 (Ctrl-C stops)"
    )
    sys.stdout.flush()

    def stop(signum: int, frame: Any) -> None:  # SIGTERM (docker stop, systemd)
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        click.echo("stopped", err=True)
    finally:
        server.server_close()


__all__ = [
    "DECODE_ACTIVATIONS",
    "chat_cmd",
    "generate_cmd",
    "sampling_options",
    "serve_cmd",
    "weight_options",
]
