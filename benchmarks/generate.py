"""Decoding speed: entrenar vs llama.cpp on the same GGUF files, one and two threads.

Files: SmolLM2-135M-Instruct's Q4_1 GGUF (`entrenar.io.smollm2_path`, what ``make
demo`` uses; its ``token_embd`` is Q8_0) and a Q8_0 export of it written by
`entrenar.io.save_llama_gguf` (``--workdir``, reused when present). Prompt: one chat
turn of the held-out ISO-date set rendered with the model's template (the same token
ids for both programs). Each program runs in its own process, pinned with
``taskset`` to one core (one thread) or two (two threads; llama.cpp's ``n_threads``
follows; entrenar's decoding kernel runs on as many threads as XLA's intra-op pool
has, which is the CPUs the process may use: ``kernels/row_pool.h``):

- llama.cpp (llama-cpp-python, ``--llama-python``, default ``/tmp/llamavenv``):
  ``eval`` of the prompt (prompt tok/s), then greedy tokens one ``eval`` each
  (decode tok/s);
- entrenar: `load_llama_gguf(keep_quantized=True)` with the tied head kept as Q8_0
  (`entrenar.quant.matvec.quantize_tied_head`), so both read the weights as stored;
  `nn.generate_stream` greedy: the time to the first token is the prompt
  (``prefill``: one batched forward), the rest decode steps. Batch 8 and 32 decode
  that many different held-out prompts at once (decode tok/s counts every row's
  tokens). ``--activations``: one entrenar process per setting of
  `entrenar.nn.matvec.set_activations` (``int8``: the input of each Q8_0 / Q4_0 /
  Q4_1 product rounded to 8 bits per 32-block, as llama.cpp does; ``float32``: as
  given); the greedy tokens of every row of the largest batch are compared between
  the two settings.

Both programs stay loaded in their processes and are measured alternately (llama.cpp,
then entrenar at each batch size, ``--repeats`` rounds after a warm-up round that
compiles), so both see the same load; every figure is the best of its rounds, since
the machine is shared. The load average is printed before and after.
Prints a Markdown report; ``--out FILE`` writes it.

Usage: ``python benchmarks/generate.py [--repeats 3] [--new-tokens 32]
[--out benchmarks/results/generate.md]``
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import time
from typing import Any

from machine import cpu_name, load

ROOT = pathlib.Path(__file__).resolve().parents[1]
HELDOUT = ROOT / "examples" / "data" / "iso_dates" / "heldout.jsonl"

LLAMA_WORKER = r"""
import json, sys, time
import numpy as np
from llama_cpp import Llama
a = json.loads(sys.argv[1])
llm = Llama(model_path=a["path"], n_ctx=512, n_batch=512, n_threads=a["threads"],
            n_threads_batch=a["threads"], verbose=False)
nv = llm.n_vocab()


def last():  # the greedy token: argmax of the last position's logits
    return int(np.argmax(np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(nv,))))


print(json.dumps({"ready": True}), flush=True)
for line in sys.stdin:  # one measurement per request
    llm.reset()
    t0 = time.perf_counter()
    llm.eval(a["prompt"])
    t1 = time.perf_counter()
    toks = [last()]
    t2 = time.perf_counter()
    for _ in range(a["new"] - 1):
        llm.eval([toks[-1]])
        toks.append(last())
    t3 = time.perf_counter()
    print(json.dumps({"prompt_tps": len(a["prompt"]) / (t1 - t0),
                      "decode_tps": (a["new"] - 1) / (t3 - t2), "tokens": toks}),
          flush=True)
"""


def prompts(n: int) -> list[list[int]]:
    """Token ids of the first ``n`` held-out chats' prompts (the user turns)."""
    from entrenar import data, io
    from entrenar.chat import ChatModel

    gguf = io.read_gguf(io.smollm2_path())
    chat = ChatModel(None, None, data.load_fast_tokenizer(gguf))
    recs = list(data.load_records(str(HELDOUT)))[:n]
    return [chat.encode([m for m in r["messages"] if m["role"] != "assistant"])
            for r in recs]  # fmt: skip


