"""Checkpoints of a `TrainState` with orbax-checkpoint: atomic, last N kept.

Layout (orbax's ``CheckpointManager``)::

    <output_dir>/checkpoints/<step>/state/   trainable params, optimizer state, step,
                                             key data (orbax's array format)
    <output_dir>/checkpoints/<step>/meta/    JSON: config, epoch, loader position,
                                             history, early-stopping counters

Orbax writes each checkpoint into a temporary directory and renames it when complete,
so a process killed mid-write leaves the previous checkpoints intact (the stray
temporary directory is removed when the next manager opens the folder). The frozen
half of the params (a LoRA base model, say) is not saved: it never changes, and the
caller passes it again when resuming. Restoring needs a template state with the same
structure (the one the run starts from); arrays come back bit for bit.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import jax

from entrenar.errors import ConfigError, FormatError, UnsupportedError
from entrenar.train.state import TrainState


def _ocp() -> Any:
    try:
        import orbax.checkpoint as ocp
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise UnsupportedError(
            "checkpoints need orbax-checkpoint: pip install 'entrenar[train]'"
        ) from e
    logging.getLogger("absl").setLevel(logging.ERROR)
    return ocp


def _saveable(state: TrainState) -> dict[str, Any]:
    return {
        "trainable": state.trainable,
        "opt_state": state.opt_state,
        "step": state.step,
        "key": jax.random.key_data(state.key),
    }


class Checkpointer:
    """Save and restore `TrainState` + JSON metadata under ``directory``.

    Args:
        directory: the checkpoints folder (created if missing).
        keep: how many of the most recent checkpoints to keep.
    """

    def __init__(self, directory: str | os.PathLike[str], keep: int = 3) -> None:
        ocp = _ocp()
        self.directory = os.path.abspath(os.fspath(directory))
        options = ocp.CheckpointManagerOptions(
            max_to_keep=int(keep),
            create=True,
            cleanup_tmp_directories=True,
            enable_async_checkpointing=False,
        )
        self._ocp = ocp
        self._manager = ocp.CheckpointManager(self.directory, options=options)

    def steps(self) -> list[int]:
        """The steps that have a complete checkpoint, oldest first."""
        return sorted(self._manager.all_steps(read=True))

    def latest_step(self) -> int | None:
        """The newest complete checkpoint's step, or None."""
        steps = self.steps()
        return steps[-1] if steps else None

    def path(self, step: int) -> str:
        """The folder of checkpoint ``step``."""
        return os.path.join(self.directory, str(int(step)))

    def save(self, state: TrainState, meta: dict[str, Any]) -> str:
        """Write checkpoint ``int(state.step)`` atomically; return its folder."""
        ocp = self._ocp
        step = int(state.step)
        self._manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(_saveable(state)),
                meta=ocp.args.JsonSave(meta),
            ),
            force=True,
        )
        self._manager.wait_until_finished()
        return self.path(step)

    def restore(
        self, template: TrainState, step: int | None = None
    ) -> tuple[TrainState, dict[str, Any]]:
        """The state and metadata of checkpoint ``step`` (default: the latest).

        ``template`` gives the structure, shapes and dtypes (and the frozen half).

        Raises:
            FormatError: no checkpoint, or one that does not fit the template.
        """
        ocp = self._ocp
        step = self.latest_step() if step is None else int(step)
        if step is None or step not in self.steps():
            raise FormatError(
                f"no complete checkpoint {'' if step is None else step} in "
                f"{self.directory} (found steps {self.steps()})"
            )
        abstract = jax.tree_util.tree_map(
            ocp.utils.to_shape_dtype_struct, _saveable(template)
        )
        try:
            out = self._manager.restore(
                step,
                args=ocp.args.Composite(
                    state=ocp.args.StandardRestore(abstract),
                    meta=ocp.args.JsonRestore(),
                ),
            )
        except (ValueError, KeyError, TypeError) as e:
            raise FormatError(
                f"checkpoint {self.path(step)} does not match this run's state "
                f"(model, trainable part or optimizer changed?): {e}"
            ) from e
        s = out["state"]
        key = jax.random.wrap_key_data(s["key"], impl=jax.random.key_impl(template.key))
        state = TrainState(
            s["trainable"], template.frozen, s["opt_state"], s["step"], key
        )
        return state, dict(out["meta"])

    def close(self) -> None:
        """Release orbax's resources."""
        self._manager.close()


def resolve_resume(
    resume: str | os.PathLike[str], output_dir: str | None
) -> tuple[str, int | None]:
    """``(checkpoints folder, step or None for latest)`` for ``fit(resume=...)``.

    ``"latest"`` is the newest checkpoint under ``output_dir``; a path may be a run
    folder (holding ``checkpoints/``), a checkpoints folder, or one step's folder.
    """
    if resume == "latest":
        if output_dir is None:
            raise ConfigError("resume='latest' needs TrainConfig.output_dir")
        return os.path.join(output_dir, "checkpoints"), None
    path = os.path.abspath(os.fspath(resume))
    if not os.path.isdir(path):
        raise FormatError(f"resume path {path} is not a folder")
    if os.path.isdir(os.path.join(path, "checkpoints")):
        return os.path.join(path, "checkpoints"), None
    base = os.path.basename(path)
    if base.isdigit() and os.path.isdir(os.path.join(path, "state")):
        return os.path.dirname(path), int(base)
    return path, None


__all__ = ["Checkpointer", "resolve_resume"]
