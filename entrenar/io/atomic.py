"""Atomic file writes: a temporary file in the target's folder, then `os.replace`.

Readers never see a half-written file: either the old file or the complete new one.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from typing import IO


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike[str], mode: str = "wb") -> Iterator[IO]:
    """Open a temporary file for writing; on success it replaces ``path`` atomically.

    If the block raises, the temporary file is removed and ``path`` is untouched.

    >>> import os, tempfile
    >>> p = os.path.join(tempfile.mkdtemp(), "x.txt")
    >>> with atomic_write(p, "w") as f:
    ...     _ = f.write("hello")
    >>> open(p).read()
    'hello'
    """
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".part", dir=folder)
    try:
        with os.fdopen(fd, mode) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


__all__ = ["atomic_write"]
