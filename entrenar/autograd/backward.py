"""`backward`: accumulate gradients of a tensor into the ``.grad`` of its leaves."""

from __future__ import annotations

from typing import Any

import numpy as np

from entrenar.autograd import engine
from entrenar.autograd.tensor import Tensor
from entrenar.errors import ShapeError, TapeError


def backward(loss: Tensor, grad: Any = None, *, retain_graph: bool = False) -> None:
    """Reverse-mode differentiation of ``loss`` through the recorded graph.

    For every leaf ``x`` with ``requires_grad=True`` that ``loss`` depends on,
    ``x.grad += Jᵀ·grad`` where J = ∂loss/∂x (vector-Jacobian product). Gradients of
    tensors used several times are summed (z = y + y with y = x² gives dz/dx = 4x).
    ``.grad`` accumulates across calls until `Tensor.zero_grad`.

    Args:
        loss: the tensor to differentiate.
        grad: the seed ``∂L/∂loss``, of ``loss``'s shape. Optional when ``loss`` has
            one element (the seed is then 1).
        retain_graph: keep the graph so it can be differentiated again; otherwise it is
            released (its leaves may then be modified).

    Raises:
        TapeError: ``loss`` does not require grad, its graph was released, or it has
            more than one element and no seed was given.
    """
    if not isinstance(loss, Tensor):
        raise TapeError(f"backward() needs a Tensor, got {type(loss).__name__}")
    if not loss.requires_grad:
        raise TapeError(
            "backward() on a tensor that does not require grad: no leaf it depends "
            "on was created with requires_grad=True (or it was computed under "
            "no_grad())"
        )
    if grad is None:
        if loss.size != 1:
            raise TapeError(
                f"backward() on a tensor of shape {loss.shape} needs a seed gradient "
                "of the same shape (grad=...); only one-element tensors default to 1"
            )
        seed = None
    else:
        seed = grad.data if isinstance(grad, Tensor) else grad
        if tuple(np.shape(seed)) != loss.shape:
            raise ShapeError(
                f"backward() seed has shape {tuple(np.shape(seed))}, expected "
                f"{loss.shape}"
            )
    engine.backward(loss, seed, retain_graph=retain_graph)
