"""Runs read and write every family's files: Hugging Face folders and GGUFs.

`load_built` / `read_header` on a folder or GGUF of each registered family give the
family's name, its config and its own tokenizer; `model_info` (``entrenar info``)
reports family, context, tokenizer and the chat template's first line; the run's
exports of such a model (hf folder, GGUF, quantized GGUF) read back as the same model.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest
import yaml

from entrenar import io, merge, nn
from entrenar.config import validate
from entrenar.errors import CompatibilityError, ConfigError
from entrenar.io.gguf_families import EXPERT_NORM, IMPLIED, written_name
from entrenar.runs import evaluate_config, load_built, quantize_file, train_from_yaml
from entrenar.runs.export import write_hf_folder, write_quantized
from entrenar.runs.inference import generate_text
from entrenar.runs.info import model_info
from entrenar.runs.models import BuiltModel, read_header, save_built
from entrenar.runs.preflight import preflight

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "io"))
import hf_cases

FAMILIES = [
    a.name
    for a in nn.architectures()
    if a.tiny is not None and a.to_hf is not None and a.from_hf is not None
]
TOKENS = np.arange(9).reshape(1, 9) * 5 % 90


GGUF_FORM = {
    # llama.cpp's olmoe: no o_proj bias (an OLMoE's one attention_bias is all four),
    # no clipping, no GQA
    "olmoe": dict(attention_bias=False, attention_out_bias=False, clip_qkv=None,
                  num_kv_heads=4),
    # llama.cpp ranks groups by their top-2 sum, DeepSeek-V2 by its maximum
    "deepseek_v2": dict(topk_method="greedy"),
    # llama.cpp's exaone4 slides only at 64 layers (EXAONE 4.0 1.2B's layout
    # here), its attn_output is {D, D}
    "exaone4": dict(sliding_window=None, layer_types=None, nope_layers=None,
                    hidden_size=64),
}  # fmt: skip
"""What a family's tiny drops to have a GGUF form (the writer refuses the rest)."""


def _gguf_experts(config: nn.LlamaConfig, width: int) -> nn.LlamaConfig:
    """``config`` as llama.cpp can hold it (`GGUF_FORM`), with its experts.

    Its architecture's routing (`gguf_families.EXPERT_NORM`), what its graph fixes
    (`gguf_families.IMPLIED`: gpt-oss's clamp) and experts ``width`` wide (whole
    Q8_0 blocks).
    """
    arch = nn.architecture_of(config)
    name = written_name(arch.name, arch.gguf_name)
    if name is None:  # no GGUF form
        return config
    config = dataclasses.replace(config, **GGUF_FORM.get(arch.name, {}))
    if not config.num_experts:  # dense
        return config
    if name == "deepseek2":  # its routing keys are its own (io.deepseek_gguf)
        return config
    if name == "glm4moe":  # its routing keys are its own (io.glm4moe_gguf)
        return dataclasses.replace(config, moe_intermediate_size=width)
    if config.shared_mlp_intermediate_size:  # Granite MoE shared's
        config = dataclasses.replace(config, shared_mlp_intermediate_size=width)
    if config.intermediate_size % width:  # gpt-oss: its experts' width
        config = dataclasses.replace(config, intermediate_size=width)
    return dataclasses.replace(
        config, norm_topk_prob=EXPERT_NORM[name], **IMPLIED.get(name, {}),
        moe_intermediate_size=config.moe_intermediate_size and width,
        shared_expert_intermediate_size=config.shared_expert_intermediate_size
        and width,
    )  # fmt: skip


def _folder(family: str, path: Path, gguf: bool = False) -> tuple[nn.LlamaConfig, dict]:
    """An entrenar-written Hugging Face folder of ``family`` with its tokenizer.

    ``gguf``: a mixture of experts as llama.cpp can hold it (`_gguf_experts`).
    """
    config = nn.architecture(family).tiny()
    config = _gguf_experts(config, 32) if gguf else config
    params = config.init(jax.random.key(0))
    hf_cases.write_tokenizer(path / "tok", family)
    tok = io.HFTokenizer.from_folder(path / "tok")
    io.save_hf_folder(path / "hf", config, params, tokenizer=tok)
    return config, params


