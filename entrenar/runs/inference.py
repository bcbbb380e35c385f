"""`generate_text`: text in, text out, for ``entrenar generate``.

The model file is read with `entrenar.runs.models.load_built` (a GGUF or a Hugging
Face folder brings its own tokenizer and chat template, a folder's
``generation_config.json`` its EOS ids; an entrenar model file names its tokenizer), an
adapter folder is attached with `entrenar.lora.load_adapter`, and the reply comes
from `entrenar.chat.ChatModel`: the chat template rendered with control tokens
parsed, the length checked against the context before anything runs, greedy or
sampled decoding until an end-of-turn token, streamed piece by piece. With
``keep_quantized`` a GGUF's quantized weights are kept as stored and decoded from
(a tied head read as Q8_0, as `entrenar.chat.ChatModel.from_gguf` does), and
``decode_activations="int8"`` multiplies Q8_0 / Q4_0 / Q4_1 ones by activations
rounded to 8 bits per 32-block, as llama.cpp does.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from entrenar import chat as chat_lib
from entrenar import data, lora
from entrenar.errors import ConfigError, ShapeError
from entrenar.quant.matvec import quantize_tied_head
from entrenar.runs.models import BuiltModel, load_built


def generate_text(
    model: str,
    prompt: str,
    *,
    adapter: str | None = None,
    chat: bool = False,
    system: str | None = None,
    max_new_tokens: int | None = None,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    min_p: float | None = None,
    repetition_penalty: float | None = None,
    stop: tuple[str, ...] = (),
    seed: int = 0,
    tokenizer: str | None = None,
    on_text: Callable[[str], None] | None = None,
    keep_quantized: bool = False,
    decode_activations: str | None = None,
) -> str:
    """Continue ``prompt`` (or reply to it, with ``chat``); returns the new text.

    Args:
        model: a GGUF, Hugging Face folder or entrenar model file of a language model.
        prompt: the text to continue, or the user's message with ``chat``.
        adapter: a PEFT LoRA folder to attach.
        chat: render through the chat template and stop at the end-of-turn token.
        system: a system message (with ``chat``).
        max_new_tokens: at most this many tokens (None: what `entrenar.chat` allows).
        temperature: 0 is greedy.
        top_k: keep the k most likely tokens.
        top_p: nucleus sampling mass.
        min_p: drop tokens below ``min_p`` times the top token's probability.
        repetition_penalty: penalise tokens already seen (1 or None: off).
        stop: strings that end the text (cut before the first).
        seed: the sampling seed (the same seed gives the same text).
        tokenizer: a ``.gguf`` or Hugging Face folder whose tokenizer to use instead
            of the model's.
        on_text: called with each piece of text as it is generated.
        keep_quantized: decode from a GGUF's quantized weights as stored.
        decode_activations: ``"int8"`` or ``"float32"`` (None: the process
            setting): how stored Q8_0 / Q4_0 / Q4_1 weights multiply activations.

    Raises:
        ConfigError: no tokenizer, no chat template, or a request longer than the
            model's context (checked before generating).
    """
    session = load_chat(
        model, adapter=adapter, tokenizer=tokenizer, keep_quantized=keep_quantized,
        decode_activations=decode_activations, chat=chat,
    )  # fmt: skip
    key = jax.random.key(seed) if temperature > 0 else None
    try:
        pieces = session.stream(
            prompt, system=system, max_new_tokens=max_new_tokens,
            temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
            repetition_penalty=repetition_penalty, stop=stop, key=key, chat=chat,
        )  # fmt: skip
    except ShapeError as e:  # the request does not fit the context
        raise ConfigError(str(e)) from None
    out = []
    for piece in pieces:
        out.append(piece)
        if on_text is not None:
            on_text(piece)
    return "".join(out)


def decoding_params(built: BuiltModel, keep_quantized: bool) -> Any:
    """``built``'s parameters as decoding reads them.

    With ``keep_quantized`` a tied output head is read as Q8_0, or as the
    ``token_embd`` kept in its own type (Q8_0, Q4_0, Q4_1, a K-quant), as llama.cpp
    reads it (`entrenar.quant.matvec.quantize_tied_head`).
    """
    if keep_quantized and getattr(built.config, "tie_word_embeddings", False):
        return quantize_tied_head(built.params)
    return built.params


def load_chat(
    model: str,
    *,
    adapter: str | None = None,
    tokenizer: str | None = None,
    keep_quantized: bool = False,
    decode_activations: str | None = None,
    chat: bool = False,
) -> chat_lib.ChatModel:
    """A `entrenar.chat.ChatModel` of a model file (``generate_text``'s arguments).

    ``chat``: the model will chat, so its tokenizer must have a chat template.

    Raises:
        ConfigError: not a language model, no tokenizer, or (``chat``) no chat
            template, naming the model and the options that give one.
    """
    built = load_built(model, keep_quantized=keep_quantized)
    if not built.is_lm:
        raise ConfigError(f"{model}: generate needs a language model, not an mlp")
    tok = data.load_fast_tokenizer(tokenizer) if tokenizer else built.tokenizer
    if tok is None:
        raise ConfigError(
            f"{model}: no tokenizer; pass --tokenizer FILE.gguf (or a Hugging Face "
            "folder with tokenizer.json)"
        )
    if chat and not getattr(tok, "chat_template", None):
        raise ConfigError(
            f"{tokenizer or model} has no chat template; pass --tokenizer with one (a "
            ".gguf with tokenizer.chat_template, or a Hugging Face folder whose "
            "tokenizer_config.json has chat_template), or continue plain text "
            "with `entrenar generate` (no --chat)"
        )
    params = decoding_params(built, keep_quantized)
    if adapter is not None:
        wrapper = getattr(built.config, "hf_wrapper", None)
        params = lora.load_adapter(adapter, params, wrapper=wrapper)
    return chat_lib.ChatModel(
        built.config, params, tok, stop_ids=chat_lib.end_of_turn_ids(tok),
        decode_activations=decode_activations,
    )  # fmt: skip


__all__ = ["decoding_params", "generate_text", "load_chat"]
