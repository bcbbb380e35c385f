"""The loads' thread pools: one per name, made again in a forked child."""

import os
import subprocess
import sys
import textwrap

import pytest

from entrenar.threads import shared_pool

FORKED = """
    import os
    import numpy as np
    from entrenar.nn.host_arrays import host_buffer
    from entrenar.threads import shared_pool

    host_buffer((16 << 20,), np.uint8)  # the populate threads started, as by a load
    assert shared_pool("work", 1).submit(int, "1").result() == 1
    pid = os.fork()
    if pid == 0:  # the child: the parent's pool objects, none of their threads
        code = 1
        try:
            assert shared_pool("work", 1).submit(int, "2").result(timeout=20) == 2
            host_buffer((16 << 20,), np.uint8)  # populated on the child's threads
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    print("child", os.waitstatus_to_exitcode(status))
"""


def test_one_pool_per_name():
    pool = shared_pool("test-one", 2)
    assert shared_pool("test-one", 2) is pool
    assert shared_pool("test-other", 1) is not pool
    assert pool.submit(pow, 2, 10).result() == 1024


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no os.fork")
def test_a_forked_child_gets_pools_that_run():
    """Before: the child waited forever on the parent's pool (its threads not there)."""
    out = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", textwrap.dedent(FORKED)],
        capture_output=True, text=True, timeout=60,
        env=dict(os.environ, JAX_PLATFORMS="cpu"),
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "child 0", out.stdout + out.stderr[-2000:]