def q8_0_export(workdir: pathlib.Path) -> pathlib.Path:
    """The Q8_0 GGUF of SmolLM2-135M-Instruct written by entrenar (made once)."""
    from entrenar import io

    path = workdir / "smollm2-135m-instruct-q8_0.gguf"
    if not path.exists():
        base = io.smollm2_path()
        cfg, params, _ = io.load_llama_gguf(base)
        io.save_llama_gguf(path, cfg, params, source=base, tensor_type="Q8_0")
    return path


def entrenar_worker(args: dict[str, Any]) -> None:
    """Serve measurements of entrenar on ``args["path"]``: one per stdin line.

    A request ``{"batch": B}`` decodes ``B`` prompts (batch 1: ``args["prompt"]``)
    and answers prompt tok/s (prompt tokens over the time to the first token),
    decode tok/s (every row's later tokens over their time) and row 0's tokens.
    """
    from entrenar import io, nn
    from entrenar.nn.matvec import set_activations
    from entrenar.quant.matvec import quantize_tied_head

    set_activations(args["activations"])
    cfg, params, _ = io.load_llama_gguf(args["path"], keep_quantized=True)
    if cfg.tie_word_embeddings:
        params = quantize_tied_head(params)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        batch = int(json.loads(line)["batch"])
        rows = args["rows"][:batch] if batch > 1 else [args["prompt"]]
        steps = nn.generate_stream(
            cfg, params, rows, max_new_tokens=args["new"], pad_token=0
        )
        t0 = time.perf_counter()
        first = next(steps)
        t1 = time.perf_counter()
        rest = list(steps)
        t2 = time.perf_counter()
        every = [[int(t[r]) for t in [first, *rest]] for r in range(batch)]
        print(json.dumps({
            "prompt_tps": sum(map(len, rows)) / (t1 - t0),
            "decode_tps": batch * len(rest) / (t2 - t1),
            "tokens": every[0], "rows": every,
        }), flush=True)  # fmt: skip


def _prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


