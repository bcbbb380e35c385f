"""Chat inference: text in, text out, through the model's own chat template.

Protocol: ``ChatModel(model, params, tokenizer)`` (or ``ChatModel.from_gguf(path,
adapter=...)``) renders a conversation with the template, tokenizes it with control
tokens parsed, refuses a request longer than the context, and decodes greedily (or by
sampling) until an end-of-turn token: ``chat("Hi")`` returns the text,
``chat.reply(...)`` a `Reply` with its tokens and finish reason, ``chat.stream(...)``
yields the text as it comes; ``chat=False`` continues plain text instead.
`exact_match` scores greedy replies on a chat dataset in one teacher-forced forward
pass per batch. `make_server` serves a `ChatModel` over HTTP with OpenAI's API
(``entrenar serve``). Layer: above ``data``, ``nn``, ``io`` and ``lora``; below
``config`` and ``cli``.
"""

from entrenar.chat.evaluate import ExactMatch, exact_match, reply_targets
from entrenar.chat.server import make_server
from entrenar.chat.session import (
    DEFAULT_MAX_NEW_TOKENS,
    END_OF_TURN,
    ChatModel,
    Reply,
    ReplyStream,
    as_messages,
    end_of_turn_ids,
    stream_text,
)

__all__ = [
    "DEFAULT_MAX_NEW_TOKENS",
    "END_OF_TURN",
    "ChatModel",
    "ExactMatch",
    "Reply",
    "ReplyStream",
    "as_messages",
    "end_of_turn_ids",
    "exact_match",
    "make_server",
    "reply_targets",
    "stream_text",
]
