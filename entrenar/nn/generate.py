"""Autoregressive generation with a KV cache: batched, ragged, sampled, with stops.

Works with any model exposing ``init_cache(batch, max_len)`` and
``apply_cached(params, tokens, cache) -> (logits, cache)`` (`entrenar.nn.LlamaConfig`,
`entrenar.nn.GPT2Config`). The prompts are run once, as one batched forward pass
(`prefill`); every new token then costs one jitted, cached step (`decode_step`) of
one position per row, compiled once per (batch, prompt bucket, cache length bucket)
and sampling structure: prompts are padded on the right to a multiple of
`PROMPT_BUCKET` tokens and the cache to a multiple of `CACHE_BUCKET` (within the
context), and the cache position is rewound to each prompt's true length.

Prompts of different lengths (a list of token lists) are decoded together with
per-row positions: the cache's ``pos`` is ``(B,)``, one position per row, so row
``i`` sees positions ``0 .. len_i - 1`` exactly as it would alone, and the padding
behind it is overwritten before any query can reach it (the causal mask allows keys
up to the query's own position). This needs a cache with a ``pos`` field whose
model takes one position per row (`entrenar.nn.KVCache`). Tokens that every prompt
of a batch begins with (a system prompt, the chat template's opening) run once
(`share_prefix`), in whole `PREFIX_BUCKET`s, and their cache is copied to every row.

The next token is chosen by `entrenar.nn.sampling` (greedy, temperature, top-k,
top-p, min-p, repetition penalty) inside the jitted step; row ``r`` at step ``s``
draws with ``fold_in(fold_in(key, s), r)``, so a run is reproducible from its key
and a row draws the same in any batch at the same index. Asked for them
(``logprobs=StepLogprobs(top=k)``), the same step also returns each chosen token's
log-probability under the raw logits and the ``k`` likeliest alternatives
(`entrenar.nn.sampling.raw_logprobs`), so only ``(B, 1 + 2k)`` numbers reach the
host per step, never a ``(B, V)`` row; not asked, the step computes none of it.
A row ends at a stop token
(kept, then ``pad_token``), at a stop string (with a ``tokenizer``: the decoded text
of the row contains it), or after ``max_new_tokens``; the loop ends when every row
has. A request longer than the model's context is refused before any work.
A ``longrope`` model (Phi-3) rotates with its long factors once the sequence passes
``L = rope_original_max_position_embeddings`` (`long_rope_switch`): a prompt's
bucket padding stops at ``L``, no prefix is shared when the prompts pass it, and
the step whose input crosses it recomputes the cache of every row's tokens so far,
as transformers does (the keys cached with the short factors are stale). A
``dynamic`` (NTK) model's base grows with the sequence past
``M = max_position_embeddings`` (`dynamic_rope_start`): no bucket padding past ``M``
and the longest prompt, no shared prefix past ``M``; the cache is kept, each step
rotating with the base of its own length, as in transformers.

Weights kept as stored (`entrenar.io.load_llama_gguf(keep_quantized=True)`: Q8_0,
Q4_0, Q4_1, K-quants, BF16; `Bfloat16Weight`) are multiplied as they are in every
step of at most 64 rows (`entrenar.quant.matvec`: a native kernel decodes them in
registers), and `entrenar.quant.matvec.quantize_tied_head` reads a tied output head
as Q8_0, as llama.cpp does; the KV cache is in the model's compute dtype.
``decode_activations="int8"`` multiplies Q8_0 / Q4_0 / Q4_1 weights by the
activations rounded to 8 bits per 32-value block, as llama.cpp does (faster; greedy
tokens can change where two logits nearly tie); None (the default) takes the process
setting (`entrenar.nn.matvec.set_activations`, float32 unless
``ENTRENAR_DECODE_ACTIVATIONS`` says otherwise). It is a static argument of the
jitted steps, so runs with either choice keep their own compilations.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from entrenar.errors import ConfigError, ShapeError
from entrenar.nn.matvec import check_activations, traced_activations
from entrenar.nn.sampling import (
    MAX_TOP,
    Sampling,
    Structure,
    TokenLogprobs,
    choose,
    raw_logprobs,
    sample_logits,
    seen_tokens,
)
from entrenar.types import Params, PRNGKey

PROMPT_BUCKET = 32
"""Prompts are padded (on the right) to a multiple of this many tokens."""

CACHE_BUCKET = 32
"""The cache length is a multiple of this (capped by the model's context).

Small, because a step costs in proportion to the cache: attention reads every slot
(``apply_cached`` writes only the new entries, in place: `prefill` and
`decode_step` donate the cache)."""

PREFIX_BUCKET = 16
"""A prefix all prompts share is run once, in whole multiples of this many tokens."""

Prompt = jax.Array | np.ndarray | Sequence[Sequence[int]]
"""``(B, T)`` token ids, or a list of token lists of different lengths."""


Scores = tuple[jax.Array, jax.Array, jax.Array] | None
"""A step's `raw_logprobs` of its chosen tokens ``(B,), (B, k), (B, k)``, or None."""


@dataclasses.dataclass
class StepLogprobs:
    """Where `generate_stream` leaves each step's log-probabilities, when asked.

    ``generate_stream(..., logprobs=StepLogprobs(top=k))``: before each ``(B,)``
    row is yielded, ``steps`` gains its `TokenLogprobs` of ``B`` entries: each
    chosen token's log-probability under the raw model (no temperature, filter or
    penalty: vLLM's default ``raw_logprobs``; ids at or past ``vocab_limit``
    impossible) and the ``top`` likeliest tokens with theirs (descending, ties to
    the smaller id). Computed inside the compiled steps (`raw_logprobs`), at
    ``top = 0`` or `MAX_TOP` there (one compilation for any ``1 <= top <= 20``),
    cut to ``top`` on the host. A row's entries after it ended are meaningless.

    Attributes:
        top: the alternatives to keep per token, 0 to `MAX_TOP`.
        steps: one `TokenLogprobs` of ``B`` entries per step yielded.
    """

    top: int = 0
    steps: list[TokenLogprobs] = dataclasses.field(default_factory=list)

    def __post_init__(self) -> None:
        """Check ``top`` (`ConfigError`)."""
        if not 0 <= self.top <= MAX_TOP:
            raise ConfigError(f"logprobs top must be in [0, {MAX_TOP}], got {self.top}")

    @property
    def computed(self) -> int:
        """The alternatives the compiled steps compute: 0 or `MAX_TOP`."""
        return 0 if self.top == 0 else MAX_TOP

    def add(self, scores: Scores) -> None:
        """Keep one step's scores (host copies, cut to ``top``)."""
        assert scores is not None
        own, ids, lp = (np.asarray(x) for x in scores)
        self.steps.append(TokenLogprobs(own, ids[:, : self.top], lp[:, : self.top]))

    def row(self, r: int, start: int = 0, stop: int | None = None) -> TokenLogprobs:
        """Row ``r``'s entries of steps ``start:stop`` as one `TokenLogprobs`."""
        steps = self.steps[start:stop]
        if not steps:
            return TokenLogprobs(np.zeros(0, np.float32),
                                 np.zeros((0, self.top), np.int32),
                                 np.zeros((0, self.top), np.float32))  # fmt: skip
        return TokenLogprobs(*(np.stack([field[r] for field in fields])
                               for fields in zip(*steps)))  # fmt: skip


def _scores(logits: jax.Array, chosen: jax.Array, structure: Structure,
            logprobs: int | None) -> Scores:  # fmt: skip
    """`raw_logprobs` of ``chosen: (B,)`` under ``logits: (B, V)``, when asked."""
    if logprobs is None:
        return None
    return raw_logprobs(logits, chosen, logprobs, structure[5])


def _rows_cache(cache: Any, rows: int, pos: jax.Array) -> Any:
    """``cache``'s one row as ``rows`` rows, each at its ``pos: (rows,)``.

    Arrays broadcast along their batch axis (axis 1, after the layers); the scalar
    position becomes ``pos``.
    """

    def tile(x: jax.Array) -> jax.Array:
        if jnp.ndim(x) < 2:
            return pos
        return jnp.broadcast_to(x, (x.shape[0], rows, *x.shape[2:]))

    return jax.tree_util.tree_map(tile, cache)


def _is_stop(tokens: jax.Array, stops: jax.Array) -> jax.Array:
    return (tokens[:, None] == stops[None, :]).any(axis=-1)  # (B,)


def _takes_logits_at(model: Any) -> bool:
    """Whether ``model.apply_cached`` takes ``logits_at`` (`LlamaConfig`, `GPT2Config`).

    Then `prefill` asks for the logits of each prompt's last token only: the output
    head multiplies ``B`` rows instead of ``B·Tb`` (a fifth of a SmolLM2 prompt's
    multiply-adds), as llama.cpp does.
    """
    try:
        params = inspect.signature(model.apply_cached).parameters
    except (TypeError, ValueError):
        return False
    return "logits_at" in params


def _see(seen: jax.Array | None, tokens: jax.Array) -> jax.Array | None:
    if seen is None:
        return None
    return seen.at[jnp.arange(tokens.shape[0]), tokens].set(True)


@functools.partial(
    jax.jit,
    static_argnames=("model", "structure", "rewind", "decode_activations", "logprobs"),
    donate_argnames=("cache",),
)
def prefill(
    model: Any,
    params: Params,
    ids: jax.Array,
    lens: jax.Array,
    cache: Any,
    key: PRNGKey | None,
    values: jax.Array,
    stops: jax.Array,
    prefix: jax.Array,
    *,
    structure: Structure,
    rewind: bool,
    decode_activations: str | None = None,
    step: jax.Array | int = 0,
    logprobs: int | None = None,
) -> tuple[jax.Array, Any, jax.Array | None, jax.Array, Scores]:
    """Run the right-padded prompts ``ids: (B, Tb)`` of lengths ``lens: (B,)``.

    ``prefix: (P,)``: tokens every row shares, already in ``cache`` (`share_prefix`;
    ``(0,)`` when none): ``ids`` are what follows them. Returns the first new token
    ``(B,)``, the cache (its ``pos`` rewound to ``P + lens`` when ``rewind``: per
    row when ``pos`` is ``(B,)``, else all rows to the first's), the seen-token
    mask (with a repetition penalty), ``done`` and the token's `Scores` (with
    ``logprobs``, the alternatives to compute; else None). ``decode_activations``:
    see the module docstring. ``step``: the decoding step the token is drawn for
    (key ``fold_in(key, step)``; not 0 when `generate` recomputes a longrope cache).
    """
    with traced_activations(decode_activations):
        if _takes_logits_at(model):  # the head on each row's last token only
            logits, cache = model.apply_cached(params, ids, cache, logits_at=lens - 1)
            last = logits[:, 0]  # (B, V)
        else:
            logits, cache = model.apply_cached(params, ids, cache)  # (B, Tb, V)
            last = jnp.take_along_axis(logits, (lens - 1)[:, None, None], axis=1)[:, 0]
    if rewind:
        pos = prefix.shape[0] + lens
        cache = cache._replace(pos=pos if jnp.ndim(cache.pos) else pos[0])
    seen = None
    if structure[4]:
        valid = jnp.arange(ids.shape[1])[None, :] < lens[:, None]  # (B, Tb)
        seen = seen_tokens(ids, valid, last.shape[-1])
        seen = seen | seen_tokens(prefix[None], jnp.ones((1, prefix.shape[0]), bool),
                                  last.shape[-1])  # fmt: skip
    k = None if key is None else jax.random.fold_in(key, step)
    nxt = choose(last, seen, k, values, structure)  # (B,)
    scores = _scores(last, nxt, structure, logprobs)
    return nxt, cache, _see(seen, nxt), _is_stop(nxt, stops), scores


@functools.partial(jax.jit, static_argnames=("model", "rows", "decode_activations"))
def share_prefix(
    model: Any,
    params: Params,
    prefix: jax.Array,
    cache: Any,
    *,
    rows: int,
    decode_activations: str | None = None,
) -> Any:
    """Run ``prefix: (P,)`` once in a batch-1 ``cache``; return it as ``rows`` rows.

    The cache of a ragged batch, every row at ``pos = P`` (``(rows,)``): prompts
    that begin alike (a system prompt, a chat template's opening) compute those
    positions once instead of once a row.
    """
    with traced_activations(decode_activations):
        _, cache = model.apply_cached(params, prefix[None], cache)  # (1, P, V) unused
    pos = jnp.full((rows,), prefix.shape[0], jnp.int32)
    return _rows_cache(cache, rows, pos)


@functools.partial(
    jax.jit,
    static_argnames=("model", "structure", "decode_activations", "logprobs"),
    donate_argnames=("cache",),
)
def decode_step(
    model: Any,
    params: Params,
    tokens: jax.Array,
    cache: Any,
    seen: jax.Array | None,
    done: jax.Array,
    key: PRNGKey | None,
    step: jax.Array,
    values: jax.Array,
    stops: jax.Array,
    pad: jax.Array,
    *,
    structure: Structure,
    decode_activations: str | None = None,
    logprobs: int | None = None,
) -> tuple[jax.Array, Any, jax.Array | None, jax.Array, Scores]:
    """Feed ``tokens: (B,)``, choose the next ones; rows already ``done`` get ``pad``.

    Returns ``(next (B,), cache, seen, done, scores)`` as `prefill` does.
    """
    with traced_activations(decode_activations):
        logits, cache = model.apply_cached(params, tokens[:, None], cache)  # (B,1,V)
    k = None if key is None else jax.random.fold_in(key, step)
    nxt = jnp.where(done, pad, choose(logits[:, -1], seen, k, values, structure))
    scores = _scores(logits[:, -1], nxt, structure, logprobs)
    return nxt, cache, _see(seen, nxt), done | _is_stop(nxt, stops), scores


def context_length(model: Any) -> int | None:
    """Longest sequence ``model`` is made for, or None when it does not say.

    Reads ``max_position_embeddings`` (`entrenar.nn.LlamaConfig`) or ``n_positions``
    (`entrenar.nn.GPT2Config`), extended by the rotary scaling the config asks for,
    as vLLM's ``max_model_len`` is: ``linear`` and ``dynamic`` scaling reach
    ``factor × max_position_embeddings``, ``yarn`` reaches
    ``factor × original_max_position_embeddings`` (Qwen2.5's long-context recipe
    keeps ``max_position_embeddings`` at the pre-training 32,768 and adds yarn with
    factor 4: 131,072), never less than ``max_position_embeddings``; ``llama3`` and
    ``longrope`` configs already state the extended length there. Dynamic NTK
    scaling changes nothing below ``max_position_embeddings``, so without this it
    could never take effect.

    >>> from entrenar.nn import LlamaConfig
    >>> context_length(LlamaConfig.smollm2_135m())
    8192
    >>> import dataclasses
    >>> yarn = dict(rope_type="yarn", rope_factor=4.0,
    ...             rope_original_max_position_embeddings=8192)
    >>> context_length(dataclasses.replace(LlamaConfig.smollm2_135m(), **yarn))
    32768
    """
    for name in ("max_position_embeddings", "n_positions"):
        n = getattr(model, name, None)
        if isinstance(n, int) and n > 0:
            return max(n, _scaled_context(model, n))
    return None


def _scaled_context(model: Any, n: int) -> int:
    """The length ``model``'s rotary scaling extends ``n`` positions to."""
    kind = getattr(model, "rope_type", "default")
    factor = float(getattr(model, "rope_factor", 1.0) or 1.0)
    if kind in ("linear", "dynamic"):
        return int(n * factor)
    if kind == "yarn":
        original = getattr(model, "rope_original_max_position_embeddings", None)
        return int((original or n) * factor)
    return n


def check_length(model: Any, prompt_len: int, max_new_tokens: int) -> None:
    """Raise `ShapeError` unless ``prompt_len + max_new_tokens`` fits the context."""
    if max_new_tokens < 0:
        raise ConfigError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    ctx = context_length(model)
    if ctx is not None and prompt_len + max_new_tokens > ctx:
        fix = (
            f"ask for at most {ctx - prompt_len} new tokens"
            if prompt_len < ctx
            else f"the prompt alone fills it: shorten it to fewer than {ctx} tokens"
        )
        raise ShapeError(
            f"prompt ({prompt_len} tokens) + max_new_tokens ({max_new_tokens}) = "
            f"{prompt_len + max_new_tokens} exceeds the model's context of {ctx} "
            f"tokens; {fix}"
        )


def find_stop(text: str, stop_strings: Sequence[str], start: int = 0) -> int | None:
    r"""Index of the first occurrence of any stop string in ``text[start:]``, or None.

    >>> find_stop("a date: 2024-01-02\nmore", ["\n", "Q:"])
    18
    """
    hits = [i for s in stop_strings if s and (i := text.find(s, start)) >= 0]
    return min(hits) if hits else None


def partial_stop(text: str, stop_strings: Sequence[str]) -> int:
    r"""Length of the longest end of ``text`` that begins some stop string.

    A stream holds these characters back: the next token may complete the stop.

    >>> partial_stop("answer: 12\nQ", ["\nQ:"])
    2
    """
    best = 0
    for s in stop_strings:
        for n in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:n]):
                best = n
                break
    return best


