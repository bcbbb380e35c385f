"""The suite's compilation cache is bounded once per session (tests/conftest.py)."""

import importlib.util
import os
from pathlib import Path

spec = importlib.util.spec_from_file_location(
    "suite_conftest", Path(__file__).with_name("conftest.py")
)
assert spec is not None and spec.loader is not None
suite_conftest = importlib.util.module_from_spec(spec)
spec.loader.exec_module(suite_conftest)


def test_least_recently_read_programs_go_first(tmp_path):
    for i in range(6):  # entry i was last read at time 1000 + i, 100 bytes each
        entry = tmp_path / f"jit_f-{i}-cache"
        entry.write_bytes(b"x" * 100)
        (tmp_path / f"jit_f-{i}-atime").write_bytes(b"t")
        os.utime(entry, (1000 + i, 1000 + i))
    (tmp_path / "notes.txt").write_bytes(b"y" * 1000)  # not an entry: never counted
    assert suite_conftest.prune_compilation_cache(str(tmp_path), bound=350) == 3
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == ["jit_f-3-atime", "jit_f-3-cache", "jit_f-4-atime", "jit_f-4-cache",
                    "jit_f-5-atime", "jit_f-5-cache", "notes.txt"]  # fmt: skip
    assert suite_conftest.prune_compilation_cache(str(tmp_path), bound=350) == 0


def test_missing_or_disabled_cache_is_left_alone(tmp_path):
    assert suite_conftest.prune_compilation_cache("", bound=0) == 0
    assert (
        suite_conftest.prune_compilation_cache(str(tmp_path / "absent"), bound=0) == 0
    )
