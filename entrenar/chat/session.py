"""Text in, text out: a chat model answering through its own chat template.

`ChatModel` holds a causal language model (a `entrenar.nn.LlamaConfig` and its
params, adapters allowed), a tokenizer and the model's Jinja chat template. A reply
is produced in four steps:

1. **Render** the conversation with the template (`entrenar.data.render_chat`), ending
   with the opening of an assistant turn (``add_generation_prompt=True``).
2. **Tokenize** with control tokens parsed (``special=True``), so ``<|im_start|>`` is
   one token, as in training, not seven pieces of text.
3. **Check the length**: prompt plus ``max_new_tokens`` must fit the model's context
   (`entrenar.nn.check_length`); a longer request is refused before any work.
4. **Decode** with the KV cache (`entrenar.nn.generate_stream`), greedy by default,
   until an end-of-turn token (`end_of_turn_ids`: the tokenizer's EOS ids, those of
   a ``generation_config.json`` included, and the usual end-of-turn control tokens
   the vocabulary has) or ``max_new_tokens``.

`ChatModel.stream` yields the reply's text as it comes, piece by piece (a piece is
held back while it ends inside a multi-byte UTF-8 character or a run of
SentencePiece byte tokens, `stream_text`).

``ChatModel(..., decode_activations="int8")`` multiplies Q8_0 / Q4_0 / Q4_1 weights
kept as stored (``from_gguf(keep_quantized=True)``) by activations rounded to 8 bits
per 32-value block, as llama.cpp does: faster, and a greedy reply can change where
two logits nearly tie (`entrenar.nn.generate`'s ``decode_activations``).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, Literal

import jax.numpy as jnp
import numpy as np

from entrenar import data, io, lora
from entrenar.errors import ConfigError
from entrenar.nn import check_length, context_length, generate_stream
from entrenar.nn.generate import StepLogprobs, find_stop, partial_stop
from entrenar.nn.matvec import check_activations
from entrenar.nn.sampling import TokenLogprobs
from entrenar.quant.matvec import quantize_tied_head
from entrenar.types import Params, PRNGKey

END_OF_TURN = (
    "<|im_end|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
)
"""Control tokens that end a turn in common chat formats (ChatML, Llama 3, ...).

