"""(c) of benchmarks/tape.py: eager loops whose shapes change, each in its own process.

Cases (one child process per case and implementation, so RSS is that loop's own):

* ``issue``: issue 20's loop, ``for n in 1..N``: ``w = ones(n)`` (requires grad),
  ``x = arange(n)``, ``loss = ((w*x + 1)*(w*x + 1)).sum()``, backward, read ``w.grad``.
* ``same``: the same loop at one size (n = 256) N times (the same-shape loop).
* ``quick``: the quickstart's loop (y = 2x + 1, one sample a step, the loss read with
  ``.item()`` before backward, SGD) for N steps: the other same-shape loop.
* ``seq``: a variable-length sequence model step: embedding 64 x 32 -> tanh(x W1 + b1)
  (64) -> logits (64), softmax cross-entropy (in Tensor ops: max, exp, sum, log), the
  loss read with ``.item()``, backward, SGD(lr 0.1); one new length T in 8..8+N per
  step, shuffled.

Implementations: ``entrenar`` (this tree), ``nobucket`` (this tree with shape buckets
off: exact programs in the bounded cache), ``jax-eager`` (issue loop only: eager jnp
and ``jax.vjp`` op by op, the other cheap path considered), ``old`` (entrenar at
``--baseline-commit``, exported with ``git archive`` and imported instead of this
tree: "today" before issue 20),
``torch`` (PyTorch eager, one thread). Each child prints one JSON line: seconds for
the loop (same-shape loops: warm, and the first run apart), RSS before and after it,
the process's peak RSS, and a check value (the last gradient's sum, the last loss or
the learned weight) that must agree between implementations.

    python benchmarks/tape.py --skip-ab --baseline-commit REV   # all of (c)
    python benchmarks/tape_shapes.py CASE IMPL STEPS   # one child
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

V, D, H = 64, 32, 64  # vocabulary, embedding and hidden sizes of the seq model


def rss_mb(field: str = "VmRSS") -> float:
    """Resident set size of this process now (``VmHWM``: its peak), in MiB.

    (``getrusage``'s peak would include the parent's, inherited across fork.)
    """
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def seq_data(steps: int) -> tuple[list[np.ndarray], list[tuple]]:
    """Initial parameters and (ids, next ids) of one new length per step."""
    rng = np.random.default_rng(0)
    init = [
        rng.normal(size=(V, D)).astype(np.float32),
        (rng.normal(size=(D, H)) / np.sqrt(D)).astype(np.float32),
        np.zeros(H, np.float32),
        (rng.normal(size=(H, V)) / np.sqrt(H)).astype(np.float32),
    ]
    batches = []
    for t in rng.permutation(np.arange(8, 8 + steps)):
        ids = rng.integers(0, V, int(t) + 1).astype(np.int32)
        batches.append((ids[:-1], ids[1:]))
    return init, batches


def loops_entrenar() -> dict:
    """The loops in entrenar's eager Tensor API; each returns a check value."""
    from entrenar.autograd import Tensor, backward
    from entrenar.optim import SGD

    def sizes_loop(sizes) -> float:
        for n in sizes:
            w = Tensor(np.ones(n, np.float32), requires_grad=True)
            x = Tensor(np.arange(n, dtype=np.float32))
            loss = ((w * x + 1.0) * (w * x + 1.0)).sum()
            backward(loss)
            g = w.grad
        return float(np.asarray(g).sum())

    def quick(steps: int) -> float:  # the quickstart: y = 2x + 1, loss read first
        w, b = Tensor.from_vec([0.0], True), Tensor.from_vec([0.0], True)
        opt = SGD(lr=0.01)
        for i in range(steps):
            x, y = float(i % 4 + 1), float(2 * (i % 4) + 3)
            diff = w * Tensor.from_vec([x]) + b - Tensor.from_vec([y])
            loss = diff * diff
            loss.item()
            backward(loss)
            opt.step([w, b])
            opt.zero_grad([w, b])
        return w.item()

    def seq(steps: int) -> float:
        init, batches = seq_data(steps)
        params = [Tensor(p, requires_grad=True) for p in init]
        emb, w1, b1, w2 = params
        opt = SGD(lr=0.1)
        eye = np.eye(V, dtype=np.float32)
        for ids, tgt in batches:
            h = (emb[ids] @ w1 + b1).tanh()  # (T, H)
            z = h @ w2  # (T, V)
            m = z.max(axis=-1, keepdims=True).detach()  # (T, 1)
            lse = (z - m).exp().sum(axis=-1, keepdims=True).log() + m  # (T, 1)
            loss = ((lse - z) * eye[tgt]).sum() / len(ids)  # mean cross-entropy
            check = loss.item()
            backward(loss)
            opt.step(params)
            opt.zero_grad(params)
        return check

    return dict(
        issue=lambda steps: sizes_loop(range(1, steps + 1)),
        same=lambda steps: sizes_loop([256] * steps),
        quick=quick,
        seq=seq,
    )


