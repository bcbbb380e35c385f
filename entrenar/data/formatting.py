"""Examples to token ids and labels: plain text, prompt-completion and chat.

Each record becomes one text made of segments, some of them *trained* (their tokens
carry labels) and the rest context (labels ``-100``):

- ``"text"``: ``record["text"]`` (+ EOS), all trained;
- ``"prompt_completion"``: ``record["prompt"]`` (context) + ``record["completion"]``
  (+ EOS) trained, so the loss is masked to the completion; when they are message
  lists (TRL's conversational prompt-completion), the prompt rendered with the
  generation prompt is context and the rest of ``prompt + completion`` rendered is
  trained (no EOS appended: the template closes the turn);
- ``"chat"``: ``record["messages"]`` rendered through the model's chat template
  (with ``record["tools"]``, when it has one, as the template's ``tools``, as TRL
  passes them); the assistant turns (`entrenar.data.chat.assistant_spans`,
  including the end-of-turn token) are trained, system, user and tool turns are
  context.

The whole text is tokenized at once, exactly as it would be for inference, and a
token is trained when any of its bytes lies in a trained segment: byte-level BPE is
lossless, so each token's byte length (`token_bytes`) locates it in the text. Labels
are aligned with the ids (``labels[t] = ids[t]`` or ``-100``); the loss shifts them
(`entrenar.nn.losses.causal_lm_loss`). A BOS the tokenizer prepends is never trained.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any, Literal, Protocol

import numpy as np

from entrenar.data.chat import assistant_spans, render_chat
from entrenar.data.fast_tokenizer import token_bytes
from entrenar.data.readers import Records
from entrenar.errors import ConfigError, FormatError, TemplateError, UnsupportedError
from entrenar.nn.losses import IGNORE_INDEX

Format = Literal["text", "prompt_completion", "chat", "auto"]
FORMATS = ("text", "prompt_completion", "chat", "auto")


class Tokenizer(Protocol):
    """What formatting needs of a tokenizer (`BPETokenizer` and `FastTokenizer`)."""

    tokens: Sequence[str]
    token_types: Sequence[int]
    bos_id: int | None
    eos_id: int | None

    def encode(
        self, text: str, *, add_bos: bool | None = None, special: bool = False
    ) -> list[int]:
        """Token ids of ``text``."""
        ...


_LENGTHS: dict[int, tuple[Sequence[str], np.ndarray]] = {}


def token_lengths(tokenizer: Tokenizer) -> np.ndarray:
    """Byte length of each token id, ``(V,)`` int64 (cached per vocabulary)."""
    hit = _LENGTHS.get(id(tokenizer.tokens))
    if hit is None or hit[0] is not tokenizer.tokens:
        table = getattr(tokenizer, "token_bytes", None)
        if table is None:
            table = token_bytes(tokenizer.tokens, tokenizer.token_types)
        hit = (tokenizer.tokens, np.array([len(b) for b in table], np.int64))
        _LENGTHS[id(tokenizer.tokens)] = hit
    return hit[1]


def _encode_all(
    tokenizer: Tokenizer, texts: list[str], special: bool, add_bos: bool | None
) -> list[list[int]]:
    batch = getattr(tokenizer, "encode_batch", None)
    if batch is not None:
        return list(batch(texts, add_bos=add_bos, special=special))
    return [tokenizer.encode(t, add_bos=add_bos, special=special) for t in texts]


def chat_add_bos(tokenizer: Tokenizer, texts: Sequence[str]) -> bool | None:
    """``add_bos`` to tokenize rendered chat ``texts`` (control tokens parsed) with.

    False when every text begins with the BOS token's text (a template's
    ``{{ bos_token }}``: Llama 3, Mistral, Gemma), so the conversation begins with
    one BOS, not two: transformers tokenizes a rendered template without adding
    special tokens, and llama.cpp drops the template's leading BOS before adding
    its own. Else None, the tokenizer's default.
    """
    bos = tokenizer.bos_id
    if bos is None or not 0 <= int(bos) < len(tokenizer.tokens) or not texts:
        return None
    text = tokenizer.tokens[int(bos)]
    return False if all(t.startswith(text) for t in texts) else None


def label_segments(
    tokenizer: Tokenizer,
    ids: Sequence[int],
    segments: Sequence[tuple[str, bool]],
) -> np.ndarray:
    """Labels of ``ids`` (the tokens of the joined ``segments``; see module docstring).

    Returns:
        ``(len(ids),)`` int32: the id where the token overlaps a trained segment,
        else ``-100``.
    """
    ids_arr = np.asarray(ids, np.int64)
    lengths = token_lengths(tokenizer)[ids_arr]  # (n,)
    total = sum(len(s.encode("utf-8", "surrogatepass")) for s, _ in segments)
    skip = int(lengths.sum()) - total  # a prepended BOS
    n_bos = 0
    if skip and len(ids_arr) and ids_arr[0] == tokenizer.bos_id:
        n_bos, skip = 1, skip - int(lengths[0])
    if skip:
        raise UnsupportedError(
            "the tokenizer's tokens do not add up to the text's bytes, so labels "
            "cannot be aligned; use a byte-level BPE tokenizer"
        )
    ends = np.cumsum(lengths[n_bos:])  # (n - n_bos,) byte end of each token
    starts = ends - lengths[n_bos:]
    trained = np.zeros(len(ids_arr) - n_bos, bool)
    pos = 0
    for text, train in segments:
        nb = len(text.encode("utf-8", "surrogatepass"))
        if train and nb:
            trained |= (starts < pos + nb) & (ends > pos)
        pos += nb
    labels = np.full(len(ids_arr), IGNORE_INDEX, np.int32)
    labels[n_bos:][trained] = ids_arr[n_bos:][trained]
    return labels


def label_spans(
    ids: Sequence[int],
    spans: Sequence[tuple[int, int]],
    segments: Sequence[tuple[str, bool]],
) -> np.ndarray:
    """`label_segments` by each token's character span in the joined ``segments``.

    A token is trained where its span ``[start, end)`` overlaps a trained segment;
    an empty span (a BOS the tokenizer adds) never is.
    """
    ids_arr = np.asarray(ids, np.int64)
    span = np.asarray(spans, np.int64).reshape(-1, 2)  # (n, 2)
    starts, ends = span[:, 0], span[:, 1]
    trained = np.zeros(len(ids_arr), bool)
    pos = 0
    for text, train in segments:
        if train and text:
            trained |= (starts < pos + len(text)) & (ends > pos) & (ends > starts)
        pos += len(text)
    return np.where(trained, ids_arr, IGNORE_INDEX).astype(np.int32)


FORMAT_FIELDS: dict[str, tuple[tuple[str, type | tuple[type, ...]], ...]] = {
    "text": (("text", str),),
    "prompt_completion": (
        ("prompt", (str, list, tuple)),
        ("completion", (str, list, tuple)),
    ),
    "chat": (("messages", (list, tuple)),),
}
"""The fields each format reads (by their default names) and their types."""


def record_fields(
    recs: Records, i: int, format: Format, fields: Mapping[str, str]
) -> list[Any]:
    """Record ``i``'s values of the fields ``format`` reads (`FORMAT_FIELDS`).

    ``fields`` renames them (``{"text": "body"}``). A missing field or one of the
    wrong type is a `FormatError` naming the file, the row and the column.
    """
    return [recs.value(i, fields[k], kind) for k, kind in FORMAT_FIELDS[format]]


def record_segments(
    recs: Records,
    i: int,
    format: Format,
    *,
    fields: dict[str, str],
    chat_template: str | None,
    chat_variables: dict[str, Any],
) -> list[tuple[str, bool]]:
    """The ``(text, trained)`` segments of record ``i`` in ``format``."""
    values = record_fields(recs, i, format, fields)
    if format == "text":
        return [(values[0], True)]
    talk = format == "prompt_completion" and conversational(recs, fields)
    if format == "prompt_completion":
        kinds = [isinstance(v, str) for v in values]
        if kinds != [not talk] * 2:
            raise FormatError(
                f"{recs.where(i)}: {fields['prompt']!r} and {fields['completion']!r} "
                f"must both be {'message lists' if talk else 'strings'}, as in the "
                "first record"
            )
        if not talk:
            return [(values[0], False), (values[1], True)]
    if chat_template is None:
        raise ConfigError(
            f"format={format!r} with messages needs a chat template: pass "
            "chat_template= or a tokenizer that has one (a GGUF's "
            "tokenizer.chat_template, a Hugging Face folder's chat_template)"
        )
    tools = record_tools(recs, i, fields.get("tools", "tools"))
    if tools is not None:
        chat_variables = {**chat_variables, "tools": tools}
    column = fields["prompt" if talk else "messages"]
    try:
        if talk:  # TRL: the prompt with the generation prompt, then the rest
            p = render_chat(values[0], chat_template, add_generation_prompt=True,
                            **chat_variables)  # fmt: skip
            q = render_chat([*values[0], *values[1]], chat_template, **chat_variables)
            if not q.startswith(p):
                raise FormatError(
                    "the chat template renders the prompt differently once the "
                    "completion follows, so the completion cannot be located; use "
                    "format='chat' or string prompts and completions"
                )
            return [(p, False), (q[len(p) :], True)]
        text, spans = assistant_spans(values[0], chat_template, **chat_variables)
    except (FormatError, TemplateError) as e:
        raise type(e)(f"{recs.where(i, column)}: {e}") from None
    segs, pos = [], 0
    for a, b in spans:
        segs += [(text[pos:a], False), (text[a:b], True)]
        pos = b
    return [*segs, (text[pos:], False)]


def conversational(recs: Records, fields: Mapping[str, str]) -> bool:
    """Whether the first record's prompt is a list of messages.

    TRL's conversational prompt-completion: ``prompt`` ``[{"role": "user", ...}]``,
    ``completion`` ``[{"role": "assistant", ...}]``.
    """
    first = recs[0] if len(recs) else None
    return isinstance(first, Mapping) and isinstance(
        first.get(fields["prompt"]), (list, tuple)
    )


def record_tools(recs: Records, i: int, column: str = "tools") -> list[Any] | None:
    """Record ``i``'s tool definitions for the chat template, as TRL passes them.

    The ``tools`` column (absent or null: none) holds a list of JSON schemas, or
    its JSON text (as datasets store it); anything else is a `FormatError` naming
    file, row and column.
    """
    row = recs[i]
    tools = row.get(column) if isinstance(row, Mapping) else None
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError as e:
            raise FormatError(f"{recs.where(i, column)}: invalid JSON ({e})") from None
    if tools is not None and not isinstance(tools, (list, tuple)):
        raise FormatError(
            f"{recs.where(i, column)}: expected a list of tool definitions, got "
            f"{tools!r:.40}"
        )
    return None if tools is None else list(tools)


def special_texts(tokenizer: Tokenizer) -> dict[str, str]:
    """``bos_token``/``eos_token`` texts for chat templates (as transformers passes)."""
    out = {}
    for name in ("bos", "eos", "pad"):
        i = getattr(tokenizer, f"{name}_id", None)
        if i is not None and 0 <= int(i) < len(tokenizer.tokens):
            out[f"{name}_token"] = tokenizer.tokens[int(i)]
    return out


def detect_record_format(
    records: Sequence[Mapping[str, Any]] | Records, fields: Mapping[str, str]
) -> Format:
    """The format the first record's fields name: messages, prompt+completion, text.

    >>> fields = {"prompt": "prompt", "completion": "completion",
    ...           "messages": "messages", "text": "text"}
    >>> detect_record_format([{"prompt": "2+2=", "completion": "4"}], fields)
    'prompt_completion'
    """
    recs = Records.wrap(records)
    first = recs[0] if len(recs) and isinstance(recs[0], Mapping) else {}
    if fields["messages"] in first:
        return "chat"
    if fields["prompt"] in first and fields["completion"] in first:
        return "prompt_completion"
    if fields["text"] in first or not len(recs):
        return "text"
    raise FormatError(
        f"{recs.where(0)}: cannot tell the format from its fields {sorted(first)}; "
        f"expected {fields['messages']!r}, {fields['prompt']!r} and "
        f"{fields['completion']!r}, or {fields['text']!r} (or pass format=)"
    )


def apply_chat_template(
    tokenizer: Tokenizer,
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool = True,
    chat_template: str | None = None,
) -> list[int]:
    """Token ids of a conversation, for generation (like ``transformers``' method).

    Renders ``messages`` through ``chat_template`` (default the tokenizer's) with the
    special tokens' texts and, by default, the generation prompt, then tokenizes the
    text with control tokens parsed (no BOS of the tokenizer's when the template
    wrote one: `chat_add_bos`).
    """
    template = chat_template or getattr(tokenizer, "chat_template", None)
    if template is None:
        raise ConfigError("no chat template: pass chat_template=")
    text = render_chat(
        messages,
        template,
        add_generation_prompt=add_generation_prompt,
        **special_texts(tokenizer),
    )
    return list(
        tokenizer.encode(text, add_bos=chat_add_bos(tokenizer, [text]), special=True)
    )


def encode_records(
    records: Sequence[Mapping[str, Any]] | Records,
    tokenizer: Tokenizer,
    *,
    format: Format = "text",
    fields: dict[str, str] | None = None,
    chat_template: str | None = None,
    add_eos: bool | None = None,
    special: bool | None = None,
) -> list[tuple[np.ndarray, np.ndarray]]:
    """``(ids, labels)`` int32 arrays of each record (see the module docstring).

    Args:
        records: dicts, or `Records` from a file (errors then name file, row, column).
        tokenizer: `FastTokenizer` (batched) or `BPETokenizer`.
        format: ``"text"``, ``"prompt_completion"``, ``"chat"``, or ``"auto"``
            (`detect_record_format` from the first record's fields).
        fields: rename the fields, e.g. ``{"text": "body"}``.
        chat_template: Jinja template; default the tokenizer's ``chat_template``.
        add_eos: append EOS (trained) after text and completions; default True
            except for messages (chat, conversational prompt-completion), whose
            template closes each turn.
        special: parse control tokens in the text; default True for messages
            only.
    """
    if format not in FORMATS:
        raise ConfigError(f"format must be one of {FORMATS}, got {format!r}")
    recs = Records.wrap(records)
    names = {"text": "text", "prompt": "prompt", "completion": "completion"}
    names["messages"] = "messages"
    names.update(fields or {})
    if format == "auto":
        format = detect_record_format(recs, names)
    template = chat_template or getattr(tokenizer, "chat_template", None)
    variables = special_texts(tokenizer)
    # messages (chat, conversational prompt-completion): the template's text
    talk = format == "chat" or (
        format == "prompt_completion" and conversational(recs, names)
    )
    eos = (not talk) if add_eos is None else add_eos
    if eos and tokenizer.eos_id is None:
        raise ConfigError("add_eos needs a tokenizer with an EOS id")
    segs = [
        record_segments(
            recs,
            i,
            format,
            fields=names,
            chat_template=template,
            chat_variables=variables,
        )
        for i in range(len(recs))
    ]
    parse = talk if special is None else special
    texts = ["".join(s for s, _ in seg) for seg in segs]
    bos = chat_add_bos(tokenizer, texts) if talk and parse else None
    with_spans = getattr(tokenizer, "encode_offsets_batch", None)
    if with_spans is not None:  # a Hugging Face tokenizer: align by its spans
        encoded = with_spans(texts, add_bos=bos, special=parse)
        all_ids = [ids for ids, _ in encoded]
        labelled = [label_spans(ids, spans, seg) for (ids, spans), seg in zip(
            encoded, segs)]  # fmt: skip
    else:
        all_ids = _encode_all(tokenizer, texts, parse, bos)
        labelled = [label_segments(tokenizer, i, g) for i, g in zip(all_ids, segs)]
    out = []
    for seg, ids, labels in zip(segs, all_ids, labelled):
        ids_a = np.asarray(ids, np.int32)
        if eos:
            last = seg[-1][1]  # the EOS is trained when the text's end is
            eid = int(tokenizer.eos_id)  # type: ignore[arg-type]
            ids_a = np.append(ids_a, np.int32(eid))
            labels = np.append(labels, np.int32(eid if last else IGNORE_INDEX))
        out.append((ids_a, labels.astype(np.int32)))
    return out


__all__ = [
    "FORMATS",
    "FORMAT_FIELDS",
    "IGNORE_INDEX",
    "Format",
    "Tokenizer",
    "apply_chat_template",
    "chat_add_bos",
    "conversational",
    "detect_record_format",
    "encode_records",
    "label_segments",
    "label_spans",
    "record_fields",
    "record_segments",
    "record_tools",
    "special_texts",
    "token_lengths",
]
