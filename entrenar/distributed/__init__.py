"""Data-parallel and FSDP training on many devices and hosts, through jax.sharding.

Protocol::

    initialize()                               # several processes: before anything
    mesh = make_mesh({"data": N, "fsdp": M})   # N × M = jax.device_count()
    params = shard_params(params, mesh, ShardingRules(min_size=2**14))
    batch = shard_batch(batch, mesh)           # axis 0 over data × fsdp
    Trainer(model, params, opt, TrainConfig(mesh={"fsdp": 8}))  # or mesh=mesh

A `jax.sharding.Mesh` with axes ``("data", "fsdp")``; `ShardingRules` place each named
leaf (FSDP: large leaves split along one axis over ``fsdp``, small ones and LoRA
adapters replicated, quantized weights split along ``out``), optimizer state like
its params; XLA's SPMD partitioner inserts the communication. Layout, traffic and
memory per device: specs/distributed.md.
"""

from entrenar.distributed.batch import (
    batch_sharding,
    host_local_batch,
    place_batch,
    process_rows,
    shard_batch,
)
from entrenar.distributed.memory import bytes_per_device
from entrenar.distributed.mesh import (
    MESH_AXES,
    MeshSpec,
    batch_shards,
    check_batch_rows,
    check_mesh_spec,
    make_mesh,
    resolve_mesh,
)
from entrenar.distributed.multihost import (
    ENV,
    ProcessConfig,
    gather_to_host,
    initialize,
    process_config,
)
from entrenar.distributed.rules import (
    Convert,
    Match,
    ShardingRules,
    constrain,
    from_host,
    fsdp_axis,
    opt_state_sharding,
    param_sharding,
    param_specs,
    put,
    replicated,
    shard_converted,
    shard_opt_state,
    shard_params,
    shard_state,
    undivided_leaves,
    warn_undivided,
)

__all__ = [
    "ENV",
    "MESH_AXES",
    "Convert",
    "Match",
    "MeshSpec",
    "ProcessConfig",
    "ShardingRules",
    "batch_sharding",
    "batch_shards",
    "bytes_per_device",
    "check_batch_rows",
    "check_mesh_spec",
    "constrain",
    "from_host",
    "fsdp_axis",
    "gather_to_host",
    "host_local_batch",
    "initialize",
    "make_mesh",
    "opt_state_sharding",
    "param_sharding",
    "param_specs",
    "place_batch",
    "process_config",
    "process_rows",
    "put",
    "replicated",
    "resolve_mesh",
    "shard_batch",
    "shard_converted",
    "shard_opt_state",
    "shard_params",
    "shard_state",
    "undivided_leaves",
    "warn_undivided",
]
