"""Callbacks: hooks the Trainer calls at fixed points of a run.

Subclass `Callback` and override what you need; every method receives the Trainer
(read ``trainer.params``, the whole tree to save or evaluate, ``trainer.state``,
``trainer.step``; set ``trainer.should_stop = True`` to end the run after the current
step). ``on_step`` gets the step's metrics as device arrays
(converting them to floats waits for the step to finish, so keep it cheap).
"""

from __future__ import annotations

from typing import Any


class Callback:
    """No-op hooks; override the ones you need."""

    def on_step(self, trainer: Any, step: int, metrics: dict[str, Any]) -> None:
        """After optimizer step ``step`` (1-based count of steps taken)."""

    def on_log(self, trainer: Any, step: int, record: dict[str, Any]) -> None:
        """After a log line (``record``: host floats, as written to metrics.jsonl)."""

    def on_eval(self, trainer: Any, step: int, metrics: dict[str, float]) -> None:
        """After an evaluation (``metrics["eval_loss"]`` and the others)."""

    def on_checkpoint(self, trainer: Any, step: int, path: str) -> None:
        """After checkpoint ``path`` is complete on disk."""

    def on_end(self, trainer: Any, result: Any) -> None:
        """When the run ends (``result``: the `TrainResult`)."""


__all__ = ["Callback"]
