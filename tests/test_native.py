"""Native kernels (entrenar/native.py): several at once on XLA's pool; the loader."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from entrenar import native


@pytest.mark.skipif(not native.load("nf4_dequantize"), reason="no C++ compiler")
def test_kernels_running_at_once_do_not_deadlock():
    """Independent custom calls run at once, each splitting its work over one pool.

    A kernel that waited for its queued tasks hung here (the QLoRA step did):
    ParallelFor only waits for work that a running thread has claimed.
    """
    code = textwrap.dedent(
        """
        import jax, jax.numpy as jnp
        from entrenar import quant
        ws = [jax.random.normal(jax.random.key(i), (1024, 1024)) for i in range(6)]
        qs = [quant.quantize(w, "nf4") for w in ws]
        f = jax.jit(lambda qs: sum(quant.dequantize(q, jnp.bfloat16).sum() for q in qs))
        for _ in range(30):
            f(qs).block_until_ready()
        print("ok")
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
    )
    assert out.stdout.strip() == "ok", out.stderr[-2000:]


def test_build_reports_the_compiler_error(tmp_path, monkeypatch):
    monkeypatch.setenv("ENTRENAR_CACHE_DIR", str(tmp_path))
    with pytest.raises(RuntimeError, match="building the native kernel 'adamw'"):
        native.build("adamw", "/bin/false")
    assert not list((tmp_path / "native").glob("*.so"))  # nothing half-written


def test_build_is_cached_by_content(tmp_path, monkeypatch):
    if native.find_compiler() is None:
        pytest.skip("no C++ compiler")
    monkeypatch.setenv("ENTRENAR_CACHE_DIR", str(tmp_path))
    first = native.build("adamw", native.find_compiler())
    mtime = os.stat(first).st_mtime_ns
    assert native.build("adamw", native.find_compiler()) == first  # not rebuilt
    assert os.stat(first).st_mtime_ns == mtime
    assert first.parent == tmp_path / "native" and first.name.startswith("adamw-")


@pytest.mark.parametrize(("value", "on"), [("0", False), ("no", False), ("1", True)])
def test_enabled_reads_the_environment(monkeypatch, value, on):
    monkeypatch.setenv("ENTRENAR_NATIVE", value)
    assert native.enabled() is on


def test_cache_dir_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("ENTRENAR_CACHE_DIR", str(tmp_path))
    assert native.cache_dir() == tmp_path / "native"


def test_compiler_from_cxx(monkeypatch):
    monkeypatch.setenv("CXX", sys.executable)  # any executable on the path
    assert native.find_compiler() == sys.executable


def test_load_from_several_threads_registers_once(tmp_path):
    """XLA refuses a second registration: threads racing to load get one answer."""
    if native.find_compiler() is None:
        pytest.skip("no C++ compiler")
    code = textwrap.dedent(
        """
        import threading, warnings
        warnings.simplefilter("error")
        from entrenar import native
        got = []
        ts = [threading.Thread(target=lambda: got.append(native.load("adamw")))
              for _ in range(4)]
        [t.start() for t in ts]
        [t.join() for t in ts]
        print(got)
        """
    )
    env = {**os.environ, "ENTRENAR_CACHE_DIR": str(tmp_path)}  # a fresh build
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True
    )
    assert out.stdout.strip() == "[True, True, True, True]", out.stderr[-2000:]
