"""Write the number-words data sets and a byte-level BPE tokenizer trained on them.

Written for this project, integers 0-9999, seed 0, every split disjoint:

- ``train.jsonl`` / ``validation.jsonl`` (2000 / 200): cardinals,
  ``{"prompt": "347 in words:", "completion": " three hundred forty-seven"}``;
- ``ordinals_train.jsonl`` / ``ordinals_validation.jsonl`` (1000 / 200): ordinals,
  ``{"prompt": "347 as an ordinal:", "completion": " three hundred forty-seventh"}``,
  the new task a LoRA adapter teaches a model trained on cardinals.

``tokenizer.gguf``: a GPT-2-style byte-level BPE (the 256 byte symbols, merges
learned from the training texts with Hugging Face ``tokenizers``, and
``<|endoftext|>``) stored as GGUF ``tokenizer.ggml.*`` fields, no tensors, so any
entrenar language model config can name it as ``model.tokenizer``.
Run: ``python examples/data/number_words/make_number_words.py``.
"""

from __future__ import annotations

import json
import os

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ONES = (
    "zero one two three four five six seven eight nine ten eleven twelve "
    "thirteen fourteen fifteen sixteen seventeen eighteen nineteen"
).split()
TENS = "_ _ twenty thirty forty fifty sixty seventy eighty ninety".split()
VOCAB_SIZE = 320


def words(n: int) -> str:
    """English words of ``0 <= n < 10000`` (American style, no "and")."""
    if n < 20:
        return ONES[n]
    if n < 100:
        return TENS[n // 10] + ("" if n % 10 == 0 else "-" + ONES[n % 10])
    if n < 1000:
        rest = "" if n % 100 == 0 else " " + words(n % 100)
        return ONES[n // 100] + " hundred" + rest
    rest = "" if n % 1000 == 0 else " " + words(n % 1000)
    return words(n // 1000) + " thousand" + rest


IRREGULAR = {
    "one": "first",
    "two": "second",
    "three": "third",
    "five": "fifth",
    "eight": "eighth",
    "nine": "ninth",
    "twelve": "twelfth",
}


def ordinal(n: int) -> str:
    """English ordinal words of ``0 <= n < 10000`` (``forty-seventh``)."""
    text = words(n)
    head, sep, last = text.rpartition("-" if "-" in text.split(" ")[-1] else " ")
    if last in IRREGULAR:
        last = IRREGULAR[last]
    elif last.endswith("y"):
        last = last[:-1] + "ieth"
    else:
        last += "th"
    return head + sep + last


def records(numbers: np.ndarray) -> list[dict[str, str]]:
    return [
        {"prompt": f"{n} in words:", "completion": " " + words(int(n))} for n in numbers
    ]


def ordinal_records(numbers: np.ndarray) -> list[dict[str, str]]:
    return [
        {"prompt": f"{n} as an ordinal:", "completion": " " + ordinal(int(n))}
        for n in numbers
    ]


def write_tokenizer(texts: list[str], path: str) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from entrenar.io import GGUFField, GGUFValueType, write_gguf

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    spec = json.loads(tok.to_str())["model"]
    vocab: dict[str, int] = spec["vocab"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["merges"]]
    eos = vocab["<|endoftext|>"]
    types = [3 if i == eos else 1 for i in range(len(tokens))]
    s, a, u = GGUFValueType.STRING, GGUFValueType.ARRAY, GGUFValueType.UINT32
    fields = {
        "general.architecture": GGUFField("tokenizer", s),
        "general.name": GGUFField("number-words byte-level BPE", s),
        "tokenizer.ggml.model": GGUFField("gpt2", s),
        "tokenizer.ggml.pre": GGUFField("gpt2", s),
        "tokenizer.ggml.tokens": GGUFField(tokens, a, s),
        "tokenizer.ggml.token_type": GGUFField(types, a, GGUFValueType.INT32),
        "tokenizer.ggml.merges": GGUFField(merges, a, s),
        "tokenizer.ggml.eos_token_id": GGUFField(eos, u),
        "tokenizer.ggml.padding_token_id": GGUFField(eos, u),
    }
    write_gguf(path, fields, {})
    print(f"tokenizer.gguf: {len(tokens)} tokens, {len(merges)} merges")


def main() -> None:
    rng = np.random.default_rng(0)
    numbers = rng.permutation(10000)
    splits = {
        "train": records(numbers[:2000]),
        "validation": records(numbers[2000:2200]),
        "ordinals_train": ordinal_records(numbers[2200:3200]),
        "ordinals_validation": ordinal_records(numbers[3200:3400]),
    }
    for name, recs in splits.items():
        with open(os.path.join(HERE, f"{name}.jsonl"), "w", encoding="utf-8") as f:
            for r in recs:
                f.write(json.dumps(r) + "\n")
        print(f"{name}.jsonl: {len(recs)} records")
    texts = [
        r["prompt"] + r["completion"]
        for name in ("train", "ordinals_train")
        for r in splits[name]
    ]
    write_tokenizer(texts, os.path.join(HERE, "tokenizer.gguf"))


if __name__ == "__main__":
    main()
