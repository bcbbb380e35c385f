r"""A Hugging Face tokenizer as llama.cpp's GGUF tokenizer fields, and back.

`gguf_tokenizer_fields` gives the ``tokenizer.*`` fields llama.cpp's
``convert_hf_to_gguf.py`` writes for a ``tokenizer.json``, so that a GGUF exported
from a Hugging Face folder runs in llama.cpp:

- **Byte-level BPE** (Llama 3, Qwen2/3, SmolLM): ``tokenizer.ggml.model`` ``gpt2``;
  ``tokens`` as the vocabulary spells them (GPT-2 byte symbols), ``merges`` as
  ``"a b"`` in rank order, ``token_type``. llama.cpp names its pre-tokenizer
  (``tokenizer.ggml.pre``) by a hash of test text in the converter; here it is
  chosen by the ``pre_tokenizer`` itself (`PRE_TOKENIZERS`: the GPT-2 regex of
  ``ByteLevel`` is ``gpt-2``, digits split first ``smollm``, the Llama 3 split
  regex ``llama-bpe``, Qwen2's ``qwen2``); any other is refused.
- **SentencePiece-style BPE** (``▁`` for spaces, ``<0xNN>`` byte fallback: Mistral,
  Llama 2, Phi-3, Gemma): ``tokenizer.ggml.model`` ``llama`` with ``tokens``,
  ``scores`` and ``token_type``. llama.cpp merges any adjacent pair whose
  concatenation is a token, highest score first, so a token's score is minus the
  rank of the merge that makes it; ``add_space_prefix`` says whether a ``▁`` is
  prepended (a ``Prepend`` normalizer or a ``Metaspace`` that prepends).
- **Both:** token types (normal 1, unused 5 for holes, control 3, user-defined 4,
  byte 6), ``bos``/``eos``/``unknown``/``padding`` ids, ``add_bos_token``,
  ``add_eos_token`` and ``tokenizer.chat_template``.

`hf_json_from_gguf` goes the other way (a ``tokenizer.json`` giving llama.cpp's ids
for those fields), which `entrenar.io.HFTokenizer.from_gguf` reads.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from entrenar.errors import FormatError, UnsupportedError
from entrenar.io.gguf_reader import GGUFField, GGUFValueType
from entrenar.io.tokenizer import (
    CONTROL,
    SPECIAL_TYPES,
    USER_DEFINED,
    _classes,
    default_patterns,
    gpt2_pattern,
    missing_byte_chars,
)

NORMAL, UNUSED, BYTE = 1, 5, 6
SPACE = "\u2581"
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_HF_CONTRACTIONS = "(?i:'s|'t|'re|'ve|'m|'ll|'d)"
_WORDS = r"|[^\r\n\p{L}\p{N}]?\p{L}+|"
_REST = r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
LLAMA3_REGEX = _CONTRACTIONS + _WORDS + r"\p{N}{1,3}" + _REST
"""Llama 3's split regex, as llama.cpp spells it (``llama-bpe``)."""
QWEN2_REGEX = _CONTRACTIONS + _WORDS + r"\p{N}" + _REST
LLAMA3_PRE = ("llama3", "llama-v3", "llama-bpe")
"""Llama 3's ``pre`` names, for which llama.cpp adds BOS unless the file says not."""
"""Qwen2's split regex, as llama.cpp spells it (``qwen2``)."""


@dataclass(frozen=True)
class PreTokenizer:
    """A llama.cpp pre-tokenizer: its split regex (None: ByteLevel's GPT-2 regex)."""

    regex: str | None
    digits: bool = False  # every digit its own piece first
    ignore_merges: bool = False  # llama.cpp takes a whole piece in the vocabulary


PRE_TOKENIZERS = {
    "gpt-2": PreTokenizer(None),
    "smollm": PreTokenizer(None, digits=True),
    "llama-bpe": PreTokenizer(LLAMA3_REGEX, ignore_merges=True),
    "qwen2": PreTokenizer(QWEN2_REGEX),
}
"""``tokenizer.ggml.pre`` names written for byte-level BPE, with their rules."""


