"""Adapters PEFT cannot hold as trained are refused before they are written.

PEFT 0.21 rewrites the config of the model types transformers 5 converts like
Qwen2-MoE: ``gate_proj`` / ``up_proj`` / ``down_proj`` targets move to the fused
experts (`entrenar.lora.peft_moe`). The first tests pin that behaviour of PEFT (if
PEFT changes it they fail, and the refusal should go); the others check that
entrenar refuses such a file, and a stack of experts' adapters, with the reason.
"""

from __future__ import annotations

import jax
import pytest

from entrenar import lora, nn
from entrenar.errors import CompatibilityError
from entrenar.lora.adapter_io import check_saveable
from entrenar.lora.peft_moe import PEFT_REMAPPED_MODEL_TYPES, peft_dropped

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

MLP = ["gate_proj", "up_proj", "down_proj"]


def _peft_adapted(model) -> set[str]:
    """The modules PEFT put adapters on for the MLP targets."""
    pm = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=MLP))
    return {n.split(".lora_")[0] for n, _ in pm.named_parameters() if ".lora_" in n}


def _tiny_qwen3_moe(**extra):
    config = transformers.Qwen3MoeConfig(
        vocab_size=32, hidden_size=16, intermediate_size=24, moe_intermediate_size=8,
        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        num_experts=2, num_experts_per_tok=1, **extra,
    )  # fmt: skip
    return transformers.Qwen3MoeForCausalLM(config)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # PEFT: unmatched patterns
def test_peft_moves_dense_mlp_targets_of_a_remapped_type_to_the_experts():
    """Qwen3-MoE's dense layer 0 (``mlp_only_layers``) gets no MLP adapter."""
    assert "qwen3_moe" in PEFT_REMAPPED_MODEL_TYPES
    adapted = _peft_adapted(_tiny_qwen3_moe(mlp_only_layers=[0]))
    assert not any(".layers.0.mlp." in m for m in adapted), adapted
    assert any(m.endswith("layers.1.mlp.experts") for m in adapted), adapted


def test_peft_adapts_qwen2_moes_shared_expert():
    """Qwen2-MoE itself is not converted: its shared expert's adapters load."""
    assert "qwen2_moe" not in PEFT_REMAPPED_MODEL_TYPES
    config = transformers.Qwen2MoeConfig(
        vocab_size=32, hidden_size=16, intermediate_size=24, moe_intermediate_size=8,
        shared_expert_intermediate_size=8, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, num_experts=2, num_experts_per_tok=1,
    )  # fmt: skip
    adapted = _peft_adapted(transformers.Qwen2MoeForCausalLM(config))
    assert {m.rsplit(".", 2)[-2:][0] for m in adapted} == {"shared_expert"}, adapted


def _deepseek(targets: list[str]):
    config = nn.architecture("deepseek_v3").tiny()
    assert config.first_k_dense_replace >= 1  # a dense MLP in layer 0
    params = config.init(jax.random.key(0))
    cfg = lora.LoRAConfig(rank=2, targets=tuple(targets))
    return lora.apply(params, cfg, key=jax.random.key(1))


def test_save_adapter_refuses_deepseeks_dense_mlp_adapters(tmp_path):
    # "gate_proj" alone would also select the experts' stacks (refused for that)
    params = _deepseek(["q_a_proj", "mlp.gate_proj", "shared_experts.up_proj"])
    with pytest.raises(CompatibilityError) as e:
        lora.save_adapter(params, tmp_path / "a", model_type="deepseek_v3")
    assert "model.layers.0.mlp.gate_proj" in str(e.value)
    assert "model.layers.1.mlp.shared_experts.up_proj" in str(e.value)
    assert "export formats [hf] or [safetensors]" in str(e.value)
    assert not (tmp_path / "a").exists()  # refused before anything is written


def test_save_adapter_writes_deepseeks_attention_adapters(tmp_path):
    params = _deepseek(["q_a_proj", "o_proj"])
    lora.save_adapter(params, tmp_path / "a", model_type="deepseek_v3")
    assert (tmp_path / "a" / "adapter_model.safetensors").exists()


def test_the_same_adapters_save_for_a_type_peft_does_not_remap():
    modules = ["model.layers.0.mlp.gate_proj", "model.layers.0.self_attn.q_proj"]
    assert peft_dropped(modules, "qwen2_moe") == []
    assert peft_dropped(modules, None) == []
    assert peft_dropped(modules, "glm4_moe") == ["model.layers.0.mlp.gate_proj"]


def test_a_stack_of_experts_adapters_is_refused():
    config = nn.architecture("qwen3_moe").tiny()
    params = lora.apply(
        config.init(jax.random.key(0)),
        lora.LoRAConfig(rank=2, targets=("experts.down_proj",)),
        key=jax.random.key(1),
    )
    stack = r"experts\.down_proj.*stack of experts"
    with pytest.raises(CompatibilityError, match=stack):
        check_saveable(params)
