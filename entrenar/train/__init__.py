"""Training runs: `TrainState`, jitted steps, the `Trainer`, checkpoints, metrics.

Protocol::

    loss_fn(params, batch, *, key) -> loss | (loss, metrics)   # batch: dict of arrays
    state = TrainState.create(params, optimizer, key=key, trainable=None|"lora"|mask)
    step = make_train_step(loss_fn, optimizer, grad_accum=k, clip=c)
    state, metrics = step(state, batch)                         # jitted, donated

or, with the loop, logging, evaluation, early stopping and resumable checkpoints::

    result = Trainer(loss_fn_or_model, params, optimizer, TrainConfig(...)).fit(
        train_data, eval_data, resume=None | "latest" | path)

Math and file formats: specs/trainer.md.
"""

from entrenar.train.callbacks import Callback
from entrenar.train.checkpoint import Checkpointer
from entrenar.train.config import TrainConfig
from entrenar.train.model_loss import (
    causal_lm_loss_fn,
    loss_for_model,
    supervised_loss_fn,
)
from entrenar.train.plot import plot, read_metrics
from entrenar.train.state import TrainState, combine, partition
from entrenar.train.step import make_eval_step, make_train_step
from entrenar.train.trainer import Trainer, TrainResult

__all__ = [
    "Callback",
    "Checkpointer",
    "TrainConfig",
    "TrainResult",
    "TrainState",
    "Trainer",
    "causal_lm_loss_fn",
    "combine",
    "loss_for_model",
    "make_eval_step",
    "make_train_step",
    "partition",
    "plot",
    "read_metrics",
    "supervised_loss_fn",
]
