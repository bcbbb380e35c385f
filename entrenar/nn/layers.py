"""Stateless layers: embedding, normalisation, dropout, feed-forward blocks.

Each layer is a pure function of its inputs and its weights. Dense weights go through
`entrenar.nn.linear`, so LoRA and quantized weight nodes work unchanged; norm gains and
embedding tables are plain arrays.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from entrenar.errors import ConfigError, DTypeError
from entrenar.nn.linear import linear
from entrenar.types import PRNGKey

Activation = Callable[[jax.Array], jax.Array]


def upcast_dtype(dtype: Any) -> Any:
    """The dtype norms, softmax and rotary math run in: float32, or float64 inputs' own.

    >>> upcast_dtype(jnp.bfloat16), upcast_dtype(jnp.float64)
    (dtype('float32'), dtype('float64'))
    """
    wide = jnp.dtype(dtype) == jnp.dtype("float64")
    return jnp.dtype("float64") if wide else jnp.dtype("float32")


def embedding(table: jax.Array, tokens: jax.Array) -> jax.Array:
    """Look up rows of ``table: (V, D)`` for integer ``tokens: (...)`` -> ``(..., D)``.

    Out-of-range ids give NaN rows (``jnp.take``'s fill mode) rather than silently
    clamped ones, so a bad tokenizer shows up in the loss.

    >>> embedding(jnp.arange(6.0).reshape(3, 2), jnp.array([2, 0])).tolist()
    [[4.0, 5.0], [0.0, 1.0]]
    """
    tokens = jnp.asarray(tokens)
    if not jnp.issubdtype(tokens.dtype, jnp.integer):
        raise DTypeError(f"token ids must be integers, got dtype {tokens.dtype}")
    return embedding_rows(table, tokens)  # (..., D)


@functools.singledispatch
def embedding_rows(table: Any, tokens: jax.Array) -> jax.Array:
    """Rows ``tokens: (...)`` of ``table: (V, D)`` -> ``(..., D)``: `embedding`'s rule.

    A plain array is ``jnp.take``; a weight node stored by rows registers its own
    rule (``@embedding_rows.register(NodeType)``), e.g. a GGUF K-quant table
    (`entrenar.quant.GGMLWeight`) decodes only the rows it looks up.
    """
    return jnp.take(table, tokens, axis=0)  # (..., D)


def layer_norm(
    x: jax.Array, weight: jax.Array, bias: jax.Array | None, eps: float = 1e-5
) -> jax.Array:
    """LayerNorm over the last axis (Ba et al., 2016), computed in float32 (or 64).

    ``y = (x - μ) / sqrt(σ² + eps) · weight + bias`` with the biased variance ``σ²``.

    >>> y = layer_norm(jnp.array([[1.0, 3.0]]), jnp.ones(2), jnp.zeros(2))
    >>> [round(v, 3) for v in y[0].tolist()]
    [-1.0, 1.0]
    """
    f = upcast_dtype(x.dtype)
    xf = x.astype(f)
    mean = jnp.mean(xf, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(xf - mean), axis=-1, keepdims=True)
    y = (xf - mean) * jax.lax.rsqrt(var + eps) * weight.astype(f)
    if bias is not None:
        y = y + bias.astype(f)
    return y.astype(x.dtype)


def rms_norm(
    x: jax.Array, weight: jax.Array, eps: float = 1e-6, *, unit_offset: bool = False
) -> jax.Array:
    """RMSNorm over the last axis (Zhang & Sennrich, 2019), in float32 (or 64).

    ``y = x / sqrt(mean(x²) + eps) · weight``; with ``unit_offset`` the gain is
    ``1 + weight`` (Gemma, whose stored weights are zero-centred).

    >>> [round(v, 4) for v in rms_norm(jnp.array([3.0, 4.0]), jnp.ones(2))[:].tolist()]
    [0.8485, 1.1314]
    """
    f = upcast_dtype(x.dtype)
    xf = x.astype(f)
    ms = jnp.mean(jnp.square(xf), axis=-1, keepdims=True)
    gain = weight.astype(f)
    if unit_offset:
        gain = 1.0 + gain
    y = xf * jax.lax.rsqrt(ms + eps) * gain
    return y.astype(x.dtype)


def check_dropout_rate(rate: float) -> None:
    """Raise `ConfigError` unless ``0 <= rate <= 1``."""
    if not 0.0 <= rate <= 1.0:
        raise ConfigError(f"dropout rate must lie in [0, 1], got {rate}")


def dropout(
    x: jax.Array, rate: float, *, key: PRNGKey | None, deterministic: bool = False
) -> jax.Array:
    """Inverted dropout: zero each entry with probability ``rate``, scale the rest.

    ``y = x · m / (1 - rate)`` with ``m ~ Bernoulli(1 - rate)``, so ``E[y] = x``.
    With ``deterministic=True`` or ``rate == 0`` it is the identity (no key needed).

    >>> dropout(jnp.ones(3), 0.5, key=None, deterministic=True).tolist()
    [1.0, 1.0, 1.0]
    """
    check_dropout_rate(rate)
    if deterministic or rate == 0.0:
        return x
    if key is None:
        raise ConfigError("dropout needs key=... unless deterministic=True or rate=0")
    if rate == 1.0:
        return jnp.zeros_like(x)
    keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)
    return jnp.where(keep, x / jnp.asarray(1.0 - rate, x.dtype), jnp.zeros_like(x))


def gelu_tanh(x: jax.Array) -> jax.Array:
    """GELU, tanh approximation (GPT-2's ``gelu_new``).

    ``0.5 x (1 + tanh(sqrt(2/π) (x + 0.044715 x³)))``.
    """
    return jax.nn.gelu(x, approximate=True)


def silu(x: jax.Array) -> jax.Array:
    """SiLU / swish: ``x · sigmoid(x)``."""
    return jax.nn.silu(x)


def relu2(x: jax.Array) -> jax.Array:
    """Squared ReLU ``max(x, 0)²``: transformers' ``relu2`` (Arcee AFM).

    So et al., "Primer: Searching for Efficient Transformers", 2021.
    """
    return jnp.square(jax.nn.relu(x))


def mlp(
    x: jax.Array,
    w_in: Any,
    b_in: jax.Array | None,
    w_out: Any,
    b_out: jax.Array | None,
    activation: Activation = gelu_tanh,
) -> jax.Array:
    """Two-layer feed-forward block ``act(x W_inᵀ + b_in) W_outᵀ + b_out``.

    Args:
        x: ``(..., D)``.
        w_in: ``(F, D)`` weight (array or weight node).
        b_in: ``(F,)`` bias or None.
        w_out: ``(D, F)`` weight.
        b_out: ``(D,)`` bias or None.
        activation: elementwise nonlinearity.

    Returns:
        ``(..., D)``.
    """
    h = activation(linear(x, w_in, b_in))  # (..., F)
    return linear(h, w_out, b_out)  # (..., D)


def gated_mlp(
    x: jax.Array,
    w_gate: Any,
    w_up: Any,
    w_down: Any,
    activation: Activation = silu,
    *,
    matmul_dtype: str | None = None,
    biases: tuple[Any, Any, Any] | None = None,
) -> jax.Array:
    """Gated feed-forward block, SwiGLU with ``silu`` (Shazeer, 2020).

    ``y = (act(x W_gateᵀ + b_gate) ⊙ (x W_upᵀ + b_up)) W_downᵀ + b_down`` with
    ``W_gate, W_up: (F, D)`` and ``W_down: (D, F)``; ``biases`` is
    ``(b_gate, b_up, b_down)`` or None (as in Llama). ``gelu_tanh`` for
    ``activation`` makes it GeGLU (Gemma). ``matmul_dtype`` is passed to `linear`
    (mixed precision).
    """
    bg, bu, bd = biases or (None, None, None)
    g = activation(linear(x, w_gate, bg, matmul_dtype=matmul_dtype))  # (..., F)
    u = linear(x, w_up, bu, matmul_dtype=matmul_dtype)  # (..., F)
    return linear(g * u, w_down, bd, matmul_dtype=matmul_dtype)  # (..., D)


MLP_CHUNK_ELEMENTS = 1 << 23
"""Most ``tokens x width`` of one chunk in `token_chunked` (8.4M: 32 MB a float32
``(chunk, I)`` temporary). Read at call time, so a test may lower it."""


def token_chunked(
    fn: Callable[[jax.Array], jax.Array],
    x: jax.Array,
    width: int,
    max_elements: int | None = None,
) -> jax.Array:
    """``fn(x)`` for a per-token ``fn``, run over chunks of tokens when they are many.

    ``fn`` maps ``(N, D) -> (N, E)`` token by token (an MLP). When ``N · width``
    (``width``: ``fn``'s widest intermediate, the MLP's ``I``) is at most
    ``max_elements`` (default `MLP_CHUNK_ELEMENTS`) it is ``fn(x)`` unchanged.
    Otherwise the ``N = prod(x.shape[:-1])`` tokens are padded with zeros to
    ``C · chunk`` (``C = ceil(N · width / max_elements)`` chunks, ``chunk =
    ceil(N / C)``, balanced) and ``jax.lax.map`` runs a `jax.checkpoint`-ed ``fn``
    over them: the forward pass keeps only each chunk's input, and the backward
    pass recomputes one chunk's intermediates at a time, so a layer's ``(N, I)``
    float32 temporaries (nine in a gated MLP's backward pass) become ``(chunk,
    I)``. The math is the same per token; the weights' gradients are summed chunk
    by chunk (float rounding apart).

    Args:
        fn: a function of ``(..., D)`` acting on each token independently.
        x: ``(..., D)``.
        width: ``fn``'s intermediate width.
        max_elements: most ``chunk x width``; None: `MLP_CHUNK_ELEMENTS`.

    Returns:
        ``fn(x)``, ``(..., E)``.

    Example:
        >>> y = token_chunked(jnp.tanh, jnp.ones((2, 5, 3)), 4, max_elements=8)
        >>> y.shape, bool(jnp.allclose(y, jnp.tanh(1.0)))
        ((2, 5, 3), True)
    """
    limit = MLP_CHUNK_ELEMENTS if max_elements is None else max_elements
    *lead, d = x.shape
    n = math.prod(lead)
    if n * width <= limit:
        return fn(x)
    chunks = min(n, -(-n * width // limit))
    chunk = -(-n // chunks)  # (the last chunk is not mostly padding)
    pad = chunks * chunk - n
    xs = jnp.pad(x.reshape(n, d), ((0, pad), (0, 0))).reshape(chunks, chunk, d)
    ys = jax.lax.map(jax.checkpoint(fn), xs)  # (C, chunk, E)
    return ys.reshape(chunks * chunk, -1)[:n].reshape(*lead, -1)  # (..., E)


__all__ = [
    "Activation",
    "dropout",
    "embedding",
    "embedding_rows",
    "gated_mlp",
    "gelu_tanh",
    "layer_norm",
    "mlp",
    "relu2",
    "rms_norm",
    "silu",
    "token_chunked",
    "upcast_dtype",
]
