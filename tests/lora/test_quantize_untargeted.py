"""``lora.quantize_untargeted``: the frozen linear weights no target adapts, 4-bit.

The reference for *which* weights: bitsandbytes' ``load_in_4bit`` in a PEFT QLoRA
run replaces every ``torch.nn.Linear`` of the transformers model but the output head
(``get_keys_to_not_convert``) — computed here from transformers' own modules. For
*what* the model computes: the same model with each of those weights replaced by its
NF4 round trip (`entrenar.quant.dequantize`, checked against the paper's code book in
tests/quant), so the 4-bit leaves without adapters must change nothing else.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import yaml

from entrenar import lora, nn, quant
from entrenar.errors import ConfigError
from entrenar.lora.names import hf_modules, named_weight_leaves
from entrenar.nn.weight_node import is_weight_node, logical_shape

pytestmark = pytest.mark.usefixtures("quick_compiles")

SIZES = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_heads=4,
             num_kv_heads=2, head_dim=16, num_layers=2)  # fmt: skip
"""Every projection's input a multiple of NF4's 64-value blocks."""


def _config(family: str, **fields):
    return dataclasses.replace(nn.architecture(family).tiny(), **SIZES, **fields)


def _quantized_modules(params) -> set[str]:
    """Hugging Face module names whose weight the tree stores 4-bit."""
    out = set()
    for name, leaf in named_weight_leaves(params):
        base = leaf.base if isinstance(leaf, lora.LoRAWeight) else leaf
        if quant.is_quantized(base):
            out.update(hf_modules(name, logical_shape(leaf)))
    return out


def _qlora(params, targets, untargeted=True, scheme="nf4"):
    c = lora.LoRAConfig(rank=4, targets=targets, quantize_base=scheme,
                        quantize_untargeted=untargeted)  # fmt: skip
    return lora.apply(params, c, key=jax.random.key(1), quantize=scheme)


@pytest.mark.parametrize("family", ["llama", "phi3", "qwen2", "gemma3"])
def test_the_4bit_weights_are_those_bitsandbytes_converts(family):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    config = _config(family)
    hf = transformers.AutoConfig.for_model(**nn.architecture(family).to_hf(config))
    model = transformers.AutoModelForCausalLM.from_config(hf)
    want = {
        n for n, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and n != "lm_head"
    }  # fmt: skip
    params = config.init(jax.random.key(0))
    got = _quantized_modules(_qlora(params, ["q_proj", "qkv_proj"]))
    assert got == want
    assert _quantized_modules(_qlora(params, ["q_proj", "qkv_proj"], False)) < want


def test_experts_are_4bit_and_routers_are_not():
    config = _config("qwen2_moe", moe_intermediate_size=64,
                     shared_expert_intermediate_size=64)  # fmt: skip
    params = _qlora(config.init(jax.random.key(0)), ["q_proj"])
    mlp = params["model"]["layers"]["mlp"]
    for proj in ("gate_proj", "up_proj", "down_proj"):
        assert quant.is_quantized(mlp["experts"][proj]["weight"])
        assert quant.is_quantized(mlp["shared_expert"][proj]["weight"])
    for router in ("gate", "shared_expert_gate"):
        assert not quant.is_quantized(mlp[router]["weight"])
    assert not quant.is_quantized(params["lm_head"]["weight"])
    assert not quant.is_quantized(params["model"]["embed_tokens"]["weight"])


def _round_trip(params, targets):
    """Every weight `_qlora` stores 4-bit, as float32 again; adapters as `_qlora`'s."""
    q = _qlora(params, targets)
    flat, treedef = jax.tree_util.tree_flatten(q, is_leaf=is_weight_node)
    dense = []
    for leaf in flat:
        if quant.is_quantized(leaf):
            leaf = quant.dequantize(leaf, jnp.float32)
        elif isinstance(leaf, lora.LoRAWeight):
            leaf = leaf.replace(base=quant.dequantize(leaf.base, jnp.float32))
        dense.append(leaf)
    return q, jax.tree_util.tree_unflatten(treedef, dense)


@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_logits_and_adapter_gradients_equal_the_dequantized_model(family):
    extra = {"moe_intermediate_size": 64} if family == "qwen3_moe" else {}
    config = _config(family, **extra)
    q, dense = _round_trip(config.init(jax.random.key(0)), ["q_proj", "v_proj"])
    assert len(_quantized_modules(q)) > 2 * 2  # more than the targets' layers
    tokens = jnp.arange(24).reshape(2, 12) * 7 % SIZES["vocab_size"]

    def loss(params):
        t, f = lora.split(params)

        def fn(t):
            logits = config.apply(lora.combine(t, f), tokens)
            return nn.causal_lm_loss(logits, tokens), logits

        return jax.value_and_grad(fn, has_aux=True)(t)

    (lq, logits_q), gq = loss(q)
    (ld, logits_d), gd = loss(dense)
    np.testing.assert_allclose(logits_q, logits_d, atol=2e-5, rtol=1e-5)
    np.testing.assert_allclose(lq, ld, rtol=1e-6)
    for a, b in zip(jax.tree_util.tree_leaves(gq), jax.tree_util.tree_leaves(gd)):
        np.testing.assert_allclose(a, b, atol=1e-6, rtol=1e-4)


