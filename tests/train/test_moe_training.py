"""Training mixture-of-experts models against transformers and PEFT.

Full fine-tuning: the Trainer's loss (`entrenar.train.causal_lm_loss_fn`) and its
gradient for every parameter, over three SGD steps, equal transformers' loss (with
``output_router_logits`` and ``router_aux_loss_coef``: the Switch load-balancing
term included) and its gradients. LoRA on the experts: PEFT 0.21 adapts
transformers 5.25's fused expert tensors (``target_parameters``, one A and B per
expert); on ``experts.down_proj`` that is the same parameterisation as entrenar's
per-expert adapter, so logits and gradients are compared there. A YAML QLoRA run on
attention and experts quantizes the expert stacks to NF4 and exports a folder
transformers loads.
"""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import yaml

from entrenar import lora, nn, quant
from entrenar.errors import CompatibilityError
from entrenar.train import causal_lm_loss_fn

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
import moe_cases  # noqa: E402  (needs torch and transformers)

pytestmark = pytest.mark.usefixtures("quick_compiles")
MOE = ("mixtral", "qwen3_moe", "qwen2_moe", "gpt_oss", "olmoe", "granitemoe",
       "granitemoeshared")  # fmt: skip


_models, _batch = moe_cases.models, moe_cases.batch


def _torch_grads(model, config):
    """The transformers gradients under our tree's names (experts stacked)."""
    grads = {n: p.grad.numpy() for n, p in model.named_parameters()}
    return nn.to_hf_names(
        nn.from_hf_names(
            nn.architecture(config.architecture).from_hf_tensors(grads, config), config
        )
    )


@pytest.mark.parametrize("family", MOE)
@pytest.mark.parametrize("aux", [False, True])
def test_full_finetuning_steps_equal_transformers(family, aux):
    config, params, model = _models(
        family, output_router_logits=aux, router_aux_loss_coef=0.3
    )
    tokens, mask, labels = _batch(config.vocab_size)
    batch = {
        "input_ids": jnp.asarray(tokens),
        "attention_mask": jnp.asarray(mask.astype(bool)),
        "labels": jnp.asarray(labels),
    }
    grad_fn = jax.jit(jax.value_and_grad(
        lambda p: causal_lm_loss_fn(config)(p, batch, key=None)[0]
    ))  # fmt: skip
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    for _ in range(3):
        opt.zero_grad()
        out = model(
            torch.from_numpy(tokens), attention_mask=torch.from_numpy(mask),
            labels=torch.from_numpy(labels),
        )  # fmt: skip
        assert (out.aux_loss is not None) == aux
        out.loss.backward()
        loss, grads = grad_fn(params)
        np.testing.assert_allclose(float(loss), out.loss.item(), rtol=1e-5)
        want = _torch_grads(model, config)
        got = nn.to_hf_names(grads)
        assert set(got) == set(want)
        for name, g in got.items():
            np.testing.assert_allclose(
                np.asarray(g), want[name], atol=2e-6, rtol=1e-3, err_msg=name
            )
        router = "model.layers.0.mlp.gate.weight"
        assert np.abs(want[router]).max() > 0  # the router is trained
        opt.step()
        params = jax.tree.map(lambda p, g: p - 0.5 * g, params, grads)


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss", "olmoe", "granitemoe"])
def test_expert_lora_equals_peft_target_parameters(family, tmp_path):
    """Per-expert LoRA on experts.down_proj against PEFT's ParamWrapper.

    gpt-oss stores ``down_proj (E, I, D)`` transposed (``is_transposed``): PEFT's
    delta is then ``(B_e A_e)ᵀ``, entrenar's ``B_e A_e`` on ``(E, D, I)``, the same
    factors. No PEFT file form is written for it (PEFT adapts gate and up fused):
    refused.
    """
    config, params, model = _models(family)
    cfg = lora.LoRAConfig(rank=2, alpha=4.0, targets=("q_proj", "experts.down_proj"))
    lp = lora.apply(params, cfg, key=jax.random.key(3))
    rng = np.random.default_rng(5)

    def fill(x):
        if isinstance(x, lora.LoRAWeight):
            return x.replace(
                b=jnp.asarray(rng.normal(size=x.b.shape) * 0.2, jnp.float32)
            )
        return x

    lp = jax.tree.map(fill, lp, is_leaf=lambda x: isinstance(x, lora.LoRAWeight))
    block = "block_sparse_moe" if family == "granitemoe" else "mlp"
    pcfg = peft.LoraConfig(
        r=2, lora_alpha=4, target_modules=["q_proj"],
        target_parameters=[f"{block}.experts.down_proj"],
    )  # fmt: skip
    pm = peft.get_peft_model(model, pcfg)
    layers = lp["model"]["layers"]
    down = layers["mlp"]["experts"]["down_proj"][
        "weight"
    ]  # A (L, E, r, I), B (L, E, D, r)
    q = layers["self_attn"]["q_proj"]["weight"]  # A (L, r, D), B (L, H d, r)
    e, r = config.num_experts, 2
    with torch.no_grad():
        for i, layer in enumerate(pm.base_model.model.model.layers):
            ex = getattr(layer, block).experts
            a = np.asarray(down.a[i]).reshape(e * r, -1)  # (E r, I): expert-major
            b = np.asarray(down.b[i]).transpose(1, 2, 0).reshape(-1, r * e)  # (D, r E)
            ex.lora_A["default"].weight.copy_(torch.from_numpy(a))
            ex.lora_B["default"].weight.copy_(torch.from_numpy(b))
            qp = layer.self_attn.q_proj
            qp.lora_A["default"].weight.copy_(torch.from_numpy(np.asarray(q.a[i])))
            qp.lora_B["default"].weight.copy_(torch.from_numpy(np.asarray(q.b[i])))
    tokens, mask, labels = _batch(config.vocab_size)
    out = pm(
        torch.from_numpy(tokens), attention_mask=torch.from_numpy(mask),
        labels=torch.from_numpy(labels),
    )  # fmt: skip
    out.loss.backward()
    batch = {
        "input_ids": jnp.asarray(tokens),
        "attention_mask": jnp.asarray(mask.astype(bool)),
        "labels": jnp.asarray(labels),
    }
    trainable, frozen = lora.split(lp)
    loss, g = jax.value_and_grad(
        lambda t: causal_lm_loss_fn(config)(lora.combine(t, frozen), batch, key=None)[0]
    )(trainable)
    np.testing.assert_allclose(float(loss), out.loss.item(), rtol=1e-5)
    gd = g["model"]["layers"]["mlp"]["experts"]["down_proj"]["weight"]
    for i, layer in enumerate(pm.base_model.model.model.layers):
        ex = getattr(layer, block).experts
        ga = ex.lora_A["default"].weight.grad.numpy().reshape(e, r, -1)
        gb = (
            ex.lora_B["default"]
            .weight.grad.numpy()
            .reshape(-1, r, e)
            .transpose(2, 0, 1)
        )
        np.testing.assert_allclose(np.asarray(gd.a[i]), ga, atol=1e-6, rtol=1e-4)
        np.testing.assert_allclose(np.asarray(gd.b[i]), gb, atol=1e-6, rtol=1e-4)
    with pytest.raises(
        CompatibilityError, match=r"experts\.down_proj\.weight adapts a"
    ):
        lora.save_adapter(lp, tmp_path)


