"""The ready-made optimizers: `sgd`, `adam`, `adamw`, each a `chain` of small pieces.

Every ``learning_rate`` is a number or a schedule; the rate sits in the state (read it
with `get_lr`, change it with `set_lr`). ``state_dtype`` stores the moment buffers in a
narrower dtype (e.g. ``jnp.bfloat16``) to halve their memory.

`OPTIMIZERS` names them for a run's YAML file (``optimizer: {name: adamw}``), whose
section is `OptimizerConfig`; adding one is one ``@OPTIMIZERS.register(name)``.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from typing import Any, Literal

from entrenar.errors import ConfigError
from entrenar.optim.base import GradientTransformation, chain
from entrenar.optim.fused import adamw_apply
from entrenar.optim.learning_rate import scale_by_learning_rate
from entrenar.optim.masking import Mask, hf_decay_mask
from entrenar.optim.schedules import Schedule
from entrenar.optim.transforms import add_decayed_weights, scale_by_adam, trace
from entrenar.schema import Config, Registry, option

OPTIMIZERS: Registry[Callable[..., GradientTransformation]] = Registry("optimizer")
"""``optimizer.name`` -> the optimizer function; `OptimizerConfig` passes it the
hyperparameters it sets by name, so the function's signature says which it reads and
their defaults."""


@OPTIMIZERS.register("sgd")
def sgd(
    learning_rate: float | Schedule,
    momentum: float = 0.0,
    nesterov: bool = False,
    weight_decay: float = 0.0,
    mask: Mask | None = None,
    *,
    state_dtype: Any = None,
) -> GradientTransformation:
    r"""Stochastic gradient descent, with optional momentum (PyTorch's ``SGD``).

    .. math::
        g'_t = g_t + λ θ_{t-1},\quad b_t = μ b_{t-1} + g'_t,\quad
        θ_t = θ_{t-1} - η_t \,(b_t \text{ or, with Nesterov, } g'_t + μ b_t)

    With ``momentum=0`` this is ``θ ← θ - η (g + λθ)``. Weight decay here is the L2
    penalty's gradient added before the momentum, as in ``torch.optim.SGD``.
    Momentum: Polyak (1964); Nesterov form: Sutskever et al. (2013).

    Args:
        learning_rate: ``η``: a number or a schedule.
        momentum: ``μ``; 0 keeps no buffer (no state memory).
        nesterov: Nesterov momentum.
        weight_decay: ``λ``.
        mask: decay only the leaves where the mask is True (a pytree of bools or a
            predicate ``fn(name, leaf)``), e.g. `hf_decay_mask`.
        state_dtype: dtype of the momentum buffer.

    Example:
        >>> import jax.numpy as jnp
        >>> from entrenar.optim import apply_updates
        >>> tx = sgd(0.1)
        >>> u, _ = tx.update(jnp.array([1.0]), tx.init(jnp.zeros(1)))
        >>> round(float(apply_updates(jnp.array([1.0]), u)[0]), 6)
        0.9
    """
    pieces: list[Any] = []
    if weight_decay:
        pieces.append(add_decayed_weights(weight_decay, mask))
    if momentum:
        pieces.append(trace(momentum, nesterov, accumulator_dtype=state_dtype))
    pieces.append(scale_by_learning_rate(learning_rate))
    return chain(*pieces)


@OPTIMIZERS.register("adam")
def adam(
    learning_rate: float | Schedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    *,
    eps_root: float = 0.0,
    state_dtype: Any = None,
) -> GradientTransformation:
    r"""Adam (Kingma & Ba, 2015, "Adam: A Method for Stochastic Optimization").

    .. math::
        m_t = β_1 m_{t-1} + (1-β_1) g_t,\quad v_t = β_2 v_{t-1} + (1-β_2) g_t^2

        \hat m_t = m_t / (1-β_1^t),\quad \hat v_t = v_t / (1-β_2^t),\quad
        θ_t = θ_{t-1} - η_t\, \hat m_t / (\sqrt{\hat v_t} + ε)

    ``t`` counts from 1 at the first update (the bias correction).

    Args:
        learning_rate: ``η``: a number or a schedule.
        b1: ``β_1``.
        b2: ``β_2``.
        eps: ``ε``, outside the square root (as in the paper and PyTorch).
        eps_root: added inside the square root (0 in the paper).
        state_dtype: dtype of ``m`` and ``v`` (default: the parameter's).

    Example:
        >>> import jax.numpy as jnp
        >>> tx = adam(0.1)
        >>> u, _ = tx.update(jnp.array([5.0]), tx.init(jnp.zeros(1)))
        >>> round(float(u[0]), 5)  # the first step is -η·sign(g)
        -0.1
    """
    return chain(
        scale_by_adam(
            b1, b2, eps, eps_root, mu_dtype=state_dtype, nu_dtype=state_dtype
        ),
        scale_by_learning_rate(learning_rate),
    )


@OPTIMIZERS.register("adamw")
def adamw(
    learning_rate: float | Schedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.01,
    mask: Mask | None = None,
    *,
    eps_root: float = 0.0,
    state_dtype: Any = None,
) -> GradientTransformation:
    r"""AdamW: Adam with decoupled weight decay (Loshchilov & Hutter, 2019).

    .. math::
        θ_t = θ_{t-1} - η_t \left(\frac{\hat m_t}{\sqrt{\hat v_t} + ε}
              + λ θ_{t-1}\right)

    with ``\hat m_t, \hat v_t`` as in `adam`. The decay ``λθ`` is added to Adam's
    direction, not to the gradient, so it is not rescaled by ``\sqrt{\hat v}``; it *is*
    multiplied by the learning rate ``η_t`` (as ``torch.optim.AdamW`` and
    ``optax.adamw`` do), so the per-step shrink is ``1 - η_t λ``.

    Args:
        learning_rate: ``η``: a number or a schedule.
        b1: ``β_1``.
        b2: ``β_2``.
        eps: ``ε``.
        weight_decay: ``λ``.
        mask: decay only the leaves where the mask is True (a pytree of bools or a
            predicate ``fn(name, leaf)``), e.g. `hf_decay_mask`: not biases and
            norms.
        eps_root: added inside the square root.
        state_dtype: dtype of ``m`` and ``v``.

    The result also has ``apply(grads, state, params) -> (params, state)``
    (`apply_gradients` uses it): the same step in one pass over θ, m and v, through
    a native kernel for float32 leaves on the CPU (`entrenar.optim.fused`).

    Example:
        >>> import jax.numpy as jnp
        >>> tx = adamw(0.1, weight_decay=0.5)
        >>> p = jnp.array([2.0])
        >>> u, _ = tx.update(jnp.array([1.0]), tx.init(p), p)
        >>> round(float(u[0]), 5)  # -η (1 + λθ) = -0.1 · (1 + 1)
        -0.2
    """
    decay = add_decayed_weights(weight_decay, mask)
    rate = scale_by_learning_rate(learning_rate)
    tx = chain(
        scale_by_adam(
            b1, b2, eps, eps_root, mu_dtype=state_dtype, nu_dtype=state_dtype
        ),
        decay,
        rate,
    )
    apply = adamw_apply(b1, b2, eps, eps_root, weight_decay, mask, decay, rate)
    return tx._replace(apply=apply)


_ARGS = {"beta1": "b1", "beta2": "b2"}
"""The YAML keys (the book's) of arguments named otherwise in the functions."""


@dataclasses.dataclass(frozen=True)
class OptimizerConfig(Config):
    """An optimizer and its hyperparameters: the ``optimizer:`` section of a run.

    Hyperparameters left unset (None) take the defaults of the optimizer's function.

    >>> OptimizerConfig("sgd", lr=0.1, momentum=0.9).arguments()
    {'momentum': 0.9}
    """

    name: Literal["sgd", "adam", "adamw"] = option("adamw", doc="sgd, adam or adamw")
    lr: float = option(
        1e-3,
        gt=0.0,
        aliases=("learning_rate",),
        doc="learning rate (the peak of the `scheduler`)",
    )
    momentum: float | None = option(
        None, ge=0.0, lt=1.0, doc="sgd: momentum (default 0: none)"
    )
    nesterov: bool | None = option(None, doc="sgd: Nesterov momentum (default false)")
    beta1: float | None = option(
        None, ge=0.0, lt=1.0, doc="adam/adamw: β₁ (default 0.9)"
    )
    beta2: float | None = option(
        None, ge=0.0, lt=1.0, doc="adam/adamw: β₂ (default 0.999)"
    )
    eps: float | None = option(
        None, gt=0.0, aliases=("epsilon",), doc="adam/adamw: ε (default 1e-8)"
    )
    weight_decay: float | None = option(
        None,
        ge=0.0,
        doc="decoupled decay for adamw (default 0.01), L2 gradient term for sgd "
        "(default 0); adam has none. Not on biases and norm weights (HF Trainer's "
        "rule) unless decay_norms_and_biases",
    )
    decay_norms_and_biases: bool = option(
        False,
        doc="adamw/sgd: decay every trainable leaf (optax's and torch's default on "
        "all parameters) instead of all but biases and norm weights (HF Trainer's "
        "get_decay_parameter_names)",
    )

    def arguments(self) -> dict[str, Any]:
        """The hyperparameters set, by the optimizer function's argument names."""
        fields = dataclasses.fields(self)[2:]  # after name and lr
        values = {
            _ARGS.get(f.name, f.name): getattr(self, f.name)
            for f in fields
            if f.name != "decay_norms_and_biases"  # `build`'s mask
        }
        return {k: v for k, v in values.items() if v is not None}

    def check(self, path: str) -> None:
        """Each hyperparameter only with an optimizer that reads it."""
        for arg in self.arguments():
            users = [n for n in OPTIMIZERS if arg in _arguments(OPTIMIZERS[n])]
            if self.name not in users:
                key = next((k for k, a in _ARGS.items() if a == arg), arg)
                raise ConfigError(
                    f"{path}.{key}: {self.name} does not use {key} (only "
                    f"{' and '.join(users)}); remove it"
                )
        if self.decay_norms_and_biases and self.name == "adam":
            raise ConfigError(
                f"{path}.decay_norms_and_biases: adam has no weight decay; remove it"
            )

    def build(
        self, learning_rate: float | Schedule | None = None
    ) -> GradientTransformation:
        """The optimizer at ``learning_rate`` (a number or a schedule; default `lr`)."""
        rate = self.lr if learning_rate is None else learning_rate
        kwargs = self.arguments()
        if "mask" in _arguments(OPTIMIZERS[self.name]):  # adamw, sgd: HF's rule
            kwargs["mask"] = None if self.decay_norms_and_biases else hf_decay_mask
        return OPTIMIZERS[self.name](rate, **kwargs)


def _arguments(fn: Callable[..., Any]) -> Any:
    return inspect.signature(fn).parameters


__all__ = ["OPTIMIZERS", "OptimizerConfig", "adam", "adamw", "sgd"]
