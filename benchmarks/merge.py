"""TIES over three SmolLM2-135M-sized trees: entrenar vs mergekit, one process each.

The trees (a base and two fine-tuned relatives, float32, SmolLM2-135M's shapes:
134.5M parameters, 538 MB each) are generated once and written as safetensors.
Each contestant then runs in its own process, so its peak resident memory
(``ru_maxrss``) is its own:

1. entrenar, in memory: ``merge.ties(base, [a, b], density)`` over the stacked trees
   read into memory (one jitted program per leaf shape, per layer);
2. entrenar, from files: ``merge.run_recipe`` of the same TIES recipe, reading the
   memory-mapped safetensors leaf by leaf and writing ``merged.safetensors``;
3. mergekit 0.1.5: ``merge_state_dicts(..., "ties")`` over the same tensors as torch
   state dicts with Hugging Face's per-layer names (what mergekit merges), in memory.

Times are the median of ``--repeats`` runs after a first one (which, for entrenar,
includes compiling). Peak memory is the peak resident size (``ru_maxrss``, which
counts the touched pages of memory-mapped files), that peak above the resident size
once the inputs are loaded, and the peak private (anonymous) memory, sampled every
10 ms, which leaves out the mapped input files. The processes also save two merged
tensors, compared at the end.

Usage: ``python benchmarks/merge.py [--layers 30] [--density 0.5] [--repeats 2]``
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

CHECK = ("model.layers.self_attn.q_proj.weight", "model.embed_tokens.weight")


def status_mib(field: str = "VmRSS") -> float:
    """A memory field of /proc/self/status in MiB (VmRSS, RssAnon, RssFile)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return float("nan")


class AnonPeak:
    """Peak RssAnon, sampled every 10 ms.

    Private memory only: it leaves out the pages of memory-mapped input files
    (clean and reclaimable, but counted by ``ru_maxrss``).
    """

    def __init__(self) -> None:
        self.peak = status_mib("RssAnon")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.01):
            self.peak = max(self.peak, status_mib("RssAnon"))

    def stop(self) -> float:
        self._stop.set()
        self._thread.join()
        return max(self.peak, status_mib("RssAnon"))


def peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def make_files(folder: str, layers: int) -> None:
    from entrenar import io
    from entrenar.nn import LlamaConfig

    cfg = dataclasses.replace(LlamaConfig.smollm2_135m(), num_layers=layers)
    rng = np.random.default_rng(0)

    def fill(shapes, scale, like=None):
        out = {}
        for k, v in shapes.items():
            if isinstance(v, dict):
                out[k] = fill(v, scale, like[k] if like else None)
            else:
                x = (scale * rng.standard_normal(v, np.float32)).astype(np.float32)
                out[k] = x if like is None else x + like[k]
        return out

    base = fill(cfg.param_shapes(), 0.02)
    for name, tree in (("base", base), ("a", None), ("b", None)):
        tree = tree or fill(cfg.param_shapes(), 0.002, base)
        meta = io.ModelMetadata(name, "llama")
        io.save_model(io.Model(meta, tree), os.path.join(folder, f"{name}.safetensors"))


def load_flat(folder: str) -> list[dict[str, np.ndarray]]:
    from entrenar.io import read_safetensors

    out = []
    for name in ("base", "a", "b"):
        tensors, _ = read_safetensors(os.path.join(folder, f"{name}.safetensors"))
        out.append({k: np.array(v) for k, v in tensors.items()})  # into memory
    return out


def timed(fn, repeats: int) -> tuple[float, list[float], object]:
    t0 = time.perf_counter()
    out = fn()
    first = time.perf_counter() - t0
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return first, times, out


