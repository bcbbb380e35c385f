"""Checks of a saved checkpoint: sha256 of its files, the shape of its metadata.

`write_checksums` records, once orbax has finished a checkpoint, the sha256 of every
file in its folder in ``checksums.json``; `checkpoint_problem` compares them before a
restore. `check_meta` checks the Trainer's JSON metadata (the keys `Trainer._meta`
writes and their types) so a damaged file is a `CheckpointError` naming the key,
not a ``KeyError`` or ``TypeError`` deep inside the resume.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any

from entrenar.errors import CheckpointError
from entrenar.io.atomic import atomic_write

CHECKSUMS = "checksums.json"
"""The file of a checkpoint folder holding the sha256 of its other files."""


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _files(folder: str) -> list[str]:
    """The regular files under ``folder`` (relative, ``/``-separated), sorted."""
    out = []
    for root, _, names in os.walk(folder):
        for name in names:
            path = os.path.join(root, name)
            if os.path.isfile(path) and not os.path.islink(path):
                out.append(os.path.relpath(path, folder).replace(os.sep, "/"))
    return sorted(f for f in out if f != CHECKSUMS)


def write_checksums(folder: str) -> None:
    """Record the sha256 of every file of the checkpoint in ``folder``."""
    sums = {rel: _sha256(os.path.join(folder, rel)) for rel in _files(folder)}
    with atomic_write(os.path.join(folder, CHECKSUMS), "w") as f:
        json.dump({"sha256": sums}, f, indent=1)


def _listed(folder: str) -> dict[str, str] | str:
    """``checksums.json``'s ``{file: sha256}``, or what is wrong with it."""
    try:
        with open(os.path.join(folder, CHECKSUMS), encoding="utf-8") as f:
            sums = json.load(f).get("sha256")
    except (OSError, ValueError, AttributeError):
        return f"{CHECKSUMS} is unreadable"
    good = isinstance(sums, dict) and all(
        isinstance(k, str) and isinstance(v, str) and len(v) == 64
        and not os.path.isabs(k) and ".." not in k.split("/")
        for k, v in sums.items()
    )  # fmt: skip
    return sums if good else f"{CHECKSUMS} is malformed"


def checkpoint_problem(folder: str) -> str | None:
    """What is wrong with the checkpoint in ``folder`` (None: nothing found).

    A missing ``meta/metadata``, or (when the checkpoint has ``checksums.json``) a
    listed file missing or not matching its sha256.
    """
    if not os.path.isfile(os.path.join(folder, "meta", "metadata")):
        return "meta/metadata is missing"
    if not os.path.exists(os.path.join(folder, CHECKSUMS)):
        return None  # unverified: older entrenar, or killed before the checksums
    sums = _listed(folder)
    if isinstance(sums, str):
        return sums
    for rel, digest in sums.items():
        path = os.path.join(folder, *rel.split("/"))
        if not os.path.isfile(path):
            return f"{rel} is missing"
        if _sha256(path) != digest:
            return f"{rel} does not match its sha256 in {CHECKSUMS}"
    return None


_NUMBER = (int, float)
META_TYPES: dict[str, tuple[type, ...]] = {
    "step": (int,),
    "epoch": (int,),
    "batch_in_epoch": (int,),
    "loader": (dict,),
    "config": (dict,),
    "history": (list,),
    "eval_history": (list,),
    "best_eval_loss": (*_NUMBER, type(None)),
    "best_step": (int, type(None)),
    "bad_evals": (int,),
    "window": (list,),
    "stopped": (bool,),
}
"""The Trainer's checkpoint metadata: each key and the JSON types it may hold."""


def _kind(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _meta_problem(meta: Any) -> str | None:
    if not isinstance(meta, dict):
        return f"the metadata is a {_kind(meta)}, not an object"
    for key, types in META_TYPES.items():
        if key not in meta:
            return f"{key} is missing"
        value = meta[key]
        if not isinstance(value, types) or (bool in types) != isinstance(value, bool):
            return f"{key} is {_kind(value)}"
    for key in ("history", "eval_history", "window"):
        for i, record in enumerate(meta[key]):
            if not isinstance(record, dict):
                return f"{key}[{i}] is {_kind(record)}, not an object"
    for i, record in enumerate(meta["window"]):  # averaged at the next log
        for name, value in record.items():
            if not isinstance(value, _NUMBER) or isinstance(value, bool):
                return f"window[{i}].{name} is {_kind(value)}, not a number"
    return None


def check_meta(meta: Any, where: str) -> dict[str, Any]:
    """``meta`` if it holds what a resume reads (`META_TYPES`), else an error.

    Raises:
        CheckpointError: ``corrupt=True``, naming ``where`` and the key.
    """
    problem = _meta_problem(meta)
    if problem is not None:
        raise CheckpointError(
            f"checkpoint {where} is corrupt: meta/metadata: {problem}; resume "
            "from an older checkpoint or start a fresh run",
            corrupt=True,
        )
    return dict(meta)


__all__ = [
    "CHECKSUMS",
    "META_TYPES",
    "check_meta",
    "checkpoint_problem",
    "write_checksums",
]
