"""Steps/s of `Trainer.fit` against the bare jitted step, same model, same run.

The model is a small Llama (causal LM loss on ``input_ids``/``labels``/
``attention_mask``), trained with AdamW. Variants, each after a warm-up step that
compiles it, timed over the same number of steps and interleaved repetition by
repetition in a rotating order (so machine noise hits all alike):

- ``bare``: ``state, m = step(state, batch)`` in a Python loop over pre-sliced numpy
  batches (``make_train_step`` with no guard), blocked on at the end;
- ``bare+guard``: the same with ``skip_nonfinite=True`` (the in-graph non-finite
  guard the Trainer always uses), to separate its cost from the loop's;
- ``bare+guard again``: a second, identical instance of ``bare+guard``: the spread
  between the two is the measurement's noise floor;
- ``fit``: ``Trainer.fit`` on a dict of arrays (its ArrayLoader shuffles and gathers
  each batch), logging every 10 steps, no progress bar, no output folder;
- ``fit+outputs``: the same with the tqdm bar and metrics.jsonl in an output folder
  (``checkpoint_every`` past the end, so the one final checkpoint is the only one;
  its time is part of the figure).

Reported per variant: the fastest and the median run's wall seconds, the median
process CPU seconds (all threads; steadier than wall time on a shared machine, and
the loop's Python work shows up in it), steps/s of the fastest run, and ratios
against ``bare+guard``, the same compiled program as ``fit``'s (target: ``fit``
under 3% over it). Part B times the loop alone: a model whose step costs almost
nothing, so ``fit - bare+guard`` per step is the Trainer's own work per step; it is
then expressed as a share of part A's step.

    python benchmarks/trainer.py                 # defaults below
    python benchmarks/trainer.py --steps 100 --reps 7 --hidden 256
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import tempfile
import time

import jax
import numpy as np

from entrenar.nn import MLP, LlamaConfig
from entrenar.optim import adamw
from entrenar.train import (
    TrainConfig,
    Trainer,
    TrainState,
    loss_for_model,
    make_train_step,
)


def make_data(n: int, seq: int, vocab: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    ids = rng.integers(0, vocab, (n, seq)).astype(np.int32)
    return {"input_ids": ids, "labels": ids.copy(),
            "attention_mask": np.ones((n, seq), bool)}  # fmt: skip


def bare_runner(model, params, data, batch, steps, guard):
    loss_fn = loss_for_model(model)
    tx = adamw(1e-3)
    step = make_train_step(loss_fn, tx, skip_nonfinite=guard)
    batches = [{k: v[i * batch : (i + 1) * batch] for k, v in data.items()}
               for i in range(steps + 1)]  # fmt: skip
    box = {"state": TrainState.create(params, tx, key=jax.random.key(0))}
    box["state"], m = step(box["state"], batches[0])  # compile
    jax.block_until_ready(m)

    def run() -> None:
        state = box["state"]
        for b in batches[1:]:
            state, m = step(state, b)
        jax.block_until_ready((state.trainable, m))
        box["state"] = state

    return run


def fit_runner(model, params, data, batch, steps, outputs):
    out = tempfile.mkdtemp() if outputs else None
    box: dict = {"done": 0}

    def make() -> Trainer:
        cfg = TrainConfig(batch_size=batch, max_steps=10**9, log_every=10,
                          progress=outputs, output_dir=out,
                          checkpoint_every=10**9)  # fmt: skip
        t = Trainer(model, params, adamw(1e-3), cfg)
        t.train_step({k: v[:batch] for k, v in data.items()})  # compile
        jax.block_until_ready(t.state.trainable)
        return t

    box["trainer"] = make()

    def run() -> None:
        t: Trainer = box["trainer"]
        start = t.step
        t.config = dataclasses.replace(t.config, max_steps=start + steps)
        t.fit(data)
        jax.block_until_ready(t.state.trainable)
        assert t.step == start + steps

    return run


def measure(model, params, data, batch, steps, reps) -> dict[str, dict[str, float]]:
    """Interleaved runs of the four variants: fastest/median wall, median CPU."""
    runners = {
        "bare": bare_runner(model, params, data, batch, steps, False),
        "bare+guard": bare_runner(model, params, data, batch, steps, True),
        "bare+guard again": bare_runner(model, params, data, batch, steps, True),
        "fit": fit_runner(model, params, data, batch, steps, False),
        "fit+outputs": fit_runner(model, params, data, batch, steps, True),
    }
    wall: dict[str, list[float]] = {k: [] for k in runners}
    cpu: dict[str, list[float]] = {k: [] for k in runners}
    names = list(runners)
    for rep in range(reps):
        for name in names[rep % len(names) :] + names[: rep % len(names)]:
            t0, c0 = time.perf_counter(), time.process_time()
            runners[name]()
            wall[name].append(time.perf_counter() - t0)
            cpu[name].append(time.process_time() - c0)
    return {
        k: {"best": min(wall[k]), "median": statistics.median(wall[k]),
            "cpu": statistics.median(cpu[k])}
        for k in names
    }  # fmt: skip


def table(res: dict[str, dict[str, float]], steps: int) -> None:
    b = res["bare+guard"]  # the very program the Trainer runs, in a bare loop
    print("| variant | fastest s | median s | steps/s (fastest) | us/step (fastest) "
          "| vs bare+guard (fastest) | median CPU s "
          "| vs bare+guard (CPU) |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for name, r in res.items():
        print(f"| {name} | {r['best']:.3f} | {r['median']:.3f} | "
              f"{steps / r['best']:.1f} | {1e6 * r['best'] / steps:.0f} | "
              f"{100 * (r['best'] / b['best'] - 1):+.1f}% | {r['cpu']:.3f} | "
              f"{100 * (r['cpu'] / b['cpu'] - 1):+.1f}% |")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--loop-steps", type=int, default=400)
    args = ap.parse_args()
    print(f"jax {jax.__version__} on {jax.devices()[0].platform}, "
          f"cpus={os.cpu_count()}, load average {os.getloadavg()[0]:.1f}")  # fmt: skip

    # A. A small Llama: the ratio the target is about.
    model = LlamaConfig(
        vocab_size=512, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
        num_layers=args.layers, num_heads=4, num_kv_heads=2,
        max_position_embeddings=args.seq,
    )  # fmt: skip
    data = make_data(args.batch * (args.steps + 1), args.seq, model.vocab_size)
    llama = measure(model, model.init(jax.random.key(0)), data, args.batch,
                    args.steps, args.reps)  # fmt: skip
    print(f"\nA. Llama D={args.hidden} L={args.layers}, batch {args.batch}x{args.seq}, "
          f"{args.steps} steps x {args.reps} reps")  # fmt: skip
    table(llama, args.steps)

    # B. The loop's own cost per step: a model whose step is nearly free.
    tiny = MLP((4, 4, 1))
    rng = np.random.default_rng(0)
    n = 8 * (args.loop_steps + 1)
    xy = {"x": rng.normal(size=(n, 4)).astype(np.float32),
          "y": rng.normal(size=(n, 1)).astype(np.float32)}  # fmt: skip
    loop = measure(tiny, tiny.init(jax.random.key(0)), xy, 8, args.loop_steps,
                   args.reps)  # fmt: skip
    print(f"\nB. MLP 4-4-1, batch 8, {args.loop_steps} steps x {args.reps} reps")
    table(loop, args.loop_steps)
    per_step = (loop["fit"]["best"] - loop["bare+guard"]["best"]) / args.loop_steps
    llama_step = llama["bare+guard"]["best"] / args.steps
    print(f"\nloop overhead of fit: {1e6 * per_step:.0f} us/step = "
          f"{100 * per_step / llama_step:.2f}% of A's bare+guard step "
          f"({1e3 * llama_step:.1f} ms)")  # fmt: skip


if __name__ == "__main__":
    main()
