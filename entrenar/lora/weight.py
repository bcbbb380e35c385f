"""`LoRAWeight`: a frozen weight plus a trainable low-rank update, as one pytree node.

The node stands where a weight ``W: (out, in)`` stood in a parameter tree. Its product
with an input is registered on `entrenar.nn.weight_matmul`, so every layer that calls
`entrenar.nn.linear` computes (Hu et al. 2021, "LoRA", arXiv:2106.09685)

    y = x Wᵀ + s · (drop(x) Aᵀ) Bᵀ,    A: (r, in),  B: (out, r)

with ``s = alpha / r`` (or ``alpha / sqrt(r)`` for rsLoRA, Kalajdzievski 2023,
arXiv:2312.03732), without ever forming ``W + s B A``. ``W`` is computed through
``weight_matmul(base, x)``, so a quantized base (``entrenar.quant.QuantizedWeight``)
gives QLoRA (Dettmers et al. 2023, arXiv:2305.14314).

With a ``magnitude`` vector ``m: (out,)`` the node is DoRA (Liu et al. 2024,
"DoRA: Weight-Decomposed Low-Rank Adaptation", arXiv:2402.09353; PEFT's
``use_dora``):

    y = (m / n) ⊙ (x Wᵀ + s · (x Aᵀ) Bᵀ),   n = ‖W + s B A‖ per output row (out,)

where ``n`` is treated as a constant in the backward pass (``stop_gradient``: the
paper's section 4.3, as PEFT 0.21 computes it), so ``A``, ``B`` and ``m`` get
PEFT's gradients. ``n`` needs the dense ``W`` of one layer: it is formed inside
the matmul, so under `jax.lax.scan` a stacked (or quantized) base is densified one
layer at a time. With dropout active PEFT's training forward is

    y = x Wᵀ + (m/n - 1) ⊙ drop(x) Wᵀ + (m/n) ⊙ s · (drop(x) Aᵀ) Bᵀ

(one more base product), which equals the formula above when nothing is dropped.

Leading axes are allowed on every child (stacked layers: ``base (L, out, in)``,
``a (L, r, in)``, ``b (L, out, r)``, ``magnitude (L, out)``, ``dropout_key (L, 2)``),
so `jax.lax.scan` slices a stacked node per layer like any array. ``alpha``,
``rank``, ``rslora`` and ``dropout`` are static (auxiliary data): changing them
recompiles, they are never traced.

Per-layer ranks (PEFT's ``rank_pattern`` / ``alpha_pattern`` by layer): the layers of
a stack hold ``A``, ``B`` padded with zeros to the stack's largest rank ``R``
(``A[i, r_i:] = 0``, ``B[i, :, r_i:] = 0``), so ``B_i A_i`` is the real rank-``r_i``
product and the padded entries get zero gradients (specs/lora.md, "Per-layer
ranks"); the real ``r_i`` and ``alpha_i`` are static (``layer_ranks``,
``layer_alphas``), and each layer's ``s_i`` is the child ``layer_scale (*lead,)``,
which `jax.lax.scan` slices with the layer.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from entrenar.nn.layers import dropout
from entrenar.nn.linear import weight_matmul
from entrenar.nn.weight_node import (
    STATIC,
    logical_dtype,
    logical_shape,
    register_weight_node,
    to_dense,
)


@register_weight_node
@dataclasses.dataclass(frozen=True, eq=False)
class LoRAWeight:
    """A frozen ``base`` weight with a low-rank adapter ``s · B A``.

    Attributes:
        base: the frozen weight ``(*lead, out, in)``: an array or any weight node
            registered on `entrenar.nn.weight_matmul` (e.g. ``QuantizedWeight``).
        a: ``(*lead, r, in)`` down-projection (PEFT's ``lora_A.weight``; pytree key
            ``lora_A``).
        b: ``(*lead, out, r)`` up-projection (PEFT's ``lora_B.weight``; pytree key
            ``lora_B``), zero at init.
        alpha: LoRA alpha (static; with per-layer ranks the largest ``alpha_i``).
        rank: r (static; with per-layer ranks ``R``, the largest ``r_i``: the
            shape of ``a`` and ``b``).
        rslora: scale ``alpha / sqrt(r)`` instead of ``alpha / r`` (static).
        dropout: dropout rate on the adapter's input (static). Dropout acts only
            while ``dropout_key`` is set (see `entrenar.lora.with_dropout_keys`);
            with ``dropout_key=None`` the forward is deterministic (evaluation).
        dropout_key: raw ``uint32`` key data ``(*lead, 2)`` or ``None``.
        magnitude: DoRA's ``m (*lead, out)`` (PEFT's ``lora_magnitude_vector``;
            `entrenar.lora.apply` starts it at ``‖W‖`` per output row), trainable;
            ``None`` for plain LoRA.
        layer_scale: per-layer ranks only: each layer's ``s_i (*lead,)`` float32
            (frozen: `entrenar.lora.split` puts it in the frozen half).
        layer_ranks: per-layer ranks only: each layer's real ``r_i`` (static,
            flattened over the leading axes); ``None``: every layer has ``rank``.
        layer_alphas: per-layer ranks only: each layer's ``alpha_i`` (static).

    Children may be ``None`` (or masks, gradients, optimizer moments): the node is
    also the container of `entrenar.lora.split`'s halves and of gradient trees.
    """

    base: Any
    a: Any = dataclasses.field(metadata={"key": "lora_A"})
    b: Any = dataclasses.field(metadata={"key": "lora_B"})
    alpha: float = dataclasses.field(metadata=STATIC)
    rank: int = dataclasses.field(metadata=STATIC)
    rslora: bool = dataclasses.field(default=False, kw_only=True, metadata=STATIC)
    dropout: float = dataclasses.field(default=0.0, kw_only=True, metadata=STATIC)
    dropout_key: Any = dataclasses.field(default=None, kw_only=True)
    magnitude: Any = dataclasses.field(
        default=None, kw_only=True, metadata={"key": "lora_magnitude_vector"}
    )
    layer_scale: Any = dataclasses.field(default=None, kw_only=True)
    layer_ranks: tuple[int, ...] | None = dataclasses.field(
        default=None, kw_only=True, metadata=STATIC
    )
    layer_alphas: tuple[float, ...] | None = dataclasses.field(
        default=None, kw_only=True, metadata=STATIC
    )

    def __post_init__(self) -> None:
        casts = {"alpha": float, "rank": int, "rslora": bool, "dropout": float}
        for name, cast in casts.items():
            object.__setattr__(self, name, cast(getattr(self, name)))
        if self.layer_ranks is not None:
            object.__setattr__(self, "layer_ranks", tuple(map(int, self.layer_ranks)))
        if self.layer_alphas is not None:
            alphas = tuple(map(float, self.layer_alphas))
            object.__setattr__(self, "layer_alphas", alphas)

    @property
    def per_layer(self) -> bool:
        """Whether the layers of the stack have their own ranks and alphas."""
        return self.layer_ranks is not None

    @property
    def scale(self) -> Any:
        """``alpha / r``, or ``alpha / sqrt(r)`` with rsLoRA.

        With per-layer ranks: each layer's ``s_i`` as an array ``(*lead, 1, 1)``,
        which broadcasts against ``B A (*lead, out, in)`` and ``B (*lead, out, r)``.
        """
        if not self.per_layer:
            return self.alpha / (math.sqrt(self.rank) if self.rslora else self.rank)
        if self.layer_scale is not None:
            return jnp.asarray(self.layer_scale)[..., None, None]
        lead = tuple((self.a if self.a is not None else self.b).shape[:-2])
        return layer_scales(self)[0].reshape(*lead, 1, 1)

    def real_ranks(self) -> tuple[int, ...]:
        """The rank of each layer (flattened leading axes): ``rank`` if uniform."""
        if self.per_layer:
            return self.layer_ranks  # type: ignore[return-value]
        ref = self.a if self.a is not None else self.b
        return (self.rank,) * int(np.prod(tuple(ref.shape[:-2]), dtype=int))

    def real_alphas(self) -> tuple[float, ...]:
        """The alpha of each layer (flattened leading axes)."""
        if self.per_layer:
            return self.layer_alphas  # type: ignore[return-value]
        return (self.alpha,) * len(self.real_ranks())

    @property
    def dora(self) -> bool:
        """Whether the node is DoRA (it has a magnitude vector)."""
        return self.magnitude is not None

    @property
    def shape(self) -> tuple[int, ...]:
        """The logical shape of the weight, ``(*lead, out, in)``."""
        if self.base is not None and hasattr(self.base, "shape"):
            return tuple(self.base.shape)
        return (*self.a.shape[:-2], self.b.shape[-2], self.a.shape[-1])

    def replace(self, **changes: Any) -> LoRAWeight:
        """A copy with the given fields changed (nothing is mutated)."""
        return dataclasses.replace(self, **changes)

    def __repr__(self) -> str:
        def desc(x: Any) -> str:
            if x is None:
                return "None"
            shape = getattr(x, "shape", None)
            dtype = getattr(x, "dtype", None)
            return f"{type(x).__name__}{tuple(shape) if shape is not None else ''}" + (
                f":{dtype}" if dtype is not None else ""
            )

        return (
            f"LoRAWeight(base={desc(self.base)}, a={desc(self.a)}, b={desc(self.b)}, "
            f"alpha={self.alpha:g}, rank={self.rank}, rslora={self.rslora}, "
            f"dropout={self.dropout:g}"
            + (
                f", layer_ranks={self.layer_ranks}, layer_alphas={self.layer_alphas}"
                if self.per_layer
                else ""
            )
            + (f", magnitude={desc(self.magnitude)})" if self.dora else ")")
        )

    def _repr_html_(self) -> str:
        """Jupyter's view: the base, the factors, the scale and the trainable count."""
        import html

        def desc(x: Any) -> str:
            if x is None:
                return "None"
            shape = tuple(getattr(x, "shape", ()))
            dtype = getattr(x, "dtype", None)
            kind = type(x).__name__
            return f"{kind} {shape}" + (f" {dtype}" if dtype is not None else "")

        parts = (self.a, self.b, self.magnitude)
        n_ab = sum(math.prod(x.shape) for x in parts if hasattr(x, "shape"))
        scale = "α/√r" if self.rslora else "α/r"
        rows = [
            ("W", f"{desc(self.base)} (frozen)"),
            ("A", f"{desc(self.a)} (trainable)"),
            ("B", f"{desc(self.b)} (trainable)"),
            (
                "rank r, α",
                f"per layer {self.layer_ranks}, {self.layer_alphas} (padded to "
                f"{self.rank}): scale {scale}"
                if self.per_layer
                else f"{self.rank}, {self.alpha:g}: scale {scale} = {self.scale:g}",
            ),
            ("dropout", f"{self.dropout:g}"),
            *([("m (DoRA)", f"{desc(self.magnitude)} (trainable)")] * self.dora),
            ("trainable params", f"{n_ab:,}"),
        ]
        cells = "".join(
            f"<tr><th style='text-align:left'>{k}</th>"
            f"<td style='text-align:left'>{html.escape(v)}</td></tr>"
            for k, v in rows
        )
        what = f"m/‖·‖ ⊙ (W + {scale}·B·A)" if self.dora else f"W + {scale}·B·A"
        return f"<b>LoRAWeight</b> {what}<table>{cells}</table>"