def _rows(prompt: Prompt) -> list[np.ndarray]:
    """The prompt as one int array per row."""
    if isinstance(prompt, jax.Array | np.ndarray):
        arr = np.asarray(prompt)
        if arr.ndim != 2 or arr.shape[1] == 0:
            raise ShapeError(f"prompt must be (batch, time>=1), got {arr.shape}")
        return list(arr.astype(np.int32))
    rows = [np.asarray(r, np.int32).reshape(-1) for r in prompt]
    if not rows or any(len(r) == 0 for r in rows):
        raise ShapeError("every prompt needs at least one token")
    return rows


def _has_pos(model: Any) -> bool:
    """Whether the model's cache is a NamedTuple with a ``pos`` (it can be rewound)."""
    cache = jax.eval_shape(lambda: model.init_cache(1, 1))
    return hasattr(cache, "pos") and hasattr(cache, "_replace")


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def long_rope_switch(model: Any) -> int | None:
    """``L``: past a sequence of ``L`` tokens ``model`` rotates with other factors.

    ``longrope`` (Phi-3) switches from its short to its long factors when
    ``max(position) + 1 > L = rope_original_max_position_embeddings``; None for
    every other model. `generate` keeps a prompt's bucket padding within ``L``
    and recomputes the cache once the sequence crosses it, as transformers does.
    """
    if getattr(model, "rope_type", None) != "longrope":
        return None
    return getattr(model, "rope_original_max_position_embeddings", None)


