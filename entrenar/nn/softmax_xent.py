"""Softmax cross-entropy of a block of logits, with the gradient it implies.

For logits ``z: (N, V)`` and labels ``y: (N,)``::

    lse[n] = log Σ_v exp(z[n, v])
    nll[n] = lse[n] - z[n, y[n]]
    dz[n, v] = softmax(z[n])[v] - [v == y[n]]        (= ∂nll[n] / ∂z[n, v])

`entrenar.nn.losses.chunked_causal_lm_loss` needs all three for each chunk of
logits when the output head is frozen (it computes the input gradient in the forward
pass). XLA:CPU runs them as three loops that each read the whole chunk (for
SmolLM2, 127 x 49,152 floats: 25 MB) from memory; the native kernel
``entrenar/kernels/softmax_xent.cc`` reads each row once and keeps it in cache for
the rest. It takes float32 logits and returns ``dz`` in bfloat16 (what the bfloat16
product ``dz W`` takes next); other dtypes, several devices, or no kernel
(`entrenar.native`) take the pure-JAX path, which gives the same values to float32
rounding of the exponentials (the kernel's ``exp`` is within 1e-7 relative; ``dz``
is then rounded to bfloat16 the same way).

A label outside ``[0, V)`` (negative ones included: they do not wrap around) gives
``nll = NaN`` and no ``-1`` in ``dz``, so a bad tokenizer shows up in the loss.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from entrenar import native


def softmax_xent(
    z: jax.Array, y: jax.Array, dz_dtype: Any
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(nll (N,), lse (N,), dz (N, V) in dz_dtype)`` for logits ``z: (N, V)``.

    Not differentiable itself: ``dz`` is the gradient, for callers that write their
    own backward pass (a `jax.custom_vjp`).
    """
    if _native_ok(z, y, dz_dtype):
        out = (
            jax.ShapeDtypeStruct(z.shape[:1], jnp.float32),
            jax.ShapeDtypeStruct(z.shape[:1], jnp.float32),
            jax.ShapeDtypeStruct(z.shape, jnp.bfloat16),
        )
        call = jax.ffi.ffi_call("entrenar_softmax_xent", out, vmap_method="sequential")
        nll, lse, dz = call(z, y.astype(jnp.int32))
        return nll, lse, dz
    nll, lse = nll_and_lse(z, y)
    return nll, lse, softmax_minus_onehot(z, lse, y).astype(dz_dtype)


def nll_and_lse(z: jax.Array, y: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(nll (N,), lse (N,))`` for logits ``z: (N, V)`` in JAX (NaN off ``[0, V)``)."""
    lse = jax.nn.logsumexp(z, axis=-1)  # (N,)
    inside = (y >= 0) & (y < z.shape[-1])  # (N,)
    zy = jnp.take_along_axis(z, jnp.where(inside, y, 0)[:, None], axis=-1)[:, 0]
    return jnp.where(inside, lse - zy, jnp.nan), lse


def softmax_minus_onehot(z: jax.Array, lse: jax.Array, y: jax.Array) -> jax.Array:
    """``softmax(z) - onehot(y)`` for logits ``z: (N, V)``, ``lse: (N,)``."""
    hit = jnp.arange(z.shape[-1])[None, :] == y[:, None]  # (N, V)
    return jnp.exp(z - lse[:, None]) - hit.astype(z.dtype)


def _native_ok(z: jax.Array, y: jax.Array, dz_dtype: Any) -> bool:
    """2-d logits, one label per row, no empty axis; then `entrenar.native.use`."""
    return (
        z.ndim == 2
        and tuple(y.shape) == tuple(z.shape[:1])
        and min(z.shape) > 0
        and native.use("softmax_xent", z, y, dz_dtype)
    )


__all__ = ["nll_and_lse", "softmax_minus_onehot", "softmax_xent"]
