"""Native CPU kernels: C++ compiled on first use, called through XLA's FFI.

Some updates are bound by memory traffic that XLA:CPU cannot bring down, because it
does not fuse a loop with several outputs: AdamW writes θ, m and v, so XLA runs three
loops and moves 40 bytes per parameter where one pass moves 28. For those, entrenar
ships C++ sources (``entrenar/kernels/*.cc``); `load` builds one (the compiler, its
flags and a verified cache are `entrenar.native.toolchain`'s) the first time it is
needed and registers its handlers as XLA custom-call targets. Each kernel has a
pure-JAX twin that gives the same results to float32 rounding (a kernel and XLA may
place fused multiply-adds differently), only slower.

**One policy decides which runs**: every call site asks `use(name, *operands)` before
it emits a custom call, and keeps only its kernel's own shape rules (NF4 block sizes,
mask ranks). The kernel runs when, in this order (the first that fails is the reason
`reason` gives and ``entrenar info`` prints):

1. the policy is not ``"jax"`` (`set_policy`, `policy`, the YAML key
   ``model.kernels``);
2. ``ENTRENAR_NATIVE`` is not ``0``, ``false`` or ``no``;
3. JAX's default backend is the CPU (the kernels are CPU code);
4. the process sees one device. A custom call is opaque to XLA's SPMD partitioner:
   on operands sharded over several devices it gathers each one whole onto every
   device to run the call, the memory and traffic sharding exists to avoid. Inside
   `jax.jit` an operand is a tracer that does not say how it is sharded, so the rule
   is the process's: with several devices the pure-JAX path runs everywhere and the
   partitioner shards it;
5. every operand has a dtype the kernel takes (`SIGNATURES`);
6. `load` builds and registers it here.

A kernel's plain C function run on host buffers through ctypes (the NF4 quantizer
a load calls on a memory-mapped file) is found with `library`, which applies the
same six rules.

Policies: ``"auto"`` (the default) runs a kernel where all six hold and the pure-JAX
path elsewhere; ``"native"`` makes a kernel that fails 2, 3, 4 or 6 an
`entrenar.errors.UnsupportedError` instead (`check` tests 2-4 and the compiler when
a run starts; a failing build shows at the first trace); a call whose operands do not
fit (5) takes the JAX path under every policy; ``"jax"`` never runs a kernel. A
change of policy clears JAX's caches (`jax.clear_caches`), so a function traced
under the old one is traced again.

`load` never raises for a missing, failing or hanging compiler or a damaged cache:
the first such fallback in a process is one `NativeKernelWarning` (a
``UserWarning``) naming the reason; later ones are logged on the ``entrenar.native``
logger.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import re
import threading
import typing
import warnings
from collections.abc import Iterator
from typing import Any, Literal

import numpy as np

from entrenar.errors import ConfigError, UnsupportedError
from entrenar.native.toolchain import (
    BASE_FLAGS,
    KERNELS,
    BuildError,
    NativeKernelWarning,
    build,
    build_flags,
    cache_dir,
    compiler_version,
    cpu_flags,
    find_compiler,
    private_to_user,
    trusted_cache_dir,
    verified,
)

Policy = Literal["auto", "native", "jax"]
POLICIES: tuple[str, ...] = typing.get_args(Policy)

SIGNATURES: dict[str, tuple[tuple[str, ...], ...]] = {
    "adamw": (("float32",),) * 4,  # θ, g, m, v
    "adamw8bit": (("float32",),) * 2,  # θ, g (m and v are uint8 codes)
    # q, k, v, the products' inputs (float32, or rounded to bfloat16)
    "attention": (*(("float32",),) * 3, ("float32", "bfloat16")),
    "softmax_xent": (("float32",), ("integer",), ("bfloat16",)),  # z, y, dz
    "nf4_matmul": (("float32",),),  # x (the weight is NF4 codes)
    "nf4_dequantize": (("float32", "bfloat16"),),  # the output
    "ggml_matvec": (("float32",),),  # x (the weight is llama.cpp blocks or bytes)
    "nf4_quantize": (("float32", "bfloat16"),),  # the matrices quantized
}
"""The dtypes each kernel takes: one tuple per operand of `use` (``"integer"``: any
integer dtype)."""

_log = logging.getLogger("entrenar.native")
_POLICY: str = "auto"
_LOADED: dict[str, bool] = {}
_FAILED: dict[str, str] = {}  # kernel -> why `load` returned False
_LIBRARIES: dict[str, ctypes.CDLL] = {}  # kernel -> its loaded library
_LOCK = threading.Lock()
_WARNED = False


def enabled() -> bool:
    """False when ``ENTRENAR_NATIVE`` is ``0``, ``false`` or ``no``."""
    return os.environ.get("ENTRENAR_NATIVE", "1").strip().lower() not in (
        "0",
        "false",
        "no",
    )


def set_policy(policy: str) -> None:
    """Set the process's kernel policy: ``"auto"``, ``"native"`` or ``"jax"``.

    See the module docstring; ``model.kernels`` in a run's YAML sets it for the run.

    Raises:
        ConfigError: another value.
    """
    global _POLICY
    if policy not in POLICIES:
        raise ConfigError(
            f"kernel policy {policy!r}: choose one of {', '.join(POLICIES)}"
        )
    if policy != _POLICY:
        import jax

        jax.clear_caches()  # traces made under the old policy are stale
        _POLICY = policy


def current_policy() -> str:
    """The process's kernel policy (`set_policy`)."""
    return _POLICY


