"""Mixtral / Qwen3-MoE / Qwen2-MoE checkpoints: the Hub's names, and what is refused.

Logits and LoRA/DoRA parity with transformers and PEFT are in test_families.py and
tests/io/test_hf_families.py (every registered family); here: the per-expert names
transformers 5.25's ``save_pretrained`` writes are the ones entrenar reads and
writes, and configs entrenar does not implement are refused naming the key.
"""

import dataclasses
import json

import jax
import numpy as np
import pytest

from entrenar import io, nn
from entrenar.errors import ConfigError, FormatError, UnsupportedError
from entrenar.io.gguf_reader import GGUFField, GGUFValueType

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
safetensors = pytest.importorskip("safetensors")

MOE = ("mixtral", "qwen3_moe", "qwen2_moe", "olmoe", "granitemoe", "granitemoeshared")
HUB_EXPERT = {  # a name of layer 1's experts in the Hub's (save_pretrained's) form
    "mixtral": "block_sparse_moe.experts.3.w2.weight",
    "qwen3_moe": "mlp.experts.3.down_proj.weight",
    "qwen2_moe": "mlp.experts.3.down_proj.weight",
    "olmoe": "mlp.experts.3.down_proj.weight",
    "granitemoe": "block_sparse_moe.input_linear.weight",
    "granitemoeshared": "shared_mlp.input_linear.weight",
}


def _names(folder):
    with safetensors.safe_open(str(folder / "model.safetensors"), "np") as f:
        return set(f.keys())


@pytest.mark.parametrize("family", MOE)
def test_entrenar_writes_the_names_transformers_writes(family, tmp_path):
    arch = nn.architecture(family)
    config = arch.tiny()
    model = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.for_model(**arch.to_hf(config))
    )
    model.save_pretrained(tmp_path / "hf")
    io.save_hf_folder(tmp_path / "ours", config, config.init(jax.random.key(0)))
    theirs = _names(tmp_path / "hf")
    assert _names(tmp_path / "ours") == theirs
    assert f"model.layers.1.{HUB_EXPERT[family]}" in theirs


def test_a_missing_expert_is_named(tmp_path):
    arch = nn.architecture("qwen3_moe")
    config = arch.tiny()
    io.save_hf_folder(tmp_path, config, config.init(jax.random.key(0)))
    from safetensors.numpy import load_file, save_file

    tensors = load_file(str(tmp_path / "model.safetensors"))
    del tensors["model.layers.1.mlp.experts.2.up_proj.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"), {"format": "pt"})
    with pytest.raises(FormatError, match=r"layer 1 has 3 of its 4 experts' up_proj"):
        io.load_hf_folder(tmp_path)


@pytest.mark.parametrize(
    "extra,named",
    [({"decoder_sparse_step": 2}, "decoder_sparse_step=2"),
     ({"mlp_only_layers": [0]}, r"mlp_only_layers=\[0\]")],
)  # fmt: skip
@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe"])
def test_dense_layers_are_refused_naming_the_key(family, extra, named):
    arch = nn.architecture(family)
    hf = {**arch.to_hf(arch.tiny()), **extra}
    with pytest.raises(UnsupportedError, match=named):
        arch.from_hf(hf)


@pytest.mark.parametrize(
    "model_type", ["llama4", "jamba", "dbrx", "phimoe"],
)  # fmt: skip
def test_other_moe_model_types_are_refused_by_name(model_type, tmp_path):
    hf = {**nn.architecture("mixtral").to_hf(nn.architecture("mixtral").tiny())}
    hf["model_type"] = model_type
    (tmp_path / "config.json").write_text(json.dumps(hf))
    want = f"model_type '{model_type}' is not supported \\(a mixture of experts"
    with pytest.raises(UnsupportedError, match=want):
        io.load_hf_folder(tmp_path)


def test_mixtral_reads_a_null_sliding_window_and_the_hub_expert_key():
    arch = nn.architecture("mixtral")
    hf = {**arch.to_hf(arch.tiny()), "sliding_window": None, "num_local_experts": 6}
    config = arch.from_hf(hf)
    assert config.sliding_window is None and config.num_experts == 6
    qwen = nn.architecture("qwen3_moe")
    hf = qwen.to_hf(qwen.tiny())
    assert "num_experts" in hf  # the Hub's key (transformers 5.25 writes both forms)
    hf["num_local_experts"] = hf.pop("num_experts")
    assert qwen.from_hf(hf) == qwen.tiny()