QLORA_SIZES = {
    "qwen2_moe": {"intermediate_size": 128, "moe_intermediate_size": 64,
                  "shared_expert_intermediate_size": 64},
    "gpt_oss": {"intermediate_size": 64},
    "granitemoe": {"intermediate_size": 64},  # fused input_linear written back
}  # fmt: skip


@pytest.mark.parametrize("family", ["qwen2_moe", "gpt_oss", "granitemoe"])
def test_qlora_run_on_attention_and_experts(family, tmp_path):
    """A YAML run: NF4 expert stacks, LoRA on them, a folder transformers loads.

    (gpt-oss: the experts' biases stay float, only their weights are quantized;
    the folder holds its experts as the Hub's MXFP4, which transformers dequantizes.)
    """
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "io"))
    import hf_cases

    from entrenar import io
    from entrenar.runs import load_built, train_from_yaml
    from entrenar.runs.models import base_quantizer

    config = dataclasses.replace(
        nn.architecture(family).tiny(), vocab_size=512, hidden_size=64,
        num_heads=4, head_dim=16, **QLORA_SIZES[family],
    )  # fmt: skip
    hf_cases.write_tokenizer(tmp_path / "tok", family)
    tok = io.HFTokenizer.from_folder(tmp_path / "tok")
    io.save_hf_folder(tmp_path / "hf", config, config.init(jax.random.key(0)),
                      tokenizer=tok)  # fmt: skip
    rows = [{"messages": hf_cases.MESSAGES[:2]}] * 8
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    targets = ["q_proj", "v_proj", "experts.gate_proj", "experts.up_proj",
               "experts.down_proj"]  # fmt: skip
    doc = {
        "model": {"path": str(tmp_path / "hf")},
        "data": {"train": str(tmp_path / "chat.jsonl"), "format": "chat",
                 "batch_size": 4, "seq_len": 64},
        "lora": {"rank": 4, "alpha": 8, "targets": targets, "quantize_base": "nf4"},
        "optimizer": {"name": "adamw", "lr": 0.01},
        "training": {"max_steps": 3, "output_dir": str(tmp_path / "out")},
        "export": {"formats": ["hf"]},
    }  # fmt: skip
    if family == "gpt_oss":  # the Hub's MXFP4 experts, as openai/gpt-oss ships them
        doc["export"]["hf_expert_type"] = "MXFP4"
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(doc))
    quantize = base_quantizer(
        lora.LoRAConfig(targets=tuple(targets), quantize_base="nf4")
    )
    shape = (2, 4, 64, 64)
    assert quantize("model.layers.mlp.experts.up_proj.weight", shape) is not None
    assert quantize("model.layers.mlp.gate.weight", (2, 4, 64)) is None
    result = train_from_yaml(tmp_path / "run.yaml", progress=False)
    losses = [m["loss"] for m in result.train.history if "loss" in m]
    assert losses and all(np.isfinite(losses)) and result.train.steps == 3
    ex = result.train.state.params["model"]["layers"]["mlp"]["experts"]
    node = ex["down_proj"]["weight"]  # LoRA on an NF4 stack (L, E, D, I)
    assert isinstance(node, lora.LoRAWeight) and quant.is_quantized(node.base)
    assert node.a.shape == (2, 4, 4, 64)  # (L, E, r, I): an adapter per expert
    if config.moe_bias:
        assert not quant.is_quantized(ex["down_proj"]["bias"])
    back = load_built(result.files["hf"])
    hf_config = json.loads((Path(result.files["hf"]) / "config.json").read_text())
    mxfp4 = hf_config.get("quantization_config", {}).get("quant_method") == "mxfp4"
    assert mxfp4 == (family == "gpt_oss")
    model = transformers.AutoModelForCausalLM.from_pretrained(result.files["hf"])
    tokens = np.arange(9).reshape(1, 9) * 5 % 90
    with torch.no_grad():
        want = model(torch.from_numpy(tokens)).logits.numpy()
    got = np.asarray(back.config.apply(back.params, jnp.asarray(tokens)))
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)