@pytest.mark.parametrize("family", FAMILIES)
def test_a_folder_loads_as_its_family_with_its_tokenizer(family, tmp_path):
    config, params = _folder(family, tmp_path)
    built = load_built(str(tmp_path / "hf"))
    assert built.architecture == family and built.config == config
    assert isinstance(built.tokenizer, io.HFTokenizer)
    assert built.tokenizer.chat_template and built.tokenizer.stop_ids
    head = read_header(str(tmp_path / "hf"))
    assert head.architecture == family and head.config == config
    assert io.file_architecture(str(tmp_path / "hf")) == family
    info = model_info(str(tmp_path / "hf"))
    assert info["architecture"] == family and info["format"] == "hf-folder"
    assert info["context_length"] == config.max_position_embeddings
    assert info["tokenizer"].startswith("tokenizer.json, ")
    assert info["chat_template"] and "\n" not in info["chat_template"]
    assert info["parameters"] == sum(
        int(np.prod(a.shape)) for a in jax.tree.leaves(params)
    )


@pytest.mark.parametrize(
    "family",
    [
        a
        for a in FAMILIES
        if written_name(a, nn.architecture(a).gguf_name)
        and nn.architecture(a).config_class is nn.LlamaConfig
    ],
)
def test_a_folder_exports_to_hf_and_gguf_of_its_family(family, tmp_path):
    config, params = _folder(family, tmp_path, gguf=True)
    built = load_built(str(tmp_path / "hf"))
    out = write_hf_folder(built, built.params, str(tmp_path / "out"))
    again = load_built(out)
    assert again.config == config and again.tokenizer.encode("Hello") == (
        built.tokenizer.encode("Hello")
    )
    gguf = write_quantized(built, built.params, str(tmp_path / "m.gguf"), "q8_0")
    back = load_built(gguf)
    assert back.architecture == family and back.config.architecture == family
    info = model_info(gguf)
    assert info["architecture"] == family and info["format"] == "gguf"
    want = np.asarray(config.apply(params, TOKENS))
    got = np.asarray(back.config.apply(back.params, TOKENS))
    np.testing.assert_allclose(got, want, atol=0.05)


def test_a_gguf_reports_its_tokenizer_and_template(tmp_path):
    info = model_info(str(io.smollm2_path()))
    assert info["architecture"] == "llama"
    assert info["tokenizer"].startswith("gguf gpt2, 49152 tokens")
    assert info["chat_template"].startswith("{%")


RECIPE = yaml.safe_load(
    (
        Path(__file__).resolve().parents[2] / "examples/configs/smollm2-qlora.yaml"
    ).read_text()
)  # the main job's recipe: QLoRA (nf4), bf16 matmuls where fast, remat, 3 exports


@pytest.mark.parametrize("family", FAMILIES)
def test_the_main_jobs_recipe_runs_on_each_familys_folder(family, tmp_path):
    """Training on chat data and every export with no GGUF anywhere, per family."""
    config, tok = _sized_folder(family, tmp_path)  # nf4 blocks of 64 on every input
    rows = [{"messages": hf_cases.MESSAGES[:2]}] * 16
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    doc = json.loads(json.dumps(RECIPE))
    doc["model"] = {k: v for k, v in doc["model"].items() if k != "keep_quantized"}
    doc["model"]["path"] = str(tmp_path / "hf")
    # 64: the llama template puts 32 tokens before the reply (at 32 none was trained)
    doc["data"].update(train=str(tmp_path / "chat.jsonl"), batch_size=4, seq_len=64)
    if config.fused_qkv:  # Phi-3's attention projections are one module
        doc["lora"]["targets"] = ["qkv_proj", "o_proj"]
    if family.startswith("deepseek"):  # latent attention's projections
        doc["lora"]["targets"] = ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa",
                                  "kv_b_proj", "o_proj"]  # fmt: skip
    doc["training"].update(max_steps=3, output_dir=str(tmp_path / "out"))
    in_gguf = written_name(family, nn.architecture(family).gguf_name) is not None
    if not in_gguf:  # a family llama.cpp has no form of (the run refuses the export)
        doc["export"]["formats"] = [
            f for f in doc["export"]["formats"] if not f.startswith("gguf")
        ]
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(doc))
    result = train_from_yaml(tmp_path / "run.yaml", progress=False)
    assert set(result.files) >= {"adapter", "hf"} | ({"gguf"} if in_gguf else set())
    adapter = json.loads(
        (Path(result.files["adapter"]) / "adapter_config.json").read_text()
    )
    assert set(adapter["target_modules"]) == set(doc["lora"]["targets"])
    hf = load_built(result.files["hf"])
    assert hf.architecture == family and hf.tokenizer.chat_template == (
        tok.chat_template
    )
    if not in_gguf:
        return
    gguf = load_built(result.files["gguf"])
    assert gguf.architecture == family and gguf.config == hf.config
    for a, b in zip(jax.tree.leaves(gguf.params), jax.tree.leaves(hf.params)):
        step = float(np.max(np.abs(b))) / 127  # Q8_0's grid step, at most
        np.testing.assert_allclose(a, b, atol=step)


