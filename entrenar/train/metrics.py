"""Where a run's numbers go: ``metrics.jsonl``, TensorBoard events, a progress bar.

``metrics.jsonl`` holds one JSON object per line: ``{"step", "epoch", "loss", "lr",
"grad_norm", "tokens_per_s", ...}`` for each log step and ``{"step", "epoch",
"eval_loss", ...}`` for each evaluation. On resume, lines past the checkpoint's step
(written by the interrupted run after its last checkpoint) are dropped, so the file
reads as one uninterrupted run; so is a last line cut short by a crash mid-write.
A ``metrics.jsonl`` that is a symbolic link is refused, never written through.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

from entrenar.data.readers import parse_json_line
from entrenar.errors import FormatError, UnsupportedError
from entrenar.io.atomic import append_text, atomic_write, refuse_symlink


class MetricsWriter:
    """Append records to ``<run_dir>/metrics.jsonl`` (and TensorBoard if asked).

    Raises:
        ConfigError: ``metrics.jsonl`` is a symbolic link.
    """

    def __init__(self, run_dir: str, *, tensorboard: bool = False) -> None:
        os.makedirs(run_dir, exist_ok=True)
        self.path = os.path.join(run_dir, "metrics.jsonl")
        refuse_symlink(self.path)
        self._tb = None
        if tensorboard:
            try:
                from tensorboardX import SummaryWriter
            except ImportError as e:
                raise UnsupportedError(
                    "TensorBoard events need tensorboardX: pip install "
                    "'entrenar[tensorboard]'"
                ) from e
            self._tb = SummaryWriter(os.path.join(run_dir, "tensorboard"))

    def truncate_after(self, step: int) -> None:
        """Drop records with ``step`` greater than ``step`` (resuming).

        A last line cut short (no line end, not JSON: the run died writing it) is
        dropped too.

        Raises:
            FormatError: any other line is not a record (naming the line).
        """
        refuse_symlink(self.path)
        if not os.path.exists(self.path):
            return
        with open(self.path, encoding="utf-8", errors="replace", newline="\n") as f:
            lines = f.readlines()
        keep = []
        for n, line in enumerate(lines, 1):
            if not line.strip() or _cut_short(line, n == len(lines)):
                continue
            record = parse_json_line(line, self.path, n)
            if not isinstance(record, dict) or not isinstance(record.get("step"), int):
                raise FormatError(
                    f"{self.path} line {n}: not a metrics record (a JSON object "
                    "with an integer 'step'); delete the line"
                )
            if record["step"] <= step:
                keep.append(line.rstrip("\r\n") + "\n")
        with atomic_write(self.path, "w") as f:
            f.writelines(keep)

    def write(self, record: dict[str, Any], prefix: str = "train") -> None:
        """Append one record (floats; non-finite values are written as null)."""
        clean = {
            k: (None if isinstance(v, float) and not math.isfinite(v) else v)
            for k, v in record.items()
        }
        with append_text(self.path) as f:  # a link is refused, not followed
            f.write(json.dumps(clean) + "\n")
        if self._tb is not None:
            for k, v in record.items():
                if k not in ("step", "epoch") and isinstance(v, (int, float)):
                    tag = k if "/" in k else f"{prefix}/{k}"
                    self._tb.add_scalar(tag, v, record["step"])
            self._tb.flush()

    def close(self) -> None:
        """Close the TensorBoard writer."""
        if self._tb is not None:
            self._tb.close()


def _cut_short(line: str, last: bool) -> bool:
    """Whether ``line`` is a last line a crash left half-written."""
    if not last or line.endswith("\n"):
        return False
    try:
        json.loads(line)
    except (ValueError, RecursionError):
        return True
    return False


class Progress:
    """A ``tqdm.auto`` bar over steps (a widget in notebooks), or nothing."""

    def __init__(self, total: int, initial: int, enabled: bool) -> None:
        self._bar = None
        if enabled:
            from tqdm.auto import tqdm

            self._bar = tqdm(
                total=total, initial=initial, unit="step", dynamic_ncols=True
            )

    def update(self, n: int = 1) -> None:
        """Advance by ``n`` steps."""
        if self._bar is not None:
            self._bar.update(n)

    def show(self, record: dict[str, Any]) -> None:
        """Show loss, learning rate and tokens/s from a log record."""
        if self._bar is None:
            return
        post = {"loss": f"{record.get('loss', float('nan')):.4g}"}
        if "lr" in record:
            post["lr"] = f"{record['lr']:.3g}"
        if "tokens_per_s" in record:
            post["tok/s"] = f"{record['tokens_per_s']:.4g}"
        if "eval_loss" in record:
            post["eval"] = f"{record['eval_loss']:.4g}"
        self._bar.set_postfix(post, refresh=False)

    def close(self) -> None:
        """Close the bar."""
        if self._bar is not None:
            self._bar.close()


__all__ = ["MetricsWriter", "Progress"]
