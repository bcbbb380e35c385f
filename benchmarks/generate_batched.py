"""Held-out evaluation by decoding: one reply at a time vs batches of 8, 16 and 32.

The main job's 80 held-out ISO-date chats (``examples/data/iso_dates/heldout.jsonl``)
are scored by `entrenar.chat.exact_match(generate=True)` on SmolLM2-135M-Instruct
(`entrenar.io.smollm2_path`, dequantized to float32, as ``ChatModel.from_gguf``
loads it): every reply's prompt is decoded greedily until the end-of-turn token or
the longest reply's length, with ``batch_size`` 1 (sequential) and 8, 16, 32 (ragged
prompts in one batch). Each batch size is warmed up once on the whole set (the
compilations), then timed ``--repeats`` times (best kept); the replies and hits of
every batch size are checked equal to the sequential ones, and the hits to the
teacher-forced exact match. Prints a Markdown table with the CPU and the load
average before and after; ``--append`` adds it to ``benchmarks/RESULTS.md``.

Usage: ``python benchmarks/generate_batched.py [--repeats 2] [--append]``
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
import time

from machine import cpu_name, load

from entrenar import data, io
from entrenar.chat import ChatModel, exact_match

ROOT = pathlib.Path(__file__).resolve().parents[1]
HELDOUT = ROOT / "examples" / "data" / "iso_dates" / "heldout.jsonl"
SIZES = (1, 8, 16, 32)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--append", action="store_true", help="append to RESULTS.md")
    args = ap.parse_args()

    recs = list(data.load_records(str(HELDOUT)))
    chat = ChatModel.from_gguf(io.smollm2_path())
    before = load()
    forced = exact_match(chat, recs)
    times: dict[int, float] = {}
    results = {}
    for bs in SIZES:
        results[bs] = exact_match(chat, recs, batch_size=bs, generate=True)  # warm
        best = float("inf")
        for _ in range(args.repeats):
            t = time.perf_counter()
            em = exact_match(chat, recs, batch_size=bs, generate=True)
            best = min(best, time.perf_counter() - t)
            assert em == results[bs]
        times[bs] = best
        print(f"batch {bs:>2}: {best / len(recs) * 1e3:7.1f} ms/item", file=sys.stderr)
    after = load()
    seq = results[1]
    same = all(
        r.replies == seq.replies and r.hits == seq.hits for r in results.values()
    )
    lines = [
        "",
        "## Batched evaluation by decoding (`python benchmarks/generate_batched.py`)",
        "",
        f"SmolLM2-135M-Instruct (float32, dequantized from the Q4_1 GGUF), the "
        f"{len(recs)} held-out ISO-date chats of the main job, greedy replies decoded "
        f"until `<|im_end|>` or the longest reference reply's length; "
        f"{cpu_name()}, {os.cpu_count()} cores; "
        f"load average {before} before, {after} after; best of {args.repeats} "
        f"after a warm-up run.",
        "",
        "| batch size | s total | ms per item | speed-up vs sequential |",
        "|---|---|---|---|",
    ]
    for bs in SIZES:
        lines.append(
            f"| {bs if bs > 1 else '1 (sequential)'} | {times[bs]:.2f} | "
            f"{times[bs] / len(recs) * 1e3:.1f} | **{times[1] / times[bs]:.2f}x** |"
        )
    lines += [
        "",
        f"Replies and hits of every batch size equal the sequential ones: "
        f"**{same}**; exact match {seq.accuracy:.3f} ({seq.correct}/{seq.total}), "
        f"teacher-forced {forced.accuracy:.3f} (hits equal: "
        f"{seq.hits == forced.hits}).",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.append:
        with open(ROOT / "benchmarks" / "RESULTS.md", "a", encoding="utf-8") as f:
            f.write(text)
    if not same:
        sys.exit("batched replies differ from the sequential ones")


if __name__ == "__main__":
    main()
