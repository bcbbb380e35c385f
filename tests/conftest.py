"""Test configuration: JAX on the CPU with strict dtype promotion, compiled once.

Strict promotion makes silent float64/int mixing an error, so dtype bugs fail loudly
(equinox's tests do the same). Hypothesis keeps a small, deterministic budget so the
suite stays fast on a 2-core machine.

Compilation is most of the suite's time, and many tests (the examples, the command
line, the notebooks, each in a subprocess, and the xdist workers of `make test`)
compile the same programs. JAX's persistent compilation cache, set here through the
environment so that every subprocess inherits it, keeps each compiled program once in
``~/.cache/entrenar/jax-compilation`` (under ``$ENTRENAR_CACHE_DIR`` when that is set;
bounded to 2 GiB at the start of each session, least recently read entries deleted), so
a second run, from this clone or another, compiles only what changed. Set
``JAX_COMPILATION_CACHE_DIR`` yourself to move it, or to an empty string to turn it
off. The cache key holds the program, the jax/jaxlib versions, the backend and
``XLA_FLAGS``, so a test that compares two ISAs still compiles twice. Every program
is kept, however quick its compile (JAX's default keeps only those over a second; a
floor of 0.1 s left the hundreds of small programs a model test compiles, each just
under or over it by the machine's load, to be compiled again on most runs: the warm
run of tests/nn/test_nn_llama.py and tests/quant/test_quant_matvec.py took 102 CPU-s
with that floor and 34 with none; the small entries add a few MB).
"""

import contextlib
import gc
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault(
    "JAX_COMPILATION_CACHE_DIR",
    os.path.join(
        os.environ.get("ENTRENAR_CACHE_DIR")
        or os.path.join(os.path.expanduser("~"), ".cache", "entrenar"),
        "jax-compilation",
    ),
)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
# -1: JAX's own bound re-reads every entry's access time, under a lock that stalls the
# other workers, on each write (with ~10,000 entries, workers at 50% of a core); the
# suite bounds the folder once per session instead (`pytest_configure`).
os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", "-1")

import jax
import pytest
from hypothesis import HealthCheck, settings

CACHE_BOUND = 2 << 30  # bytes of compiled programs kept between sessions

