"""How entrenar's QLoRA cost grows with the model: SmolLM2-135M to Llama-3-8B.

For each shape of `scale_models.SHAPES` (files written once by `scale_models`,
random weights of the real shapes), each measurement in a fresh subprocess, peak
RSS as ``VmHWM`` of ``/proc/self/status`` (JAX's buffers and the mapped files'
pages included):

- ``load``: `load_llama_gguf` of the Q4_K_M-like GGUF with ``keep_quantized`` (the
  QLoRA base as stored), and `load_hf_folder` of the bfloat16 folder with the bases
  quantized to NF4 as a ``quantize_base: nf4`` run on every linear layer does: wall
  time and peak RSS, the files' pages evicted first (``posix_fadvise
  DONTNEED``, checked with ``mincore``), against the time to read every byte of
  the files after the same eviction (and, for reference, again from the cache),
  and against the time a new process takes to get as much fresh memory as the
  loaded tree holds (``fresh``: `entrenar.nn.host_arrays.host_buffer`, its pages
  populated as a load populates its buffers): a load cannot take less than that,
  and on a virtual machine whose host takes free memory back it can be most of it;
- ``step``: the real ``entrenar train`` path (`entrenar.runs.run.prepare` and
  ``_train``) on the GGUF: QLoRA rank 16 on every linear layer, bfloat16 matmuls,
  each layer recomputed in the backward pass (``remat_policy: nothing_saveable``),
  ISO-dates chat data packed into rows, batch 1 x 512 and 4 x 128; 3 steps, the
  last two timed (from the run's metrics); peak RSS of the whole run (load, steps,
  checkpoint, adapter). FLOP/s counts ``4 P T`` for ``T`` tokens through ``P``
  matrix parameters (the forward product and the input-gradient product of each
  frozen base; LoRA factors, attention scores and the recomputation not counted),
  as a fraction of the bfloat16 matmul rate measured in the same run
  (``(512, 4096) x (4096, 4096)``, float32 accumulation);
- ``peer``: ``../shared/bench/peers/torch_llama_lora.py --preset`` (PyTorch + PEFT,
  float32 weights, bfloat16 autocast, LoRA rank 16 on every linear layer) where its
  float32 model fits in memory (not Llama-2-7B / Llama-3-8B: 27-32 GB).

Results accumulate in ``--json`` (one entry per measurement, so shapes can be run
separately); ``--report`` writes the tables (``--md``) and the log-log plot
(``--png``) from it.

Usage: ``python benchmarks/scale.py --shapes smollm2-135m,tinyllama-1.1b
[--what load,step,peer] [--batches 1x512,4x128] [--out /tmp/s12/scale]``, then
``python benchmarks/scale.py --report``. Run big shapes under
``flock /tmp/s12/bigmem.lock`` on a shared machine.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import scale_models
from machine import cpu_name, peak_rss

HERE = os.path.dirname(os.path.abspath(__file__))
PEER = os.path.join(HERE, "..", "..", "shared", "bench", "peers", "torch_llama_lora.py")
PEER_FITS = ("smollm2-135m", "smollm2-360m", "tinyllama-1.1b")
"""Shapes whose float32 PyTorch model fits in this machine's 24 GB."""

RUN_YAML = """\
name: {shape}-qlora
model: {{path: {gguf}, keep_quantized: true, matmul_dtype: bfloat16,
        remat_policy: nothing_saveable}}
data: {{train: {data}, format: chat, batch_size: {batch}, seq_len: {seq},
       packing: true}}
lora: {{rank: 16, alpha: 32, targets: all-linear, quantize_base: nf4}}
optimizer: {{name: adamw, lr: 0.0002}}
training: {{max_steps: {steps}, log_every: 1, seed: 0, checkpoint_every: {steps},
           output_dir: {out}}}
export: {{formats: [adapter]}}
"""
"""The measured run (also the headline run of Llama-3-8B, with 2 steps)."""


