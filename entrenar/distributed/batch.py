"""Batches on a mesh: axis 0 split over every device (``data × fsdp`` slices).

Under FSDP every device computes on its own examples too, so a batch ``(B, ...)`` is
split along axis 0 over both mesh axes jointly, ``PartitionSpec(("data", "fsdp"))``:
device ``(i, j)`` holds rows ``[(i M + j) b, (i M + j + 1) b)`` with ``b = B / (N M)``.

Several processes feed one global batch in either of two ways:

- `shard_batch`: every process holds the same global batch (the same loader with the
  same seed); each copies only its own devices' rows to them. The simplest way, and
  what the Trainer does.
- `host_local_batch`: each process loads only its own rows (`process_rows` says
  which) and the global array is assembled from the pieces
  (`jax.make_array_from_process_local_data`): no process reads the others' data.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from entrenar.distributed.mesh import MESH_AXES, batch_shards
from entrenar.distributed.rules import from_host, put
from entrenar.errors import ShapeError
from entrenar.tree import key_path_str
from entrenar.types import PyTree


def batch_sharding(mesh: Mesh, ndim: int = 1) -> NamedSharding:
    """Axis 0 over ``("data", "fsdp")``; a scalar (``ndim=0``) is replicated."""
    return NamedSharding(mesh, PartitionSpec(MESH_AXES) if ndim else PartitionSpec())


def _check_rows(name: str, shape: tuple[int, ...], mesh: Mesh) -> None:
    n = batch_shards(mesh)
    if shape and shape[0] % n:
        raise ShapeError(
            f"batch array {name!r} of shape {shape}: its {shape[0]} rows do not split "
            f"over the mesh's {n} devices (data × fsdp = {dict(mesh.shape)}); make the "
            f"batch size a multiple of {n}"
        )


def shard_batch(batch: PyTree, mesh: Mesh) -> PyTree:
    """Place a global batch on ``mesh``, axis 0 split over all devices.

    Every process passes the same global batch; each places only its own rows.

    Raises:
        ShapeError: a leading axis that the number of devices does not divide.

    Example:
        >>> import numpy as np
        >>> from entrenar.distributed import make_mesh
        >>> mesh = make_mesh({"data": -1})
        >>> b = shard_batch({"x": np.zeros((mesh.size * 2, 3), np.float32)}, mesh)
        >>> b["x"].shape == (mesh.size * 2, 3), len(b["x"].addressable_shards)
        (True, 1)
    """
    flat, treedef = jax.tree_util.tree_flatten_with_path(batch)
    out = []
    for path, x in flat:
        shape = tuple(np.shape(x))
        _check_rows(key_path_str(path), shape, mesh)
        s = batch_sharding(mesh, len(shape))
        if isinstance(x, jax.Array) and x.sharding == s:
            out.append(x)
        elif jax.process_count() == 1:
            out.append(jax.device_put(x, s))
        else:
            out.append(from_host(x, s))
    return jax.tree_util.tree_unflatten(treedef, out)


def place_batch(batch: PyTree, mesh: Mesh) -> PyTree:
    """`shard_batch` when every leading axis splits over the devices, else replicated.

    For evaluation batches (the last one of a data set is often smaller).
    """
    n = batch_shards(mesh)
    if all(
        np.ndim(x) and np.shape(x)[0] % n == 0 for x in jax.tree_util.tree_leaves(batch)
    ):
        return shard_batch(batch, mesh)
    rep = NamedSharding(mesh, PartitionSpec())
    return put(batch, jax.tree_util.tree_map(lambda _: rep, batch))


def process_rows(batch_size: int, mesh: Mesh) -> slice:
    """The rows of a global batch of ``batch_size`` that this process's devices hold.

    >>> from entrenar.distributed import make_mesh
    >>> process_rows(16, make_mesh({"data": -1}))
    slice(0, 16, None)
    """
    _check_rows("batch", (batch_size,), mesh)
    index = batch_sharding(mesh).addressable_devices_indices_map((batch_size,))
    starts = sorted(
        {(i[0].start or 0, i[0].stop or batch_size) for i in index.values() if i}
    )
    lo, hi = starts[0][0], starts[-1][1]
    if sum(b - a for a, b in starts) != hi - lo:
        raise ShapeError(  # a mesh whose devices interleave processes
            f"this process's devices hold rows {starts} of the batch, which are not "
            "contiguous; build the mesh with make_mesh (devices process by process)"
        )
    return slice(lo, hi)


def host_local_batch(
    local: Mapping[str, Any], mesh: Mesh, global_batch_size: int | None = None
) -> dict[str, jax.Array]:
    """Global arrays from each process's own rows (`process_rows`).

    Args:
        local: this process's rows of every batch array.
        mesh: the mesh; rows are split over ``("data", "fsdp")``.
        global_batch_size: the global batch (default: local rows × processes).
    """
    out = {}
    for name, x in local.items():
        x = np.asarray(x)
        n = global_batch_size or x.shape[0] * jax.process_count()
        _check_rows(name, (n, *x.shape[1:]), mesh)
        out[name] = jax.make_array_from_process_local_data(
            batch_sharding(mesh, x.ndim), x, (n, *x.shape[1:])
        )
    return out


__all__ = [
    "batch_sharding",
    "host_local_batch",
    "place_batch",
    "process_rows",
    "shard_batch",
]