def dynamic_rope_start(model: Any) -> int | None:
    """``M``: past a sequence of ``M`` tokens ``model``'s rotary base grows with it.

    ``dynamic`` (NTK) scaling rotates with a base that depends on
    ``s = max(position) + 1`` once ``s > M = max_position_embeddings``
    (`entrenar.nn.rope_scaling`); transformers takes ``s`` from the real tokens,
    so `generate` pads no prompt past ``M`` nor past its longest row, and shares
    no prefix once the prompt passes ``M``. None for every other model.
    """
    if getattr(model, "rope_type", None) != "dynamic":
        return None
    return getattr(model, "max_position_embeddings", None)


def generate_stream(
    model: Any,
    params: Params,
    prompt: Prompt,
    *,
    max_new_tokens: int,
    key: PRNGKey | None = None,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    min_p: float | None = None,
    repetition_penalty: float | None = None,
    vocab_limit: int | None = None,
    stop_tokens: Sequence[int] = (),
    stop_strings: Sequence[str] = (),
    tokenizer: Any = None,
    pad_token: int = 0,
    max_len: int | None = None,
    decode_activations: str | None = None,
    logprobs: StepLogprobs | None = None,
) -> Iterator[np.ndarray]:
    """Yield the next token of each row, ``(B,)`` int, one step at a time.

    Same arguments and rules as `generate` (which collects these steps). The checks
    run when the generator is created, before the first ``next``: a request beyond
    the model's context raises there. ``logprobs``: each step's scores are added to
    its ``steps`` before the step's row is yielded (`StepLogprobs`).
    """
    if decode_activations is not None:
        check_activations(decode_activations, "decode_activations")
    rows = _rows(prompt)
    sampling = Sampling(
        temperature, top_k, top_p, min_p, repetition_penalty, vocab_limit
    )
    if not sampling.greedy and key is None:
        raise ConfigError("sampling with temperature > 0 needs key=...")
    if stop_strings and tokenizer is None:
        raise ConfigError("stop_strings need tokenizer=... to decode the rows")
    t0 = max(len(r) for r in rows)
    check_length(model, t0, max_new_tokens)
    if max_len is not None and t0 + max_new_tokens > max_len:
        raise ShapeError(
            f"prompt ({t0}) + max_new_tokens ({max_new_tokens}) exceeds the cache "
            f"length max_len={max_len}"
        )
    has_pos = _has_pos(model)
    ragged = any(len(r) != t0 for r in rows)
    if ragged and not has_pos:
        raise ConfigError(
            "prompts of different lengths need a model whose cache has a pos "
            "field (entrenar.nn.KVCache); pass prompts of one length"
        )
    if max_len is None:
        max_len = _round_up(t0 + max_new_tokens, CACHE_BUCKET)
        max_len = min(max_len, context_length(model) or max_len)
    switch = long_rope_switch(model)
    grows = dynamic_rope_start(model)
    p = _shared_prefix(rows) if has_pos and len(rows) > 1 else 0
    if switch is not None and t0 > switch:
        p = 0  # the prefix alone would rotate with the short factors
    if grows is not None and t0 > grows:
        p = 0  # the prefix alone would rotate with a smaller base than the prompt
    ragged = ragged or p > 0
    prefix, rows = np.asarray(rows[0][:p], np.int32), [r[p:] for r in rows]
    t1 = max(len(r) for r in rows)
    tb = min(_round_up(t1, PROMPT_BUCKET), max_len - p) if has_pos else t1
    if switch is not None and p + t1 <= switch < p + tb:
        tb = switch - p  # padding past L would switch the prompt to the long factors
    if grows is not None and p + tb > grows:
        tb = max(t1, grows - p)  # padding past M and the longest row grows the base
    ids = np.zeros((len(rows), tb), np.int32)  # (B, Tb) right-padded
    for i, r in enumerate(rows):
        ids[i, : len(r)] = r
    lens = np.asarray([len(r) for r in rows], np.int32)
    stops = np.asarray(list(stop_tokens), np.int32)
    run = _Run(model, params, key, sampling, stops, pad_token, ragged, max_len,
               decode_activations, logprobs)  # fmt: skip
    if switch is not None and t0 <= switch:
        run.recompute_at = switch + 1 - t0  # the step whose input crosses L
    texts = _Texts(tokenizer, tuple(stop_strings), set(stops.tolist()), len(rows))
    return run.steps(prefix, ids, lens, max_new_tokens, texts)


