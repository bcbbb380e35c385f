"""The ready-made optimizers: `sgd`, `adam`, `adamw`, `adam_8bit`, `adamw_8bit`.

Each is a `chain` of small pieces; the 8-bit ones store Adam's moments block-wise in
8 bits (bitsandbytes' ``Adam8bit``/``AdamW8bit``).

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
from entrenar.optim.adam8bit import (
    MIN_8BIT_SIZE,
    adam8bit_apply,
    scale_by_adam_8bit,
)
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


@OPTIMIZERS.register("adam_8bit")
def adam_8bit(
    learning_rate: float | Schedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    *,
    min_8bit_size: int = MIN_8BIT_SIZE,
) -> GradientTransformation:
    r"""`adam` with 8-bit block-wise moments (bitsandbytes' ``Adam8bit``).

    Dettmers et al. (2022), "8-bit Optimizers via Block-wise Quantization": ``m``
    and ``v`` are stored as uint8 codes of the dynamic map with one float32 absmax
    per block of 256 values (`entrenar.optim.adam8bit`), ~2 bytes per parameter
    instead of 8; the step itself runs in float32 from the dequantized moments.

    Args:
        learning_rate: ``η``: a number or a schedule.
        b1: ``β_1``.
        b2: ``β_2``.
        eps: ``ε``.
        min_8bit_size: leaves with fewer values keep float32 moments
            (bitsandbytes' 4096).

    Example:
        >>> import jax.numpy as jnp
        >>> tx = adam_8bit(0.1)
        >>> u, _ = tx.update(jnp.full(5000, 5.0), tx.init(jnp.zeros(5000)))
        >>> round(float(u[0]), 5)  # the first step is -η·sign(g)
        -0.1
    """
    rate = scale_by_learning_rate(learning_rate)
    tx = chain(scale_by_adam_8bit(b1, b2, eps, min_8bit_size=min_8bit_size), rate)
    return tx._replace(apply=adam8bit_apply(b1, b2, eps, 0.0, None, None, rate))


@OPTIMIZERS.register("adamw_8bit")
def adamw_8bit(
    learning_rate: float | Schedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.01,
    mask: Mask | None = None,
    *,
    min_8bit_size: int = MIN_8BIT_SIZE,
) -> GradientTransformation:
    r"""`adamw` with 8-bit block-wise moments (bitsandbytes' ``AdamW8bit``).

    Hugging Face's ``optim="adamw_bnb_8bit"`` (or ``"adamw_8bit"``): the update is
    `adamw`'s, ``θ_t = θ_{t-1} − η_t (\hat m_t / (\sqrt{\hat v_t} + ε) + λθ_{t-1})``,
    with ``m`` and ``v`` stored 8-bit between steps as in `adam_8bit` (Dettmers et
    al., 2022). Equal to bitsandbytes' CPU kernel to float32 rounding (its CUDA
    kernel shrinks by ``1 − η_t λ`` after the step instead of before: a
    difference of ``η_t² λ`` times the step).

    Args:
        learning_rate: ``η``: a number or a schedule.
        b1: ``β_1``.
        b2: ``β_2``.
        eps: ``ε``.
        weight_decay: ``λ``.
        mask: decay only the leaves where the mask is True, as in `adamw`.
        min_8bit_size: leaves with fewer values keep float32 moments.

    Example:
        >>> import jax.numpy as jnp
        >>> tx = adamw_8bit(0.1, weight_decay=0.5)
        >>> p = jnp.full(5000, 2.0)
        >>> u, _ = tx.update(jnp.ones(5000), tx.init(p), p)
        >>> round(float(u[0]), 5)  # -η (1 + λθ) = -0.1 · (1 + 1)
        -0.2
    """
    decay = add_decayed_weights(weight_decay, mask)
    rate = scale_by_learning_rate(learning_rate)
    tx = chain(
        scale_by_adam_8bit(b1, b2, eps, min_8bit_size=min_8bit_size), decay, rate
    )
    apply = adam8bit_apply(b1, b2, eps, weight_decay, mask, decay, rate)
    return tx._replace(apply=apply)


_HF_NAMES = {"adamw_bnb_8bit": "adamw_8bit", "adam_bnb_8bit": "adam_8bit"}
"""Hugging Face's ``optim`` names of the same optimizers."""


def _optimizer_name(value: object) -> object:
    """Accept Hugging Face's ``adamw_bnb_8bit``; refuse its paged optimizers."""
    if not isinstance(value, str):
        return value
    if value.startswith("paged_") and value.endswith("8bit"):
        raise ConfigError(
            f"{value!r}: paged optimizers page their state through CUDA unified "
            "memory, which JAX does not have; adamw_8bit is the same optimizer "
            "without paging (its state stays on the device)"
        )
    return _HF_NAMES.get(value, value)


_ARGS = {"beta1": "b1", "beta2": "b2"}
"""The YAML keys (the book's) of arguments named otherwise in the functions."""


@dataclasses.dataclass(frozen=True)
class OptimizerConfig(Config):
    """An optimizer and its hyperparameters: the ``optimizer:`` section of a run.

    Hyperparameters left unset (None) take the defaults of the optimizer's function.

    >>> OptimizerConfig("sgd", lr=0.1, momentum=0.9).arguments()
    {'momentum': 0.9}
    """

    name: Literal["sgd", "adam", "adamw", "adam_8bit", "adamw_8bit"] = option(
        "adamw",
        normalize=_optimizer_name,
        doc="sgd, adam, adamw, or adam_8bit/adamw_8bit: Adam's moments stored 8-bit "
        "per block of 256 (bitsandbytes' Adam8bit/AdamW8bit; Hugging Face's "
        "adamw_bnb_8bit is adamw_8bit)",
    )
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
        None, ge=0.0, lt=1.0, doc="adam/adamw(_8bit): β₁ (default 0.9)"
    )
    beta2: float | None = option(
        None, ge=0.0, lt=1.0, doc="adam/adamw(_8bit): β₂ (default 0.999)"
    )
    eps: float | None = option(
        None, gt=0.0, aliases=("epsilon",), doc="adam/adamw(_8bit): ε (default 1e-8)"
    )
    weight_decay: float | None = option(
        None,
        ge=0.0,
        doc="decoupled decay for adamw/adamw_8bit (default 0.01), L2 gradient term "
        "for sgd (default 0); adam has none. Not on biases and norm weights "
        "(HF Trainer's rule) unless decay_norms_and_biases",
    )
    decay_norms_and_biases: bool = option(
        False,
        doc="adamw/adamw_8bit/sgd: decay every trainable leaf (optax's and torch's "
        "default on all parameters) instead of all but biases and norm weights "
        "(HF Trainer's get_decay_parameter_names)",
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
        if self.decay_norms_and_biases and self.name in ("adam", "adam_8bit"):
            raise ConfigError(
                f"{path}.decay_norms_and_biases: {self.name} has no weight decay; "
                "remove it"
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


__all__ = [
    "OPTIMIZERS",
    "OptimizerConfig",
    "adam",
    "adam_8bit",
    "adamw",
    "adamw_8bit",
    "sgd",
]
