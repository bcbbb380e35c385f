"""One writer per output: an advisory ``fcntl.flock`` lock beside what a run writes.

A workflow that writes an output folder (``train``, ``merge``, ``quantize``,
export) holds `OutputLock` on it for as long as it writes. The lock file is
``<folder>/.entrenar.lock`` for a folder and ``<folder>/.<name>.lock`` for a single
output file, so two runs writing different files of one folder do not collide. Its
content is the holder, ``{"pid", "host", "since"}``, which a second run that finds the
lock taken names in its `entrenar.errors.ConfigError`.

The operating system releases a ``flock`` when its holder dies (``kill -9``
included), so a lock file left by a dead process is simply taken over; the file is
removed when the lock is released. The lock is per process and re-entrant: a
workflow that holds it may call another that takes it again (``train`` → export).
It is advisory: it keeps entrenar runs apart, not other programs.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import threading
import time
from typing import Any

from entrenar.errors import ConfigError
from entrenar.io.atomic import file_mode

FOLDER_LOCK = ".entrenar.lock"
"""The lock file's name inside a locked output folder."""

_HELD: dict[str, list[int]] = {}  # lock file -> [fd, depth, created the folder]
_GUARD = threading.Lock()


def lock_file(target: str | os.PathLike[str], *, folder: bool = True) -> str:
    """The lock file of output ``target``: inside a folder, or beside a file.

    Folders are resolved (``os.path.realpath``), so two paths to one folder give
    one lock.
    """
    target = os.path.abspath(os.fspath(target))
    if folder:
        return os.path.join(os.path.realpath(target), FOLDER_LOCK)
    head, name = os.path.split(target)
    return os.path.join(os.path.realpath(head), f".{name}.lock")


def read_holder(path: str) -> dict[str, Any] | None:
    """The holder recorded in lock file ``path`` (None: none recorded or unreadable)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        text = os.read(fd, 4096).decode("utf-8", "replace")
    finally:
        os.close(fd)
    try:
        holder = json.loads(text)
    except ValueError:
        return None
    return holder if isinstance(holder, dict) else None


def _describe(holder: dict[str, Any] | None) -> str:
    if holder is None:
        return "another process (its pid is not recorded yet)"
    pid, host = holder.get("pid"), holder.get("host")
    text = f"pid {pid} on host {host}"
    if holder.get("since"):
        text += f", since {holder['since']}"
    if host == socket.gethostname() and isinstance(pid, int) and not _alive(pid):
        text += "; that process has exited, so a child process it started holds it"
    return text


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # exists, owned by someone else
        return True
    return True


def _open_locked(path: str, target: str) -> tuple[int, dict[str, Any] | None]:
    """``(fd, previous holder)`` of ``path`` locked exclusively, or a ConfigError."""
    flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
    while True:
        try:
            fd = os.open(path, flags, file_mode())
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise ConfigError(
                    f"{path} is a symbolic link: entrenar does not follow links in "
                    "its output folders; remove it"
                ) from None
            raise
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise ConfigError(
                f"{target} is being written by another entrenar run "
                f"({_describe(read_holder(path))}; lock file {path}): wait for it "
                "to finish, or write to another output"
            ) from None
        try:  # the holder we waited on may have removed the file: lock the new one
            same = os.path.samestat(os.fstat(fd), os.stat(path, follow_symlinks=False))
        except FileNotFoundError:
            same = False
        if same:
            return fd, read_holder(path)
        os.close(fd)


def _remove_empty(folder: str, created: bool) -> None:
    if created:
        with contextlib.suppress(OSError):
            os.rmdir(folder)  # fails, as it should, unless the folder is empty


def _record_holder(fd: int) -> None:
    since = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    holder = {"pid": os.getpid(), "host": socket.gethostname(), "since": since}
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(holder) + "\n").encode(), 0)


class OutputLock:
    """Hold the output lock of ``target`` (see the module docstring).

    Args:
        target: the output folder, or the output file with ``folder=False``.
        folder: whether ``target`` is a folder (created if missing) or a file.
        enabled: False makes the lock a no-op (JAX processes other than process 0
            of a multi-process run, which write the same folder by design).

    Attributes:
        path: the lock file.
        previous: the holder recorded by a dead process whose lock was taken over
            (None when the lock file was new).

    Example:
        >>> import tempfile
        >>> with tempfile.TemporaryDirectory() as d, OutputLock(d) as lock:
        ...     read_holder(lock.path)["pid"] == os.getpid()
        True
    """

    def __init__(
        self,
        target: str | os.PathLike[str],
        *,
        folder: bool = True,
        enabled: bool = True,
    ) -> None:
        self.target = os.path.abspath(os.fspath(target))
        self.folder, self.enabled = folder, enabled
        self.path = lock_file(self.target, folder=folder)
        self.previous: dict[str, Any] | None = None
        self._held = False

    def acquire(self) -> OutputLock:
        """Take the lock (re-entrant in this process).

        Raises:
            ConfigError: another process holds it (the message names the holder).
        """
        if not self.enabled or self._held:
            return self
        with _GUARD:
            held = _HELD.get(self.path)
            if held is not None:
                held[1] += 1
            else:
                folder = os.path.dirname(self.path)
                created = self.folder and not os.path.isdir(folder)
                os.makedirs(folder, exist_ok=True)
                try:
                    fd, self.previous = _open_locked(self.path, self.target)
                except BaseException:
                    _remove_empty(folder, created)
                    raise
                _record_holder(fd)
                _HELD[self.path] = [fd, 1, created]
        self._held = True
        return self

    def release(self) -> None:
        """Give the lock back; the last holder removes the lock file.

        A folder the lock created is removed too if nothing was written into it.
        """
        if not self._held:
            return
        self._held = False
        with _GUARD:
            held = _HELD[self.path]
            held[1] -= 1
            if held[1] > 0:
                return
            del _HELD[self.path]
            with contextlib.suppress(OSError):
                os.unlink(self.path)  # while still locked: no one waits on this inode
            os.close(held[0])
            _remove_empty(os.path.dirname(self.path), bool(held[2]))

    def __enter__(self) -> OutputLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


__all__ = ["FOLDER_LOCK", "OutputLock", "lock_file", "read_holder"]
