"""Greedy replies of the quantized decoding paths against the float32 path (issue 37).

The main job's exported GGUF (``make demo`` writes it: ``model.gguf``, Q8_0) scored on
the 80 held-out ISO-date chats by `entrenar.chat.exact_match(generate=True)` three
ways: the float32 path (the file dequantized on load, what the main job scores), the
weights kept as stored with float32 activations (``keep_quantized``), and kept with
8-bit activations (``decode_activations="int8"``). Counts the replies equal to the
float32 path's, the hits of each, and for each differing reply the characters before
it parts from the float32 one.

    python benchmarks/decode_agreement.py runs/smollm2-qlora/model.gguf [--out FILE]
"""

from __future__ import annotations

import argparse
import os
import pathlib
import platform
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
HELDOUT = ROOT / "examples" / "data" / "iso_dates" / "heldout.jsonl"
WAYS = (
    ("float32 path (dequantized on load)", False, "float32"),
    ("kept as stored, float32 activations", True, "float32"),
    ("kept as stored, int8 activations", True, "int8"),
)


def _text(replies: str | tuple[str, ...]) -> str:
    """A record's replies as one string (a record may hold several turns)."""
    return replies if isinstance(replies, str) else "\n".join(replies)


def _common(a: str, b: str) -> int:
    """Characters ``a`` and ``b`` share before they part."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def main() -> None:
    from entrenar import data
    from entrenar.chat import ChatModel, exact_match

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("gguf", help="the exported GGUF (make demo's model.gguf)")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--out", help="also write the markdown report here")
    args = parser.parse_args()
    records = list(data.load_records(str(HELDOUT)))
    runs = []
    for name, kept, acts in WAYS:
        chat = ChatModel.from_gguf(
            args.gguf, keep_quantized=kept, decode_activations=acts
        )
        t0 = time.perf_counter()
        res = exact_match(chat, records, batch_size=args.batch_size, generate=True)
        runs.append((name, res, time.perf_counter() - t0))
    ref = [_text(r) for r in runs[0][1].replies]
    cpu = platform.processor() or platform.machine()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    lines = [
        f"`python benchmarks/decode_agreement.py {args.gguf}`, "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, CPU {cpu}, "
        f"load average {os.getloadavg()[0]:.1f}; {len(records)} held-out chats, "
        f"batches of {args.batch_size}.",
        "",
        "| decoding | exact match | replies equal to the float32 path's | "
        "differing replies: characters equal before they part | seconds |",
        "|---|---|---|---|---|",
    ]
    for name, res, secs in runs:
        mine = [_text(r) for r in res.replies]
        same = sum(a == b for a, b in zip(mine, ref, strict=True))
        parts = [str(_common(a, b)) for a, b in zip(mine, ref, strict=True) if a != b]
        lines.append(
            f"| {name} | {res.correct}/{res.total} | {same}/{res.total} | "
            f"{', '.join(parts) or '-'} | {secs:.1f} |"
        )
    text = "\n".join(lines)
    print(text)
    if args.out:
        pathlib.Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
