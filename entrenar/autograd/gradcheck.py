"""Gradient checking by central finite differences in float64."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np

from entrenar.autograd.backward import backward
from entrenar.autograd.tape import no_grad
from entrenar.autograd.tensor import Tensor
from entrenar.errors import ConfigError, GradientCheckError

API = Literal["tensor", "jax"]


@dataclass(frozen=True)
class GradientCheckResult:
    """Outcome of `check_gradient`; truthy when the check passed.

    Attributes:
        passed: every element satisfies ``|a - n| <= atol + rtol · max(|a|, |n|)``.
        max_error: the largest ``|a - n| / (atol + rtol · max(|a|, |n|))`` over the
            checked elements; the check passes when it is at most 1.
        worst: (input index, flat element index) of the largest error.
        analytic: gradients from the tape (or ``jax.grad``), one per checked input.
        numeric: finite-difference gradients, one per checked input.
        api: "tensor" (differentiated by the tape) or "jax" (by ``jax.grad``).
    """

    passed: bool
    max_error: float
    worst: tuple[int, int]
    analytic: tuple[np.ndarray, ...]
    numeric: tuple[np.ndarray, ...]
    api: API = "tensor"

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
    rtol: float = 1e-3,
    atol: float = 1e-5,
    *,
    api: API | None = None,
    wrt: Sequence[int] | None = None,
    raise_on_failure: bool = False,
    seed: int = 0,
) -> GradientCheckResult:
    """Compare analytic gradients of ``fn`` with central finite differences.

    Everything runs in float64 (``jax.enable_x64``). A non-scalar output is reduced
    to ``L = Σ out · r`` with a fixed random ``r``; for each checked input element
    ``x_j``::

        numeric_j  = (L(x + ε e_j) - L(x - ε e_j)) / (2ε)
        passes iff |analytic_j - numeric_j| <= atol + rtol · max(|analytic_j|,
                                                                 |numeric_j|)

    The relative term judges large gradients, the absolute term small ones (a
    gradient of 1e-3 that should be 0 fails at the default ``atol``). The
    central difference's truncation error is ``O(ε²)``, far below both.

    Args:
        fn: the function to check.
        inputs: arrays, lists or Tensors; integer inputs are passed unchanged.
        eps: finite-difference step ε.
        rtol: relative tolerance.
        atol: absolute tolerance.
        api: "tensor" when ``fn`` is written with the Tensor API (it is called with
            Tensors and differentiated by the tape), "jax" when it is a jnp function
            (called with arrays, differentiated by ``jax.grad``). By default
            "tensor"; a jnp function must say ``api="jax"``.
        wrt: indices of the inputs to check (default: every floating-point input).
        raise_on_failure: raise `GradientCheckError` instead of returning a failure.
        seed: seed of the random projection for non-scalar outputs.

    Returns:
        A `GradientCheckResult` (truthy when the check passed).

    Raises:
        ConfigError: ``api`` or the tolerances are invalid, or ``wrt`` is empty or
            names an input that is not floating-point (or there is none to check).
        GradientCheckError: the check failed and ``raise_on_failure`` is set.

    Example:
        >>> assert check_gradient(lambda x: (x * x).sum(), [[1.0, 2.0]])
        >>> import jax.numpy as jnp
        >>> assert check_gradient(lambda x: jnp.sum(x**3), [[0.1]], api="jax")
        >>> assert not check_gradient(_wrong_square, [[0.01, 0.002]], api="jax")
    """
    api = "tensor" if api is None else api
    if api not in ("tensor", "jax"):
        raise ConfigError(f"api must be 'tensor' or 'jax', got {api!r}")
    if not (rtol >= 0 and atol >= 0 and rtol + atol > 0):
        raise ConfigError(f"need rtol, atol >= 0, not both 0; got {rtol}, {atol}")
    with jax.enable_x64(True):
        arrays = [np.asarray(x.numpy() if isinstance(x, Tensor) else x) for x in inputs]
        # bfloat16 and the other ml_dtypes floats are numpy kind "V": ask JAX
        arrays = [a.astype(np.float64) if _floating(a) else a for a in arrays]
        floats = [i for i, a in enumerate(arrays) if _floating(a)]
        checked = floats if wrt is None else [int(i) for i in wrt]
        if not checked or not set(checked) <= set(floats):
            raise ConfigError(
                f"check_gradient: wrt={checked} must name floating-point inputs, at "
                f"least one; the floating-point inputs here are {floats}"
            )
        if api == "tensor":
            analytic, proj = _tape_gradients(fn, arrays, checked, seed)
        else:
            analytic, proj = _jax_gradients(fn, arrays, checked, seed)
        numeric = _numeric_gradients(fn, arrays, checked, proj, eps, api)
    return _judge(analytic, numeric, checked, rtol, atol, api, raise_on_failure)


def _floating(a: np.ndarray) -> bool:
    """Whether ``a`` holds floating-point values (bfloat16 included)."""
    return bool(jnp.issubdtype(a.dtype, jnp.floating))


def _wrong_square(x: Any) -> Any:
    # For the docstring: the gradient of Σ x² is 2x; this function's is 2.2x.
    return jnp.sum(x * jax.lax.stop_gradient(x) * 0.1 + x * x)


def _numeric_gradients(
    fn: Callable[..., Any],
    arrays: list[np.ndarray],
    checked: list[int],
    proj: Any,
    eps: float,
    api: API,
) -> list[np.ndarray]:
    def loss_of(*xs: Any) -> Any:
        if api == "tensor":
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
            args_p, args_m = list(arrays), list(arrays)
            args_p[i] = plus.reshape(base.shape)
            args_m[i] = minus.reshape(base.shape)
            diff = float(loss_jit(*args_p)) - float(loss_jit(*args_m))
            num[j] = diff / (2 * eps)
        numeric.append(num.reshape(base.shape))
    return numeric


def _judge(
    analytic: list[np.ndarray],
    numeric: list[np.ndarray],
    checked: list[int],
    rtol: float,
    atol: float,
    api: API,
    raise_on_failure: bool,
) -> GradientCheckResult:
    max_err, worst = 0.0, (checked[0], 0)
    for k, (a, n) in enumerate(zip(analytic, numeric)):
        err = np.abs(a - n) / (atol + rtol * np.maximum(np.abs(a), np.abs(n)))
        if err.size and float(err.max()) > max_err:
            max_err, worst = float(err.max()), (checked[k], int(err.argmax()))
    result = GradientCheckResult(
        max_err <= 1.0, max_err, worst, tuple(analytic), tuple(numeric), api
    )
    if raise_on_failure and not result.passed:
        k = checked.index(worst[0])
        a_j = float(analytic[k].reshape(-1)[worst[1]])
        n_j = float(numeric[k].reshape(-1)[worst[1]])
        raise GradientCheckError(
            f"gradient check failed at input {worst[0]}, element {worst[1]}: "
            f"analytic {a_j:.6g} vs numeric {n_j:.6g} (allowed {atol:g} + "
            f"{rtol:g}·max)"
        )
    return result


def _tape_gradients(
    fn: Callable[..., Any], arrays: list[np.ndarray], checked: list[int], seed: int
) -> tuple[list[np.ndarray], Any]:
    tensors = [Tensor(a, requires_grad=i in checked) for i, a in enumerate(arrays)]
    out = fn(*tensors)
    if not isinstance(out, Tensor):
        raise ConfigError(
            f"check_gradient(api='tensor') needs fn to return a Tensor, got "
            f"{type(out).__name__}; for a jnp function pass api='jax'"
        )
    proj = _projection(out, seed)
    loss = (out * proj).sum() if proj is not None else out.sum()
    backward(loss)
    grads = [
        np.zeros_like(arrays[i])
        if tensors[i].grad is None
        else np.asarray(tensors[i].grad)
        for i in checked
    ]
    return grads, proj


def _jax_gradients(
    fn: Callable[..., Any], arrays: list[np.ndarray], checked: list[int], seed: int
) -> tuple[list[np.ndarray], Any]:
    out_arr = jax.eval_shape(fn, *arrays)
    proj = _projection(out_arr, seed)

    def projected(*xs: Any) -> Any:
        y = fn(*xs)
        return jnp.sum(y * proj) if proj is not None else jnp.sum(y)

    g = jax.grad(projected, argnums=tuple(checked))(*arrays)
    return [np.asarray(x) for x in g], proj
