"""Native kernels (entrenar/native/): several at once on XLA's pool; the loader."""

from __future__ import annotations

import os
import platform
import re
import shutil
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
    with pytest.raises(native.BuildError, match="building the native kernel 'adamw'"):
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


# --- portability: flags per machine, the fallback without a compiler ---------------


@pytest.mark.parametrize(
    ("machine", "system", "extra"),
    [
        ("x86_64", "Linux", ("-march=native", "-mprefer-vector-width=512")),
        ("AMD64", "Windows", ("-march=native", "-mprefer-vector-width=512")),
        ("aarch64", "Linux", ("-mcpu=native",)),
        ("arm64", "Darwin", ()),  # Apple Clang targets the CPU by default
        ("riscv64", "Linux", ()),
    ],
)
def test_build_flags_fit_the_machine(machine, system, extra):
    flags = native.build_flags(machine, system)
    assert flags == (*native.BASE_FLAGS, *extra)
    if machine not in ("x86_64", "AMD64"):  # x86-only options never reach other CPUs
        assert not any("vector-width" in f or "march" in f for f in flags)


def _run(code: str, tmp_path, **env: str) -> subprocess.CompletedProcess[str]:
    """``code`` in a fresh interpreter with a fresh kernel cache and ``env`` added."""
    full = {**os.environ, "ENTRENAR_CACHE_DIR": str(tmp_path / "cache"), **env}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=full,
        capture_output=True,
        text=True,
        timeout=300,
    )


FALLBACK = """
    import warnings
    warnings.simplefilter("error", RuntimeWarning)  # as pytest's filterwarnings does
    import jax.numpy as jnp
    from entrenar import native, quant
    from entrenar.quant.linear import quantized_matmul
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        on = [native.load(k) for k in ("adamw", "nf4_matmul", "attention")]
        w = jnp.linspace(-1.0, 1.0, 64 * 128).reshape(64, 128)
        y = quantized_matmul(quant.quantize(w, "nf4"), jnp.ones((2, 128)))
    print(on, [type(w.message).__name__ for w in seen], y.shape)
    print(*[str(w.message) for w in seen], sep="\\n")
"""


def test_no_compiler_is_one_warning_and_the_jax_path(tmp_path):
    """No compiler anywhere: every kernel off, one NativeKernelWarning, same API."""
    empty = tmp_path / "bin"
    empty.mkdir()
    out = _run(FALLBACK, tmp_path, CXX="", PATH=str(empty))
    assert out.returncode == 0, out.stderr[-2000:]
    first, message = out.stdout.splitlines()[:2]
    assert first == "[False, False, False] ['NativeKernelWarning'] (2, 64)"
    assert "no C++ compiler found" in message


def test_an_invalid_cxx_is_not_replaced_by_another_compiler(tmp_path):
    out = _run(FALLBACK, tmp_path, CXX=str(tmp_path / "no-such-compiler"))
    assert out.returncode == 0, out.stderr[-2000:]
    first, message = out.stdout.splitlines()[:2]
    assert first.startswith("[False, False, False] ['NativeKernelWarning']")
    assert "no-such-compiler" in message and "names no executable" in message


def _fake_compiler(tmp_path, body: str) -> str:
    """A script standing in for a compiler: ``--version`` answers, ``body`` runs."""
    path = tmp_path / "fake-c++"
    path.write_text(
        "#!/bin/sh\n"
        'if [ "$1" = "--version" ]; then printf "fake \\377\\376 1.0\\n"; exit 0; fi\n'
        f"{body}\n"
    )
    path.chmod(0o755)
    return str(path)


