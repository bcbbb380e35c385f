"""A Hugging Face folder's tokenizer: ``tokenizer.json`` and ``tokenizer_config.json``.

`HFTokenizer` answers the tokenizer protocol the rest of entrenar uses
(`entrenar.data.FastTokenizer`'s: ``tokens``, ``token_types``, ``bos_id``,
``eos_id``, ``pad_id``, ``add_bos``, ``chat_template``, ``encode``,
``encode_batch``, ``decode``, ``token_bytes``) for any tokenizer the Hugging Face
``tokenizers`` library runs (byte-level BPE as in Llama 3 and Qwen, SentencePiece-style
BPE with byte fallback as in Mistral, Gemma and Phi-3), with the ids
``transformers.AutoTokenizer`` gives:

- **Files.** ``tokenizer.json`` (at most `MAX_TOKENIZER_BYTES`) is the tokenizer;
  ``tokenizer_config.json`` (optional) names the special tokens (``bos_token``,
  ``eos_token``, ``pad_token``: a string or ``{"content": ...}``), ``add_bos_token``
  and the ``chat_template`` (a string, or a list of ``{"name", "template"}`` whose
  ``default`` is taken); a ``chat_template.jinja`` file, as newer ``transformers``
  writes, wins over it. ``special_tokens_map.json`` fills in special tokens the config
  lacks; ``generation_config.json``'s ``eos_token_id`` (an id or a list) gives
  `stop_ids`.
- **Token types** (llama.cpp's numbering): special added tokens are control (3),
  other added tokens user-defined (4), ``<0xNN>`` byte-fallback tokens byte (6), the
  rest normal (1).
- **BOS.** ``add_bos`` is ``add_bos_token`` when the config says, else whether the
  tokenizer's post-processor puts the BOS token first. `encode` adds it itself and
  never runs the post-processor (EOS is added by the data pipeline).
- **Specials in text** parse only with ``special=True``, as in `FastTokenizer`
  (``encode_special_tokens`` underneath); ``AutoTokenizer`` always parses them.

`tokenizer_files` gives the files of any entrenar tokenizer (this one, or a GGUF's
`FastTokenizer`) for a Hugging Face folder that ``AutoTokenizer.from_pretrained``
loads.
"""

from __future__ import annotations

import functools
import json
import os
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from entrenar.errors import FormatError, UnsupportedError
from entrenar.io.bounded import MAX_CONFIG_BYTES, parse_json, read_json, read_text
from entrenar.io.gguf_reader import GGUFFile, read_gguf
from entrenar.io.tokenizer import (
    CONTROL,
    UNUSED,
    USER_DEFINED,
    bytes_to_unicode,
    check_text,
    check_tokenizer_metadata,
)

MAX_TOKENIZER_BYTES = 64 << 20
"""Largest ``tokenizer.json`` read (Gemma 3's is 33 MB)."""
MAX_TEMPLATE_BYTES = 1 << 20
"""Largest ``chat_template.jinja`` read."""
NORMAL, BYTE = 1, 6
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")
SPECIAL_NAMES = ("bos", "eos", "pad", "unk")


def _token_text(value: Any, where: str) -> str | None:
    """A special token as tokenizer_config has it: a string, ``{"content"}``, null."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return str(value["content"])
    raise FormatError(f"{where}: want a token string or {{'content': str}}")


def _processor_template(folder: str) -> str | None:
    """The template of a processor's ``chat_template.json``, or None without one.

    Vision-language folders (Gemma 3, Mistral 3) written before
    ``chat_template.jinja`` keep the processor's template there,
    ``{"chat_template": "..."}``; transformers' processor reads it when neither
    the ``.jinja`` file nor the tokenizer config has one.
    """
    path = os.path.join(folder, "chat_template.json")
    if not os.path.isfile(path):
        return None
    value = _optional_json(path).get("chat_template")
    return _template(value, f"{path}: chat_template")


def _template(value: Any, where: str) -> str | None:
    """``chat_template``: a string, or the ``default`` of a list of named ones."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {
            t.get("name"): t.get("template") for t in value if isinstance(t, Mapping)
        }
        chosen = named.get("default")
        if isinstance(chosen, str):
            return chosen
    raise FormatError(
        f"{where}: want a template string or a list of {{'name', 'template'}} with "
        "a 'default'"
    )


