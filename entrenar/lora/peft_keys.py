"""Which ``adapter_config.json`` settings of PEFT (0.21) `load_adapter` honours.

PEFT's LoRA computes ``y = x Wᵀ + s · (x Aᵀ) Bᵀ`` with ``s = alpha / r`` (or
``alpha / sqrt(r)``), from the A and B tensors of the file (DoRA: rescaled per
output row by ``m / ‖W + s·BA‖``, ``m`` the file's ``lora_magnitude_vector``). A
setting is accepted when that stays the forward PEFT runs:

- honoured: ``r``, ``lora_alpha``, ``rank_pattern``, ``alpha_pattern``,
  ``use_rslora``, ``use_dora`` (on linear modules), ``lora_dropout``, and the
  settings that choose *which* modules
  carry an adapter (``target_modules``, ``exclude_modules``, ``layers_to_transform``,
  ``layers_pattern``, ``target_parameters``): the tensors in the file say which
  modules they are, and a layer without tensors gets a zero adapter;
- no effect on the forward: ``fan_in_fan_out`` (it transposes only the base
  weight of a GPT-2 ``Conv1D``; A and B are ``(r, in)`` / ``(out, r)`` either way),
  the initialisations that do not touch the base weight (``true``, ``false``,
  ``"gaussian"``, ``"eva"``, ``"orthogonal"``), the other methods' settings while
  their method is off, and bookkeeping (task type, versions, runtime options);
- refused, naming the key (`UNSUPPORTED`): settings that change the forward
  (variants such as aLoRA or QA-LoRA, a bias on B, trained base biases, whole modules
  or token rows saved beside the adapter, replicated layers) and initialisations
  that change the base weight itself (PiSSA, OLoRA, CorDA, LoftQ, LoRA-GA, MiCA: the
  adapter is relative to PEFT's modified base).

A key PEFT 0.21 does not have is refused unless its value is empty (``null``,
``false``, ``{}``, ``[]``, ``""``): it may change the forward.
"""

from __future__ import annotations

from typing import Any

from entrenar.errors import UnsupportedError

_MERGE = (
    "merge it into the base in PEFT (merge_and_unload, save_pretrained) and load "
    "the merged model instead"
)

UNSUPPORTED: dict[str, str] = {
    "lora_bias": "B carries a bias vector (lora_B.bias)",
    "use_qalora": "QA-LoRA pools the input in groups before A",
    "alora_invocation_tokens": "activated LoRA applies the adapter only after "
    "its invocation tokens",
    "velora_config": "VeLoRA is a LoRA variant entrenar does not implement",
    "monteclora_config": "MonteCLoRA is a LoRA variant entrenar does not implement",
    "use_bdlora": "block-diagonal LoRA is a variant entrenar does not implement",
    "arrow_config": "Arrow routes between several adapters per token",
    "kasa_config": "KaSA adds a learned singular-value vector between A and B",
    "modules_to_save": "whole modules are trained and saved beside the adapter",
    "trainable_token_indices": "embedding rows are trained and saved beside "
    "the adapter",
    "layer_replication": "the base's layers are replicated into a deeper model",
    "megatron_config": "the adapter is for Megatron's parallel layers",
}
"""Keys refused when set (not ``null`` / ``false`` / empty), with what they do."""

IGNORED = frozenset(
    {
        "peft_type",
        "task_type",
        "auto_mapping",
        "peft_version",
        "base_model_name_or_path",
        "revision",
        "inference_mode",
        "fan_in_fan_out",
        "megatron_core",
        "qalora_group_size",
        "runtime_config",
        "ensure_weight_tying",
        "loftq_config",
        "eva_config",
        "corda_config",
        "lora_ga_config",
    }
)
"""Keys without effect on the forward of a plain LoRA adapter (module docstring)."""

HONOURED = frozenset(
    {
        "r",
        "lora_alpha",
        "lora_dropout",
        "use_rslora",
        "rank_pattern",
        "alpha_pattern",
        "target_modules",
        "exclude_modules",
        "layers_to_transform",
        "layers_pattern",
        "target_parameters",
        "bias",
        "init_lora_weights",
        "use_dora",
    }
)
"""Keys `load_adapter` reads or whose effect the file's tensors carry."""

PLAIN_INITS = (True, False, "gaussian", "eva", "orthogonal")
"""``init_lora_weights`` values that leave the base weight as it is."""


def _empty(value: Any) -> bool:
    return value is None or value is False or value in ({}, [], "")


_RUN_IN_PEFT = frozenset({"alora_invocation_tokens", "arrow_config"})
"""Keys whose adapter cannot be merged into a base: it must run in PEFT."""


def check_peft_keys(cfg: dict[str, Any], file: str) -> None:
    """Refuse the settings of ``cfg`` that `load_adapter` would not honour.

    Raises:
        UnsupportedError: the message names the file, the key and its value, says
            what it does and what to do.
    """
    for key, value in cfg.items():
        if key in UNSUPPORTED and not _empty(value):
            todo = "run this adapter with PEFT" if key in _RUN_IN_PEFT else _MERGE
            raise UnsupportedError(
                f"{file}: {key}={value!r:.60} is not supported ({UNSUPPORTED[key]}); "
                f"{todo}"
            )
        if key not in UNSUPPORTED and key not in IGNORED | HONOURED:
            if not _empty(value):
                raise UnsupportedError(
                    f"{file}: unknown key {key!r} = {value!r:.60} (not a PEFT 0.21 "
                    f"LoRA setting; it may change the adapter's forward); {_MERGE}, "
                    "or delete the key if it is at its default"
                )
    init = cfg.get("init_lora_weights", True)
    if not any(init is v or (isinstance(v, str) and init == v) for v in PLAIN_INITS):
        raise UnsupportedError(
            f"{file}: init_lora_weights={init!r:.40} is not supported (PiSSA, OLoRA, "
            "CorDA, LoftQ and LoRA-GA adapters fit only the base PEFT modified when "
            "it initialised them, W - s·B₀A₀; MiCA is a variant); convert the "
            "adapter in PEFT with save_pretrained(..., "
            "path_initial_model_for_weight_conversion=<the initial adapter>), which "
            f"writes an ordinary LoRA adapter, or {_MERGE}"
        )
    if cfg.get("bias", "none") not in ("none", None):
        raise UnsupportedError(
            f"{file}: bias={cfg['bias']!r:.40} is not supported (the base's biases "
            f"are trained and saved beside the adapter); {_MERGE}"
        )


__all__ = ["HONOURED", "IGNORED", "PLAIN_INITS", "UNSUPPORTED", "check_peft_keys"]