@contextlib.contextmanager
def policy(value: str) -> Iterator[None]:
    """`set_policy` ``value`` inside the ``with`` block, the previous one after it."""
    before = _POLICY
    set_policy(value)
    try:
        yield
    finally:
        set_policy(before)


def _process_reason() -> str | None:
    """Why no kernel runs in this process (policy, switch, backend, devices)."""
    if _POLICY == "jax":
        return "policy jax"
    why = _environment_reason()
    if why is None:
        import jax

        devices = jax.device_count()
        if devices > 1:
            why = f"{devices} devices (a kernel would gather sharded operands)"
    return why


def _environment_reason() -> str | None:
    """``ENTRENAR_NATIVE`` off, or a backend other than the CPU; else None."""
    if not enabled():
        return f"ENTRENAR_NATIVE={os.environ.get('ENTRENAR_NATIVE', '').strip()}"
    import jax

    backend = jax.default_backend()
    return None if backend == "cpu" else f"backend {backend}"


def reason(name: str) -> str | None:
    """Why kernel ``name`` does not run in this process; None when it does.

    None means operands of the kernel's dtypes (`SIGNATURES`) go through it. Builds
    the kernel on first call (`load`).

    Raises:
        KeyError: ``name`` is not one of `KERNELS`.
    """
    _known(name)
    why = _process_reason()
    if why is None and not load(name):
        why = _FAILED.get(name, "it could not be loaded")
    return why


def use(name: str, *operands: Any) -> bool:
    """Whether kernel ``name`` runs for these operands (see the module docstring).

    Args:
        name: one of `KERNELS`.
        *operands: the arrays (or tracers, `jax.ShapeDtypeStruct`, dtypes) the
            kernel takes, in the order of ``SIGNATURES[name]``.

    Returns:
        True when the caller should emit the custom call, False for its JAX path.

    Raises:
        UnsupportedError: the policy is ``"native"`` and the kernel cannot run here
            (operands of other dtypes are never an error).
        KeyError: an unknown kernel; TypeError: the wrong number of operands
            (programming errors).
    """
    _known(name)
    signature = SIGNATURES[name]
    if len(operands) != len(signature):
        raise TypeError(
            f"native.use({name!r}) takes {len(signature)} operands, got {len(operands)}"
        )
    if not all(map(_takes, signature, operands)):
        return False
    why = reason(name)
    if why is not None and _POLICY == "native":
        raise UnsupportedError(_refusal(f"the native {name!r} kernel", why))
    return why is None


def library(name: str, *operands: Any) -> ctypes.CDLL | None:
    """Kernel ``name``'s library, for its plain C functions on host buffers (ctypes).

    The same decision as `use` (policy, switch, backend, devices, dtypes, build): the
    library where ``use(name, *operands)`` is True, else None. A caller that runs the
    kernel's C code without XLA (a load quantizing numpy buffers) gets the results
    its custom calls give.

    Raises:
        UnsupportedError, KeyError, TypeError: as `use`.
    """
    return _LIBRARIES.get(name) if use(name, *operands) else None


def check() -> None:
    """Under the ``"native"`` policy, fail now if no kernel can run in this process.

    Tests what needs no build (the switch, the backend, the devices, a compiler), so
    a run stops before it loads its model; a build that fails shows at the first
    trace (`use`). Nothing to check under the other policies.

    Raises:
        UnsupportedError: the policy is ``"native"`` and kernels cannot run here.
    """
    if _POLICY != "native":
        return
    why = _process_reason() or _compiler_missing()
    if why is not None:
        raise UnsupportedError(_refusal("the native kernels", why))