def _shared_prefix(rows: Sequence[np.ndarray]) -> int:
    """Tokens all rows begin with, in whole `PREFIX_BUCKET`s, leaving each row one.

    0 when shorter than one bucket (sharing would not pay for its compilation).
    """
    n = min(len(r) for r in rows) - 1
    first = rows[0][:n]
    for r in rows[1:]:
        diff = np.nonzero(r[:n] != first[:n])[0]
        n = int(diff[0]) if len(diff) else n
    return n // PREFIX_BUCKET * PREFIX_BUCKET


def _same_start(old: str, new: str) -> int:
    """Length of the longest common beginning of ``old`` and ``new``."""
    if new.startswith(old):
        return len(old)
    n = 0
    for a, b in zip(old, new):
        if a != b:
            break
        n += 1
    return n


class _Texts:
    """Each row's decoded text, to stop rows at a stop string (host side)."""

    def __init__(
        self, tokenizer: Any, stop_strings: tuple[str, ...], stops: set[int], b: int
    ) -> None:
        self.tokenizer, self.stop_strings, self.stops = tokenizer, stop_strings, stops
        self.ids: list[list[int]] = [[] for _ in range(b)]
        self.texts = [""] * b  # each row's text, already searched
        self.width = max((len(s) for s in stop_strings), default=0)

    def stopped(self, row: np.ndarray, live: np.ndarray) -> np.ndarray:
        """Rows (among ``live``) whose text now holds a stop string.

        The search starts where the new text differs from the last one (less a
        stop string's width): a token can change text already decoded, as a
        SentencePiece byte token does to the U+FFFD of an unfinished character.
        """
        out = np.zeros(len(row), bool)
        if not self.stop_strings:
            return out
        for r in np.nonzero(live)[0]:
            tok = int(row[r])
            if tok in self.stops:
                continue
            self.ids[r].append(tok)
            text = self.tokenizer.decode(self.ids[r])
            start = max(0, _same_start(self.texts[r], text) - self.width + 1)
            out[r] = find_stop(text, self.stop_strings, start) is not None
            self.texts[r] = text
        return out


