r"""`LoRAConfig` and how its targets select weights by their Hugging Face name.

A weight leaf at dotted path ``<module>.weight`` is a candidate; its module names
are the Hugging Face names: for a stacked leaf (under a ``layers`` key, leading axis
``L``) the names ``...layers.{i}...`` for every ``i < L``. A target selects the leaf
when it matches every one of those names:

- ``"all-linear"``: every candidate with a 2-D ``(out, in)`` matrix per layer, except
  embeddings, the output head (PEFT's ``all-linear``), norms (Cohere's per-head q/k
  norm gains are ``(H, d)``: ``*norm`` modules are LayerNorms, not linear) and a
  mixture of experts' router ``mlp.gate`` (frozen, as PEFT leaves Qwen MoE routers;
  the experts' ``(E, out, in)`` stacks are not 2-D: target them by name,
  ``experts.down_proj``);
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
from typing import Any, Literal

from entrenar.errors import ConfigError
from entrenar.lora.patterns import SEARCH, check_pattern, check_peft_key, search_pattern
from entrenar.schema import Config, option

ALL_LINEAR = "all-linear"
"""Target every linear weight except embeddings and the output head."""

BASE_BLOCK = 64
"""Values per block of a QLoRA base (``quantize_base``; `entrenar.quant.quantize`'s
default): `lora.apply`, a run's load-time quantizer and the host form all take it."""

_PLAIN = re.compile(r"[A-Za-z0-9_.]+")
_NOT_LINEAR = re.compile(
    r"(^|\.)(embed_tokens|embed|wte|wpe|lm_head|output)(\.|$)|(^|\.)mlp\.gate$"
    r"|(^|\.)\w*norm$"
)


@dataclasses.dataclass(frozen=True)
class LoRAConfig(Config):
    """Settings of a LoRA transform: the ``lora:`` section of a run's YAML file.

    ``init``: ``"kaiming"`` draws ``A ~ U(-1/sqrt(in), 1/sqrt(in))`` (PEFT's default,
    PyTorch's ``kaiming_uniform_(a=sqrt(5))``), ``"gaussian"`` ``A ~ N(0, 1/r²)``;
    ``B = 0`` in both, so the adapted model starts equal to the base model.
    ``dropout`` acts only when keys are supplied with
    `entrenar.lora.with_dropout_keys`. ``use_dora`` adds DoRA's trainable magnitude
    vector (Liu et al. 2024, arXiv:2402.09353). Every field is checked when a
    config is built.

    Example:
        >>> LoRAConfig(rank=8, alpha=16, targets=("q_proj", "v_proj")).scale
        2.0
    """

    enabled: bool = option(True, doc="train LoRA adapters (the section's presence)")
    rank: int = option(
        8, ge=1, aliases=("r",), doc="r, inner dimension of A (r, in) and B (out, r)"
    )
    alpha: float = option(
        16.0, gt=0.0, aliases=("lora_alpha",), doc="scale numerator: update = α/r·BA"
    )
    targets: tuple[str, ...] = option(
        ("q_proj", "v_proj"),
        aliases=("target_modules",),
        doc="module names, regexes or all-linear (PEFT's target_modules; see "
        "entrenar.lora.config)",
    )
    dropout: float = option(
        0.0,
        ge=0.0,
        lt=1.0,
        aliases=("lora_dropout",),
        doc="dropout on the adapter input",
    )
    quantize_base: Literal["none", "nf4", "int4"] = option(
        "none",
        doc="store the adapted base weights 4-bit while training (QLoRA: nf4; a "
        "run passes it to lora.apply as quantize)",
    )
    quantize_untargeted: bool = option(
        False,
        doc="with quantize_base: also store 4-bit the linear weights no target "
        "adapts (every projection and mixture-of-experts stack; not embeddings, the "
        "output head, norms or routers), as bitsandbytes' load_in_4bit does in a "
        "PEFT QLoRA run: the frozen model is 4-bit whatever the targets",
    )
    init: Literal["kaiming", "gaussian"] = option(
        "kaiming", doc="initialisation of A (B starts at zero)"
    )
    rslora: bool = option(False, doc="scale by α/√r (rank-stabilised LoRA)")
    rank_pattern: dict[str, int] = option(
        factory=dict,
        doc="rank per module, {pattern: r} (PEFT's rank_pattern: a key matches the "
        "end of a module name at a dot, e.g. q_proj or model.layers.0.self_attn."
        "q_proj or a regex like layers\\.[0-3]\\.mlp\\..*; first match wins); the "
        "layers of one stacked weight may differ (padded with zeros to the largest, "
        "see specs/lora.md)",
    )
    alpha_pattern: dict[str, float] = option(
        factory=dict,
        doc="alpha per module, {pattern: alpha} (PEFT's alpha_pattern, keys as "
        "rank_pattern's)",
    )
    use_dora: bool = option(
        False,
        aliases=("dora",),
        doc="DoRA: also train a magnitude per output feature, y = m/‖W+sBA‖ ⊙ "
        "(W+sBA)x (PEFT's use_dora; see entrenar.lora.weight)",
    )

    def check(self, path: str) -> None:
        """At least one target; a regular expression is checked before it runs.

        ``rank_pattern`` values are integers >= 1, ``alpha_pattern`` values finite
        numbers > 0; their keys are checked as PEFT runs them.
        """
        _check_patterns(
            f"{path}.rank_pattern", self.rank_pattern, _is_rank, "an integer >= 1"
        )
        _check_patterns(
            f"{path}.alpha_pattern", self.alpha_pattern, _is_alpha, "a number > 0"
        )
        if not self.targets:
            raise ConfigError(f"{path}.targets: empty; name at least one module")
        if self.quantize_untargeted and self.quantize_base == "none":
            raise ConfigError(
                f"{path}.quantize_untargeted: needs {path}.quantize_base: nf4 or "
                "int4 (the scheme the frozen weights are stored in)"
            )
        for t in self.targets:
            if t != ALL_LINEAR and not _PLAIN.fullmatch(t):
                try:
                    check_pattern(t, runs_as=SEARCH)
                except ConfigError as e:
                    raise ConfigError(f"{path}.targets: {e}") from None

    def __hash__(self) -> int:
        """Hashable although the patterns are dicts (by their items)."""
        items = [(f.name, getattr(self, f.name)) for f in dataclasses.fields(self)]
        return hash(
            tuple((k, tuple(v.items()) if isinstance(v, dict) else v) for k, v in items)
        )

    @property
    def scale(self) -> float:
        """``alpha / r`` (``alpha / sqrt(r)`` with rsLoRA; patterns not applied)."""
        return self.alpha / (self.rank**0.5 if self.rslora else self.rank)


