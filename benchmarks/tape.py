"""Tape overhead, measured against peers in the same run.

(a) The quickstart loop (100 epochs x 4 samples, SGD) with the eager Tensor API vs the
    same loop in PyTorch eager autograd (when torch is installed).
(b) A jitted Tensor-API MLP train step vs the same step written with ``jax.grad``.
(c) Eager loops whose shapes change every step (`tape_shapes.py`): issue 20's loop
    over sizes 1..N and a variable-length sequence model step, against PyTorch eager
    and against the engine of an older commit, each in its own process (RSS).

    python benchmarks/tape.py [--repeats 5] [--baseline-commit REV] [--skip-ab]

Targets: (a) no slower than PyTorch eager; (b) within 2% of jax.grad; (c) memory
growth < 100 MB over 1,000 distinct shapes, 400 steps in <= 1/5 of the old engine's
time, the same-shape loop no slower than the old engine.
"""

from __future__ import annotations

import argparse
import collections
import re
import statistics
import time

import jax
import jax.numpy as jnp

import entrenar.autograd as ag
from entrenar import Tensor, backward
from entrenar.nn.losses import cross_entropy
from entrenar.optim import SGD

X_DATA, Y_DATA = [1.0, 2.0, 3.0, 4.0], [3.0, 5.0, 7.0, 9.0]


def make_quickstart_entrenar():
    """The quickstart loop; parameters and optimizer are made once, reset per run."""
    w = Tensor.from_vec([0.0], requires_grad=True)
    b = Tensor.from_vec([0.0], requires_grad=True)
    opt = SGD(lr=0.01, momentum=0.0)

    def run(epochs: int = 100) -> float:
        w.data, b.data = jnp.zeros(1), jnp.zeros(1)
        for _ in range(epochs):
            total = 0.0
            for x, y in zip(X_DATA, Y_DATA):
                diff = w * Tensor.from_vec([x]) + b - Tensor.from_vec([y])
                loss = diff * diff
                total += loss.item()
                backward(loss)
                opt.step([w, b])
                opt.zero_grad([w, b])
        return w.item()

    return run


def quickstart_torch(epochs: int = 100) -> float:
    import torch

    w = torch.zeros(1, requires_grad=True)
    b = torch.zeros(1, requires_grad=True)
    opt = torch.optim.SGD([w, b], lr=0.01, momentum=0.0)
    for _ in range(epochs):
        total = 0.0
        for x, y in zip(X_DATA, Y_DATA):
            diff = w * torch.tensor([x]) + b - torch.tensor([y])
            loss = diff * diff
            total += loss.item()
            loss.backward()
            opt.step()
            opt.zero_grad()
    return float(w.item())


def timed(fn, repeats: int) -> float:
    fn()  # warm-up (compiles)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def mlp_params(key, sizes):
    keys = jax.random.split(key, len(sizes) - 1)
    return [
        (jax.random.normal(k, (m, n)) / jnp.sqrt(m), jnp.zeros(n))
        for k, m, n in zip(keys, sizes[:-1], sizes[1:])
    ]


def mlp_loss_jnp(params, x, y):
    h = x
    for i, (w, b) in enumerate(params):
        h = h @ w + b
        if i < len(params) - 1:
            h = jax.nn.relu(h)
    # the function ag.cross_entropy records: positions with y == -100 ignored
    return cross_entropy(h, y)


def mlp_loss_tensor(params, x, y):
    h = x
    for i, (w, b) in enumerate(params):
        h = h @ w + b
        if i < len(params) - 1:
            h = ag.relu(h)
    return ag.cross_entropy(h, y)


@jax.jit
def step_tensor(params, x, y):
    tps = [(Tensor(w, True), Tensor(b, True)) for w, b in params]
    loss = mlp_loss_tensor(tps, x, y)
    backward(loss)
    new = [(w.data - 0.01 * w.grad, b.data - 0.01 * b.grad) for w, b in tps]
    return new, loss.data


@jax.jit
def step_jax(params, x, y):
    loss, g = jax.value_and_grad(mlp_loss_jnp)(params, x, y)
    new = jax.tree_util.tree_map(lambda p, gi: p - 0.01 * gi, params, g)
    return new, loss


def op_histogram(compiled_text: str) -> collections.Counter:
    """Count the HLO instructions of a compiled computation by opcode."""
    return collections.Counter(re.findall(r"= \S+ (\w+)\(", compiled_text))


def bench_mlp(repeats: int, iters: int = 20) -> tuple[float, float]:
    params = mlp_params(jax.random.key(0), [512, 1024, 1024, 10])
    x = jax.random.normal(jax.random.key(1), (256, 512))
    y = jax.random.randint(jax.random.key(2), (256,), 0, 10)

    def run(step):
        def go():
            p = params
            for _ in range(iters):
                p, loss = step(p, x, y)
            jax.block_until_ready(loss)

        return go

    same = op_histogram(step_tensor.lower(params, x, y).compile().as_text()) == (
        op_histogram(step_jax.lower(params, x, y).compile().as_text())
    )
    print(f"(b) compiled HLO of both steps has the same instructions: {same}")
    # interleave the two, alternating which goes first, so noise hits both alike
    t_tensor, t_jax = [], []
    run(step_tensor)()
    run(step_jax)()
    for i in range(3 * repeats):
        pair = [(t_tensor, step_tensor), (t_jax, step_jax)]
        for times, step in pair if i % 2 else pair[::-1]:
            times.append(timed(run(step), 1))
    return statistics.median(t_tensor) / iters, statistics.median(t_jax) / iters


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--baseline-commit", default=None, help="old engine for (c)")
    ap.add_argument("--skip-ab", action="store_true", help="run only (c)")
    a = ap.parse_args()
    print(f"jax {jax.__version__}, devices {jax.devices()}")
    if not a.skip_ab:
        bench_ab(a.repeats)
    import tape_shapes

    tape_shapes.run_all(a.baseline_commit)


def bench_ab(repeats: int) -> None:
    """(a) the quickstart loop vs PyTorch eager; (b) the jitted MLP step vs jax.grad."""
    t0 = time.perf_counter()
    quickstart_entrenar = make_quickstart_entrenar()
    quickstart_entrenar()
    t_cold = time.perf_counter() - t0
    print(f"(a) first run of the quickstart, compiles included: {t_cold * 1e3:.0f} ms")
    t_ours = timed(quickstart_entrenar, repeats)
    print(
        f"(a) quickstart 100 epochs x 4 samples, entrenar eager: {t_ours * 1e3:.1f} ms"
        f" ({t_ours / 400 * 1e6:.0f} us/step)"
    )
    try:
        import torch

        torch.set_num_threads(1)
        t_torch = timed(quickstart_torch, repeats)
        print(
            f"    PyTorch {torch.__version__} eager autograd: {t_torch * 1e3:.1f} ms"
            f" ({t_torch / 400 * 1e6:.0f} us/step)"
        )
        print(f"    ratio entrenar / torch = {t_ours / t_torch:.2f} (target <= 1.0)")
    except ImportError:
        print("    torch not installed: no peer")

    t_t, t_j = bench_mlp(repeats)
    print(
        f"(b) jitted MLP step 512-1024-1024-10, batch 256: Tensor API "
        f"{t_t * 1e3:.2f} ms, jax.grad {t_j * 1e3:.2f} ms, "
        f"ratio {t_t / t_j:.3f} (target <= 1.02)"
    )


if __name__ == "__main__":
    main()
