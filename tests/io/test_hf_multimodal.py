"""Gemma 3 and Mistral 3 vision-language folders: their language model, in and out.

transformers 5.25 is the oracle: a tiny random ``Gemma3ForConditionalGeneration`` /
``Mistral3ForConditionalGeneration`` (float32, tests/io/mm_cases.py) saved in the
Hub's key layout (sharded) or the in-memory one loads into entrenar with the text
logits of its forward on ``input_ids``; the folder entrenar exports loads in
transformers with the same text logits and the vision tensors byte for byte; PEFT
0.21's adapters on the ConditionalGeneration model load here and entrenar's load
there; a YAML run trains on such a folder and exports all of it.
"""

from __future__ import annotations

import dataclasses
import json

import jax
import mm_cases as mc
import numpy as np
import pytest
import yaml

from entrenar import io, lora, merge, nn
from entrenar.errors import CompatibilityError, FormatError, UnsupportedError
from entrenar.lora.weight import LoRAWeight
from entrenar.nn import multimodal

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
safetensors = pytest.importorskip("safetensors")
pytest.importorskip("safetensors.numpy")

KINDS = ("gemma3", "mistral3")


def _names(folder) -> set[str]:
    names: set[str] = set()
    for f in folder.glob("*.safetensors"):
        with safetensors.safe_open(f, "np") as st:
            names |= set(st.keys())
    return names


def _entrenar_logits(info, params) -> np.ndarray:
    return np.asarray(info.config.apply(params, mc.TOKENS))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("layout", [multimodal.LEGACY, multimodal.IN_MEMORY])
@pytest.mark.parametrize("tie", [True, False])
def test_a_folder_loads_its_language_model_with_transformers_logits(
    kind, layout, tie, tmp_path
):
    model = mc.model(kind, tie_word_embeddings=tie)
    mc.save(model, tmp_path, layout=layout, shard="20KB")
    assert (tmp_path / "model.safetensors.index.json").exists()  # sharded
    names = _names(tmp_path)
    head = "language_model.lm_head.weight" if layout == "legacy" else "lm_head.weight"
    assert (head in names) == (not tie)
    assert any(n.startswith("language_model.model.") for n in names) == (
        layout == "legacy"
    )
    info, params = io.load_hf_folder(tmp_path)
    family = {"gemma3": "gemma3", "mistral3": "mistral"}[kind]
    assert info.architecture.name == family == io.file_architecture(str(tmp_path))
    assert info.config.hf_wrapper == kind and info.config.tie_word_embeddings == tie
    assert info.multimodal.layout == layout
    vision = [p for n, p in model.named_parameters() if multimodal.is_vision(n)]
    assert info.multimodal.skipped_params == sum(p.numel() for p in vision)
    assert f"{info.multimodal.skipped_params:,} parameters" in info.skipped_note
    np.testing.assert_allclose(
        _entrenar_logits(info, params), mc.text_logits(model), atol=1e-5, rtol=0
    )


def test_gemma3_text_config_keys_left_out_take_transformers_defaults(tmp_path):
    # Gemma 3 4B's text_config names six keys; the rest are Gemma3TextConfig's
    # (6 layers: the 6th global by the default pattern, rotating scaled by 8)
    made = mc.model(
        "gemma3", query_pre_attn_scalar=256, num_hidden_layers=6, layer_types=None
    )
    mc.save(made, tmp_path)
    mc.keep_text_config(tmp_path)
    model = transformers.Gemma3ForConditionalGeneration.from_pretrained(tmp_path)
    assert model.config.text_config.layer_types[-1] == "full_attention"
    info, params = io.load_hf_folder(tmp_path)
    assert info.config.query_pre_attn_scalar == 256.0
    assert info.config.layer_types == tuple(model.config.text_config.layer_types)
    assert info.config.rope_type == "linear" and info.config.rope_factor == 8.0
    assert info.config.rope_theta == 1e6 and info.config.rope_local_theta == 1e4
    np.testing.assert_allclose(
        _entrenar_logits(info, params), mc.text_logits(model.eval()), atol=1e-5
    )


