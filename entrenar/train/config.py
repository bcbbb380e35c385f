"""`TrainConfig`: how to run training, and the ``training:`` section of a run's YAML.

Steps count optimizer updates. A step consumes ``batch_size × grad_accum`` examples:
``grad_accum`` micro-batches of ``batch_size`` (in-memory data is batched that way;
a loader's batches are split in ``grad_accum`` parts). The learning-rate schedule is
part of the optimizer (``adamw(learning_rate=cosine(...))``), whose state holds it.
"""

from __future__ import annotations

import dataclasses
import re
import typing
from typing import Any, Literal

from entrenar.distributed import check_mesh_spec
from entrenar.errors import ConfigError
from entrenar.schema import Config, option

ComputeDtype = Literal["float32", "bfloat16", "float16"]
COMPUTE_DTYPES: tuple[str, ...] = typing.get_args(ComputeDtype)
Loss = Literal["auto", "cross_entropy", "mse", "l1", "huber",
               "binary_cross_entropy_with_logits"]  # fmt: skip
"""``auto`` and the `entrenar.nn.losses.LOSSES` between ``apply(x)`` and ``y``."""


_UNITS = {"": 1, "b": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kmgt]?)(i?)(b?)\s*$", re.IGNORECASE)


def parse_bytes(value: Any) -> int:
    """A size in bytes: an integer, or ``"8GB"``, ``"7.5 GiB"``, ``"512MB"``.

    ``KB/MB/GB/TB`` are powers of 1000, ``KiB/MiB/GiB/TiB`` of 1024.

    >>> parse_bytes("8GB"), parse_bytes("1 GiB"), parse_bytes(4096)
    (8000000000, 1073741824, 4096)
    """
    if isinstance(value, bool):
        raise ConfigError(
            f"expected a size like '8GB' or a number of bytes, got {value!r}"
        )
    if isinstance(value, (int, float)) and value > 0:
        return int(value)
    m = _SIZE.match(str(value)) if isinstance(value, str) else None
    if m is None or float(m.group(1)) <= 0:
        raise ConfigError(
            f"expected a positive size like '8GB', '7.5GiB' or a number of bytes, or "
            f"'auto' (the memory available now), got {value!r}"
        )
    number, prefix, binary = float(m.group(1)), m.group(2).lower(), m.group(3)
    unit = 1024 ** " kmgt".index(prefix) if binary and prefix else _UNITS[prefix]
    return int(number * unit)


def check_budget(value: Any) -> Any:
    """``training.max_memory`` as given: ``"auto"`` or a size `parse_bytes` reads."""
    if isinstance(value, str) and value.strip().lower() == "auto":
        return "auto"
    parse_bytes(value)
    return str(value).strip()


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
        "each epoch's end; a grpo run: its last step); needs validation data"
    )  # fmt: skip
    checkpoint_every: int | None = option(
        None,
        ge=1,
        aliases=("save_interval", "save_steps"),
        doc="steps between checkpoints (default: each epoch's end; a grpo run, "
        "which has no epochs: none before its end); one is also written when the "
        "run ends",
    )
    keep_checkpoints: int = option(3, ge=1, doc="most recent checkpoints kept")
    export_best: bool = option(
        False,
        aliases=("load_best_model_at_end",),
        doc="export the parameters of the evaluation with the lowest eval loss "
        "(best_step) instead of the last ones: a checkpoint is written at each "
        "improving evaluation and kept past keep_checkpoints while it is the best; "
        "needs validation data",
    )
    log_every: int = option(
        10, ge=1, doc="steps between metric lines (metrics.jsonl, progress bar)"
    )
    patience: int | None = option(
        None,
        ge=1,
        group="early_stopping",
        yaml_default=3,
        doc="stop after this many evaluations without improvement (null: never); "
        "needs validation data",
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
    max_memory: str | None = option(
        None,
        normalize=check_budget,
        doc="refuse the run before loading when its predicted peak resident memory "
        "(weights, adapters, optimizer, activations; `entrenar info --memory "
        "CONFIG`) exceeds this: a size ('8GB', '7.5GiB', bytes) or auto (the "
        "memory available when the run starts); null: no check",
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
        """TensorBoard events and the best parameters' checkpoints need a folder."""
        for key in ("tensorboard", "export_best"):
            if getattr(self, key) and self.output_dir is None:
                raise ConfigError(
                    f"{path}.{key}: needs an output_dir (where "
                    f"{'its events' if key == 'tensorboard' else 'the best checkpoint'}"
                    " is written)"
                )


__all__ = [
    "COMPUTE_DTYPES",
    "ComputeDtype",
    "TrainConfig",
    "check_budget",
    "parse_bytes",
]