_DEEPSEEK = dict(
    head_dim=None, q_lora_rank=64, kv_lora_rank=64, qk_nope_head_dim=32,
    v_head_dim=16, moe_intermediate_size=64,
)  # fmt: skip
SIZED = {"deepseek_v3": _DEEPSEEK, "deepseek_v2": _DEEPSEEK}
"""DeepSeek: head_dim is the rotary width; latent widths of 64 (and GGUF's attn_k_b
rows, d_n, of whole Q8_0 blocks)."""


def _sized_folder(family: str, path: Path) -> tuple[Any, io.HFTokenizer]:
    """A folder like `_folder`'s, its vocabulary the tokenizer's and hidden size 64.

    (Rows then split into the quantizers' blocks of 64.) A mixture of experts
    routes as llama.cpp's architecture does (`gguf_families.EXPERT_NORM`), so its
    GGUF export is written. Returns its config and tokenizer.
    """
    config = dataclasses.replace(
        nn.architecture(family).tiny(), vocab_size=512, hidden_size=64,
        intermediate_size=128, num_heads=4, **SIZED.get(family, {"head_dim": 16}),
    )  # fmt: skip
    config = _gguf_experts(config, 64)
    hf_cases.write_tokenizer(path / "tok", family)
    tok = io.HFTokenizer.from_folder(path / "tok")
    io.save_hf_folder(
        path / "hf", config, config.init(jax.random.key(0)), tokenizer=tok
    )
    return config, tok


def _chat_run(tmp_path: Path, model: str, **training: object) -> Path:
    """A 2-step LoRA run config on ``model`` with chat data (no file exported)."""
    rows = [{"messages": hf_cases.MESSAGES[:2]}] * 8
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    doc = {
        "model": {"path": model},
        "data": {"train": "chat.jsonl", "validation": "chat.jsonl", "format": "chat",
                 "batch_size": 4, "seq_len": 64},
        "lora": {"rank": 2},
        "training": {"max_steps": 2, "output_dir": str(tmp_path / "out"), **training},
    }  # fmt: skip
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(doc))
    return tmp_path / "run.yaml"


def test_a_runs_model_file_from_a_folder_names_the_folders_tokenizer(tmp_path):
    """A run on a Hugging Face folder: model.safetensors names the folder's tokenizer.

    So `entrenar eval CONFIG` scores it (before: "no tokenizer"), and so does its
    quantized copy written to another folder (`entrenar quantize`).
    """
    _sized_folder("llama", tmp_path)
    config = _chat_run(tmp_path, str(tmp_path / "hf"))
    result = train_from_yaml(config, progress=False)
    back = load_built(result.files["safetensors"])
    assert back.tokenizer is not None
    assert back.tokenizer.encode("Hello") == load_built(
        str(tmp_path / "hf")
    ).tokenizer.encode("Hello")
    assert evaluate_config(str(config))["examples"] == 8
    (tmp_path / "a" / "b").mkdir(parents=True)  # "../hf" from here is not the folder
    q = str(tmp_path / "a" / "b" / "q.safetensors")
    quantize_file(result.files["safetensors"], q, "int8")
    assert load_built(q).tokenizer is not None


def test_a_quantized_model_file_names_the_originals_tokenizer(tmp_path):
    """`entrenar quantize` of a Hugging Face folder names the folder's tokenizer.

    Before: none, so --calibration-data failed after the file was written.
    """
    _sized_folder("llama", tmp_path)
    q = str(tmp_path / "q.safetensors")
    quantize_file(str(tmp_path / "hf"), q, "int8")
    assert load_built(q).tokenizer is not None


