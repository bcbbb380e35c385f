"""Write the number-words data set and a byte-level BPE tokenizer trained on it.

``train.jsonl`` / ``validation.jsonl``: prompt-completion records such as
``{"prompt": "347 in words:", "completion": " three hundred forty-seven"}`` for
integers 0-9999 (written for this project; 2000 training and 200 held-out numbers,
disjoint, seed 0). ``tokenizer.gguf``: a GPT-2-style byte-level BPE (the 256 byte
symbols, merges learned from the training text with Hugging Face ``tokenizers``, and
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


def records(numbers: np.ndarray) -> list[dict[str, str]]:
    return [
        {"prompt": f"{n} in words:", "completion": " " + words(int(n))} for n in numbers
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
    splits = {"train": numbers[:2000], "validation": numbers[2000:2200]}
    for name, nums in splits.items():
        with open(os.path.join(HERE, f"{name}.jsonl"), "w", encoding="utf-8") as f:
            for r in records(nums):
                f.write(json.dumps(r) + "\n")
        print(f"{name}.jsonl: {len(nums)} records")
    texts = [r["prompt"] + r["completion"] for r in records(splits["train"])]
    write_tokenizer(texts, os.path.join(HERE, "tokenizer.gguf"))


if __name__ == "__main__":
    main()
