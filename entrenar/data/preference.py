"""Preference pairs (prompt, chosen, rejected), tokenized as TRL 1.16's DPOTrainer.

Records come in TRL's two preference formats:

- standard: ``{"prompt": str, "chosen": str, "rejected": str}``;
- conversational: ``prompt``, ``chosen`` and ``rejected`` message lists
  (``[{"role", "content"}, ...]``).

Without ``prompt``, the prompt is implicit: the longest common prefix of
``chosen`` and ``rejected`` (TRL's ``extract_prompt``: the shared turns of
message lists; of strings, the shared characters less a trailing space).

Tokenization (`encode_preference`, TRL's ``_prepare_dataset``): a standard record
gets the EOS token's text appended to each completion that does not end with it,
and ``prompt``, ``prompt + chosen`` and ``prompt + rejected`` are tokenized as
texts (the tokenizer's BOS, control tokens parsed, as ``tokenizer(text)`` does);
a conversational one renders the prompt with the generation prompt, and
``prompt + chosen`` / ``prompt + rejected`` without it, through the chat template.
The prompt's ids are the common prefix of the three, and each completion the rest
of its sequence (TRL's ``common_prefix_length``: a template that renders the
prompt alone differently starts the completion where they part). With
``max_length``, a pair whose prompt alone has ``max_length`` tokens or more is
dropped (no completion token would be left).

Batches (`collate_preference`, TRL's ``DataCollatorForPreference``): each
``prompt + chosen`` and ``prompt + rejected`` is cut to its first ``max_length``
tokens (``truncation_mode="keep_start"``, TRL's only mode), and all ``2B`` rows are
padded on the right to the longest: ``input_ids`` (pad id), ``attention_mask`` and
``completion_mask``, each ``(B, 2, T)`` (index 0 chosen, 1 rejected).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

from entrenar.data.formatting import Tokenizer, apply_chat_template
from entrenar.data.readers import Records
from entrenar.errors import ConfigError, FormatError

FIELDS = ("prompt", "chosen", "rejected")


class PreferencePair(NamedTuple):
    """The token ids of one pair: the shared prompt and the two completions."""

    prompt: list[int]
    chosen: list[int]
    rejected: list[int]


def _is_messages(value: Any) -> bool:
    return (
        isinstance(value, list)
        and bool(value)
        and isinstance(value[0], Mapping)
        and "role" in value[0]
    )


def extract_prompt(record: Mapping[str, Any]) -> dict[str, Any]:
    """``{prompt, chosen, rejected}`` with the implicit prompt taken out (TRL's).

    >>> extract_prompt({"chosen": "The sky is blue.", "rejected": "The sky is red."})
    {'prompt': 'The sky is', 'chosen': ' blue.', 'rejected': ' red.'}
    """
    chosen, rejected = record["chosen"], record["rejected"]
    idx = 0
    for idx in range(min(len(chosen), len(rejected))):
        if chosen[idx] != rejected[idx]:
            if chosen[idx - 1] == " ":  # the space goes with the completion
                idx -= 1
            break
    return {"prompt": chosen[:idx], "chosen": chosen[idx:], "rejected": rejected[idx:]}


def preference_record(recs: Records, i: int) -> dict[str, Any]:
    """Record ``i`` as ``{prompt, chosen, rejected}``, checked (errors name the row)."""
    rec = recs[i]
    if not isinstance(rec, Mapping) or "chosen" not in rec or "rejected" not in rec:
        got = sorted(rec) if isinstance(rec, Mapping) else type(rec).__name__
        raise FormatError(
            f"{recs.where(i)}: a preference record needs 'chosen' and 'rejected' "
            f"(and optionally 'prompt'); it has {got}"
        )
    rec = dict(rec) if "prompt" in rec else {**rec, **extract_prompt(rec)}
    talk = [_is_messages(rec[k]) for k in FIELDS]
    texts = [isinstance(rec[k], str) for k in FIELDS]
    if not (all(talk) or all(texts)):
        raise FormatError(
            f"{recs.where(i)}: 'prompt', 'chosen' and 'rejected' must all be strings "
            "or all be message lists ([{role, content}, ...])"
        )
    return rec


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    """The number of leading ids ``a`` and ``b`` share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def encode_pair(
    rec: Mapping[str, Any], tokenizer: Tokenizer, chat_template: str | None = None
) -> PreferencePair:
    """One checked record's ids (module docstring)."""
    if isinstance(rec["prompt"], list):
        kw = {"chat_template": chat_template}
        p = apply_chat_template(
            tokenizer, rec["prompt"], add_generation_prompt=True, **kw
        )
        pc = apply_chat_template(
            tokenizer,
            [*rec["prompt"], *rec["chosen"]],
            add_generation_prompt=False,
            **kw,
        )
        pr = apply_chat_template(
            tokenizer,
            [*rec["prompt"], *rec["rejected"]],
            add_generation_prompt=False,
            **kw,
        )
    else:
        if tokenizer.eos_id is None:
            raise ConfigError("standard preference records need a tokenizer with EOS")
        eos = tokenizer.tokens[int(tokenizer.eos_id)]
        c, r = (
            x if x.endswith(eos) else x + eos for x in (rec["chosen"], rec["rejected"])
        )
        p, pc, pr = (
            list(tokenizer.encode(t, special=True))
            for t in (rec["prompt"], rec["prompt"] + c, rec["prompt"] + r)
        )
    n = min(common_prefix_length(p, pc), common_prefix_length(p, pr))
    return PreferencePair(list(p[:n]), list(pc[n:]), list(pr[n:]))


def encode_preference(
    records: Sequence[Mapping[str, Any]] | Records,
    tokenizer: Tokenizer,
    *,
    chat_template: str | None = None,
    max_length: int | None = 1024,
) -> list[PreferencePair]:
    """The pairs of ``records``, tokenized as TRL does (module docstring).

    Pairs whose prompt has ``max_length`` tokens or more are dropped, as TRL drops
    them; ``max_length=None`` keeps all.
    """
    recs = Records.wrap(records)
    out = []
    for i in range(len(recs)):
        pair = encode_pair(preference_record(recs, i), tokenizer, chat_template)
        if max_length is None or len(pair.prompt) < max_length:
            out.append(pair)
    return out


def collate_preference(
    pairs: Sequence[PreferencePair],
    pad_id: int,
    *,
    max_length: int | None = 1024,
    length: int | None = None,
) -> dict[str, np.ndarray]:
    """``(B, 2, T)`` int32 ``input_ids``, ``attention_mask``, ``completion_mask``.

    Each row is cut to its first ``max_length`` tokens, then padded on the right to
    ``length`` (default: the batch's longest row, as TRL pads).
    """
    rows, masks = [], []
    for p in pairs:
        for completion in (p.chosen, p.rejected):
            ids = [*p.prompt, *completion][:max_length]
            rows.append(ids)
            masks.append(([0] * len(p.prompt) + [1] * len(completion))[:max_length])
    t = max((len(r) for r in rows), default=0) if length is None else length
    b = len(pairs)
    ids_a = np.full((b * 2, t), pad_id, np.int32)
    att = np.zeros((b * 2, t), np.int32)
    comp = np.zeros((b * 2, t), np.int32)
    for j, (r, m) in enumerate(zip(rows, masks)):
        if len(r) > t:
            raise ConfigError(f"a pair's row has {len(r)} tokens, more than length={t}")
        ids_a[j, : len(r)], att[j, : len(r)], comp[j, : len(m)] = r, 1, m
    shape = (b, 2, t)
    return {
        "input_ids": ids_a.reshape(shape),
        "attention_mask": att.reshape(shape),
        "completion_mask": comp.reshape(shape),
    }


__all__ = [
    "PreferencePair",
    "collate_preference",
    "common_prefix_length",
    "encode_pair",
    "encode_preference",
    "extract_prompt",
    "preference_record",
]