class Worker:
    """A measuring process pinned to ``cores``; `ask` sends one request."""

    def __init__(self, cmd: list[str], cores: str) -> None:
        full = ["taskset", "-c", cores, *cmd]
        self.proc = subprocess.Popen(
            full, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        self.read()  # {"ready": true} once loaded

    def read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"worker {self.proc.args[:5]} ... exited")
        return dict(json.loads(line))

    def ask(self, request: dict[str, Any]) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        return self.read()

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--files", nargs="+", default=["q4_1", "q8_0"])
    ap.add_argument(
        "--activations", nargs="+", default=["int8", "float32"],
        choices=["int8", "float32"],
    )  # fmt: skip
    ap.add_argument("--workdir", default="/tmp/entrenar-bench-generate")
    ap.add_argument("--llama-python", default="/tmp/llamavenv/bin/python")
    ap.add_argument("--out", default=None, help="write the Markdown report here")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker is not None:  # a measuring subprocess
        entrenar_worker(json.loads(args.worker))
        return

    from entrenar import io

    workdir = pathlib.Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    files = {}
    if "q4_1" in args.files:
        files["Q4_1 (make demo's base)"] = pathlib.Path(io.smollm2_path())
    if "q8_0" in args.files:
        files["Q8_0 (entrenar's export)"] = q8_0_export(workdir)
    rows = prompts(max(args.batches))
    prompt = rows[0]
    lines = [
        "# Decoding: entrenar vs llama.cpp on the same GGUF files",
        "",
        f"`python benchmarks/generate.py {' '.join(sys.argv[1:])}`, "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}. "
        f"CPU: {cpu_name()}, {os.cpu_count()} cores, **shared** with other jobs: "
        "the two programs are "
        f"measured alternately, {args.repeats} rounds after a warm-up round, and "
        "every figure is the best of its rounds; the load average (1/5/15 min) is "
        "given before and after. Prompt: "
        f"{len(prompt)} tokens (a held-out ISO-date chat), then {args.new_tokens} "
        "greedy tokens. Threads: the process pinned to that many cores "
        "(`taskset`; llama.cpp's `n_threads` the same).",
        "",
        "| file | threads | program | batch | prompt tok/s | decode tok/s | "
        "decode vs llama.cpp | prompt vs llama.cpp | load before → after |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    agree: list[str] = []
    versus: list[str] = []
    for label, path in files.items():
        for threads in args.threads:
            cores = ",".join(str(i) for i in range(threads))
            before = load()
            llama = Worker([args.llama_python, "-c", LLAMA_WORKER, json.dumps({
                "path": str(path), "threads": threads, "prompt": prompt,
                "new": args.new_tokens,
            })], cores)  # fmt: skip
            ours = {}
            for act in args.activations:
                worker = {
                    "path": str(path), "prompt": prompt, "rows": rows,
                    "new": args.new_tokens, "activations": act,
                }  # fmt: skip
                ours[act] = Worker(
                    [sys.executable, __file__, "--worker", json.dumps(worker)], cores
                )
            best: dict[Any, dict[str, Any]] = {}
            keys = ["llama", *((a, b) for a in args.activations for b in args.batches)]
            for rep in range(args.repeats + 1):  # the first: warm-up (compiling)
                for key in keys:  # alternated: the same load
                    if key == "llama":
                        r = llama.ask({})
                    else:
                        r = ours[key[0]].ask({"batch": key[1]})
                    if rep == 0:
                        continue
                    b = best.setdefault(key, dict(r))
                    for k in ("prompt_tps", "decode_tps"):
                        b[k] = max(b[k], r[k])
            llama.close()
            for w in ours.values():
                w.close()
            after = load()
            ref = best["llama"]
            lines.append(
                f"| {label} | {threads} | llama.cpp | 1 | {ref['prompt_tps']:.0f} | "
                f"{ref['decode_tps']:.1f} | 1.00x | 1.00x | {before} → {after} |"
            )
            for act, batch in keys[1:]:
                r = best[act, batch]
                ratio = r["decode_tps"] / ref["decode_tps"]
                pr = r["prompt_tps"] / ref["prompt_tps"]
                lines.append(
                    f"| {label} | {threads} | entrenar ({act} x) | {batch} | "
                    f"{r['prompt_tps']:.0f} | {r['decode_tps']:.1f} | "
                    f"**{ratio:.2f}x** | {pr:.2f}x | {before} → {after} |"
                )
            for act in args.activations:
                same = _prefix(best[act, args.batches[0]]["tokens"], ref["tokens"])
                agree.append(
                    f"{label}, {threads} thread(s), {act} x: {same}/{args.new_tokens}"
                )
            if len(args.activations) == 2:  # int8 vs float32 x, every row
                a, b = (
                    best[act, max(args.batches)]["rows"] for act in args.activations
                )
                equal = sum(x == y for x, y in zip(a, b))
                tokens = sum(_prefix(x, y) for x, y in zip(a, b))
                versus.append(
                    f"{label}, {threads} thread(s): {equal}/{len(a)} rows identical, "
                    f"{tokens}/{len(a) * args.new_tokens} tokens before the first "
                    "difference of each row"
                )
            print("\n".join(lines[-len(keys) :]), file=sys.stderr)
    lines += [
        "",
        "Greedy tokens equal to llama.cpp's at batch 1 (the first N of "
        f"{args.new_tokens}; the two programs round differently, so a near tie can "
        "go either way and the texts part there): " + "; ".join(agree) + ".",
        "",
    ]
    if versus:
        lines += [
            f"Greedy tokens of the {max(args.batches)} held-out prompts, "
            f"{' vs '.join(args.activations)} activations: " + "; ".join(versus) + ".",
            "",
        ]
    report = "\n".join(lines)
    print(report)
    if args.out:
        pathlib.Path(args.out).write_text(report)


if __name__ == "__main__":
    main()
