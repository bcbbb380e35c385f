"""A tiny stacked model over hand-made params, shared by the LoRA tests."""

import jax
import jax.numpy as jnp
import numpy as np

from entrenar.lora import LoRAWeight
from entrenar.nn import linear

L, D, H, V = 3, 8, 16, 5


def make_params(seed: int = 0) -> dict:
    """Random float32 params (numpy's generator: no compilation for test set-up)."""
    rng = np.random.default_rng(seed)

    def normal(*shape, std=1.0):
        return jnp.asarray((rng.normal(size=shape) * std).astype(np.float32))

    return {
        "model": {
            "layers": {
                "up_proj": {"weight": normal(L, H, D, std=1 / 3)},
                "down_proj": {"weight": normal(L, D, H, std=1 / 4)},
                "norm": {"weight": jnp.ones((L, D))},
            },
            "embed_tokens": {"weight": normal(V, D)},
        },
        "lm_head": {"weight": normal(V, D, std=1 / 3)},
    }


def forward(params: dict, x: jax.Array) -> jax.Array:
    """``x: (B, D)`` -> ``(B, V)``; layers scanned over the stacked axis."""

    def layer(h, p):
        u = jnp.tanh(linear(h * p["norm"]["weight"], p["up_proj"]["weight"]))  # (B, H)
        return h + linear(u, p["down_proj"]["weight"]), None  # (B, D)

    h, _ = jax.lax.scan(layer, x, params["model"]["layers"])
    return linear(h, params["lm_head"]["weight"])  # (B, V)


def is_adapter(x) -> bool:
    return isinstance(x, LoRAWeight)


def with_b(params, value):
    """Every adapter's B set to ``value`` (as after training: folding changes W)."""
    return jax.tree_util.tree_map(
        lambda x: x.replace(b=jnp.full_like(x.b, value)) if is_adapter(x) else x,
        params,
        is_leaf=is_adapter,
    )