def matrix_params(shape: str) -> tuple[int, int]:
    """``(all parameters, matrix parameters)``: ``P`` of the FLOP count."""
    cfg = scale_models.config(shape)
    vocab, d, ff, n, heads, kv, _, _ = scale_models.SHAPES[shape]
    hd = d // heads
    per_layer = d * heads * hd * 2 + 2 * d * kv * hd + 3 * d * ff
    matrices = n * per_layer + vocab * d  # the head (tied: the embedding)
    return cfg.num_params(), matrices


def child_load(shape: str, fmt: str, out: str) -> dict[str, Any]:
    """One load in this process: seconds, peak RSS, bytes of the tree."""
    import jax

    from entrenar import io, lora
    from entrenar.nn.weight_node import is_weight_node, nbytes
    from entrenar.runs.models import base_quantizer

    folder, gguf = scale_models.paths(out, shape)
    left = evict(files_of(shape, fmt, out))  # read from disk, as a first load does
    t0 = time.perf_counter()
    if fmt == "gguf":
        _, params, _ = io.load_llama_gguf(gguf, keep_quantized=True)
    else:
        cfg = lora.LoRAConfig(rank=16, targets="all-linear", quantize_base="nf4")
        _, params = io.load_hf_folder(folder, quantize=base_quantizer(cfg))
    jax.block_until_ready(params)
    seconds = time.perf_counter() - t0
    leaves = jax.tree_util.tree_leaves(params, is_leaf=is_weight_node)
    return {
        "seconds": seconds, "peak": peak_rss(), "tree": sum(map(nbytes, leaves)),
        "resident_before": left,
    }  # fmt: skip


def child_step(shape: str, batch: int, seq: int, steps: int, out: str) -> dict:
    """A QLoRA run of ``steps`` through `entrenar.runs.run`: times and peak RSS."""
    from entrenar.config.summary import validate
    from entrenar.runs import run as run_mod

    _, gguf = scale_models.paths(out, shape)
    data = os.path.join(HERE, "..", "examples", "data", "iso_dates", "train.jsonl")
    run_dir = os.path.join(out, "runs", f"{shape}-{batch}x{seq}")
    shutil.rmtree(run_dir, ignore_errors=True)
    os.makedirs(os.path.dirname(run_dir), exist_ok=True)
    yaml = run_dir + ".yaml"
    with open(yaml, "w") as f:
        f.write(
            RUN_YAML.format(
                shape=shape, gguf=gguf, data=os.path.abspath(data), batch=batch,
                seq=seq, steps=steps, out=run_dir,
            )
        )  # fmt: skip
    t0 = time.perf_counter()
    spec = validate(yaml)
    prep = run_mod.prepare(spec)
    prepare_s, prepare_peak = time.perf_counter() - t0, peak_rss()
    res = run_mod._train(spec, prep, resume=None, progress=False)
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f if '"tokens_per_s"' in line]
    step_s = [batch * seq / r["tokens_per_s"] for r in rows]
    return {
        "prepare_s": prepare_s,
        "prepare_peak": prepare_peak,
        "run_s": time.perf_counter() - t0,
        "peak": peak_rss(),
        "step_s": step_s,
        "loss": res.metrics.get("train_loss"),
    }


def matmul_rate() -> dict[str, float]:
    """FLOP/s of a ``(512, 4096) x (4096, 4096)`` product, bfloat16 and float32."""
    import jax
    import jax.numpy as jnp

    out = {}
    for name, dt in (("bfloat16", jnp.bfloat16), ("float32", jnp.float32)):
        a, b = jnp.ones((512, 4096), dt), jnp.ones((4096, 4096), dt)
        f = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32))
        f(a, b).block_until_ready()
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            f(a, b).block_until_ready()
            times.append(time.perf_counter() - t0)
        out[name] = 2 * 512 * 4096 * 4096 / sorted(times)[2]
    return out


def run_child(args: list[str]) -> dict[str, Any]:
    res = subprocess.run(
        [sys.executable, __file__, *args], capture_output=True, text=True,
        env=dict(os.environ, JAX_PLATFORMS="cpu"),
    )  # fmt: skip
    if res.returncode:
        sys.stderr.write(res.stderr[-3000:])
        raise RuntimeError(f"child {args} failed ({res.returncode})")
    return json.loads(res.stdout.strip().splitlines()[-1])


