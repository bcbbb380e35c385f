"""The merge math for one leaf, jitted: trim, drop, elect, combine, interpolate.

Every function here works on one leaf laid out as ``(L, m)``: ``L`` layers (1 for a
leaf that is not stacked) of ``m`` values each, flattened. The layer axis is mapped
with `jax.vmap`, so TIES trims and SLERP measures its angle per layer, as mergekit
does on its per-layer tensors. Parameters arrive as arrays, one row per layer
(``(L, n)`` for ``n`` models), so per-layer schedules cost no recompilation; only
the shapes and the static flags (``trim``, ``elect``, ``normalize``, ``drop``,
``rescale``) select a program. Arithmetic is float32 (float64 for float64 inputs);
callers cast the result. specs/merging.md states each step.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

DOT_THRESHOLD = 0.9995
"""``|cos θ|`` above which SLERP falls back to linear interpolation (mergekit's)."""
NORM_EPS = 1e-8
"""Norm at or below which a tensor counts as zero (SLERP then interpolates linearly)."""


def compute_dtype(*dtypes: jnp.dtype) -> jnp.dtype:
    """float64 if any input is float64 (and x64 is on), else float32."""
    wide = any(jnp.dtype(d) == jnp.float64 for d in dtypes)
    x64 = bool(jax.config.read("jax_enable_x64"))
    return jnp.dtype(jnp.float64 if wide and x64 else "float32")


def trim_top_k(delta: jax.Array, k: jax.Array) -> jax.Array:
    """Keep each row's ``k`` largest magnitudes (ties at the threshold kept).

    The k-th largest ``|delta|`` is found exactly without sorting: the bit patterns
    of non-negative floats order like the floats, so the largest pattern ``T`` with
    ``#{|delta| >= T} >= k`` is built bit by bit from the top (one counting pass per
    bit, 31 for float32: several times faster than a sort on XLA:CPU).

    Args:
        delta: ``(n, m)`` float32 task vectors of one layer.
        k: ``(n,)`` int32, values to keep per row (0 keeps none).

    Returns:
        ``(n, m)``: ``delta`` where ``|delta| >= `` the row's k-th largest ``|delta|``,
        else 0 (TIES step 1, Yadav et al. 2023).
    """
    wide = delta.dtype == jnp.float64
    itype = jnp.int64 if wide else jnp.int32
    bits = jax.lax.bitcast_convert_type(jnp.abs(delta), itype)  # (n, m), monotone
    one = jnp.asarray(1, itype)

    def step(i: jax.Array, t: jax.Array) -> jax.Array:
        cand = t | jnp.left_shift(one, (bits.dtype.itemsize * 8 - 2 - i).astype(itype))
        count = jnp.sum(bits >= cand[:, None], axis=-1)  # (n,)
        return jnp.where(count >= k, cand, t)

    top = bits.dtype.itemsize * 8 - 1  # every bit below the sign bit
    t = jax.lax.fori_loop(0, top, step, jnp.zeros(delta.shape[0], itype))  # (n,)
    keep = (bits >= t[:, None]) & (k[:, None] > 0)
    return jnp.where(keep, delta, jnp.zeros_like(delta))


def combine(
    delta: jax.Array, w: jax.Array, *, elect: bool, normalize: bool
) -> jax.Array:
    """Merge the task vectors of one layer into one.

    With ``elect`` (TIES steps 2-3) the weighted vectors ``w_i δ_i`` vote: the
    elected sign is ``+1`` where ``Σ_i w_i δ_i >= 0`` else ``-1``; only entries whose
    ``sign(w_i δ_i)`` equals it are summed, and ``normalize`` divides by the sum of
    their weights (the disjoint mean; 1 where none agree). Without ``elect`` it is
    ``Σ_i w_i δ_i``, divided by ``Σ_i w_i`` when ``normalize`` (1 where
    ``|Σ w| < 1e-8``).

    Args:
        delta: ``(n, m)`` task vectors.
        w: ``(n,)`` weights.
        elect: TIES sign election and disjoint merge.
        normalize: divide by the (agreeing) weights' sum.

    Returns:
        ``(m,)`` merged task vector.
    """
    wd = w[:, None] * delta  # (n, m)
    if elect:
        sign = jnp.where(jnp.sum(wd, axis=0) >= 0, 1, -1).astype(wd.dtype)  # (m,)
        agree = jnp.sign(wd) == sign  # (n, m)
        total = jnp.sum(jnp.where(agree, wd, 0), axis=0)  # (m,)
        if normalize:
            div = jnp.sum(jnp.where(agree, w[:, None], 0), axis=0)  # (m,)
            total = total / jnp.where(div == 0, 1, div)
        return total
    total = jnp.sum(wd, axis=0)  # (m,)
    if normalize:
        div = jnp.sum(w)
        total = total / jnp.where(jnp.abs(div) < 1e-8, 1, div)
    return total


@functools.partial(
    jax.jit, static_argnames=("trim", "elect", "normalize", "drop", "rescale")
)
def merged_task_vector(
    base: jax.Array,
    thetas: tuple[jax.Array, ...],
    w: jax.Array,
    k: jax.Array,
    keep: jax.Array,
    keys: jax.Array,
    *,
    trim: bool,
    elect: bool,
    normalize: bool,
    drop: bool,
    rescale: bool,
) -> jax.Array:
    """``combine(sparsify(θ_i - base))`` for one leaf: the merged task vector.

    It does not depend on λ, so a search over λ computes it once per setting of
    the other values (`entrenar.merge.search`); `scaled_sum` adds it to the base.

    Args:
        base: ``(L, m)`` the base model's leaf.
        thetas: ``n`` arrays ``(L, m)``, the fine-tuned models' leaves (stacked
            inside the program, so no stacked copy is made outside it).
        w: ``(L, n)`` weights.
        k: ``(L, n)`` int32 values kept by the TIES trim (used when ``trim``).
        keep: ``(L, n)`` DARE keep probabilities ``1 - p`` (used when ``drop``).
        keys: ``(n,)`` typed PRNG keys, one per model (used when ``drop``).
        trim: TIES magnitude trim.
        elect: TIES sign election and disjoint merge.
        normalize: see `combine`.
        drop: DARE random drop.
        rescale: DARE rescale of the kept values by ``1 / (1 - p)``.

    Returns:
        ``(L, m)`` merged task vector in the compute dtype.
    """
    dt = compute_dtype(base.dtype, *(t.dtype for t in thetas))
    b = base.astype(dt)  # (L, m)
    delta = jnp.stack([t.astype(dt) - b for t in thetas])  # (n, L, m)
    if drop:
        p_keep = jnp.transpose(keep).astype(dt)[:, :, None]  # (n, L, 1)

        def one(key: jax.Array, p: jax.Array) -> jax.Array:
            return jax.random.bernoulli(key, p, delta.shape[1:])  # (L, m)

        kept = jax.vmap(one)(keys, p_keep)  # (n, L, m)
        scaled = delta / p_keep if rescale else delta
        delta = jnp.where(kept, scaled, jnp.zeros_like(delta))

    def layer(d: jax.Array, wl: jax.Array, kl: jax.Array) -> jax.Array:
        if trim:
            d = trim_top_k(d, kl)
        return combine(d, wl.astype(dt), elect=elect, normalize=normalize)

    return jax.vmap(layer, in_axes=(1, 0, 0))(delta, w, k)  # (L, m), per layer


@jax.jit
def scaled_sum(base: jax.Array, merged: jax.Array, lam: jax.Array) -> jax.Array:
    """``base + λ · merged`` per layer: ``(L, m)``, ``(L, m)``, ``(L,)`` -> ``(L, m)``.

    In ``merged``'s dtype (the compute dtype of `merged_task_vector`).
    """
    dt = merged.dtype
    return base.astype(dt) + lam.astype(dt)[:, None] * merged


def task_vectors_leaf(
    base: jax.Array,
    thetas: tuple[jax.Array, ...],
    w: jax.Array,
    k: jax.Array,
    keep: jax.Array,
    keys: jax.Array,
    lam: jax.Array,
    **flags: bool,
) -> jax.Array:
    """``base + λ · combine(sparsify(θ_i - base))`` for one leaf.

    `merged_task_vector` (its arguments and static ``flags``: ``trim``, ``elect``,
    ``normalize``, ``drop``, ``rescale``) then `scaled_sum` with ``lam: (L,)``;
    two programs, so a merge and a search's reuse of the task vector for another
    λ give the same bits.
    """
    merged = merged_task_vector(base, thetas, w, k, keep, keys, **flags)
    return scaled_sum(base, merged, lam)


@functools.partial(jax.jit, static_argnames=("normalize",))
def linear_leaf(thetas: jax.Array, w: jax.Array, *, normalize: bool) -> jax.Array:
    """``Σ_i w_i θ_i`` (divided by ``Σ_i w_i`` when ``normalize``) for one leaf.

    Args:
        thetas: ``(n, L, m)``.
        w: ``(L, n)`` weights (their per-layer sums are nonzero when normalizing).
        normalize: divide by the weights' sum.

    Returns:
        ``(L, m)``.
    """
    dt = compute_dtype(thetas.dtype)
    wt = jnp.transpose(w).astype(dt)  # (n, L)
    total = jnp.sum(wt[:, :, None] * thetas.astype(dt), axis=0)  # (L, m)
    if normalize:
        total = total / jnp.sum(wt, axis=0)[:, None]
    return total


def slerp_layer(a: jax.Array, b: jax.Array, t: jax.Array) -> jax.Array:
    """Spherical interpolation of two flattened tensors ``a, b: (m,)`` at ``t``.

    ``cos θ = â · b̂`` with ``x̂ = x / ‖x‖``; the result is
    ``sin((1-t)θ)/sin θ · a + sin(tθ)/sin θ · b``, or ``(1-t) a + t b`` when
    ``|cos θ| > 0.9995`` (nearly colinear) or a norm is ``<= 1e-8``.
    """
    na = jnp.linalg.norm(a)
    nb = jnp.linalg.norm(b)
    small = (na <= NORM_EPS) | (nb <= NORM_EPS)
    unit_a = a / jnp.where(small, 1, na)
    unit_b = b / jnp.where(small, 1, nb)
    dot = jnp.clip(jnp.sum(unit_a * unit_b), -1, 1)
    flat = small | (jnp.abs(dot) > DOT_THRESHOLD)
    theta = jnp.arccos(jnp.where(flat, 0, dot))
    sin = jnp.where(flat, 1, jnp.sin(theta))
    ca = jnp.where(flat, 1 - t, jnp.sin((1 - t) * theta) / sin)
    cb = jnp.where(flat, t, jnp.sin(t * theta) / sin)
    return ca * a + cb * b


@jax.jit
def slerp_leaf(a: jax.Array, b: jax.Array, t: jax.Array) -> jax.Array:
    """`slerp_layer` per layer: ``a, b: (L, m)``, ``t: (L,)`` -> ``(L, m)``."""
    dt = compute_dtype(a.dtype, b.dtype)
    return jax.vmap(slerp_layer)(a.astype(dt), b.astype(dt), t.astype(dt))


__all__ = [
    "DOT_THRESHOLD",
    "NORM_EPS",
    "combine",
    "compute_dtype",
    "linear_leaf",
    "merged_task_vector",
    "scaled_sum",
    "slerp_layer",
    "slerp_leaf",
    "task_vectors_leaf",
    "trim_top_k",
]
