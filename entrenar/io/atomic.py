"""Safe writes: atomic replacement, the user's file modes, no symbolic links followed.

`atomic_write` writes a temporary file in the target's folder, then ``os.replace``:
readers never see a half-written file, either the old file or the complete new one.
Every file entrenar writes gets mode ``0o666 & ~umask`` (`file_mode`; ``mkstemp``
alone gives 0600) and every folder it creates ``0o777 & ~umask`` (``os.makedirs``),
as ``open`` and ``mkdir`` would give, so an exported model is readable by the
accounts the user's umask allows.
A process killed mid-write (SIGKILL, a power cut) leaves its temporary file,
``.tmp-<random>.part``; `remove_temporaries` deletes them from a folder whose
writer holds its `entrenar.io.lock.OutputLock` (a run's export does).
`append_text` appends to a log file (``metrics.jsonl``) and refuses one that is a
symbolic link, which would send the run's writes elsewhere.
"""

from __future__ import annotations

import contextlib
import errno
import os
import tempfile
import threading
from collections.abc import Iterator
from typing import IO

from entrenar.errors import ConfigError

_UMASK_GUARD = threading.Lock()
TEMP_PREFIX, TEMP_SUFFIX = ".tmp-", ".part"
"""How `atomic_write` names its temporary files."""


def current_umask() -> int:
    """The process's umask, read without changing it where the system allows.

    Linux reports it in ``/proc/self/status``; elsewhere it is read with
    ``os.umask`` twice (set, then put back) under a lock: safe among entrenar's
    threads, but a file another thread creates in that instant gets umask 022.
    """
    with contextlib.suppress(OSError, ValueError):
        with open("/proc/self/status", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    with _UMASK_GUARD:
        mask = os.umask(0o022)
        os.umask(mask)
    return mask


def file_mode() -> int:
    """The mode of a new file: ``0o666 & ~umask``."""
    return 0o666 & ~current_umask()


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike[str], mode: str = "wb") -> Iterator[IO]:
    """Open a temporary file for writing; on success it replaces ``path`` atomically.

    If the block raises, the temporary file is removed and ``path`` is untouched.
    The file gets mode ``0o666 & ~umask``; a symbolic link at ``path`` is replaced,
    never written through.

    >>> import os, tempfile
    >>> tmp = tempfile.TemporaryDirectory()  # removed with the object
    >>> p = os.path.join(tmp.name, "x.txt")
    >>> with atomic_write(p, "w") as f:
    ...     _ = f.write("hello")
    >>> open(p).read()
    'hello'
    """
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=TEMP_PREFIX, suffix=TEMP_SUFFIX, dir=folder)
    try:
        os.fchmod(fd, file_mode())  # mkstemp creates 0600
        with os.fdopen(fd, mode) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def remove_temporaries(folder: str | os.PathLike[str]) -> list[str]:
    """Delete the temporary files `atomic_write` left in ``folder``; their paths.

    Only for a writer that holds ``folder``'s `entrenar.io.lock.OutputLock`: no
    other entrenar process is then writing there, so every ``.tmp-*.part`` file is
    a dead writer's (a run killed while exporting left its GGUF's temporary, as
    large as the model, beside the finished files). Not recursive; a missing
    folder has none.
    """
    try:
        names = os.listdir(folder)
    except FileNotFoundError:
        return []
    removed = []
    for name in names:
        path = os.path.join(folder, name)
        if (
            name.startswith(TEMP_PREFIX)
            and name.endswith(TEMP_SUFFIX)
            and not os.path.islink(path)
            and os.path.isfile(path)
        ):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
                removed.append(path)
    return removed


def refuse_symlink(path: str | os.PathLike[str]) -> None:
    """Raise a `ConfigError` if ``path`` is a symbolic link (a run's own file)."""
    if os.path.islink(path):
        raise ConfigError(
            f"{os.fspath(path)} is a symbolic link: entrenar does not write through "
            "links in an output folder; remove the link or choose another output "
            "folder"
        )


@contextlib.contextmanager
def append_text(path: str | os.PathLike[str]) -> Iterator[IO[str]]:
    """Open ``path`` to append UTF-8 text, created ``0o666 & ~umask`` if missing.

    Raises:
        ConfigError: ``path`` is a symbolic link (not followed, not replaced).
    """
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(path, flags, file_mode())
    except OSError as e:
        if e.errno == errno.ELOOP:
            refuse_symlink(path)
        raise
    with os.fdopen(fd, "a", encoding="utf-8") as f:
        yield f


__all__ = [
    "append_text",
    "atomic_write",
    "current_umask",
    "file_mode",
    "refuse_symlink",
]