def run_peer(shape: str, batch: int, seq: int) -> dict[str, Any]:
    """The PyTorch + PEFT step and its peak RSS (``/usr/bin/time -v``)."""
    cmd = [
        "/usr/bin/time", "-v", sys.executable, PEER, "--preset", shape,
        "--targets", "all", "--rank", "16", "--batch", str(batch), "--seq", str(seq),
        "--steps", "2", "--bf16",
    ]  # fmt: skip
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode:
        raise RuntimeError(f"{cmd} failed: {res.stderr[-2000:]}")
    out = json.loads(res.stdout.strip().splitlines()[-1])
    for line in res.stderr.splitlines():
        if "Maximum resident set size" in line:
            out["peak"] = int(line.split()[-1]) * 1024
    return out


def read_seconds(paths: list[str]) -> float:
    """Seconds to read ``paths`` (``readinto`` one reused buffer), page cache warm."""
    buf = bytearray(64 << 20)
    for _ in range(2):  # the second from the page cache
        t0 = time.perf_counter()
        for p in paths:
            with open(p, "rb", buffering=0) as f:
                while f.readinto(buf):
                    pass
        seconds = time.perf_counter() - t0
    return seconds


def resident_fraction(paths: list[str]) -> float:
    """The fraction of ``paths``' pages in the page cache (``mincore`` of a map)."""
    import ctypes
    import mmap

    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    page, held, total = mmap.PAGESIZE, 0, 0
    for p in paths:
        size = os.path.getsize(p)
        n = (size + page - 1) // page
        vec = ctypes.create_string_buffer(n)
        with open(p, "rb") as f:  # a private map: its pages are the cache's
            m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
            start = ctypes.c_char.from_buffer(m)
            rc = libc.mincore(ctypes.addressof(start), size, vec)
            del start
            m.close()
        if rc:
            raise OSError(ctypes.get_errno(), f"mincore of {p}")
        held += sum(b & 1 for b in vec.raw)
        total += n
    return held / max(total, 1)


def evict(paths: list[str]) -> float:
    """Drop ``paths``' clean pages from the page cache; the fraction left after.

    ``posix_fadvise(POSIX_FADV_DONTNEED)`` needs no privileges for pages nobody
    has dirtied or mapped; `resident_fraction` checks what it did.
    """
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return resident_fraction(paths)


def child_read(shape: str, fmt: str, out: str) -> dict[str, Any]:
    """Every byte of the files read from disk (evicted first), then from the cache."""
    paths = files_of(shape, fmt, out)
    left = evict(paths)
    buf = bytearray(64 << 20)
    times = []
    for _ in range(2):  # cold, then warm
        t0 = time.perf_counter()
        for p in paths:
            with open(p, "rb", buffering=0) as f:
                while f.readinto(buf):
                    pass
        times.append(time.perf_counter() - t0)
    return {
        "cold_read_s": times[0], "warm_read_s": times[1], "resident_before": left,
        "bytes": sum(os.path.getsize(p) for p in paths),
    }  # fmt: skip


def child_fresh(nbytes: int) -> dict[str, Any]:
    """Seconds to get ``nbytes`` of fresh, populated memory in this new process.

    What a load must do at least besides reading: its tree lives in memory the
    process did not have (`host_buffer` maps it and populates it in parts on
    threads, as the loads' buffers are).
    """
    import numpy as np

    from entrenar.nn.host_arrays import host_buffer

    t0 = time.perf_counter()
    buf = host_buffer((nbytes,), np.uint8)
    return {"fresh_s": time.perf_counter() - t0, "fresh_bytes": buf.nbytes}


def files_of(shape: str, fmt: str, out: str) -> list[str]:
    folder, gguf = scale_models.paths(out, shape)
    if fmt == "gguf":
        return [gguf]
    return sorted(
        os.path.join(folder, f)
        for f in os.listdir(folder)
        if f.endswith(".safetensors")
    )


