"""Checked reads of a llama.cpp GGUF's ``{arch}.*`` hyperparameters.

Every integer lies in ``(0, INT_LIMITS[key]]`` (keys without an entry: below
``2**31``, as `entrenar.io.hf_folder.check_config_values` has them), every float is
finite and inside ``FLOAT_RANGES[key]`` (keys without the ``{arch}.`` prefix), and a
missing key is its default or a `FormatError` naming the file and the key.
"""

from __future__ import annotations

import json
import math
from collections.abc import Collection
from typing import Any

import numpy as np

from entrenar import nn
from entrenar.errors import FormatError, UnsupportedError
from entrenar.io.gguf_families import FAMILY_KEY, written_name
from entrenar.io.gguf_reader import GGUFFile, GGUFValueType
from entrenar.io.hf_folder import check_field_types

INT_LIMITS = {
    "vocab_size": 1 << 24,
    "embedding_length": 1 << 20,
    "feed_forward_length": 1 << 22,
    "block_count": 1 << 12,
    "attention.head_count": 1 << 12,
    "attention.head_count_kv": 1 << 12,
    "attention.key_length": 1 << 16,
    "attention.sliding_window": 1 << 27,
    "context_length": 1 << 27,
    "rope.scaling.original_context_length": 1 << 27,
}
"""Largest value entrenar accepts for each integer ``{arch}.*`` hyperparameter."""
INT_LIMIT_DEFAULT = (1 << 31) - 1
"""Largest value of an integer ``{arch}.*`` key without an `INT_LIMITS` entry (below
``2**31``: a config value `check_config_values` accepts)."""
FLOAT_RANGES = {
    "rope.freq_base": (1.0, 1e12),
    "rope.freq_base_swa": (1.0, 1e12),
    "attention.layer_norm_rms_epsilon": (0.0, 1.0),
    "attention.layer_norm_epsilon": (0.0, 1.0),
    "rope.scaling.factor": (0.0, 1e6),
    "rope.scaling.attn_factor": (0.0, 1e3),
    "rope.scaling.yarn_attn_factor": (0.0, 1e3),
    "rope.scaling.yarn_beta_fast": (0.0, 1e6),
    "rope.scaling.yarn_beta_slow": (0.0, 1e6),
    "rope.scaling.yarn_log_multiplier": (-100.0, 100.0),
    "expert_weights_scale": (0.0, 1e6),
    "attn_logit_softcapping": (0.0, 1e6),
    "final_logit_softcapping": (0.0, 1e6),
    "embedding_scale": (0.0, 1e6),
    "residual_scale": (0.0, 1e6),
    "attention.scale": (0.0, 1e6),
    "logit_scale": (0.0, 1e6),
    "attention.temperature_scale": (0.0, 1e3),
}
"""Open interval ``(low, high)`` a float ``{arch}.*`` hyperparameter must lie in."""


def meta_int(g: GGUFFile, key: str, default: int | None = None) -> int:
    """An integer hyperparameter: present (or defaulted), ``0 < value <= limit``.

    ``limit`` is ``INT_LIMITS[key]`` (without the ``{arch}.`` prefix), else
    `INT_LIMIT_DEFAULT`, ``2**31 - 1``: every value below ``2**31``.
    """
    f = g.fields.get(key)
    if f is None:
        if default is None:
            raise FormatError(f"{g.path}: metadata {key!r} is missing")
        return default
    limit = INT_LIMITS.get(key.split(".", 1)[1], INT_LIMIT_DEFAULT)
    if isinstance(f.value, bool) or not isinstance(f.value, int) or f.value <= 0:
        raise FormatError(f"{g.path}: metadata {key!r} = {f.value!r}, want an int > 0")
    if f.value > limit:
        raise FormatError(
            f"{g.path}: metadata {key!r} = {f.value} is over the limit of {limit}; "
            "the file is corrupt or not a model entrenar can load"
        )
    return int(f.value)


def meta_float(g: GGUFFile, key: str, default: Any) -> Any:
    """A float hyperparameter: a finite number inside `FLOAT_RANGES`' interval."""
    f = g.fields.get(key)
    if f is None:
        return default
    if f.type not in (GGUFValueType.FLOAT32, GGUFValueType.FLOAT64):
        raise FormatError(f"{g.path}: metadata {key!r} = {f.value!r} is not a float")
    low, high = FLOAT_RANGES[key.split(".", 1)[1]]
    value = float(f.value)
    if f.type == GGUFValueType.FLOAT32 and math.isfinite(value):
        value = float(str(np.float32(value)))  # 1e-06, not 9.99999997e-07
    if not (math.isfinite(value) and low < value < high):
        raise FormatError(
            f"{g.path}: metadata {key!r} = {value!r}, want a finite number in "
            f"({low:g}, {high:g}); the file is corrupt"
        )
    return value


__all__ = ["FLOAT_RANGES", "INT_LIMITS", "meta_float", "meta_int"]


def family_fields(g: GGUFFile, name: str, allowed: Collection[str]) -> dict[str, Any]:
    """The ``entrenar.family`` object of a file entrenar wrote (``{}`` without one).

    Its keys must be among ``allowed`` (the fields the reader applies over the
    file's keys), and its ``architecture``, when given, a family written as
    ``general.architecture`` ``name``.

    Raises:
        FormatError: not a JSON object of ``allowed``, another architecture's
            family (or none entrenar knows), or a value not of its field's type
            (`check_field_types`).
    """
    f = g.fields.get(FAMILY_KEY)
    if f is None:
        return {}
    try:
        value = json.loads(f.value) if isinstance(f.value, str) else None
    except (ValueError, RecursionError):
        value = None
    if not isinstance(value, dict) or set(value) - set(allowed):
        raise FormatError(
            f"{g.path}: metadata {FAMILY_KEY!r} must be a JSON object of "
            f"{sorted(allowed)}"
        )
    family = value.get("architecture")
    if family is not None:
        try:
            arch = nn.architecture(str(family))
        except UnsupportedError:
            arch = None
        if arch is None or written_name(arch.name, arch.gguf_name) != name:
            raise FormatError(
                f"{g.path}: metadata {FAMILY_KEY!r} names family {family!r}, which "
                f"is not written as general.architecture {name!r}"
            )
    else:
        arch = nn.architecture_for_gguf(name, g.path)
    check_field_types(arch.config_class, value, f"{g.path}: metadata {FAMILY_KEY!r}")
    return value
