"""Quantization-aware training: fake quantization with a straight-through estimator.

``fake_quant(x, scheme)`` returns ``dequantize(quantize(x, scheme))`` in the forward
pass and passes the gradient straight through, ``∂L/∂x := ∂L/∂x̂`` (Bengio et al.,
2013; the STE used by QAT in Jacob et al., 2018), so a model trained through it learns
weights that survive quantization. ``fake_quant_range(x, lo, hi, bits=8)`` quantizes
to ``2^bits`` levels on a calibrated or learnable range ``[lo, hi]``::

    s = (hi - lo) / (2^bits - 1),   x̂ = lo + s · round((clip(x, lo, hi) - lo) / s)

with the STE on ``round`` only, so ``∂x̂/∂x = 1`` inside the range and 0 outside, and
``lo``, ``hi`` receive gradients as in LSQ (Esser et al., 2020) / PACT (Choi et al.,
2018): a value clipped at ``hi`` gives ``∂x̂/∂hi = 1``.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from entrenar.quant.api import dequantize, quantize


@jax.custom_vjp
def round_ste(x: jax.Array) -> jax.Array:
    """``round(x)`` whose gradient is the identity (straight-through estimator)."""
    return jnp.round(x)


def _round_fwd(x: jax.Array) -> tuple[jax.Array, None]:
    return jnp.round(x), None


def _round_bwd(_: None, g: jax.Array) -> tuple[jax.Array]:
    return (g,)


round_ste.defvjp(_round_fwd, _round_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _fake_quant(x: jax.Array, scheme: str, options: tuple[tuple[str, Any], ...]):
    return dequantize(quantize(x, scheme, **dict(options)), x.dtype)


def _fq_fwd(x: jax.Array, scheme: str, options: tuple[tuple[str, Any], ...]):
    return _fake_quant(x, scheme, options), None


def _fq_bwd(scheme: str, options: Any, _: None, g: jax.Array) -> tuple[jax.Array]:
    return (g,)


_fake_quant.defvjp(_fq_fwd, _fq_bwd)


def fake_quant(x: jax.Array, scheme: str = "int8", **options: Any) -> jax.Array:
    """Quantize and dequantize ``x`` with any scheme; identity gradient (STE).

    Args:
        x: array ``(*lead, cols)`` (``cols`` a multiple of the block size).
        scheme: any `entrenar.quant.quantize` scheme.
        **options: options of `entrenar.quant.quantize` (``block_size``, ...).

    Returns:
        ``dequantize(quantize(x, scheme, **options))`` in ``x``'s dtype.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> x = jnp.linspace(-1.0, 1.0, 64).reshape(1, 64)
        >>> float(jax.grad(lambda v: fake_quant(v, "int4").sum())(x).min())
        1.0
    """
    x = jnp.asarray(x)
    return _fake_quant(x, scheme, tuple(sorted(options.items())))


def fake_quant_range(
    x: jax.Array, lo: jax.Array, hi: jax.Array, *, bits: int = 8
) -> jax.Array:
    """Affine fake quantization of ``x`` to ``2^bits`` levels on ``[lo, hi]``.

    ``lo`` and ``hi`` broadcast against ``x`` (per tensor or per channel) and may be
    calibrated (`entrenar.quant.ptq.calibrate`) or learned (they receive gradients).

    Example:
        >>> import jax.numpy as jnp
        >>> fake_quant_range(jnp.array([-2.0, 0.26, 9.0]), 0.0, 1.0, bits=2).tolist()
        [0.0, 0.3333333432674408, 1.0]
    """
    x = jnp.asarray(x)
    lo = jnp.asarray(lo, x.dtype)
    hi = jnp.maximum(jnp.asarray(hi, x.dtype), lo)
    levels = 2**bits - 1
    s = jnp.maximum((hi - lo) / levels, jnp.finfo(x.dtype).tiny)
    return lo + s * round_ste((jnp.clip(x, lo, hi) - lo) / s)


__all__ = ["fake_quant", "fake_quant_range", "round_ste"]