def record(path: str, entry: dict[str, Any]) -> None:
    """Append ``entry`` (with the time, load average and CPU) to the JSON list."""
    entries = []
    if os.path.exists(path):
        with open(path) as f:
            entries = json.load(f)
    entry |= {"when": time.strftime("%Y-%m-%d %H:%M"), "cpu": cpu_name()}
    entries.append(entry)
    with open(path, "w") as f:
        json.dump(entries, f, indent=1)
    print(json.dumps(entry), flush=True)


def measure(args: argparse.Namespace) -> None:
    for shape in args.shapes.split(","):
        formats = "gguf" if "load" not in args.what else args.formats
        scale_models.ensure(shape, args.out, formats)
        n_params, n_matrix = matrix_params(shape)
        base = {"shape": shape, "params": n_params, "matrix_params": n_matrix}
        if "load" in args.what:
            for fmt in args.formats.split(","):
                before = os.getloadavg()[0]
                read = run_child(["--child-read", shape, fmt, "--out", args.out])
                got = run_child(["--child-load", shape, fmt, "--out", args.out])
                fresh = run_child(["--child-fresh", str(got["tree"])])
                record(args.json, base | got | fresh | {
                    "what": "load", "format": fmt, "read_s": read["warm_read_s"],
                    "cold_read_s": read["cold_read_s"], "bytes": read["bytes"],
                    "read_resident_before": read["resident_before"],
                    "load_before": before, "load_after": os.getloadavg()[0],
                })  # fmt: skip
        for bt in args.batches.split(",") if "step" in args.what else ():
            batch, seq = (int(v) for v in bt.split("x"))
            before = os.getloadavg()[0]
            rate = matmul_rate()
            got = run_child(
                ["--child-step", shape, str(batch), str(seq), str(args.steps),
                 "--out", args.out]
            )  # fmt: skip
            record(args.json, base | got | {
                "what": "step", "batch": batch, "seq": seq, "matmul_rate": rate,
                "load_before": before, "load_after": os.getloadavg()[0],
            })  # fmt: skip
        for bt in args.batches.split(",") if "peer" in args.what else ():
            if shape not in PEER_FITS:
                continue
            batch, seq = (int(v) for v in bt.split("x"))
            before = os.getloadavg()[0]
            got = run_peer(shape, batch, seq)
            record(args.json, base | got | {
                "what": "peer", "batch": batch, "seq": seq,
                "load_before": before, "load_after": os.getloadavg()[0],
            })  # fmt: skip


def latest(entries: list[dict[str, Any]], **match: Any) -> dict[str, Any] | None:
    """The last entry whose fields equal ``match``."""
    found = [e for e in entries if all(e.get(k) == v for k, v in match.items())]
    return found[-1] if found else None