def _steps(node: Any) -> list[dict[str, Any]]:
    """A ``pre_tokenizer``/``normalizer`` as a flat list of steps."""
    if node is None:
        return []
    if node.get("type") == "Sequence":
        key = "pretokenizers" if "pretokenizers" in node else "normalizers"
        return [s for sub in node.get(key, []) for s in _steps(sub)]
    return [node]


def _regex_of(step: Mapping[str, Any]) -> str | None:
    """The regex of a ``Split`` step, in llama.cpp's spelling."""
    pattern = step.get("pattern", {})
    regex = pattern.get("Regex") if isinstance(pattern, Mapping) else None
    if not isinstance(regex, str):
        return None
    return regex.replace(_HF_CONTRACTIONS, _CONTRACTIONS)


def _isolates(step: Mapping[str, Any]) -> bool:
    """A ``Split`` step that keeps each match as a piece."""
    isolated = step.get("behavior") == "Isolated" and not step.get("invert")
    return step.get("type") == "Split" and isolated


def _without_missing_split(regexes: list[str | None], vocab: Any) -> list[str | None]:
    """``regexes`` less a last split of `missing_byte_chars` (entrenar adds it)."""
    missing = missing_byte_chars(vocab if isinstance(vocab, Mapping) else {})
    if missing and regexes and regexes[-1] == f"[{missing}]":
        return regexes[:-1]
    return regexes


def _entrenar_split(regexes: list[str | None]) -> str | None:
    """``gpt-2``, ``smollm`` or ``default`` for `FastTokenizer.hf_json`'s splits.

    `entrenar.data.FastTokenizer` spells GPT-2's regex (and the digits, and the
    ``default`` splits) with their character classes listed.
    """
    if regexes == [gpt2_pattern()]:
        return "gpt-2"
    if regexes == [f"[{_classes()['N']}]", gpt2_pattern()]:
        return "smollm"
    if regexes == list(default_patterns()):
        return "default"
    return None


def pre_tokenizer_name(doc: Mapping[str, Any], where: str = "tokenizer.json") -> str:
    """llama.cpp's name for a byte-level ``tokenizer.json``'s pre-tokenizer.

    Raises:
        UnsupportedError: a pre-tokenizer (or normalizer) llama.cpp has no name for.
    """
    steps = _steps(doc.get("pre_tokenizer"))
    kinds = [s.get("type") for s in steps]
    norm = [s.get("type") for s in _steps(doc.get("normalizer"))]
    name = None
    last = steps[-1] if steps else {}
    if kinds and kinds[-1] == "ByteLevel" and not last.get("add_prefix_space"):
        regex = last.get("use_regex", True)
        if kinds == ["ByteLevel"] and regex:
            name = "gpt-2"
        elif kinds == ["Digits", "ByteLevel"] and regex:
            name = "smollm" if steps[0].get("individual_digits") else None
        elif kinds[-2:] == ["Split", "ByteLevel"] and not regex:
            found = [_regex_of(s) for s in steps[:-1] if _isolates(s)]
            found = _without_missing_split(found, doc.get("model", {}).get("vocab"))
            for n, p in PRE_TOKENIZERS.items():
                name = n if found == [p.regex] else name
            name = name or _entrenar_split(found)
    if name is None or norm not in ([], ["NFC"]):
        raise UnsupportedError(
            f"{where}: pre-tokenizer {json.dumps(doc.get('pre_tokenizer'))[:300]} "
            f"(normalizer {norm}) matches no llama.cpp pre-tokenizer entrenar "
            f"writes ({sorted(PRE_TOKENIZERS)}); llama.cpp could not run the GGUF"
        )
    return name


