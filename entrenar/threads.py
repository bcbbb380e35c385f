"""Thread pools a process keeps between calls, made again in a forked child.

The loads do their side work (faulting in pages, dequantizing, quantizing, building
a leaf beside the layers) on small thread pools made once per process
(`shared_pool`). A child made by ``os.fork`` (``multiprocessing``'s default start
method on Linux up to Python 3.13) inherits the pool objects but none of their
threads: work submitted to them would wait forever, so a load in the child would
hang. The pools are forgotten in a forked child (``os.register_at_fork``) and made
again when the child first asks for one. (JAX itself warns that a forked child may
deadlock in JAX, whose compiler has threads of its own: where a child computes with
JAX, start it with ``multiprocessing.get_context("spawn")``.)

>>> pool = shared_pool("doc-example", 1)
>>> pool is shared_pool("doc-example", 1)
True
>>> pool.submit(sum, [1, 2]).result()
3
"""

from __future__ import annotations

import os
import threading

# imported with entrenar, not at a load's first pool (``concurrent.futures`` imports
# it lazily: ~4 ms in a new process)
from concurrent.futures import ThreadPoolExecutor

_POOLS: dict[str, ThreadPoolExecutor] = {}
_LOCK = threading.Lock()


def shared_pool(name: str, workers: int) -> ThreadPoolExecutor:
    """This process's pool ``name`` (its threads named after it), made at first use.

    ``workers`` is its thread count when it is made; later calls get the same pool.
    """
    with _LOCK:
        pool = _POOLS.get(name)
        if pool is None:
            pool = _POOLS[name] = ThreadPoolExecutor(workers, name)
        return pool


def _forget_in_child() -> None:
    """In a forked child: drop the parent's pools (their threads are not here)."""
    global _LOCK
    _LOCK = threading.Lock()  # another thread may have held it at the fork
    _POOLS.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)

__all__ = ["shared_pool"]
