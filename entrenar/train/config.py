"""`TrainConfig`: one flat, frozen, validated dataclass for a run.

Steps count optimizer updates. A step consumes ``batch_size × grad_accum`` examples:
``grad_accum`` micro-batches of ``batch_size`` (in-memory data is batched that way;
a loader's batches are split in ``grad_accum`` parts). The learning-rate schedule is
part of the optimizer (``adamw(learning_rate=cosine(...))``), whose state holds it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from entrenar.distributed import check_mesh_spec
from entrenar.errors import ConfigError
from entrenar.nn.losses import LOSSES

COMPUTE_DTYPES = ("float32", "bfloat16", "float16")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """How to run training.

    Attributes:
        epochs: passes over the training data (ignored when ``max_steps`` is set).
        max_steps: optimizer steps to take, across as many epochs as needed.
        batch_size: examples per micro-batch for in-memory data.
        grad_accum: micro-batches per optimizer step.
        grad_clip: clip gradients to this global norm (None: no clipping).
        log_every: steps between log lines (metrics.jsonl, progress bar, history).
        eval_every: steps between evaluations; None: at the end of each epoch.
        checkpoint_every: steps between checkpoints; None: at the end of each epoch.
            Checkpoints need ``output_dir``; one is also written when the run ends.
        keep_checkpoints: how many recent checkpoints to keep.
        patience: evaluations without improvement before stopping (None: never).
        min_delta: an eval loss improves when it is below ``best - min_delta``.
        seed: the root of every random choice (shuffling, the step keys).
        output_dir: where metrics.jsonl, TensorBoard events and checkpoints go.
        compute_dtype: cast float params to this dtype inside the loss (None: as
            stored). Gradients and the optimizer stay in the params' dtype.
        nonfinite: "stop" (raise `NonFiniteError`) or "skip" (drop the update) on a
            non-finite loss or gradient.
        progress: show a tqdm progress bar.
        tensorboard: also write TensorBoard events (needs ``entrenar[tensorboard]``).
        loss: for models that are not language models: a name in
            ``entrenar.nn.losses.LOSSES`` (batches with ``x`` and ``y``).
        shuffle: shuffle in-memory data each epoch (order from ``(seed, epoch)``).
        drop_last: drop the last incomplete batch of in-memory data.
        mesh: devices to train on, ``{"data": N, "fsdp": M}`` (one size may be -1:
            the remaining devices); None: one device. See specs/distributed.md.

    Example:
        >>> TrainConfig(epochs=2, batch_size=8).grad_accum
        1
        >>> TrainConfig(batch_size=0)
        Traceback (most recent call last):
        ...
        entrenar.errors.ConfigError: TrainConfig.batch_size must be >= 1, got 0
    """

    epochs: int = 1
    max_steps: int | None = None
    batch_size: int = 32
    grad_accum: int = 1
    grad_clip: float | None = None
    log_every: int = 10
    eval_every: int | None = None
    checkpoint_every: int | None = None
    keep_checkpoints: int = 3
    patience: int | None = None
    min_delta: float = 0.0
    seed: int = 0
    output_dir: str | None = None
    compute_dtype: str | None = None
    nonfinite: str = "stop"
    progress: bool = True
    tensorboard: bool = False
    loss: str = "mse"
    shuffle: bool = True
    drop_last: bool = True
    mesh: dict[str, int] | None = None

    def __post_init__(self) -> None:
        def positive(name: str, optional: bool = False) -> None:
            v = getattr(self, name)
            if optional and v is None:
                return
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"TrainConfig.{name} must be >= 1, got {v!r}")

        for name in ("epochs", "batch_size", "grad_accum", "log_every"):
            positive(name)
        positive("keep_checkpoints")
        for name in ("max_steps", "eval_every", "checkpoint_every", "patience"):
            positive(name, optional=True)
        if self.grad_clip is not None and not self.grad_clip > 0:
            raise ConfigError(
                f"TrainConfig.grad_clip must be > 0, got {self.grad_clip}"
            )
        if not self.min_delta >= 0:
            raise ConfigError(
                f"TrainConfig.min_delta must be >= 0, got {self.min_delta}"
            )
        if self.nonfinite not in ("stop", "skip"):
            raise ConfigError(
                "TrainConfig.nonfinite must be 'stop' or 'skip', got "
                f"{self.nonfinite!r}"
            )
        if self.compute_dtype is not None and self.compute_dtype not in COMPUTE_DTYPES:
            raise ConfigError(
                f"TrainConfig.compute_dtype must be None or one of {COMPUTE_DTYPES}, "
                f"got {self.compute_dtype!r}"
            )
        if self.loss not in LOSSES:
            raise ConfigError(
                f"TrainConfig.loss {self.loss!r} is not one of {sorted(LOSSES)}"
            )
        if self.tensorboard and self.output_dir is None:
            raise ConfigError("TrainConfig.tensorboard needs an output_dir")
        if self.mesh is not None:
            try:
                check_mesh_spec(self.mesh)
            except ConfigError as e:
                raise ConfigError(f"TrainConfig.mesh: {e}") from None

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> TrainConfig:
        """Build from a mapping; an unknown key is a `ConfigError` naming it.

        >>> TrainConfig.from_dict({"epochs": 3}).epochs
        3
        """
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ConfigError(
                f"unknown TrainConfig key(s) {unknown}; known keys: {sorted(names)}"
            )
        return cls(**dict(d))

    def to_dict(self) -> dict[str, Any]:
        """The fields as a plain dict (JSON data)."""
        return dataclasses.asdict(self)

    def _repr_html_(self) -> str:
        """Jupyter's view: the fields, those changed from their default in bold."""
        import html

        rows = []
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            changed = f.default is not dataclasses.MISSING and value != f.default
            text = html.escape(repr(value))
            text = f"<b>{text}</b>" if changed else text
            rows.append(
                f"<tr><th style='text-align:left'>{f.name}</th>"
                f"<td style='text-align:left'>{text}</td></tr>"
            )
        return f"<b>TrainConfig</b><table>{''.join(rows)}</table>"


__all__ = ["COMPUTE_DTYPES", "TrainConfig"]
