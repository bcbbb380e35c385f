"""Stateful optimizers for the Tensor API: ``opt.step([w, b])``, ``opt.set_lr(lr)``.

A thin shell over the pure transformations: the wrapper keeps one pure optimizer state
per tensor and, on ``step``, runs **one** jitted function over the whole list (the
update of every tensor plus `apply_updates`, or AdamW's one-pass ``apply``: see
`apply_gradients`), then assigns each tensor's new ``.data``.
Tensors whose ``.grad`` is None are skipped and keep their state (as in PyTorch, each
tensor counts its own steps). The learning rate is an argument of the jitted function,
so `set_lr` never recompiles; the states are donated to it (updated in place).

    opt = AdamW(lr=1e-3, weight_decay=0.01)
    backward(loss)
    clip_grad_norm(params, 1.0)
    opt.step(params)
    opt.zero_grad(params)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from entrenar.errors import ConfigError, ShapeError
from entrenar.optim.adam8bit import MIN_8BIT_SIZE
from entrenar.optim.alias import adam, adam_8bit, adamw, adamw_8bit, sgd
from entrenar.optim.base import GradientTransformation, apply_gradients
from entrenar.optim.learning_rate import set_lr
from entrenar.types import OptState


class Optimizer:
    """Base class: a pure transformation with a settable rate, state per tensor.

    Args:
        tx: a transformation whose state holds a settable learning rate (built with
            `scale_by_learning_rate` and a number).
        lr: the initial learning rate.
    """

    def __init__(self, tx: GradientTransformation, lr: float):
        if callable(lr) or not isinstance(lr, (int, float)):
            raise ConfigError(
                f"lr must be a number, got {type(lr).__name__}; to follow a schedule "
                "call opt.set_lr(schedule(step)) each step (e.g. CosineScheduler)"
            )
        self._tx = tx
        self._lr = float(lr)
        # id(tensor) -> (tensor, its state, its shape); holding the tensor keeps the id
        self._states: dict[int, tuple[Any, OptState, tuple[int, ...]]] = {}
        self._step_fn = jax.jit(self._pure_step, donate_argnums=(2,))

    def _pure_step(
        self, params: list[Any], grads: list[Any], states: list[Any], lr: jax.Array
    ) -> tuple[list[Any], list[Any]]:
        new_params, new_states = [], []
        for p, g, s in zip(params, grads, states):
            p, s = apply_gradients(self._tx, g, set_lr(s, lr), p)  # AdamW: one pass
            new_params.append(p)
            new_states.append(s)
        return new_params, new_states

    @property
    def lr(self) -> float:
        """The learning rate of the next step."""
        return self._lr

    def set_lr(self, lr: float) -> None:
        """Use ``lr`` from the next step on (no recompilation)."""
        self._lr = float(lr)

    def state_of(self, tensor: Any) -> OptState | None:
        """The pure optimizer state held for ``tensor`` (None before its first step)."""
        entry = self._states.get(id(tensor))
        return None if entry is None else entry[1]

    def _state_for(self, t: Any) -> OptState:
        entry = self._states.get(id(t))
        if entry is None:
            return self._tx.init(t.data)
        _, state, shape = entry
        if t.data.shape != shape:
            raise ShapeError(
                f"a tensor changed shape from {shape} to {t.data.shape} between "
                "optimizer steps; make a new optimizer for the new parameters"
            )
        return state

    def step(self, tensors: Sequence[Any]) -> None:
        """Update each tensor of ``tensors`` that has a gradient, in one jitted call."""
        live: list[Any] = []
        seen: set[int] = set()
        for t in tensors:
            if t.grad is not None and id(t) not in seen:
                seen.add(id(t))
                live.append(t)
        if not live:
            return
        states = [self._state_for(t) for t in live]
        params = [t.data for t in live]
        for t, p in zip(live, params):
            # Raises TapeError now (if a live tape still needs t), before the donated
            # states are consumed, rather than half-way through the assignments.
            t.data = p
        grads = [
            g if isinstance(g, jax.Array) else jnp.asarray(g)
            for g in (t.grad for t in live)
        ]
        for p, g in zip(params, grads):
            if p.shape != g.shape:
                raise ShapeError(
                    f"tensor of shape {p.shape} has a gradient of shape {g.shape}"
                )
        new_params, new_states = self._step_fn(
            params, grads, states, np.float32(self._lr)
        )
        for t, p, s in zip(live, new_params, new_states):
            t.data = p
            self._states[id(t)] = (t, s, p.shape)

    def zero_grad(self, tensors: Sequence[Any]) -> None:
        """Forget the gradients of ``tensors`` (each ``.grad`` becomes None)."""
        for t in tensors:
            t.zero_grad()


class SGD(Optimizer):
    """SGD with optional momentum, Nesterov and (L2) weight decay; see `sgd`."""

    def __init__(
        self,
        lr: float,
        momentum: float = 0.0,
        nesterov: bool = False,
        weight_decay: float = 0.0,
        *,
        state_dtype: Any = None,
    ):
        super().__init__(
            sgd(lr, momentum, nesterov, weight_decay, state_dtype=state_dtype), lr
        )


class Adam(Optimizer):
    """Adam; see `adam` for the update rule."""

    def __init__(
        self,
        lr: float,
        beta1: float = 0.9,
        beta2: float = 0.999,
        eps: float = 1e-8,
        *,
        state_dtype: Any = None,
    ):
        super().__init__(adam(lr, beta1, beta2, eps, state_dtype=state_dtype), lr)

    @classmethod
    def default_params(cls, lr: float) -> Adam:
        """Adam with β1=0.9, β2=0.999, ε=1e-8 (a name kept for Rust API users)."""
        return cls(lr)


class AdamW(Optimizer):
    """AdamW with decoupled weight decay; see `adamw` for the update rule."""

    def __init__(
        self,
        lr: float,
        weight_decay: float = 0.01,
        beta1: float = 0.9,
        beta2: float = 0.999,
        eps: float = 1e-8,
        *,
        state_dtype: Any = None,
    ):
        tx = adamw(lr, beta1, beta2, eps, weight_decay, state_dtype=state_dtype)
        super().__init__(tx, lr)

    @classmethod
    def default_params(cls, lr: float) -> AdamW:
        """AdamW with λ=0.01, β1=0.9, β2=0.999, ε=1e-8 (a name for Rust API users)."""
        return cls(lr)


class Adam8bit(Optimizer):
    """Adam with 8-bit block-wise moments for tensors (bitsandbytes' ``Adam8bit``).

    The update is `adam`'s; ``m`` and ``v`` are kept between steps as uint8 codes of
    the dynamic map with one float32 absmax per block of 256 values (Dettmers et al.,
    2022, "8-bit Optimizers via Block-wise Quantization"; `adam_8bit`), about 2 bytes
    a parameter instead of 8. Tensors with fewer than ``min_8bit_size`` values keep
    float32 moments.
    """

    def __init__(
        self,
        lr: float,
        beta1: float = 0.9,
        beta2: float = 0.999,
        eps: float = 1e-8,
        *,
        min_8bit_size: int = MIN_8BIT_SIZE,
    ):
        tx = adam_8bit(lr, beta1, beta2, eps, min_8bit_size=min_8bit_size)
        super().__init__(tx, lr)


class AdamW8bit(Optimizer):
    """AdamW with 8-bit block-wise moments for tensors (bitsandbytes' ``AdamW8bit``).

    `adamw_8bit`'s update, ``θ ← θ − η (m̂ / (√v̂ + ε) + λθ)``, with the moments
    stored 8-bit between steps as in `Adam8bit`.

        opt = AdamW8bit(lr=1e-3, weight_decay=0.01)
        backward(loss)
        opt.step(params)
    """

    def __init__(
        self,
        lr: float,
        weight_decay: float = 0.01,
        beta1: float = 0.9,
        beta2: float = 0.999,
        eps: float = 1e-8,
        *,
        min_8bit_size: int = MIN_8BIT_SIZE,
    ):
        tx = adamw_8bit(
            lr, beta1, beta2, eps, weight_decay, min_8bit_size=min_8bit_size
        )
        super().__init__(tx, lr)


__all__ = ["SGD", "Adam", "Adam8bit", "AdamW", "AdamW8bit", "Optimizer"]
