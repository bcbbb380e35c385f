"""The differentiable functions of the Tensor API.

Activations, norms, attention, losses, joining and selecting: each a recorded `Op`
over a pure jnp function.

Every function takes tensors (or arrays / numbers, treated as constants) and returns a
tensor; the math is the pure function's, the gradient its ``jax.vjp``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from entrenar.autograd import ops as _ops
from entrenar.autograd.tensor import Tensor, apply_op
from entrenar.errors import ConfigError, ShapeError
from entrenar.nn import attention as _attention
from entrenar.nn import layers as _layers
from entrenar.nn import losses as _losses

defop = _ops.defop


# ---- elementwise ---------------------------------------------------------------------
def exp(x: Any) -> Tensor:
    """e^x."""
    return apply_op(_ops.EXP, x)


def log(x: Any) -> Tensor:
    """Natural logarithm."""
    return apply_op(_ops.LOG, x)


def sqrt(x: Any) -> Tensor:
    """Square root."""
    return apply_op(_ops.SQRT, x)


def tanh(x: Any) -> Tensor:
    """Hyperbolic tangent."""
    return apply_op(_ops.TANH, x)


_SIGMOID = defop("sigmoid", jax.nn.sigmoid)
_RELU = defop("relu", jax.nn.relu)
_GELU = defop("gelu", lambda x, *, approximate: jax.nn.gelu(x, approximate))
_SILU = defop("silu", jax.nn.silu)


def sigmoid(x: Any) -> Tensor:
    """σ(x) = 1 / (1 + e^-x)."""
    return apply_op(_SIGMOID, x)


def relu(x: Any) -> Tensor:
    """max(x, 0); the gradient at 0 is 0."""
    return apply_op(_RELU, x)


def gelu(x: Any, approximate: bool = False) -> Tensor:
    """GELU (Hendrycks & Gimpel, 2016): x·Φ(x).

    With ``approximate``, the tanh form 0.5·x·(1 + tanh(√(2/π)(x + 0.044715x³))).
    """
    return apply_op(_GELU, x, approximate=bool(approximate))


def silu(x: Any) -> Tensor:
    """SiLU / swish: x·σ(x) (Ramachandran et al., 2017)."""
    return apply_op(_SILU, x)


swish = silu


def where(cond: Any, a: Any, b: Any) -> Tensor:
    """Elementwise ``a`` where ``cond`` else ``b`` (no gradient to ``cond``)."""
    return apply_op(_ops.WHERE, cond, a, b)


# ---- reductions and shapes -----------------------------------------------------------
def sum(x: Any, axis: Any = None, keepdims: bool = False) -> Tensor:
    """Sum over ``axis``."""
    return apply_op(_ops.SUM, x, axis=_ops._axis(axis), keepdims=keepdims)


def mean(x: Any, axis: Any = None, keepdims: bool = False) -> Tensor:
    """Mean over ``axis``."""
    return apply_op(_ops.MEAN, x, axis=_ops._axis(axis), keepdims=keepdims)


def max(x: Any, axis: Any = None, keepdims: bool = False) -> Tensor:
    """Maximum over ``axis``."""
    return apply_op(_ops.MAX, x, axis=_ops._axis(axis), keepdims=keepdims)


def reshape(x: Any, shape: Sequence[int]) -> Tensor:
    """Reshape to ``shape``."""
    return apply_op(_ops.RESHAPE, x, shape=tuple(int(s) for s in shape))


def transpose(x: Any, axes: Sequence[int] | None = None) -> Tensor:
    """Permute axes."""
    return apply_op(_ops.TRANSPOSE, x, axes=None if axes is None else tuple(axes))


def concatenate(xs: Sequence[Any], axis: int = 0) -> Tensor:
    """Join tensors along an existing axis."""
    return apply_op(_ops.CONCATENATE, *xs, axis=axis)


def stack(xs: Sequence[Any], axis: int = 0) -> Tensor:
    """Join tensors along a new axis."""
    return apply_op(_ops.STACK, *xs, axis=axis)


# ---- matmul, including the flat form (m·n outputs from flat inputs) ------------------
_FLAT_MATMUL = defop(
    "matmul_flat",
    lambda a, b, *, m, k, n: (jnp.reshape(a, (m, k)) @ jnp.reshape(b, (k, n))).reshape(
        m * n
    ),
)


def matmul(
    a: Any, b: Any, m: int | None = None, k: int | None = None, n: int | None = None
) -> Tensor:
    """Matrix product ``a @ b``, or the flat form ``matmul(a, b, m, k, n)``.

    In the flat form ``a`` holds an (m, k) matrix and ``b`` a (k, n) matrix, both
    row-major and flattened; the result is the flattened (m, n) product.
    """
    if m is None and k is None and n is None:
        return apply_op(_ops.MATMUL, a, b)
    if m is None or k is None or n is None:
        raise ShapeError("matmul's flat form needs all of m, k and n")
    sa, sb = _size(a), _size(b)
    if sa != m * k or sb != k * n:
        raise ShapeError(
            f"matmul(a, b, m={m}, k={k}, n={n}) needs a with m*k={m * k} and b with "
            f"k*n={k * n} elements, got {sa} and {sb}"
        )
    return apply_op(_FLAT_MATMUL, a, b, m=int(m), k=int(k), n=int(n))


def _size(x: Any) -> int:
    return x.size if isinstance(x, Tensor) else int(jnp.size(x))


# ---- softmax and normalisation -------------------------------------------------------
_SOFTMAX = defop("softmax", lambda x, *, axis: jax.nn.softmax(x, axis=axis))
_LOG_SOFTMAX = defop("log_softmax", lambda x, *, axis: jax.nn.log_softmax(x, axis=axis))


def softmax(x: Any, axis: int = -1) -> Tensor:
    """Softmax along ``axis``: e^{x_i - max x} / Σ_j e^{x_j - max x}."""
    return apply_op(_SOFTMAX, x, axis=axis)


def log_softmax(x: Any, axis: int = -1) -> Tensor:
    """Log softmax(x)_i = x_i - logsumexp(x)."""
    return apply_op(_LOG_SOFTMAX, x, axis=axis)


def _layer_norm(x, *wb, eps, has_w, has_b):
    mu = jnp.mean(x, -1, keepdims=True)
    var = jnp.mean(jnp.square(x - mu), -1, keepdims=True)
    y = (x - mu) * jax.lax.rsqrt(var + eps)
    if has_w:
        y = y * wb[0]
    if has_b:
        y = y + wb[-1]
    return y


def _rms_norm(x, *w, eps):
    y = x * jax.lax.rsqrt(jnp.mean(jnp.square(x), -1, keepdims=True) + eps)
    return y * w[0] if w else y


_LAYER_NORM = defop("layer_norm", _layer_norm)
_RMS_NORM = defop("rms_norm", _rms_norm)


def layer_norm(
    x: Any, weight: Any = None, bias: Any = None, eps: float = 1e-5
) -> Tensor:
    """LayerNorm over the last axis (Ba et al., 2016): (x-μ)/√(σ²+ε)·w + b."""
    wb = [t for t in (weight, bias) if t is not None]
    return apply_op(
        _LAYER_NORM, x, *wb, eps=eps, has_w=weight is not None, has_b=bias is not None
    )


def rms_norm(x: Any, weight: Any = None, eps: float = 1e-6) -> Tensor:
    """RMSNorm over the last axis (Zhang & Sennrich, 2019): x/√(mean(x²)+ε)·w."""
    return apply_op(_RMS_NORM, x, *([] if weight is None else [weight]), eps=eps)


# ---- embedding and dropout -----------------------------------------------------------
_EMBEDDING = defop("embedding", lambda w, ids: jnp.take(w, ids, axis=0))


def embedding(weight: Any, ids: Any) -> Tensor:
    """Rows of ``weight: (V, D)`` at integer ``ids: (...)`` → ``(..., D)``."""
    return apply_op(_EMBEDDING, weight, ids)


def _dropout(x, key, *, rate):
    return _layers.dropout(x, rate, key=key)


_DROPOUT = defop("dropout", _dropout)


def dropout(
    x: Any, rate: float, *, key: jax.Array | None, deterministic: bool = False
) -> Tensor:
    """Inverted dropout (Srivastava et al., 2014): `entrenar.nn.dropout`, recorded.

    Zeroes each element with probability ``rate`` and scales the rest by
    1/(1-rate); the identity when ``deterministic`` or ``rate == 0``.
    """
    _layers.check_dropout_rate(rate)
    if deterministic or rate == 0.0:
        return apply_op(_ops.ADD, x, 0.0)
    if key is None:
        raise ConfigError("dropout needs key=... unless deterministic=True or rate=0")
    return apply_op(_DROPOUT, x, key, rate=float(rate))


# ---- attention -----------------------------------------------------------------------
def _sdpa(q, k, v, *mask, causal, scale):
    # q: (B, Hq, T, d)  k: (B, Hkv, S, d)  v: (B, Hkv, S, dv)
    # nn's layout is (B, T, H, d); masks here broadcast to (B, Hq, T, S)
    t, s = q.shape[2], k.shape[2]
    allowed = None
    if causal:
        allowed = _attention.causal_mask(jnp.arange(t) + (s - t), s)[None, None]
    bias = None
    if mask:
        m = mask[0]
        if m.dtype == jnp.bool_:
            m = m.reshape((1,) * (4 - m.ndim) + m.shape)  # (B|1, H|1, T|1, S|1)
            allowed = m if allowed is None else allowed & m
        else:
            bias = m
    out = _attention.dot_product_attention(
        q.swapaxes(1, 2),
        k.swapaxes(1, 2),
        v.swapaxes(1, 2),
        allowed,
        bias=bias,
        scale=scale,
    )  # (B, T, Hq, dv)
    return out.swapaxes(1, 2)  # (B, Hq, T, dv)


_SDPA = defop("scaled_dot_product_attention", _sdpa)


def scaled_dot_product_attention(
    q: Any,
    k: Any,
    v: Any,
    mask: Any = None,
    *,
    causal: bool = False,
    scale: float | None = None,
) -> Tensor:
    """softmax(q kᵀ · scale + mask) v (Vaswani et al., 2017), with grouped-query heads.

    Args:
        q: queries ``(B, Hq, T, d)``.
        k: keys ``(B, Hkv, S, d)``; ``Hq`` must be a multiple of ``Hkv`` (GQA,
            Ainslie et al., 2023: each key/value head serves ``Hq/Hkv`` query heads).
        v: values ``(B, Hkv, S, dv)``.
        mask: optional, broadcastable to ``(B, Hq, T, S)``: boolean (True = attend)
            or additive float.
        causal: query i attends to keys j ≤ i + (S - T) (the last T of S positions).
        scale: defaults to 1/√d.

    Returns:
        ``(B, Hq, T, dv)``.
    """
    qs, ks = _shape(q), _shape(k)
    if len(qs) != 4 or len(ks) != 4 or qs[1] % ks[1] != 0:
        raise ShapeError(
            f"attention needs q (B, Hq, T, d) and k (B, Hkv, S, d) with Hq a multiple "
            f"of Hkv; got q {qs}, k {ks}"
        )
    scale = 1.0 / math.sqrt(qs[-1]) if scale is None else float(scale)
    extra = [] if mask is None else [mask]
    return apply_op(_SDPA, q, k, v, *extra, causal=bool(causal), scale=scale)


def _shape(x: Any) -> tuple[int, ...]:
    return x.shape if isinstance(x, Tensor) else tuple(jnp.shape(x))


# ---- losses: recorded wrappers over entrenar.nn.losses ------------------------------
_MSE = defop("mse", lambda p, y, *, reduction: _losses.mse(p, y, reduction))


def mse_loss(pred: Any, target: Any, reduction: str = "mean") -> Tensor:
    """Mean squared error ``(pred - target)²``: `entrenar.nn.losses.mse`, recorded."""
    _losses.check_reduction(reduction)
    return apply_op(_MSE, pred, target, reduction=reduction)


def _cross_entropy(logits, targets, *, ignore_index, reduction):
    return _losses.cross_entropy(logits, targets, reduction, ignore_index=ignore_index)


_CROSS_ENTROPY = defop("cross_entropy", _cross_entropy)


def cross_entropy(
    logits: Any, targets: Any, ignore_index: int = -100, reduction: str = "mean"
) -> Tensor:
    """Softmax cross-entropy with integer targets: `entrenar.nn.losses.cross_entropy`.

    loss = -Σ_valid log softmax(logits)[target] / #valid, where positions whose target
    equals ``ignore_index`` count neither in the sum nor in the mean (0 if none valid).

    Args:
        logits: ``(..., C)``.
        targets: integer ``(...)``.
        ignore_index: target value to skip (PyTorch's default -100).
        reduction: "mean" (over valid positions), "sum" or "none".
    """
    _losses.check_reduction(reduction)
    return apply_op(
        _CROSS_ENTROPY,
        logits,
        targets,
        ignore_index=int(ignore_index),
        reduction=reduction,
    )


_BCE = defop(
    "binary_cross_entropy_with_logits",
    lambda x, y, *, reduction: _losses.binary_cross_entropy_with_logits(
        x, y, reduction
    ),
)


def binary_cross_entropy_with_logits(
    logits: Any, targets: Any, reduction: str = "mean"
) -> Tensor:
    """-[y log σ(x) + (1-y) log(1-σ(x))], stably: `nn.losses`' version, recorded."""
    _losses.check_reduction(reduction)
    return apply_op(_BCE, logits, targets, reduction=reduction)