def _optional_json(path: str) -> dict[str, Any]:
    """A small JSON object file, or ``{}`` when the file is absent."""
    if not os.path.isfile(path):
        return {}
    value = read_json(path, max_bytes=MAX_CONFIG_BYTES)
    if not isinstance(value, dict):
        raise FormatError(f"{path}: want a JSON object")
    return value


def _check_merge_prefix(model: Mapping[str, Any], where: str) -> None:
    """Check that each BPE merge's second part starts with the subword prefix.

    With a ``continuing_subword_prefix`` P, ``tokenizers`` joins a merge ``(a, b)``
    into ``a + b[len(P):]`` (bytes) without checking that ``b`` starts with P: a
    shorter ``b`` panics in Rust, and a cut inside a character aborts the process.

    Raises:
        FormatError: the first merge whose second part lacks the prefix.
    """
    prefix, merges = model.get("continuing_subword_prefix"), model.get("merges")
    if not isinstance(prefix, str) or not prefix or not isinstance(merges, list):
        return
    for i, merge in enumerate(merges):
        if isinstance(merge, str):
            second: Any = merge.split(" ", 1)[-1]
        elif isinstance(merge, list) and len(merge) == 2:
            second = merge[1]
        else:
            continue  # tokenizers refuses it itself
        if isinstance(second, str) and not second.startswith(prefix):
            raise FormatError(
                f"{where}: model.merges[{i}] = {str(merge)[:60]!r}: its second part "
                f"does not start with model.continuing_subword_prefix "
                f"{prefix[:40]!r}; fix the merges or remove the prefix"
            )


def eos_ids_of(generation: Mapping[str, Any], where: str) -> tuple[int, ...]:
    """``eos_token_id`` of a ``generation_config.json`` dict: an id or a list."""
    value = generation.get("eos_token_id")
    values = value if isinstance(value, list) else [] if value is None else [value]
    if not all(type(v) is int and v >= 0 for v in values):
        raise FormatError(
            f"{where}: 'eos_token_id' = {value!r:.60}, want an id or a list of ids"
        )
    return tuple(values)


def _rust_call(run: Callable[[], Any], texts: Sequence[Any]) -> Any:
    """``run()``, its TypeError on a text that is no valid Unicode made clear.

    ``tokenizers`` says ``TextInputSequence must be str`` for a lone surrogate (or a
    non-string); the `FormatError` names the text and the character.
    """
    try:
        return run()
    except TypeError:
        for i, t in enumerate(texts):
            if not isinstance(t, str):
                raise FormatError(
                    f"text {i} is a {type(t).__name__}, want a str"
                ) from None
            check_text(t, i)
        raise