def space_prefix(doc: Mapping[str, Any], where: str = "tokenizer.json") -> bool:
    """Whether a SentencePiece-style ``tokenizer.json`` prepends ``▁`` to the text.

    Raises:
        UnsupportedError: steps llama.cpp's SentencePiece tokenizer does not do.
    """
    norms = _steps(doc.get("normalizer"))
    pres = _steps(doc.get("pre_tokenizer"))
    prepend, escaped = False, False
    for s in norms:
        kind = s.get("type")
        if kind == "Prepend" and s.get("prepend") == SPACE:
            prepend = True
        elif kind == "Replace" and s.get("pattern") == {"String": " "}:
            if s.get("content") != SPACE:
                raise UnsupportedError(f"{where}: spaces become {s.get('content')!r}")
            escaped = True
        else:
            raise UnsupportedError(f"{where}: normalizer {kind} has no llama.cpp form")
    for s in pres:
        if s.get("type") != "Metaspace" or s.get("split", False):
            raise UnsupportedError(
                f"{where}: pre-tokenizer {json.dumps(s)[:200]} has no llama.cpp form "
                "(a Metaspace that does not split does)"
            )
        escaped = True
        scheme = s.get("prepend_scheme", "always" if s.get("add_prefix_space") else "")
        prepend = prepend or scheme in ("always", "first")
    if not escaped:
        raise UnsupportedError(f"{where}: spaces are not written as {SPACE!r}")
    return prepend


def _merge_pairs(doc: Mapping[str, Any], where: str) -> list[tuple[str, str]]:
    """``model.merges``: ``"a b"`` strings or ``[a, b]`` pairs, in rank order."""
    out = []
    for m in doc["model"].get("merges") or []:
        pair = m.split(" ", 1) if isinstance(m, str) else m
        if not (isinstance(pair, list) and len(pair) == 2):
            raise FormatError(f"{where}: merge {m!r} is not 'a b' or [a, b]")
        out.append((str(pair[0]), str(pair[1])))
    return out


def _arr(values: list[Any], item: GGUFValueType) -> GGUFField:
    return GGUFField(values, GGUFValueType.ARRAY, item)


def gguf_tokenizer_fields(
    tok: Any, *, vocab_size: int | None = None
) -> dict[str, GGUFField]:
    """The GGUF ``tokenizer.*`` fields of ``tok`` (module docstring).

    ``tok`` is an `entrenar.io.HFTokenizer`, or a GGUF's
    `entrenar.data.FastTokenizer` (its own fields again). With ``vocab_size`` (the
    model's embedding rows, which llama.cpp wants equal to the token count), the
    tokens are padded to it with unused ``[PAD{i}]`` tokens, as llama.cpp's
    converter does.

    Raises:
        FormatError: more tokens than ``vocab_size``.
        UnsupportedError: a tokenizer model or pre-tokenizer llama.cpp has no form for
            (WordPiece, Unigram, an unknown split regex).
    """
    S, U32 = GGUFValueType.STRING, GGUFValueType.UINT32
    ref = getattr(tok, "reference", None)
    fields: dict[str, GGUFField] = {}
    if ref is not None:  # a GGUF's FastTokenizer: its fields as they were
        fields["tokenizer.ggml.model"] = GGUFField("gpt2", S)
        pre = "gpt-2" if ref.pre == "gpt2" else ref.pre  # llama.cpp knows only this
        fields["tokenizer.ggml.pre"] = GGUFField(pre, S)
        fields["tokenizer.ggml.tokens"] = _arr(list(ref.tokens), S)
        fields["tokenizer.ggml.token_type"] = _arr(
            list(ref.token_types), GGUFValueType.INT32
        )
        fields["tokenizer.ggml.merges"] = _arr(list(ref.merges), S)
    else:
        fields = _hf_fields(tok)
    ids = {"bos": tok.bos_id, "eos": tok.eos_id, "padding": tok.pad_id}
    ids["unknown"] = getattr(tok, "unk_id", None)
    flags = {"bos": bool(tok.add_bos), "eos": bool(getattr(tok, "add_eos", False))}
    for name, i in ids.items():
        if i is not None:
            fields[f"tokenizer.ggml.{name}_token_id"] = GGUFField(int(i), U32)
    for name, flag in flags.items():
        fields[f"tokenizer.ggml.add_{name}_token"] = GGUFField(flag, GGUFValueType.BOOL)
    if tok.chat_template:
        fields["tokenizer.chat_template"] = GGUFField(tok.chat_template, S)
    if vocab_size is not None:
        _pad(fields, vocab_size)
    return fields