def _is_rank(v: object) -> bool:
    return type(v) is int and v >= 1


def _is_alpha(v: object) -> bool:
    return (
        isinstance(v, (int, float))
        and not isinstance(v, bool)
        and math.isfinite(v)
        and v > 0
    )


def _check_patterns(path: str, patterns: object, valid: Any, want: str) -> None:
    """``{pattern: value}``: keys safe to run (`check_peft_key`), values valid."""
    if not isinstance(patterns, dict):
        raise ConfigError(
            f"{path}: must be a mapping {{pattern: value}}, got {patterns!r:.60}"
        )
    for key, value in patterns.items():
        if not isinstance(key, str) or not key:
            raise ConfigError(f"{path}: pattern {key!r:.60} must be a non-empty string")
        if not valid(value):
            raise ConfigError(f"{path}[{key!r:.60}] = {value!r:.40} must be {want}")
        try:
            check_peft_key(key)
        except ConfigError as e:
            raise ConfigError(f"{path}: {e}") from None


def frozen_linear(module: str, per_layer_ndim: int) -> bool:
    """Whether ``quantize_untargeted`` stores the module's weight 4-bit.

    A projection ``(out, in)`` or a mixture of experts' stack ``(E, out, in)`` per
    layer; not embeddings, the output head, norms, a MoE router ``mlp.gate`` or
    Qwen2-MoE's ``shared_expert_gate`` (bitsandbytes' ``load_in_4bit`` keeps the
    head in float too; the routers are kept so routing is unchanged).

    >>> frozen_linear("model.layers.0.mlp.experts.down_proj", 3)
    True
    >>> frozen_linear("model.layers.0.mlp.gate", 2), frozen_linear("lm_head", 2)
    (False, False)
    """
    if module == "shared_expert_gate" or module.endswith(".shared_expert_gate"):
        return False
    return per_layer_ndim in (2, 3) and not _NOT_LINEAR.search(module)


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
    >>> target_matches("all-linear", "model.layers.0.mlp.gate", 2)  # a MoE router
    False
    >>> target_matches("all-linear", "model.layers.0.self_attn.q_norm", 2)  # (H, d)
    False
    """
    if target == ALL_LINEAR:
        return per_layer_ndim == 2 and not _NOT_LINEAR.search(module)
    if _PLAIN.fullmatch(target):
        return module == target or module.endswith("." + target)
    return search_pattern(target, module)


__all__ = ["ALL_LINEAR", "BASE_BLOCK", "LoRAConfig", "frozen_linear", "target_matches"]
