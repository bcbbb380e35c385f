"""Adapters PEFT would drop: dense MLP targets of a mixture of experts PEFT remaps.

transformers 5 fuses a mixture of experts' per-expert ``gate_proj`` / ``up_proj`` /
``down_proj`` Linears into ``(E, ...)`` parameters. So that a PEFT 0.21 config
written for transformers 4 still finds them, `PeftModel.from_pretrained` rewrites
the config of the model types transformers converts like Qwen2-MoE
(``_MODEL_TO_CONVERSION_PATTERN[model_type] == "qwen2_moe"``): every
``gate_proj`` / ``up_proj`` / ``down_proj`` entry of ``target_modules`` becomes a
``target_parameters`` entry of the fused experts (``gate_up_proj``, ``down_proj``)
and is *removed* from ``target_modules``; a regex is first resolved to the leaf
names it matches, so naming one module exactly does not escape it.

A model of these types whose *2-D* MLP is adapted (DeepSeek's and GLM-4.5's dense
first layers and shared experts, a Qwen3-MoE ``mlp_only_layers`` layer) therefore
loads in PEFT with those modules un-adapted, the file's tensors unused, and new
zero adapters on the experts instead (or fails: ``up_proj`` without ``gate_proj``).
Such an adapter is refused before it is written (`check_peft_loadable`); merging
(export formats ``hf`` / ``safetensors``) keeps it. Qwen2-MoE itself is not
converted (its ``shared_expert`` adapters load), nor are Mixtral (no dense MLP),
gpt-oss and Granite MoE (other names).
"""

from __future__ import annotations

from collections.abc import Iterable

from entrenar.errors import CompatibilityError

PEFT_REMAPPED_MODEL_TYPES = frozenset(
    {"afmoe", "beam", "cohere2_moe", "deepseek_v2", "deepseek_v3", "deepseek_v32",
     "dots1", "ernie4_5_moe", "exaone_moe", "flex_olmo", "glm4_moe", "glm4_moe_lite",
     "glm4v_moe", "glm_moe_dsa", "hunyuan_v1_moe", "longcat_flash", "mellum", "olmoe",
     "qwen3_moe", "qwen3_next", "qwen3_omni_moe", "qwen3_omni_moe_text",
     "qwen3_omni_moe_thinker", "sarvam_mla", "solar_open"}
)  # fmt: skip
"""``model_type`` values transformers 5.25 converts as ``qwen2_moe``
(``transformers.conversion_mapping._MODEL_TO_CONVERSION_PATTERN``), whose PEFT
0.21 configs are rewritten (module docstring)."""
REMAPPED_NAMES = ("gate_proj", "up_proj", "down_proj")
"""The ``target_modules`` leaf names PEFT moves to the fused experts."""


def peft_dropped(modules: Iterable[str], model_type: str | None) -> list[str]:
    """The adapted modules PEFT 0.21 would not adapt when it loads the file.

    Args:
        modules: Hugging Face names of the adapted 2-D modules
            (``model.layers.0.mlp.gate_proj``).
        model_type: the model's ``config.json`` ``model_type`` (None: unknown,
            nothing is dropped).
    """
    if model_type not in PEFT_REMAPPED_MODEL_TYPES:
        return []
    return sorted(m for m in modules if m.rsplit(".", 1)[-1] in REMAPPED_NAMES)


def check_peft_loadable(modules: Iterable[str], model_type: str | None) -> None:
    """Refuse adapters that PEFT would drop when it loads them (module docstring).

    Raises:
        CompatibilityError: naming the modules and what to do instead.
    """
    dropped = peft_dropped(modules, model_type)
    if not dropped:
        return
    shown = ", ".join(dropped[:4]) + (
        f" and {len(dropped) - 4} more" if len(dropped) > 4 else ""
    )
    raise CompatibilityError(
        f"a PEFT adapter file of this {model_type} model would lose its adapters on "
        f"{shown}: PEFT 0.21 moves gate_proj / up_proj / down_proj targets of "
        f"{model_type} models to the fused experts (transformers 5's conversion), so "
        f"these dense MLP adapters would not load. Merge them instead (export "
        f"formats [hf] or [safetensors]), or target other modules (attention "
        f"projections) for a PEFT adapter"
    )
