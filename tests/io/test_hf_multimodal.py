"""Vision-language folders: their language model, in and out.

transformers 5.25 is the oracle: a tiny random ConditionalGeneration model of each
wrapper (Gemma 3, Mistral 3 with a Mistral or a Ministral 3 text model, LLaVA,
LLaVA-NeXT, Qwen2-VL, Qwen2.5-VL, Qwen3-VL; float32, tests/io/mm_cases.py) saved in
the Hub's key layout (sharded) or the in-memory one loads into entrenar with the text
logits of its forward on ``input_ids`` (for Qwen, through its multimodal rotary);
the folder entrenar exports loads in transformers with the same text logits and the
vision tensors byte for byte; PEFT 0.21's adapters on the ConditionalGeneration model
load here and entrenar's load there; a YAML run trains on such a folder and exports
all of it.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

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

KINDS = mc.KINDS
CASES = [  # (kind, layout, tie): each kind tied and untied, each of its layouts
    (k, layout, tie)
    for k in KINDS
    for layout, tie in zip((mc.LAYOUTS[k] * 2)[:2], (True, False), strict=True)
]


def _names(folder) -> set[str]:
    names: set[str] = set()
    for f in folder.glob("*.safetensors"):
        with safetensors.safe_open(f, "np") as st:
            names |= set(st.keys())
    return names


def _entrenar_logits(info, params) -> np.ndarray:
    return np.asarray(info.config.apply(params, mc.TOKENS))


@pytest.mark.parametrize(("kind", "layout", "tie"), CASES)
def test_a_folder_loads_its_language_model_with_transformers_logits(
    kind, layout, tie, tmp_path
):
    from entrenar.runs.info import model_info

    model = mc.model(kind, tie_word_embeddings=tie)
    assert model.config.tie_word_embeddings == tie
    mc.save(model, tmp_path, layout=layout, shard="20KB")
    assert (tmp_path / "model.safetensors.index.json").exists()  # sharded
    names = _names(tmp_path)
    llava = not kind.startswith("qwen")
    legacy = "language_model.model." if llava else "model.layers."
    head = "language_model.lm_head.weight" if llava and layout == "legacy" else (
        "lm_head.weight"
    )  # fmt: skip
    assert (head in names) == (not tie)
    assert any(n.startswith(legacy) for n in names) == (layout == "legacy")
    info, params = io.load_hf_folder(tmp_path)
    family = mc.FAMILY[kind]
    assert info.architecture.name == family == io.file_architecture(str(tmp_path))
    wrapper = mc.WRAPPER[kind]
    assert info.config.hf_wrapper == wrapper
    assert info.config.tie_word_embeddings == tie
    assert info.multimodal.layout == layout
    vision = [
        p for n, p in model.named_parameters() if multimodal.is_vision(n, wrapper)
    ]
    assert vision and info.multimodal.skipped_params == sum(p.numel() for p in vision)
    assert f"{info.multimodal.skipped_params:,} parameters" in info.skipped_note
    assert "not loaded" in model_info(str(tmp_path))["not_loaded"]
    np.testing.assert_allclose(
        _entrenar_logits(info, params), mc.text_logits(model), atol=1e-5, rtol=0
    )


@pytest.mark.parametrize(
    ("kind", "text"),
    [("llava", "qwen2"), ("llava", "mistral"), ("llava_next", "llama")],
)
def test_llava_reads_each_of_its_text_families(kind, text, tmp_path):
    window = {"sliding_window": 4} if text == "mistral" else {}
    model = mc.model(kind, model_type=text, **window)
    assert model.config.text_config.model_type == text
    mc.save(model, tmp_path)
    info, params = io.load_hf_folder(tmp_path)
    assert info.architecture.name == text and info.config.hf_wrapper == kind
    assert info.config.attention_bias == (text == "qwen2")
    assert info.config.sliding_window == window.get("sliding_window")
    np.testing.assert_allclose(
        _entrenar_logits(info, params), mc.text_logits(model), atol=1e-5
    )


def test_ministral3s_query_scale_matters_and_its_text_model_exports_alone(tmp_path):
    """Llama 4's query scale changes the logits from position 4 on (mm_cases)."""
    model = mc.model("ministral3")
    mc.save(model, tmp_path / "hf")
    info, params = io.load_hf_folder(tmp_path / "hf")
    assert info.config.query_scale_beta == 0.1 and info.config.query_scale_length == 4
    assert info.config.rope_type == "yarn" and info.config.rope_factor == 16.0
    plain = dataclasses.replace(info.config, query_scale_beta=None)
    want = mc.text_logits(model)
    off = np.asarray(plain.apply(params, mc.TOKENS))
    assert np.abs(off - want)[:, 4:].max() > 1e-3  # scaled from position 4 on
    np.testing.assert_allclose(off[:, :4], want[:, :4], atol=1e-5)
    with pytest.warns(UserWarning, match="writing the language model alone"):
        io.save_hf_folder(tmp_path / "out", info.config, params)
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert cfg["model_type"] == "ministral3"
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert type(back).__name__ == "Ministral3ForCausalLM"
    np.testing.assert_allclose(mc.text_logits(back), want, atol=1e-5)


