r"""`LoRAConfig` and how its targets select weights by their Hugging Face name.

A weight leaf at dotted path ``<module>.weight`` is a candidate; its module names
are the Hugging Face names: for a stacked leaf (under a ``layers`` key, leading axis
``L``) the names ``...layers.{i}...`` for every ``i < L``. A target selects the leaf
when it matches every one of those names:

- ``"all-linear"``: every candidate with a 2-D ``(out, in)`` matrix per layer, except
  embeddings and the output head (PEFT's ``all-linear``);
- a dotted name made of ``[A-Za-z0-9_.]`` only (``"q_proj"``, ``"self_attn.v_proj"``):
  the module name equals it or ends with ``"." + target`` (PEFT's list semantics);
- anything else is a regular expression searched in the module name
  (``r"layers\.\d+\.mlp\..*"``), checked first by `entrenar.lora.patterns`
  (length, no lookarounds, a bounded number of ways to match: no ``(a*)*``).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Sequence

from entrenar.errors import ConfigError
from entrenar.lora.patterns import SEARCH, check_pattern, search_pattern

ALL_LINEAR = "all-linear"
"""Target every linear weight except embeddings and the output head."""

_INITS = ("kaiming", "gaussian")
_PLAIN = re.compile(r"[A-Za-z0-9_.]+")
_NOT_LINEAR = re.compile(r"(^|\.)(embed_tokens|embed|wte|wpe|lm_head|output)(\.|$)")


@dataclasses.dataclass(frozen=True)
class LoRAConfig:
    """Settings of a LoRA transform.

    Attributes:
        rank: r, the inner dimension of the adapter (``A: (r, in)``, ``B: (out, r)``).
        alpha: scaling numerator; the update is ``(alpha / r) · B A``.
        targets: which weights to adapt (see the module docstring): a name, a regex,
            ``"all-linear"``, or a sequence of those (any may match).
        dropout: dropout rate on the adapter input ``x`` (PEFT's ``lora_dropout``);
            it acts only when keys are supplied with `entrenar.lora.with_dropout_keys`.
        init: ``"kaiming"``: ``A ~ U(-1/sqrt(in), 1/sqrt(in))`` (PEFT's default,
            PyTorch's ``kaiming_uniform_(a=sqrt(5))``); ``"gaussian"``:
            ``A ~ N(0, 1/r²)``. ``B = 0`` in both, so the adapted model starts equal
            to the base model.
        rslora: scale by ``alpha / sqrt(r)`` (rank-stabilised LoRA) instead.

    Example:
        >>> LoRAConfig(rank=8, alpha=16, targets=("q_proj", "v_proj")).scale
        2.0
    """

    rank: int = 8
    alpha: float = 16.0
    targets: str | Sequence[str] = ("q_proj", "v_proj")
    dropout: float = 0.0
    init: str = "kaiming"
    rslora: bool = False

    def __post_init__(self) -> None:
        if type(self.rank) is not int or self.rank < 1:
            raise ConfigError(
                f"LoRAConfig.rank must be a positive int, got {self.rank!r}"
            )
        if not _finite_number(self.alpha):
            raise ConfigError(
                f"LoRAConfig.alpha must be a finite number, got {self.alpha!r}"
            )
        if not self.alpha > 0:
            raise ConfigError(f"LoRAConfig.alpha must be > 0, got {self.alpha!r}")
        if not _finite_number(self.dropout):
            raise ConfigError(
                f"LoRAConfig.dropout must be a number in [0, 1), got {self.dropout!r}"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(
                f"LoRAConfig.dropout must be in [0, 1), got {self.dropout!r}"
            )
        if self.init not in _INITS:
            raise ConfigError(
                f"LoRAConfig.init must be one of {_INITS}, got {self.init!r}"
            )
        targets = (self.targets,) if isinstance(self.targets, str) else self.targets
        if not targets:
            raise ConfigError("LoRAConfig.targets is empty: name at least one module")
        for t in targets:
            if not isinstance(t, str) or not t:
                raise ConfigError(f"LoRAConfig.targets holds {t!r}; use strings")
            if t != ALL_LINEAR and not _PLAIN.fullmatch(t):
                try:
                    check_pattern(t, runs_as=SEARCH)
                except ConfigError as e:
                    raise ConfigError(f"LoRAConfig.targets: {e}") from None
        object.__setattr__(self, "targets", tuple(targets))

    @property
    def scale(self) -> float:
        """``alpha / r`` (``alpha / sqrt(r)`` with rsLoRA)."""
        return self.alpha / (self.rank**0.5 if self.rslora else self.rank)


def target_matches(target: str, module: str, per_layer_ndim: int) -> bool:
    r"""Whether one target selects one Hugging Face module name.

    Args:
        target: a name, a regex or ``"all-linear"``.
        module: the module name, e.g. ``"model.layers.0.self_attn.q_proj"``.
        per_layer_ndim: rank of the weight of one layer (2 for a linear layer).

    >>> target_matches("q_proj", "model.layers.0.self_attn.q_proj", 2)
    True
    >>> target_matches("proj", "model.layers.0.self_attn.q_proj", 2)
    False
    >>> target_matches(r"layers\.\d+\.mlp\..*", "model.layers.3.mlp.up_proj", 2)
    True
    >>> target_matches("all-linear", "model.embed_tokens", 2)
    False
    """
    if target == ALL_LINEAR:
        return per_layer_ndim == 2 and not _NOT_LINEAR.search(module)
    if _PLAIN.fullmatch(target):
        return module == target or module.endswith("." + target)
    return search_pattern(target, module)


def _finite_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


__all__ = ["ALL_LINEAR", "LoRAConfig", "target_matches"]
