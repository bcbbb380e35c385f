"""Data: loaders of batches, file readers, tokenizers, chat formatting, packing.

Protocol: a loader is an iterable of batches (dicts of numpy arrays) over one epoch,
with ``len(loader)`` batches, ``set_epoch(epoch)`` (order a pure function of the seed
and the epoch) and ``state_dict()``/``load_state_dict()`` for the position inside the
epoch, which checkpoints save. `ArrayLoader` serves in-memory arrays (``x``/``y``);
`TextLoader` (`lm_loader`) serves language-modelling batches with Hugging Face's keys
``input_ids``, ``labels`` (-100 where no loss), ``attention_mask`` and, when packing,
``segment_ids`` and ``positions`` (what `entrenar.nn.LlamaConfig.apply` takes).

Records come from JSONL, CSV and Parquet files (`load_records`, one reader per
extension in the registry `READERS`); text is tokenized by
`FastTokenizer` (Hugging Face ``tokenizers``, ids equal to the reference
`entrenar.io.BPETokenizer`) and formatted as plain text, prompt-completion or chat
(`render_chat` with the model's own template), the loss masked to the completion.
specs/data.md documents the formats, keys, masking and packing.
"""

from entrenar.data.batching import fit_documents, pack_rows, pad_rows
from entrenar.data.chat import (
    assistant_spans,
    check_messages,
    load_chat_template,
    render_chat,
)
from entrenar.data.fast_tokenizer import (
    FastTokenizer,
    gpt2_pattern,
    load_fast_tokenizer,
    token_bytes,
)
from entrenar.data.formatting import (
    FORMATS,
    IGNORE_INDEX,
    Tokenizer,
    apply_chat_template,
    chat_add_bos,
    detect_record_format,
    encode_records,
    label_segments,
    record_fields,
    special_texts,
)
from entrenar.data.preference import (
    PreferencePair,
    collate_preference,
    encode_preference,
    extract_prompt,
)
from entrenar.data.protocol import (
    ArrayLoader,
    Batch,
    Loader,
    NoFullBatchError,
    epoch_permutation,
)
from entrenar.data.readers import (
    READERS,
    Records,
    load_records,
    read_csv,
    read_jsonl,
    read_parquet,
    to_arrays,
)
from entrenar.data.tabular import split_rows, standardize, tabular_arrays
from entrenar.data.text_loader import TextLoader, lm_loader

__all__ = [
    "FORMATS",
    "IGNORE_INDEX",
    "READERS",
    "ArrayLoader",
    "Batch",
    "FastTokenizer",
    "Loader",
    "NoFullBatchError",
    "PreferencePair",
    "Records",
    "TextLoader",
    "Tokenizer",
    "apply_chat_template",
    "assistant_spans",
    "chat_add_bos",
    "check_messages",
    "collate_preference",
    "detect_record_format",
    "encode_preference",
    "encode_records",
    "epoch_permutation",
    "extract_prompt",
    "fit_documents",
    "gpt2_pattern",
    "label_segments",
    "lm_loader",
    "load_chat_template",
    "load_fast_tokenizer",
    "load_records",
    "pack_rows",
    "pad_rows",
    "read_csv",
    "read_jsonl",
    "read_parquet",
    "record_fields",
    "render_chat",
    "special_texts",
    "split_rows",
    "standardize",
    "tabular_arrays",
    "to_arrays",
    "token_bytes",
]
