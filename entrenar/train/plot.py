"""`plot(run_dir)`: ``loss.png`` from a run's ``metrics.jsonl`` (matplotlib)."""

from __future__ import annotations

import os
from typing import Any

from entrenar.data.readers import parse_json_line
from entrenar.errors import FormatError, UnsupportedError
from entrenar.io.atomic import atomic_write


def read_metrics(run_dir: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The records of ``<run_dir>/metrics.jsonl`` (a bad line names its number)."""
    path = os.path.join(os.fspath(run_dir), "metrics.jsonl")
    if not os.path.exists(path):
        raise FormatError(f"{path} does not exist: is {run_dir} a Trainer output_dir?")
    records = []
    with open(path, encoding="utf-8", newline="\n") as f:
        for i, line in enumerate(f, 1):
            if line.strip():
                records.append(parse_json_line(line, path, i))
    return records


def plot(
    run_dir: str | os.PathLike[str], out: str | None = None, *, show: bool = False
) -> str:
    """Write ``loss.png``: train and eval loss against the step, and the rate.

    Args:
        run_dir: a Trainer ``output_dir`` holding ``metrics.jsonl``.
        out: the image path (default ``<run_dir>/loss.png``).
        show: also display the image inline (in Jupyter: ``IPython.display``); a
            no-op outside IPython.

    Returns:
        The path of the image.
    """
    try:  # a Figure of its own: no pyplot, so a notebook's backend is left alone
        from matplotlib.figure import Figure
    except ImportError as e:
        raise UnsupportedError(
            "plot needs matplotlib: pip install 'entrenar[train]'"
        ) from e
    records = read_metrics(run_dir)
    train = [r for r in records if r.get("loss") is not None]
    evals = [r for r in records if r.get("eval_loss") is not None]
    lrs = [r for r in records if r.get("lr") is not None]
    fig = Figure(figsize=(8, 4.5))
    ax = fig.subplots()
    ax.plot([r["step"] for r in train], [r["loss"] for r in train], label="train loss")
    if evals:
        ax.plot(
            [r["step"] for r in evals], [r["eval_loss"] for r in evals],
            "o-", label="eval loss",
        )  # fmt: skip
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.grid(alpha=0.3)
    handles, labels = ax.get_legend_handles_labels()
    if lrs:
        ax2 = ax.twinx()
        ax2.plot(
            [r["step"] for r in lrs], [r["lr"] for r in lrs],
            color="tab:gray", linestyle="--", label="learning rate",
        )  # fmt: skip
        ax2.set_ylabel("learning rate")
        h2, l2 = ax2.get_legend_handles_labels()
        handles, labels = handles + h2, labels + l2
    ax.legend(handles, labels, loc="upper right")
    fig.tight_layout()
    out = out or os.path.join(os.fspath(run_dir), "loss.png")
    kind = os.path.splitext(out)[1].lstrip(".").lower() or "png"
    with atomic_write(out) as f:  # a link at ``out`` is replaced, not followed
        fig.savefig(f, format=kind, dpi=100)
    if show:
        _show_inline(out)
    return out


def _show_inline(path: str) -> None:
    """Display the PNG at ``path`` in IPython (nothing without IPython)."""
    try:
        from IPython import get_ipython
        from IPython.display import Image, display
    except ImportError:
        return
    if get_ipython() is not None:
        display(Image(filename=path))


__all__ = ["plot", "read_metrics"]