logical_shape.register(LoRAWeight, lambda w: w.shape)


@logical_dtype.register
def _lora_dtype(w: LoRAWeight) -> np.dtype:
    """The base's logical dtype (the factors' for a trainable half, base None)."""
    return logical_dtype(w.a if w.base is None else w.base)


@weight_matmul.register(LoRAWeight)
def _lora_matmul(
    w: LoRAWeight, x: jax.Array, matmul_dtype: str | None = None
) -> jax.Array:
    """``x Wᵀ + s · (drop(x) Aᵀ) Bᵀ`` for ``x: (..., in)``, without ``W + s BA``.

    ``matmul_dtype`` applies to the frozen base (``"bfloat16"``: bfloat16 inputs,
    float32 accumulation); the rank-``r`` adapter products stay in ``x``'s dtype.
    A DoRA node rescales the sum per output feature (`_dora_output`).
    """
    y = _base_matmul(w.base, x, matmul_dtype)  # (..., out)
    dropped = w.dropout > 0.0 and w.dropout_key is not None
    xd = x
    if dropped:
        xd = dropout(x, w.dropout, key=jax.random.wrap_key_data(w.dropout_key))
    h = jnp.einsum("...i,ri->...r", xd, jnp.asarray(w.a).astype(x.dtype))  # (..., r)
    delta = _times_bt(h, jnp.asarray(w.b).astype(x.dtype))
    if w.magnitude is not None:
        return _dora_output(w, y, dropped, xd, delta, matmul_dtype)
    return y + (_layer_scale(w, delta.dtype) * delta).astype(y.dtype)  # (..., out)


