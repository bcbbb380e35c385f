"""Building a native kernel: the compiler, its flags, and a cache that is checked.

`build` compiles one of `KERNELS` (``entrenar/kernels/*.cc``, written against XLA's
FFI headers, which jaxlib ships: `jax.ffi.include_dir`) with the system C++ compiler
(`find_compiler`: ``$CXX``, else ``c++``, ``g++`` or ``clang++``) and returns the
library's path; `entrenar.native.load` registers it and decides when it runs.

Flags: `build_flags` tunes for the machine (x86-64: ``-march=native`` and 512-bit
vectors; aarch64: ``-mcpu=native``) for GCC and Clang alike; when that build fails
(an old compiler, an unknown CPU) a portable build without machine flags is tried.

Cache: ``$ENTRENAR_CACHE_DIR/native`` or ``~/.cache/entrenar/native``, created
``0o700``. A library's file name holds a hash of its source, the compiler and its
version, the flags, jaxlib's version and the CPU's feature flags, so machines that
share a home folder never load each other's builds. The cache is untrusted until
checked: a folder not owned by the user or writable by group or others is not used
(the build goes to a private temporary folder instead), and a library is loaded only
when it is a regular file owned by the user whose SHA-256 equals the digest written
beside it (``<name>.so.sha256``, written after the library, atomically) — a truncated,
replaced or half-written library is rebuilt, never loaded.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import os
import platform
import shutil
import stat
import subprocess
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path

KERNELS: dict[str, tuple[str, dict[str, str]]] = {
    # name: (source file in entrenar/kernels, {custom-call target: C symbol})
    "adamw": ("adamw.cc", {"entrenar_adamw": "EntrenarAdamW"}),
    "adamw8bit": ("adamw8bit.cc", {"entrenar_adamw8bit": "EntrenarAdamW8bit"}),
    "attention": (
        "attention.cc",
        {
            "entrenar_attention_fwd": "EntrenarAttentionForward",
            "entrenar_attention_bwd": "EntrenarAttentionBackward",
            "entrenar_attention_cached": "EntrenarAttentionCached",
        },
    ),
    "softmax_xent": (
        "softmax_xent.cc",
        {"entrenar_softmax_xent": "EntrenarSoftmaxXent"},
    ),
    "nf4_matmul": ("nf4_matmul.cc", {"entrenar_nf4_matmul": "EntrenarNf4Matmul"}),
    "ggml_matvec": (
        "ggml_matvec.cc",
        {
            "entrenar_q_matvec": "EntrenarQMatvec",
            "entrenar_ggml_matvec": "EntrenarGgmlMatvec",
        },
    ),
    "nf4_dequantize": (
        "nf4_dequantize.cc",
        {
            "entrenar_nf4_dequantize_f32": "EntrenarNf4DequantizeF32",
            "entrenar_nf4_dequantize_bf16": "EntrenarNf4DequantizeBf16",
        },
    ),
    "nf4_quantize": (
        "nf4_quantize.cc",
        {
            "entrenar_nf4_quantize_f32": "EntrenarNf4QuantizeF32",
            "entrenar_nf4_quantize_bf16": "EntrenarNf4QuantizeBf16",
            "entrenar_nf4_quantize_dq_f32": "EntrenarNf4QuantizeDqF32",
            "entrenar_nf4_quantize_dq_bf16": "EntrenarNf4QuantizeDqBf16",
        },
    ),
}
"""The kernels `load` knows. A kernel may also export plain C functions for host
buffers (``nf4_quantize``'s ``EntrenarNf4QuantizeHost``), called through ctypes on
the library `entrenar.native.library` gives."""

BASE_FLAGS = (
    "-O3",
    "-std=c++17",
    "-shared",
    "-fPIC",
    "-fno-math-errno",  # lets sqrt vectorize
    "-ffp-contract=fast",  # fused multiply-adds, as XLA:CPU's own loops use
    "-fopenmp-simd",
    "-pthread",
)
"""Flags of every kernel build, portable across GCC and Clang on every CPU."""

COMPILER_TIMEOUT_S = 300.0
"""Seconds a compiler may run (``ENTRENAR_NATIVE_TIMEOUT`` overrides) before the
build counts as failed; ``--version`` gets 30 s."""

SOURCES = Path(__file__).resolve().parents[1] / "kernels"
_ELF, _MACHO, _MACHO_FAT = (
    b"\x7fELF",
    (b"\xcf\xfa\xed\xfe", b"\xce\xfa\xed\xfe"),
    b"\xca\xfe\xba\xbe",
)


class NativeKernelWarning(UserWarning):
    """The native kernels are off in this process; the pure-JAX path runs instead."""


class BuildError(RuntimeError):
    """A kernel could not be built here (compiler missing, failing or too slow)."""


def cache_dir() -> Path:
    """Where compiled kernels are kept (see the module docstring)."""
    root = os.environ.get("ENTRENAR_CACHE_DIR")
    base = Path(root) if root else Path.home() / ".cache" / "entrenar"
    return base / "native"


def find_compiler() -> str | None:
    """The C++ compiler to use: ``$CXX`` when set, else the first of c++, g++, clang++.

    A ``$CXX`` that names no executable gives None (no native kernels), not another
    compiler: the user asked for that one.
    """
    wanted = os.environ.get("CXX", "").strip()
    if wanted:
        return shutil.which(wanted)
    for name in ("c++", "g++", "clang++"):
        path = shutil.which(name)
        if path:
            return path
    return None


def compiler_version(compiler: str) -> str:
    """The first lines of ``compiler --version`` (any bytes decoded; 30 s at most).

    Raises:
        BuildError: the compiler cannot be run, fails, or does not answer in time.
    """
    try:
        done = subprocess.run(
            [compiler, "--version"], capture_output=True, timeout=30, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        raise BuildError(f"{compiler} --version failed: {e}") from None
    if done.returncode != 0:
        raise BuildError(f"{compiler} --version exited with {done.returncode}")
    return done.stdout.decode("utf-8", errors="replace")[:2000]


def build_flags(
    machine: str | None = None, system: str | None = None
) -> tuple[str, ...]:
    """The tuned flags for this machine (or the one named), for GCC and Clang alike.

    x86-64: ``-march=native -mprefer-vector-width=512`` (whole AVX-512 registers where
    the CPU has them; both GCC and Clang take the option). aarch64 Linux:
    ``-mcpu=native``. Apple silicon: Apple Clang's default target already is the CPU.
    Other machines: `BASE_FLAGS` only.
    """
    machine = (machine or platform.machine()).lower()
    system = system or platform.system()
    if machine in ("x86_64", "amd64", "x64"):
        return (*BASE_FLAGS, "-march=native", "-mprefer-vector-width=512")
    if machine in ("aarch64", "arm64") and system != "Darwin":
        return (*BASE_FLAGS, "-mcpu=native")
    return BASE_FLAGS


def cpu_flags() -> list[str]:
    """The CPU's feature flags: ``/proc/cpuinfo``'s ``flags`` (Arm: ``Features``).

    Without ``/proc/cpuinfo``, the machine and processor names instead.
    """
    try:
        with open("/proc/cpuinfo", errors="replace") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line.split(":", 1)[1].split()
    except OSError:
        pass
    return [platform.machine(), platform.processor()]


def private_to_user(path: Path) -> bool:
    """True when ``path`` is owned by this user and not writable by group or others.

    Always True where the system has no user ids (Windows).
    """
    if not hasattr(os, "geteuid"):
        return True
    st = os.lstat(path)
    return st.st_uid == os.geteuid() and not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)


_PRIVATE_DIR: Path | None = None


def trusted_cache_dir() -> Path:
    """`cache_dir`, created ``0o700``, or a private temporary folder when it is shared.

    A cache folder that another user owns, or that group or others may write, could
    hold a library planted under the name entrenar will load: it is not used (one
    warning) and this process builds into a folder of its own, removed when it exits.
    """
    global _PRIVATE_DIR
    folder = cache_dir()
    try:
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        if private_to_user(folder) and not folder.is_symlink():
            return folder
        reason = "is not owned by you or is writable by others"
    except OSError as e:
        reason = f"cannot be created ({e})"
    if _PRIVATE_DIR is None:
        _PRIVATE_DIR = Path(tempfile.mkdtemp(prefix="entrenar-native-"))
        atexit.register(shutil.rmtree, _PRIVATE_DIR, ignore_errors=True)
        warnings.warn(
            f"entrenar: the kernel cache {folder} {reason}; kernels are built in "
            f"{_PRIVATE_DIR} for this process instead (fix with `chmod go-w {folder}`"
            " or set ENTRENAR_CACHE_DIR to a folder of your own)",
            NativeKernelWarning,
            stacklevel=2,
        )
    return _PRIVATE_DIR


def _digest_path(library: Path) -> Path:
    return library.with_name(library.name + ".sha256")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def verified(library: Path) -> bool:
    """True when ``library`` may be loaded: a regular file of this user's, untouched.

    Its SHA-256 must equal the digest recorded beside it when it was built; a missing
    digest, a symlink, another owner or a different content is False.
    """
    digest = _digest_path(library)
    try:
        for path in (library, digest):
            if not stat.S_ISREG(os.lstat(path).st_mode) or not private_to_user(path):
                return False
        recorded = digest.read_text(encoding="ascii", errors="replace").strip()
        return recorded == _sha256(library)
    except OSError:
        return False


def _looks_like_a_library(path: Path) -> bool:
    with open(path, "rb") as f:
        magic = f.read(4)
    return magic == _ELF or magic in _MACHO or magic == _MACHO_FAT or magic[:2] == b"MZ"


def _atomic_write_text(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}-", dir=path.parent)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def _compile(compiler: str, flags: tuple[str, ...], name: str, target: Path) -> None:
    """Compile kernel ``name`` into ``target`` (atomically), then record its digest."""
    import jax

    source = SOURCES / KERNELS[name][0]
    fd, tmp = tempfile.mkstemp(
        prefix=f".{target.stem}-", suffix=".so", dir=target.parent
    )
    os.close(fd)
    include = [f"-I{jax.ffi.include_dir()}", f"-I{SOURCES}"]
    cmd = [compiler, *flags, *include, str(source), "-o", tmp]
    timeout = float(os.environ.get("ENTRENAR_NATIVE_TIMEOUT", COMPILER_TIMEOUT_S))
    try:
        try:
            done = subprocess.run(
                cmd, capture_output=True, timeout=timeout, check=False
            )
        except subprocess.TimeoutExpired:
            raise BuildError(
                f"the compiler did not finish in {timeout:g} s ({' '.join(cmd)}); "
                "set ENTRENAR_NATIVE_TIMEOUT to wait longer"
            ) from None
        except OSError as e:
            raise BuildError(f"the compiler could not run ({e})") from None
        if done.returncode != 0:
            stderr = done.stderr.decode("utf-8", errors="replace")
            raise BuildError(
                f"the compiler failed ({' '.join(cmd)}):\n{stderr[-2000:]}"
            )
        if not _looks_like_a_library(Path(tmp)):
            raise BuildError(
                f"the compiler {compiler} exited 0 but wrote no shared library "
                f"({os.path.getsize(tmp)} bytes); set CXX to a C++ compiler"
            )
        os.replace(tmp, target)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
    _atomic_write_text(_digest_path(target), _sha256(target) + "\n")


@contextlib.contextmanager
def _exclusive(folder: Path, name: str) -> Iterator[None]:
    """One process at a time checks, builds and loads kernel ``name`` in ``folder``."""
    try:
        import fcntl
    except ImportError:  # Windows: no advisory locks; atomic renames still hold
        yield
        return
    with open(folder / f".{name}.lock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def build(name: str, compiler: str) -> Path:
    """Compile kernel ``name`` (unless a verified build is cached); the library's path.

    The tuned flags (`build_flags`) are tried first, then `BASE_FLAGS`; a cached
    library that fails `verified` is rebuilt.

    Raises:
        KeyError: an unknown kernel.
        BuildError: the compiler failed, timed out or wrote no library (its output is
            in the message).
    """
    import jax
    import jaxlib

    source = SOURCES / KERNELS[name][0]
    try:
        version = compiler_version(compiler)
    except BuildError as e:
        raise BuildError(f"building the native kernel {name!r} failed: {e}") from None
    headers = sorted(SOURCES.glob("*.h"))  # shared by the kernels (parallel.h)
    common = [
        source.read_text(),
        *(h.read_text() for h in headers),
        compiler,
        version,
        jax.__version__,
        jaxlib.__version__,
        " ".join(cpu_flags()),
    ]
    folder = trusted_cache_dir()
    candidates = []
    for flags in dict.fromkeys([build_flags(), BASE_FLAGS]):
        digest = hashlib.sha256("\n".join([*common, " ".join(flags)]).encode())
        candidates.append((flags, folder / f"{name}-{digest.hexdigest()[:16]}.so"))
    with _exclusive(folder, name):
        for _, target in candidates:
            if verified(target):
                return target
        errors = []
        for flags, target in candidates:
            try:
                _compile(compiler, flags, name, target)
                return target
            except BuildError as e:
                errors.append(str(e))
        raise BuildError(
            f"building the native kernel {name!r} failed: " + "\n".join(errors)
        )


__all__ = [
    "BASE_FLAGS",
    "COMPILER_TIMEOUT_S",
    "KERNELS",
    "SOURCES",
    "BuildError",
    "NativeKernelWarning",
    "build",
    "build_flags",
    "cache_dir",
    "compiler_version",
    "cpu_flags",
    "find_compiler",
    "private_to_user",
    "trusted_cache_dir",
    "verified",
]