def _pad(fields: dict[str, GGUFField], vocab_size: int) -> None:
    """Pad tokens (and types, scores) to ``vocab_size`` with unused tokens."""
    n = len(fields["tokenizer.ggml.tokens"].value)
    if n > vocab_size:
        raise FormatError(
            f"the tokenizer has {n} tokens, more than the model's vocab_size "
            f"{vocab_size}; llama.cpp needs one embedding row per token"
        )
    extra = range(n, vocab_size)
    for key, more in (
        ("tokenizer.ggml.tokens", [f"[PAD{i}]" for i in extra]),
        ("tokenizer.ggml.token_type", [UNUSED] * len(extra)),
        ("tokenizer.ggml.scores", [0.0] * len(extra)),
    ):
        if key in fields:
            f = fields[key]
            fields[key] = GGUFField(list(f.value) + more, f.type, f.item_type)


def _hf_fields(tok: Any) -> dict[str, GGUFField]:
    """Model, pre, tokens, types and merges or scores of an `HFTokenizer`."""
    S = GGUFValueType.STRING
    doc = json.loads(tok.text)
    model, where = doc["model"], tok.source
    if model.get("type") != "BPE":
        raise UnsupportedError(
            f"{where}: a {model.get('type')} tokenizer; entrenar writes BPE ones "
            "(byte-level or SentencePiece-style) to GGUF"
        )
    holes = {i for i, t in enumerate(tok.tokens) if t == "" and i not in _ids(tok)}
    tokens = [f"[PAD{i}]" if i in holes else t for i, t in enumerate(tok.tokens)]
    types = [UNUSED if i in holes else k for i, k in enumerate(tok.token_types)]
    merges = _merge_pairs(doc, where)
    fields: dict[str, GGUFField] = {}
    if tok.byte_level:
        pre = pre_tokenizer_name(doc, where)
        fields["tokenizer.ggml.model"] = GGUFField("gpt2", S)
        fields["tokenizer.ggml.pre"] = GGUFField(pre, S)
    else:
        if not model.get("byte_fallback"):
            raise UnsupportedError(
                f"{where}: a SentencePiece-style BPE without byte_fallback; "
                "llama.cpp's tokenizer falls back to <0xNN> tokens"
            )
        prefix = space_prefix(doc, where)
        vocab = {t: i for i, t in enumerate(tok.tokens)}
        scores = [0.0] * len(tokens)
        for rank in reversed(range(len(merges))):  # the first merge making it
            made = vocab.get("".join(merges[rank]))
            if made is not None:
                scores[made] = -float(rank)
        fields["tokenizer.ggml.model"] = GGUFField("llama", S)
        fields["tokenizer.ggml.pre"] = GGUFField("default", S)
        fields["tokenizer.ggml.add_space_prefix"] = GGUFField(
            prefix, GGUFValueType.BOOL
        )
    fields["tokenizer.ggml.tokens"] = _arr(tokens, S)
    if not tok.byte_level:
        fields["tokenizer.ggml.scores"] = _arr(scores, GGUFValueType.FLOAT32)
    fields["tokenizer.ggml.token_type"] = _arr(types, GGUFValueType.INT32)
    if tok.byte_level:
        fields["tokenizer.ggml.merges"] = _arr([f"{a} {b}" for a, b in merges], S)
    return fields


def _byte_level(*, use_regex: bool) -> dict[str, Any]:
    """A ``ByteLevel`` pre-tokenizer or decoder step, no prefix space."""
    return dict(
        type="ByteLevel", add_prefix_space=False, trim_offsets=False,
        use_regex=use_regex,
    )  # fmt: skip


def _ids(tok: Any) -> set[int]:
    return {i for i in (tok.bos_id, tok.eos_id, tok.pad_id) if i is not None}


