"""Checkpoints of a `TrainState` with orbax-checkpoint: atomic, last N kept.

Layout (orbax's ``CheckpointManager``)::

    <output_dir>/checkpoints/<step>/state/   trainable params, optimizer state, step,
                                             key data (orbax's array format)
    <output_dir>/checkpoints/<step>/meta/    JSON: config, epoch, loader position,
                                             history, early-stopping counters
    <output_dir>/checkpoints/<step>/checksums.json   sha256 of every file above

Rotation keeps the ``keep`` newest checkpoints and the one `save` is told to protect
(``TrainConfig.export_best``: the best evaluation's, as Hugging Face's
``save_total_limit`` never deletes ``best_model_checkpoint``); it runs after each save,
so a process killed before it leaves one checkpoint too many, removed by the next.

Orbax writes each checkpoint into a temporary directory and renames it when complete,
so a process killed mid-write leaves the previous checkpoints intact (the stray
temporary directory is removed when the next manager opens the folder). A write that
fails (disk full, read-only folder) removes its temporary directory and raises one
`CheckpointError`. Once orbax has finished, the sha256 of every file of the checkpoint
goes into its ``checksums.json``; restoring checks them first, and a checkpoint whose
files do not match is refused with a `CheckpointError` naming its step and the newest
intact one (never restored silently different). A checkpoint without the file
(written by an older entrenar, or the process was killed between orbax's rename and
the checksums) is restored unverified. The frozen
half of the params (a LoRA base model, say) is not saved: it never changes, and the
caller passes it again when resuming. Restoring needs a template state with the same
structure (the one the run starts from); arrays come back bit for bit.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import threading
import time
from collections.abc import Iterator
from typing import Any

import jax

from entrenar.errors import CheckpointError, ConfigError, FormatError, UnsupportedError
from entrenar.train.state import TrainState
from entrenar.train.verify import checkpoint_problem, write_checksums
from entrenar.tree import key_path_str


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


def _registry(ocp: Any) -> Any:
    """The handlers of a checkpoint's items: ``state`` written uncompressed.

    Orbax compresses arrays with zstd by default, and holds each array's compressed
    bytes until the checkpoint's data file is written: a host copy of about the
    whole state (0.41 GB over a 0.44 GB float32 state with AdamW; 0.72 GB over
    1 GB of random float32) at the moment of the save. Trained float weights
    hardly compress (zstd saves a few percent of their random mantissas), so the
    arrays are written as they are: the save holds almost nothing beyond the state
    (0.01 GB) and is several times faster. Checkpoints written compressed (older
    entrenar) restore unchanged: the codec is in each array's metadata.
    """
    state = ocp.PyTreeCheckpointHandler(use_compression=False)
    registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
    registry.add("state", ocp.args.PyTreeSave, state)
    registry.add("state", ocp.args.PyTreeRestore, state)
    meta = ocp.JsonCheckpointHandler()
    registry.add("meta", ocp.args.JsonSave, meta)
    registry.add("meta", ocp.args.JsonRestore, meta)
    return registry


@contextlib.contextmanager
def _quiet_orbax() -> Iterator[None]:
    """Silence orbax's thread tracebacks (absl): its errors are raised here."""
    logger = logging.getLogger("absl")
    level = logger.level
    logger.setLevel(logging.CRITICAL + 1)
    try:
        yield
    finally:
        logger.setLevel(level)


def _join_new_threads(before: set[threading.Thread], timeout: float = 60.0) -> None:
    """Wait for the threads a failed save left writing (so its files can go)."""
    deadline = time.monotonic() + timeout
    for t in threading.enumerate():
        if t not in before and t is not threading.current_thread():
            t.join(max(0.0, deadline - time.monotonic()))


def _reason(error: BaseException) -> str:
    """The root cause of a failed write, on one line."""
    e: BaseException | None = error
    while e is not None:
        if isinstance(e, OSError) and e.strerror:
            where = f": {e.filename}" if e.filename else ""
            return f"{e.strerror}{where}"
        e = e.__cause__ or e.__context__
    text = (str(error).strip().splitlines() or [""])[0]
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


