"""MXFP4 experts in the GGUF entrenar writes (``save_llama_gguf(expert_type="MXFP4")``).

The experts' stacks ``ffn_{gate,up,down}_exps`` are written as ggml's MXFP4 (the
other tensors as before, ``general.file_type`` ``MOSTLY_MXFP4_MOE``); entrenar reads
them back as the dequantized values, gguf-py reads the same bytes (its quantizer's)
and values; a LoRA fine-tune's retention is measured for MXFP4 experts; configs
without experts or with rows that are not whole blocks are refused. llama.cpp's
logits for such files: tests/io/test_gguf_families.py (``*_mxfp4`` cases).
"""

from __future__ import annotations

import dataclasses
import re

import gguf
import jax
import jax.numpy as jnp
import llama_cpp_cases as cases
import numpy as np
import pytest
from config_cases import wine_doc, write
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from entrenar import io, lora
from entrenar.config.summary import validate
from entrenar.errors import ConfigError
from entrenar.lora import LoRAConfig, fold_retention, save_folded_gguf
from entrenar.nn import architecture
from entrenar.nn.mxfp4 import dequantize_ggml, quantize_ggml
from entrenar.runs.export import check_gguf_export, write_outputs
from entrenar.runs.models import BuiltModel
from entrenar.tree import tree_named_leaves

MXFP4 = GGMLQuantizationType.MXFP4
EXPERTS = ("gate_proj", "up_proj", "down_proj")
STEMS = {p: f"ffn_{p[:-5]}_exps" for p in EXPERTS}


def tiny(family: str = "gpt_oss", width: int = 64, **extra):
    """The family's tiny model as llama.cpp runs it, rows ``width`` values wide."""
    make = architecture(family).tiny
    assert make is not None
    c = make()
    extra = cases.FAMILY_LIMITS.get(family, {}) | extra
    c = dataclasses.replace(c, hidden_size=width, intermediate_size=width, **extra)
    return c, cases.family_params(c)


def mx(w) -> np.ndarray:
    """``w``'s values through MXFP4 (quantized, dequantized)."""
    w = np.asarray(w, np.float32)
    return dequantize_ggml(quantize_ggml(w), w.shape)


def _experts(params: dict) -> dict:
    return params["model"]["layers"]["mlp"]["experts"]


@pytest.mark.parametrize("kind", ["F32", "Q8_0"])
def test_mxfp4_experts_read_back_as_their_dequantized_values(kind, tmp_path):
    c, params = tiny()
    path = tmp_path / "mx.gguf"
    io.save_llama_gguf(path, c, params, tensor_type=kind, expert_type="MXFP4")
    back_c, back, _ = io.load_llama_gguf(path)
    assert back_c == c
    assert io.read_gguf(path).metadata["general.file_type"] == 38  # MXFP4_MOE
    for name, a in tree_named_leaves(params):
        b = np.asarray(dict(tree_named_leaves(back))[name])
        if re.search(r"experts\.\w+_proj\.weight$", name):
            np.testing.assert_array_equal(b, mx(a), err_msg=name)
            assert not np.array_equal(b, a)  # the values are MXFP4's, not the input
        elif kind == "F32":
            np.testing.assert_array_equal(b, np.asarray(a), err_msg=name)
        else:  # Q8_0's rounding
            np.testing.assert_allclose(b, np.asarray(a), atol=4e-3, err_msg=name)
    again = tmp_path / "again.gguf"  # the values read back requantize to the bytes
    io.save_llama_gguf(again, c, back, tensor_type=kind, expert_type="MXFP4")
    assert again.read_bytes() == path.read_bytes()