def test_qwen2_vl_flat_config_json_reads_and_exports_flat(tmp_path):
    """Qwen2-VL's Hub config.json has its text keys at the top, no text_config."""
    model = mc.model("qwen2_vl")
    mc.save(model, tmp_path / "src")
    path = tmp_path / "src" / "config.json"
    cfg = json.loads(path.read_text())
    text = cfg.pop("text_config")
    text.pop("model_type")
    text.pop("rope_parameters")  # the Hub's form:
    text["rope_scaling"] = {"type": "mrope", "mrope_section": [2, 3, 3]}
    text["rope_theta"] = 1e6
    path.write_text(json.dumps({**cfg, **text}))
    flat = type(model).from_pretrained(tmp_path / "src").eval()
    assert flat.config.text_config.hidden_size == 32
    info, params = io.load_hf_folder(tmp_path / "src")
    assert info.config.rope_theta == 1e6 and info.config.rope_type == "default"
    np.testing.assert_allclose(
        _entrenar_logits(info, params), mc.text_logits(flat), atol=1e-5
    )
    longer = dataclasses.replace(info.config, max_position_embeddings=128)
    io.save_hf_folder(tmp_path / "out", longer, params, source=tmp_path / "src")
    out = json.loads((tmp_path / "out" / "config.json").read_text())
    assert "text_config" not in out and out["max_position_embeddings"] == 128
    back = type(model).from_pretrained(tmp_path / "out")
    assert back.config.text_config.max_position_embeddings == 128


def test_qwen3_vl_moe_hub_experts_are_read_and_written_the_hub_way_round(tmp_path):
    """Qwen3-VL-MoE's experts, stored the Hub's way round, in and out.

    The Hub's fused experts are (E, D, 2I) / (E, I, D), transformers' own (E, 2I, D)
    / (E, D, I): each read as transformers does, and written back as stored.
    """
    from safetensors.torch import load_file, save_file

    model = mc.model("qwen3_vl_moe")
    mc.save(model, tmp_path / "src")
    file = tmp_path / "src" / "model.safetensors"
    state = load_file(file)
    fused = [k for k in state if ".mlp.experts." in k]
    assert len(fused) == 4 and state[fused[0]].shape[0] == 4
    hub = {k: v.transpose(1, 2).contiguous() if k in fused else v
           for k, v in state.items()}  # fmt: skip
    save_file(hub, file, metadata={"format": "pt"})
    back = type(model).from_pretrained(tmp_path / "src").eval()
    want = mc.text_logits(model)
    np.testing.assert_allclose(mc.text_logits(back), want, atol=1e-6)
    info, params = io.load_hf_folder(tmp_path / "src")
    assert info.config.num_experts == 4 and info.config.norm_topk_prob
    np.testing.assert_allclose(_entrenar_logits(info, params), want, atol=1e-5)
    io.save_hf_folder(tmp_path / "out", info.config, params, source=tmp_path / "src")
    out = load_file(tmp_path / "out" / "model.safetensors")
    assert {k: v.shape for k, v in out.items()} == {k: v.shape for k, v in hub.items()}
    for k in fused:
        assert torch.equal(out[k], hub[k]), k
    again = type(model).from_pretrained(tmp_path / "out").eval()
    np.testing.assert_allclose(mc.text_logits(again), want, atol=1e-5)


