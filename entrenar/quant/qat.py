"""Quantization-aware training: fake quantization with a straight-through estimator.

``fake_quant(x, scheme)`` returns ``dequantize(quantize(x, scheme))`` in the forward
pass and passes the gradient straight through, ``∂L/∂x := ∂L/∂x̂`` (Bengio et al.,
2013; the STE used by QAT in Jacob et al., 2018), so a model trained through it learns
weights that survive quantization. ``fake_quant_range(x, lo, hi, bits=8)`` quantizes
to ``2^bits`` levels on a calibrated or learnable range ``[lo, hi]``::

    s = (hi - lo) / (2^bits - 1),   x̂ = lo + s · round((clip(x, lo, hi) - lo) / s)

computed in float32 whatever ``x``'s dtype (as PyTorch's ``fake_quantize_per_tensor_
affine`` does for bfloat16; bfloat16 arithmetic would round ``(x - lo) / s`` before
``round`` does, up to 1.6 steps off at 8 bits), the result in ``x``'s dtype. The STE
is on ``round`` only, so ``∂x̂/∂x = 1`` inside the closed range ``[lo, hi]`` (a value
equal to a calibrated ``lo`` or ``hi`` is inside, as in PyTorch) and 0 outside, and
``lo``, ``hi`` receive gradients as in LSQ (Esser et al., 2020) / PACT (Choi et al.,
2018): a value clipped at ``hi`` gives ``∂x̂/∂hi = 1``.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from entrenar.errors import ConfigError
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
    Computed in float32 (the module docstring); the result has ``x``'s dtype.

    Raises:
        ConfigError: ``bits`` is not an integer from 1 to 24.

    Example:
        >>> import jax.numpy as jnp
        >>> fake_quant_range(jnp.array([-2.0, 0.26, 9.0]), 0.0, 1.0, bits=2).tolist()
        [0.0, 0.3333333432674408, 1.0]
    """
    if isinstance(bits, bool) or not isinstance(bits, (int, np.integer)):
        raise ConfigError(f"bits must be an integer from 1 to 24, got {bits!r}")
    if not 1 <= bits <= 24:  # 2^bits - 1 levels, each exact in float32
        raise ConfigError(f"bits must be from 1 to 24, got {bits}")
    x = jnp.asarray(x)
    ct = jnp.float64 if x.dtype == jnp.float64 else jnp.float32
    xf = x.astype(ct)
    lo = jnp.asarray(lo).astype(ct)
    hi = jnp.maximum(jnp.asarray(hi).astype(ct), lo)
    levels = 2**bits - 1
    s = jnp.maximum((hi - lo) / levels, jnp.finfo(ct).tiny)
    # clip(x, lo, hi) whose gradient goes to x on the closed range: jnp.clip splits
    # it half and half with lo / hi where x equals them
    c = jnp.where(xf < lo, lo, jnp.where(xf > hi, hi, xf))
    return (lo + s * round_ste((c - lo) / s)).astype(x.dtype)


__all__ = ["fake_quant", "fake_quant_range", "round_ste"]
