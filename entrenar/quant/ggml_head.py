"""The causal-LM loss through a frozen GGUF output head, decoding it once a step.

`entrenar.nn.losses.chunked_causal_lm_loss` forms the logits ``z = x Ŵᵀ`` chunk of
tokens by chunk of tokens; with a head kept as stored (a `GGMLWeight`: Llama-3-8B's
Q6_K ``output``, 128256 x 4096; a `QuantizedWeight`: a Q8_0/Q4_0/Q4_1 ``output`` or
tied ``token_embd``) each chunk would decode the whole table, and again in the
backward pass: 12 decodes of 525M values for 512 tokens. Here the loop runs over
blocks of vocabulary rows instead, all tokens at once, with an online ``logsumexp``
(Milakov & Gimelshein, 2018): for each block ``Ŵ_b`` (decoded once, in cache)::

    z_b = x Ŵ_bᵀ                                   (N, rows)
    m'  = max(m, max_v z_b)
    s   = s e^{m - m'} + Σ_v e^{z_b - m'}
    a   = a e^{m - m'} + e^{z_b - m'} Ŵ_b          (N, D), the gradient's sum

so ``logsumexp(z) = m + log s`` and, the head being frozen (a LoRA step),
``∂nll/∂x = softmax(z) Ŵ - Ŵ_y = a / s - Ŵ_y``: one pass over the head gives the
loss and the input gradient; the backward pass only scales it by the incoming
gradient. ``Ŵ_y`` are the label rows, decoded from their bytes. Equal to the dense
path to float32 rounding (the test).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from entrenar.nn.losses import head_nll
from entrenar.quant.api import dequantize, map_rows, quantized_rows
from entrenar.quant.blocked import rows_within
from entrenar.quant.kquant import GGMLWeight, decode_rows
from entrenar.quant.weight import QuantizedWeight

Head = GGMLWeight | QuantizedWeight

BLOCK_VALUES = 1 << 20
"""Head values decoded at a time (4 MiB in float32)."""


@head_nll.register(GGMLWeight)
@head_nll.register(QuantizedWeight)
def ggml_head_nll(
    w: Head, x: jax.Array, y: jax.Array, matmul_dtype: str | None = None
) -> jax.Array:
    """``logsumexp(x Ŵᵀ) - (x Ŵᵀ)[y]`` per token, ``x: (N, D)``, ``y: (N,)``: ``(N,)``.

    ``Ŵ`` is decoded in ``x``'s dtype, or in ``matmul_dtype`` (then float32
    accumulation); the logits and the sums are float32.
    """
    v, d = w.shape
    rows = rows_within(v, d, BLOCK_VALUES)
    dtype = jnp.dtype(matmul_dtype or x.dtype)
    return _nll(w, x, y, rows, dtype)


def _row_blocks(w: Head, rows: int) -> Any:
    """``w (V, D)`` as ``V / rows`` blocks of rows along a new leading axis."""
    if isinstance(w, GGMLWeight):
        return w.data.reshape(-1, rows, w.data.shape[-1])  # (V / rows, rows, bytes)
    v = w.shape[0]

    def split(a: Any) -> Any:  # (V, k) -> (V / rows, rows, k); broadcast scales too
        if a is None:
            return None
        a = jnp.broadcast_to(a, (v, a.shape[-1]))
        return a.reshape(v // rows, rows, a.shape[-1])

    return map_rows(w, split)


def _decode(w: Head, block: Any) -> jax.Array:
    """One block of `_row_blocks` decoded: ``(rows, D)`` float32."""
    if isinstance(w, GGMLWeight):
        return decode_rows(block, w.ggml_type)
    return dequantize(block, np.float32)


def _label_rows(w: Head, y: jax.Array) -> jax.Array:
    """Rows ``Ŵ_y`` ``(N, D)`` float32, decoded from their bytes alone."""
    if isinstance(w, GGMLWeight):
        return decode_rows(jnp.take(w.data, y, axis=0), w.ggml_type)
    return quantized_rows(w, y).astype(jnp.float32)


def _scan(
    w: Head, x: jax.Array, y: jax.Array, rows: int, dtype: Any, dx: bool
) -> tuple[jax.Array, Any]:
    """One pass over the head: ``(nll (N,), a / s - Ŵ_y (N, D) or None)``."""
    n = x.shape[0]
    xd = x.astype(dtype)
    blocks = _row_blocks(w, rows)  # (V / rows, rows, ·) arrays

    def step(carry: Any, xs: Any) -> Any:
        m, s, zy, acc = carry
        data, start = xs
        wb = _decode(w, data).astype(dtype)  # (rows, D)
        z = jnp.einsum("nd,rd->nr", xd, wb, preferred_element_type=jnp.float32)
        m_new = jnp.maximum(m, jnp.max(z, axis=-1))  # (N,)
        scale = jnp.exp(m - m_new)
        p = jnp.exp(z - m_new[:, None])  # (N, rows)
        s = s * scale + jnp.sum(p, axis=-1)
        hit = (y - start)[:, None] == jnp.arange(rows)[None, :]  # (N, rows)
        zy = zy + jnp.sum(jnp.where(hit, z, 0.0), axis=-1)
        if acc is not None:
            pw = jnp.einsum(
                "nr,rd->nd", p.astype(dtype), wb, preferred_element_type=jnp.float32
            )
            acc = acc * scale[:, None] + pw  # (N, D)
        return (m_new, s, zy, acc), None

    starts = jnp.arange(0, w.shape[0], rows, dtype=y.dtype)  # (V / rows,)
    acc0 = jnp.zeros((n, x.shape[1]), jnp.float32) if dx else None
    init = (jnp.full((n,), -jnp.inf), jnp.zeros((n,)), jnp.zeros((n,)), acc0)
    final: Any = jax.lax.scan(step, init, (blocks, starts))[0]
    m, s, zy, acc = final
    nll = m + jnp.log(s) - zy  # (N,)
    if not dx:
        return nll, None
    wy = _label_rows(w, y)  # (N, D) float32
    return nll, acc / s[:, None] - wy


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _nll(w: Head, x: jax.Array, y: jax.Array, rows: int, dtype: Any) -> Any:
    return _scan(w, x, y, rows, dtype, dx=False)[0]


def _fwd(w: Head, x: jax.Array, y: jax.Array, rows: int, dtype: Any) -> Any:
    nll, dx = _scan(w, x, y, rows, dtype, dx=True)
    return nll, (w, dx.astype(x.dtype), y)


def _bwd(rows: int, dtype: Any, res: Any, g: jax.Array) -> Any:
    w, dx, y = res
    frozen = jax.tree_util.tree_map(lambda a: np.zeros(a.shape, jax.dtypes.float0), w)
    y_ct = np.zeros(y.shape, jax.dtypes.float0)
    return frozen, dx * g[:, None].astype(dx.dtype), y_ct


_nll.defvjp(_fwd, _bwd)


__all__ = ["BLOCK_VALUES", "ggml_head_nll"]
