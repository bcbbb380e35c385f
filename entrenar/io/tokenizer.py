r"""GPT-2-style byte-level BPE built from a GGUF's ``tokenizer.ggml.*`` fields.

It tokenizes as llama.cpp's ``llm_tokenizer_bpe`` does:

1. **Special tokens.** Control and unknown tokens (``token_type`` 3 and 2) are
   matched in the text when ``special=True``; user-defined tokens (type 4) always.
   Longer tokens win; the text between them goes through steps 2-4.
2. **Pre-tokenization** by the model's ``tokenizer.ggml.pre`` rules. The GPT-2 regex
   ``'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+``
   is hand-coded over Unicode categories as in llama.cpp's ``unicode.cpp``; the
   ``smollm``/``starcoder`` family first splits off every digit (``\p{N}``).
   ``default`` (also a file without ``pre``, as llama.cpp reads it) splits by four
   regexes in turn, each keeping its matches and the text between them as pieces:
   ``[\p{P}\$\+<=>\^~\|]+``, GPT-2's, ``\p{N}+``, then ``[0-9][0-9][0-9]``.
3. **Bytes to symbols.** Each piece's UTF-8 bytes map to printable characters with
   GPT-2's ``bytes_to_unicode`` table (``Ġ`` is the space).
4. **Merges.** Repeatedly merge the adjacent pair with the lowest rank in
   ``tokenizer.ggml.merges`` (leftmost first on ties) until no pair has a rank; each
   symbol is then looked up in ``tokenizer.ggml.tokens``.
"""

from __future__ import annotations

import bisect
import functools
import heapq
import itertools
import re
from collections.abc import Callable, Container, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from entrenar.errors import FormatError, UnsupportedError
from entrenar.io import unicode_classes

UNKNOWN, CONTROL, USER_DEFINED, UNUSED = 2, 3, 4, 5
SPECIAL_TYPES = (CONTROL, UNKNOWN)
"""Types llama.cpp parses in text only with ``special`` and decodes only with it."""
_DIGIT_SPLIT_PRE = {"smollm", "starcoder", "refact", "command-r", "codeshell"}
_DEFAULT_PRE = {"default"}
_GPT2_PRE = {"gpt2", "gpt-2", "mpt", "olmo", "jais"} | _DIGIT_SPLIT_PRE | _DEFAULT_PRE
_DEFAULT_SYMBOLS = "$+<=>^~|"  # llama.cpp's default split: \p{P} and these
_TRIPLE_DIGITS = re.compile("[0-9]{3}")


@functools.lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from the 256 byte values to printable characters."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table, n = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + n)
            n += 1
    return table


@functools.lru_cache(maxsize=1 << 16)
def _class(ch: str) -> str:
    """llama.cpp's class of ``ch``: ``s``, ``L``, ``N``, ``p`` or ``P``.

    From llama.cpp's own Unicode table (15.1, `entrenar.io.unicode_classes`), not
    Python's ``unicodedata``, whose version follows the Python (3.11's 14.0 calls
    5116 of llama.cpp's letters, digits and punctuation unassigned).
    """
    at = bisect.bisect_right(unicode_classes.STARTS, ord(ch)) - 1
    return unicode_classes.KINDS[at]


def _kind(ch: str) -> str:
    r"""Class of ``ch`` for GPT-2's regex: ``s`` space, ``L`` letter, ``N``, ``P``.

    ``P`` is everything else, unassigned code points included: llama.cpp flags them
    ``UNDEFINED``, which its ``[^\s\p{L}\p{N}]+`` takes like punctuation.
    """
    k = _class(ch)
    return "P" if k == "p" else k


