"""Task vectors made of re-quantization noise: measured, corrected or refused.

A fine-tune exported to a quantized file stores ``θ = Q_t(W + Δ)``, its weights
rounded to the file's grid ``t`` (Q8_0, Q4_1, F16, ...). Merged against a base ``W``
that lies on another grid (a Q4_1 GGUF, say), its task vector is

    τ = θ - W = (Q_t(W) - W) + (θ - Q_t(W)) = η + τ'

where ``η`` is the noise of re-quantizing the base onto ``t``, in *every* weight,
and ``τ'`` is what the file adds on its own grid (the update ``Δ``, rounded). When
``Σ ‖η‖² > Σ ‖τ'‖²`` the task vector is mostly noise and TIES' trimming and sign
election keep noise instead of the fine-tune. `requantization_noise` measures both
sums (``noise = sqrt(Σ‖η‖² / Σ‖τ‖²)``, ``update = sqrt(Σ‖τ'‖² / Σ‖η‖²)``, the
update against the grid's rounding noise, as `entrenar.lora.fold_retention`
measures an export) and `correct_leaf` takes the task vector on the file's grid:
``θ - η``, so that ``θ - W = τ'``.

The grid of a leaf is read from its values: a leaf holds a grid ``t`` when
rounding onto ``t`` leaves it unchanged (dequantized block formats are fixed points
of their quantizer), tried coarsest first on a sample of rows. A base already on
the file's grid has ``η = 0``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax.numpy as jnp
import numpy as np

from entrenar.errors import EntrenarError
from entrenar.io.safetensors_io import release_pages
from entrenar.lora.export import stored
from entrenar.merge.recipe import POLICIES
from entrenar.nn.weight_node import logical_dtype

GRIDS = ("Q4_0", "Q4_1", "Q8_0", "BF16", "F16")
"""The grids a file's leaf is tested for, coarsest first."""
SAMPLE_ROWS = 64
"""Rows of a leaf whose rounding decides its grid."""


class NoiseReport(NamedTuple):
    """How much of one model's task vector is re-quantization noise.

    Attributes:
        path: the model file.
        noise: ``sqrt(Σ‖η‖² / Σ‖τ‖²)``: 0 when the task vector holds no rounding of
            the base, 1 when it is nothing else.
        update: ``sqrt(Σ‖τ'‖² / Σ‖η‖²)``: what the file adds on its own grid,
            relative to the noise of rounding the base onto it (inf without noise).
        grids: leaf name -> the file's grid, for the leaves where ``η ≠ 0``.
    """

    path: str
    noise: float
    update: float
    grids: Mapping[str, str]

    @property
    def flagged(self) -> bool:
        """Whether the noise outweighs the update (``Σ‖η‖² > Σ‖τ'‖²``)."""
        return self.update < 1.0

    def describe(self) -> str:
        """One line: the figures and what they mean."""
        kinds = sorted(set(self.grids.values()))
        return (
            f"{self.path}: {self.noise:.0%} of its difference from the base is the "
            f"noise of rounding the base onto the file's {'/'.join(kinds)} grid; "
            f"the update on that grid is {self.update:.2f}x that noise"
        )


def grid_of(x: Any) -> str | None:
    """The first of `GRIDS` whose rounding leaves ``x`` unchanged (on a sample)."""
    a = np.asarray(x)
    if a.ndim < 1 or not np.issubdtype(a.dtype, np.floating) or a.size == 0:
        return None
    rows = a.reshape(-1, a.shape[-1])[:SAMPLE_ROWS].astype(np.float32)
    if not np.isfinite(rows).all():
        return None
    for kind in GRIDS:
        if kind.startswith("Q") and rows.shape[-1] % 32:
            continue
        try:
            again = np.asarray(stored(jnp.asarray(rows), kind))
        except EntrenarError:  # scales out of float16's range: not this grid
            continue
        if np.array_equal(again, rows):
            return kind
    return None


def base_on_grid(base: Any, grid: str) -> np.ndarray:
    """``Q_t(W)``: the base rounded onto the file's grid (float32)."""
    a = np.asarray(base, np.float32)
    return np.asarray(stored(jnp.asarray(a), grid)).reshape(a.shape)


def requantization_noise(
    path: str, base: Mapping[str, Any], model: Mapping[str, Any]
) -> NoiseReport:
    """Measure the re-quantization noise in ``model - base`` (module docstring).

    Args:
        path: the model's file (for the report).
        base: ``{name: array}`` of the base.
        model: ``{name: array}`` of the model, same names and shapes.
    """
    eta2 = upd2 = 0.0
    grids: dict[str, str] = {}
    for name, theta in model.items():
        if not np.issubdtype(np.dtype(logical_dtype(theta)), np.floating):
            continue
        w = np.asarray(base[name], np.float32)
        t = np.asarray(theta, np.float32)
        grid = grid_of(t)
        if grid is None or grid_of(w) == grid:  # no grid, or the base's own
            upd2 += float(np.sum((t - w) ** 2))
        else:
            on_grid = base_on_grid(w, grid)
            e2 = float(np.sum((on_grid - w) ** 2))
            if e2 > 0.0:
                grids[name] = grid
            eta2 += e2
            upd2 += float(np.sum((t - on_grid) ** 2))
        for x in (base[name], theta):  # a mapped file's pages: read, given back
            if isinstance(x, np.ndarray):
                release_pages(x)
    total = eta2 + upd2  # ‖η + τ'‖² ≈ ‖η‖² + ‖τ'‖² (rounding is not the update)
    noise = (eta2 / total) ** 0.5 if total > 0 else 0.0
    update = (upd2 / eta2) ** 0.5 if eta2 > 0 else float("inf")
    return NoiseReport(path, noise, update, grids)


def correct_leaf(base: Any, theta: Any, grid: str | None) -> Any:
    """``θ - (Q_t(W) - W)``: the model whose task vector is taken on its grid."""
    if grid is None:
        return theta
    w = np.asarray(base, np.float32)
    fixed = np.asarray(theta, np.float32) - (base_on_grid(w, grid) - w)
    return fixed.astype(np.dtype(logical_dtype(theta)))


def adapter_beside(path: str) -> str | None:
    """The PEFT adapter folder a run wrote beside ``path`` (``adapter/``), if any."""
    folder = os.path.join(os.path.dirname(os.path.abspath(path)), "adapter")
    found = os.path.isfile(os.path.join(folder, "adapter_config.json"))
    return folder if found else None


def better_path(report: NoiseReport) -> str:
    """The message that names the merges that keep the fine-tune."""
    return (
        f"{report.describe()}, so the merge would mostly combine rounding noise. "
        "Merge the fine-tunes' adapters instead (MODEL+ADAPTER_FOLDER with the base "
        "the adapters were trained on, or entrenar.merge.merge_adapters), or their "
        "folded float models (F32/F16 safetensors or GGUF); or let the merge take "
        "the task vector on the file's grid (quantized: correct)"
    )


__all__ = [
    "GRIDS",
    "POLICIES",
    "NoiseReport",
    "adapter_beside",
    "base_on_grid",
    "better_path",
    "correct_leaf",
    "grid_of",
    "requantization_noise",
]
