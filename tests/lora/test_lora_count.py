"""SmolLM2-135M sizes from shapes only (jax.eval_shape), checked against PEFT."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from entrenar import lora, nn, quant
from entrenar.lora import LoRAConfig
from entrenar.nn import LlamaConfig

SMOL = LlamaConfig.smollm2_135m()
QV = LoRAConfig(rank=8, alpha=16, targets=("q_proj", "v_proj"))


def adapted_shapes(config, **kw):
    shapes = jax.eval_shape(SMOL.init, jax.random.key(0))
    return jax.eval_shape(
        lambda p, k: lora.apply(p, config, key=k, **kw), shapes, jax.random.key(1)
    )


def test_smollm2_rank8_q_v_has_460800_trainable_params():
    rep = lora.trainable_report(adapted_shapes(QV))
    assert rep.trainable_params == 460_800  # 30 · 8 · ((576 + 576) + (576 + 192))
    assert rep.frozen_params == SMOL.num_params() == 134_515_008
    assert rep.trainable_bytes == 4 * 460_800


def test_trainable_count_equals_peft_on_the_same_model():
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    with torch.device("meta"):  # shapes only, nothing allocated
        model = transformers.LlamaForCausalLM(
            transformers.LlamaConfig(**SMOL.to_hf_config())
        )
    pm = peft.get_peft_model(
        model, peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"])
    )
    trainable, total = pm.get_nb_trainable_parameters()
    rep = lora.trainable_report(adapted_shapes(QV))
    assert trainable == rep.trainable_params == 460_800
    assert total == rep.total_params
    al = lora.trainable_report(adapted_shapes(LoRAConfig(rank=4, targets="all-linear")))
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(
            transformers.LlamaConfig(**SMOL.to_hf_config())
        )
    pm = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules="all-linear"))
    assert pm.get_nb_trainable_parameters()[0] == al.trainable_params


def test_qlora_nf4_double_quant_bits_per_param():
    # Whole model, every linear layer 4-bit: sizes of the stored arrays (eval_shape).
    cfg = LoRAConfig(rank=8, targets="all-linear")
    rep = lora.trainable_report(adapted_shapes(cfg, quantize="nf4"))
    linear = [
        s for n, s in jax.tree_util.tree_flatten_with_path(
            adapted_shapes(cfg, quantize="nf4"),
            is_leaf=lambda x: isinstance(x, quant.QuantizedWeight))[0]
        if isinstance(s, quant.QuantizedWeight)
    ]  # fmt: skip
    q_bits = 8 * sum(nn.nbytes(q) for q in linear) / sum(q.size for q in linear)
    assert 4.0 < q_bits <= 4.13, q_bits
    assert rep.frozen_bits_per_param < 32
    # And on real arrays: SmolLM2's stacked v_proj (30, 192, 576), measured.
    w = jnp.asarray(np.random.default_rng(0).normal(size=(30, 192, 576)), jnp.float32)
    lp = lora.apply({"model": {"layers": {"v_proj": {"weight": w}}}},
                    LoRAConfig(rank=8, targets="v_proj"), key=jax.random.key(0),
                    quantize="nf4")  # fmt: skip
    q = lp["model"]["layers"]["v_proj"]["weight"].base
    assert isinstance(q, quant.QuantizedWeight) and q.double_quant
    stored = sum(a.size * a.dtype.itemsize for a in jax.tree_util.tree_leaves(q))
    bits = 8 * stored / w.size
    assert bits <= 4.13, bits
    assert re.search(r"4\.1\d\d bits/param", str(lora.trainable_report(lp)))