def gpt2_split(text: str) -> list[str]:
    """Split ``text`` by the GPT-2 pre-tokenizer regex (see the module docstring).

    >>> gpt2_split("Hello world's  2024!!")
    ['Hello', ' world', "'s", ' ', ' 2024', '!!']
    """
    out, pos, n = [], 0, len(text)
    kinds = [_kind(c) for c in text] + ["end"]
    while pos < n:
        c = text[pos]
        if c == "'" and pos + 1 < n:
            nxt = text[pos + 1 : pos + 3]
            if nxt[:1] in ("s", "t", "m", "d"):
                out.append(text[pos : pos + 2])
                pos += 2
                continue
            if nxt in ("re", "ve", "ll"):
                out.append(text[pos : pos + 3])
                pos += 3
                continue
        start = pos
        k = kinds[pos + 1] if c == " " and pos + 1 < n else kinds[pos]
        if k in ("L", "N", "P"):
            end = pos + (c == " ")
            while kinds[end] == k:
                end += 1
            out.append(text[start:end])
            pos = end
            continue
        end = pos
        while kinds[end] == "s":
            end += 1
        if end - pos > 1 and end < n:  # \s+(?!\S): leave the last space to the word
            end -= 1
        end = max(end, pos + 1)  # no rule matched: a single character
        out.append(text[start:end])
        pos = end
    return out


def _runs(text: str, inside: Callable[[str], bool]) -> list[str]:
    """``text`` cut into maximal runs of characters ``inside`` or not."""
    return ["".join(g) for _, g in itertools.groupby(text, key=inside)]


def _default_punct(ch: str) -> bool:
    r"""``[\p{P}\$\+<=>\^~\|]``, with llama.cpp's whitespace never punctuation."""
    return _class(ch) == "p" or ch in _DEFAULT_SYMBOLS


def _number(ch: str) -> bool:
    return _kind(ch) == "N"


def _isolate(text: str, pattern: re.Pattern[str]) -> list[str]:
    """``text`` split at each match of ``pattern``, matches kept as pieces."""
    out, at = [], 0
    for m in pattern.finditer(text):
        out += [text[at : m.start()], m.group()]
        at = m.end()
    return [p for p in [*out, text[at:]] if p]


def default_split(text: str) -> list[str]:
    """llama.cpp's ``default`` pre-tokenizer (module docstring, step 2).

    >>> default_split("x+=12345 don't")
    ['x', '+=', '123', '45', ' don', "'", 't']
    """
    return [
        d
        for a in _runs(text, _default_punct)
        for b in gpt2_split(a)
        for c in _runs(b, _number)
        for d in _isolate(c, _TRIPLE_DIGITS)
    ]


def pre_tokenize(text: str, pre: str) -> list[str]:
    """Pre-tokenize ``text`` by the rules named ``pre`` (``tokenizer.ggml.pre``).

    >>> pre_tokenize("in 2024", "smollm")
    ['in', ' ', '2', '0', '2', '4']
    """
    if pre not in _GPT2_PRE:
        raise UnsupportedError(
            f"pre-tokenizer {pre!r} is not supported; supported: {sorted(_GPT2_PRE)}"
        )
    if pre in _DEFAULT_PRE:
        return default_split(text)
    if pre not in _DIGIT_SPLIT_PRE:
        return gpt2_split(text)
    out: list[str] = []
    run = ""
    for ch in text:
        if _class(ch) == "N":
            out += [*gpt2_split(run), ch]
            run = ""
        else:
            run += ch
    return out + gpt2_split(run)


def _array_of(md: Mapping[str, Any], key: str, kind: type, path: str) -> list[Any]:
    """``md[key]``, checked to be a list whose items are all of ``kind``."""
    value = md.get(key)
    if not isinstance(value, list):
        got = "missing" if value is None else f"of type {type(value).__name__}"
        raise FormatError(f"{path}: {key} is {got}, want an array")
    for i, x in enumerate(value):
        if isinstance(x, bool) or not isinstance(x, kind):
            raise FormatError(
                f"{path}: {key}[{i}] = {str(x)[:40]!r} has type "
                f"{type(x).__name__}, want {kind.__name__}"
            )
    if kind is str and not _is_utf8("".join(value)):
        i = next(i for i, x in enumerate(value) if not _is_utf8(x))
        raise FormatError(f"{path}: {key}[{i}] = {value[i]!r} is not valid UTF-8")
    return value