@pytest.mark.parametrize("kind", KINDS)
def test_text_defaults_are_transformers(kind):
    w = multimodal.WRAPPERS[kind]
    gemma = kind == "gemma3"
    cls = transformers.Gemma3TextConfig if gemma else transformers.MistralConfig
    theirs = cls().to_dict() | {"sliding_window_pattern": 6}  # Gemma3's _pattern
    for key, value in w.text_defaults.items():
        assert theirs[key] == value, key
    if kind == "mistral3":  # no text_config at all: Mistral Small 3.1's sizes
        absent = transformers.Mistral3Config().text_config.to_dict()
        absent["rope_theta"] = absent["rope_parameters"]["rope_theta"]
        for key, value in w.absent.items():
            assert absent[key] == value, key


@pytest.mark.parametrize("kind", KINDS)
def test_an_export_is_the_whole_folder_again(kind, tmp_path):
    model = mc.model(kind)
    for layout in (multimodal.LEGACY, multimodal.IN_MEMORY):
        src, out = tmp_path / f"src-{layout}", tmp_path / f"out-{layout}"
        mc.save(model, src, layout=layout)
        (src / "preprocessor_config.json").write_text('{"do_resize": true}')
        info, params = io.load_hf_folder(src)
        params = jax.tree.map(lambda a: a * 1.01, params)  # a fine-tuned model
        io.save_hf_folder(out, info.config, params, source=src, max_shard_bytes=20_000)
        assert json.loads((out / "config.json").read_text()) == json.loads(
            (src / "config.json").read_text()
        )
        assert (out / "preprocessor_config.json").read_text() == '{"do_resize": true}'
        assert _names(out) == _names(src)  # the source's key layout
        back = type(model).from_pretrained(out).eval()
        np.testing.assert_allclose(
            mc.text_logits(back), _entrenar_logits(info, params), atol=1e-5
        )
        theirs, ours = model.state_dict(), back.state_dict()
        for name, value in theirs.items():
            if multimodal.is_vision(name):
                assert torch.equal(value, ours[name]), name


def test_an_export_updates_only_the_text_config_keys_that_changed(tmp_path):
    import dataclasses

    mc.save(mc.model("gemma3"), tmp_path / "src")
    info, params = io.load_hf_folder(tmp_path / "src")
    longer = dataclasses.replace(info.config, max_position_embeddings=128)
    io.save_hf_folder(tmp_path / "out", longer, params, source=tmp_path / "src")
    src = json.loads((tmp_path / "src" / "config.json").read_text())
    out = json.loads((tmp_path / "out" / "config.json").read_text())
    src["text_config"]["max_position_embeddings"] = 128
    assert out == src
    back = transformers.AutoConfig.from_pretrained(tmp_path / "out")
    assert back.text_config.max_position_embeddings == 128


def test_an_export_without_its_source_is_the_language_model_alone(tmp_path):
    model = mc.model("gemma3")
    mc.save(model, tmp_path / "src")
    info, params = io.load_hf_folder(tmp_path / "src")
    with pytest.warns(UserWarning, match="is gone: writing the language model alone"):
        io.save_hf_folder(tmp_path / "out", info.config, params, source="/nowhere")
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert cfg["model_type"] == "gemma3_text"
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    np.testing.assert_allclose(
        mc.text_logits(back.eval()), mc.text_logits(model), atol=1e-5
    )


def _with_b(params, seed: int = 5):
    """``params`` with every LoRA B random (a trained adapter)."""

    def fill(x):
        if not isinstance(x, LoRAWeight):
            return x
        return x.replace(b=jax.random.normal(jax.random.key(seed), x.b.shape) * 0.3)

    return jax.tree.map(fill, params, is_leaf=lambda x: isinstance(x, LoRAWeight))


