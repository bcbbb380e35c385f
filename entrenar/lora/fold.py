"""Fold adapters into their bases (`fold`) and take them out again (`unfold`).

``fold`` replaces each `LoRAWeight` by the dense matrix

    W' = W + s · B A            (*lead, out, in), s = alpha / r (or alpha / sqrt(r))

computed in float32 and cast to the base's dtype (a quantized base is dequantized
first, so a merged QLoRA model is dense). A DoRA node (with a magnitude ``m``)
folds to its rescaled sum, as PEFT's ``merge_and_unload``:

    W' = (m / ‖W + s · B A‖_row) ⊙ (W + s · B A)      (m, the norm: (*lead, out))
 ``fold_and_requantize`` quantizes ``W'``
again with the base's own scheme and reports the error that costs. ``unfold`` is the
inverse for plain LoRA over dense bases: ``W = W' - s · B A``.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from entrenar.errors import CompatibilityError, UnsupportedError
from entrenar.lora import _quant
from entrenar.lora.names import named_weight_leaves
from entrenar.lora.weight import LoRAWeight, layer_scales
from entrenar.nn.weight_node import is_weight_node, logical_shape, to_dense
from entrenar.types import Params


def delta(w: LoRAWeight) -> jax.Array:
    """The update ``s · B A`` in float32, ``(*lead, out, in)``."""
    a = jnp.asarray(w.a).astype(jnp.float32)  # (*lead, r, in)
    b = jnp.asarray(w.b).astype(jnp.float32)  # (*lead, out, r)
    return w.scale * jnp.einsum("...or,...ri->...oi", b, a)


def _merged(w: LoRAWeight) -> tuple[jax.Array, Any]:
    """``(W', dtype)``: the merged weight in float32 and the base's dtype."""
    base = to_dense(w.base)
    v = base.astype(jnp.float32) + delta(w)  # (*lead, out, in)
    if w.dora:  # DoRA: each output row rescaled to its magnitude
        norm = jnp.sqrt(jnp.sum(v * v, axis=-1, keepdims=True))  # (*lead, out, 1)
        m = jnp.asarray(w.magnitude).astype(jnp.float32)[..., None]  # (*lead, out, 1)
        v = (m / norm) * v
    return v, base.dtype


@to_dense.register
def folded_weight(w: LoRAWeight) -> jax.Array:
    """``W + s · B A`` in the base's (dequantized) dtype (`to_dense` of the node).

    DoRA: ``(m / ‖W + s · B A‖_row) ⊙ (W + s · B A)``.
    """
    v, dtype = _merged(w)
    return v.astype(dtype)


def update(w: LoRAWeight) -> jax.Array:
    """What folding adds to the base, float32 ``(*lead, out, in)``: ``W' - W``.

    ``s · B A`` (`delta`) for plain LoRA; for DoRA the rescaled sum minus ``W``
    (the task vector of a DoRA fine-tune, non-zero even when ``B = 0`` once ``m``
    has moved away from ``‖W‖``).
    """
    if not w.dora:
        return delta(w)
    v, _ = _merged(w)
    return v - to_dense(w.base).astype(jnp.float32)


def fold(params: Params) -> Params:
    """Replace every `LoRAWeight` by its merged dense weight ``W + s · B A``.

    Example:
        >>> import jax.numpy as jnp
        >>> w = LoRAWeight(jnp.zeros((2, 2)), jnp.ones((1, 2)), jnp.ones((2, 1)),
        ...                alpha=2, rank=1)
        >>> fold({"w": w})["w"].tolist()
        [[2.0, 2.0], [2.0, 2.0]]
    """
    return jax.tree_util.tree_map(
        lambda x: folded_weight(x) if isinstance(x, LoRAWeight) else x,
        params,
        is_leaf=is_weight_node,
    )


class RequantReport(NamedTuple):
    """How far a requantized merged weight is from the exact merged weight."""

    max_abs: float
    """``max |Q(W') - W'|``."""
    rms: float
    """``sqrt(mean((Q(W') - W')²))``."""
    relative_rms: float
    """``rms / sqrt(mean(W'²))``."""


def fold_and_requantize(params: Params) -> tuple[Params, dict[str, RequantReport]]:
    """`fold`, then quantize each merged weight whose base was quantized.

    Each quantized base is dequantized, ``s · B A`` is added, and the sum is quantized
    again with the base's scheme, block size and double quantization.

    Returns:
        ``(params, errors)``: the new tree (quantized merged weights, dense weights
        elsewhere) and, per dotted path of a requantized weight, its `RequantReport`.
    """
    errors: dict[str, RequantReport] = {}
    flat, treedef = jax.tree_util.tree_flatten(params, is_leaf=is_weight_node)
    out = []
    for (name, _), x in zip(named_weight_leaves(params), flat):
        if isinstance(x, LoRAWeight):
            merged = folded_weight(x)
            result: Any = merged
            if _quant.is_quantized(x.base):
                q = _quant.requantize_like(merged, x.base)
                exact = merged.astype(jnp.float32)  # bfloat16 bases too
                diff = to_dense(q).astype(jnp.float32) - exact
                rms = float(jnp.sqrt(jnp.mean(diff**2)))
                ref = float(jnp.sqrt(jnp.mean(exact**2)))
                errors[name] = RequantReport(
                    float(jnp.max(jnp.abs(diff))), rms, rms / ref if ref else 0.0
                )
                result = q
            x = result
        out.append(x)
    return jax.tree_util.tree_unflatten(treedef, out), errors


def unfold(merged: Params, adapters: Params) -> Params:
    """Undo `fold`: ``LoRAWeight(W' - s · B A, A, B)`` where ``adapters`` has one.

    Args:
        merged: a tree of dense weights (the output of `fold`, possibly trained or
            saved and reloaded since).
        adapters: a tree with the same structure holding the `LoRAWeight` nodes
            (the `apply`'d params or the trainable half from `split`).

    Returns:
        A tree like ``merged`` with the adapted weights as `LoRAWeight` nodes again;
        dense bases are recovered to float32 rounding.
    """

    def undo(ad: Any, m: Any) -> Any:
        if not isinstance(ad, LoRAWeight):
            return m
        if ad.dora:
            raise UnsupportedError(
                "unfold: a DoRA adapter's fold rescales W by m/‖W + s·BA‖, which "
                "is not undone here; keep the unfolded tree (lora.fold makes a copy)"
            )
        if is_weight_node(m):
            raise CompatibilityError(
                f"unfold needs a dense merged weight where the adapter is, got {m!r}"
            )
        if logical_shape(m) != logical_shape(ad):
            raise CompatibilityError(
                f"unfold: merged weight {tuple(m.shape)} does not fit the adapter "
                f"A {tuple(ad.a.shape)}, B {tuple(ad.b.shape)}"
            )
        base = (jnp.asarray(m).astype(jnp.float32) - delta(ad)).astype(m.dtype)
        if ad.per_layer and ad.layer_scale is None:  # a trainable half's node
            ad = ad.replace(layer_scale=layer_scales(ad)[1])
        return ad.replace(base=base, dropout_key=None)

    return jax.tree_util.tree_map(
        undo, adapters, merged, is_leaf=lambda x: x is None or is_weight_node(x)
    )


__all__ = [
    "RequantReport",
    "delta",
    "fold",
    "fold_and_requantize",
    "unfold",
    "update",
]
