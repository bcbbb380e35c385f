"""A multi-layer perceptron as a frozen config with ``init`` and a pure ``apply``.

For sizes ``(n₀, n₁, ..., n_K)``: ``h₀ = x``, ``h_k = act(h_{k-1} W_kᵀ + b_k)`` for
``k < K`` (with dropout after the activation when a key is given), and the output
``h_K = h_{K-1} W_Kᵀ + b_K`` has no activation. ``params["layers"][k]`` holds
``{"weight": (n_k, n_{k-1}), "bias": (n_k,)}`` (Hugging Face name ``layers.k.weight``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from entrenar.errors import ConfigError, ShapeError
from entrenar.nn import init as initializers
from entrenar.nn.layers import dropout, gelu_tanh, silu
from entrenar.nn.linear import linear
from entrenar.nn.llama import check_dtype
from entrenar.nn.registry import Architecture, register_architecture
from entrenar.types import Params, PRNGKey

ACTIVATIONS: dict[str, Callable[[jax.Array], jax.Array]] = {
    "relu": jax.nn.relu,
    "gelu": gelu_tanh,
    "silu": silu,
    "tanh": jnp.tanh,
}
INITIALIZERS = ("xavier_uniform", "xavier_normal", "kaiming_uniform", "kaiming_normal")


@dataclasses.dataclass(frozen=True)
class MLP:
    """Multi-layer perceptron; the config is the model.

    Attributes:
        sizes: ``(in, hidden..., out)``, at least two entries.
        activation: one of `ACTIVATIONS`.
        dropout: rate after each hidden activation, active only when ``apply`` gets
            a ``key``.
        initializer: one of `INITIALIZERS` for the weights (biases start at zero).
        dtype: compute dtype.
        param_dtype: dtype of the parameters ``init`` creates.

    Example:
        >>> m = MLP((3, 8, 2))
        >>> m.apply(m.init(jax.random.key(0)), jnp.ones((5, 3))).shape
        (5, 2)
    """

    sizes: tuple[int, ...]
    activation: str = "relu"
    dropout: float = 0.0
    initializer: str = "xavier_uniform"
    dtype: str = "float32"
    param_dtype: str = "float32"

    def __post_init__(self) -> None:
        object.__setattr__(self, "sizes", tuple(int(s) for s in self.sizes))
        if len(self.sizes) < 2 or min(self.sizes) <= 0:
            raise ConfigError(f"MLP sizes need >= 2 positive entries: {self.sizes}")
        if self.activation not in ACTIVATIONS:
            raise ConfigError(
                f"MLP activation {self.activation!r} is not one of {list(ACTIVATIONS)}"
            )
        if self.initializer not in INITIALIZERS:
            raise ConfigError(
                f"MLP initializer {self.initializer!r} is not one of {INITIALIZERS}"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"MLP dropout must lie in [0, 1): {self.dropout}")
        check_dtype(self.dtype, "MLP.dtype")
        check_dtype(self.param_dtype, "MLP.param_dtype")

    def init(self, key: PRNGKey) -> Params:
        """Weights from the configured initialiser, zero biases."""
        fn: Any = getattr(initializers, self.initializer)
        layers = []
        for k, (n_in, n_out) in enumerate(zip(self.sizes[:-1], self.sizes[1:])):
            w = fn(
                (n_out, n_in), key=jax.random.fold_in(key, k), dtype=self.param_dtype
            )
            layers.append({"weight": w, "bias": jnp.zeros(n_out, self.param_dtype)})
        return {"layers": layers}

    def apply(
        self,
        params: Params,
        x: jax.Array,
        *,
        key: PRNGKey | None = None,
        return_hidden: bool = False,
    ) -> Any:
        """Outputs ``(..., out)`` for inputs ``x: (..., in)``.

        Args:
            params: from `init` (weights may be LoRA or quantized nodes).
            x: inputs ``(..., sizes[0])``.
            key: dropout key; None disables dropout.
            return_hidden: also return the hidden states, a tuple of ``K`` arrays:
                ``h₀ = x`` (in the compute dtype), then each hidden layer's output
                ``h_k: (..., n_k)`` as the next layer receives it (after the
                activation and dropout).

        Returns:
            outputs, or ``(outputs, hidden)`` with ``return_hidden``.
        """
        if x.shape[-1] != self.sizes[0]:
            raise ShapeError(
                f"MLP expects inputs (..., {self.sizes[0]}), got {tuple(x.shape)}"
            )
        act = ACTIVATIONS[self.activation]
        layers = params["layers"]
        h = x.astype(self.dtype)
        hidden = [h]
        for k, layer in enumerate(layers):
            h = linear(h, layer["weight"], layer["bias"])  # (..., n_k)
            if k < len(layers) - 1:
                h = act(h)
                if key is not None:
                    h = dropout(h, self.dropout, key=jax.random.fold_in(key, k))
                hidden.append(h)
        return (h, tuple(hidden)) if return_hidden else h


__all__ = ["ACTIVATIONS", "INITIALIZERS", "MLP"]


register_architecture(
    Architecture(
        name="mlp",
        config_class=MLP,
        summary="a multilayer perceptron for tabular data (features in, outputs out)",
    )
)