def test_gguf_py_reads_the_bytes_its_own_quantizer_writes(tmp_path):
    c, params = tiny()
    path = tmp_path / "mx.gguf"
    io.save_llama_gguf(path, c, params, tensor_type="F16", expert_type="MXFP4")
    reader = gguf.GGUFReader(path)
    assert reader.fields["general.file_type"].parts[-1][0] == 38
    tensors = {t.name: t for t in reader.tensors}
    _, back, _ = io.load_llama_gguf(path)
    for proj, stem in STEMS.items():
        w = np.asarray(_experts(params)[proj]["weight"], np.float32)  # (L, E, out, in)
        mine = np.asarray(_experts(back)[proj]["weight"])
        for i in range(c.num_layers):
            t = tensors[f"blk.{i}.{stem}.weight"]
            assert t.tensor_type == MXFP4
            assert [int(n) for n in t.shape] == list(w.shape[1:][::-1])  # ggml's ne
            raw = np.asarray(t.data).reshape(-1)
            want = gguf_quantize(w[i].reshape(-1, w.shape[-1]), MXFP4).reshape(-1)
            np.testing.assert_array_equal(raw, want, err_msg=t.name)
            values = gguf_dequantize(np.asarray(t.data), MXFP4).reshape(w.shape[1:])
            np.testing.assert_array_equal(values, mine[i], err_msg=t.name)
        bias = tensors[f"blk.0.{stem}.bias"]  # gpt-oss's expert biases stay F32
        assert bias.tensor_type == GGMLQuantizationType.F32
    others = {t.tensor_type for n, t in tensors.items() if n.endswith("attn_q.weight")}
    assert others == {GGMLQuantizationType.F16}


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_other_mixtures_of_experts_take_mxfp4_experts(family, tmp_path):
    c, params = tiny(
        family, moe_intermediate_size=32 if family == "qwen3_moe" else None
    )
    path = tmp_path / "mx.gguf"
    io.save_llama_gguf(path, c, params, expert_type="mxfp4")
    types = {n: t.type_id for n, t in io.read_gguf(path).tensors.items()}
    assert {types[f"blk.1.{s}.weight"] for s in STEMS.values()} == {39}
    assert types["blk.1.attn_q.weight"] == 0 and types["blk.1.ffn_gate_inp.weight"] == 0
    _, back, _ = io.load_llama_gguf(path)
    for proj in EXPERTS:
        np.testing.assert_array_equal(
            _experts(back)[proj]["weight"], mx(_experts(params)[proj]["weight"])
        )


def test_mxfp4_experts_make_a_smaller_file(tmp_path):
    c, params = tiny(num_experts=8)
    sizes = {}
    for kind, experts in [("F16", None), ("Q8_0", None), ("F16", "MXFP4")]:
        path = tmp_path / f"{kind}-{experts}.gguf"
        io.save_llama_gguf(path, c, params, tensor_type=kind, expert_type=experts)
        sizes[kind, experts] = path.stat().st_size
    e = c.num_layers * 3 * c.num_experts * 64 * 64  # expert values
    assert sizes["F16", None] - sizes["F16", "MXFP4"] == e * 2 - e // 32 * 17
    assert sizes["F16", "MXFP4"] < sizes["Q8_0", None]


def test_a_folded_fine_tune_is_measured_with_mxfp4_experts(tmp_path):
    c, params = tiny()
    key = jax.random.key(0)
    lp = lora.apply(params, LoRAConfig(rank=2, targets=("experts.down_proj",)), key=key)
    node = _experts(lp)["down_proj"]["weight"]  # (L, E, out, in): one A, B an expert
    node = dataclasses.replace(node, b=jnp.full_like(node.b, 1e-2))  # as trained
    _experts(lp)["down_proj"]["weight"] = node
    base = np.asarray(node.base, np.float32)  # (L, E, out, in)
    delta = np.asarray(lora.fold(lp)["model"]["layers"]["mlp"]["experts"]["down_proj"]
                       ["weight"], np.float32) - base  # fmt: skip
    e = mx(base + delta) - base  # what an MXFP4 file adds to the base
    kept = float(np.vdot(e, delta) / np.vdot(delta, delta))
    r = fold_retention(lp, "F32", "MXFP4")
    assert r.tensor_type == "F32" and r.weights == 1
    np.testing.assert_allclose(r.kept, kept, rtol=1e-4)
    f32 = fold_retention(lp, "F32")  # F32 keeps the update to rounding
    assert r.residual > 1.0 > 1e-4 > f32.residual and r.kept < f32.kept
    with pytest.warns(UserWarning, match="F32 with MXFP4 experts keeps"):
        got = save_folded_gguf(
            tmp_path / "ft.gguf", c, lp, tensor_type="F32", expert_type="MXFP4",
            min_kept=1.0,
        )  # fmt: skip
    assert got == r
    io.save_llama_gguf(tmp_path / "ref.gguf", c, lora.fold(lp), expert_type="MXFP4")
    assert (tmp_path / "ft.gguf").read_bytes() == (tmp_path / "ref.gguf").read_bytes()