def _refusal(what: str, why: str) -> str:
    return (
        f"kernel policy 'native' (model.kernels): {what} cannot run here: {why}; "
        "fix that, or set model.kernels: auto to take the pure-JAX path where a "
        "kernel is off"
    )


def _known(name: str) -> None:
    if name not in KERNELS:
        raise KeyError(f"unknown native kernel {name!r}; known: {sorted(KERNELS)}")


def _takes(allowed: tuple[str, ...], operand: Any) -> bool:
    dtype = np.dtype(getattr(operand, "dtype", operand))
    return dtype.name in allowed or (
        "integer" in allowed and np.issubdtype(dtype, np.integer)
    )


def _compiler_missing() -> str | None:
    """Why no compiler is found, or None when one is."""
    if find_compiler() is not None:
        return None
    wanted = os.environ.get("CXX", "").strip()
    if wanted:
        return f"CXX={wanted!r} names no executable"
    return "no C++ compiler found (set CXX)"


def _warn_once(message: str) -> None:
    """The first fallback of the process is a warning; the rest go to the log."""
    global _WARNED
    if _WARNED:
        _log.info(message)
        return
    _WARNED = True
    warnings.warn(message, NativeKernelWarning, stacklevel=4)


def load(name: str) -> bool:
    """Build (once) and register kernel ``name``; True when its targets can be called.

    Returns False where ``ENTRENAR_NATIVE`` is off, the backend is not the CPU, or the
    kernel cannot be built or loaded here (one warning per process naming the reason;
    `reason` repeats it); never raises for a missing, failing or hanging compiler or
    a damaged cache. Thread-safe: XLA refuses a second registration of a target, so
    one thread builds and registers while the others wait for its answer. Call sites
    ask `use`, which also applies the policy, the device rule and the dtypes.

    Raises:
        KeyError: ``name`` is not one of `KERNELS` (a programming error).
    """
    _known(name)
    with _LOCK:
        if name not in _LOADED:
            why = _build_and_register(name)
            _LOADED[name] = why is None
            if why is not None:
                _FAILED[name] = why
        return _LOADED[name]


def _build_and_register(name: str) -> str | None:
    """Build and register kernel ``name``: None, or why it is off."""
    import jax

    off = _environment_reason()
    if off is not None:
        return off
    compiler = find_compiler()
    if compiler is None:
        why = _compiler_missing() or "no C++ compiler found (set CXX)"
        _warn_once(
            f"entrenar: {why}, so the native {name!r} kernel is off and the "
            "pure-JAX path runs instead (same results, slower)"
        )
        return why
    try:
        path = build(name, compiler)
        lib = ctypes.cdll.LoadLibrary(str(path))
        for target, symbol in KERNELS[name][1].items():
            capsule = jax.ffi.pycapsule(getattr(lib, symbol))
            jax.ffi.register_ffi_target(target, capsule, platform="cpu")
        _LIBRARIES[name] = lib
    except Exception as e:  # any build or load problem: the pure-JAX path
        _warn_once(
            f"entrenar: the native {name!r} kernel is off ({e}); the pure-JAX path "
            "runs instead (same results, slower)"
        )
        return _short(e)
    return None


def _short(error: Exception) -> str:
    """One line for `reason`: the build error without its command line."""
    text = (str(error).splitlines() or [type(error).__name__])[0]
    if isinstance(error, BuildError):
        text = re.sub(r" \([^()]* -o [^()]*\)", "", text.split(" failed: ", 1)[-1])
        text = "build failed: " + text.rstrip(":")
    else:
        text = f"load failed: {text}"
    return text if len(text) <= 200 else text[:199] + "…"


__all__ = [
    "BASE_FLAGS",
    "KERNELS",
    "POLICIES",
    "SIGNATURES",
    "BuildError",
    "NativeKernelWarning",
    "Policy",
    "build",
    "build_flags",
    "cache_dir",
    "check",
    "compiler_version",
    "cpu_flags",
    "current_policy",
    "enabled",
    "find_compiler",
    "library",
    "load",
    "policy",
    "private_to_user",
    "reason",
    "set_policy",
    "trusted_cache_dir",
    "use",
    "verified",
]