def check_text(text: str, index: int = 0) -> None:
    """Refuse text that is no valid Unicode: a lone surrogate cannot be tokenized.

    Raises:
        FormatError: naming text ``index``, the code point and its character.
    """
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise FormatError(
            f"text {index} holds a lone surrogate U+{ord(text[e.start]):04X} at "
            f"character {e.start}: not valid Unicode (half of a JSON "
            "'\\ud83d\\ude00' escape?); repair it first, e.g. "
            "text.encode('utf-8', 'replace').decode('utf-8')"
        ) from None


def _is_utf8(text: str) -> bool:
    """Whether ``text`` came from valid UTF-8.

    The GGUF reader keeps invalid bytes as lone surrogates, which no tokenizer can
    encode.
    """
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def check_tokenizer_metadata(md: Mapping[str, Any], path: str = "<gguf>") -> None:
    """Check the ``tokenizer.ggml.*`` fields a `BPETokenizer` is built from.

    ``tokens`` and ``merges`` are arrays of UTF-8 strings; ``token_type`` (if present)
    an array of integers, one per token, and ``scores`` (if present, SentencePiece
    style) an array of floats, one per token; ``pre`` and ``tokenizer.chat_template`` (if
    present) UTF-8 strings; ``add_bos_token`` a boolean;
    every special id (``bos``, ``eos``, ``padding``, ``unknown``, ... any
    ``tokenizer.ggml.*_token_id``) an integer inside the vocabulary.

    Raises:
        FormatError: the first field that fails, naming ``path`` and the key.

    >>> md = {"tokenizer.ggml.tokens": ["a"], "tokenizer.ggml.merges": [],
    ...       "tokenizer.ggml.eos_token_id": 1}
    >>> check_tokenizer_metadata(md, "m.gguf")
    Traceback (most recent call last):
    entrenar.errors.FormatError: m.gguf: tokenizer.ggml.eos_token_id = 1 is outside the vocabulary of 1 tokens
    """  # noqa: E501
    tokens = _array_of(md, "tokenizer.ggml.tokens", str, path)
    _array_of(md, "tokenizer.ggml.merges", str, path)
    for key, kind in (("token_type", int), ("scores", float)):
        if f"tokenizer.ggml.{key}" in md:
            per_token = _array_of(md, f"tokenizer.ggml.{key}", kind, path)
            if len(per_token) != len(tokens):
                raise FormatError(
                    f"{path}: tokenizer.ggml.{key} has {len(per_token)} entries for "
                    f"{len(tokens)} tokens"
                )
    for key in ("tokenizer.ggml.pre", "tokenizer.chat_template"):
        text = md.get(key, "")
        if not isinstance(text, str) or not _is_utf8(text):
            raise FormatError(
                f"{path}: {key} = {str(text)[:40]!r} is not a UTF-8 string"
            )
    add_bos = md.get("tokenizer.ggml.add_bos_token", False)
    if add_bos not in (True, False) or not isinstance(add_bos, (bool, int)):
        raise FormatError(
            f"{path}: tokenizer.ggml.add_bos_token = {add_bos!r} is not a boolean"
        )
    for key, value in md.items():
        if key.startswith("tokenizer.ggml.") and key.endswith("_token_id"):
            _check_special_id(key, value, len(tokens), path)


