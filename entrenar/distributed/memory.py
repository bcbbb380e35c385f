"""What a placed tree costs each device, measured from its arrays' shards."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from entrenar.types import PyTree


def bytes_per_device(tree: PyTree) -> dict[Any, int]:
    """Bytes of ``tree``'s arrays on each of this process's devices.

    Counted from ``addressable_shards`` (a replicated array counts on every device
    that holds it); a leaf that is not a `jax.Array` is skipped.

    Example:
        >>> import jax.numpy as jnp
        >>> sum(bytes_per_device({"w": jnp.zeros((4, 8), jnp.float32)}).values())
        128
    """
    out: dict[Any, int] = {}
    for x in jax.tree_util.tree_leaves(tree):
        if not isinstance(x, jax.Array):
            continue
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            x = jax.random.key_data(x)
        for shard in x.addressable_shards:
            n = int(np.prod(shard.data.shape)) * np.dtype(x.dtype).itemsize
            out[shard.device] = out.get(shard.device, 0) + n
    return out


__all__ = ["bytes_per_device"]
