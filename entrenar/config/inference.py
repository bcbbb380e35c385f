"""`generate_text`: text in, text out, for ``entrenar generate``.

The model file is read with `entrenar.config.models.load_built` (a GGUF brings its
own tokenizer and chat template), an adapter folder is attached with
`entrenar.lora.load_adapter`, and tokens come from `entrenar.nn.generate`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from entrenar import data, lora, nn
from entrenar.config.models import load_built, load_tokenizer_file
from entrenar.errors import ConfigError


def _context(config: Any) -> int:
    return int(
        getattr(config, "max_position_embeddings", 0)
        or getattr(config, "n_positions", 0)
    )


def _end_of_turn(tok: Any) -> list[int]:
    """EOS and the chat end-of-turn tokens the vocabulary has."""
    stops = [] if tok.eos_id is None else [int(tok.eos_id)]
    for text in ("<|im_end|>", "<|eot_id|>", "<|end|>", "</s>"):
        if text in tok.tokens:
            stops.append(tok.tokens.index(text))
    return sorted(set(stops))


def generate_text(
    model: str,
    prompt: str,
    *,
    adapter: str | None = None,
    chat: bool = False,
    system: str | None = None,
    max_new_tokens: int = 128,
    temperature: float = 0.0,
    top_p: float | None = None,
    seed: int = 0,
    tokenizer: str | None = None,
    on_text: Callable[[str], None] | None = None,
) -> str:
    """Continue ``prompt`` (or answer it, with ``chat``); returns the new text.

    Raises:
        ConfigError: no tokenizer, no chat template for ``chat``, or a prompt plus
            ``max_new_tokens`` longer than the model's context.
    """
    built = load_built(model)
    if not built.is_lm:
        raise ConfigError(f"{model}: generate needs a language model, not an mlp")
    tok = load_tokenizer_file(tokenizer) if tokenizer else built.tokenizer
    if tok is None and built.custom.get("tokenizer"):
        tok = load_tokenizer_file(str(built.custom["tokenizer"]))
    if tok is None:
        raise ConfigError(f"{model}: no tokenizer; pass --tokenizer FILE.gguf")
    params = built.params
    if adapter is not None:
        params = lora.load_adapter(adapter, params)
    if chat:
        template = getattr(tok, "chat_template", None)
        if not template:
            raise ConfigError(
                f"{model}: the tokenizer has no chat template (--no-chat)"
            )
        messages = ([{"role": "system", "content": system}] if system else []) + [
            {"role": "user", "content": prompt}
        ]
        text = data.render_chat(
            messages, template, add_generation_prompt=True, **data.special_texts(tok)
        )
        ids = tok.encode(text, special=True)
    else:
        ids = tok.encode(prompt)
    context = _context(built.config)
    if context and len(ids) + max_new_tokens > context:
        raise ConfigError(
            f"the prompt ({len(ids)} tokens) + max_new_tokens ({max_new_tokens}) "
            f"exceeds the model's context of {context} tokens"
        )
    out = nn.generate(
        built.config, params, jnp.asarray([ids], jnp.int32),
        max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
        key=jax.random.key(seed) if temperature > 0 else None,
        stop_tokens=_end_of_turn(tok),
    )  # fmt: skip
    new = [int(t) for t in np.asarray(out)[0]]
    stops = set(_end_of_turn(tok))
    while new and new[-1] in stops:
        new.pop()
    result = tok.decode(new)
    if on_text is not None:
        on_text(result)
    return str(result)


__all__ = ["generate_text"]
