r"""A fast tokenizer (Hugging Face ``tokenizers``, in Rust) equal to `BPETokenizer`.

`entrenar.io.BPETokenizer` is the pure-Python reference, checked against llama.cpp.
`FastTokenizer` builds the same byte-level BPE in Hugging Face ``tokenizers`` from the
same GGUF fields (``tokenizer.ggml.tokens``, ``merges``, ``token_type``, ``pre``,
``bos/eos_token_id``) and returns the same ids:

- **Specials.** Control tokens (type 3) are ``AddedToken(special=True)``, parsed only
  with ``special=True`` (otherwise ``encode_special_tokens`` makes them plain text);
  user-defined tokens (type 4) are plain added tokens, always parsed.
- **Pre-tokenizer.** The GPT-2 regex, with its classes spelt out from llama.cpp's
  Unicode table (`entrenar.io.unicode_classes`) so that both tokenizers and llama.cpp
  use one table: ``'s|'t|'re|'ve|'m|'ll|'d| ?L+| ?N+| ?P+|S+(?!\S)|S+`` where ``S``
  is llama.cpp's whitespace set, ``L`` letters, ``N`` numbers and ``P`` everything
  else (unassigned code points too: llama.cpp flags them ``UNDEFINED``). The
  ``smollm``/``starcoder`` family first isolates every ``N`` character; ``default``
  (a file without ``pre`` too) splits by llama.cpp's four default regexes in turn
  (`entrenar.io.tokenizer.default_split`).
- **Bytes and merges.** ``ByteLevel`` maps bytes to GPT-2's printable symbols; the
  ``BPE`` model merges the lowest-ranked pair, leftmost first, like the reference.

Text with lone surrogates (not valid Unicode) cannot be passed to ``tokenizers``:
`encode` raises a `FormatError` naming the text and the character.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from typing import Any

from entrenar.errors import FormatError, UnsupportedError
from entrenar.io.gguf_reader import GGUFFile, read_gguf
from entrenar.io.hf_tokenizer import HFTokenizer, RustTokenizer
from entrenar.io.tokenizer import (
    _DEFAULT_PRE,
    _DIGIT_SPLIT_PRE,
    _GPT2_PRE,
    CONTROL,
    SPECIAL_TYPES,
    USER_DEFINED,
    BPETokenizer,
    _classes,
    bytes_to_unicode,
    default_patterns,
    gpt2_pattern,
    missing_byte_chars,
)


def token_bytes(tokens: Sequence[str], token_types: Sequence[int]) -> list[bytes]:
    """The bytes each token stands for (control/user tokens: their UTF-8 text).

    Byte-level BPE is lossless, so the byte lengths of a text's tokens add up to the
    UTF-8 length of the text; `entrenar.data.formatting` uses this to find which
    tokens fall inside a completion.
    """
    u2b = {u: b for b, u in bytes_to_unicode().items()}
    out = []
    for tok, kind in zip(tokens, token_types):
        if kind in (CONTROL, USER_DEFINED) or any(ch not in u2b for ch in tok):
            out.append(tok.encode("utf-8"))
        else:
            out.append(bytes(u2b[ch] for ch in tok))
    return out


class FastTokenizer(RustTokenizer):
    """`BPETokenizer`'s ids at Rust speed (Hugging Face ``tokenizers``).

    Args:
        reference: the `BPETokenizer` whose fields (vocabulary, merges, token types,
            pre-tokenizer, BOS/EOS) define this one.
        chat_template: the model's Jinja chat template (``tokenizer.chat_template``),
            or None.
        pad_id: padding id (``tokenizer.ggml.padding_token_id``), or None.

    Attributes mirror the reference: ``tokens``, ``token_types``, ``bos_id``,
    ``eos_id``, ``add_bos``, plus ``pad_id`` and ``chat_template``.
    """

    def __init__(
        self,
        reference: BPETokenizer,
        *,
        chat_template: str | None = None,
        pad_id: int | None = None,
    ) -> None:
        try:
            import tokenizers as hf
        except ImportError as e:  # pragma: no cover - depends on the environment
            raise UnsupportedError(
                "the fast tokenizer needs Hugging Face tokenizers: pip install "
                "'entrenar[data]' (or use entrenar.io.BPETokenizer)"
            ) from e
        if reference.pre not in _GPT2_PRE:
            raise UnsupportedError(
                f"pre-tokenizer {reference.pre!r} is not supported; supported: "
                f"{sorted(_GPT2_PRE)}"
            )
        self.reference = reference
        self.tokens, self.token_types = reference.tokens, reference.token_types
        self.bos_id, self.eos_id = reference.bos_id, reference.eos_id
        self.add_bos, self.pre = reference.add_bos, reference.pre
        self.chat_template, self.pad_id = chat_template, pad_id
        vocab = {t: i for i, t in enumerate(reference.tokens)}
        if len(vocab) != len(reference.tokens):
            raise FormatError("tokenizer.ggml.tokens has duplicate tokens")
        merges = []
        for r, m in enumerate(reference.merges):
            a, sep, b = m.partition(" ")
            if not sep or a not in vocab or b not in vocab or a + b not in vocab:
                raise FormatError(
                    f"tokenizer.ggml.merges[{r}] {m!r} is not 'a b' over the "
                    "vocabulary with 'ab' in it"
                )
            merges.append((a, b))
        pre = hf.pre_tokenizers
        steps: list[Any] = [pre.Split(hf.Regex(gpt2_pattern()), behavior="isolated")]
        if reference.pre in _DIGIT_SPLIT_PRE:
            digit = hf.Regex(f"[{_classes()['N']}]")
            steps.insert(0, pre.Split(digit, behavior="isolated"))
        if reference.pre in _DEFAULT_PRE:
            steps = [
                pre.Split(hf.Regex(r), behavior="isolated") for r in default_patterns()
            ]
        missing = missing_byte_chars(vocab)
        if missing:
            steps.append(pre.Split(hf.Regex(f"[{missing}]"), behavior="isolated"))
        steps.append(pre.ByteLevel(add_prefix_space=False, use_regex=False))
        self._hf: list[Any] = []
        for parse_special in (False, True):
            t = hf.Tokenizer(hf.models.BPE(vocab, merges))
            t.pre_tokenizer = pre.Sequence(steps)
            t.decoder = hf.decoders.ByteLevel()
            for kinds, add in (
                (SPECIAL_TYPES, t.add_special_tokens),
                ((USER_DEFINED,), t.add_tokens),
            ):
                add(
                    [
                        hf.AddedToken(tok, special=k != USER_DEFINED, normalized=False)
                        for tok, k in zip(reference.tokens, reference.token_types)
                        if k in kinds
                    ]
                )
            t.encode_special_tokens = not parse_special
            self._hf.append(t)

    @classmethod
    def from_gguf(cls, path: str | os.PathLike[str] | GGUFFile) -> FastTokenizer:
        """The tokenizer (and chat template) of a GGUF file."""
        g = path if isinstance(path, GGUFFile) else read_gguf(path)
        md = g.metadata
        ref = BPETokenizer.from_gguf_metadata(md, g.path)
        template = md.get("tokenizer.chat_template")
        pad = md.get("tokenizer.ggml.padding_token_id")
        return cls(
            ref,
            chat_template=template if isinstance(template, str) else None,
            pad_id=None if pad is None else int(pad),
        )

    @functools.cached_property
    def token_bytes(self) -> list[bytes]:
        """Bytes of each token id (see `token_bytes`)."""
        return token_bytes(self.tokens, self.token_types)

    def hf_json(self) -> str:
        """This tokenizer as a Hugging Face ``tokenizer.json`` (the same ids).

        Control tokens are special added tokens, so ``transformers`` parses them in
        text as ``encode(special=True)`` does; with ``add_bos`` the post-processor
        puts BOS first.
        """
        import tokenizers as hf

        t = hf.Tokenizer.from_str(self._hf[1].to_str())
        if self.add_bos and self.bos_id is not None:
            bos = self.tokens[self.bos_id]
            t.post_processor = hf.processors.TemplateProcessing(
                single=f"{bos} $A",
                pair=f"{bos} $A {bos} $B",
                special_tokens=[(bos, int(self.bos_id))],
            )
        return str(t.to_str())


def load_fast_tokenizer(
    path: str | os.PathLike[str] | GGUFFile,
) -> FastTokenizer | HFTokenizer:
    """The tokenizer of a GGUF file, or of a Hugging Face folder.

    A ``.gguf`` (or a `GGUFFile`) gives `FastTokenizer.from_gguf`, or
    `entrenar.io.HFTokenizer.from_gguf` for the fields FastTokenizer does not read
    (SentencePiece-style ``llama``, ``pre`` ``llama-bpe``/``qwen2``); a folder, or a
    ``tokenizer.json`` in one, gives `entrenar.io.HFTokenizer.from_folder` (its
    ``tokenizer_config.json``, chat template and generation config with it).
    """
    if not isinstance(path, GGUFFile):
        p = os.fspath(path)
        if os.path.isdir(p):
            return HFTokenizer.from_folder(p)
        if os.path.basename(p) == "tokenizer.json":
            return HFTokenizer.from_folder(os.path.dirname(p) or ".")
        path = read_gguf(p)
    model, pre = (path.metadata.get(f"tokenizer.ggml.{k}") for k in ("model", "pre"))
    if model == "llama" or (model == "gpt2" and pre in ("llama-bpe", "qwen2")):
        return HFTokenizer.from_gguf(path)
    return FastTokenizer.from_gguf(path)


__all__ = ["FastTokenizer", "gpt2_pattern", "load_fast_tokenizer", "token_bytes"]