jax.config.update("jax_numpy_dtype_promotion", "strict")
# in case jax was imported before this file ran (the environment is read at import)
jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
jax.config.update(
    "jax_persistent_cache_min_compile_time_secs",
    float(os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"]),
)
jax.config.update(
    "jax_compilation_cache_max_size", int(os.environ["JAX_COMPILATION_CACHE_MAX_SIZE"])
)


def _atomic_cache_put() -> None:
    """Make JAX's persistent cache write each entry whole (temp file + rename).

    JAX 0.8's ``LRUCache.put`` writes ``<key>-cache`` in place (``write_bytes``), and
    without its size bound (``-1`` above) takes no lock: an xdist worker that finds
    the file while another is still writing it reads a torn program, and a process
    killed mid-write (a timeout, Ctrl-C) leaves one behind for every later run. XLA
    deserializes such bytes without checking them and the worker dies (SIGSEGV in
    ``get_executable_and_time``, seen twice in one session). Written to a temporary
    name in the same folder and renamed, a reader sees the whole entry or none.
    """
    try:
        from jax._src import lru_cache
    except ImportError:  # another JAX layout: keep JAX's own put
        return
    cache_cls = getattr(lru_cache, "LRUCache", None)
    put = getattr(cache_cls, "put", None)
    if put is None or getattr(put, "_entrenar_atomic", False):
        return

    def atomic_put(self: Any, key: str, value: bytes) -> None:
        if getattr(self, "eviction_enabled", True):  # JAX's locked path as it is
            return put(self, key, value)
        path = self.path / f"{key}{lru_cache._CACHE_SUFFIX}"
        if not key or path.exists():
            return put(self, key, value)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_bytes(value)
        os.replace(tmp, path)
        return None

    atomic_put._entrenar_atomic = True  # type: ignore[attr-defined]
    cache_cls.put = atomic_put


_atomic_cache_put()

settings.register_profile(
    "entrenar",
    max_examples=25,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile("entrenar")


@contextlib.contextmanager
def _deadline(seconds: float) -> Iterator[None]:
    """Fail (instead of hanging) when the body runs past ``seconds`` (SIGALRM)."""

    def expire(*_: object) -> None:
        raise TimeoutError(f"still running after {seconds} s")

    old = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


@pytest.fixture
def deadline() -> Callable[[float], contextlib.AbstractContextManager[None]]:
    """The context manager that fails a hanging test body in time (SIGALRM)."""
    return _deadline


@pytest.fixture(scope="module")
def quick_compiles() -> Iterator[None]:
    """XLA without most optimizations: tiny programs compile in half the time.

    A module of tiny models opts in with
    ``pytestmark = pytest.mark.usefixtures("quick_compiles")``.
    """
    before = jax.config.read("jax_disable_most_optimizations")
    jax.config.update("jax_disable_most_optimizations", True)
    yield
    jax.config.update("jax_disable_most_optimizations", before)


def prune_compilation_cache(folder: str, bound: int = CACHE_BOUND) -> int:
    """Delete the least recently read programs until ``folder`` holds ``bound`` bytes.

    Recency is the file's access time (the filesystem updates it on the first read
    after a write and then daily under ``relatime``: coarse, but enough to drop the
    programs no test has asked for since). Returns the number of entries deleted.
    """
    if not folder or not os.path.isdir(folder):
        return 0
    entries = []
    with os.scandir(folder) as it:
        for e in it:
            if e.name.endswith(".tmp") and e.is_file():  # a writer killed (an hour)
                if time.time() - e.stat().st_mtime > 3600:
                    with contextlib.suppress(FileNotFoundError):
                        os.remove(e.path)
            elif e.name.endswith("-cache") and e.is_file():
                st = e.stat()
                entries.append((max(st.st_atime, st.st_mtime), st.st_size, e.path))
    total = sum(size for _, size, _ in entries)
    deleted = 0
    for _, size, path in sorted(entries):
        if total <= bound:
            break
        for stale in (path, path.removesuffix("-cache") + "-atime"):
            with contextlib.suppress(FileNotFoundError):
                os.remove(stale)
        total -= size
        deleted += 1
    return deleted


def _map_count() -> int | None:
    """The number of memory mappings of this process (Linux), else None."""
    try:
        with open("/proc/self/maps", "rb") as f:
            return f.read().count(b"\n")
    except OSError:
        return None


def _map_limit() -> int:
    """The kernel's bound on one process's mappings (``vm.max_map_count``)."""
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            return int(f.read())
    except (OSError, ValueError):
        return 65530


MAP_BOUND = _map_limit() // 4
"""Mappings past which a test's end drops JAX's programs (`_bound_jit_code`)."""


@pytest.fixture(autouse=True)
def _bound_jit_code() -> Iterator[None]:
    """Keep an xdist worker's JIT code under the kernel's mapping limit.

    XLA:CPU maps each compiled object's code and data as separate mappings (three per
    object, thousands per model test), and a long-lived worker keeps every program
    its tests compiled through JAX's in-memory caches. One worker of `make test` ran
    past ``vm.max_map_count`` (65,530) during tests/nn/test_nn_scoring.py: the next
    ``mmap`` failed and the worker died inside XLA (a compile, a cache read or write:
    three CI runs, always after tests/nn/test_nn_generate_transformers.py, which alone
    adds ~40,000). Past `MAP_BOUND` a test's end calls `jax.clear_caches`, so the
    programs can be freed; later tests get them back from the persistent cache.
    """
    yield
    count = _map_count()
    if count is not None and count > MAP_BOUND:
        jax.clear_caches()
        gc.collect()


def pytest_configure(config: pytest.Config) -> None:
    """Bound the compilation cache once, in the controlling process (not per worker)."""
    if not hasattr(config, "workerinput"):
        prune_compilation_cache(os.environ["JAX_COMPILATION_CACHE_DIR"])


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Run the tests marked slow first (stable order otherwise).

    With xdist workers, a minute-long test collected last leaves the other workers
    idle at the end; started first, the short tests fill in around it. `make test`
    uses ``--dist worksteal``: the first worker starts on the first half (every slow
    test) and the other, its own half done, takes the short tests from the end of the
    first's queue, so they end within one test of each other.
    """
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


_HOLD = """
import sys
from entrenar.io.lock import OutputLock
locks = [OutputLock(p, folder=p.endswith("/")).acquire() for p in sys.argv[1:]]
print("ready", flush=True)
sys.stdin.read()
for lock in locks:
    lock.release()
"""


def _hold_locks(*targets: object) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", _HOLD, *map(str, targets)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    return proc


@pytest.fixture
def hold_locks() -> Callable[..., subprocess.Popen[str]]:
    """Another process holding `OutputLock`s of targets (a folder ends with ``/``).

    It holds them until its stdin is closed; the test closes it and waits.
    """
    return _hold_locks
