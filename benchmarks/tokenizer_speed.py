"""Tokens/s of the fast tokenizer beside the pure-Python reference, same text, one run.

Corpus: this repository's own text (every ``*.md`` and ``*.py`` file under the repo,
one document per file, sorted by path), tokenized with SmolLM2-135M's vocabulary.

1. reference, cold: a fresh `entrenar.io.BPETokenizer` (vocabulary and merge tables
   built before timing, its per-piece memo empty: a repeated word hits it after its
   first occurrence);
2. reference, warm: the same instance again (every piece already memoized), and the
   reference's algorithm with no memo at all (pre-tokenize, then merge every piece);
3. fast: `entrenar.data.FastTokenizer.encode`, one document at a time;
4. fast, batch: `FastTokenizer.encode_batch` (Rust threads over the documents);
5. peer: the stock Hugging Face pipeline for this vocabulary (``Digits`` +
   ``ByteLevel`` with its built-in regex), what one would build without matching
   llama.cpp's character classes; shows what the explicit classes cost.

The ids of 1, 3, 4 and the memo-less reference are checked equal. Every figure is
the median of ``--repeats`` runs. Usage:
``python benchmarks/tokenizer_speed.py [--repeats 3]``
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import pathlib
import platform
import subprocess
import time

import numpy as np

from entrenar.data import FastTokenizer
from entrenar.io import BPETokenizer, load_tokenizer, smollm2_path
from entrenar.io.tokenizer import pre_tokenize

ROOT = pathlib.Path(__file__).resolve().parents[1]


def corpus() -> list[str]:
    skip = {".venv", ".git", "node_modules"}
    files = sorted(
        p
        for ext in ("*.md", "*.py")
        for p in ROOT.rglob(ext)
        if not skip & set(p.relative_to(ROOT).parts)
    )
    return [p.read_text(encoding="utf-8", errors="replace") for p in files]


def stock_hf(fast: FastTokenizer):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {t: i for i, t in enumerate(fast.tokens)}
    merges = [tuple(m.split(" ", 1)) for m in fast.reference.merges]
    t = Tokenizer(models.BPE(vocab, merges))
    t.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    return t


def timed(fn, repeats: int) -> tuple[float, object]:
    times, out = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times)), out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    docs = corpus()
    chars = sum(map(len, docs))
    cpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model = next((ln.split(":", 1)[1].strip() for ln in cpu.splitlines()
                  if ln.startswith("Model name")), platform.processor())  # fmt: skip
    print(f"# {len(docs)} documents, {chars:,} characters; {model}, "
          f"{os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}")  # fmt: skip

    path = smollm2_path()
    ref = load_tokenizer(path)

    def fresh() -> BPETokenizer:  # a new instance: empty memo, tables prebuilt
        t = dataclasses.replace(ref)
        _ = t._vocab, t._ranks, t._specials
        return t

    colds = []
    for _ in range(args.repeats):
        t = fresh()
        t0 = time.perf_counter()
        want = [t.encode(d) for d in docs]
        colds.append(time.perf_counter() - t0)
    cold = float(np.median(colds))
    n = sum(map(len, want))
    ref = t
    warm, _ = timed(lambda: [ref.encode(d) for d in docs], args.repeats)
    nomemo = load_tokenizer(path)
    t0 = time.perf_counter()
    plain = [[i for p in pre_tokenize(d, nomemo.pre) for i in nomemo._merge(p)]
             for d in docs]  # fmt: skip
    bare = time.perf_counter() - t0
    assert plain == want

    fast = FastTokenizer.from_gguf(path)
    one, got = timed(lambda: [fast.encode(d) for d in docs], args.repeats)
    assert got == want, "fast tokenizer ids differ from the reference"
    batch, got = timed(lambda: fast.encode_batch(docs), args.repeats)
    assert got == want, "fast tokenizer batch ids differ from the reference"
    peer = stock_hf(fast)
    stock, enc = timed(lambda: peer.encode_batch(docs), args.repeats)
    same = [e.ids for e in enc] == want  # type: ignore[union-attr]
    stock1, _ = timed(lambda: [peer.encode(d) for d in docs], args.repeats)

    rows = [
        ("reference BPETokenizer, cold (fresh memo)", cold),
        ("reference BPETokenizer, warm (memoized pieces)", warm),
        ("reference algorithm without its memo", bare),
        ("FastTokenizer.encode, one document at a time", one),
        ("FastTokenizer.encode_batch (threads)", batch),
        ("stock HF pipeline .encode, one at a time", stock1),
        ("stock HF pipeline .encode_batch", stock),
    ]
    print(f"{n:,} tokens; stock pipeline ids equal: {same}")
    print("| tokenizer | seconds | tokens/s | x reference cold |")
    print("|---|---|---|---|")
    for name, sec in rows:
        print(f"| {name} | {sec:.3f} | {n / sec:,.0f} | {cold / sec:.1f} |")


if __name__ == "__main__":
    main()