class RustTokenizer:
    """Encoding and decoding through Hugging Face ``tokenizers`` (in Rust).

    The part of the tokenizer protocol `HFTokenizer` and
    `entrenar.data.FastTokenizer` share. A subclass sets ``tokens``, ``bos_id``,
    ``add_bos`` and ``_hf``: two ``tokenizers.Tokenizer``, the first with
    ``encode_special_tokens`` (special tokens in text stay text), the second
    parsing them (``special=True``).
    """

    tokens: Sequence[str]
    token_types: Sequence[int]
    bos_id: int | None
    add_bos: bool
    _hf: list[Any]

    @property
    def vocab_size(self) -> int:
        """Number of token ids (holes included)."""
        return len(self.tokens)

    def _bos(self, add_bos: bool | None) -> list[int]:
        add = self.add_bos if add_bos is None else add_bos
        return [int(self.bos_id)] if add and self.bos_id is not None else []

    def encode(
        self, text: str, *, add_bos: bool | None = None, special: bool = False
    ) -> list[int]:
        """Token ids of ``text`` (BOS by ``add_bos``, default `add_bos`)."""
        t = self._hf[bool(special)]
        enc = _rust_call(lambda: t.encode(text, add_special_tokens=False), [text])
        return self._bos(add_bos) + list(enc.ids)

    def encode_batch(
        self,
        texts: Sequence[str],
        *,
        add_bos: bool | None = None,
        special: bool = False,
    ) -> list[list[int]]:
        """`encode` of each text, in parallel threads (Rust's rayon)."""
        t = self._hf[bool(special)]
        # encode_batch_fast (tokenizers >= 0.20) skips the character offsets.
        run = getattr(t, "encode_batch_fast", t.encode_batch)
        bos = self._bos(add_bos)
        texts = list(texts)
        encs = _rust_call(lambda: run(texts, add_special_tokens=False), texts)
        return [bos + list(e.ids) for e in encs]

    def decode(self, ids: Sequence[int] | np.ndarray, *, special: bool = False) -> str:
        """Text of ``ids`` (special tokens dropped unless ``special``).

        Unused tokens (type 5: a GGUF's ``[PAD{i}]`` padding) decode to nothing, as
        in llama.cpp.
        """
        ids = [int(i) for i in ids]
        for i in ids:
            if not 0 <= i < len(self.tokens):
                raise FormatError(f"token id {i} is outside the vocabulary")
        types = self.token_types
        ids = [i for i in ids if types[i] != UNUSED]
        return str(self._hf[0].decode(ids, skip_special_tokens=not special))