@pytest.mark.parametrize("kind", KINDS)
def test_peft_adapters_both_ways(kind, tmp_path):
    model = mc.model(kind)
    mc.save(model, tmp_path / "hf")
    info, params = io.load_hf_folder(tmp_path / "hf")
    cls = type(model)
    # entrenar -> PEFT: named on the ConditionalGeneration model, no vision adapter
    cfg = lora.LoRAConfig(rank=2, alpha=4.0, targets=("q_proj", "v_proj"))
    ours = _with_b(lora.apply(params, cfg, key=jax.random.key(3)))
    lora.save_adapter(ours, tmp_path / "ours", config=cfg, wrapper=kind)
    saved = json.loads((tmp_path / "ours" / "adapter_config.json").read_text())
    assert saved["target_modules"] == r"model\.language_model\..*\.(?:q_proj|v_proj)"
    base = cls.from_pretrained(tmp_path / "hf").eval()
    theirs = peft.PeftModel.from_pretrained(base, tmp_path / "ours").eval()
    adapted = [n for n, _ in theirs.named_modules() if n.endswith(".lora_A")]
    assert adapted and not any("vision" in n or "projector" in n for n in adapted)
    np.testing.assert_allclose(
        mc.text_logits(theirs), _entrenar_logits(info, ours), atol=1e-5
    )
    # PEFT -> entrenar, and back to the same tensors
    base = cls.from_pretrained(tmp_path / "hf").eval()
    targets = r"model\.language_model\..*\.(?:k_proj|up_proj)"
    made = peft.get_peft_model(
        base, peft.LoraConfig(r=2, target_modules=targets, init_lora_weights=False)
    ).eval()
    made.save_pretrained(tmp_path / "theirs")
    loaded = lora.load_adapter(tmp_path / "theirs", params, wrapper=kind)
    np.testing.assert_allclose(
        _entrenar_logits(info, loaded), mc.text_logits(made), atol=1e-5
    )
    lora.save_adapter(loaded, tmp_path / "again", wrapper=kind)
    with (
        safetensors.safe_open(tmp_path / "theirs/adapter_model.safetensors", "np") as a,
        safetensors.safe_open(tmp_path / "again/adapter_model.safetensors", "np") as b,
    ):
        assert set(a.keys()) == set(b.keys())
        for k in a.keys():
            np.testing.assert_array_equal(a.get_tensor(k), b.get_tensor(k))


@pytest.mark.parametrize(
    ("kind", "layout"),
    [("gemma3", multimodal.LEGACY), ("mistral3", multimodal.IN_MEMORY)],
)
def test_entrenar_merge_folds_a_peft_adapter_into_the_whole_folder(
    kind, layout, tmp_path
):
    """``model+adapter`` in a merge recipe: PEFT's ``merge_and_unload``, folder kept.

    The adapter (PEFT 0.21, on the ConditionalGeneration model) names the language
    model's modules as ``model.language_model.*`` whichever layout the folder stores.
    """
    model = mc.model(kind)
    mc.save(model, tmp_path / "hf", layout=layout)
    base = mc.text_logits(model)
    targets = r"model\.language_model\..*\.(?:q_proj|up_proj)"
    made = peft.get_peft_model(
        model, peft.LoraConfig(r=2, target_modules=targets, init_lora_weights=False)
    ).eval()
    made.save_pretrained(tmp_path / "ad")
    want = mc.text_logits(made.merge_and_unload())
    recipe = {
        "merge_method": "linear",
        "models": [
            {"model": f"{tmp_path}/hf+{tmp_path}/ad", "parameters": {"weight": 1}}
        ],
        "dtype": "float32",
    }
    merge.run_recipe(recipe, str(tmp_path / "out"))
    assert _names(tmp_path / "out") == _names(tmp_path / "hf")  # the stored layout
    back = type(model).from_pretrained(tmp_path / "out").eval()
    assert np.abs(want - base).max() > 1e-2  # the adapter matters
    np.testing.assert_allclose(mc.text_logits(back), want, atol=1e-5)
    theirs, ours = model.state_dict(), back.state_dict()
    for name, value in theirs.items():
        if multimodal.is_vision(name):
            assert torch.equal(value, ours[name]), name


def test_a_dora_adapter_on_the_head_loads_in_peft(tmp_path):
    model = mc.model("mistral3")  # an untied head
    mc.save(model, tmp_path / "hf")
    info, params = io.load_hf_folder(tmp_path / "hf")
    targets = ("q_proj", "down_proj", "lm_head")
    cfg = lora.LoRAConfig(rank=2, alpha=4.0, targets=targets, use_dora=True)
    ours = _with_b(lora.apply(params, cfg, key=jax.random.key(3)))
    lora.save_adapter(ours, tmp_path / "ad", config=cfg, wrapper="mistral3")
    saved = json.loads((tmp_path / "ad" / "adapter_config.json").read_text())
    assert saved["target_modules"] == (
        r"model\.language_model\..*\.(?:down_proj|q_proj)|lm_head"
    )
    base = type(model).from_pretrained(tmp_path / "hf").eval()
    theirs = peft.PeftModel.from_pretrained(base, tmp_path / "ad").eval()
    adapted = [n for n, _ in theirs.named_modules() if n.endswith(".lora_A")]
    assert len(adapted) == 2 * 2 + 1 and "base_model.model.lm_head.lora_A" in adapted
    np.testing.assert_allclose(
        mc.text_logits(theirs), _entrenar_logits(info, ours), atol=1e-5
    )