def _rstrip(md: Mapping[str, Any], tokens: list[str], types: list[int]) -> set[int]:
    """Tokens llama.cpp strips the whitespace after, by ``general.name``.

    GGUF has no per-token strip flags; llama.cpp gives a model whose name holds
    ``phi3`` or ``phi-3`` Phi-3's: every control and user-defined token but
    ``<unk>``, ``<s>`` and ``<|endoftext|>``, and ``</s>``.
    """
    name = str(md.get("general.name", "")).lower()
    if "phi3" not in name and "phi-3" not in name:
        return set()
    keep = {"<unk>", "<s>", "<|endoftext|>"}
    return {
        i
        for i, (t, k) in enumerate(zip(tokens, types))
        if (k in (CONTROL, USER_DEFINED) and t not in keep) or t == "</s>"
    }


def _added(tokens: list[str], types: list[int], rstrip: set[int]) -> list[Any]:
    """``added_tokens`` of a tokenizer.json: control, unknown and user-defined tokens.

    Unknown ones (type 2, ``<unk>`` in a converted Llama 2) are special like control
    ones: llama.cpp parses them in text only with ``special`` and decodes them only
    with it.
    """
    return [
        {"id": i, "content": t, "single_word": False, "lstrip": False,
         "rstrip": i in rstrip, "normalized": False, "special": k != USER_DEFINED}
        for i, (t, k) in enumerate(zip(tokens, types))
        if k in (*SPECIAL_TYPES, USER_DEFINED)
    ]  # fmt: skip


def _spm_merges(tokens: list[str], types: list[int], scores: list[float]) -> list[Any]:
    """Merges giving llama.cpp's SentencePiece ids: every split of every normal token.

    A token made of two tokens ``a + b`` is a merge ``[a, b]``; merges are ranked by
    the made token's score, highest first.
    """
    vocab = {t: i for i, t in enumerate(tokens) if types[i] == NORMAL}
    merges = []
    for t, i in vocab.items():
        for cut in range(1, len(t)):
            a, b = t[:cut], t[cut:]
            if a in vocab and b in vocab:
                merges.append((-scores[i], vocab[a], vocab[b], a, b))
    merges.sort()
    return [[a, b] for *_, a, b in merges]


