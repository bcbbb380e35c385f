"""`TextLoader`: language-modelling batches from records, through a tokenizer.

Records are tokenized and labelled once (`entrenar.data.formatting`), laid out in rows
of ``seq_len`` tokens (`entrenar.data.batching`: padding, or packing), and the rows are
served by an `ArrayLoader`: shuffled per epoch from ``(seed, epoch)``, with a position
that checkpoints save. Every batch has the same shape: a last incomplete batch is
dropped (``drop_last=True``) or filled with empty rows (labels ``-100``, attention
mask False) that add nothing to the loss. A document none of whose targets has a
label once fitted to ``seq_len`` (its completion cut off) gets no row.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from entrenar.data.batching import Overflow, fit_documents, pack_rows, pad_rows
from entrenar.data.formatting import IGNORE_INDEX, Format, Tokenizer, encode_records
from entrenar.data.protocol import ArrayLoader, Batch
from entrenar.data.readers import Records, load_records
from entrenar.errors import ConfigError


class TextLoader:
    """Language-modelling batches ``(batch_size, seq_len)``, numpy int32/bool.

    Keys: ``input_ids``, ``labels``, ``attention_mask``, and when packing
    ``segment_ids`` and ``positions`` (specs/data.md).

    Args:
        records: dicts, `Records`, or the path of a JSONL/CSV/Parquet file.
        tokenizer: a `FastTokenizer` (or the reference `BPETokenizer`).
        format: ``"text"``, ``"prompt_completion"``, ``"chat"`` or ``"auto"``.
        seq_len: tokens per row.
        batch_size: rows per batch.
        packing: pack several documents per row (else one, right-padded).
        shuffle: shuffle the rows each epoch.
        seed: seed of the shuffling.
        drop_last: drop the last incomplete batch instead of padding it.
        overflow: documents over ``seq_len``: ``"truncate"``, ``"split"`` or
            ``"error"``.
        pad_id: the padding token; default the tokenizer's ``pad_id``, else EOS,
            else 0.
        **format_options: ``fields``, ``chat_template``, ``add_eos``, ``special`` for
            `entrenar.data.formatting.encode_records`.

    Attributes:
        arrays: all rows, ``{key: (N, seq_len)}``.
        documents: how many records gave tokens.
        document_tokens: the documents' tokens before they were fitted to
            ``seq_len`` (`tokens_per_epoch` counts those the rows keep).
        unlabelled: documents left out, as TRL's SFTTrainer leaves them out: none
            of their tokens (once fitted to ``seq_len``) is a target with a loss
            (a prompt as long as the row, a chat without an assistant turn), so
            they would only take a row's compute and a batch's place.
    """

    def __init__(
        self,
        records: Sequence[Mapping[str, Any]] | Records | str | os.PathLike[str],
        tokenizer: Tokenizer,
        *,
        format: Format = "text",
        seq_len: int,
        batch_size: int,
        packing: bool = False,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        overflow: Overflow = "truncate",
        pad_id: int | None = None,
        **format_options: Any,
    ) -> None:
        if isinstance(records, (str, os.PathLike)):
            records = load_records(records)
        records = Records.wrap(records)
        docs = encode_records(records, tokenizer, format=format, **format_options)
        if pad_id is None:
            pad_id = getattr(tokenizer, "pad_id", None)
            pad_id = tokenizer.eos_id if pad_id is None else pad_id
        pad_id = 0 if pad_id is None else int(pad_id)
        fitted = fit_documents(docs, seq_len, overflow)
        kept = [(i, y) for i, y in fitted if (y[1:] != IGNORE_INDEX).any()]
        self.unlabelled = len(fitted) - len(kept)
        layout = pack_rows if packing else pad_rows
        self.arrays = layout(kept, seq_len, pad_id=pad_id)
        self.documents = sum(len(ids) > 0 for ids, _ in docs)
        self.document_tokens = sum(len(ids) for ids, _ in docs)
        if not len(self.arrays["input_ids"]):
            raise no_tokens_error(records, self.unlabelled, seq_len)
        self.seq_len, self.packing, self.pad_id = int(seq_len), packing, pad_id
        pads = {"input_ids": pad_id, "labels": IGNORE_INDEX, "attention_mask": False}
        self._rows = ArrayLoader(
            self.arrays,
            batch_size,
            shuffle=shuffle,
            seed=seed,
            drop_last=drop_last,
            pad=not drop_last,
            pad_values=pads,
        )

    @property
    def batch_size(self) -> int:
        """Rows per batch."""
        return self._rows.batch_size

    @property
    def epoch(self) -> int:
        """The current epoch."""
        return self._rows.epoch

    @property
    def position(self) -> int:
        """Batches already yielded in the current epoch."""
        return self._rows.position

    def __len__(self) -> int:
        return len(self._rows)

    def __iter__(self) -> Iterator[Batch]:
        return iter(self._rows)

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch`` (its order from ``(seed, epoch)``) at batch 0."""
        self._rows.set_epoch(epoch)

    def state_dict(self) -> dict[str, Any]:
        """The position (JSON data): epoch, batches yielded, seed, number of rows."""
        return self._rows.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume at a position saved by `state_dict` (same data and seed)."""
        self._rows.load_state_dict(state)

    def tokens_per_epoch(self) -> int:
        """Non-padding tokens in one epoch (for tokens/s)."""
        return int(np.sum(self.arrays["attention_mask"]))


def no_tokens_error(
    records: Records, unlabelled: int = 0, seq_len: int | None = None
) -> ConfigError:
    """The error for records that give no token to train on.

    An empty file, empty texts, or (``unlabelled``) documents none of whose
    ``seq_len`` first tokens has a label: prompts as long as the row, chats
    without an assistant turn.
    """
    n = len(records)
    if not n:
        return ConfigError(
            f"{records.source}: holds no records (an empty file?), so no tokens to "
            "train on; give it at least one row, or name another file"
        )
    if unlabelled:
        return ConfigError(
            f"{records.source}: none of its {n} record{'s' * (n > 1)} has a token "
            f"with a loss in its first seq_len={seq_len} tokens (prompts that fill "
            "the row, chats without an assistant turn); raise seq_len "
            "(data.seq_len in a run config) or check the completions and replies"
        )
    return ConfigError(
        f"{records.source}: its {n} record{'s' if n > 1 else ''} hold"
        f"{'' if n > 1 else 's'} no tokens to train on; check that the format's "
        "fields hold text"
    )


def lm_loader(
    records: Sequence[Mapping[str, Any]] | Records | str | os.PathLike[str],
    tokenizer: Tokenizer,
    *,
    format: Format = "text",
    seq_len: int,
    batch_size: int,
    packing: bool = False,
    seed: int = 0,
    **options: Any,
) -> TextLoader:
    """A `TextLoader` (same arguments): language-modelling batches from records.

    >>> from entrenar.io import BPETokenizer
    >>> tok = BPETokenizer(tokens=("a", "b", "ab", "<e>"), merges=("a b",),
    ...                    token_types=(1, 1, 1, 3), eos_id=3)
    >>> dl = lm_loader([{"text": "ab"}, {"text": "b"}], tok, seq_len=4,
    ...                batch_size=2, packing=True, shuffle=False)
    >>> b = next(iter(dl))
    >>> b["input_ids"].tolist(), b["segment_ids"].tolist(), b["labels"].tolist()
    ([[2, 3, 1, 3], [3, 3, 3, 3]], [[1, 1, 2, 2], [0, 0, 0, 0]], [[-100, 3, -100, 3], [-100, -100, -100, -100]])
    """  # noqa: E501
    return TextLoader(
        records,
        tokenizer,
        format=format,
        seq_len=seq_len,
        batch_size=batch_size,
        packing=packing,
        seed=seed,
        **options,
    )


__all__ = ["TextLoader", "lm_loader", "no_tokens_error"]