def test_a_legacy_named_adapter_loads_and_a_vision_one_is_refused(tmp_path):
    model = mc.model("gemma3")
    mc.save(model, tmp_path / "hf")
    info, params = io.load_hf_folder(tmp_path / "hf")
    cfg = lora.LoRAConfig(rank=2, alpha=4.0, targets=("q_proj",))
    ours = _with_b(lora.apply(params, cfg, key=jax.random.key(3)))
    lora.save_adapter(ours, tmp_path / "ad", wrapper="gemma3")
    file = tmp_path / "ad" / "adapter_model.safetensors"
    tensors, _ = io.read_safetensors(file)
    legacy = {
        k.replace("model.language_model.", "language_model.model."): np.asarray(v)
        for k, v in tensors.items()
    }
    safetensors.numpy.save_file(legacy, str(file), metadata={"format": "pt"})
    back = lora.load_adapter(tmp_path / "ad", params, wrapper="gemma3")
    np.testing.assert_allclose(
        _entrenar_logits(info, back), _entrenar_logits(info, ours), atol=1e-6
    )
    base = transformers.Gemma3ForConditionalGeneration.from_pretrained(tmp_path / "hf")
    made = peft.get_peft_model(base, peft.LoraConfig(r=2, target_modules="all-linear"))
    made.save_pretrained(tmp_path / "all")
    with pytest.raises(CompatibilityError, match="adapt the gemma3 vision tower"):
        lora.load_adapter(tmp_path / "all", params, wrapper="gemma3")


