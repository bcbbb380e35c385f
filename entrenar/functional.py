"""The functional core: gradients of pure functions over pytrees.

Thin, documented entry points over `jax.value_and_grad` / `jax.grad` so that user code
and the rest of entrenar import one name. They add one thing: a clear `TypeError`-style
message when the function does not return a real scalar.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax


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
    return jax.value_and_grad(fn, argnums=argnums_, has_aux=has_aux)


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
    return jax.grad(fn, argnums=argnums_, has_aux=has_aux)


__all__ = ["grad", "value_and_grad"]