def _check_special_id(key: str, value: Any, n_tokens: int, path: str) -> None:
    """A special token id: an integer in ``[0, n_tokens)``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise FormatError(
            f"{path}: {key} = {str(value)[:40]!r} has type {type(value).__name__}, "
            "want an integer token id"
        )
    if not 0 <= value < n_tokens:
        raise FormatError(
            f"{path}: {key} = {value} is outside the vocabulary of {n_tokens} tokens"
        )


@dataclass(frozen=True)
class BPETokenizer:
    """Byte-level BPE over a GGUF vocabulary.

    Attributes:
        tokens: the vocabulary, token id -> string (byte-level symbols).
        merges: ``"a b"`` pairs, rank = position.
        token_types: llama.cpp token types (1 normal, 3 control, 4 user-defined, ...).
        pre: pre-tokenizer name (``tokenizer.ggml.pre``).
        bos_id, eos_id: special ids (``None`` when absent).
        add_bos: prepend ``bos_id`` by default (``tokenizer.ggml.add_bos_token``).
    """

    tokens: tuple[str, ...]
    merges: tuple[str, ...]
    token_types: tuple[int, ...]
    pre: str = "gpt2"
    bos_id: int | None = None
    eos_id: int | None = None
    add_bos: bool = False

    @classmethod
    def from_gguf_metadata(
        cls, md: Mapping[str, Any], path: str = "<gguf>"
    ) -> BPETokenizer:
        """Build from GGUF metadata (``tokenizer.ggml.model`` must be ``"gpt2"``).

        Raises:
            FormatError: a field of the wrong type or out of range (see
                `check_tokenizer_metadata`), naming ``path`` and the key.
            UnsupportedError: another tokenizer model.
        """
        model = md.get("tokenizer.ggml.model")
        if model != "gpt2":
            raise UnsupportedError(
                f"{path}: tokenizer.ggml.model {model!r} is not supported "
                "(only 'gpt2', byte-level BPE)"
            )
        check_tokenizer_metadata(md, path)
        tokens = md["tokenizer.ggml.tokens"]
        types = md.get("tokenizer.ggml.token_type", [1] * len(tokens))
        return cls(
            tokens=tuple(tokens),
            merges=tuple(md["tokenizer.ggml.merges"]),
            token_types=tuple(int(t) for t in types),
            pre=str(md.get("tokenizer.ggml.pre") or "default"),  # llama.cpp's
            bos_id=md.get("tokenizer.ggml.bos_token_id"),
            eos_id=md.get("tokenizer.ggml.eos_token_id"),
            add_bos=bool(md.get("tokenizer.ggml.add_bos_token", False)),
        )

    @functools.cached_property
    def _vocab(self) -> dict[str, int]:
        return {t: i for i, t in enumerate(self.tokens)}

    @functools.cached_property
    def _ranks(self) -> dict[tuple[str, str], int]:
        ranks: dict[tuple[str, str], int] = {}
        for r, m in enumerate(self.merges):
            a, sep, b = m.partition(" ")
            if sep:
                ranks.setdefault((a, b), r)
        return ranks

    @functools.cached_property
    def _specials(self) -> tuple[list[str], list[str]]:
        """(control tokens, user-defined tokens), longest first."""
        ctl = [t for t, k in zip(self.tokens, self.token_types) if k in SPECIAL_TYPES]
        usr = [t for t, k in zip(self.tokens, self.token_types) if k == USER_DEFINED]
        return sorted(ctl, key=len, reverse=True), sorted(usr, key=len, reverse=True)

    def _split_special(self, text: str, special: bool) -> list[tuple[str, bool]]:
        ctl, usr = self._specials
        cands = sorted((ctl if special else []) + usr, key=len, reverse=True)
        parts: list[tuple[str, bool]] = [(text, False)]
        for tok in cands:
            if not tok:
                continue
            new: list[tuple[str, bool]] = []
            for s, is_tok in parts:
                if is_tok or tok not in s:
                    new.append((s, is_tok))
                    continue
                pieces = s.split(tok)
                for j, p in enumerate(pieces):
                    if j:
                        new.append((tok, True))
                    if p:
                        new.append((p, False))
            parts = new
        return parts

    @functools.cached_property
    def _cache(self) -> dict[str, tuple[int, ...]]:
        return {}

    def _bpe(self, piece: str) -> tuple[int, ...]:
        """Token ids of one pre-tokenized piece (memoized per tokenizer)."""
        ids = self._cache.get(piece)
        if ids is None:
            if len(self._cache) > 100_000:
                self._cache.clear()
            ids = self._cache[piece] = self._merge(piece)
        return ids

    def _merge(self, piece: str) -> tuple[int, ...]:
        """BPE merges of one piece: lowest rank first, leftmost on ties.

        As llama.cpp's ``llm_tokenizer_bpe_session``: a heap of ``(rank, left)``
        candidate pairs over a linked list of symbols, so a piece of n bytes takes
        O(n log n) (rescanning all pairs per merge took O(n^2): minutes for 50 kB
        without a space). A popped pair is stale when its symbols have changed since;
        it is still right to merge when the pair now there has the same rank, as one
        rank names one pair.
        """
        b2u = bytes_to_unicode()
        syms: list[str | None] = [
            b2u[b] for b in piece.encode("utf-8", errors="surrogatepass")
        ]
        ranks, n = self._ranks, len(syms)
        nxt, prv = list(range(1, n + 1)), list(range(-1, n - 1))
        heap: list[tuple[int, int]] = []

        def rank(i: int) -> int | None:  # of the pair starting at symbol i
            j = nxt[i] if i >= 0 else n
            a, b = (syms[i], syms[j]) if j < n else (None, None)
            return None if a is None or b is None else ranks.get((a, b))

        def push(i: int) -> None:
            r = rank(i)
            if r is not None:
                heapq.heappush(heap, (r, i))

        for i in range(n - 1):
            push(i)
        while heap:
            r, i = heapq.heappop(heap)
            if rank(i) != r:  # stale: the pair there changed
                continue
            j = nxt[i]
            syms[i] = str(syms[i]) + str(syms[j])
            syms[j] = None
            nxt[i] = nxt[j]
            if nxt[j] < n:
                prv[nxt[j]] = i
            push(prv[i])
            push(i)
        ids: list[int] = []
        for s in syms:
            if s is None:
                continue
            if s in self._vocab:
                ids.append(self._vocab[s])
            else:  # unknown symbol: fall back to its single bytes, as llama.cpp does
                ids.extend(self._vocab[c] for c in s if c in self._vocab)
        return tuple(ids)

    def encode(
        self, text: str, *, add_bos: bool | None = None, special: bool = False
    ) -> list[int]:
        """Token ids of ``text``.

        Args:
            text: the string.
            add_bos: prepend BOS; default the file's ``add_bos_token``.
            special: parse control tokens such as ``<|im_start|>`` in the text.

        Raises:
            FormatError: text with a lone surrogate (`check_text`).
        """
        check_text(text)
        ids: list[int] = []
        if (self.add_bos if add_bos is None else add_bos) and self.bos_id is not None:
            ids.append(int(self.bos_id))
        for part, is_tok in self._split_special(text, special):
            if is_tok:
                ids.append(self._vocab[part])
                continue
            for piece in pre_tokenize(part, self.pre):
                ids.extend(self._bpe(piece))
        return ids

    def decode(self, ids: Sequence[int], *, special: bool = False) -> str:
        """Text of ``ids``, as llama.cpp's pieces.

        Control and unknown tokens are dropped unless ``special``; unused ones (type
        5, such as the ``[PAD{i}]`` tokens that pad a vocabulary) always.
        """
        u2b = {u: b for b, u in bytes_to_unicode().items()}
        out = bytearray()
        for i in ids:
            if not 0 <= int(i) < len(self.tokens):
                raise FormatError(f"token id {i} is outside the vocabulary")
            tok, kind = self.tokens[int(i)], self.token_types[int(i)]
            if kind in (*SPECIAL_TYPES, USER_DEFINED, UNUSED):
                if kind == USER_DEFINED or (special and kind != UNUSED):
                    out += tok.encode("utf-8")
                continue
            out += bytes(u2b[c] for c in tok if c in u2b)
        return out.decode("utf-8", errors="replace")


def _ranges(spans: Sequence[tuple[int, int]]) -> str:
    r"""Bracket-free regex class body of code point spans (``\x{a}-\x{b}...``)."""
    return "".join(
        f"\\x{{{a:X}}}" + (f"-\\x{{{b:X}}}" if b > a else "") for a, b in sorted(spans)
    )


@functools.lru_cache(maxsize=1)
def _classes() -> dict[str, str]:
    r"""Regex class bodies of llama.cpp's classes (see `_class`), surrogates left out.

    ``S`` whitespace, ``L`` letters, ``N`` numbers, ``P`` the ``default`` split's
    first class: ``\p{P}`` and ``$+<=>^~|``.
    """
    starts, kinds = unicode_classes.STARTS, unicode_classes.KINDS
    spans: dict[str, list[tuple[int, int]]] = {"S": [], "L": [], "N": [], "P": []}
    for a, b, k in zip(starts, [*starts[1:], 0x110000], kinds):
        name = {"s": "S", "L": "L", "N": "N", "p": "P"}.get(k)  # not P: other
        for lo, hi in ((a, min(b, 0xD800)), (max(a, 0xE000), b)):  # no surrogates
            if name is not None and lo < hi:
                spans[name].append((lo, hi - 1))
    spans["P"] += [(ord(c), ord(c)) for c in _DEFAULT_SYMBOLS]
    return {k: _ranges(v) for k, v in spans.items()}


def missing_byte_chars(vocab: Container[str]) -> str:
    r"""Regex class body of the characters whose UTF-8 holds a byte with no token.

    llama.cpp merges a piece's byte symbols and drops a symbol with no token after;
    such a symbol still stands between its neighbours, so no merge crosses it.
    ``tokenizers``' BPE drops it first and may merge across (SmolLM2 has no token for
    0x16: ``'"\x16{'`` gave ``'"{'``). Isolating those characters (after the
    pre-tokenizer's splits) keeps the merges apart. Bytes ``< 0x80`` are their own
    character; a lead byte stands for the code points it begins; a missing
    continuation byte (no vocabulary lacks one) is not handled.
    """
    b2u = bytes_to_unicode()
    spans: list[tuple[int, int]] = []
    for b in (b for b in range(256) if b2u[b] not in vocab):
        if b < 0x80:
            spans.append((b, b))
        for lead, bits, low, high in ((0xC2, 6, 0x80, 0x7FF), (0xE0, 12, 0x800, 0xFFFF),
                                      (0xF0, 18, 0x10000, 0x10FFFF)):  # fmt: skip
            top = 0xE0 if lead == 0xC2 else 0xF0 if lead == 0xE0 else 0xF5
            if lead <= b < top:
                first = (b & (0x3F >> (bits // 6))) << bits
                a, z = max(first, low), min(first | ((1 << bits) - 1), high)
                spans += [(lo, hi) for lo, hi in ((a, min(z, 0xD7FF)),
                          (max(a, 0xE000), z)) if lo <= hi]  # fmt: skip
    return _ranges(spans)


@functools.lru_cache(maxsize=1)
def gpt2_pattern() -> str:
    """The reference's GPT-2 pre-tokenizer as one Oniguruma regex (module docstring)."""
    c = _classes()
    s, letters, nums = f"[{c['S']}]", f"[{c['L']}]", f"[{c['N']}]"
    other = f"[^{c['S']}{c['L']}{c['N']}]"
    not_s = f"[^{c['S']}]"
    return (
        f"'s|'t|'re|'ve|'m|'ll|'d| ?{letters}+| ?{nums}+| ?{other}+"
        f"|{s}+(?!{not_s})|{s}+"
    )


@functools.lru_cache(maxsize=1)
def default_patterns() -> tuple[str, ...]:
    """The reference's ``default`` splits as Oniguruma regexes (`default_split`)."""
    c = _classes()
    return f"[{c['P']}]+", gpt2_pattern(), f"[{c['N']}]+", "[0-9]{3}"


__all__ = [
    "BPETokenizer",
    "bytes_to_unicode",
    "check_text",
    "check_tokenizer_metadata",
    "default_patterns",
    "default_split",
    "gpt2_split",
    "missing_byte_chars",
    "pre_tokenize",
]
