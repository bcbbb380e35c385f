"""The bounded cache of compiled graph programs, and how to size, inspect and clear it.

The eager engine (`entrenar.autograd.engine`) compiles one XLA program per graph
structure *and shape* (XLA needs static shapes) and keeps it here, so a loop that
repeats a step runs one compiled call per step. The cache is least-recently used with
a bound (`DEFAULT_CACHE_SIZE` programs): a stream of distinct shapes evicts old
programs instead of growing memory without end. Evicted programs are released (JAX's
executable and trace caches are keyed by the dropped function, so they go with it).

Example:
    >>> import entrenar.autograd as ag
    >>> old = ag.set_cache_size(8)  # returns the previous bound
    >>> ag.cache_info().max_size
    8
    >>> _ = ag.set_cache_size(old)
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Hashable
from typing import NamedTuple

from entrenar.errors import ConfigError

DEFAULT_CACHE_SIZE = 64
"""Compiled programs kept by default: about 0.1-2 MB each on CPU (by program size)."""


class CacheInfo(NamedTuple):
    """Counters of the compiled-program cache (since the last `clear_caches`).

    Attributes:
        size: programs held now.
        max_size: the bound (`set_cache_size`).
        hits: calls that found their program compiled.
        misses: calls that compiled a program (exact shapes or a shape bucket).
        evictions: programs dropped because the cache was full.
        bucketed: evaluations run by a padded shape-bucket program (see
            `entrenar.autograd.bucket`) instead of an exact-shape one.
    """

    size: int
    max_size: int
    hits: int
    misses: int
    evictions: int
    bucketed: int


class ProgramCache:
    """A least-recently-used map ``key -> compiled function`` with a size bound."""

    def __init__(self, max_size: int = DEFAULT_CACHE_SIZE):
        self.max_size = max_size
        self._items: collections.OrderedDict[Hashable, Callable] = (
            collections.OrderedDict()
        )
        self.counts: collections.Counter[str] = collections.Counter()

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._items

    def keys(self) -> list[Hashable]:
        """Keys from least to most recently used."""
        return list(self._items)

    def get(self, key: Hashable) -> Callable | None:
        """The program for ``key`` (marked most recently used), or None."""
        fn = self._items.get(key)
        if fn is not None:
            self._items.move_to_end(key)
            self.counts["hits"] += 1
        return fn

    def put(self, key: Hashable, fn: Callable) -> None:
        """Insert ``fn``; evict least recently used programs beyond the bound."""
        self.counts["misses"] += 1
        if self.max_size <= 0:
            return
        self._items[key] = fn
        self._items.move_to_end(key)
        self._shrink()

    def pop(self, key: Hashable) -> None:
        """Forget ``key`` if present."""
        self._items.pop(key, None)

    def resize(self, max_size: int) -> None:
        """Change the bound, evicting at once if the cache is over it."""
        self.max_size = max_size
        self._shrink()

    def _shrink(self) -> None:
        while len(self._items) > max(self.max_size, 0):
            self._items.popitem(last=False)
            self.counts["evictions"] += 1

    def clear(self) -> None:
        """Drop every program and reset the counters."""
        self._items.clear()
        self.counts.clear()


programs = ProgramCache()


def set_cache_size(n: int) -> int:
    """Bound the number of compiled programs kept; returns the previous bound.

    Each graph structure evaluated eagerly needs one program per distinct shape (two
    when it is also differentiated: the forward and the forward+backward). A larger
    bound keeps more shapes warm; a smaller one caps memory. ``0`` keeps none (every
    evaluation compiles: slow, for memory-starved sessions only).

    Raises:
        ConfigError: ``n`` is not a non-negative integer.
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ConfigError(
            f"set_cache_size needs a non-negative int (programs to keep), got {n!r}"
        )
    old = programs.max_size
    programs.resize(n)
    return old


def cache_info() -> CacheInfo:
    """Size, bound and hit/miss/eviction counters of the compiled-program cache."""
    c = programs.counts
    return CacheInfo(
        len(programs),
        programs.max_size,
        c["hits"],
        c["misses"],
        c["evictions"],
        c["bucketed"],
    )


__all__ = [
    "DEFAULT_CACHE_SIZE",
    "CacheInfo",
    "ProgramCache",
    "cache_info",
    "programs",
    "set_cache_size",
]
