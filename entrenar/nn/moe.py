"""The sparse mixture-of-experts MLP: a router picks ``k`` of ``E`` SwiGLU experts.

Shazeer et al., "Outrageously Large Neural Networks: The Sparsely-Gated
Mixture-of-Experts Layer", 2017 (top-k gating); Fedus et al., "Switch Transformers",
2021 (the load-balancing loss, `load_balancing_loss`); Jiang et al., "Mixtral of
Experts", 2024 (top-2 of 8 SwiGLU experts, renormalised). Qwen1.5/2-MoE add a shared
expert behind a sigmoid gate; Qwen3-MoE is Mixtral's block with ``norm_topk_prob``.

For a token ``x: (D,)`` of a layer with router ``W_r: (E, D)`` and experts
``W_gate^e, W_up^e: (I, D)``, ``W_down^e: (D, I)``::

    z = x W_rᵀ                          (E,)   router logits, in the compute dtype
    p = softmax(z)                      (E,)   in float32
    S = top-k(p)                               the k largest, ties to the lower index
    w_e = p_e / Σ_{j∈S} p_j  (renormalised: Mixtral; Qwen's norm_topk_prob)
          p_e                (otherwise)
    y = Σ_{e∈S} w_e · (silu(x W_gate^eᵀ) ⊙ x W_up^eᵀ) W_down^eᵀ
      + σ(x W_sgᵀ) · SwiGLU_shared(x)      (Qwen2-MoE's shared expert, W_sg: (1, D))

Only the chosen experts are computed: the ``N k`` (token, expert) slots are sorted
by expert and each projection is one grouped matmul, `jax.lax.ragged_dot`, over the
sorted ``(N k, D)`` rows with the ``(E,)`` group sizes, never an ``(N, E, ...)``
tensor. (On TPU that is a grouped-GEMM kernel; XLA:CPU in jax 0.10.2 lowers
``ragged_dot`` to one masked dot per group, so the CPU's FLOPs still grow with
``E``: specs/models.md, "Mixture of experts".) The weights of a layer are stacked
``(E, out, in)``, those of the model ``(L, E, out, in)``, so the layer scan stays
one scan.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from entrenar.nn.layers import gated_mlp, silu, upcast_dtype
from entrenar.nn.linear import linear
from entrenar.nn.weight_node import logical_shape, to_dense
from entrenar.types import Params


def route(logits: jax.Array, k: int, normalize: bool) -> tuple[jax.Array, jax.Array]:
    """The top-``k`` experts of each row and their weights (module docstring).

    Args:
        logits: router logits ``(N, E)``.
        k: experts per token.
        normalize: renormalise the ``k`` probabilities to sum to 1.

    Returns:
        ``(weights (N, k), experts (N, k) int32)``, largest first; the weights in
        float32 (float64 for float64 logits).
    """
    p = jax.nn.softmax(logits.astype(upcast_dtype(logits.dtype)), axis=-1)  # (N, E)
    top, experts = jax.lax.top_k(p, k)  # (N, k) each
    if normalize:
        top = top / jnp.sum(top, axis=-1, keepdims=True)
    return top, experts.astype(jnp.int32)


def _dense(w: Any) -> jax.Array:
    """A stacked expert weight ``(E, out, in)`` as an array (nodes folded)."""
    return jnp.asarray(to_dense(w))


def _grouped(
    x: jax.Array, w: Any, sizes: jax.Array, matmul_dtype: str | None
) -> jax.Array:
    """``x_r W_{g(r)}ᵀ`` for rows ``x: (M, in)`` sorted by group, ``w: (E, out, in)``.

    `jax.lax.ragged_dot` with ``sizes: (E,)`` rows per group; ``(M, out)`` in
    ``x``'s dtype (float32 accumulation with a low-precision ``matmul_dtype``).
    """
    wt = jnp.swapaxes(_dense(w), 1, 2)  # (E, in, out)
    if matmul_dtype is None:
        return jax.lax.ragged_dot(x, wt.astype(x.dtype), sizes)
    y = jax.lax.ragged_dot(
        x.astype(matmul_dtype),
        wt.astype(matmul_dtype),
        sizes,
        preferred_element_type=jnp.float32,
    )
    return y.astype(x.dtype)


def experts_mlp(
    x: jax.Array,
    weights: jax.Array,
    experts: jax.Array,
    w_gate: Any,
    w_up: Any,
    w_down: Any,
    *,
    activation: Callable[[jax.Array], jax.Array] = silu,
    matmul_dtype: str | None = None,
) -> jax.Array:
    """``Σ_{j<k} weights[n, j] · SwiGLU_{experts[n, j]}(x_n)``, chosen experts only.

    Args:
        x: tokens ``(N, D)``.
        weights: ``(N, k)`` routing weights (float32).
        experts: ``(N, k)`` expert ids in ``[0, E)``.
        w_gate: ``(E, I, D)`` (an array or a weight node).
        w_up: ``(E, I, D)``.
        w_down: ``(E, D, I)``.
        activation: the gate's activation (``silu``: SwiGLU).
        matmul_dtype: None, or the low-precision input dtype of the products.

    Returns:
        ``(N, D)`` in ``x``'s dtype.
    """
    k = experts.shape[1]
    num = logical_shape(w_gate)[0]
    flat = experts.reshape(-1)  # (N k,) slot s = n k + j
    order = jnp.argsort(flat, stable=True)  # (N k,) slots sorted by expert
    token = order // k  # (N k,) the token of each sorted slot
    sizes = jnp.bincount(flat, length=num).astype(jnp.int32)  # (E,)
    xs = x[token]  # (N k, D)
    g = _grouped(xs, w_gate, sizes, matmul_dtype)  # (N k, I)
    u = _grouped(xs, w_up, sizes, matmul_dtype)  # (N k, I)
    y = _grouped(activation(g) * u, w_down, sizes, matmul_dtype)  # (N k, D)
    w = weights.reshape(-1)[order]  # (N k,) float32
    y = (y.astype(w.dtype) * w[:, None]).astype(x.dtype)  # float32 product (Mixtral)
    return jnp.zeros_like(x).at[token].add(y)  # (N, D)


def sparse_moe(
    mp: Params,
    x: jax.Array,
    k: int,
    normalize: bool,
    *,
    matmul_dtype: str | None = None,
    activation: Callable[[jax.Array], jax.Array] = silu,
) -> tuple[jax.Array, jax.Array]:
    """One layer's MoE block of ``x: (..., D)``; returns ``(y (..., D), logits)``.

    ``mp`` holds ``gate.weight (E, D)`` (the router), ``experts.{gate,up,down}_proj
    .weight`` stacked ``(E, out, in)`` and optionally Qwen2-MoE's
    ``shared_expert.{gate,up,down}_proj.weight`` with ``shared_expert_gate.weight
    (1, D)``. ``logits: (N, E)`` are the router's (for `load_balancing_loss`).
    """
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])  # (N, D)
    logits = linear(x2, mp["gate"]["weight"], matmul_dtype=matmul_dtype)  # (N, E)
    weights, chosen = route(logits, k, normalize)  # (N, k) each
    ex = mp["experts"]
    y = experts_mlp(
        x2, weights, chosen,
        ex["gate_proj"]["weight"], ex["up_proj"]["weight"], ex["down_proj"]["weight"],
        activation=activation, matmul_dtype=matmul_dtype,
    )  # (N, D)  # fmt: skip
    if "shared_expert" in mp:
        sp = mp["shared_expert"]
        shared = gated_mlp(
            x2, sp["gate_proj"]["weight"], sp["up_proj"]["weight"],
            sp["down_proj"]["weight"], activation, matmul_dtype=matmul_dtype,
        )  # (N, D)  # fmt: skip
        gate = linear(x2, mp["shared_expert_gate"]["weight"], matmul_dtype=matmul_dtype)
        y = y + jax.nn.sigmoid(gate) * shared  # gate (N, 1)
    return y.reshape(shape), logits


def load_balancing_loss(
    logits: jax.Array, k: int, mask: jax.Array | None = None
) -> jax.Array:
    """Switch Transformer's auxiliary loss (Fedus et al. 2021, eqs. 4-6).

    As transformers' ``load_balancing_loss_func`` computes it.

    For router logits of all layers ``(L, N, E)`` with ``p = softmax(logits)``::

        f_e = (1 / (L N)) Σ_{l,n} #{j : top-k(p_ln)_j = e}      fraction of slots
        P_e = (1 / (L N)) Σ_{l,n} p_lne                         mean probability
        loss = E · Σ_e f_e P_e

    (``f`` counts the ``k`` slots of a token, so a perfectly balanced router gives
    ``k``.) ``mask: (N,)``, 1 for real tokens, restricts both sums to them.
    """
    num = logits.shape[-1]
    f32 = upcast_dtype(logits.dtype)
    p = jax.nn.softmax(logits.astype(f32), axis=-1)  # (L, N, E)
    _, chosen = jax.lax.top_k(p, k)  # (L, N, k)
    counts = jax.nn.one_hot(chosen, num, dtype=f32).sum(axis=-2)  # (L, N, E)
    n = logits.shape[-2]
    m = jnp.ones(n, f32) if mask is None else mask.reshape(-1).astype(f32)  # (N,)
    rows = m.sum() * logits.shape[0]
    f = jnp.einsum("lne,n->e", counts, m) / rows  # (E,)
    pe = jnp.einsum("lne,n->e", p, m) / rows  # (E,)
    return num * jnp.sum(f * pe)


__all__ = ["experts_mlp", "load_balancing_loss", "route", "sparse_moe"]
