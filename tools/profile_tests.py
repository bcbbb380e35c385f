"""A pytest plugin that writes where each test's time goes, one JSON line per test.

    PYTHONPATH=$PWD:tools python -m pytest -p profile_tests -n 2 --dist worksteal ...
    python tools/profile_tests.py /tmp/entrenar-profile/*.jsonl    # the summary

Each line (in ``$TEST_PROFILE_DIR``, default ``/tmp/entrenar-profile``, one file per
xdist worker): the test's id; its wall and CPU seconds (this process, all threads:
setup, call and teardown); the CPU seconds of the subprocesses it waited for
(``os.times``' children: the CLI, the examples, the multi-device checks); and the
seconds JAX spent tracing, lowering to MLIR and compiling (or reading from the
persistent cache) in this process, from `jax.monitoring`'s duration events, with the
persistent cache's hits and misses (a line without some of them, from an earlier
version, reads them as 0). Compile seconds are wall time inside XLA: on a
loaded machine they grow with the load, CPU seconds much less. The summary prints the
totals, the modules by CPU (self + children) and the slowest tests.
"""

from __future__ import annotations

import collections
import glob
import json
import os
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest

TRACE = "/jax/core/compile/jaxpr_trace_duration"
LOWER = "/jax/core/compile/jaxpr_to_mlir_module_duration"
COMPILE = "/jax/core/compile/backend_compile_duration"
HITS = "/jax/compilation_cache/cache_hits"
MISSES = "/jax/compilation_cache/cache_misses"

_events: collections.defaultdict[str, float] = collections.defaultdict(float)
_out: Any = None


def _duration(event: str, duration_secs: float, **_: str | int) -> None:
    _events[event] += duration_secs


def _count(event: str, **_: object) -> None:
    _events[event] += 1


def pytest_configure(config: pytest.Config) -> None:
    """Listen to JAX's compile events; open this worker's output file."""
    global _out
    import jax.monitoring

    jax.monitoring.register_event_duration_secs_listener(_duration)
    jax.monitoring.register_event_listener(_count)
    worker = getattr(config, "workerinput", {}).get("workerid", "main")
    folder = os.environ.get("TEST_PROFILE_DIR", "/tmp/entrenar-profile")
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"{worker}-{os.getpid()}.jsonl")
    _out = open(path, "a", buffering=1)  # open for the whole session


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: object) -> Iterator[None]:
    """Time one test's setup, call and teardown; write its line."""
    _events.clear()
    wall, cpu, before = time.perf_counter(), time.process_time(), os.times()
    yield
    after = os.times()
    children = (after.children_user + after.children_system) - (
        before.children_user + before.children_system
    )
    record = {
        "id": item.nodeid,
        "wall": time.perf_counter() - wall,
        "cpu": time.process_time() - cpu,
        "child": children,
        "trace": _events[TRACE],
        "lower": _events[LOWER],
        "compile": _events[COMPILE],
        "hits": int(_events[HITS]),
        "misses": int(_events[MISSES]),
    }
    if _out is not None:
        _out.write(json.dumps(record) + "\n")


KEYS = ("wall", "cpu", "child", "trace", "lower", "compile", "hits", "misses")
"""The figures of a line the summary adds up; one a line lacks counts as 0 (files
written by earlier versions of this plugin have no compile events)."""


def read_records(paths: list[str]) -> list[dict[str, Any]]:
    """The lines of ``paths`` (blank ones skipped), each with every `KEYS` figure."""
    records = []
    for path in paths:
        with open(path) as f:
            for line in f:
                if line.strip():
                    r = json.loads(line)
                    records.append(r | {k: r.get(k) or 0 for k in KEYS})
    return records


def summary(paths: list[str], top: int = 30) -> None:
    """Print the totals, the modules by CPU (self + children), the slowest tests."""
    records, keys = read_records(paths), KEYS
    total = {k: sum(r[k] for r in records) for k in keys}
    print(f"{len(records)} tests", " ".join(f"{k} {v:.0f}" for k, v in total.items()))
    modules: dict[str, collections.Counter[str]] = collections.defaultdict(
        collections.Counter
    )
    for r in records:
        m = modules[r["id"].split("::")[0]]
        m["n"] += 1
        for k in keys:
            m[k] += r[k]
    print(f"{'module':58} {'n':>4} " + " ".join(f"{k:>7}" for k in keys))
    ranked = sorted(modules.items(), key=lambda kv: -(kv[1]["cpu"] + kv[1]["child"]))
    for name, m in ranked[:top]:
        print(f"{name:58} {m['n']:4d} " + " ".join(f"{m[k]:7.0f}" for k in keys))
    print("slowest tests (CPU + children)")
    for r in sorted(records, key=lambda r: -(r["cpu"] + r["child"]))[:top]:
        print(f"{r['cpu'] + r['child']:7.1f} {r['compile']:7.1f} {r['id']}")


if __name__ == "__main__":
    summary(sys.argv[1:] or glob.glob("/tmp/entrenar-profile/*.jsonl"))