def loops_jax_eager() -> dict:
    """The issue loop op by op: eager jnp and ``jax.vjp``, no whole-graph program.

    The "cheap path" alternative to buckets (each primitive compiles per shape).
    """
    import jax
    import jax.numpy as jnp

    def sizes_loop(sizes) -> float:
        for n in sizes:
            x = jnp.arange(n, dtype=jnp.float32)
            loss, vjp = jax.vjp(
                lambda w, x=x: ((w * x + 1.0) * (w * x + 1.0)).sum(), jnp.ones(n)
            )
            (g,) = vjp(jnp.ones_like(loss))
        return float(g.sum())

    return dict(issue=lambda steps: sizes_loop(range(1, steps + 1)))


def loops_torch() -> dict:
    """The same loops in PyTorch eager (one thread)."""
    import torch

    torch.set_num_threads(1)

    def sizes_loop(sizes) -> float:
        for n in sizes:
            w = torch.ones(n, requires_grad=True)
            x = torch.arange(n, dtype=torch.float32)
            loss = ((w * x + 1.0) * (w * x + 1.0)).sum()
            loss.backward()
            g = w.grad
        return float(g.sum())

    def quick(steps: int) -> float:
        w, b = torch.zeros(1, requires_grad=True), torch.zeros(1, requires_grad=True)
        opt = torch.optim.SGD([w, b], lr=0.01)
        for i in range(steps):
            x, y = float(i % 4 + 1), float(2 * (i % 4) + 3)
            diff = w * torch.tensor([x]) + b - torch.tensor([y])
            loss = diff * diff
            loss.item()
            loss.backward()
            opt.step()
            opt.zero_grad()
        return float(w.item())

    def seq(steps: int) -> float:
        init, batches = seq_data(steps)
        params = [torch.tensor(p, requires_grad=True) for p in init]
        emb, w1, b1, w2 = params
        opt = torch.optim.SGD(params, lr=0.1)
        for ids, tgt in batches:
            ids_t, tgt_t = torch.from_numpy(ids).long(), torch.from_numpy(tgt).long()
            z = torch.tanh(emb[ids_t] @ w1 + b1) @ w2
            loss = torch.nn.functional.cross_entropy(z, tgt_t)
            check = loss.item()
            loss.backward()
            opt.step()
            opt.zero_grad()
        return check

    return dict(
        issue=lambda steps: sizes_loop(range(1, steps + 1)),
        same=lambda steps: sizes_loop([256] * steps),
        quick=quick,
        seq=seq,
    )


def use_old_entrenar(root: str) -> None:
    """Import entrenar from ``root``: ahead of the path and of the editable install."""
    sys.meta_path[:] = [
        f for f in sys.meta_path if "__editable__" not in getattr(f, "__module__", "")
    ]
    sys.path.insert(0, root)