class HFTokenizer(RustTokenizer):
    """A ``tokenizers`` tokenizer with entrenar's tokenizer protocol (module doc).

    Args:
        text: the ``tokenizer.json`` text.
        config: the ``tokenizer_config.json`` dict (``{}`` when there is none).
        source: the file the errors name.
        chat_template: overrides the config's template.
        stop_ids: extra ids that end a reply (``generation_config.json``).

    Raises:
        FormatError: a tokenizer.json ``tokenizers`` cannot load, or a special token
            the vocabulary lacks.
    """

    def __init__(
        self,
        text: str,
        config: Mapping[str, Any] | None = None,
        *,
        source: str = "tokenizer.json",
        chat_template: str | None = None,
        stop_ids: Sequence[int] = (),
    ) -> None:
        try:
            import tokenizers as hf
        except ImportError as e:  # pragma: no cover - depends on the environment
            raise UnsupportedError(
                "a Hugging Face tokenizer.json needs tokenizers: pip install "
                "'entrenar[data]'"
            ) from e
        doc = parse_json(text, source, max_depth=None)
        if not isinstance(doc, dict) or not isinstance(doc.get("model"), dict):
            raise FormatError(f"{source}: not a tokenizers file (no 'model' object)")
        _check_merge_prefix(doc["model"], source)
        try:
            self._hf = [hf.Tokenizer.from_str(text) for _ in range(2)]
        except Exception as e:  # tokenizers raises plain Exceptions
            raise FormatError(f"{source}: tokenizers cannot load it ({e})") from None
        except BaseException as e:  # a Rust panic is a BaseException (pyo3)
            if type(e).__name__ != "PanicException":
                raise
            raise FormatError(f"{source}: tokenizers cannot load it ({e})") from None
        for parse_special, t in enumerate(self._hf):
            t.encode_special_tokens = not parse_special
        self.source, self.text = source, text
        self.config = dict(config or {})
        cfg_where = f"{os.path.dirname(source) or '.'}/tokenizer_config.json"
        t = self._hf[0]
        n = t.get_vocab_size(with_added_tokens=True)
        added = t.get_added_tokens_decoder()
        n = max([n, *(i + 1 for i in added)])
        self.tokens: list[str] = [t.id_to_token(i) or "" for i in range(n)]
        self.byte_level = "ByteLevel" in json.dumps(doc.get("decoder"))
        types = [NORMAL] * n
        for i, tok in enumerate(self.tokens):
            if not self.byte_level and _BYTE_TOKEN.fullmatch(tok):
                types[i] = BYTE
        for i, a in added.items():
            types[i] = CONTROL if a.special else USER_DEFINED
        self.token_types = types
        ids: dict[str, int | None] = {}
        for name in SPECIAL_NAMES:
            text_ = _token_text(self.config.get(f"{name}_token"), cfg_where)
            ids[name] = None if text_ is None else t.token_to_id(text_)
            if text_ is not None and ids[name] is None:
                raise FormatError(
                    f"{cfg_where}: {name}_token {text_!r} is not in the vocabulary "
                    f"of {source}"
                )
        self.bos_id, self.eos_id, self.pad_id = ids["bos"], ids["eos"], ids["pad"]
        self.unk_id = ids["unk"]
        if self.unk_id is None and isinstance(doc["model"].get("unk_token"), str):
            self.unk_id = t.token_to_id(doc["model"]["unk_token"])
        add_bos = self.config.get("add_bos_token")
        if not isinstance(add_bos, bool):
            add_bos = self._post_processor_adds("bos")
        self.add_bos = add_bos
        add_eos = self.config.get("add_eos_token")
        if not isinstance(add_eos, bool):
            add_eos = self._post_processor_adds("eos")
        self.add_eos = add_eos and self.eos_id is not None
        template = _template(self.config.get("chat_template"), cfg_where)
        self.chat_template = chat_template or template
        self.stop_ids = tuple(int(i) for i in stop_ids if 0 <= int(i) < n)
        self.pre = "hf"

    def _post_processor_adds(self, which: str) -> bool:
        """Whether the post-processor puts BOS first (``"bos"``) or EOS last."""
        i = getattr(self, f"{which}_id")
        ids = self._hf[1].encode("a", add_special_tokens=True).ids
        return i is not None and bool(ids) and ids[0 if which == "bos" else -1] == i

    @classmethod
    def from_folder(cls, folder: str | os.PathLike[str]) -> HFTokenizer:
        """The tokenizer of a Hugging Face folder (its files: module docstring).

        Raises:
            FormatError: no ``tokenizer.json``, or a file that does not parse.
        """
        folder = os.fspath(folder)
        path = os.path.join(folder, "tokenizer.json")
        if not os.path.isfile(path):
            raise FormatError(
                f"{folder}: no tokenizer.json; entrenar reads Hugging Face fast "
                "tokenizers (tokenizer.json), or give model.tokenizer"
            )
        text = read_text(path, max_bytes=MAX_TOKENIZER_BYTES, what="tokenizer file")
        config = _optional_json(os.path.join(folder, "special_tokens_map.json"))
        config |= _optional_json(os.path.join(folder, "tokenizer_config.json"))
        jinja = os.path.join(folder, "chat_template.jinja")
        template = None
        if os.path.isfile(jinja):
            template = read_text(jinja, max_bytes=MAX_TEMPLATE_BYTES, what="template")
        elif config.get("chat_template") is None:
            template = _processor_template(folder)
        gen_path = os.path.join(folder, "generation_config.json")
        stop = eos_ids_of(_optional_json(gen_path), gen_path)
        return cls(text, config, source=path, chat_template=template, stop_ids=stop)

    @classmethod
    def from_gguf(cls, path: str | os.PathLike[str] | GGUFFile) -> HFTokenizer:
        """The tokenizer of a GGUF's ``tokenizer.*`` fields, with llama.cpp's ids.

        For the fields `FastTokenizer` does not read: ``tokenizer.ggml.model``
        ``llama`` (SentencePiece-style) and the ``pre`` names of
        `entrenar.io.gguf_tokenizer.PRE_TOKENIZERS` (``llama-bpe``, ``qwen2``).

        Raises:
            UnsupportedError: another tokenizer model or pre-tokenizer.
        """
        from entrenar.io.gguf_tokenizer import hf_config_from_gguf, hf_json_from_gguf

        g = path if isinstance(path, GGUFFile) else read_gguf(path)
        md = g.metadata
        merges = md.get("tokenizer.ggml.merges", [])  # SentencePiece has none
        check_tokenizer_metadata({**md, "tokenizer.ggml.merges": merges}, g.path)
        text = hf_json_from_gguf(g.metadata, g.path)
        tok = cls(text, hf_config_from_gguf(g.metadata), source=g.path)
        tok.pre = str(g.metadata.get("tokenizer.ggml.pre", "default"))
        types = md.get("tokenizer.ggml.token_type")
        if types is not None:  # unknown (2) and unused (5) too, as the file has them
            tok.token_types = [*map(int, types), *tok.token_types[len(types) :]]
        return tok

    @functools.cached_property
    def token_bytes(self) -> list[bytes]:
        """Bytes each token id stands for (``▁`` a space, ``<0xNN>`` the byte)."""
        if self.byte_level:
            u2b = {u: b for b, u in bytes_to_unicode().items()}
        out = []
        for tok, kind in zip(self.tokens, self.token_types):
            if kind == BYTE:
                out.append(bytes([int(tok[3:5], 16)]))
            elif kind in (CONTROL, USER_DEFINED):
                out.append(tok.encode("utf-8"))
            elif self.byte_level and all(ch in u2b for ch in tok):
                out.append(bytes(u2b[ch] for ch in tok))
            else:
                out.append(tok.replace("\u2581", " ").encode("utf-8"))
        return out

    def encode_offsets_batch(
        self,
        texts: Sequence[str],
        *,
        add_bos: bool | None = None,
        special: bool = False,
    ) -> list[tuple[list[int], list[tuple[int, int]]]]:
        """`encode_batch` with each token's ``(start, end)`` character span.

        The spans index the text as given (``tokenizers`` maps them back through
        its normalizer), so labels can be aligned for tokenizers whose tokens do not
        spell the text byte for byte (SentencePiece's ``▁``, a prepended space, byte
        fallback). A BOS added here (by ``add_bos``, default `add_bos`) spans
        ``(0, 0)``.
        """
        t = self._hf[bool(special)]
        bos = self._bos(add_bos)
        out = []
        texts = list(texts)
        encs = _rust_call(
            lambda: t.encode_batch(texts, add_special_tokens=False), texts
        )
        for e in encs:
            spans = [(int(a), int(b)) for a, b in e.offsets]
            out.append((bos + list(e.ids), [(0, 0)] * len(bos) + spans))
        return out

    def hf_json(self) -> str:
        """The ``tokenizer.json`` text it was read from."""
        return self.text


