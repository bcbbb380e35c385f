"""Device meshes: a ``{"data": N, "fsdp": M}`` spec to a `jax.sharding.Mesh`.

Every mesh has the two axes `MESH_AXES`, in that order (an axis left out of the spec
has size 1), so that partition specs may always name both:

- ``data``: pure data parallelism; params and optimizer state are replicated along it.
- ``fsdp``: fully sharded data parallelism (ZeRO-3, Rajbhandari et al. 2020,
  arXiv:1910.02054): the batch is split along it too, and each large parameter, its
  gradient and its optimizer moments are split along it in ``M`` slices.

The devices are ``jax.devices()`` (all processes' devices, process by process) laid
out row-major as ``(N, M)``: the ``fsdp`` axis is the inner one, so with ``M`` no
larger than a host's device count each FSDP group lives on one host (its all-gathers
and reduce-scatters stay on the fast links) and ``data`` spans hosts.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from entrenar.errors import ConfigError

MESH_AXES: tuple[str, str] = ("data", "fsdp")
"""The axes of every mesh, outer to inner."""

MeshSpec = Mapping[str, int]
"""``{"data": N, "fsdp": M}``; one size may be ``-1`` (all remaining devices)."""


def check_mesh_spec(spec: Any) -> dict[str, int]:
    """``spec`` as a plain dict, or a `ConfigError` naming what is wrong.

    >>> check_mesh_spec({"fsdp": 4})
    {'data': 1, 'fsdp': 4}
    >>> check_mesh_spec({"model": 2})  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    entrenar.errors.ConfigError: mesh axis 'model' is not one of ('data', 'fsdp') ...
    """
    if not isinstance(spec, Mapping):
        raise ConfigError(
            f"a mesh is a mapping like {{'data': 2, 'fsdp': 4}}; got {spec!r}"
        )
    for name, size in spec.items():
        if name not in MESH_AXES:
            raise ConfigError(
                f"mesh axis {name!r} is not one of {MESH_AXES} (data parallel and "
                "FSDP; tensor and pipeline parallelism are not provided)"
            )
        whole = isinstance(size, (int, np.integer)) and not isinstance(size, bool)
        if not whole:
            raise ConfigError(
                f"mesh axis {name!r} must be a whole number of devices (>= 1, or -1: "
                f"the remaining devices); got {size!r} ({type(size).__name__})"
            )
        if not (size >= 1 or size == -1):
            raise ConfigError(
                f"mesh axis {name!r} must have a size >= 1 (or -1: the remaining "
                f"devices); got {size!r}"
            )
    sizes = {name: int(spec.get(name, 1)) for name in MESH_AXES}
    if list(sizes.values()).count(-1) > 1:
        raise ConfigError(f"at most one mesh axis may have size -1; got {dict(spec)}")
    return sizes


def make_mesh(spec: MeshSpec, devices: Sequence[Any] | None = None) -> Mesh:
    """A ``("data", "fsdp")`` mesh over ``devices`` (default: ``jax.devices()``).

    Args:
        spec: axis sizes, e.g. ``{"data": 2, "fsdp": 4}``; missing axes have size 1,
            and one size may be ``-1`` for "the remaining devices".
        devices: the devices, outer axis first (default: every process's devices).

    Raises:
        ConfigError: an unknown axis, a bad size, or sizes whose product is not the
            number of devices.

    Example:
        >>> import jax
        >>> mesh = make_mesh({"data": -1})
        >>> mesh.axis_names, mesh.devices.size == jax.device_count()
        (('data', 'fsdp'), True)
    """
    devs = list(jax.devices() if devices is None else devices)
    sizes = check_mesh_spec(spec)
    known = math.prod(s for s in sizes.values() if s != -1)
    for name, s in sizes.items():
        if s == -1:
            if len(devs) % known:
                raise ConfigError(
                    f"mesh {dict(spec)}: {len(devs)} devices do not split into "
                    f"{known} × (a whole number)"
                )
            sizes[name] = len(devs) // known
    shape = tuple(sizes[a] for a in MESH_AXES)
    if math.prod(shape) != len(devs):
        raise ConfigError(
            f"mesh {dict(spec)} needs {math.prod(shape)} devices, but there are "
            f"{len(devs)} ({jax.default_backend()}); make the sizes multiply to "
            f"{len(devs)} (one may be -1) or start the process with that many devices "
            "(CPU: XLA_FLAGS=--xla_force_host_platform_device_count=N before jax "
            "is imported)"
        )
    return Mesh(np.array(devs, dtype=object).reshape(shape), MESH_AXES)


def resolve_mesh(mesh: Mesh | MeshSpec | None) -> Mesh | None:
    """A `Mesh` from a mesh, a spec (`make_mesh`) or None (no mesh: one device)."""
    if mesh is None or isinstance(mesh, Mesh):
        if mesh is not None and tuple(mesh.axis_names) != MESH_AXES:
            raise ConfigError(
                f"entrenar's meshes have the axes {MESH_AXES}; got "
                f"{tuple(mesh.axis_names)}: build it with make_mesh"
            )
        return mesh
    return make_mesh(mesh)


def batch_shards(mesh: Mesh) -> int:
    """How many slices a batch is split in: ``data × fsdp`` (every device's own)."""
    return int(mesh.shape["data"] * mesh.shape["fsdp"])


def check_batch_rows(rows: int, mesh: Mesh, what: str) -> None:
    """Refuse training batches of ``rows`` rows that ``mesh``'s devices cannot split.

    Every device takes ``rows / (data × fsdp)`` rows of each batch
    (`entrenar.distributed.shard_batch`); checked when training starts, before
    anything compiles, with ``what`` saying where ``rows`` comes from.

    >>> from jax.sharding import AbstractMesh
    >>> check_batch_rows(6, AbstractMesh((2, 4), MESH_AXES), "batch_size 6")
    Traceback (most recent call last):
    ...
    entrenar.errors.ConfigError: training batches of 6 rows (batch_size 6) do not split over the mesh's 8 devices ({'data': 2, 'fsdp': 4}); make it a multiple of 8
    """  # noqa: E501
    n = batch_shards(mesh)
    if rows % n:
        raise ConfigError(
            f"training batches of {rows} rows ({what}) do not split over the mesh's "
            f"{n} devices ({dict(mesh.shape)}); make it a multiple of {n}"
        )


__all__ = [
    "MESH_AXES",
    "MeshSpec",
    "batch_shards",
    "check_batch_rows",
    "check_mesh_spec",
    "make_mesh",
    "resolve_mesh",
]