class _Run:
    """One generation request after its checks: the device state and its loop."""

    def __init__(
        self,
        model: Any,
        params: Params,
        key: PRNGKey | None,
        sampling: Sampling,
        stops: np.ndarray,
        pad: int,
        ragged: bool,
        max_len: int,
        decode_activations: str | None,
        logprobs: StepLogprobs | None = None,
    ) -> None:
        self.model, self.params, self.key = model, params, key
        self.activations = decode_activations
        self.logprobs = logprobs
        self.top = None if logprobs is None else logprobs.computed  # static
        self.structure, self.values = sampling.structure(), sampling.values()
        self.stops, self.pad = jnp.asarray(stops), jnp.int32(pad)
        self.ragged, self.max_len = ragged, max_len
        self.recompute_at: int | None = None  # see `long_rope_switch`

    def cache(self, b: int) -> Any:
        """An empty cache of ``b`` rows; ragged: with a position per row."""
        cache = self.model.init_cache(b, self.max_len)
        if self.ragged:
            cache = cache._replace(pos=jnp.zeros((b,), jnp.int32))
        return cache

    def steps(
        self,
        prefix: np.ndarray,
        ids: np.ndarray,
        lens: np.ndarray,
        max_new: int,
        texts: _Texts,
    ) -> Iterator[np.ndarray]:
        """The decoding loop of `generate_stream`."""
        if max_new == 0:
            return
        b, tb = ids.shape
        rewind = self.ragged or tb != int(lens.max())
        if len(prefix):
            one = self.model.init_cache(1, self.max_len)
            cache = share_prefix(
                self.model, self.params, jnp.asarray(prefix), one, rows=b,
                decode_activations=self.activations,
            )  # fmt: skip
        else:
            cache = self.cache(b)
        nxt, cache, seen, done, scores = prefill(
            self.model, self.params, jnp.asarray(ids), jnp.asarray(lens),
            cache, self.key, self.values, self.stops, jnp.asarray(prefix),
            structure=self.structure, rewind=rewind,
            decode_activations=self.activations, logprobs=self.top,
        )  # fmt: skip
        was_done = np.zeros(b, bool)
        fed: list[np.ndarray] = []  # the tokens chosen so far, (B,) a step
        for step in range(max_new):
            if step and step == self.recompute_at:
                nxt, cache, seen, done, scores = self.recompute(
                    prefix, ids, lens, fed, done
                )
            elif step:
                nxt, cache, seen, done, scores = decode_step(
                    self.model, self.params, nxt, cache, seen, done, self.key,
                    jnp.int32(step), self.values, self.stops, self.pad,
                    structure=self.structure, decode_activations=self.activations,
                    logprobs=self.top,
                )  # fmt: skip
            if self.logprobs is not None:
                self.logprobs.add(scores)
            row = np.where(was_done, int(self.pad), np.asarray(nxt))  # (B,)
            fed.append(np.asarray(nxt))
            by_text = texts.stopped(row, ~was_done)
            was_done = was_done | np.asarray(done) | by_text
            yield row
            if was_done.all():
                return
            if by_text.any():
                done = done | jnp.asarray(by_text)

    def recompute(
        self,
        prefix: np.ndarray,
        ids: np.ndarray,
        lens: np.ndarray,
        fed: list[np.ndarray],
        done: jax.Array,
    ) -> tuple[jax.Array, Any, jax.Array | None, jax.Array, Scores]:
        """Step ``len(fed)`` by a fresh `prefill` of every row's tokens so far.

        When a longrope sequence crosses `long_rope_switch`'s ``L``, the keys
        cached with the short factors are stale: transformers' Phi-3 then drops
        its cache and runs the whole sequence again with the long factors
        (``Phi3ForCausalLM.prepare_inputs_for_generation``), which this does.
        """
        step = len(fed)
        gen = np.stack(fed, axis=1)  # (B, step)
        rows = [np.concatenate([prefix, ids[i, : lens[i]], gen[i]])
                for i in range(len(ids))]  # fmt: skip
        n = np.asarray([len(r) for r in rows], np.int32)
        tb = min(_round_up(int(n.max()), PROMPT_BUCKET), self.max_len)
        full = np.zeros((len(rows), tb), np.int32)  # (B, Tb) right-padded
        for i, r in enumerate(rows):
            full[i, : len(r)] = r
        nxt, cache, seen, stop, scores = prefill(
            self.model, self.params, jnp.asarray(full), jnp.asarray(n),
            self.cache(len(rows)), self.key, self.values, self.stops,
            jnp.zeros((0,), jnp.int32), structure=self.structure,
            rewind=self.ragged or tb != int(n.max()),
            decode_activations=self.activations, step=step, logprobs=self.top,
        )  # fmt: skip
        return jnp.where(done, self.pad, nxt), cache, seen, done | stop, scores


