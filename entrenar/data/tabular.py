"""Tabular rows as training arrays: features and targets, a held-out split, scaling.

Rows (`load_records`) become ``{"x": (N, F) float32, "y": (N,) int32 or (N, 1)
float32}``; `split_rows` holds out a seeded fraction; `standardize` scales the
features by stored or computed mean and std. Errors name the run's config keys.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from entrenar.data.readers import to_arrays
from entrenar.errors import ConfigError


def split_rows(n: int, fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Row ids ``(keep, held)`` of ``n`` rows, ``fraction`` of them held out.

    The shuffle is a pure function of ``seed``; both id arrays are sorted.
    """
    order = np.random.default_rng([int(seed), 7]).permutation(n)
    k = round(n * fraction)
    if fraction > 0 and not 0 < k < n:
        raise ConfigError(
            f"data.validation_split: {fraction} of {n} examples leaves an empty split"
        )
    return np.sort(order[k:]), np.sort(order[:k])


def tabular_arrays(
    recs: Any, where: str, features: list[str], target: str, task: str, n_out: int
) -> dict[str, np.ndarray]:
    """The rows as ``{"x": (N, F) float32, "y": targets}``.

    Targets are ``(N, 1)`` float32 for regression, otherwise class ids ``(N,)`` int32,
    checked to be integers in ``[0, n_out)``.
    """
    x = to_arrays(recs, {"x": features})["x"]
    if task == "regression":
        y = to_arrays(recs, {"y": [target]})["y"]  # (N, 1)
        if n_out != 1:
            raise ConfigError(
                f"model.config.sizes: regression predicts one value; the last "
                f"size is {n_out}"
            )
        return {"x": x, "y": y}
    raw = to_arrays(recs, {"y": target}, dtype=np.float64)["y"]
    bad = (raw != np.round(raw)) | (raw < 0) | (raw >= n_out)
    if np.any(bad):
        raise ConfigError(
            f"data.target: {where} has class {raw[bad][0]:g}; classes must be "
            f"integers 0..{n_out - 1} (the model's last size is {n_out})"
        )
    return {"x": x, "y": raw.astype(np.int32)}


def standardize(
    train: dict[str, np.ndarray],
    valid: dict[str, np.ndarray] | None,
    preset: dict[str, Any] | None,
) -> dict[str, Any]:
    """Standardise ``x`` in place by the preset's or the training rows' mean and std.

    A constant feature (std 0) is divided by 1. Returns the statistics to store.
    """
    if preset is not None:
        mean = np.asarray(preset["mean"], np.float32)
        std = np.asarray(preset["std"], np.float32)
    else:
        mean = train["x"].mean(axis=0)
        std = train["x"].std(axis=0)
        std = np.where(std > 0, std, 1.0).astype(np.float32)
    train["x"] = ((train["x"] - mean) / std).astype(np.float32)
    if valid is not None:
        valid["x"] = ((valid["x"] - mean) / std).astype(np.float32)
    return {"mean": mean.tolist(), "std": std.tolist()}


__all__ = ["split_rows", "standardize", "tabular_arrays"]
