"""How much of an adapter's update survives folding and storing in a tensor type.

Folding an adapter gives ``W' = W + Δ`` with ``Δ = s · B A`` (DoRA: ``Δ`` is the
rescaled fold minus ``W``, `entrenar.lora.fold.update`); a file stores
``Q(W')``, ``W'`` rounded to its tensor type (F16, Q8_0, Q4_1, ...). What the file
adds to the base is then ``E = Q(W') - W``, not ``Δ``. Rounding error alone is not
the danger (it is spread over every weight); the danger is rounding that erases
``Δ``: a base that came from a 4-bit file lies on that format's grid, and an update
smaller than half a grid step rounds straight back to it. `fold_retention`
measures, over all adapted weights together,

    kept     = Σ ⟨E, Δ⟩ / Σ ‖Δ‖²          (1: the update is in the file; 0: erased)
    residual = sqrt(Σ ‖E - Δ‖²) / sqrt(Σ ‖Δ‖²)   (0: exact)

`save_folded_gguf` checks ``kept`` for the chosen type and writes the GGUF, folding
each layer as it writes it (never a dense copy of the model; both measure and write
a stacked weight one layer at a time), warning (naming the measured figures and a
type that keeps more) when the type keeps less than ``min_kept`` of the update. Q8_0
keeps a short fine-tune of a 4-bit SmolLM2 (~99%), Q4_1 erases most of it
(benchmarks/results/main_job.md). A mixture of experts written with its own
``expert_type`` (MXFP4: gpt-oss's experts as llama.cpp ships them) is measured as
written: its expert stacks (``mlp.experts.{gate,up,down}_proj``) in ``expert_type``,
the other weights in ``tensor_type``.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterator
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from entrenar import io, quant
from entrenar.errors import ConfigError
from entrenar.lora.fold import update
from entrenar.lora.names import named_weight_leaves
from entrenar.lora.weight import LoRAWeight
from entrenar.nn import mxfp4
from entrenar.nn.weight_node import to_dense
from entrenar.types import Params

_CASTS = {"F32": jnp.float32, "F16": jnp.float16, "BF16": jnp.bfloat16}
_BLOCKS = ("Q8_0", "Q4_0", "Q4_1")
_PROJS = ("gate_proj", "up_proj", "down_proj")


class Retention(NamedTuple):
    """How much of the adapters' update ``Δ`` a tensor type keeps (module docstring)."""

    tensor_type: str
    kept: float
    """``Σ ⟨E, Δ⟩ / Σ ‖Δ‖²``: 1 when the file adds exactly the update, 0 erased."""
    residual: float
    """``sqrt(Σ ‖E - Δ‖²) / sqrt(Σ ‖Δ‖²)``: error relative to the update's size."""
    weights: int
    """Adapted weights measured."""


def stored(w: jax.Array, tensor_type: str) -> jax.Array:
    """``w`` as a file of ``tensor_type`` holds it (rounded), back in float32."""
    kind = tensor_type.upper()
    if kind in _CASTS:
        return w.astype(_CASTS[kind]).astype(jnp.float32)
    if kind in _BLOCKS:
        return quant.dequantize(quant.quantize(w, kind.lower()), jnp.float32)
    if kind == "MXFP4":  # experts only (`entrenar.io.save_llama_gguf`'s expert_type)
        a = np.asarray(w, np.float32)  # (..., in): rows of whole 32-value blocks
        back = mxfp4.dequantize_ggml(mxfp4.quantize_ggml(a), a.shape)
        return jnp.asarray(back)
    raise ConfigError(
        f"tensor type {tensor_type!r}: expected one of {(*_CASTS, *_BLOCKS, 'MXFP4')}"
    )


def _is_expert_stack(path: str) -> bool:
    """``path`` (a dotted tree path) names a mixture of experts' weight stack.

    >>> _is_expert_stack("model.layers.mlp.experts.down_proj.weight")
    True
    >>> _is_expert_stack("model.layers.mlp.shared_expert.down_proj.weight")
    False
    """
    *_, group, proj, leaf = ["", "", *path.split(".")]
    return group == "experts" and proj in _PROJS and leaf == "weight"