Llama 3.1 ends a turn that calls a tool with ``<|eom_id|>`` (llama.cpp counts it
among the end-of-generation tokens too)."""

DEFAULT_MAX_NEW_TOKENS = 256
"""Replies stop here when no end-of-turn token came (``max_new_tokens=None``)."""

Messages = str | Sequence[Mapping[str, Any]]
Tools = Sequence[Mapping[str, Any]] | None
"""Function schemas for the chat template's ``tools`` (OpenAI's ``tools`` entries)."""


def end_of_turn_ids(tokenizer: Any) -> tuple[int, ...]:
    """The ids that end a reply: the EOS ids and each `END_OF_TURN` token present.

    The EOS ids are the tokenizer's ``eos_id`` and its ``stop_ids`` (a Hugging
    Face folder's ``generation_config.json`` ``eos_token_id`` list: Llama 3's
    ``<|end_of_text|>`` beside ``<|eot_id|>``). Of `END_OF_TURN` only control
    tokens (llama.cpp token type 3) count, so a vocabulary that holds
    ``<|im_end|>`` as plain text is not cut short.
    """
    ids = [] if tokenizer.eos_id is None else [int(tokenizer.eos_id)]
    ids += [int(i) for i in getattr(tokenizer, "stop_ids", ()) if int(i) not in ids]
    index = {t: i for i, t in enumerate(tokenizer.tokens) if t in END_OF_TURN}
    for tok in END_OF_TURN:
        i = index.get(tok)
        if i is not None and tokenizer.token_types[i] == 3 and i not in ids:
            ids.append(i)
    return tuple(ids)


def _is_token_ids(x: Any) -> bool:
    """A list or tuple of Python ints (not bools): a prompt given as token ids."""
    return isinstance(x, (list, tuple)) and all(
        isinstance(i, int) and not isinstance(i, bool) for i in x
    )


def as_messages(prompt: Messages, system: str | None = None) -> list[dict[str, Any]]:
    """A user string (plus an optional system prompt) as a message list.

    >>> as_messages("Hi", system="Be brief.")  # doctest: +NORMALIZE_WHITESPACE
    [{'role': 'system', 'content': 'Be brief.'}, {'role': 'user', 'content': 'Hi'}]
    """
    if isinstance(prompt, str):
        msgs = [{"role": "user", "content": prompt}]
    else:
        msgs = data.check_messages(prompt)
    if system is not None:
        msgs = [{"role": "system", "content": system}, *msgs]
    return msgs


def stream_text(
    tokenizer: Any,
    steps: Iterable[np.ndarray],
    stops: Sequence[int] = (),
    stop_strings: Sequence[str] = (),
) -> Iterator[str]:
    """Text pieces of generated tokens (row 0 of each step) until a stop.

    A piece is held back while the text ends inside a multi-byte UTF-8 character
    (the tokenizer decodes it as U+FFFD), inside a run of SentencePiece byte
    tokens (``<0xNN>``: the run decodes as a whole, and a character left unfinished
    at its end turns all of it into U+FFFD, as transformers' ``ByteFallback``
    decoder does; a token that decodes to nothing, such as a skipped ``<unk>`` or
    control token, does not end the run, since the decoder never sees it) or with
    the beginning of a stop string
    (`entrenar.nn.generate.partial_stop`), so every piece is whole characters, no
    part of a stop string is ever shown, and the pieces join to the decoded text cut
    before its first stop string.
    """
    ids: list[int] = []
    sent = 0
    run = 0  # where the trailing run of byte tokens begins in ids
    for row in steps:
        tok = int(row[0])
        if tok in stops:
            break
        ids.append(tok)
        if not _is_byte_token(tokenizer, tok) and tokenizer.decode([tok]):
            run = len(ids)
        text = tokenizer.decode(ids)
        cut = find_stop(text, stop_strings)
        if cut is not None:
            if cut > sent:
                yield text[sent:cut]
            return
        if text.endswith("\ufffd"):  # inside a multi-byte character: wait
            continue
        end = len(text) - partial_stop(text, stop_strings)
        if run < len(ids):  # the run may still turn into U+FFFD: up to its start
            end = min(end, len(tokenizer.decode(ids[:run])))
        if end > sent:
            yield text[sent:end]
            sent = end
    text = tokenizer.decode(ids)
    if len(text) > sent:
        yield text[sent:]


def _is_byte_token(tokenizer: Any, tok: int) -> bool:
    """Whether ``tok`` is a SentencePiece byte-fallback token ``<0xNN>``."""
    tokens = getattr(tokenizer, "tokens", ())
    piece = tokens[tok] if 0 <= tok < len(tokens) else ""
    return len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">")


def _reply(
    tokenizer: Any,
    out: Sequence[int],
    stops: Sequence[int],
    stop_strings: Sequence[str],
    prompt_tokens: int,
    scores: StepLogprobs | None = None,
    row: int = 0,
) -> Reply:
    """The `Reply` of one row's generated ids (cut at a stop token or string).

    ``scores``: the decoding's log-probabilities (row ``row`` is this reply's).
    """
    out = list(out)
    for i, t in enumerate(out):
        if t in stops:
            out = out[: i + 1]
            break
    stopped = bool(out) and out[-1] in stops
    text = tokenizer.decode(out[:-1] if stopped else out)
    cut = find_stop(text, stop_strings)
    if cut is not None and not stopped:  # ends at the token that completed it
        while (
            len(out) > 1
            and find_stop(tokenizer.decode(out[:-1]), stop_strings) is not None
        ):
            out = out[:-1]  # a batch's pad after the row stopped (`replies`)
    return Reply(
        text=text if cut is None else text[:cut],
        token_ids=tuple(out),
        finish_reason="stop" if stopped or cut is not None else "length",
        prompt_tokens=prompt_tokens,
        logprobs=None if scores is None else scores.row(row, 0, len(out)),
    )


@dataclasses.dataclass(frozen=True)
class Reply:
    """One generated reply.

    Attributes:
        text: the reply, without the end-of-turn token, cut before the first stop
            string.
        token_ids: the generated ids, the end-of-turn token (or the token that
            completed a stop string) included when one came.
        finish_reason: ``"stop"`` (an end-of-turn token or a stop string) or
            ``"length"`` (``max_new_tokens`` reached first).
        prompt_tokens: length of the rendered, tokenized prompt.
        logprobs: asked for (``logprobs=k``), the raw log-probability of each of
            ``token_ids`` and its ``k`` likeliest alternatives, from the decoding
            steps that chose them (`entrenar.nn.StepLogprobs`); else None.
    """

    text: str
    token_ids: tuple[int, ...]
    finish_reason: Literal["stop", "length"]
    prompt_tokens: int
    logprobs: TokenLogprobs | None = dataclasses.field(default=None, compare=False)


@dataclasses.dataclass(frozen=True)
class ChatModel:
    """A causal LM with its tokenizer and chat template; see the module docstring.

    Attributes:
        model: the architecture (`entrenar.nn.LlamaConfig`), with ``init_cache`` and
            ``apply_cached``.
        params: its param tree (dense, quantized or with `entrenar.lora.LoRAWeight`
            nodes).
        tokenizer: `entrenar.data.FastTokenizer` or `entrenar.io.BPETokenizer`.
        chat_template: Jinja template; None takes the tokenizer's ``chat_template``.
        stop_ids: ids that end a reply; None takes `end_of_turn_ids`.
        decode_activations: ``"int8"`` or ``"float32"``: how quantized weights
            kept as stored multiply the activations (see the module docstring);
            None: the process setting (`entrenar.nn.matvec.set_activations`).
    """

    model: Any
    params: Params
    tokenizer: Any
    chat_template: str | None = None
    stop_ids: tuple[int, ...] | None = None
    decode_activations: str | None = None

    def __post_init__(self) -> None:
        if self.decode_activations is not None:
            check_activations(self.decode_activations, "ChatModel.decode_activations")

    @classmethod
    def from_gguf(
        cls,
        path: str | os.PathLike[str],
        *,
        adapter: str | os.PathLike[str] | None = None,
        keep_quantized: bool = False,
        decode_activations: str | None = None,
    ) -> ChatModel:
        """Load a llama.cpp GGUF (and optionally a PEFT adapter folder) for chat.

        Args:
            path: the ``.gguf`` file; its tokenizer and chat template are used.
            adapter: a PEFT LoRA folder (`entrenar.lora.save_adapter`) to attach.
            keep_quantized: keep the matrices as stored (less memory). Decoding
                steps (at most `entrenar.quant.matvec.FEW_ROWS` rows) multiply by
                the stored bytes through the native kernel where it runs; longer
                forwards (prompts, teacher-forced scoring) decode blocks of rows
                at every call. A tied output head is then read as Q8_0
                (`entrenar.quant.matvec.quantize_tied_head`), or as the
                ``token_embd`` kept in its own type (SmolLM2's Q8_0 bytes), as
                llama.cpp reads it and as ``benchmarks/generate.py`` measures.
            decode_activations: see `ChatModel` (``"int8"`` needs
                ``keep_quantized`` to have any effect).
        """
        gguf = io.read_gguf(path)
        config, params, _ = io.load_llama_gguf(gguf, keep_quantized=keep_quantized)
        if keep_quantized and config.tie_word_embeddings:
            params = quantize_tied_head(params)  # the head as Q8_0, as llama.cpp reads
        if adapter is not None:
            params = lora.load_adapter(adapter, params)
        tokenizer = data.load_fast_tokenizer(gguf)
        return cls(config, params, tokenizer, decode_activations=decode_activations)

    @property
    def template(self) -> str:
        """The chat template in use."""
        t = self.chat_template or getattr(self.tokenizer, "chat_template", None)
        if not t:
            raise ConfigError(
                "this model has no chat template (tokenizer.chat_template); pass "
                "chat_template= to ChatModel"
            )
        return str(t)

    @property
    def stops(self) -> tuple[int, ...]:
        """The ids that end a reply."""
        return end_of_turn_ids(self.tokenizer) if self.stop_ids is None else (
            self.stop_ids)  # fmt: skip

    def render(
        self, messages: Messages, *, system: str | None = None, tools: Tools = None
    ) -> str:
        """The prompt text: the conversation plus the opening of the assistant turn.

        ``tools``: function schemas the template lists (its ``tools`` variable, as
        transformers' ``apply_chat_template(tools=...)``); None: none.
        """
        return data.render_chat(
            as_messages(messages, system), self.template, add_generation_prompt=True,
            tools=None if tools is None else list(tools),
            **data.special_texts(self.tokenizer),
        )  # fmt: skip

    def encode(
        self,
        messages: Messages,
        *,
        system: str | None = None,
        chat: bool = True,
        tools: Tools = None,
    ) -> list[int]:
        """Token ids of the prompt.

        With ``chat`` (the default): `render` tokenized with control tokens parsed
        as single tokens, and no BOS added when the template begins with one
        (`entrenar.data.chat_add_bos`). Without: ``messages`` is plain text to
        continue, tokenized as text (control tokens not parsed, BOS as the
        tokenizer's default), or a list of token ids, taken as they are (each
        checked to lie in the vocabulary: `ConfigError` otherwise).
        """
        if chat:
            text = self.render(messages, system=system, tools=tools)
            bos = data.chat_add_bos(self.tokenizer, [text])  # one BOS, not two
            return list(self.tokenizer.encode(text, add_bos=bos, special=True))
        if tools is not None:
            raise ConfigError("tools are listed by the chat template: pass chat=True")
        if _is_token_ids(messages) and system is None:
            return self._checked_ids(messages)  # type: ignore[arg-type]
        if not isinstance(messages, str) or system is not None:
            raise ConfigError(
                "chat=False continues plain text: pass a string (or a list of token "
                "ids) and no system prompt"
            )
        ids = list(self.tokenizer.encode(messages))
        if not ids:  # nothing to continue (no text, and the tokenizer adds no BOS)
            raise ConfigError(
                f"the prompt {messages!r} gives no tokens; give text to continue"
            )
        return ids

    def _checked_ids(self, ids: Sequence[int]) -> list[int]:
        """Token ids given as the prompt, each checked against the vocabulary."""
        n = min(len(self.tokenizer.tokens), self.model.vocab_size)
        bad = [i for i in ids if not 0 <= i < n]
        if not ids or bad:
            raise ConfigError(
                f"a prompt of token ids needs at least one id in [0, {n}); got "
                f"{len(ids)} ids" + (f", {bad[0]} among them" if bad else "")
            )
        return [int(i) for i in ids]

    def _limit(self, longest: int, max_new_tokens: int | None) -> int:
        """``max_new_tokens``, or the default capped by the context; checked."""
        if max_new_tokens is None:
            room = (context_length(self.model) or 1 << 62) - longest
            max_new_tokens = min(DEFAULT_MAX_NEW_TOKENS, max(room, 1))
        check_length(self.model, longest, max_new_tokens)
        return max_new_tokens

    def _decode(
        self,
        prompts: list[list[int]],
        max_new_tokens: int | None,
        options: Mapping[str, Any],
        scores: StepLogprobs | None = None,
    ) -> Iterator[np.ndarray]:
        """The steps of `entrenar.nn.generate_stream` for these prompts (checked).

        ``scores``: receives each step's log-probabilities (`StepLogprobs`).
        """
        unknown = set(options) - set(SAMPLING_OPTIONS)
        if unknown:
            raise ConfigError(
                f"unknown generation option(s) {sorted(unknown)}; the options are "
                f"{', '.join(SAMPLING_OPTIONS)}"
            )
        n = self._limit(max(len(p) for p in prompts), max_new_tokens)
        opts = dict(options)
        stop = tuple(opts.pop("stop", ()) or ())
        return generate_stream(
            self.model, self.params, prompts if len(prompts) > 1 else
            jnp.asarray(prompts, jnp.int32), max_new_tokens=n,
            stop_tokens=self.stops, stop_strings=stop,
            tokenizer=self.tokenizer if stop else None,
            vocab_limit=len(self.tokenizer.tokens),  # a padded embedding's rows
            decode_activations=self.decode_activations, logprobs=scores, **opts,
        )  # fmt: skip

    def reply(
        self,
        messages: Messages,
        *,
        system: str | None = None,
        max_new_tokens: int | None = None,
        temperature: float = 0.0,
        top_k: int | None = None,
        top_p: float | None = None,
        min_p: float | None = None,
        repetition_penalty: float | None = None,
        stop: Sequence[str] = (),
        key: PRNGKey | None = None,
        chat: bool = True,
        tools: Tools = None,
        logprobs: int | None = None,
    ) -> Reply:
        """Generate the assistant's reply to ``messages`` (a string is one user turn).

        Greedy unless ``temperature > 0`` (then ``key`` is required; the same key
        gives the same reply). Stops at an end-of-turn token (EOS included), at the
        first of the ``stop`` strings (cut before it, however the tokens split it),
        or after ``max_new_tokens`` (None: `DEFAULT_MAX_NEW_TOKENS` or what is left
        of the context, whichever is less). ``chat=False`` continues ``messages`` as
        plain text instead (see `encode`).

        Args:
            messages: the conversation, or one user message.
            system: a system message to put first.
            max_new_tokens: at most this many tokens.
            temperature: 0 is greedy.
            top_k: keep the k most likely tokens.
            top_p: nucleus sampling mass.
            min_p: drop tokens below ``min_p`` times the top token's probability.
            repetition_penalty: penalise tokens already seen, prompt included
                (Hugging Face's rule; 1 or None is off).
            stop: strings that end the reply.
            key: the sampling key.
            chat: render through the chat template (else continue plain text).
            tools: function schemas for the template (`render`).
            logprobs: report each generated token's raw log-probability and this
                many likeliest alternatives (0 to 20) in `Reply.logprobs`, as the
                decoding steps compute them; None: none.

        Raises:
            ShapeError: prompt + ``max_new_tokens`` exceeds the model's context.
            FormatError: malformed messages.
            TemplateError: a chat template that fails to render or exceeds its
                budget (`entrenar.data.sandbox`).
        """
        options = dict(temperature=temperature, top_k=top_k, top_p=top_p,
                       min_p=min_p, repetition_penalty=repetition_penalty,
                       stop=stop, key=key)  # fmt: skip
        return self.replies(
            [messages], system=system, max_new_tokens=max_new_tokens, chat=chat,
            batch_size=1, tools=tools, logprobs=logprobs, **options,
        )[0]  # fmt: skip

    def replies(
        self,
        conversations: Sequence[Messages],
        *,
        system: str | None = None,
        max_new_tokens: int | None = None,
        chat: bool = True,
        batch_size: int = 16,
        tools: Tools = None,
        logprobs: int | None = None,
        **options: Any,
    ) -> list[Reply]:
        """`reply` to each conversation, ``batch_size`` prompts decoded at once.

        Prompts of different lengths share a batch (`entrenar.nn.generate`'s per-row
        positions); each greedy reply equals `reply` to the same conversation (the
        default ``max_new_tokens`` is capped by the longest prompt of its batch).
        ``options``: the sampling and ``stop`` arguments of `reply`; with sampling,
        row ``r`` of a batch draws with ``fold_in(step_key, r)``. ``logprobs``: as
        in `reply`.
        """
        if batch_size < 1:
            raise ConfigError(f"batch_size must be >= 1, got {batch_size}")
        prompts = [self.encode(m, system=system, chat=chat, tools=tools)
                   for m in conversations]  # fmt: skip
        stop = tuple(options.get("stop", ()) or ())
        out: list[Reply] = []
        for s in range(0, len(prompts), batch_size):
            chunk = prompts[s : s + batch_size]
            scores = None if logprobs is None else StepLogprobs(logprobs)
            steps = list(self._decode(chunk, max_new_tokens, options, scores))
            ids = np.stack(steps, axis=1) if steps else np.zeros((len(chunk), 0))
            out += [_reply(self.tokenizer, [int(t) for t in ids[i]], self.stops,
                           stop, len(p), scores, i)
                    for i, p in enumerate(chunk)]  # fmt: skip
        return out

    def __call__(self, messages: Messages, **kwargs: Any) -> str:
        """The text of `reply` (same arguments)."""
        return self.reply(messages, **kwargs).text

    def stream(
        self,
        messages: Messages,
        *,
        system: str | None = None,
        max_new_tokens: int | None = None,
        chat: bool = True,
        **options: Any,
    ) -> Iterator[str]:
        """Yield the reply's text piece by piece as tokens come (same arguments).

        ``options``: the sampling, ``stop`` and ``tools`` arguments of `reply`. The
        checks (messages, template, length) run before this returns, so a bad request
        raises here, not at the first ``next``. ``"".join(stream(...))`` equals
        ``reply(...).text``: a piece that may be the start of a stop string is held
        back until the next tokens decide.
        """
        return iter(self.stream_reply(messages, system=system,
                                      max_new_tokens=max_new_tokens, chat=chat,
                                      **options))  # fmt: skip

    def stream_reply(
        self,
        messages: Messages,
        *,
        system: str | None = None,
        max_new_tokens: int | None = None,
        chat: bool = True,
        logprobs: int | None = None,
        **options: Any,
    ) -> ReplyStream:
        """`stream`, with the whole `Reply` once the pieces are exhausted.

        The same checks as `stream`, before this returns. Iterating the result
        yields the pieces of `stream`; after the last, its ``reply`` is the `Reply`
        that `reply` gives for the same request (token ids, finish reason, prompt
        length, log-probabilities): what a server reports after streaming
        (`entrenar.chat.server`). ``logprobs``: as in `reply`; while streaming,
        `ReplyStream.logprobs` gives those of the tokens read so far.
        """
        tools = options.pop("tools", None)
        prompt = self.encode(messages, system=system, chat=chat, tools=tools)
        scores = None if logprobs is None else StepLogprobs(logprobs)
        steps = self._decode([prompt], max_new_tokens, options, scores)
        stop = tuple(options.get("stop", ()) or ())
        return ReplyStream(self.tokenizer, steps, self.stops, stop, len(prompt),
                           scores)  # fmt: skip


class ReplyStream:
    """The text pieces of one reply as they come, then its `Reply`.

    Iterate once: the pieces are `stream_text`'s of the decoding ``steps``; the ids
    it reads are kept in ``ids`` (when a piece comes, ``ids`` holds the tokens that
    made it and those before: what a server's streamed log-probabilities are cut
    by; `logprobs` gives theirs as they come, when ``scores`` collects them), and
    when it ends, ``reply`` is `_reply` of them, as `ChatModel.reply` cuts the ids
    of a whole decode (a stop token or stop string ends both at the same step).
    ``reply`` is None until then.
    """

    def __init__(
        self,
        tokenizer: Any,
        steps: Iterable[np.ndarray],
        stops: Sequence[int],
        stop_strings: Sequence[str],
        prompt_tokens: int,
        scores: StepLogprobs | None = None,
    ) -> None:
        self.tokenizer, self.steps = tokenizer, steps
        self.stops, self.stop_strings = tuple(stops), tuple(stop_strings)
        self.prompt_tokens, self.scores = prompt_tokens, scores
        self.ids: list[int] = []
        self.reply: Reply | None = None

    def logprobs(self, start: int, stop: int) -> TokenLogprobs:
        """The log-probabilities of ``ids[start:stop]`` (tokens already read).

        Raises:
            ConfigError: the stream was made without ``logprobs``.
        """
        if self.scores is None:
            raise ConfigError("this stream has no log-probabilities: ask logprobs=")
        return self.scores.row(0, start, min(stop, len(self.ids)))

    def __iter__(self) -> Iterator[str]:
        def kept() -> Iterator[np.ndarray]:
            for row in self.steps:
                self.ids.append(int(row[0]))
                yield row

        yield from stream_text(self.tokenizer, kept(), self.stops, self.stop_strings)
        self.reply = _reply(self.tokenizer, self.ids, self.stops, self.stop_strings,
                            self.prompt_tokens, self.scores)  # fmt: skip


SAMPLING_OPTIONS = (
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "repetition_penalty",
    "stop",
    "key",
)
"""The generation options `ChatModel.reply`, `replies` and `stream` take."""


__all__ = [
    "DEFAULT_MAX_NEW_TOKENS",
    "END_OF_TURN",
    "SAMPLING_OPTIONS",
    "ChatModel",
    "Reply",
    "ReplyStream",
    "as_messages",
    "end_of_turn_ids",
    "stream_text",
]
