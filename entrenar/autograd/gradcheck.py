"""Gradient checking by central finite differences in float64."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from entrenar.autograd.backward import backward
from entrenar.autograd.tape import no_grad
from entrenar.autograd.tensor import Tensor
from entrenar.errors import GradientCheckError


@dataclass(frozen=True)
class GradientCheckResult:
    """Outcome of `check_gradient`; truthy when the check passed.

    Attributes:
        passed: every element's error is within the threshold.
        max_error: max over elements of |analytic - numeric| / max(1, |analytic|,
            |numeric|).
        worst: (input index, flat element index) of the largest error.
        analytic: gradients from the tape (or ``jax.grad``), one per checked input.
        numeric: finite-difference gradients, one per checked input.
    """

    passed: bool
    max_error: float
    worst: tuple[int, int]
    analytic: tuple[np.ndarray, ...]
    numeric: tuple[np.ndarray, ...]

    def __bool__(self) -> bool:
        return self.passed


def _projection(out: Any, key: int) -> np.ndarray | None:
    # Non-scalar outputs are reduced with a fixed random projection: sum(out * r).
    if int(np.prod(out.shape)) == 1:
        return None
    return np.random.default_rng(key).standard_normal(out.shape)


def check_gradient(
    fn: Callable[..., Any],
    inputs: Sequence[Any],
    eps: float = 1e-3,
    threshold: float = 1e-3,
    *,
    wrt: Sequence[int] | None = None,
    raise_on_failure: bool = False,
    seed: int = 0,
) -> GradientCheckResult:
    """Compare analytic gradients of ``fn`` with central finite differences.

    ``fn`` takes one argument per input and returns a tensor or array. It may be
    written with the Tensor API (it is then called with Tensors and differentiated by
    the tape) or with jnp (called with arrays, differentiated by ``jax.grad``).
    Everything runs in float64 (``jax.enable_x64``). A non-scalar output is reduced
    to ``L = Σ out · r`` with a fixed random ``r``; for each checked input element
    ``x_j``::

        numeric_j = (L(x + ε e_j) - L(x - ε e_j)) / (2ε)
        error_j   = |analytic_j - numeric_j| / max(1, |analytic_j|, |numeric_j|)

    Args:
        fn: the function to check.
        inputs: arrays, lists or Tensors; integer inputs are passed unchanged.
        eps: finite-difference step ε.
        threshold: largest accepted error.
        wrt: indices of the inputs to check (default: every floating-point input).
        raise_on_failure: raise `GradientCheckError` instead of returning a failure.
        seed: seed of the random projection for non-scalar outputs.

    Returns:
        A `GradientCheckResult` (truthy when the check passed).

    Example:
        >>> assert check_gradient(lambda x: (x * x).sum(), [[1.0, 2.0]])
    """
    with jax.enable_x64(True):
        arrays = [np.asarray(x.numpy() if isinstance(x, Tensor) else x) for x in inputs]
        arrays = [a.astype(np.float64) if a.dtype.kind == "f" else a for a in arrays]
        checked = (
            list(wrt)
            if wrt is not None
            else [i for i, a in enumerate(arrays) if a.dtype.kind == "f"]
        )
        analytic, tensor_api, proj = _analytic(fn, arrays, checked, seed)

        def loss_of(*xs: Any) -> Any:
            if tensor_api:
                with no_grad():
                    out = fn(*[Tensor(x) for x in xs]).data
            else:
                out = fn(*xs)
            return jnp.sum(out * proj) if proj is not None else jnp.sum(out)

        loss_jit = jax.jit(loss_of)
        numeric = []
        for i in checked:
            base = arrays[i]
            num = np.zeros(base.size)
            for j in range(base.size):
                plus, minus = base.copy().reshape(-1), base.copy().reshape(-1)
                plus[j] += eps
                minus[j] -= eps
                args_p = list(arrays)
                args_m = list(arrays)
                args_p[i] = plus.reshape(base.shape)
                args_m[i] = minus.reshape(base.shape)
                num[j] = (float(loss_jit(*args_p)) - float(loss_jit(*args_m))) / (
                    2 * eps
                )
            numeric.append(num.reshape(base.shape))

    max_err, worst = 0.0, (checked[0] if checked else -1, 0)
    for k, (a, n) in enumerate(zip(analytic, numeric)):
        err = np.abs(a - n) / np.maximum(1.0, np.maximum(np.abs(a), np.abs(n)))
        if err.size and float(err.max()) > max_err:
            max_err, worst = float(err.max()), (checked[k], int(err.argmax()))
    result = GradientCheckResult(
        max_err <= threshold, max_err, worst, tuple(analytic), tuple(numeric)
    )
    if raise_on_failure and not result.passed:
        raise GradientCheckError(
            f"gradient check failed: max error {max_err:.3g} > {threshold:g} at input "
            f"{worst[0]}, element {worst[1]}"
        )
    return result


def _analytic(
    fn: Callable[..., Any], arrays: list[np.ndarray], checked: list[int], seed: int
) -> tuple[list[np.ndarray], bool, Any]:
    tensors = [Tensor(a, requires_grad=i in checked) for i, a in enumerate(arrays)]
    try:
        out = fn(*tensors)
    except TypeError:
        out = None
    if isinstance(out, Tensor):
        proj = _projection(out, seed)
        loss = (out * proj).sum() if proj is not None else out.sum()
        backward(loss)
        grads = [
            np.zeros_like(arrays[i])
            if tensors[i].grad is None
            else np.asarray(tensors[i].grad)
            for i in checked
        ]
        return grads, True, proj
    out_arr = jax.eval_shape(fn, *arrays)
    proj = _projection(out_arr, seed)

    def projected(*xs: Any) -> Any:
        y = fn(*xs)
        return jnp.sum(y * proj) if proj is not None else jnp.sum(y)

    g = jax.grad(projected, argnums=tuple(checked))(*arrays)
    return [np.asarray(x) for x in g], False, proj
