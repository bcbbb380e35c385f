"""A training run with the Trainer: handwritten digits, checkpoints, a resumed run.

scikit-learn's 8x8 handwritten digits (1,797 images, 10 classes) are split into
train / validation / test sets; an MLP 64-128-10 learns them with AdamW, a warm-up +
cosine learning-rate schedule, gradient clipping and early stopping on the validation
loss. The Trainer writes metrics.jsonl, checkpoints and loss.png to the output folder.

Then the run is repeated as if it had crashed: a first process stops at half the
steps, a second one resumes from its latest checkpoint; the resumed parameters and
optimizer state are compared with the uninterrupted run's, bit for bit.

Checked figures (the script exits with an error if one is missed):
  - test accuracy >= 95%
  - the resumed run equals the uninterrupted one exactly

    python examples/training_loop.py [--out runs/digits]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile

import jax
import numpy as np
from sklearn.datasets import load_digits

from entrenar.nn import MLP
from entrenar.optim import adamw, warmup_cosine_decay_schedule
from entrenar.train import TrainConfig, Trainer, plot

EPOCHS, BATCH_SIZE, PEAK_LR = 40, 64, 3e-3
MIN_TEST_ACCURACY = 0.95


def digits_split(seed: int = 0) -> tuple[dict[str, np.ndarray], ...]:
    """Train / validation / test dicts ``{"x": (n, 64) float32, "y": (n,) int32}``."""
    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32)  # pixel intensities 0..16 -> [0, 1]
    order = np.random.default_rng(seed).permutation(len(x))
    parts = np.split(order, [int(0.7 * len(x)), int(0.85 * len(x))])
    return tuple({"x": x[i], "y": y[i].astype(np.int32)} for i in parts)


def make_trainer(model: MLP, config: TrainConfig, steps: int) -> Trainer:
    schedule = warmup_cosine_decay_schedule(
        0.0,
        PEAK_LR,
        warmup_steps=steps // 20,
        decay_steps=steps,
        end_value=PEAK_LR / 20,
    )
    params = model.init(jax.random.key(0))
    return Trainer(model, params, adamw(schedule, weight_decay=1e-4), config)


def same_state(a, b) -> bool:
    la = jax.tree_util.tree_leaves((a.trainable, a.opt_state, a.step))
    lb = jax.tree_util.tree_leaves((b.trainable, b.opt_state, b.step))
    return len(la) == len(lb) and all(
        np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(la, lb)
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None, help="output folder (default: a temp dir)")
    args = ap.parse_args()
    out = args.out or tempfile.mkdtemp(prefix="entrenar-digits-")
    train, valid, test = digits_split()
    print(f"digits: {len(train['x'])} train, {len(valid['x'])} validation, "
          f"{len(test['x'])} test images; output in {out}")  # fmt: skip

    model = MLP((64, 128, 10), dropout=0.1)
    config = TrainConfig(
        epochs=EPOCHS, batch_size=BATCH_SIZE, grad_clip=1.0, loss="cross_entropy",
        log_every=10, patience=5, min_delta=1e-3, keep_checkpoints=2,
        output_dir=os.path.join(out, "full"), progress=False,
    )  # fmt: skip
    steps = EPOCHS * (len(train["x"]) // BATCH_SIZE)

    # 1. The whole run.
    result = make_trainer(model, config, steps).fit(train, valid)
    logits = model.apply(result.params, test["x"])  # (n, 10)
    accuracy = float(np.mean(np.argmax(logits, axis=-1) == test["y"]))
    last = result.history[-1]
    print(f"steps {result.steps} ({result.steps / (steps / EPOCHS):.0f} epochs), "
          f"stopped early: {result.stopped_early}")  # fmt: skip
    print(f"train loss {result.history[0]['loss']:.3f} -> {last['loss']:.3f}, "
          f"best validation loss {result.best_eval_loss:.4f} at step "
          f"{result.best_step}")  # fmt: skip
    print(f"test accuracy {accuracy:.1%} (threshold {MIN_TEST_ACCURACY:.0%})")
    print(f"loss plot: {plot(config.output_dir)}")

    # 2. The same run, interrupted at half its steps, then resumed from disk.
    crashed = dataclasses.replace(
        config, output_dir=os.path.join(out, "resumed"), max_steps=result.steps // 2
    )
    make_trainer(model, crashed, steps).fit(train, valid)  # "crashes" half-way
    again = dataclasses.replace(crashed, max_steps=None)
    resumed = make_trainer(model, again, steps).fit(train, valid, resume="latest")
    identical = same_state(result.state, resumed.state)
    print(f"resumed at step {result.steps // 2}; resumed run identical: {identical}")

    failures = []
    if accuracy < MIN_TEST_ACCURACY:
        failures.append(f"test accuracy {accuracy:.1%} < {MIN_TEST_ACCURACY:.0%}")
    if not identical:
        failures.append("the resumed run differs from the uninterrupted one")
    if failures:
        sys.exit("FAILED: " + "; ".join(failures))
    print("all checks passed")


if __name__ == "__main__":
    main()