@pytest.mark.parametrize("family", ["llama", "qwen2", "gpt2"])
@pytest.mark.parametrize("scheme", ["nf4", "int8"])
def test_a_quantized_model_file_of_a_layer_stack_runs(family, scheme, tmp_path):
    """`entrenar quantize` to an entrenar file quantizes each layer's matrices.

    Not the (L, D) stacks of a decoder's norms and biases. Before, those stacks
    were quantized as matrices: the file's model stopped with a raw JAX error (nf4:
    "scan got values with different leading axis sizes", int8: "'QuantizedWeight'
    object has no attribute 'astype'"), calibration included.
    """
    if family == "gpt2":
        config: Any = nn.GPT2Config(
            vocab_size=128, n_positions=16, n_embd=64, n_layer=2, n_head=2
        )
        src = str(tmp_path / "m.safetensors")
        save_built(
            BuiltModel(family, config, config.init(jax.random.key(0))),
            config.init(jax.random.key(0)), src,
        )  # fmt: skip
    else:
        _sized_folder(family, tmp_path)
        src = str(tmp_path / "hf")
    q = str(tmp_path / "q.safetensors")
    quantize_file(src, q, scheme)
    want, got = load_built(src), load_built(q)
    tokens = TOKENS % 128
    ref = np.asarray(want.config.apply(want.params, tokens))
    out = np.asarray(got.config.apply(got.params, tokens))
    error = float(np.linalg.norm(out - ref) / np.linalg.norm(ref))
    assert error < {"nf4": 0.3, "int8": 0.02}[scheme], error


def test_a_merged_model_file_names_the_inputs_tokenizer(tmp_path):
    """`entrenar merge` of a run's model files keeps the tokenizer they name.

    Named relative to the output (a streamed .safetensors and an in-memory .json in
    another folder); before, the path stayed relative to the inputs' folder and the
    merged model read back with none ("no tokenizer").
    """
    _sized_folder("llama", tmp_path)
    result = train_from_yaml(_chat_run(tmp_path, str(tmp_path / "hf")), progress=False)
    model = result.files["safetensors"]
    (tmp_path / "a" / "b").mkdir(parents=True)
    for name in ("m.safetensors", "m.json"):
        out = str(tmp_path / "a" / "b" / name)
        merge.merge_files([model, model], "linear", out, weights=[0.5, 0.5])
        assert load_built(out).tokenizer is not None, name


@pytest.mark.parametrize("quantize_base", ["none", "nf4"])
def test_eval_of_a_run_that_exported_only_its_adapter(quantize_base, tmp_path):
    """`entrenar eval CONFIG` of a run that exported only its adapter scores it.

    The base as it trained with the adapter attached: what the folded model file
    scores. Before: "no trained model; run `entrenar train` first", after the run
    had trained.
    """
    _sized_folder("llama", tmp_path)
    config = _chat_run(tmp_path, str(tmp_path / "hf"))
    doc = yaml.safe_load(config.read_text())
    doc["lora"].update(quantize_base=quantize_base, targets="all-linear")
    doc["optimizer"] = {"lr": 0.05}
    doc["export"] = {"formats": ["adapter", "safetensors"]}
    config.write_text(yaml.safe_dump(doc))
    result = train_from_yaml(config, progress=False)
    folded = evaluate_config(str(config))  # model.safetensors
    Path(result.files["safetensors"]).unlink()
    adapted = evaluate_config(str(config))  # the base and adapter/
    base = evaluate_config(str(config), model=str(tmp_path / "hf"))
    assert adapted["tokens"] == folded["tokens"]
    assert abs(adapted["eval_loss"] - folded["eval_loss"]) < 1e-4
    assert abs(adapted["eval_loss"] - base["eval_loss"]) > 1e-2  # the adapter counts


def test_a_teacher_with_another_tokenizer_is_refused_by_validate_and_train(tmp_path):
    """A distillation teacher with another tokenizer is refused, as validate says.

    The loss compares logits id by id: a teacher whose ids are other tokens is
    refused by `entrenar validate` as by `train`; the student's own GGUF (its
    vocabulary padded to vocab_size) is accepted.

    Before: any teacher with as many logits trained, silently distilling a Qwen
    vocabulary into a Llama one; validate did not check the teacher at all.
    """
    for family in ("llama", "qwen2"):
        (tmp_path / family).mkdir()
        _sized_folder(family, tmp_path / family)
    config = _chat_run(tmp_path, str(tmp_path / "llama" / "hf"))
    doc = yaml.safe_load(config.read_text())
    del doc["lora"]
    gguf = tmp_path / "student.gguf"
    built = load_built(str(tmp_path / "llama" / "hf"))
    write_quantized(built, built.params, str(gguf), "q8_0")
    for teacher, ok in ((tmp_path / "qwen2" / "hf", False), (gguf, True)):
        doc["distillation"] = {"teacher": str(teacher)}
        config.write_text(yaml.safe_dump(doc))
        for check in (
            lambda: preflight(validate(config)),
            lambda: train_from_yaml(config, dry_run=True, progress=False),
        ):
            if ok:
                check()
                continue
            with pytest.raises(CompatibilityError, match=r"tokenizer is not the"):
                check()


