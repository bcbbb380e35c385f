"""`TrainConfig`: how to run training, and the ``training:`` section of a run's YAML.

Steps count optimizer updates. A step consumes ``batch_size × grad_accum`` examples:
``grad_accum`` micro-batches of ``batch_size`` (in-memory data is batched that way;
a loader's batches are split in ``grad_accum`` parts). The learning-rate schedule is
part of the optimizer (``adamw(learning_rate=cosine(...))``), whose state holds it.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Literal

from entrenar.distributed import check_mesh_spec
from entrenar.errors import ConfigError
from entrenar.schema import Config, option

ComputeDtype = Literal["float32", "bfloat16", "float16"]
COMPUTE_DTYPES: tuple[str, ...] = typing.get_args(ComputeDtype)
Loss = Literal["auto", "cross_entropy", "mse", "l1", "huber",
               "binary_cross_entropy_with_logits"]  # fmt: skip
"""``auto`` and the `entrenar.nn.losses.LOSSES` between ``apply(x)`` and ``y``."""


@dataclasses.dataclass(frozen=True)
class TrainConfig(Config):
    """How to run training: the ``training:`` section of a run's YAML file.

    Every field is checked when a config is built (`entrenar.schema`). The fields
    that are not YAML keys a run sets from other sections (``data.batch_size``,
    ``data.shuffle``) or from the command line (``progress``).

    Example:
        >>> TrainConfig(epochs=2, batch_size=8).grad_accum
        1
        >>> TrainConfig(batch_size=0)
        Traceback (most recent call last):
        ...
        entrenar.errors.ConfigError: TrainConfig.batch_size: must be >= 1, got 0
    """

    epochs: int = option(
        1, ge=1, doc="passes over the data (ignored when `max_steps` is set)"
    )
    max_steps: int | None = option(
        None, ge=1, doc="optimizer steps, across as many epochs as needed"
    )
    grad_accum: int = option(
        1,
        ge=1,
        aliases=("gradient_accumulation_steps",),
        doc="micro-batches averaged into each optimizer step",
    )
    grad_clip: float | None = option(
        None,
        gt=0.0,
        aliases=("max_grad_norm",),
        doc="clip the global gradient norm to this value",
    )
    eval_every: int | None = option(
        None, ge=1, aliases=("eval_steps",), doc="steps between evaluations (default: "
        "each epoch's end)"
    )  # fmt: skip
    checkpoint_every: int | None = option(
        None,
        ge=1,
        aliases=("save_interval", "save_steps"),
        doc="steps between checkpoints (default: each epoch's end); one is also "
        "written when the run ends",
    )
    keep_checkpoints: int = option(3, ge=1, doc="most recent checkpoints kept")
    log_every: int = option(
        10, ge=1, doc="steps between metric lines (metrics.jsonl, progress bar)"
    )
    patience: int | None = option(
        None,
        ge=1,
        group="early_stopping",
        yaml_default=3,
        doc="stop after this many evaluations without improvement (needs validation "
        "data; null: never)",
    )
    min_delta: float = option(
        0.0,
        ge=0.0,
        group="early_stopping",
        doc="an eval loss improves when below best - min_delta",
    )
    seed: int = option(0, ge=0, doc="seed of initialisation, shuffling and dropout")
    output_dir: str | None = option(
        None,
        path="output",
        yaml_default="runs/run",
        doc="where metrics.jsonl, checkpoints/, the model and plots go (relative to "
        "the working directory); the library's null writes nothing",
    )
    compute_dtype: ComputeDtype | None = option(
        None,
        doc="cast float parameters to this dtype inside the loss (null: as stored); "
        "gradients and the optimizer stay in the parameters' dtype",
    )
    loss: Loss = option(
        "mse",
        yaml_default="auto",
        doc="models that are not language models: the loss between apply(x) and y "
        "(entrenar.nn.losses.LOSSES); auto: cross_entropy for classification, mse for "
        "regression (language models always use the causal LM loss)",
    )
    mesh: dict[str, int] | None = option(
        None,
        normalize=check_mesh_spec,
        doc="devices to train on, {data: N, fsdp: M} (N x M = the device count; "
        "one size may be -1: the rest); default: one device (specs/distributed.md)",
    )
    nonfinite: Literal["stop", "skip"] = option(
        "stop",
        doc="on a non-finite loss or gradient: stop (raise NonFiniteError) or skip "
        "(drop the update)",
    )
    tensorboard: bool = option(
        False, doc="also write TensorBoard events (needs entrenar[tensorboard])"
    )
    progress: bool = option(True, yaml=False, doc="show a tqdm progress bar")
    batch_size: int = option(
        32, ge=1, yaml=False, doc="examples per micro-batch of in-memory data"
    )
    shuffle: bool = option(
        True, yaml=False, doc="shuffle in-memory data each epoch (from (seed, epoch))"
    )
    drop_last: bool = option(
        True, yaml=False, doc="drop the last incomplete batch of in-memory data"
    )

    def check(self, path: str) -> None:
        """TensorBoard events need a folder."""
        if self.tensorboard and self.output_dir is None:
            raise ConfigError(f"{path}.tensorboard: needs an output_dir")


__all__ = ["COMPUTE_DTYPES", "ComputeDtype", "TrainConfig"]