def _layer_scale(w: LoRAWeight, dtype: Any) -> Any:
    """``s`` of one layer for the matmul: the static float, or the sliced 0-d leaf.

    The float multiplies as a weak type, so ``s`` is rounded to ``dtype`` either way.
    """
    if w.layer_scale is None:
        if w.per_layer:
            raise ValueError(
                "a LoRAWeight with per-layer ranks has no layer_scale: a trainable "
                "half of lora.split computes no product; lora.combine it with its "
                "frozen half (or build it with lora.with_layer_ranks)"
            )
        return w.scale
    return jnp.asarray(w.layer_scale).astype(dtype)  # () inside scan


def layer_scales(w: LoRAWeight) -> tuple[np.ndarray, Any]:
    """``(s, layer_scale)``: float32 ``s_i = alpha_i / r_i`` (rsLoRA: ``/ sqrt(r_i)``).

    ``s`` is ``(n,)`` over the flattened layers, from the static ``layer_ranks`` and
    ``layer_alphas``; ``layer_scale`` the same reshaped to the node's leading axes.
    """
    ranks, alphas = w.real_ranks(), w.real_alphas()
    s = np.array(
        [a / (math.sqrt(r) if w.rslora else r) for r, a in zip(ranks, alphas)],
        np.float32,
    )
    ref = w.a if w.a is not None else w.b
    return s, jnp.asarray(s.reshape(tuple(ref.shape[:-2])))