def generate(
    model: Any,
    params: Params,
    prompt: Prompt,
    *,
    max_new_tokens: int,
    key: PRNGKey | None = None,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    min_p: float | None = None,
    repetition_penalty: float | None = None,
    vocab_limit: int | None = None,
    stop_tokens: Sequence[int] = (),
    stop_strings: Sequence[str] = (),
    tokenizer: Any = None,
    pad_token: int = 0,
    max_len: int | None = None,
    decode_activations: str | None = None,
    logprobs: StepLogprobs | None = None,
) -> jax.Array:
    """Continue each prompt; return the new tokens ``(B, N)``, ``N <= max_new_tokens``.

    A row that emits a stop token keeps it and is padded with ``pad_token`` afterwards;
    a row whose decoded text comes to hold a stop string keeps the token that
    completed it and is padded after it (cutting the text at the stop string is the
    caller's: `entrenar.chat` does). Generation ends early once every row has
    stopped. Without stops it runs all ``max_new_tokens`` steps.

    Args:
        model: a model config with ``init_cache`` and ``apply_cached``.
        params: its parameters.
        prompt: int token ids ``(B, T0)``, ``T0 >= 1``, or a list of token lists of
            different lengths (each row then decodes as it would alone).
        max_new_tokens: at most this many tokens per row.
        key: sampling key; required unless ``temperature == 0`` (greedy).
        temperature: softmax temperature; 0 is greedy argmax.
        top_k: keep only the k most likely tokens.
        top_p: nucleus sampling mass.
        min_p: drop tokens less likely than ``min_p`` times the most likely one.
        repetition_penalty: divide positive (multiply negative) logits of tokens
            already in the row, prompt included; 1 or None is off.
        vocab_limit: never choose an id at or past it: the tokenizer's size when the
            model's embedding is padded past it (no text decodes to those ids).
        stop_tokens: token ids that end a row.
        stop_strings: texts that end a row (they need ``tokenizer``).
        tokenizer: anything with ``decode(ids) -> str``, for ``stop_strings``.
        pad_token: filler after a row has stopped.
        max_len: cache length; defaults to ``T0 + max_new_tokens`` rounded up to
            `CACHE_BUCKET` (within the context).
        decode_activations: ``"int8"``: Q8_0 / Q4_0 / Q4_1 weights kept as stored
            are multiplied by ``x`` rounded to 8 bits per 32-block, as llama.cpp
            does (faster; a near tie of two logits can go the other way);
            ``"float32"``: by ``x`` as is; None: the process setting
            (`entrenar.nn.matvec.set_activations`).
        logprobs: a `StepLogprobs` to receive each step's raw log-probabilities
            of the chosen tokens and their ``top`` alternatives; None: none are
            computed.

    Raises:
        ShapeError: ``T0 + max_new_tokens`` exceeds the model's `context_length`
            (checked before any computation) or ``max_len``.
        ConfigError: sampling without a key, an option out of range, a negative
            ``max_new_tokens``, or ``decode_activations`` not float32 / int8.
    """
    steps = generate_stream(
        model, params, prompt, max_new_tokens=max_new_tokens, key=key,
        temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
        repetition_penalty=repetition_penalty, vocab_limit=vocab_limit,
        stop_tokens=stop_tokens,
        stop_strings=stop_strings, tokenizer=tokenizer, pad_token=pad_token,
        max_len=max_len, decode_activations=decode_activations, logprobs=logprobs,
    )  # fmt: skip
    out = list(steps)
    if not out:
        return jnp.zeros((len(_rows(prompt)), 0), jnp.int32)
    return jnp.asarray(np.stack(out, axis=1), jnp.int32)  # (B, N)


__all__ = [
    "CACHE_BUCKET",
    "PREFIX_BUCKET",
    "PROMPT_BUCKET",
    "Prompt",
    "Sampling",
    "Scores",
    "StepLogprobs",
    "check_length",
    "context_length",
    "decode_step",
    "dynamic_rope_start",
    "find_stop",
    "generate",
    "generate_stream",
    "long_rope_switch",
    "partial_stop",
    "prefill",
    "sample_logits",
    "share_prefix",
]