def test_a_compiler_that_hangs_times_out(tmp_path, monkeypatch):
    monkeypatch.setenv("ENTRENAR_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("ENTRENAR_NATIVE_TIMEOUT", "1")
    hang = _fake_compiler(tmp_path, "exec /bin/sleep 60")
    with pytest.raises(native.BuildError, match="did not finish in 1 s"):
        native.build("adamw", hang)


def test_a_compiler_writing_no_library_leaves_nothing_cached(tmp_path, monkeypatch):
    """``CXX=/bin/true`` exits 0 and writes nothing: refused, the cache stays empty."""
    monkeypatch.setenv("ENTRENAR_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.raises(native.BuildError, match="wrote no shared library"):
        native.build("adamw", _fake_compiler(tmp_path, "exit 0"))
    assert not list((tmp_path / "cache" / "native").glob("*.so*"))


def test_load_never_raises_for_a_strange_compiler(tmp_path):
    """Non-UTF-8 ``--version`` and a failing build: False and one warning, no error."""
    fake = _fake_compiler(tmp_path, "echo 'error: \\377' >&2; exit 1")
    out = _run(FALLBACK, tmp_path, CXX=fake)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith("[False, False, False] ['NativeKernelWarning']")


needs_compiler = pytest.mark.skipif(
    native.find_compiler() is None, reason="no C++ compiler"
)


@needs_compiler
def test_a_truncated_cached_library_is_rebuilt_not_loaded(tmp_path):
    """Half a library used to kill every later run with SIGBUS; now it is rebuilt."""
    code = "from entrenar import native; print(native.load('adamw'))"
    assert _run(code, tmp_path).stdout.strip() == "True"
    (library,) = (tmp_path / "cache" / "native").glob("adamw-*.so")
    size = library.stat().st_size
    library.write_bytes(library.read_bytes()[: size // 2])
    assert not native.verified(library)
    out = _run(code, tmp_path)
    assert out.returncode == 0 and out.stdout.strip() == "True", out.stderr[-2000:]
    assert library.stat().st_size == size and native.verified(library)


PLANT = r"""
#include <stdio.h>
__attribute__((constructor)) static void planted(void) {
  FILE* f = fopen("MARKER", "w"); if (f) { fputs("ran", f); fclose(f); }
}
"""


@needs_compiler
@pytest.mark.parametrize("shared_folder", [True, False])
def test_a_planted_library_never_runs(tmp_path, shared_folder):
    """A library planted under the predictable name: not loaded, its code never runs.

    In a world-writable cache folder the folder itself is refused; in the user's own
    folder the planted file has no matching digest and is rebuilt over.
    """
    code = "from entrenar import native; print(native.load('adamw'))"
    assert _run(code, tmp_path).stdout.strip() == "True"  # learn the name
    cache = tmp_path / "cache" / "native"
    (library,) = cache.glob("adamw-*.so")
    library.unlink()
    native.verified(library)  # no library: False, no error
    marker = tmp_path / "ran"
    source = tmp_path / "plant.c"
    source.write_text(PLANT.replace("MARKER", str(marker)))
    compiler = native.find_compiler()
    assert compiler is not None
    subprocess.run(
        [compiler, "-x", "c", "-shared", "-fPIC", str(source), "-o", str(library)],
        check=True,
    )
    if shared_folder:
        cache.chmod(0o777)
    out = _run(code, tmp_path)
    assert out.returncode == 0 and out.stdout.strip() == "True", out.stderr[-2000:]
    assert not marker.exists()
    if shared_folder:
        assert "is not owned by you or is writable by others" in out.stderr
        private = re.search(r"kernels are built in (\S+) for this process", out.stderr)
        assert private and os.path.isabs(private.group(1)), out.stderr[-2000:]
        assert not os.path.exists(private.group(1))  # removed when the process exited


def test_the_cache_folder_is_private_under_any_umask(tmp_path):
    code = """
        import os, stat
        os.umask(0)
        from entrenar import native
        print(oct(stat.S_IMODE(native.trusted_cache_dir().stat().st_mode)))
    """
    out = _run(code, tmp_path)
    assert out.stdout.strip() == "0o700", out.stderr[-2000:]


AVX2_ONLY = """
    import subprocess
    import jax, jax.numpy as jnp
    import numpy as np
    from entrenar import native, quant
    from entrenar.native import toolchain
    from entrenar.quant.linear import quantized_matmul

    # an x86-64 CPU without AVX-512 (AMD Zen 2/3, older Intel): what -march=native
    # gives there, forced here
    toolchain.build_flags = lambda *_: (*toolchain.BASE_FLAGS, "-march=x86-64-v3")
    w = quant.quantize(jax.random.normal(jax.random.key(0), (96, 512)), "nf4")
    x = jax.random.normal(jax.random.key(1), (3, 512))
    out = {}
    for p in ("native", "jax"):
        with native.policy(p):
            out[p] = (quantized_matmul(w, x), quant.dequantize(w, jnp.bfloat16))
    (y, d), (y_ref, d_ref) = out["native"], out["jax"]
    np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-5)
    assert bool(jnp.all(d == d_ref))
    libs = sorted((toolchain.cache_dir()).glob("nf4_*.so"))
    dis = subprocess.run(["objdump", "-d", *map(str, libs)], capture_output=True,
                         text=True, check=True).stdout
    print(len(libs), "zmm" in dis, "ymm" in dis)
"""


@needs_compiler
@pytest.mark.skipif(
    platform.machine() not in ("x86_64", "AMD64") or shutil.which("objdump") is None,
    reason="x86-64 with objdump only",
)
def test_kernels_built_without_avx512_run_and_agree(tmp_path):
    """AVX-512 paths are optional: an AVX2-only build has none and gives the same."""
    out = _run(AVX2_ONLY, tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["3", "False", "True"]  # nf4_{matmul,(de)quantize}
