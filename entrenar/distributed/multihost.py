"""Several processes, one program: `jax.distributed.initialize` from config or env.

Every process runs the same script; process 0 also runs the coordinator (a small
gRPC service at ``coordinator``, ``host:port``, that the others reach at start-up).
After `initialize`, ``jax.devices()`` lists every process's devices and a mesh built
by `entrenar.distributed.make_mesh` spans them all. Settings, first found wins:

1. the arguments of `initialize` (from ``training.distributed`` in a config, say);
2. the environment: ``JAX_COORDINATOR_ADDRESS``, ``JAX_NUM_PROCESSES``,
   ``JAX_PROCESS_ID`` (and ``JAX_LOCAL_DEVICE_IDS``, read by JAX itself);
3. JAX's cluster detection (SLURM, Open MPI, Kubernetes, Cloud TPU): every
   setting left ``None``.

Launch recipes (specs/distributed.md): one process per host, each seeing its own
GPUs (``JAX_COORDINATOR_ADDRESS=host0:1234 JAX_NUM_PROCESSES=4 JAX_PROCESS_ID=<i>``);
on one multi-GPU node, a single process sees every GPU and needs no `initialize`.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

from entrenar.errors import ConfigError
from entrenar.types import PyTree

ENV = {
    "coordinator": "JAX_COORDINATOR_ADDRESS",
    "num_processes": "JAX_NUM_PROCESSES",
    "process_id": "JAX_PROCESS_ID",
}
"""The environment variables each setting is read from."""


@dataclasses.dataclass(frozen=True)
class ProcessConfig:
    """Where this process sits in a multi-process run (``None``: let JAX detect it)."""

    coordinator: str | None = None
    num_processes: int | None = None
    process_id: int | None = None

    @property
    def multi_process(self) -> bool:
        """Whether any setting is given (else: one process, or cluster detection)."""
        return any(v is not None for v in dataclasses.astuple(self))


_DIGITS = re.compile(r"[0-9]+")
_MAX_PROCESSES = 2**31 - 1  # jax.distributed passes both numbers to C++ as int32


def _int(value: str | int | None, name: str, source: str) -> int | None:
    """``value`` as a count or id: a Python int, or ASCII digits (an env variable).

    Floats, bools, signs, underscores and non-ASCII digits (which `int` accepts:
    ``int("1_0")``, ``int("٣")``, ``int(1.9)``) are refused rather than read as
    some other number.
    """
    if value is None or value == "":
        return None
    if isinstance(value, str):
        text = value.strip()
        if not _DIGITS.fullmatch(text):
            raise ConfigError(
                f"{source} {name} must be a whole number >= 0 written in the digits "
                f"0-9, got {value!r}"
            )
        out = int(text)
    elif isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ConfigError(
            f"{source} {name} must be an integer, got {value!r} "
            f"({type(value).__name__})"
        )
    else:
        out = int(value)
    if not 0 <= out <= _MAX_PROCESSES:
        raise ConfigError(
            f"{source} {name} must be in [0, {_MAX_PROCESSES}], got {out}"
        )
    return out


def _check_coordinator(coord: str) -> None:
    """``host:port`` with a host (IPv6 in brackets) and a port in 1..65535."""
    if not isinstance(coord, str):
        raise ConfigError(
            f"the coordinator address must be a string host:port, got {coord!r}"
        )
    host, _, port = coord.rpartition(":")
    bare_ipv6 = ":" in host and not (host.startswith("[") and host.endswith("]"))
    if (
        not host
        or bare_ipv6
        or "/" in host
        or any(c.isspace() for c in coord)
        or not _DIGITS.fullmatch(port)
        or not 1 <= int(port) <= 65535
    ):
        raise ConfigError(
            "the coordinator address must be host:port with a port in 1..65535 and "
            "no scheme or spaces (e.g. 10.0.0.1:1234, node-0:1234 or [fd00::1]:1234); "
            f"got {coord!r}"
        )


def process_config(
    coordinator: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    env: Mapping[str, str] | None = None,
) -> ProcessConfig:
    """The settings from the arguments, else ``env`` (default ``os.environ``).

    Raises:
        ConfigError: a non-integer count or id, an id out of range, a coordinator
            without ``host:port``, or a partial setting (a process count without a
            coordinator, say).

    Example:
        >>> process_config(env={"JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234",
        ...                     "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "1"})
        ProcessConfig(coordinator='10.0.0.1:1234', num_processes=2, process_id=1)
    """
    env = os.environ if env is None else env
    coord = coordinator if coordinator is not None else env.get(ENV["coordinator"])
    coord = coord or None
    n = _int(num_processes, "num_processes", "argument")
    if n is None:
        n = _int(env.get(ENV["num_processes"]), ENV["num_processes"], "environment")
    pid = _int(process_id, "process_id", "argument")
    if pid is None:
        pid = _int(env.get(ENV["process_id"]), ENV["process_id"], "environment")
    cfg = ProcessConfig(coord, n, pid)
    if not cfg.multi_process:
        return cfg
    missing = [k for k, v in dataclasses.asdict(cfg).items() if v is None]
    if missing:
        raise ConfigError(
            f"multi-process settings are incomplete: {dataclasses.asdict(cfg)}; set "
            f"{[ENV[k] for k in missing]} too (or pass them to initialize)"
        )
    assert coord is not None and n is not None and pid is not None
    _check_coordinator(coord)
    if n < 1:
        raise ConfigError(
            f"num_processes must be at least 1, got {n} (the processes that take part)"
        )
    if pid >= n:
        raise ConfigError(
            f"process_id {pid} is not in [0, num_processes={n}): number the "
            "processes 0 .. num_processes - 1"
        )
    return cfg


def initialize(
    coordinator: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    auto_detect: bool = False,
) -> ProcessConfig:
    """Join a multi-process run (call before any other JAX call); a no-op if alone.

    Args:
        coordinator: ``host:port`` of process 0's coordinator.
        num_processes: how many processes take part.
        process_id: this process's number, ``0 .. num_processes - 1``.
        auto_detect: with nothing set, let JAX detect a cluster (SLURM, MPI, ...);
            otherwise nothing set means a single process.

    Returns:
        The settings used. Calling it again (already initialized) does nothing.
    """
    cfg = process_config(coordinator, num_processes, process_id)
    if jax.distributed.is_initialized():
        return cfg
    if cfg.multi_process:
        jax.distributed.initialize(cfg.coordinator, cfg.num_processes, cfg.process_id)
    elif auto_detect:
        jax.distributed.initialize()
    return cfg


def gather_to_host(tree: PyTree) -> PyTree:
    """``tree`` with each array that spans other processes' devices made whole here.

    A split array (FSDP over several hosts) is gathered
    (`multihost_utils.process_allgather`, a collective: every process must call
    this with the same tree); a replicated one is read from a local copy. Arrays
    this process holds whole are returned as they are, so with one process the
    tree comes back unchanged. Writing a model (`np.asarray`) needs this: it
    cannot read an array with shards on other processes.

    Example:
        >>> import jax.numpy as jnp
        >>> w = jnp.ones(3)
        >>> gather_to_host({"w": w})["w"] is w
        True
    """

    def whole(x: Any) -> Any:
        if not isinstance(x, jax.Array) or x.is_fully_addressable:
            return x
        if x.is_fully_replicated:
            return x.addressable_data(0)
        return multihost_utils.process_allgather(x, tiled=True)

    return jax.tree_util.tree_map(whole, tree)


__all__ = ["ENV", "ProcessConfig", "gather_to_host", "initialize", "process_config"]
