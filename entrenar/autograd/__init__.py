"""Tape-style automatic differentiation over ``jax.vjp``.

Protocol: make leaves with ``Tensor(data, requires_grad=True)``; operate on them with
Python operators and the functions here (each operation is recorded on the tape held in
a ``contextvars.ContextVar``); call ``backward(loss)``; read ``leaf.grad``. Inside
`no_grad` nothing is recorded. The same code runs eagerly (lazily evaluated, compiled
once per graph structure) and inside `jax.jit` (on tracers), where it gives what
``jax.grad`` gives. `check_gradient` compares any function's gradients with central
finite differences in float64. Compiled programs are kept in a bounded LRU cache
(`set_cache_size`, `cache_info`, `clear_caches`); a graph whose shapes keep changing
runs padded to shape buckets instead of compiling every shape.
"""

from entrenar.autograd.backward import backward
from entrenar.autograd.cache import (
    DEFAULT_CACHE_SIZE,
    CacheInfo,
    cache_info,
    set_cache_size,
)
from entrenar.autograd.engine import clear_caches
from entrenar.autograd.functional import (
    binary_cross_entropy_with_logits,
    concatenate,
    cross_entropy,
    dropout,
    embedding,
    exp,
    gelu,
    layer_norm,
    log,
    log_softmax,
    matmul,
    max,
    mean,
    mse_loss,
    relu,
    reshape,
    rms_norm,
    scaled_dot_product_attention,
    sigmoid,
    silu,
    softmax,
    sqrt,
    stack,
    sum,
    swish,
    tanh,
    transpose,
    where,
)
from entrenar.autograd.gradcheck import GradientCheckResult, check_gradient
from entrenar.autograd.ops import Op, defop
from entrenar.autograd.tape import enable_grad, get_tape, is_grad_enabled, no_grad
from entrenar.autograd.tensor import Tensor, apply_op, as_tensor

__all__ = [
    "DEFAULT_CACHE_SIZE",
    "CacheInfo",
    "GradientCheckResult",
    "Op",
    "Tensor",
    "apply_op",
    "as_tensor",
    "backward",
    "binary_cross_entropy_with_logits",
    "cache_info",
    "check_gradient",
    "clear_caches",
    "concatenate",
    "cross_entropy",
    "defop",
    "dropout",
    "embedding",
    "enable_grad",
    "exp",
    "gelu",
    "get_tape",
    "is_grad_enabled",
    "layer_norm",
    "log",
    "log_softmax",
    "matmul",
    "max",
    "mean",
    "mse_loss",
    "no_grad",
    "relu",
    "reshape",
    "rms_norm",
    "scaled_dot_product_attention",
    "set_cache_size",
    "sigmoid",
    "silu",
    "softmax",
    "sqrt",
    "stack",
    "sum",
    "swish",
    "tanh",
    "transpose",
    "where",
]
