"""Native CPU kernels: C++ compiled on first use, called through XLA's FFI.

Some updates are bound by memory traffic that XLA:CPU cannot bring down, because it
does not fuse a loop with several outputs: AdamW writes θ, m and v, so XLA runs three
loops and moves 40 bytes per parameter where one pass moves 28. For those, entrenar
ships C++ sources (``entrenar/kernels/*.cc``) written against XLA's FFI headers (which
jaxlib ships: `jax.ffi.include_dir`). `load` compiles one with the system C++ compiler
(``$CXX``, else ``c++``, ``g++`` or ``clang++``) the first time it is needed, keeps the
library in a cache folder and registers its handlers as XLA custom-call targets.

Where no compiler is found, the build fails, the backend is not the CPU, or
``ENTRENAR_NATIVE=0`` is set, `load` returns False and the callers use their pure-JAX
path: the same results to float32 rounding (a kernel and XLA may place fused
multiply-adds differently), only slower.

Cache: ``$ENTRENAR_CACHE_DIR/native`` or ``~/.cache/entrenar/native``. A library's file
name holds a hash of its source, the compiler and its version, the flags, jaxlib's
version and the CPU's feature flags (the build uses ``-march=native``), so machines
that share a home folder never load each other's builds. Libraries are written to a
temporary name and renamed into place (atomic).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import warnings
from pathlib import Path

KERNELS: dict[str, tuple[str, dict[str, str]]] = {
    # name: (source file in entrenar/kernels, {custom-call target: C symbol})
    "adamw": ("adamw.cc", {"entrenar_adamw": "EntrenarAdamW"}),
    "attention": (
        "attention.cc",
        {
            "entrenar_attention_fwd": "EntrenarAttentionForward",
            "entrenar_attention_bwd": "EntrenarAttentionBackward",
        },
    ),
    "softmax_xent": (
        "softmax_xent.cc",
        {"entrenar_softmax_xent": "EntrenarSoftmaxXent"},
    ),
    "nf4_matmul": ("nf4_matmul.cc", {"entrenar_nf4_matmul": "EntrenarNf4Matmul"}),
    "nf4_dequantize": (
        "nf4_dequantize.cc",
        {
            "entrenar_nf4_dequantize_f32": "EntrenarNf4DequantizeF32",
            "entrenar_nf4_dequantize_bf16": "EntrenarNf4DequantizeBf16",
        },
    ),
}
"""The kernels `load` knows."""

FLAGS = (
    "-O3",
    "-march=native",
    "-std=c++17",
    "-shared",
    "-fPIC",
    "-fno-math-errno",  # lets sqrt vectorize
    "-ffp-contract=fast",  # fused multiply-adds, as XLA:CPU's own loops use
    "-fopenmp-simd",
    "-mprefer-vector-width=512",  # AVX-512 CPUs: whole-register loops (GCC, Clang)
    "-pthread",
)
"""Compiler flags of every kernel build."""

SOURCES = Path(__file__).resolve().parent / "kernels"


def cache_dir() -> Path:
    """Where compiled kernels are kept (see the module docstring)."""
    root = os.environ.get("ENTRENAR_CACHE_DIR")
    base = Path(root) if root else Path.home() / ".cache" / "entrenar"
    return base / "native"


def enabled() -> bool:
    """False when ``ENTRENAR_NATIVE`` is ``0``, ``false`` or ``no``."""
    return os.environ.get("ENTRENAR_NATIVE", "1").strip().lower() not in (
        "0",
        "false",
        "no",
    )


def find_compiler() -> str | None:
    """The C++ compiler to use: ``$CXX``, else the first of c++, g++, clang++."""
    names = [os.environ["CXX"]] if os.environ.get("CXX") else []
    for name in [*names, "c++", "g++", "clang++"]:
        path = shutil.which(name)
        if path:
            return path
    return None


def cpu_flags() -> list[str]:
    """The CPU's feature flags: ``/proc/cpuinfo``'s ``flags`` (Arm: ``Features``).

    Without ``/proc/cpuinfo``, the machine and processor names instead.
    """
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line.split(":", 1)[1].split()
    except OSError:
        pass
    return [platform.machine(), platform.processor()]


def build(name: str, compiler: str) -> Path:
    """Compile kernel ``name`` (if not cached) and return the library's path.

    Raises:
        KeyError: an unknown kernel.
        RuntimeError: the compiler failed (its output is in the message).
    """
    import jax
    import jaxlib

    source_name, _ = KERNELS[name]
    source = SOURCES / source_name
    version = subprocess.run(
        [compiler, "--version"], capture_output=True, text=True, check=False
    ).stdout
    headers = sorted(SOURCES.glob("*.h"))  # shared by the kernels (parallel.h)
    key = "\n".join(
        [
            source.read_text(),
            *(h.read_text() for h in headers),
            compiler,
            version,
            " ".join(FLAGS),
            jax.__version__,
            jaxlib.__version__,
            " ".join(cpu_flags()),
        ]
    )
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    target = cache_dir() / f"{name}-{digest}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{name}-", suffix=".so", dir=target.parent)
    os.close(fd)
    include = [f"-I{jax.ffi.include_dir()}", f"-I{SOURCES}"]
    cmd = [compiler, *FLAGS, *include, str(source), "-o", tmp]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        os.unlink(tmp)
        raise RuntimeError(
            f"building the native kernel {name!r} failed ({' '.join(cmd)}):\n"
            f"{done.stderr[-2000:]}"
        )
    os.replace(tmp, target)
    return target


_LOADED: dict[str, bool] = {}
_LOCK = threading.Lock()


def load(name: str) -> bool:
    """Build (once) and register kernel ``name``; True when its targets can be called.

    Returns False, with one warning naming the reason, when the kernel cannot be
    built here; never raises for a missing compiler or a failed build. Thread-safe:
    XLA refuses a second registration of a target, so one thread builds and
    registers while the others wait for its answer.
    """
    with _LOCK:
        if name not in _LOADED:
            _LOADED[name] = _build_and_register(name)
        return _LOADED[name]


def _build_and_register(name: str) -> bool:
    import jax

    if not enabled() or jax.default_backend() != "cpu":
        return False
    compiler = find_compiler()
    if compiler is None:
        warnings.warn(
            f"entrenar: no C++ compiler found (set CXX), so the native {name!r} "
            "kernel is off and the pure-JAX path runs instead (same results, slower)",
            RuntimeWarning,
            stacklevel=3,
        )
        return False
    try:
        path = build(name, compiler)
        lib = ctypes.cdll.LoadLibrary(str(path))
        for target, symbol in KERNELS[name][1].items():
            capsule = jax.ffi.pycapsule(getattr(lib, symbol))
            jax.ffi.register_ffi_target(target, capsule, platform="cpu")
    except (OSError, RuntimeError, AttributeError) as e:
        warnings.warn(
            f"entrenar: the native {name!r} kernel is off ({e}); the pure-JAX path "
            "runs instead (same results, slower)",
            RuntimeWarning,
            stacklevel=3,
        )
        return False
    return True


__all__ = [
    "FLAGS",
    "KERNELS",
    "build",
    "cache_dir",
    "cpu_flags",
    "enabled",
    "find_compiler",
    "load",
]