class Checkpointer:
    """Save and restore `TrainState` + JSON metadata under ``directory``.

    Args:
        directory: the checkpoints folder (created if missing, unless read-only).
        keep: how many of the most recent checkpoints to keep (besides the one a
            save protects).
        read_only: only restore (another run's folder: its temporary folders,
            maybe a save in progress, are left alone).
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        keep: int = 3,
        *,
        read_only: bool = False,
    ) -> None:
        ocp = _ocp()
        self.directory = os.path.abspath(os.fspath(directory))
        self.keep = int(keep)
        options = ocp.CheckpointManagerOptions(
            max_to_keep=None,  # rotated here (`_rotate`): one may be protected
            create=not read_only,
            cleanup_tmp_directories=not read_only,
            read_only=read_only,
            enable_async_checkpointing=False,
        )
        self._ocp = ocp
        try:
            self._manager = ocp.CheckpointManager(
                self.directory, options=options, handler_registry=_registry(ocp)
            )
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            # orbax reads every step's _CHECKPOINT_METADATA here, unchecked
            raise CheckpointError(
                f"orbax cannot read the checkpoints in {self.directory}: "
                f"{_reason(e).rstrip('.')}; a step folder's _CHECKPOINT_METADATA is "
                "damaged: move that step out of the folder, or start a fresh run",
                corrupt=True,
            ) from e

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

    def save(
        self, state: TrainState, meta: dict[str, Any], *, protect: int | None = None
    ) -> str:
        """Write checkpoint ``int(state.step)`` atomically; return its folder.

        Then remove the checkpoints older than the ``keep`` newest, but ``protect``
        (a step whose checkpoint must stay: the best evaluation's).

        Raises:
            CheckpointError: the write failed (disk full, read-only folder); the
                temporary folder is removed, older checkpoints are intact.
        """
        ocp = self._ocp
        step = int(state.step)
        before = set(threading.enumerate())
        with _quiet_orbax():
            try:
                self._manager.save(
                    step,
                    args=ocp.args.Composite(
                        state=ocp.args.PyTreeSave(_saveable(state)),
                        meta=ocp.args.JsonSave(meta),
                    ),
                    force=True,
                )
                self._manager.wait_until_finished()
                if jax.process_index() == 0:
                    write_checksums(self.path(step))
            except Exception as e:
                _join_new_threads(before)
                self._remove_temporaries(step)
                good = [s for s in self.steps() if s != step]
                raise CheckpointError(
                    f"could not write checkpoint step {step} in {self.directory}: "
                    f"{_reason(e)} (the newest complete checkpoint is "
                    f"{f'step {good[-1]}' if good else 'none'}); free disk space or "
                    "make the folder writable, then continue with --resume latest"
                ) from e
        self._rotate(protect)
        return self.path(step)

    def _rotate(self, protect: int | None) -> None:
        """Delete all but the ``keep`` newest checkpoints and ``protect``."""
        steps = self.steps()  # every process calls delete: orbax syncs them
        for step in steps[: max(len(steps) - self.keep, 0)]:
            if step != protect:
                self._manager.delete(step)

    def _remove_temporaries(self, step: int) -> None:
        prefix = f"{step}.orbax-checkpoint-tmp"
        with contextlib.suppress(OSError):
            for name in os.listdir(self.directory):
                if name.startswith(prefix):
                    shutil.rmtree(os.path.join(self.directory, name), True)

    def verify(self, step: int) -> None:
        """Check checkpoint ``step``'s files against its checksums.

        Raises:
            CheckpointError: it is corrupt (``corrupt=True``); the message names the
                newest intact older checkpoint.
        """
        problem = checkpoint_problem(self.path(step))
        if problem is None:
            return
        older = [s for s in self.steps() if s < step]
        good = next(
            (s for s in reversed(older) if checkpoint_problem(self.path(s)) is None),
            None,
        )
        offer = (
            "no older checkpoint is intact: start a fresh run"
            if good is None
            else f"the newest intact one is step {good}: move {self.path(step)} "
            "out of the folder and continue with --resume latest"
        )
        raise CheckpointError(
            f"checkpoint step {step} ({self.path(step)}) is corrupt: {problem}; "
            f"{offer}",
            corrupt=True,
        )

    def restore(
        self, template: TrainState, step: int | None = None
    ) -> tuple[TrainState, dict[str, Any]]:
        """The state and metadata of checkpoint ``step`` (default: the latest).

        ``template`` gives the structure, shapes and dtypes (and the frozen half).

        Raises:
            FormatError: no checkpoint, or one that does not fit the template.
            CheckpointError: a corrupt checkpoint (see `verify`), or orbax files
                it cannot read (damaged metadata in a checkpoint without, or with
                matching, checksums).
        """
        ocp = self._ocp
        step = self.latest_step() if step is None else int(step)
        if step is None or step not in self.steps():
            raise FormatError(
                f"no complete checkpoint {'' if step is None else step} in "
                f"{self.directory} (found steps {self.steps()})"
            )
        self.verify(step)
        abstract = jax.tree_util.tree_map(
            ocp.utils.to_shape_dtype_struct, _saveable(template)
        )
        differs = self._differs(step, abstract)
        if differs is not None:  # refused before orbax starts reading
            raise FormatError(
                f"checkpoint {self.path(step)} does not match this run's state "
                f"(model, trainable part or optimizer changed?): {differs}"
            )
        try:
            out = self._manager.restore(
                step,
                args=ocp.args.Composite(
                    state=ocp.args.PyTreeRestore(
                        abstract,
                        restore_args=ocp.checkpoint_utils.construct_restore_args(
                            abstract
                        ),
                    ),
                    meta=ocp.args.JsonRestore(),
                ),
            )
        except (ValueError, KeyError, TypeError) as e:
            raise FormatError(
                f"checkpoint {self.path(step)} does not match this run's state "
                f"(model, trainable part or optimizer changed?): {e}"
            ) from e
        except (AttributeError, OSError) as e:  # orbax's own files are damaged
            raise CheckpointError(
                f"checkpoint step {step} ({self.path(step)}) cannot be read: "
                f"{_reason(e).rstrip('.')}; move it out of the folder and continue "
                "with --resume latest, or start a fresh run",
                corrupt=True,
            ) from e
        s = out["state"]
        key = jax.random.wrap_key_data(s["key"], impl=jax.random.key_impl(template.key))
        state = TrainState(
            s["trainable"], template.frozen, s["opt_state"], s["step"], key
        )
        return state, dict(out["meta"])

    def _differs(self, step: int, abstract: Any) -> str | None:
        """The first leaf of ``abstract`` that checkpoint ``step`` does not hold as is.

        Read from the checkpoint's metadata (names and shapes), so a run whose
        state changed (``lora.rank``, ``lora.targets``, the optimizer) is refused
        before orbax starts reading: a restore that fails part-way leaves reads in
        flight whose callbacks print "RuntimeError: Event loop is closed"
        tracebacks. None: every leaf matches, or the metadata cannot be read (the
        restore then decides).
        """
        try:
            with _quiet_orbax():
                reader = self._ocp.StandardCheckpointer()
                try:
                    meta = reader.metadata(os.path.join(self.path(step), "state"))
                finally:
                    reader.close()
            tree = getattr(meta, "item_metadata", meta)
            tree = getattr(tree, "tree", tree)
            stored = {
                key_path_str(p): tuple(x.shape)
                for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]
            }
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return None
        wanted = {
            key_path_str(p): tuple(x.shape)
            for p, x in jax.tree_util.tree_flatten_with_path(abstract)[0]
        }
        for name, shape in wanted.items():
            if name not in stored:
                return f"{name}: not in the checkpoint"
            if stored[name] != shape:
                return f"{name}: {stored[name]} in the checkpoint, {shape} in this run"
        extra = sorted(set(stored) - set(wanted))
        return f"{extra[0]}: in the checkpoint, not in this run" if extra else None

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
