"""`entrenar.io.heap`: glibc's mmap threshold fixed for big models only."""

import os
import subprocess
import sys

import pytest

CHECK = """
import sys
from entrenar.io.heap import BIG_MODEL_BYTES, bound_heap
print(bound_heap(BIG_MODEL_BYTES - 1), bound_heap(BIG_MODEL_BYTES))
"""


def _run(env_extra):
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_MMAP_THRESHOLD_"}
    env.update(env_extra)
    out = subprocess.run(
        [sys.executable, "-c", CHECK], env=env, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_threshold_fixed_for_big_models_only():
    # in a fresh process: mallopt changes the whole process's heap
    assert _run({}) == ["False", "True"]


def test_a_threshold_from_the_environment_is_kept():
    assert _run({"MALLOC_MMAP_THRESHOLD_": "65536"}) == ["False", "False"]
