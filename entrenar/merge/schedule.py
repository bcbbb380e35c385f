"""Parameter settings as mergekit writes them: a number, a gradient, or conditionals.

A setting (``t``, ``weight``, ``density``, ``lambda``) is one of

- a number: the same everywhere;
- a gradient, a list of numbers ``[v_0, ..., v_{g-1}]``: at depth fraction
  ``f ∈ [0, 1]`` (layer ``i`` of ``N`` has ``f = i / (N - 1)``, and ``f = 1`` when
  ``N = 1``; tensors outside the layers have ``f = 0``) the value is interpolated
  linearly between ``v_j`` and ``v_{j+1}`` with ``x = f (g - 1)``, ``j = ⌊x⌋``;
- conditionals, a list of ``{"filter": str, "value": setting}`` (or one such
  mapping): the first whose ``filter`` is absent, ``"*"`` or a substring of the
  tensor's Hugging Face name (``model.layers.3.self_attn.q_proj.weight``) gives the
  value; when none matches the setting is unset and the next scope answers.

This is mergekit's ``evaluate_setting``, so recipes written for it mean the same here.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeAlias

from entrenar.errors import ConfigError

Setting: TypeAlias = Any
"""``float | list[float] | Mapping | list[Mapping]`` (see the module docstring)."""


def _is_number(x: Any) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool)


def check_setting(setting: Setting, where: str) -> None:
    """Raise `ConfigError` naming ``where`` unless ``setting`` is well formed."""
    if _is_number(setting):
        if not math.isfinite(setting):
            raise ConfigError(f"{where}: {setting!r} is not a finite number")
        return
    if isinstance(setting, Mapping):
        setting = [setting]
    if not isinstance(setting, Sequence) or isinstance(setting, str) or not setting:
        raise ConfigError(
            f"{where}: expected a number, a non-empty list of numbers (a gradient "
            f"over depth) or a list of {{filter, value}} conditionals, got {setting!r}"
        )
    if all(_is_number(v) for v in setting):
        for v in setting:
            check_setting(v, where)
        return
    for i, cond in enumerate(setting):
        if not isinstance(cond, Mapping) or "value" not in cond:
            raise ConfigError(
                f"{where}[{i}]: a conditional must be a mapping with 'value' (and an "
                f"optional 'filter'), got {cond!r}"
            )
        unknown = set(cond) - {"filter", "value"}
        if unknown:
            raise ConfigError(f"{where}[{i}]: unknown keys {sorted(unknown)}")
        flt = cond.get("filter")
        if flt is not None and not isinstance(flt, str):
            raise ConfigError(f"{where}[{i}].filter must be a string, got {flt!r}")
        check_setting(cond["value"], f"{where}[{i}].value")


def evaluate(setting: Setting, name: str, fraction: float) -> float | None:
    """The value of ``setting`` for tensor ``name`` at depth ``fraction``.

    Returns None when the setting is conditional and no filter matches ``name``.

    >>> evaluate([0.0, 1.0, 0.0], "model.layers.1.mlp.up_proj.weight", 0.5)
    1.0
    >>> evaluate([0.0, 1.0], "model.layers.1.mlp.up_proj.weight", 0.25)
    0.25
    >>> evaluate([{"filter": "self_attn", "value": 0.2}, {"value": 0.7}], "x.mlp", 0)
    0.7
    """
    if setting is None:
        return None
    if _is_number(setting):
        return float(setting)
    if isinstance(setting, Mapping):
        setting = [setting]
    if all(_is_number(v) for v in setting):
        x = fraction * (len(setting) - 1)
        j = int(x)
        j1 = min(len(setting) - 1, j + 1)
        frac = x - j
        return float((1 - frac) * setting[j] + frac * setting[j1])
    for cond in setting:
        flt = cond.get("filter")
        if flt is None or flt == "*" or (name and flt in name):
            return evaluate(cond["value"], name, fraction)
    return None


def map_setting(setting: Setting, f: Callable[[float], float]) -> Setting:
    """``setting`` with ``f`` applied to every number in it.

    >>> map_setting([{"filter": "mlp", "value": [0.1, 0.3]}, {"value": 0.5}],
    ...             lambda p: 1 - p)
    [{'filter': 'mlp', 'value': [0.9, 0.7]}, {'value': 0.5}]
    """
    if setting is None:
        return None
    if _is_number(setting):
        return f(float(setting))
    if isinstance(setting, Mapping):
        return {**setting, "value": map_setting(setting["value"], f)}
    return [map_setting(s, f) for s in setting]


__all__ = ["Setting", "check_setting", "evaluate", "map_setting"]