def test_bad_folders_are_refused_by_name(tmp_path):
    model = mc.model("mistral3")
    mc.save(model, tmp_path / "hf", layout="in-memory")
    tensors, _ = io.read_safetensors(tmp_path / "hf" / "model.safetensors")
    mixed = {k: np.asarray(v) for k, v in tensors.items()}
    mixed["language_model.model.norm.weight"] = mixed.pop(
        "model.language_model.norm.weight"
    )
    safetensors.numpy.save_file(mixed, str(tmp_path / "hf" / "model.safetensors"))
    with pytest.raises(FormatError, match="mixes the legacy"):
        io.load_hf_folder(tmp_path / "hf")
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    cfg["text_config"]["model_type"] = "llama"
    (tmp_path / "hf" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(FormatError, match="text_config of model_type 'llama'"):
        io.read_hf_folder(tmp_path / "hf")
    for model_type, why in (("mllama", "cross-attention"), ("qwen2_5_vl", "M-RoPE")):
        (tmp_path / "hf" / "config.json").write_text(
            json.dumps({"model_type": model_type})
        )
        with pytest.raises(UnsupportedError, match=why):
            io.read_hf_folder(tmp_path / "hf")


def test_a_yaml_run_trains_on_a_gemma3_folder_and_exports_it(tmp_path):
    import hf_cases

    from entrenar.runs import train_from_yaml
    from entrenar.runs.info import model_info

    vocab = 512  # the tiny tokenizer's ids fit
    model = mc.model("gemma3", vocab_size=vocab)
    hf = tmp_path / "hf"
    mc.save(model, hf)
    hf_cases.write_tokenizer(hf, "gemma3")
    tok_cfg = json.loads((hf / "tokenizer_config.json").read_text())
    template = tok_cfg.pop("chat_template")  # the processor's file keeps it
    (hf / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
    (hf / "chat_template.json").write_text(json.dumps({"chat_template": template}))
    assert io.HFTokenizer.from_folder(hf).chat_template == template
    info = model_info(str(hf))
    assert info["architecture"] == "gemma3" and "not loaded" in info["not_loaded"]
    rows = [{"messages": hf_cases.MESSAGES[:2]}] * 8
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    doc = {
        "model": {"path": str(hf)},
        "data": {"train": "chat.jsonl", "format": "chat", "batch_size": 4,
                 "seq_len": 64},
        "lora": {"rank": 2, "targets": ["q_proj", "v_proj"]},
        "training": {"max_steps": 3, "output_dir": str(tmp_path / "out")},
        "export": {"formats": ["adapter", "hf"]},
    }  # fmt: skip
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(doc))
    result = train_from_yaml(tmp_path / "run.yaml", progress=False)
    assert result.metrics["steps"] == 3 and np.isfinite(result.metrics["train_loss"])
    out = result.files["hf"]
    back = transformers.Gemma3ForConditionalGeneration.from_pretrained(out).eval()
    for name, value in model.state_dict().items():
        if multimodal.is_vision(name):
            assert torch.equal(value, back.state_dict()[name]), name
    base = transformers.Gemma3ForConditionalGeneration.from_pretrained(hf).eval()
    tuned = peft.PeftModel.from_pretrained(base, result.files["adapter"]).eval()
    merged_logits = mc.text_logits(back, mc.TOKENS)
    np.testing.assert_allclose(mc.text_logits(tuned), merged_logits, atol=1e-4)
    assert not np.allclose(merged_logits, mc.text_logits(model), atol=1e-6)
    assert nn.architecture("gemma3").hf_class == "Gemma3ForCausalLM"


def test_a_bfloat16_folder_exports_as_bfloat16_with_its_vision_bytes(tmp_path):
    from entrenar.runs import load_built
    from entrenar.runs.export import write_hf_folder

    model = mc.model("mistral3").to(torch.bfloat16)
    mc.save(model, tmp_path / "hf", shard="20KB")
    built = load_built(str(tmp_path / "hf"))  # float32, as a run loads it
    out = write_hf_folder(built, built.params, str(tmp_path / "out"))  # dtype auto
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert cfg["dtype"] == "bfloat16" and built.config.param_dtype == "float32"
    src, got = _tensors(tmp_path / "hf"), _tensors(tmp_path / "out")
    assert set(src) == set(got)
    for name, value in src.items():  # every tensor: float32 -> bfloat16 is exact
        assert value.dtype == got[name].dtype and value.tobytes() == (
            got[name].tobytes()
        ), name
    again = load_built(out)
    assert again.config == built.config


def _tensors(folder) -> dict[str, np.ndarray]:
    out = {}
    for f in folder.glob("*.safetensors"):
        tensors, _ = io.read_safetensors(f)
        out |= {k: np.asarray(v) for k, v in tensors.items()}
    return out


def test_the_memory_plan_counts_the_language_model_only(tmp_path):
    import hf_cases

    from entrenar.config import validate
    from entrenar.runs.memory_plan import plan_memory

    model = mc.model("gemma3", vocab_size=512)
    mc.save(model, tmp_path / "hf")
    hf_cases.write_tokenizer(tmp_path / "hf", "gemma3")
    (tmp_path / "t.jsonl").write_text(json.dumps({"text": "hello world"}) + "\n")
    doc = {
        "model": {"path": str(tmp_path / "hf")},
        "data": {"train": str(tmp_path / "t.jsonl"), "batch_size": 2, "seq_len": 8},
        "lora": {"rank": 2, "targets": ["q_proj"]},
        "training": {"max_steps": 1, "output_dir": str(tmp_path / "out")},
    }
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(doc))
    plan = plan_memory(validate(tmp_path / "run.yaml"), compile_step=False)
    text = [p for n, p in model.named_parameters() if not multimodal.is_vision(n)]
    vision = [p for n, p in model.named_parameters() if multimodal.is_vision(n)]
    assert vision and plan.weights == 4 * sum(p.numel() for p in text)  # tied once


def test_an_unknown_wrapper_is_refused():
    """``hf_wrapper`` is a LlamaConfig field (so YAML ``model.config`` reaches it)."""
    from entrenar.errors import ConfigError

    with pytest.raises(ConfigError, match=r"hf_wrapper must be None or one of"):
        dataclasses.replace(nn.architecture("gemma3").tiny(), hf_wrapper="llava")
