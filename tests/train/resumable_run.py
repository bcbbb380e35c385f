"""A small training run that test_kill_resume.py kills and resumes in a subprocess.

Usage: ``python resumable_run.py OUTPUT_DIR``. It prints ``STEP n`` after each step
(flushed, so the parent can kill it at a chosen step) and resumes from the latest
checkpoint in OUTPUT_DIR if there is one. With ``HANG_AT_CHECKPOINT=n`` it writes
checkpoint ``n`` completely but stops before orbax's final rename, prints ``HANG``
and sleeps: the parent kills it there, mid-write.
"""

import os
import sys
import time

import jax
import numpy as np

from entrenar.nn import MLP
from entrenar.optim import adamw, cosine_decay_schedule
from entrenar.train import Callback, TrainConfig, Trainer

MAX_STEPS = 20


def build(output_dir):
    """The Trainer and data of the run (also the test's restore template)."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(40, 4)).astype(np.float32)
    y = np.sin(x @ rng.normal(size=(4, 2))).astype(np.float32)
    model = MLP((4, 16, 2), dropout=0.1)  # dropout: the step keys matter
    cfg = TrainConfig(
        max_steps=MAX_STEPS, batch_size=4, grad_accum=2, grad_clip=1.0,
        log_every=3, eval_every=4, checkpoint_every=1, keep_checkpoints=100,
        seed=3, output_dir=output_dir, progress=False,
    )  # fmt: skip
    tx = adamw(cosine_decay_schedule(0.05, MAX_STEPS), weight_decay=0.01)
    trainer = Trainer(model, model.init(jax.random.key(1)), tx, cfg,
                      callbacks=[Announce()])  # fmt: skip
    return trainer, {"x": x[:32], "y": y[:32]}, {"x": x[32:], "y": y[32:]}


class Announce(Callback):
    def on_step(self, trainer, step, metrics):
        jax.block_until_ready(metrics)
        print(f"STEP {step}", flush=True)


def hang_before_rename(step):
    """Make orbax stop, forever, just before it renames checkpoint ``step`` in."""
    from orbax.checkpoint._src.path import atomicity

    original = atomicity.AtomicRenameTemporaryPath.finalize

    async def finalize(self, *args, **kwargs):
        if self._final_path.name == str(step):
            print("HANG", flush=True)
            time.sleep(600)
        return await original(self, *args, **kwargs)

    atomicity.AtomicRenameTemporaryPath.finalize = finalize


if __name__ == "__main__":
    if os.environ.get("HANG_AT_CHECKPOINT"):
        hang_before_rename(int(os.environ["HANG_AT_CHECKPOINT"]))
    trainer, train, evals = build(sys.argv[1])
    trainer.fit(train, evals, resume="latest")
    print("DONE", flush=True)