def child(case: str, impl: str, steps: int) -> None:
    """Run one loop and print its JSON line.

    Loops over new shapes (issue, seq) run once; same-shape loops (same, quick) run
    three times and report the median of the two warm runs, plus the first run's time.
    """
    if impl == "old":
        use_old_entrenar(os.environ["ENTRENAR_OLD_ROOT"])
    if impl == "torch":
        loops = loops_torch()
    else:
        import jax.numpy as jnp

        jnp.zeros(1).block_until_ready()  # the backend is up before the clock starts
        loops = loops_jax_eager() if impl == "jax-eager" else loops_entrenar()
    if impl == "nobucket":  # choice A: exact programs only, in the bounded cache
        from entrenar.autograd import engine

        engine.SHAPES_BEFORE_BUCKETING = 10**9
    before = rss_mb()
    times, cpu = [], []
    for _ in range(3 if case in ("same", "quick") else 1):
        t0, c0 = time.perf_counter(), time.process_time()
        check = loops[case](steps)
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    after = rss_mb()
    peak = rss_mb("VmHWM")
    source = sys.modules["entrenar"].__file__ if "entrenar" in sys.modules else ""
    result = dict(
        seconds=float(np.median(times[1:])) if len(times) > 1 else times[0],
        cpu=float(np.median(cpu[1:])) if len(cpu) > 1 else cpu[0],
        first=times[0],
        before=before,
        after=after,
        peak=peak,
        check=check,
        src=source,
    )
    print(json.dumps(result))


def spawn(case: str, impl: str, steps: int, old_root: str | None) -> dict:
    """Run one child process and return its JSON result."""
    env = dict(os.environ)
    if impl == "old":
        env["ENTRENAR_OLD_ROOT"] = old_root
    out = subprocess.run(
        [sys.executable, __file__, case, impl, str(steps)],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


def export_commit(rev: str) -> str:
    """Export ``entrenar/`` at ``rev`` to a temporary directory; returns its path."""
    root = tempfile.mkdtemp(prefix="entrenar-old-")
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    archive = subprocess.run(
        ["git", "-C", repo, "archive", rev, "entrenar"], capture_output=True, check=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", root], input=archive, check=True)
    return root


def run_all(baseline_commit: str | None) -> None:
    """Run every case and print one table row per (case, implementation)."""
    old_root = export_commit(baseline_commit) if baseline_commit else None
    plan = [
        ("issue", 100, ["entrenar", "nobucket", "jax-eager", "old", "torch"]),
        ("issue", 400, ["entrenar", "nobucket", "old", "torch"]),
        ("issue", 1000, ["entrenar", "torch"]),
        ("same", 400, ["entrenar", "old", "torch"]),
        ("quick", 400, ["entrenar", "old", "torch"]),
        ("seq", 100, ["entrenar", "old", "torch"]),
        ("seq", 400, ["entrenar", "torch"]),
    ]
    print(
        "(c) case     steps impl       seconds  x torch  x old   cpu s  cpu x old"
        "  RSS +MB  peak MB  check"
    )
    for case, steps, impls in plan:
        rows = {
            impl: spawn(case, impl, steps, old_root)
            for impl in impls
            if impl != "old" or old_root is not None
        }
        for impl, r in rows.items():
            vs_torch = r["seconds"] / rows["torch"]["seconds"]
            old = rows.get("old")
            vs_old = r["seconds"] / old["seconds"] if old else float("nan")
            cpu_old = r["cpu"] / old["cpu"] if old else float("nan")
            print(
                f"    {case:8s} {steps:5d} {impl:9s} {r['seconds']:8.3f}"
                f" {vs_torch:8.1f} {vs_old:6.3f} {r['cpu']:7.3f} {cpu_old:10.3f}"
                f" {r['after'] - r['before']:8.0f} {r['peak']:8.0f}  {r['check']:.6g}",
                flush=True,
            )


if __name__ == "__main__":
    child(sys.argv[1], sys.argv[2], int(sys.argv[3]))