def with_layer_ranks(
    w: LoRAWeight, ranks: tuple[int, ...], alphas: tuple[float, ...]
) -> LoRAWeight:
    """``w`` with each layer's rank and alpha, its factors zeroed past each rank.

    ``w.a (*lead, R, in)``, ``w.b (*lead, out, R)`` with ``R = max(ranks)``; the
    rows ``A[i, r_i:]`` and columns ``B[i, :, r_i:]`` are set to zero, which keeps
    ``B_i A_i`` of rank ``r_i`` and their gradients zero (specs/lora.md). A stack
    whose layers share one rank and alpha gets a plain node (``rank``, ``alpha``).
    """
    ranks, alphas = tuple(map(int, ranks)), tuple(map(float, alphas))
    big = max(ranks)
    if w.a.shape[-2] != big:
        raise ValueError(f"A has rank {w.a.shape[-2]}, the largest of {ranks} is {big}")
    if len(set(ranks)) == 1 and len(set(alphas)) == 1:
        return w.replace(rank=big, alpha=alphas[0])
    lead = tuple(w.a.shape[:-2])
    keep = np.arange(big)[None, :] < np.array(ranks)[:, None]  # (n, R)
    keep = keep.reshape(*lead, big)
    a = jnp.where(keep[..., :, None], w.a, 0)  # (*lead, R, in)
    b = jnp.where(keep[..., None, :], w.b, 0)  # (*lead, out, R)
    node = w.replace(
        a=a, b=b, rank=big, alpha=max(alphas), layer_ranks=ranks, layer_alphas=alphas
    )
    return node.replace(layer_scale=layer_scales(node)[1])