def test_chat_without_a_chat_template_names_the_model_and_the_fix(tmp_path):
    """Chat data or --chat on a model whose tokenizer has no chat template.

    Training, generation and evaluation each stop with an entrenar error naming the
    model and what to set. Before: the Python API's "pass chat_template= (to
    ChatModel)", which no YAML key or option sets.
    """
    _sized_folder("llama", tmp_path)
    hf = tmp_path / "hf"
    cfg = json.loads((hf / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (hf / "tokenizer_config.json").write_text(json.dumps(cfg))
    (hf / "chat_template.jinja").unlink(missing_ok=True)
    config = _chat_run(tmp_path, str(hf))
    with pytest.raises(ConfigError, match=r"^data\.format: chat .* set model\.token"):
        preflight(validate(config))
    with pytest.raises(ConfigError, match=r"has no chat template; pass --tokenizer"):
        generate_text(str(hf), "Hello", chat=True)
    with pytest.raises(ConfigError, match=r"chat data, and .* has no chat template"):
        evaluate_config(str(config), model=str(hf))


def test_a_bfloat16_base_exports_a_bfloat16_hf_folder(tmp_path):
    """export.hf_dtype auto: the base folder's dtype, for the merged model.

    Before, a run (float32 by default, model.dtype) on a bfloat16 folder wrote its
    hf folder float32: twice the base's size, config.json torch_dtype float32.
    transformers reads the bfloat16 folder with the float32 one's logits to bf16
    rounding.
    """
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    config, tok = _sized_folder("llama", tmp_path)
    params = jax.tree.map(lambda x: x.astype("bfloat16"), load_built(
        str(tmp_path / "hf")).params)  # fmt: skip
    io.save_hf_folder(tmp_path / "bf16", config, params, tokenizer=tok)
    config_path = _chat_run(tmp_path, str(tmp_path / "bf16"))
    doc = yaml.safe_load(config_path.read_text())
    doc["export"] = {"formats": ["hf", "adapter"]}
    logits = {}
    for dtype in ("auto", "float32"):
        doc["export"]["hf_dtype"] = dtype
        doc["training"]["output_dir"] = str(tmp_path / dtype)
        config_path.write_text(yaml.safe_dump(doc))
        folder = train_from_yaml(config_path, progress=False).files["hf"]
        written = json.loads((Path(folder) / "config.json").read_text())
        tensors = io.read_safetensors(str(Path(folder) / "model.safetensors"))[0]
        dtypes = {a.dtype for a in tensors.values()}
        want = "bfloat16" if dtype == "auto" else "float32"
        assert written["torch_dtype"] == want and {d.name for d in dtypes} == {want}
        model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
        assert model.dtype == getattr(torch, want)
        with torch.no_grad():
            logits[dtype] = model(torch.from_numpy(TOKENS)).logits.float().numpy()
    scale = np.abs(logits["float32"]).max()
    np.testing.assert_allclose(logits["auto"], logits["float32"], atol=0.01 * scale)


def test_an_adapter_export_peft_would_drop_is_refused_before_training(tmp_path):
    """DeepSeek's dense MLP adapters: PEFT 0.21 would not load them (peft_moe)."""
    _sized_folder("deepseek_v3", tmp_path)
    rows = [{"messages": hf_cases.MESSAGES[:2]}] * 4
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    doc = json.loads(json.dumps(RECIPE))
    doc["model"] = {"path": str(tmp_path / "hf")}
    doc["data"].update(train=str(tmp_path / "chat.jsonl"), batch_size=2, seq_len=64)
    doc["lora"]["targets"] = ["q_a_proj", "mlp.gate_proj", "shared_experts.up_proj"]
    doc["training"].update(max_steps=3, output_dir=str(tmp_path / "out"))
    doc["export"]["formats"] = ["adapter"]
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(doc))
    with pytest.raises(ConfigError, match=r"export\.formats: 'adapter'.*gate_proj"):
        train_from_yaml(tmp_path / "run.yaml", progress=False)
    assert not list((tmp_path / "out").glob("**/*.safetensors"))
    assert not (tmp_path / "out" / "checkpoints").exists()  # no step was taken
    doc["export"]["formats"] = ["hf"]  # merged, the same adapters are kept
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(doc))
    assert set(train_from_yaml(tmp_path / "run.yaml", progress=False).files) >= {"hf"}
