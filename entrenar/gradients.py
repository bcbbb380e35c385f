"""Gradients of pure functions over pytrees: the functional core's entry points.

Thin, documented entry points over `jax.value_and_grad` / `jax.grad` so that user code
and the rest of entrenar import one name. They add one thing: a clear `TypeError`
when the function returns something other than an array (a Tensor-API loss, say),
saying what to do instead.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np


def _returns_arrays(fn: Callable[..., Any], has_aux: bool) -> Callable[..., Any]:
    def checked(*args: Any, **kwargs: Any) -> Any:
        out = fn(*args, **kwargs)
        value = out[0] if has_aux and isinstance(out, tuple) else out
        if not isinstance(value, (jax.Array, np.ndarray, np.generic, float, int)):
            hint = (
                " A Tensor-API loss is differentiated with entrenar.backward(loss) "
                "(or loss.backward()); to use value_and_grad, write the loss with jnp "
                "(or return loss.data)."
                if type(value).__name__ == "Tensor"
                else ""
            )
            raise TypeError(
                f"{getattr(fn, '__name__', 'fn')} must return a real scalar array to "
                f"be differentiated, got {type(value).__name__}.{hint}"
            )
        return out

    return checked


def _array_arguments(g: Callable[..., Any], name: str) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        for leaf in jax.tree_util.tree_leaves(args):
            if type(leaf).__name__ == "Tensor":
                raise TypeError(
                    f"{name}'s arguments must be arrays (pytrees of arrays), got a "
                    f"Tensor. Pass tensor.data, or differentiate Tensor code with "
                    f"entrenar.backward(loss)."
                )
        return g(*args, **kwargs)

    return call


def value_and_grad(
    fn: Callable[..., Any],
    argnums: int | Sequence[int] = 0,
    *,
    has_aux: bool = False,
) -> Callable[..., Any]:
    """Return ``f(*args) -> (value, grads)`` (or ``((value, aux), grads)``).

    Args:
        fn: pure function of pytrees returning a real scalar (or ``(scalar, aux)``
            when ``has_aux``).
        argnums: which positional arguments to differentiate; an int gives the
            gradient pytree of that argument, a sequence gives a tuple.
        has_aux: ``fn`` returns ``(loss, aux)``; ``aux`` is passed through.

    Example:
        >>> import jax.numpy as jnp
        >>> f = value_and_grad(lambda p: jnp.sum(p["w"] ** 2))
        >>> v, g = f({"w": jnp.array([1.0, 2.0])})
        >>> float(v), g["w"].tolist()
        (5.0, [2.0, 4.0])
    """
    argnums_ = tuple(argnums) if isinstance(argnums, Sequence) else argnums
    g = jax.value_and_grad(
        _returns_arrays(fn, has_aux), argnums=argnums_, has_aux=has_aux
    )
    return _array_arguments(g, "value_and_grad")


def grad(
    fn: Callable[..., Any],
    argnums: int | Sequence[int] = 0,
    *,
    has_aux: bool = False,
) -> Callable[..., Any]:
    """Return ``f(*args) -> grads`` (or ``(grads, aux)`` when ``has_aux``).

    Example:
        >>> import jax.numpy as jnp
        >>> float(grad(lambda x: x * x)(jnp.float32(3.0)))
        6.0
    """
    argnums_ = tuple(argnums) if isinstance(argnums, Sequence) else argnums
    g = jax.grad(_returns_arrays(fn, has_aux), argnums=argnums_, has_aux=has_aux)
    return _array_arguments(g, "grad")


__all__ = ["grad", "value_and_grad"]