def test_moe_fields_that_do_not_fit_are_config_errors():
    tiny = nn.architecture("mixtral").tiny()
    for bad in (
        {"num_experts_per_tok": 5},
        {"num_experts_per_tok": 0},
        {"fused_gate_up": True},
        {"mlp_bias": True},
        {"num_experts": 0, "shared_expert_intermediate_size": 8},
        {"num_experts": 0, "shared_mlp_intermediate_size": 8},
        {"shared_mlp_intermediate_size": -1},
    ):
        with pytest.raises(ConfigError, match="LlamaConfig"):
            nn.LlamaConfig(**{**tiny.__dict__, **bad})
    with pytest.raises(UnsupportedError, match="num_experts"):
        nn.architecture("llama").to_hf(dataclasses.replace(tiny, sliding_window=None))


def test_the_loaded_expert_stack_is_the_hub_tensors(tmp_path):
    arch = nn.architecture("mixtral")
    config = arch.tiny()
    hf_cfg = transformers.AutoConfig.for_model(**arch.to_hf(config))
    model = transformers.AutoModelForCausalLM.from_config(hf_cfg)
    model.save_pretrained(tmp_path)
    from safetensors.numpy import load_file

    stored = load_file(str(tmp_path / "model.safetensors"))
    _, params = io.load_hf_folder(tmp_path)
    ex = params["model"]["layers"]["mlp"]["experts"]
    for ours, theirs in (("gate_proj", "w1"), ("up_proj", "w3"), ("down_proj", "w2")):
        want = stored[f"model.layers.1.block_sparse_moe.experts.2.{theirs}.weight"]
        np.testing.assert_array_equal(np.asarray(ex[ours]["weight"][1, 2]), want)


def test_a_streaming_nf4_load_of_experts_equals_the_whole_load(tmp_path):
    """Expert stacks read lazily (ExpertStack) and quantized as they load."""
    from entrenar import lora, quant
    from entrenar.runs.models import base_quantizer

    arch = nn.architecture("qwen2_moe")
    config = dataclasses.replace(
        arch.tiny(), hidden_size=64, num_heads=4, head_dim=16,
        moe_intermediate_size=64, shared_expert_intermediate_size=64,
    )  # fmt: skip
    io.save_hf_folder(tmp_path, config, config.init(jax.random.key(0)))
    targets = ("experts.gate_proj", "experts.up_proj", "experts.down_proj")
    quantize = base_quantizer(lora.LoRAConfig(targets=targets, quantize_base="nf4"))
    _, streamed = io.load_hf_folder(tmp_path, quantize=quantize)
    _, whole = io.load_hf_folder(tmp_path, stream=False)
    ex = streamed["model"]["layers"]["mlp"]["experts"]
    assert all(quant.is_quantized(ex[p]["weight"]) for p in ex)
    plain = whole["model"]["layers"]["mlp"]["experts"]
    for p in ex:  # what BaseQuantize does: NF4 with double quantization
        want = quant.quantize(plain[p]["weight"], "nf4", double_quant=True)
        got = ex[p]["weight"]
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=p)


@pytest.mark.parametrize(
    ("arch_name", "error", "match"),
    [
        ("llama", FormatError, "tensor 'blk.0.ffn_gate_inp.weight' is missing"),
        ("qwen3moe", FormatError, "tensor 'blk.0.ffn_gate_inp.weight' is missing"),
        ("qwen2", UnsupportedError, "mixture of experts .* in general.architecture"),
    ],
)
def test_an_expert_count_without_experts_is_refused(arch_name, error, match, tmp_path):
    """An expert_count in a dense file is refused.

    Mixtral (llama) and Qwen MoE files lack the experts' tensors; Qwen2 reads no
    experts at all (tests/io/test_gguf_moe.py reads real MoE files).
    """
    config = nn.LlamaConfig(**{**nn.decoder_config.TINY_SIZES})
    io.save_llama_gguf(tmp_path / "a.gguf", config, config.init(jax.random.key(0)))
    g = io.read_gguf(tmp_path / "a.gguf")
    fields = {k.replace("llama.", f"{arch_name}."): v for k, v in g.fields.items()}
    fields["general.architecture"] = GGUFField(arch_name, GGUFValueType.STRING)
    fields[f"{arch_name}.expert_count"] = GGUFField(4, GGUFValueType.UINT32)
    fields[f"{arch_name}.expert_used_count"] = GGUFField(2, GGUFValueType.UINT32)
    tensors = {
        n: io.GGUFTensor(g.raw(n), t.shape, t.type_id) for n, t in g.tensors.items()
    }
    io.write_gguf(tmp_path / "moe.gguf", fields, tensors)
    with pytest.raises(error, match=match):
        io.load_llama_gguf(tmp_path / "moe.gguf")


def _hf_logits(arch, config, **changes):
    """The logits of transformers' model of ``config`` (seeded), ``changes`` set."""
    hf_cfg = transformers.AutoConfig.for_model(**{**arch.to_hf(config), **changes})
    hf_cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(hf_cfg).float().eval()
    tokens = torch.arange(10).reshape(1, 10) * 7 % config.vocab_size
    with torch.no_grad():
        return model(tokens).logits.numpy(), model


