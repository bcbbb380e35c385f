"""`memory_report`: bytes and bits per parameter of any tree, as stored.

A `QuantizedWeight` counts its codes, scales, zero points and second-level scales;
its parameter count is the size of the tensor it stands for. Any other leaf counts
``size × itemsize`` bytes.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from entrenar.nn.weight_node import is_weight_node, logical_dtype, logical_shape, nbytes
from entrenar.quant.kquant import GGMLWeight
from entrenar.quant.weight import QuantizedWeight
from entrenar.tree import tree_named_leaves
from entrenar.types import PyTree


def bits_per_param(x: Any) -> float:
    """Stored bits per value of an array or `QuantizedWeight`.

    >>> import jax.numpy as jnp
    >>> bits_per_param(jnp.zeros((2, 64), jnp.bfloat16))
    16.0
    """
    return 8 * nbytes(x) / math.prod(logical_shape(x))


@dataclasses.dataclass(frozen=True)
class MemoryEntry:
    """One leaf: its dotted name, storage kind, value count and bytes."""

    name: str
    kind: str
    params: int
    bytes: int

    @property
    def bits_per_param(self) -> float:
        """Stored bits per value."""
        return 8 * self.bytes / max(self.params, 1)


@dataclasses.dataclass(frozen=True)
class MemoryReport:
    """Per-leaf and total bytes of a parameter tree, as stored."""

    entries: tuple[MemoryEntry, ...]

    @property
    def params(self) -> int:
        """Total number of values."""
        return sum(e.params for e in self.entries)

    @property
    def bytes(self) -> int:
        """Total bytes stored."""
        return sum(e.bytes for e in self.entries)

    @property
    def bits_per_param(self) -> float:
        """Stored bits per value over the whole tree."""
        return 8 * self.bytes / max(self.params, 1)

    def __str__(self) -> str:
        width = max([len(e.name) for e in self.entries] + [5])
        lines = [f"{'name':<{width}}  {'kind':<14} {'params':>12} {'bytes':>12}  bits"]
        for e in (*self.entries, MemoryEntry("total", "", self.params, self.bytes)):
            lines.append(
                f"{e.name:<{width}}  {e.kind:<14} {e.params:>12,} {e.bytes:>12,}  "
                f"{e.bits_per_param:.3f}"
            )
        return "\n".join(lines)


def memory_report(params: PyTree) -> MemoryReport:
    """Bytes and bits per parameter of every leaf of ``params``.

    Example:
        >>> import jax.numpy as jnp
        >>> from entrenar.quant import quantize
        >>> r = memory_report({"w": quantize(jnp.ones((4, 64)), "nf4"),
        ...                    "b": jnp.zeros(4)})
        >>> r.bytes, r.params, [e.kind for e in r.entries]
        (160, 260, ['float32', 'nf4'])
    """
    entries = []
    for name, x in tree_named_leaves(params, is_leaf=is_weight_node):
        if isinstance(x, QuantizedWeight):
            kind = x.scheme + ("+dq" if x.double_quant else "")
        elif isinstance(x, GGMLWeight):  # a GGUF base kept as stored (Q4_K, BF16, ...)
            kind = x.ggml_type
        else:
            kind = logical_dtype(x).name
        n = math.prod(logical_shape(x))
        entries.append(MemoryEntry(name, kind, n, nbytes(x)))
    return MemoryReport(tuple(entries))


__all__ = ["MemoryEntry", "MemoryReport", "bits_per_param", "memory_report"]