@pytest.mark.parametrize(
    ("kind", "section"), [("qwen2_vl", [2, 2, 2]), ("qwen2_5_vl", "16,24,24")]
)
def test_an_mrope_section_transformers_cannot_split_is_refused(kind, section, tmp_path):
    mc.save(mc.model(kind), tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["text_config"]["rope_parameters"]["mrope_section"] = section
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(FormatError, match=r"mrope_section = .* head_dim / 2 = 8"):
        io.read_hf_folder(tmp_path)


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


TEXT_CLASSES = {
    "gemma3_text": "Gemma3TextConfig",
    "mistral": "MistralConfig",
    "ministral3": "Ministral3Config",
    "llama": "LlamaConfig",
    "qwen2": "Qwen2Config",
    "qwen2_vl_text": "Qwen2VLTextConfig",
    "qwen2_5_vl_text": "Qwen2_5_VLTextConfig",
    "qwen3_vl_text": "Qwen3VLTextConfig",
    "qwen3_vl_moe_text": "Qwen3VLMoeTextConfig",
}


@pytest.mark.parametrize("kind", sorted(multimodal.WRAPPERS))
def test_text_defaults_are_transformers(kind):
    import inspect

    w = multimodal.WRAPPERS[kind]
    top = getattr(transformers, w.hf_class).config_class()
    assert top.model_type == kind and top.tie_word_embeddings == w.tie_default
    assert top.text_config.model_type == w.default_text
    for text_type, text in w.texts.items():
        made = getattr(transformers, TEXT_CLASSES[text_type])()
        theirs = made.to_dict() | {"sliding_window_pattern": 6}  # Gemma3's _pattern
        theirs.setdefault("num_experts", theirs.get("num_local_experts"))
        for key, value in text.defaults.items():
            if key == "sliding_window" and not theirs.get("use_sliding_window", 1):
                continue  # Qwen2Config: no window unless use_sliding_window
            assert theirs[key] == value, (text_type, key)
        if text_type not in ("gemma3_text", "ministral3"):  # their own rope code
            theta = made.rope_parameters["rope_theta"]
            assert theta == (text.theta or 1e4), text_type
    if kind == "mistral3":  # no text_config at all: Mistral Small 3.1's sizes
        absent = transformers.Mistral3Config().text_config.to_dict()
        absent["rope_theta"] = absent["rope_parameters"]["rope_theta"]
        for key, value in w.absent.items():
            assert absent[key] == value, key
    if w.absent is None:  # Qwen2-VL: the text keys transformers takes from the top
        cls = getattr(transformers, TEXT_CLASSES[w.default_text])
        base = set(inspect.signature(transformers.PreTrainedConfig.__init__).parameters)
        fields = set(inspect.signature(cls.__init__).parameters) - base
        assert set(w.flat_keys) == fields | {"rope_scaling", "rope_theta"}


@pytest.mark.parametrize("kind", KINDS)
def test_an_export_is_the_whole_folder_again(kind, tmp_path):
    model = mc.model(kind)
    wrapper = mc.WRAPPER[kind]
    for layout in mc.LAYOUTS[kind]:
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
            if multimodal.is_vision(name, wrapper):
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


@pytest.mark.parametrize(
    "kind",
    [
        "gemma3", "mistral3", "ministral3", "llava_next", "qwen2_5_vl", "qwen3_vl",
        "qwen3_vl_moe",
    ],
)  # fmt: skip
def test_peft_adapters_both_ways(kind, tmp_path):
    model = mc.model(kind)
    mc.save(model, tmp_path / "hf")
    info, params = io.load_hf_folder(tmp_path / "hf")
    cls = type(model)
    kind = mc.WRAPPER[kind]
    # entrenar -> PEFT: named on the ConditionalGeneration model, no vision adapter
    cfg = lora.LoRAConfig(rank=2, alpha=4.0, targets=("q_proj", "v_proj"))
    ours = _with_b(lora.apply(params, cfg, key=jax.random.key(3)))
    lora.save_adapter(ours, tmp_path / "ours", config=cfg, wrapper=kind)
    saved = json.loads((tmp_path / "ours" / "adapter_config.json").read_text())
    assert saved["target_modules"] == r"model\.language_model\..*\.(?:q_proj|v_proj)"
    base = cls.from_pretrained(tmp_path / "hf").eval()
    theirs = peft.PeftModel.from_pretrained(base, tmp_path / "ours").eval()
    adapted = [n for n, _ in theirs.named_modules() if n.endswith(".lora_A")]
    assert len(adapted) == 2 * 2 and all(".language_model." in n for n in adapted)
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
    [
        ("gemma3", multimodal.LEGACY),
        ("mistral3", multimodal.IN_MEMORY),
        ("qwen2_vl", multimodal.LEGACY),
    ],
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
        if multimodal.is_vision(name, kind):
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


@pytest.mark.parametrize("kind", ["gemma3", "qwen2_vl"])
def test_a_legacy_named_adapter_loads_and_a_vision_one_is_refused(kind, tmp_path):
    model = mc.model(kind)
    mc.save(model, tmp_path / "hf")
    info, params = io.load_hf_folder(tmp_path / "hf")
    cfg = lora.LoRAConfig(rank=2, alpha=4.0, targets=("q_proj",))
    ours = _with_b(lora.apply(params, cfg, key=jax.random.key(3)))
    lora.save_adapter(ours, tmp_path / "ad", wrapper=kind)
    file = tmp_path / "ad" / "adapter_model.safetensors"
    tensors, _ = io.read_safetensors(file)
    old = "language_model.model." if kind == "gemma3" else "model."  # legacy names
    legacy = {
        k.replace("model.language_model.", old): np.asarray(v)
        for k, v in tensors.items()
    }
    assert set(legacy) != set(tensors)
    safetensors.numpy.save_file(legacy, str(file), metadata={"format": "pt"})
    back = lora.load_adapter(tmp_path / "ad", params, wrapper=kind)
    np.testing.assert_allclose(
        _entrenar_logits(info, back), _entrenar_logits(info, ours), atol=1e-6
    )
    base = type(model).from_pretrained(tmp_path / "hf")
    made = peft.get_peft_model(base, peft.LoraConfig(r=2, target_modules="all-linear"))
    made.save_pretrained(tmp_path / "all")
    with pytest.raises(CompatibilityError, match=f"adapt the {kind} vision tower"):
        lora.load_adapter(tmp_path / "all", params, wrapper=kind)


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
    fp8 = {"quant_method": "fp8", "weight_block_size": [128, 128]}  # Ministral 3's
    (tmp_path / "hf" / "config.json").write_text(
        json.dumps({**cfg, "quantization_config": fp8})
    )
    with pytest.raises(UnsupportedError, match=r"quant_method 'fp8'.*mistral3"):
        io.read_hf_folder(tmp_path / "hf")
    for model_type, why in (("mllama", "cross-attention"), ("paligemma", "prefix-LM")):
        (tmp_path / "hf" / "config.json").write_text(
            json.dumps({"model_type": model_type})
        )
        with pytest.raises(UnsupportedError, match=why):
            io.read_hf_folder(tmp_path / "hf")


@pytest.mark.parametrize("kind", ["gemma3", "qwen2_5_vl"])
def test_a_yaml_run_trains_on_a_vision_language_folder_and_exports_it(kind, tmp_path):
    import hf_cases

    from entrenar.runs import train_from_yaml
    from entrenar.runs.info import model_info

    vocab = 512  # the tiny tokenizer's ids fit
    model = mc.model(kind, vocab_size=vocab)
    cls = type(model)
    hf = tmp_path / "hf"
    mc.save(model, hf)
    hf_cases.write_tokenizer(hf, "gemma3" if kind == "gemma3" else "qwen")
    tok_cfg = json.loads((hf / "tokenizer_config.json").read_text())
    template = tok_cfg.pop("chat_template")  # the processor's file keeps it
    (hf / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
    (hf / "chat_template.json").write_text(json.dumps({"chat_template": template}))
    assert io.HFTokenizer.from_folder(hf).chat_template == template
    info = model_info(str(hf))
    assert info["architecture"] == mc.FAMILY[kind]
    assert "not loaded" in info["not_loaded"]
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
    assert _names(hf) == _names(Path(out))  # the source's key layout
    back = cls.from_pretrained(out).eval()
    for name, value in model.state_dict().items():
        if multimodal.is_vision(name, kind):
            assert torch.equal(value, back.state_dict()[name]), name
    base = cls.from_pretrained(hf).eval()
    tuned = peft.PeftModel.from_pretrained(base, result.files["adapter"]).eval()
    merged_logits = mc.text_logits(back, mc.TOKENS)
    np.testing.assert_allclose(mc.text_logits(tuned), merged_logits, atol=1e-4)
    assert not np.allclose(merged_logits, mc.text_logits(model), atol=1e-6)


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


@pytest.mark.parametrize("kind", ["gemma3", "qwen2_5_vl"])
def test_the_memory_plan_counts_the_language_model_only(kind, tmp_path):
    import hf_cases

    from entrenar.config import validate
    from entrenar.runs.memory_plan import plan_memory

    model = mc.model(kind, vocab_size=512, tie_word_embeddings=True)
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
    text = [p for n, p in model.named_parameters() if not multimodal.is_vision(n, kind)]
    vision = [p for n, p in model.named_parameters() if multimodal.is_vision(n, kind)]
    assert vision and plan.weights == 4 * sum(p.numel() for p in text)  # tied once


def test_an_unknown_wrapper_is_refused():
    """``hf_wrapper`` is a LlamaConfig field (so YAML ``model.config`` reaches it)."""
    from entrenar.errors import ConfigError

    with pytest.raises(ConfigError, match=r"hf_wrapper must be None or one of"):
        dataclasses.replace(nn.architecture("gemma3").tiny(), hf_wrapper="paligemma")