def hf_json_from_gguf(md: Mapping[str, Any], where: str = "<gguf>") -> str:
    """A ``tokenizer.json`` giving llama.cpp's ids for GGUF tokenizer fields ``md``.

    Raises:
        UnsupportedError: a tokenizer model or ``pre`` not in `PRE_TOKENIZERS`.
        FormatError: fields missing or of the wrong length.
    """
    kind = md.get("tokenizer.ggml.model")
    tokens = list(md.get("tokenizer.ggml.tokens") or [])
    types = list(md.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens))
    if len(types) != len(tokens):
        raise FormatError(f"{where}: tokenizer.ggml.token_type and tokens differ")
    vocab = {t: i for i, t in enumerate(tokens)}
    dec: dict[str, Any]
    if kind == "gpt2":
        pre_name = str(md.get("tokenizer.ggml.pre", "gpt2"))
        pre = PRE_TOKENIZERS.get("gpt-2" if pre_name == "gpt2" else pre_name)
        if pre is None:
            raise UnsupportedError(
                f"{where}: tokenizer.ggml.pre {pre_name!r}; entrenar reads "
                f"{sorted(PRE_TOKENIZERS)}"
            )
        merges = [m.split(" ", 1) for m in md.get("tokenizer.ggml.merges") or []]
        byte_level = _byte_level(use_regex=pre.regex is None)
        steps: list[dict[str, Any]] = [byte_level]
        if pre.regex is not None:
            split = dict(pattern={"Regex": pre.regex}, behavior="Isolated")
            steps.insert(0, {"type": "Split", **split, "invert": False})
            missing = missing_byte_chars(vocab)  # no merge across them (llama.cpp)
            if missing:
                split = dict(pattern={"Regex": f"[{missing}]"}, behavior="Isolated")
                steps.insert(1, {"type": "Split", **split, "invert": False})
        if pre.digits:
            steps.insert(0, {"type": "Digits", "individual_digits": True})
        model = {"type": "BPE", "vocab": vocab, "merges": merges, "byte_fallback":
                 False, "ignore_merges": pre.ignore_merges}  # fmt: skip
        norm = None
        pre_tok: dict[str, Any] | None = {"type": "Sequence", "pretokenizers": steps}
        dec = _byte_level(use_regex=False)
    elif kind == "llama":
        scores = list(md.get("tokenizer.ggml.scores") or [0.0] * len(tokens))
        if len(scores) != len(tokens):
            raise FormatError(f"{where}: tokenizer.ggml.scores and tokens differ")
        unk = md.get("tokenizer.ggml.unknown_token_id")
        model = {"type": "BPE", "vocab": vocab, "byte_fallback": True,
                 "merges": _spm_merges(tokens, types, scores), "fuse_unk": True,
                 "unk_token": None if unk is None else tokens[int(unk)]}  # fmt: skip
        prefix = bool(md.get("tokenizer.ggml.add_space_prefix", True))
        escape = {"type": "Replace", "pattern": {"String": " "}, "content": SPACE}
        prepend = [{"type": "Prepend", "prepend": SPACE}] if prefix else []
        norm = {"type": "Sequence", "normalizers": [*prepend, escape]}
        pre_tok = None
        strip = [{"type": "Strip", "content": " ", "start": 1, "stop": 0}]
        dec = {"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": SPACE}, "content": " "},
            {"type": "ByteFallback"}, {"type": "Fuse"}, *(strip if prefix else []),
        ]}  # fmt: skip
    else:
        raise UnsupportedError(
            f"{where}: tokenizer.ggml.model {kind!r}; entrenar reads 'gpt2' and 'llama'"
        )
    added = _added(tokens, types, _rstrip(md, tokens, types))
    doc = {"version": "1.0", "truncation": None, "padding": None,
           "added_tokens": added, "normalizer": norm,
           "pre_tokenizer": pre_tok, "post_processor": None, "decoder": dec,
           "model": model}  # fmt: skip
    return json.dumps(doc, ensure_ascii=False)


def hf_config_from_gguf(md: Mapping[str, Any]) -> dict[str, Any]:
    """The ``tokenizer_config.json`` dict of GGUF tokenizer fields ``md``.

    A field the file lacks takes llama.cpp's default (``llama_vocab::load``): for
    ``tokenizer.ggml.model`` ``llama`` BOS 1, EOS 2, unknown 0 and ``add_bos_token``
    true; ``add_bos_token`` true for ``pre`` ``llama-bpe`` too; else no id, false.
    """
    tokens = md.get("tokenizer.ggml.tokens") or []
    spm = md.get("tokenizer.ggml.model") == "llama"
    default_ids = {"bos": 1, "eos": 2, "unknown": 0} if spm else {}
    config: dict[str, Any] = {}
    for name, key in (("bos", "bos"), ("eos", "eos"), ("pad", "padding"),
                      ("unk", "unknown")):  # fmt: skip
        i = md.get(f"tokenizer.ggml.{key}_token_id", default_ids.get(key))
        if isinstance(i, int) and 0 <= i < len(tokens):
            config[f"{name}_token"] = tokens[i]
    add_bos = spm or md.get("tokenizer.ggml.pre") in LLAMA3_PRE
    for name, default in (("bos", add_bos), ("eos", False)):
        flag = md.get(f"tokenizer.ggml.add_{name}_token", default)
        config[f"add_{name}_token"] = bool(flag)
    template = md.get("tokenizer.chat_template")
    if isinstance(template, str):
        config["chat_template"] = template
    return config


__all__ = [
    "LLAMA3_REGEX",
    "PRE_TOKENIZERS",
    "QWEN2_REGEX",
    "PreTokenizer",
    "gguf_tokenizer_fields",
    "hf_config_from_gguf",
    "hf_json_from_gguf",
    "pre_tokenizer_name",
    "space_prefix",
]