def worker(kind: str, folder: str, density: float, repeats: int) -> None:
    import jax

    from entrenar import merge
    from entrenar.io import unflatten_params
    from entrenar.tree import tree_named_leaves

    report: dict[str, object] = {"kind": kind}
    sampler = AnonPeak()
    checks: dict[str, np.ndarray] = {}
    if kind == "entrenar":
        base, a, b = (unflatten_params(t) for t in load_flat(folder))
        report["rss_loaded_mib"] = status_mib()

        def run():
            out = merge.ties(base, [a, b], density)
            return jax.block_until_ready(out)

        first, times, out = timed(run, repeats)
        flat = dict(tree_named_leaves(out))
        checks = {k: np.asarray(flat[k]) for k in CHECK}
    elif kind == "entrenar_files":
        report["rss_loaded_mib"] = status_mib()
        recipe = {
            "merge_method": "ties",
            "base_model": os.path.join(folder, "base.safetensors"),
            "models": [
                {"model": os.path.join(folder, f"{m}.safetensors")} for m in "ab"
            ],
            "parameters": {"weight": 1.0, "density": density},
        }
        target = os.path.join(folder, "merged.safetensors")
        first, times, _ = timed(lambda: merge.run_recipe(recipe, target), repeats)
        flat = merge.open_model(merge.ModelRef(target)).leaves
        checks = {k: np.array(flat[k]) for k in CHECK}
    else:
        import torch
        from mergekit.merge_methods import merge_state_dicts

        torch.set_grad_enabled(False)
        dicts = []
        for tree in load_flat(folder):  # stacked -> per-layer Hugging Face names
            sd = {}
            for name, x in tree.items():
                if ".layers." in name:
                    head, tail = name.split(".layers.")
                    for i in range(x.shape[0]):
                        sd[f"{head}.layers.{i}.{tail}"] = torch.from_numpy(x[i])
                else:
                    sd[name] = torch.from_numpy(x)
            dicts.append(sd)
        report["rss_loaded_mib"] = status_mib()
        params = {"weight": [1.0, 1.0], "density": [density, density]}

        def run():
            return merge_state_dicts(dicts, "ties", parameters=params, base=0)

        first, times, out = timed(run, repeats)
        q = CHECK[0].replace(".layers.", ".layers.{}.")
        layers = sum(1 for k in out if k.startswith("model.layers.") and "q_proj" in k)
        checks = {
            CHECK[0]: np.stack([out[q.format(i)].numpy() for i in range(layers)]),
            CHECK[1]: out[CHECK[1]].numpy(),
        }
    report.update(
        first_s=first, times_s=times, peak_mib=peak_mib(), anon_peak_mib=sampler.stop()
    )
    np.savez(os.path.join(folder, f"check_{kind}.npz"), **checks)
    print(json.dumps(report))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--density", type=float, default=0.5)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--worker", nargs=2, metavar=("KIND", "FOLDER"))
    args = ap.parse_args()
    if args.worker:
        worker(args.worker[0], args.worker[1], args.density, args.repeats)
        return
    import jax

    with tempfile.TemporaryDirectory() as folder:
        make_files(folder, args.layers)
        size = os.path.getsize(os.path.join(folder, "base.safetensors")) / 2**20
        print(
            f"# TIES (density {args.density}) of a base and 2 models, "
            f"{args.layers} layers, {size:.0f} MiB each; {platform.machine()}, "
            f"{os.cpu_count()} CPUs, jax {jax.__version__}, load "
            f"{os.getloadavg()[0]:.1f}; median of {args.repeats} after a first run"
        )
        rows = {}
        for kind in ("entrenar", "entrenar_files", "mergekit"):
            cmd = [sys.executable, __file__, "--worker", kind, folder]
            cmd += ["--density", str(args.density), "--repeats", str(args.repeats)]
            done = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if done.returncode:
                print(f"{kind}: failed\n{done.stderr[-2000:]}")
                continue
            rows[kind] = json.loads(done.stdout.strip().splitlines()[-1])
        peer = rows.get("mergekit")
        print(
            "| contestant | first s | median s | / mergekit | peak RSS MiB | "
            "above loaded | peak private MiB |"
        )
        print("|---|---|---|---|---|---|---|")
        for kind, r in rows.items():
            med = float(np.median(r["times_s"]))
            ratio = med / float(np.median(peer["times_s"])) if peer else float("nan")
            print(
                f"| {kind} | {r['first_s']:.2f} | {med:.2f} | {ratio:.2f} | "
                f"{r['peak_mib']:.0f} | {r['peak_mib'] - r['rss_loaded_mib']:.0f} | "
                f"{r['anon_peak_mib']:.0f} |"
            )
        if peer:
            want = np.load(os.path.join(folder, "check_mergekit.npz"))
            for kind in rows:
                got = np.load(os.path.join(folder, f"check_{kind}.npz"))
                diff = max(float(np.max(np.abs(got[k] - want[k]))) for k in CHECK)
                n = sum(int(np.sum(got[k] != want[k])) for k in CHECK)
                total = sum(want[k].size for k in CHECK)
                print(
                    f"# {kind} vs mergekit on {CHECK}: {n} of {total} values differ, "
                    f"by at most {diff:.2e} (magnitudes tied at the trim threshold: "
                    "entrenar keeps them all, mergekit exactly k)"
                )


if __name__ == "__main__":
    main()