def _base_matmul(base: Any, x: jax.Array, matmul_dtype: str | None) -> jax.Array:
    """``x Wᵀ`` of the frozen base (``matmul_dtype`` passed only when set)."""
    if matmul_dtype is None:
        return weight_matmul(base, x)
    return weight_matmul(base, x, matmul_dtype)


def dora_norm(w: LoRAWeight) -> jax.Array:
    """``n = ‖W + s B A‖`` over the input axis, per output row: ``(*lead, out)``.

    Float32, from the dense (dequantized) base of one layer at a time: a stacked
    node is mapped over its leading axes with `jax.lax.map`, so a quantized stack
    is never dense as a whole. PEFT's ``DoraLinearLayer.get_weight_norm``.
    """
    if jnp.ndim(w.a) > 2:  # (*lead, r, in): one layer at a time
        return jax.lax.map(dora_norm, w)
    wd = to_dense(w.base).astype(jnp.float32)  # (out, in)
    a = jnp.asarray(w.a).astype(jnp.float32)  # (r, in)
    b = jnp.asarray(w.b).astype(jnp.float32)  # (out, r)
    v = wd + _layer_scale(w, jnp.float32) * (b @ a)  # (out, in)
    return jnp.sqrt(jnp.sum(v * v, axis=-1))  # (out,)


def eager_dora_norm(w: LoRAWeight) -> jax.Array:
    """`dora_norm` for callers outside a trace (`lora.apply`, `save_adapter`, ...).

    A stacked node goes through one jitted program, kept per shapes and static
    fields: `jax.lax.map` called outside a trace wraps a new closure, so each call
    traced and compiled its program again (a DoRA Llama: 7 programs in `apply`,
    the same 7 again in `save_adapter`). A single layer runs op by op, as before.
    """
    if jnp.ndim(w.a) > 2:
        return _stacked_dora_norm(w)
    return dora_norm(w)


_stacked_dora_norm = jax.jit(dora_norm)


def _dora_output(
    w: LoRAWeight,
    y: jax.Array,
    dropped: bool,
    xd: jax.Array,
    delta: jax.Array,
    matmul_dtype: str | None,
) -> jax.Array:
    """DoRA's output from the base's ``y = x Wᵀ`` and the adapter's ``(xd Aᵀ) Bᵀ``.

    ``y + (m/n - 1) ⊙ yd + (m/n) ⊙ s · delta``, with ``yd = y`` unless dropout
    acted (then ``yd = drop(x) Wᵀ``), as PEFT's ``DoraLinearLayer.forward``; ``n``
    is a constant of the backward pass (paper, section 4.3).
    """
    n = jax.lax.stop_gradient(dora_norm(w))  # (out,)
    g = jnp.asarray(w.magnitude).astype(jnp.float32) / n  # (out,)
    yd = _base_matmul(w.base, xd, matmul_dtype) if dropped else y  # (..., out)
    extra = (g - 1.0) * yd + g * (_layer_scale(w, delta.dtype) * delta)  # (..., out)
    return y + extra.astype(y.dtype)


@jax.custom_vjp
def _times_bt(h: jax.Array, b: jax.Array) -> jax.Array:
    """``h Bᵀ`` for ``h: (..., r)``, ``B: (out, r)``."""
    return jnp.einsum("...r,or->...o", h, b)


def _times_bt_fwd(h: jax.Array, b: jax.Array) -> Any:
    return _times_bt(h, b), (h, b)


def _times_bt_bwd(res: Any, g: jax.Array) -> Any:
    h, b = res
    dh = jnp.einsum("...o,or->...r", g, b)
    dbt = jnp.einsum("...r,...o->ro", h, g)  # (r, out): h transposed, not g
    return dh, jax.lax.optimization_barrier(dbt).T


_times_bt.defvjp(_times_bt_fwd, _times_bt_bwd)


__all__ = [
    "LoRAWeight",
    "dora_norm",
    "eager_dora_norm",
    "layer_scales",
    "with_layer_ranks",
]