def fold_retention(
    params: Params, tensor_type: str, expert_type: str | None = None
) -> Retention:
    """Measure how much of every adapter's update survives folding into ``tensor_type``.

    Args:
        params: a tree with `LoRAWeight` nodes (dense or quantized bases).
        tensor_type: ``"F32"``, ``"F16"``, ``"BF16"``, ``"Q8_0"``, ``"Q4_0"`` or
            ``"Q4_1"`` (as `entrenar.io.save_llama_gguf` writes).
        expert_type: the type of the experts' stacks (``"MXFP4"`` or one of the
            above; default ``tensor_type``), as `entrenar.io.save_llama_gguf`'s
            ``expert_type``; the `Retention` then measures both types together,
            and its ``tensor_type`` names the other weights' type.

    Raises:
        ConfigError: no adapter in ``params``, or an unknown tensor type.

    Example:
        >>> w = LoRAWeight(jnp.zeros((2, 32)), jnp.ones((1, 32)) / 8,
        ...                jnp.ones((2, 1)), alpha=1, rank=1)
        >>> fold_retention({"w": w}, "F16").kept
        1.0
    """
    dot = sq = err = 0.0
    n = 0
    for path, x in named_weight_leaves(params):
        if not isinstance(x, LoRAWeight):
            continue
        kind = expert_type if expert_type and _is_expert_stack(path) else tensor_type
        for m in _matrices(x):  # a stacked leaf one layer at a time
            base = to_dense(m.base).astype(jnp.float32)  # (out, in)
            d = update(m)  # s·BA; DoRA: its rescaled fold minus W
            e = stored(base + d, kind) - base  # what the file adds to W
            dot += float(jnp.vdot(e, d))
            sq += float(jnp.vdot(d, d))
            err += float(jnp.sum((e - d) ** 2))
        n += 1
    if n == 0:
        raise ConfigError("fold_retention: params hold no LoRA adapter")
    if sq == 0.0:  # untrained adapters (B = 0): nothing to lose
        return Retention(tensor_type.upper(), 1.0, 0.0, n)
    return Retention(tensor_type.upper(), dot / sq, (err / sq) ** 0.5, n)


def _matrices(w: LoRAWeight) -> Iterator[LoRAWeight]:
    """The adapted matrices of ``w``, made one at a time.

    ``w`` itself, or each matrix of a stack ``(*lead, out, in)`` in row-major order
    (every array of the node sliced).
    """
    if w.a.ndim <= 2:
        yield w
        return
    for i in range(w.a.shape[0]):
        yield from _matrices(jax.tree_util.tree_map(lambda a, i=i: a[i], w))


def save_folded_gguf(
    path: str | os.PathLike[str],
    config: Any,
    params: Params,
    *,
    source: str | os.PathLike[str] | None = None,
    tensor_type: str = "Q8_0",
    expert_type: str | None = None,
    min_kept: float = 0.9,
    name: str = "",
    tokenizer: Any = None,
) -> Retention:
    """Fold the adapters of ``params`` and write a llama.cpp GGUF that keeps them.

    Args:
        path: destination ``.gguf``.
        config: the model's `entrenar.nn.LlamaConfig`.
        params: the tree with `LoRAWeight` nodes (QLoRA bases allowed).
        source: the base GGUF, whose tokenizer and chat template are copied.
        tensor_type: type of the matrices (default Q8_0: 8.5 bits a value, about
            145 MB for SmolLM2-135M, and it keeps a fine-tune of a 4-bit base).
        expert_type: type of a mixture of experts' stacks (default
            ``tensor_type``; ``"MXFP4"`` as llama.cpp's gpt-oss files), measured
            with the rest (`fold_retention`).
        min_kept: warn (`UserWarning`) when `fold_retention` ``.kept`` is lower.
        name: ``general.name`` (default: keep the source's).
        tokenizer: the tokenizer to write when ``source`` has none (see
            `entrenar.io.save_llama_gguf`).

    Returns:
        The `Retention` of ``tensor_type``, measured before writing.

    Raises:
        ConfigError, UnsupportedError: what `entrenar.io.check_llama_gguf`
            refuses, before anything is measured.
    """
    kind = tensor_type.upper()
    experts = expert_type.upper() if expert_type else None
    # what the writer would refuse, before the retention is measured
    io.check_llama_gguf(config, tensor_type=kind, expert_type=experts)
    r = fold_retention(params, kind, experts)
    if r.kept < min_kept:
        better = fold_retention(params, "Q8_0" if kind != "Q8_0" else "F16")
        what = f"{kind} with {experts} experts" if experts not in (None, kind) else kind
        warnings.warn(
            f"{os.fspath(path)}: {what} keeps {r.kept:.0%} of the LoRA update "
            f"(error {r.residual:.0%} of the update's size), so the exported model "
            f"loses much of the fine-tune; {better.tensor_type} keeps "
            f"{better.kept:.0%} (tensor_type={better.tensor_type!r}"
            f"{', expert_type=None' if experts else ''})",
            UserWarning,
            stacklevel=2,
        )
    io.save_llama_gguf(  # folds each layer as it writes it: no dense copy
        path, config, params, source=source, tensor_type=kind, expert_type=experts,
        name=name, tokenizer=tokenizer,
    )  # fmt: skip
    return r


__all__ = ["Retention", "fold_retention", "save_folded_gguf", "stored"]