def test_a_weight_whose_blocks_do_not_divide_stays_float():
    config = dataclasses.replace(_config("llama"), intermediate_size=96)
    params = _qlora(config.init(jax.random.key(0)), ["q_proj"])
    mlp = params["model"]["layers"]["mlp"]
    assert quant.is_quantized(mlp["up_proj"]["weight"])  # (96, 64): in blocks
    assert not quant.is_quantized(mlp["down_proj"]["weight"])  # (64, 96): not


def test_it_needs_a_scheme():
    with pytest.raises(ConfigError, match=r"quantize_untargeted: needs "
                       r"\S*quantize_base: nf4 or int4"):  # fmt: skip
        lora.LoRAConfig.from_dict({"quantize_untargeted": True})


def test_a_run_trains_and_plans_a_4bit_frozen_model(tmp_path):
    """A QLoRA run on q/v: the MLP stored NF4 too; the plan counts it; exports fold."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "io"))
    import hf_cases

    from entrenar import io
    from entrenar.config import validate
    from entrenar.runs import load_built, train_from_yaml
    from entrenar.runs.memory_plan import plan_memory
    from entrenar.tree import tree_bytes

    config = _config("llama")
    hf_cases.write_tokenizer(tmp_path / "tok", "llama")
    tok = io.HFTokenizer.from_folder(tmp_path / "tok")
    io.save_hf_folder(tmp_path / "hf", config, config.init(jax.random.key(0)),
                      tokenizer=tok)  # fmt: skip
    rows = [{"messages": hf_cases.MESSAGES[:2]}] * 8
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))

    def doc(untargeted):
        return {
            "model": {"path": str(tmp_path / "hf")},
            "data": {"train": str(tmp_path / "chat.jsonl"), "format": "chat",
                     "batch_size": 4, "seq_len": 64},
            "lora": {"rank": 4, "alpha": 8, "targets": ["q_proj", "v_proj"],
                     "quantize_base": "nf4", "quantize_untargeted": untargeted},
            "optimizer": {"name": "adamw", "lr": 0.01},
            "training": {"max_steps": 2, "log_every": 1,
                         "output_dir": str(tmp_path / "out")},
            "export": {"formats": ["adapter", "hf"]},
        }  # fmt: skip

    plans = []
    for untargeted in (False, True):
        (tmp_path / "run.yaml").write_text(yaml.safe_dump(doc(untargeted)))
        plans.append(plan_memory(validate(tmp_path / "run.yaml"), compile_step=False))
    assert plans[1].weights < plans[0].weights
    result = train_from_yaml(tmp_path / "run.yaml", progress=False)
    losses = [m["loss"] for m in result.train.history if "loss" in m]
    assert len(losses) == 2 and all(np.isfinite(losses))
    params = result.train.state.params
    got = _quantized_modules(params)
    assert "model.layers.0.mlp.down_proj" in got and "lm_head" not in got
    assert plans[1].weights == pytest.approx(
        tree_bytes(lora.split(params)[1]), rel=0.02
    )
    # the merged export: the adapters folded into the dequantized weights
    back = load_built(result.files["hf"])
    mlp = params["model"]["layers"]["mlp"]["down_proj"]["weight"]
    np.testing.assert_allclose(  # native vs XLA dequantizers: an ulp apart
        back.params["model"]["layers"]["mlp"]["down_proj"]["weight"],
        quant.dequantize(mlp, jnp.float32), rtol=1e-6, atol=1e-9,
    )  # fmt: skip


@pytest.mark.parametrize("family", ["qwen2", "gemma3"])
def test_the_mlp_over_chunks_of_tokens_changes_nothing(family, monkeypatch):
    """`nn.layers.token_chunked`: logits and adapter gradients as the whole MLP.

    A QLoRA step's setup (NF4, every linear layer adapted, bfloat16 matmuls) with
    the chunk bound lowered so each layer's MLP runs over 3 chunks of 8 tokens
    (24 tokens x I 128 over 1024); adapters random so every gradient is non-zero.
    """
    config = _config(family, matmul_dtype="bfloat16")
    q = _qlora(config.init(jax.random.key(0)), "all-linear")
    t, f = lora.split(q)
    leaves, treedef = jax.tree_util.tree_flatten(t)
    keys = jax.random.split(jax.random.key(2), len(leaves))
    t = jax.tree_util.tree_unflatten(treedef, [
        0.05 * jax.random.normal(k, x.shape, x.dtype) for k, x in zip(keys, leaves)
    ])  # fmt: skip
    tokens = jnp.arange(24).reshape(2, 12) * 7 % SIZES["vocab_size"]

    def fn(t):
        logits = config.apply(lora.combine(t, f), tokens)
        return nn.causal_lm_loss(logits, tokens), logits

    (l1, z1), g1 = jax.value_and_grad(fn, has_aux=True)(t)
    monkeypatch.setattr(nn.layers, "MLP_CHUNK_ELEMENTS", 1024)
    (l2, z2), g2 = jax.value_and_grad(fn, has_aux=True)(t)
    jaxpr = str(jax.make_jaxpr(fn)(t))
    assert "length=3" in jaxpr  # the chunked path ran (lax.map over 3 chunks)
    np.testing.assert_allclose(z2, z1, atol=2e-6, rtol=1e-6)
    np.testing.assert_allclose(l2, l1, rtol=1e-6)
    diff = max(float(jnp.max(jnp.abs(a - b)) / (jnp.max(jnp.abs(b)) + 1e-30))
               for a, b in zip(jax.tree_util.tree_leaves(g2),
                               jax.tree_util.tree_leaves(g1)))  # fmt: skip
    assert diff < 1e-5, diff