def tokenizer_files(tok: Any, *, max_length: int | None = None) -> dict[str, str]:
    """``{file name: text}`` of a Hugging Face folder's tokenizer for ``tok``.

    ``tok`` is an `HFTokenizer` or a GGUF's `entrenar.data.FastTokenizer`:
    ``tokenizer.json``, and ``tokenizer_config.json`` with the special tokens,
    ``add_bos_token`` and the chat template (also in ``chat_template.jinja``), so
    that ``transformers.AutoTokenizer.from_pretrained`` gives its ids.
    """
    text = tok.hf_json()
    config: dict[str, Any] = {}
    base = getattr(tok, "config", {})
    for key in ("clean_up_tokenization_spaces", "model_max_length", "padding_side"):
        if key in base:
            config[key] = base[key]
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    for name in ("bos", "eos", "pad"):
        i = getattr(tok, f"{name}_id", None)
        config[f"{name}_token"] = None if i is None else tok.tokens[int(i)]
    unk = base.get("unk_token")
    if unk is not None:
        config["unk_token"] = unk
    config["add_bos_token"] = bool(tok.add_bos and tok.bos_id is not None)
    config["add_eos_token"] = False
    if max_length is not None and "model_max_length" not in config:
        config["model_max_length"] = max_length
    files = {"tokenizer.json": text}
    if tok.chat_template:
        config["chat_template"] = tok.chat_template
        files["chat_template.jinja"] = tok.chat_template
    files["tokenizer_config.json"] = json.dumps(config, indent=2, ensure_ascii=False)
    return files


__all__ = [
    "MAX_TOKENIZER_BYTES",
    "HFTokenizer",
    "RustTokenizer",
    "eos_ids_of",
    "tokenizer_files",
]