def report(args: argparse.Namespace) -> None:
    """Tables (markdown, printed and written to ``--md``'s section) and the plot."""
    with open(args.json) as f:
        entries = json.load(f)
    shapes = [s for s in scale_models.SHAPES if latest(entries, shape=s)]
    lines = [
        "| shape | params | file | GB | load, cold (s) | read, cold (s) "
        "| load / read | read, cached (s) | fresh memory (s) | peak RSS (GB) "
        "| tree (GB) | load avg |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in shapes:
        for fmt in ("gguf", "hf"):
            e = latest(entries, shape=s, what="load", format=fmt)
            if e and "cold_read_s" in e:
                lines.append(
                    f"| {s} | {e['params'] / 1e9:.2f}B | {_file_name(fmt)} | "
                    f"{e['bytes'] / 1e9:.2f} | {e['seconds']:.1f} | "
                    f"{e['cold_read_s']:.2f} | "
                    f"{e['seconds'] / e['cold_read_s']:.1f}x | {e['read_s']:.2f} | "
                    f"{_seconds(e.get('fresh_s'))} | "
                    f"{e['peak'] / 1e9:.2f} | {e['tree'] / 1e9:.2f} | "
                    f"{e['load_before']:.1f}-{e['load_after']:.1f} |"
                )
    lines += [
        "",
        "| shape | batch | step (s) | tokens/s | FLOP/s | of bf16 matmul "
        "| peak RSS (GB) | peer step (s) | peer tokens/s | peer peak (GB) "
        "| load avg |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in shapes:
        for bt in ("1x512", "4x128"):
            b, t = (int(v) for v in bt.split("x"))
            e = latest(entries, shape=s, what="step", batch=b, seq=t)
            if not e:
                continue
            step = sorted(e["step_s"][1:] or e["step_s"])[0]  # best timed step
            flops = 4 * e["matrix_params"] * b * t / step
            frac = flops / e["matmul_rate"]["bfloat16"]
            p = latest(entries, shape=s, what="peer", batch=b, seq=t)
            peer = (
                f"{p['step_s_median']:.2f} | {p['tokens_per_s']:.0f} | "
                f"{p['peak'] / 1e9:.2f}"
                if p
                else ("does not fit (float32)" if s not in PEER_FITS else "-")
                + " | - | -"
            )
            lines.append(
                f"| {s} | {bt} | {step:.2f} | {b * t / step:.1f} | "
                f"{flops / 1e9:.1f} G | {frac:.2f} | {e['peak'] / 1e9:.2f} | {peer} | "
                f"{e['load_before']:.0f}-{e['load_after']:.0f} |"
            )
    table = "\n".join(lines)
    print(table)
    if args.png:
        plot(entries, shapes, args.png)


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _file_name(fmt: str) -> str:
    return "Q4_K_M GGUF, kept" if fmt == "gguf" else "bf16 folder -> NF4"


def plot(entries: list[dict[str, Any]], shapes: list[str], path: str) -> None:
    """Step time per token and peak memory vs parameters, log-log, 1 x 512."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = []
    for s in shapes:
        e = latest(entries, shape=s, what="step", batch=1, seq=512)
        if e:
            step = sorted(e["step_s"][1:] or e["step_s"])[0]
            pts.append((e["params"], step / 512, e["peak"] / 1e9, s))
    if not pts:
        return
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, i, label in ((axes[0], 1, "step time per token (s)"),
                         (axes[1], 2, "peak RSS of the run (GB)")):  # fmt: skip
        x = [p[0] for p in pts]
        y = [p[i] for p in pts]
        ax.loglog(x, y, "o-", label="entrenar QLoRA, 1 x 512")
        ax.loglog(x, [y[0] * v / x[0] for v in x], "--", label="proportional")
        for p in pts:
            ax.annotate(p[3], (p[0], p[i]), fontsize=7)
        ax.set_xlabel("parameters")
        ax.set_ylabel(label)
        ax.legend(fontsize=8)
    fig.suptitle("Cost vs model size (Q4_K_M GGUF bases, rank 16 on every linear)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="smollm2-135m,smollm2-360m,tinyllama-1.1b")
    ap.add_argument("--what", default="load,step,peer")
    ap.add_argument("--formats", default="gguf,hf")
    ap.add_argument("--batches", default="1x512,4x128")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--out", default="/tmp/s12/scale")
    ap.add_argument("--json", default="/tmp/s12/scale/results.json")
    ap.add_argument("--report", action="store_true")
    ap.add_argument("--png", default=os.path.join(HERE, "results", "scale.png"))
    ap.add_argument("--child-load", nargs=2, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--child-step", nargs=4, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--child-read", nargs=2, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--child-fresh", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child_load:
        print(json.dumps(child_load(*args.child_load, args.out)))
    elif args.child_read:
        print(json.dumps(child_read(*args.child_read, args.out)))
    elif args.child_fresh is not None:
        print(json.dumps(child_fresh(args.child_fresh)))
    elif args.child_step:
        shape, *nums = args.child_step
        print(json.dumps(child_step(shape, *(int(v) for v in nums), args.out)))
    elif args.report:
        report(args)
    else:
        measure(args)


if __name__ == "__main__":
    main()