def test_olmoe_clip_qkv_bites_and_equals_transformers():
    """The tiny's clip_qkv changes transformers' logits, and entrenar follows it."""
    arch = nn.architecture("olmoe")
    config = arch.tiny()
    want, model = _hf_logits(arch, config)
    unclipped, _ = _hf_logits(arch, config, clip_qkv=None)
    assert np.abs(want - unclipped).max() > 1e-3  # the clip is not a no-op here
    flat = {k: v.numpy() for k, v in model.state_dict().items()}
    params = nn.from_hf_names(arch.from_hf_tensors(flat, config), config)
    tokens = np.arange(10).reshape(1, 10) * 7 % config.vocab_size
    got = np.asarray(config.apply(params, tokens))
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
    off = np.asarray(dataclasses.replace(config, clip_qkv=None).apply(params, tokens))
    np.testing.assert_allclose(off, unclipped, atol=1e-5, rtol=1e-5)


def test_the_loaded_granitemoe_stacks_are_the_hub_fused_tensors(tmp_path):
    """input_linear (E, 2I, D) is [gate; up]; router.layer is the router."""
    arch = nn.architecture("granitemoe")
    _, model = _hf_logits(arch, arch.tiny())
    model.save_pretrained(tmp_path)
    from safetensors.numpy import load_file

    stored = load_file(str(tmp_path / "model.safetensors"))
    _, params = io.load_hf_folder(tmp_path)
    mlp = params["model"]["layers"]["mlp"]
    fused = stored["model.layers.1.block_sparse_moe.input_linear.weight"]
    i = fused.shape[1] // 2
    ex = mlp["experts"]
    np.testing.assert_array_equal(
        np.asarray(ex["gate_proj"]["weight"][1]), fused[:, :i]
    )
    np.testing.assert_array_equal(np.asarray(ex["up_proj"]["weight"][1]), fused[:, i:])
    np.testing.assert_array_equal(
        np.asarray(ex["down_proj"]["weight"][1]),
        stored["model.layers.1.block_sparse_moe.output_linear.weight"],
    )
    np.testing.assert_array_equal(
        np.asarray(mlp["gate"]["weight"][1]),
        stored["model.layers.1.block_sparse_moe.router.layer.weight"],
    )


@pytest.mark.parametrize(
    "family,change,named",
    [
        ("olmoe", {"head_dim": 16}, "head_dim 16 has no OLMoE"),
        ("olmoe", {"moe_intermediate_size": 24}, "intermediate_size wide"),
        ("olmoe", {"qk_norm_whole": False}, "qk_norm_whole must be True"),
        ("granitemoe", {"norm_topk_prob": False}, "norm_topk_prob=False"),
        ("granitemoe", {"clip_qkv": 1.0}, "clip_qkv=1.0 has no GraniteMoe"),
        ("granitemoe", {"shared_mlp_intermediate_size": 8}, "GraniteMoe sets"),
    ],
)
def test_configs_without_a_config_json_form_are_refused(family, change, named):
    arch = nn.architecture(family)
    with pytest.raises(UnsupportedError, match=named):
        arch.to_hf(dataclasses.replace(arch.tiny(), **change))


def test_olmoe_heads_narrower_than_hidden_over_heads_are_refused_when_read():
    arch = nn.architecture("olmoe")
    hf = {**arch.to_hf(arch.tiny()), "head_dim": 16}
    with pytest.raises(UnsupportedError, match="head_dim 16 is not hidden_size"):
        arch.from_hf(hf)
    with pytest.raises(ConfigError, match="clip_qkv must be > 0"):
        dataclasses.replace(arch.tiny(), clip_qkv=0.0)


@pytest.mark.parametrize("name", ["dbrx", "phimoe"])
def test_moe_gguf_files_entrenar_does_not_implement_are_refused_by_name(name, tmp_path):
    config = nn.LlamaConfig(**{**nn.decoder_config.TINY_SIZES})
    io.save_llama_gguf(tmp_path / "a.gguf", config, config.init(jax.random.key(0)))
    g = io.read_gguf(tmp_path / "a.gguf")
    fields = {k.replace("llama.", f"{name}."): v for k, v in g.fields.items()}
    fields["general.architecture"] = GGUFField(name, GGUFValueType.STRING)
    tensors = {
        n: io.GGUFTensor(g.raw(n), t.shape, t.type_id) for n, t in g.tensors.items()
    }
    io.write_gguf(tmp_path / "moe.gguf", fields, tensors)
    want = f"'{name}' is not supported .*reads Mixtral .*deepseek2 and glm4moe"
    with pytest.raises(UnsupportedError, match=want):
        io.load_llama_gguf(tmp_path / "moe.gguf")
