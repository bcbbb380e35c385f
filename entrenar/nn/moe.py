"""The sparse mixture-of-experts MLP: a router picks ``k`` of ``E`` SwiGLU experts.

Shazeer et al., "Outrageously Large Neural Networks: The Sparsely-Gated
Mixture-of-Experts Layer", 2017 (top-k gating); Fedus et al., "Switch Transformers",
2021 (the load-balancing loss, `load_balancing_loss`); Jiang et al., "Mixtral of
Experts", 2024 (top-2 of 8 SwiGLU experts, renormalised). Qwen1.5/2-MoE add a shared
expert behind a sigmoid gate; Qwen3-MoE is Mixtral's block with ``norm_topk_prob``.
gpt-oss (OpenAI, 2025) adds biases to the router and to every expert projection,
and its experts apply a clamped SwiGLU (`clamped_swiglu`).

For a token ``x: (D,)`` of a layer with router ``W_r: (E, D)`` and experts
``W_gate^e, W_up^e: (I, D)``, ``W_down^e: (D, I)``::

    z = x W_rᵀ (+ b_r: gpt-oss)         (E,)   router logits, in the compute dtype
    p = softmax(z)                      (E,)   in float32
    S = top-k(p)                               the k largest, ties to the lower index
    w_e = p_e / Σ_{j∈S} p_j  (renormalised: Mixtral; Qwen's norm_topk_prob)
          p_e                (otherwise)
    y = Σ_{e∈S} w_e · (silu(x W_gate^eᵀ) ⊙ x W_up^eᵀ) W_down^eᵀ
      + σ(x W_sgᵀ) · SwiGLU_shared(x)      (Qwen2-MoE's shared expert, W_sg: (1, D))

gpt-oss takes the top ``k`` logits and a softmax over them, which is the
renormalised ``w_e`` above (``softmax(z)_e / Σ_{j∈S} softmax(z)_j``).

Only the chosen experts are computed: the ``N k`` (token, expert) slots are sorted
by expert and each projection is one grouped matmul, `jax.lax.ragged_dot`, over the
sorted ``(N k, D)`` rows with the ``(E,)`` group sizes, never an ``(N, E, ...)``
tensor. (On TPU that is a grouped-GEMM kernel; XLA:CPU in jax 0.10.2 lowers
``ragged_dot`` to one masked dot per group, so the CPU's FLOPs still grow with
``E``: specs/models.md, "Mixture of experts".) The weights of a layer are stacked
``(E, out, in)``, those of the model ``(L, E, out, in)``, so the layer scan stays
one scan.

Mixtral's ``router_jitter_noise`` ``j`` (`router_jitter`): while training,
transformers multiplies the block's input by noise ``u ~ U(1 - j, 1 + j)``, drawn
for every value, before both the router and the experts see it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from entrenar.nn.layers import gated_mlp, silu, upcast_dtype
from entrenar.nn.linear import linear
from entrenar.nn.weight_node import is_weight_node, to_dense
from entrenar.types import Params


def router_jitter(x: jax.Array, noise: float, key: Any) -> jax.Array:
    """``x ⊙ u``, ``u ~ U(1 - noise, 1 + noise)`` for each value of ``x: (..., D)``.

    Mixtral's training-time jitter (transformers' ``MixtralSparseMoeBlock``:
    ``hidden_states *= empty_like(hidden_states).uniform_(1 - j, 1 + j)``, then
    the router and the experts read the product). ``key`` None or ``noise`` 0:
    ``x`` unchanged (evaluation).

    >>> x = jnp.ones((2, 3))
    >>> bool(jnp.all(router_jitter(x, 0.1, None) == x))
    True
    >>> y = router_jitter(x, 0.1, jax.random.key(0))
    >>> bool(jnp.all((0.9 <= y) & (y <= 1.1)))
    True
    """
    if key is None or noise == 0:
        return x
    f = upcast_dtype(x.dtype)
    u = jax.random.uniform(key, x.shape, f, 1.0 - noise, 1.0 + noise)
    return (x.astype(f) * u).astype(x.dtype)


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


def clamped_swiglu(
    g: jax.Array, u: jax.Array, limit: float, alpha: float = 1.702
) -> jax.Array:
    """gpt-oss's expert activation of gate ``g`` and up ``u`` projections.

    As transformers' ``GptOssExperts._apply_gate`` (and OpenAI's reference)::

        g' = min(g, limit)
        u' = clip(u, -limit, limit)
        h  = (u' + 1) · g' σ(α g')          (α = 1.702: the sigmoid form of GELU)

    Returns ``h`` in ``g``'s dtype (the gradient of a clamped value is 0 beyond the
    limit, as torch's ``clamp``).
    """
    lim = jnp.asarray(limit, g.dtype)
    g = jnp.minimum(g, lim)
    u = jnp.clip(u, -lim, lim)
    glu = g * jax.nn.sigmoid(g * jnp.asarray(alpha, g.dtype))
    return (u + 1) * glu


def _dense(w: Any) -> jax.Array:
    """A stacked expert weight ``(E, out, in)`` as an array (nodes folded)."""
    return jnp.asarray(to_dense(w))


def tile_rows(m: int, groups: int) -> int:
    """Rows per tile of `tiled_grouped_matmul`: about the mean rows per group.

    A power of two in ``[8, 256]``: the tiles hold ``M + E C / 2`` rows on average
    (each group's last tile is part empty), at most ``M + E C``.
    """
    mean = max(1, m // max(groups, 1))
    return int(min(256, max(8, 1 << (mean - 1).bit_length())))


def _tiles(
    sizes: jax.Array, c: int, count: int
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Each tile's ``(group, first row, rows)``: ``count`` tiles of ``c`` rows.

    Group ``e``'s rows ``[o_e, o_e + n_e)`` (sorted rows, ``o`` the exclusive
    cumulative sizes) are cut into ``ceil(n_e / c)`` tiles; tiles past the last
    group's hold 0 rows.
    """
    sizes = sizes.astype(jnp.int32)
    ends = jnp.cumsum(sizes)  # (E,)
    starts = ends - sizes
    per = (sizes + c - 1) // c  # (E,) tiles of each group
    tile_end = jnp.cumsum(per)  # (E,)
    t = jnp.arange(count, dtype=jnp.int32)  # (T,)
    group = jnp.minimum(
        jnp.searchsorted(tile_end, t, side="right"), sizes.shape[0] - 1
    ).astype(jnp.int32)  # (T,)
    j = t - (tile_end - per)[group]  # the tile's index within its group
    first = starts[group] + j * c  # (T,)
    rows = jnp.clip(ends[group] - first, 0, c)
    rows = jnp.where(t < tile_end[-1], rows, 0)
    return group, first, rows


def _tile_scan(
    x: jax.Array, w: jax.Array, sizes: jax.Array, c: int, dtype: Any
) -> jax.Array:
    """``y_r = x_r w_{g(r)}`` tile by tile: ``x (M, in)``, ``w (E, in, out)``."""
    m, out = x.shape[0], w.shape[-1]
    count = -(-m // c) + w.shape[0]
    group, first, rows = _tiles(sizes, c, count)
    xp = jnp.pad(x, ((0, c), (0, 0)))  # (M + C, in): a tile never leaves the rows
    y0 = jnp.zeros((m + c, out), dtype)

    def tile(y: jax.Array, t: Any) -> tuple[jax.Array, None]:
        g, f, n = t
        xt = jax.lax.dynamic_slice_in_dim(xp, f, c)  # (C, in)
        keep = (jnp.arange(c, dtype=jnp.int32) < n)[:, None]
        yt = jnp.dot(xt, w[g], preferred_element_type=dtype)  # (C, out), accumulated
        old = jax.lax.dynamic_slice_in_dim(y, f, c)
        return jax.lax.dynamic_update_slice_in_dim(
            y, jnp.where(keep, yt, old), f, 0
        ), None

    y, _ = jax.lax.scan(tile, y0, (group, first, rows))
    return y[:m]


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def tiled_grouped_matmul(
    x: jax.Array, w: jax.Array, sizes: jax.Array, c: int
) -> jax.Array:
    """``y_r = x_r w_{g(r)}`` for rows sorted by group: a grouped matmul.

    ``x: (M, in)`` sorted by group, ``w: (E, in, out)``, ``sizes: (E,)`` rows per
    group summing to ``M`` (as `jax.lax.ragged_dot`). A `jax.lax.scan` over tiles
    of ``c`` rows, each within one group, multiplies each tile by its group's
    weight: ``(M + E c) in out`` multiply-adds at most and ``(c, out)`` temporaries,
    whatever ``E`` (XLA:CPU lowers ``ragged_dot`` to ``E`` dense products of all
    ``M`` rows, so its FLOPs and temporaries grow with ``E``). The backward pass
    is the same scan: ``dx`` tile by tile, ``dw[g] += x_tileᵀ g_tile``.
    Returns ``(M, out)``, accumulated and returned in float32 (float64 for
    float64 inputs).
    """
    return _tile_scan(x, w, sizes, c, _acc(x, w))


def _acc(x: jax.Array, w: jax.Array) -> Any:
    """The accumulation dtype of ``x w``: float32, or float64."""
    dtype = jnp.result_type(x, w)
    return dtype if jnp.finfo(dtype).bits >= 32 else jnp.dtype(jnp.float32)


def _tgm_fwd(x: jax.Array, w: jax.Array, sizes: jax.Array, c: int) -> Any:
    return tiled_grouped_matmul(x, w, sizes, c), (x, w, sizes)


def _tgm_bwd(c: int, res: Any, g: jax.Array) -> Any:
    x, w, sizes = res
    m = x.shape[0]
    count = -(-m // c) + w.shape[0]
    group, first, rows = _tiles(sizes, c, count)
    acc = _acc(x, w)
    xp = jnp.pad(x, ((0, c), (0, 0)))  # (M + C, in)
    gp = jnp.pad(g, ((0, c), (0, 0))).astype(w.dtype)  # (M + C, out), w's dtype
    dx0 = jnp.zeros(xp.shape, acc)
    dw0 = jnp.zeros(w.shape, acc)

    def tile(carry: Any, t: Any) -> tuple[Any, None]:
        dx, dw = carry
        gi, f, n = t
        keep = (jnp.arange(c, dtype=jnp.int32) < n)[:, None]
        zero = jnp.zeros((), x.dtype)
        xt = jnp.where(keep, jax.lax.dynamic_slice_in_dim(xp, f, c), zero)  # (C, in)
        gt = jnp.where(keep, jax.lax.dynamic_slice_in_dim(gp, f, c), zero.astype(
            gp.dtype))  # (C, out)  # fmt: skip
        dxt = jnp.dot(gt, w[gi].T, preferred_element_type=acc)  # (C, in)
        old = jax.lax.dynamic_slice_in_dim(dx, f, c)
        dx = jax.lax.dynamic_update_slice_in_dim(dx, jnp.where(keep, dxt, old), f, 0)
        dw = dw.at[gi].add(jnp.dot(xt.T, gt, preferred_element_type=dw.dtype))
        return (dx, dw), None

    (dx, dw), _ = jax.lax.scan(tile, (dx0, dw0), (group, first, rows))
    return dx[:m].astype(x.dtype), dw.astype(w.dtype), None


tiled_grouped_matmul.defvjp(_tgm_fwd, _tgm_bwd)


def tiled_grouped_nodes(
    x: jax.Array, w: Any, sizes: jax.Array, c: int, num: int, lo: Any
) -> jax.Array:
    """`tiled_grouped_matmul` of a weight node ``w`` (E, out, in), expert by expert.

    Each tile makes only its expert's ``(out, in)`` dense (``to_dense`` of the
    node's leaves at index ``g``: a LoRA adapter folded, an NF4 block dequantized),
    never the ``(E, out, in)`` stack; the tile is rematerialised in the backward
    pass (`jax.checkpoint`), so autodiff keeps no weight per tile, and the
    gradients of the node's float leaves (LoRA's A, B) are accumulated by the
    scan's transpose. ``lo``: the products' input dtype; float32 accumulation.
    Returns ``(M, out)``.
    """
    m = x.shape[0]
    count = -(-m // c) + num
    group, first, rows = _tiles(sizes, c, count)
    xp = jnp.pad(x, ((0, c), (0, 0)))  # (M + C, in)
    acc = _acc(x, x)

    @jax.checkpoint
    def tile(_: None, t: Any) -> tuple[None, jax.Array]:
        g, f, n = t
        xt = jax.lax.dynamic_slice_in_dim(xp, f, c).astype(lo)  # (C, in)
        wg = jnp.asarray(to_dense(jax.tree_util.tree_map(lambda a: a[g], w)))
        yt = jax.lax.dot_general(
            xt, wg.astype(lo), (((1,), (1,)), ((), ())), preferred_element_type=acc
        )  # (C, out): x Wᵀ
        keep = (jnp.arange(c, dtype=jnp.int32) < n)[:, None]
        return None, jnp.where(keep, yt, jnp.zeros((), acc))

    _, ys = jax.lax.scan(tile, None, (group, first, rows))  # (T, C, out)
    at = first[:, None] + jnp.arange(c, dtype=jnp.int32)[None, :]  # (T, C) rows
    at = jnp.where(jnp.arange(c, dtype=jnp.int32)[None, :] < rows[:, None], at, m)
    y = jnp.zeros((m + 1, ys.shape[-1]), acc)  # row m: the empty slots' sink
    return y.at[at.reshape(-1)].add(ys.reshape(-1, ys.shape[-1]))[:m]


GROUPED_IMPLS = ("tiles", "ragged_dot")
"""How `experts_mlp` multiplies the sorted slots: `tiled_grouped_matmul`
(default) or `jax.lax.ragged_dot` (TPUs' grouped-matmul kernel)."""


def _grouped(
    x: jax.Array,
    w: Any,
    sizes: jax.Array,
    matmul_dtype: str | None,
    impl: str,
    num: int,
) -> jax.Array:
    """``x_r W_{g(r)}ᵀ`` for rows ``x: (M, in)`` sorted by group, ``w: (E, out, in)``.

    ``sizes: (E,)`` rows per group; ``(M, out)`` in ``x``'s dtype (float32
    accumulation with a low-precision ``matmul_dtype``).
    """
    lo = x.dtype if matmul_dtype is None else jnp.dtype(matmul_dtype)
    if impl == "tiles" and is_weight_node(w):  # one expert made dense at a time
        c = tile_rows(x.shape[0], num)
        return tiled_grouped_nodes(x, w, sizes, c, num, lo).astype(x.dtype)
    wt = jnp.swapaxes(_dense(w), 1, 2)  # (E, in, out)
    xl, wl = x.astype(lo), wt.astype(lo)
    if impl == "ragged_dot":
        acc = None if matmul_dtype is None else jnp.float32
        y = jax.lax.ragged_dot(xl, wl, sizes, preferred_element_type=acc)
    else:
        y = tiled_grouped_matmul(xl, wl, sizes, tile_rows(x.shape[0], num))
    return y.astype(x.dtype)


def experts_mlp(
    x: jax.Array,
    weights: jax.Array,
    experts: jax.Array,
    num: int,
    w_gate: Any,
    w_up: Any,
    w_down: Any,
    *,
    activation: Callable[[jax.Array], jax.Array] = silu,
    matmul_dtype: str | None = None,
    impl: str = "tiles",
    biases: tuple[Any, Any, Any] | None = None,
    glu: Callable[[jax.Array, jax.Array], jax.Array] | None = None,
) -> jax.Array:
    """``Σ_{j<k} weights[n, j] · SwiGLU_{experts[n, j]}(x_n)``, chosen experts only.

    Args:
        x: tokens ``(N, D)``.
        weights: ``(N, k)`` routing weights (float32).
        experts: ``(N, k)`` expert ids in ``[0, E)``.
        num: ``E``.
        w_gate: ``(E, I, D)`` (an array or a weight node).
        w_up: ``(E, I, D)``.
        w_down: ``(E, D, I)``.
        activation: the gate's activation (``silu``: SwiGLU).
        matmul_dtype: None, or the low-precision input dtype of the products.
        impl: one of `GROUPED_IMPLS`.
        biases: None, or the experts' ``(E, I)``, ``(E, I)``, ``(E, D)`` biases of
            gate, up and down (gpt-oss): each slot adds its expert's.
        glu: None (``activation(g) * u``), or ``glu(g, u)`` (`clamped_swiglu`).

    Returns:
        ``(N, D)`` in ``x``'s dtype.
    """
    k = experts.shape[1]
    flat = experts.reshape(-1)  # (N k,) slot s = n k + j
    order = jnp.argsort(flat, stable=True)  # (N k,) slots sorted by expert
    token = order // k  # (N k,) the token of each sorted slot
    sizes = jnp.bincount(flat, length=num).astype(jnp.int32)  # (E,)
    xs = x[token]  # (N k, D)
    g = _grouped(xs, w_gate, sizes, matmul_dtype, impl, num)  # (N k, I)
    u = _grouped(xs, w_up, sizes, matmul_dtype, impl, num)  # (N k, I)
    slot_expert = flat[order]  # (N k,) the expert of each sorted slot
    if biases is not None:
        g = g + jnp.asarray(biases[0])[slot_expert].astype(g.dtype)
        u = u + jnp.asarray(biases[1])[slot_expert].astype(u.dtype)
    h = activation(g) * u if glu is None else glu(g, u)
    y = _grouped(h, w_down, sizes, matmul_dtype, impl, num)  # (N k, D)
    if biases is not None:
        y = y + jnp.asarray(biases[2])[slot_expert].astype(y.dtype)
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
    impl: str = "tiles",
    glu: Callable[[jax.Array, jax.Array], jax.Array] | None = None,
) -> tuple[jax.Array, jax.Array]:
    """One layer's MoE block of ``x: (..., D)``; returns ``(y (..., D), logits)``.

    ``mp`` holds ``gate.weight (E, D)`` (the router), ``experts.{gate,up,down}_proj
    .weight`` stacked ``(E, out, in)`` and optionally Qwen2-MoE's
    ``shared_expert.{gate,up,down}_proj.weight`` with ``shared_expert_gate.weight
    (1, D)``; gpt-oss adds ``gate.bias (E,)`` and the experts' ``bias (E, out)``.
    ``logits: (N, E)`` are the router's (for `load_balancing_loss`). ``glu``: as
    `experts_mlp`.
    """
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])  # (N, D)
    router = mp["gate"]
    logits = linear(x2, router["weight"], router.get("bias"),
                    matmul_dtype=matmul_dtype)  # (N, E)  # fmt: skip
    weights, chosen = route(logits, k, normalize)  # (N, k) each
    ex = mp["experts"]
    biases = None
    if "bias" in ex["gate_proj"]:  # gpt-oss
        biases = tuple(ex[p]["bias"] for p in ("gate_proj", "up_proj", "down_proj"))
    y = experts_mlp(
        x2, weights, chosen, logits.shape[-1],
        ex["gate_proj"]["weight"], ex["up_proj"]["weight"], ex["down_proj"]["weight"],
        activation=activation, matmul_dtype=matmul_dtype, impl=impl, biases=biases,
        glu=glu,
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


__all__ = [
    "GROUPED_IMPLS",
    "clamped_swiglu",
    "experts_mlp",
    "load_balancing_loss",
    "route",
    "router_jitter",
    "sparse_moe",
    "tile_rows",
    "tiled_grouped_matmul",
    "tiled_grouped_nodes",
]
