"""The loader protocol the Trainer consumes, and `ArrayLoader` over in-memory arrays.

A loader is an iterable of batches (dicts of arrays) over one epoch, with a position
that can be saved and restored, so a resumed run sees exactly the batches it would
have seen::

    loader.set_epoch(epoch)          # order = f(seed, epoch); position back to 0
    for batch in loader: ...         # the rest of this epoch, from the position
    len(loader)                      # batches per epoch
    d = loader.state_dict()          # {"epoch": e, "position": i, ...} (JSON data)
    loader.load_state_dict(d)        # the next iteration resumes at batch i of e

``position`` counts the batches already yielded in the epoch (0 after `set_epoch`);
iterating again without `set_epoch` continues from it (an exhausted epoch yields
nothing). The batch order of an epoch depends only on the loader's seed and the
epoch number, never on how many epochs ran before in this process.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any, Protocol, runtime_checkable

import numpy as np

from entrenar.errors import ConfigError, ShapeError

Batch = dict[str, Any]
"""One batch: a dict of arrays sharing their leading (batch) axis."""


@runtime_checkable
class Loader(Protocol):
    """An epoch-aware, resumable iterable of batches (see the module docstring)."""

    def __iter__(self) -> Iterator[Batch]: ...

    def __len__(self) -> int: ...

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch``: its order, position 0."""

    def state_dict(self) -> dict[str, Any]:
        """The position as JSON-serialisable data (epoch, batches yielded, ...)."""

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a position saved by `state_dict`."""


def epoch_permutation(n: int, seed: int, epoch: int) -> np.ndarray:
    """The order of ``n`` examples in ``epoch``: a function of ``(seed, epoch)`` only.

    >>> epoch_permutation(5, seed=0, epoch=1).tolist() == (
    ...     epoch_permutation(5, seed=0, epoch=1).tolist())
    True
    """
    return np.random.default_rng([int(seed), int(epoch)]).permutation(n)


class NoFullBatchError(ShapeError):
    """Fewer examples than one batch where the last incomplete batch is dropped."""


class ArrayLoader:
    """Batches of in-memory arrays, shuffled per epoch from ``(seed, epoch)``.

    Args:
        arrays: a dict of arrays with the same leading length ``N``.
        batch_size: examples per batch.
        shuffle: shuffle the examples each epoch (else keep their order).
        seed: seed of the shuffling.
        drop_last: drop the last incomplete batch (keeps one compiled shape); else
            yield it smaller.
        pad: instead, fill the last incomplete batch up to ``batch_size`` with rows
            of ``pad_values`` (one compiled shape, no example lost); wins over
            ``drop_last``. The loss must ignore those rows: LM batches pad with
            ``labels=-100`` and ``attention_mask=False``; for others, add a weight
            array of ones and pad it with 0.
        pad_values: the fill value of each array's padding rows (default 0).

    Example:
        >>> import numpy as np
        >>> dl = ArrayLoader({"x": np.arange(5)}, batch_size=2, shuffle=False)
        >>> [b["x"].tolist() for b in dl], len(dl)
        ([[0, 1], [2, 3]], 2)
    """

    def __init__(
        self,
        arrays: Mapping[str, Any],
        batch_size: int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = True,
        pad: bool = False,
        pad_values: Mapping[str, Any] | None = None,
    ) -> None:
        if not isinstance(arrays, Mapping) or not arrays:
            raise ConfigError("ArrayLoader needs a non-empty dict of arrays")
        self.arrays = {k: np.asarray(v) for k, v in arrays.items()}
        lengths = {k: (v.shape[0] if v.ndim else None) for k, v in self.arrays.items()}
        if len(set(lengths.values())) != 1 or None in lengths.values():
            raise ShapeError(
                f"every array needs the same leading (example) axis; got lengths "
                f"{lengths}"
            )
        self.n = int(next(iter(self.arrays.values())).shape[0])
        if int(batch_size) < 1:
            raise ConfigError(f"batch_size must be at least 1, got {batch_size}")
        self.batch_size = int(batch_size)
        drop_last = drop_last and not pad
        self.pad = bool(pad)
        self.pad_values = dict(pad_values or {})
        unknown = set(self.pad_values) - set(self.arrays)
        if unknown:
            raise ConfigError(f"pad_values for unknown arrays {sorted(unknown)}")
        if drop_last and self.n < self.batch_size:
            raise NoFullBatchError(
                f"{self.n} examples make no full batch of {self.batch_size}; lower "
                "batch_size or pass drop_last=False"
            )
        self.shuffle, self.seed, self.drop_last = bool(shuffle), int(seed), drop_last
        self.epoch, self.position = 0, 0

    def __len__(self) -> int:
        full, rest = divmod(self.n, self.batch_size)
        return full + (1 if rest and not self.drop_last else 0)

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch`` at its first batch."""
        self.epoch, self.position = int(epoch), 0

    def state_dict(self) -> dict[str, Any]:
        """``{"epoch", "position", "seed", "n"}`` (JSON data)."""
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed,
                "n": self.n}  # fmt: skip

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume at a saved position; refuses one saved over other data or seed."""
        for key in ("seed", "n"):
            if key in state and int(state[key]) != getattr(self, key):
                raise ConfigError(
                    f"loader state has {key}={state[key]} but this loader has "
                    f"{key}={getattr(self, key)}; resume with the same data and seed"
                )
        self.epoch, self.position = int(state["epoch"]), int(state["position"])

    def __iter__(self) -> Iterator[Batch]:
        order = (
            epoch_permutation(self.n, self.seed, self.epoch)
            if self.shuffle
            else np.arange(self.n)
        )
        while self.position < len(self):
            idx = order[self.position * self.batch_size :][: self.batch_size]
            self.position += 1
            batch = {k: v[idx] for k, v in self.arrays.items()}
            if self.pad and len(idx) < self.batch_size:
                batch = {k: self._padded(k, v) for k, v in batch.items()}
            yield batch

    def _padded(self, key: str, v: np.ndarray) -> np.ndarray:
        fill = np.full((self.batch_size - len(v), *v.shape[1:]), 0, v.dtype)
        fill[...] = self.pad_values.get(key, 0)
        return np.concatenate([v, fill])


__all__ = ["ArrayLoader", "Batch", "Loader", "NoFullBatchError", "epoch_permutation"]