def test_configs_mxfp4_cannot_hold_are_refused(tmp_path):
    path = tmp_path / "x.gguf"
    dense, params = tiny("llama")
    with pytest.raises(ConfigError, match="llama config has no experts"):
        io.save_llama_gguf(path, dense, params, expert_type="MXFP4")
    odd, params = tiny(width=48)  # rows of 48: not whole blocks
    with pytest.raises(ConfigError, match="expert_size 48: write the experts in F16"):
        io.save_llama_gguf(path, odd, params, expert_type="MXFP4")
    io.save_llama_gguf(path, odd, params, expert_type="F16")  # fine
    c, params = tiny()
    with pytest.raises(ConfigError, match="expert type 'Q4_K'"):
        io.save_llama_gguf(path, c, params, expert_type="Q4_K")
    ds = dataclasses.replace(architecture("deepseek_v2").tiny(), hidden_size=64)
    with pytest.raises(ConfigError, match="expert_size 12: write the experts in F16"):
        io.save_llama_gguf(path, ds, cases.family_params(ds), expert_type="MXFP4")
    assert not path.with_suffix(".gguf.tmp").exists()


@pytest.mark.parametrize("family", ["deepseek_v3", "glm4_moe"])
def test_layer_by_layer_families_take_mxfp4_experts(family, tmp_path):
    """DeepSeek's and GLM-4.5's writer: routed experts MXFP4, shared ones not."""
    c = dataclasses.replace(
        architecture(family).tiny(), hidden_size=64, moe_intermediate_size=32
    )
    params = cases.family_params(c)
    path = tmp_path / "mx.gguf"
    io.save_llama_gguf(path, c, params, tensor_type="F16", expert_type="MXFP4")
    g = io.read_gguf(path)
    assert g.metadata["general.file_type"] == 38  # MOSTLY_MXFP4_MOE
    types = {n: t.type_id for n, t in g.tensors.items()}
    moe = range(c.first_k_dense_replace, c.num_layers)
    assert {types[f"blk.{i}.{s}.weight"] for i in moe for s in STEMS.values()} == {39}
    assert {types[f"blk.{i}.ffn_{p}_shexp.weight"] for i in moe for p in
            ("gate", "up", "down")} == {1}  # fmt: skip
    assert types[f"blk.{moe[0]}.ffn_gate_inp.weight"] == 0  # the router: F32
    _, back, _ = io.load_llama_gguf(path)
    stacks = [
        (name, a) for name, a in tree_named_leaves(params)
        if re.search(r"\.experts\.\w+_proj\.weight$", name)
    ]  # fmt: skip
    assert len(stacks) == 3 * len(moe)
    for name, a in stacks:
        b = np.asarray(dict(tree_named_leaves(back))[name])
        np.testing.assert_array_equal(b, mx(a), err_msg=name)
    again = tmp_path / "again.gguf"  # the values read back requantize to the bytes
    io.save_llama_gguf(again, c, back, tensor_type="F16", expert_type="MXFP4")
    assert again.read_bytes() == path.read_bytes()


def _run_spec(tmp_path, **export):
    """A validated run (a gpt-oss from scratch on text) with ``export`` set."""
    doc = wine_doc(tmp_path / "run")
    doc["model"] = {"architecture": "gpt_oss", "config": {"hidden_size": 64}}
    doc["data"] = {"train": doc["data"]["train"], "format": "text"}
    doc["training"].pop("eval_every", None)
    doc["export"] = {"formats": ["gguf"], **export}
    return validate(write(tmp_path / "run.yaml", doc))


def test_a_runs_export_section_writes_mxfp4_experts(tmp_path):
    """``export: {formats: [gguf], gguf_expert_type: MXFP4}`` reaches the writer."""
    c, params = tiny()
    spec = _run_spec(tmp_path, gguf_type="F16", gguf_expert_type="MXFP4")
    built = BuiltModel("gpt_oss", c, params)
    check_gguf_export(spec, built)  # fine
    files = write_outputs(spec, built, params, str(tmp_path / "out"))
    f = io.read_gguf(files["gguf"])
    assert f.metadata["general.file_type"] == 38
    assert f.tensors["blk.0.ffn_down_exps.weight"].type_id == 39
    assert f.tensors["blk.0.attn_q.weight"].type_id == 1


def test_a_run_refuses_an_expert_type_before_training(tmp_path):
    spec = _run_spec(tmp_path, gguf_expert_type="MXFP4")
    dense, params = tiny("llama")
    with pytest.raises(ConfigError, match=r"^export\.gguf_expert_type: .* no experts"):
        check_gguf_export(spec, BuiltModel("llama", dense, params))
    odd, params = tiny(width=48)
    with pytest.raises(ConfigError, match=r"^export\.gguf_expert_type: .* 32-value"):
        check_gguf_export(spec, BuiltModel("gpt_oss", odd, params))
