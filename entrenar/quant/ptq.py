"""Post-training quantization: calibrate activation ranges, quantize the weights.

``calibrate(activations_fn, batches, method=...)`` runs ``activations_fn(batch)`` (a
pure function returning a pytree of the activations to be quantized) over sample
batches and returns a pytree of `Range` with the same structure:

- ``"minmax"``: ``lo = min_t min(a_t)``, ``hi = max_t max(a_t)`` over all batches;
- ``"percentile"``: the mean over batches of the ``(100 - p)``-th and ``p``-th
  percentiles of each batch (clips rare outliers);
- ``"moving_average"``: ``lo ← lo + c (min(a_t) - lo)`` (likewise ``hi``), starting at
  the first batch, with ``c = 1 - momentum`` (PyTorch's
  ``MovingAverageMinMaxObserver``).

The ranges feed `entrenar.quant.qat.fake_quant_range` at inference (static activation
quantization); `ptq` also returns the weights quantized by `quantize_params`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from entrenar.errors import ConfigError
from entrenar.quant.api import quantize_params
from entrenar.types import PyTree

METHODS = ("minmax", "percentile", "moving_average")


class Range(NamedTuple):
    """A calibrated activation range ``[lo, hi]`` (float32 scalars)."""

    lo: jax.Array
    hi: jax.Array


def _batch_range(a: jax.Array, method: str, percentile: float) -> Range:
    a = jnp.asarray(a).astype(jnp.float32).reshape(-1)
    if method == "percentile":
        q = jnp.percentile(a, jnp.array([100 - percentile, percentile], jnp.float32))
        return Range(q[0], q[1])
    return Range(jnp.min(a), jnp.max(a))


def _is_range(v: Any) -> bool:
    return isinstance(v, Range)


def _merger(method: str, c: float) -> Callable[[Range, Range], Range]:
    """How a running range ``a`` absorbs a batch's range ``b``."""
    if method == "minmax":
        return lambda a, b: Range(jnp.minimum(a.lo, b.lo), jnp.maximum(a.hi, b.hi))
    if method == "percentile":  # a running sum, divided by the count at the end
        return lambda a, b: Range(a.lo + b.lo, a.hi + b.hi)
    return lambda a, b: Range(a.lo + c * (b.lo - a.lo), a.hi + c * (b.hi - a.hi))


def calibrate(
    activations_fn: Callable[[Any], PyTree],
    batches: Iterable[Any],
    *,
    method: str = "minmax",
    percentile: float = 99.99,
    momentum: float = 0.9,
) -> PyTree:
    """Activation ranges observed over sample batches (see the module docstring).

    Args:
        activations_fn: ``batch -> pytree of arrays`` (jitted here).
        batches: sample batches (at least one).
        method: ``"minmax"``, ``"percentile"`` or ``"moving_average"``.
        percentile: upper percentile ``p`` for ``"percentile"`` (in ``(50, 100]``).
        momentum: ``"moving_average"`` keeps this fraction of the running range.

    Returns:
        A pytree of `Range`, structured like ``activations_fn``'s output.

    Raises:
        ConfigError: unknown method, a bad percentile/momentum, or no batches.

    Example:
        >>> import jax.numpy as jnp
        >>> batches = [jnp.array([0.0, 2.0]), jnp.array([-1.0, 0.5])]
        >>> r = calibrate(lambda b: {"h": b}, batches)
        >>> float(r["h"].lo), float(r["h"].hi)
        (-1.0, 2.0)
    """
    if method not in METHODS:
        raise ConfigError(
            f"calibration method must be one of {METHODS}, got {method!r}"
        )
    if not 50 < percentile <= 100:
        raise ConfigError(f"percentile must be in (50, 100], got {percentile}")
    if not 0 <= momentum < 1:
        raise ConfigError(f"momentum must be in [0, 1), got {momentum}")

    @jax.jit
    def observe(batch: Any) -> PyTree:
        return jax.tree_util.tree_map(
            lambda a: _batch_range(a, method, percentile), activations_fn(batch)
        )

    merge = _merger(method, 1 - momentum)
    acc, n = None, 0
    for batch in batches:
        r = observe(batch)
        acc = (
            r
            if acc is None
            else jax.tree_util.tree_map(merge, acc, r, is_leaf=_is_range)
        )
        n += 1
    if acc is None:
        raise ConfigError("calibrate needs at least one batch")
    if method == "percentile":
        acc = jax.tree_util.tree_map(
            lambda a: Range(a.lo / n, a.hi / n), acc, is_leaf=_is_range
        )
    return acc


def ptq(
    params: PyTree,
    activations_fn: Callable[[PyTree, Any], PyTree],
    batches: Iterable[Any],
    *,
    scheme: str = "int8",
    method: str = "minmax",
    percentile: float = 99.99,
    momentum: float = 0.9,
    **options: Any,
) -> tuple[PyTree, PyTree]:
    """Post-training quantization of a trained model.

    Calibrates activation ranges with the float weights, then quantizes the weights.

    Args:
        params: trained parameters.
        activations_fn: ``(params, batch) -> pytree of activations to quantize``.
        batches: calibration batches.
        scheme: weight scheme (`entrenar.quant.quantize`); ``options`` go to it
            (e.g. ``granularity="channel"``).
        method: activation calibration method (see `calibrate`).
        percentile: see `calibrate`.
        momentum: see `calibrate`.
        **options: options of `entrenar.quant.quantize_params` / `quantize`.

    Returns:
        ``(quantized params, activation ranges)``; ``params`` is not modified.
    """
    ranges = calibrate(
        lambda b: activations_fn(params, b),
        batches,
        method=method,
        percentile=percentile,
        momentum=momentum,
    )
    return quantize_params(params, scheme, **options), ranges


__all__ = ["METHODS", "Range", "calibrate", "ptq"]
