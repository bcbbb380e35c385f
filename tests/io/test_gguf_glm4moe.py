"""GLM-4.5 / 4.6 as llama.cpp's ``glm4moe`` GGUF (`entrenar.io.glm4moe_gguf`).

Names and keys against the ``gguf`` package (llama.cpp's constants), round trips in
every tensor type, a file's MTP layer skipped, and the refusals. llama.cpp's logits
on entrenar's files are in tests/io/test_gguf_families.py (recorded); the
converter's file (keys, tensors, transformers' logits) in tests/io/test_gguf_moe.py.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

from entrenar import io, nn, quant
from entrenar.errors import ConfigError, FormatError, UnsupportedError
from entrenar.io.gguf_families import FAMILY_KEY
from entrenar.io.gguf_reader import GGUFField, GGUFValueType
from entrenar.io.glm4moe_gguf import gguf_tensor_names

gguf = pytest.importorskip("gguf")

TOKENS = np.arange(11).reshape(1, 11) * 7 % 90  # (1, 11)
WIDE = dict(hidden_size=64, intermediate_size=64, moe_intermediate_size=32,
            n_shared_experts=1)  # fmt: skip
"""Every row a whole number of 32-value blocks (quantized types)."""
U32 = GGUFValueType.UINT32


def _tiny(**change) -> tuple[nn.Glm4MoeConfig, dict]:
    """The tiny (groups, q/k norms, biases, a dense layer), biases off zero."""
    config = dataclasses.replace(nn.architecture("glm4_moe").tiny(), **change)
    params = config.init(jax.random.key(2))
    for layer in params["model"]["layers"]:  # the correction bias, off zero
        gate = layer["mlp"].get("gate", {})
        if "e_score_correction_bias" in gate:
            b = gate["e_score_correction_bias"]
            gate["e_score_correction_bias"] = jax.random.normal(
                jax.random.key(4), b.shape
            )
    return config, params


def test_names_and_keys_are_llama_cpps(tmp_path):
    config, params = _tiny()
    path = tmp_path / "m.gguf"
    io.save_llama_gguf(path, config, params)
    g = io.read_gguf(path)
    assert g.metadata["general.architecture"] == "glm4moe"
    arch = gguf.MODEL_ARCH.GLM4_MOE
    allowed = {gguf.TENSOR_NAMES[t] for t in gguf.MODEL_TENSORS[arch]}
    tmap = gguf.get_tensor_name_map(arch, config.num_layers)
    for hf, ours in gguf_tensor_names(config).items():
        if "experts." in hf and "shared" not in hf:  # stacked by the converter
            continue
        key = hf.replace("e_score_correction_bias", "e_score_correction.bias")
        assert tmap.get_name(key, try_suffixes=(".weight", ".bias")) == ours, hf
    for tensor in g.tensors:
        stem = tensor.rsplit(".", 1)[0]
        parts = stem.split(".", 2)
        if parts[0] == "blk":
            stem = f"blk.{{bid}}.{parts[2]}"
        assert stem in allowed, tensor
    known = set()
    for group in (gguf.Keys.LLM, gguf.Keys.Attention, gguf.Keys.Rope):
        for value in vars(group).values():
            if isinstance(value, str) and value.startswith("{arch}."):
                known.add(value.replace("{arch}", "glm4moe", 1))
    for key in g.metadata:
        if not key.startswith(("general.", "tokenizer.", "entrenar.")):
            assert key in known, key
    m = g.metadata  # the MTP layer declared (the converter's trunk-only file)
    assert m["glm4moe.block_count"] == config.num_layers + 1
    assert m["glm4moe.nextn_predict_layers"] == 1
    assert m["glm4moe.expert_gating_func"] == 2  # sigmoid
    assert not any(t.startswith(f"blk.{config.num_layers}.") for t in g.tensors)


def _stored(w, kind: str) -> np.ndarray:
    a = np.asarray(w, np.float32)
    if kind == "F32":
        return a
    if kind in ("F16", "BF16"):
        dt = np.float16 if kind == "F16" else jax.numpy.bfloat16
        return np.asarray(a.astype(dt), np.float32)
    return np.asarray(quant.dequantize(quant.quantize(a, kind.lower()), np.float32))


@pytest.mark.parametrize("kind", ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1"])
def test_a_glm4_moe_round_trips_bit_exact(kind, tmp_path):
    """Written in ``kind`` and read back: each matrix is its stored rounding.

    Norms, biases and the router (weights, correction bias) stay F32. Read and
    written again, the file is the same bytes.
    """
    config, params = _tiny(**WIDE)
    path = tmp_path / "a.gguf"
    io.save_llama_gguf(path, config, params, tensor_type=kind)
    back, loaded, _ = io.load_llama_gguf(path)
    assert back == config
    assert io.file_architecture(str(path)) == "glm4_moe"

    def check(kp, want, got):
        name = jax.tree_util.keystr(kp)
        router = "'gate'" in name and "experts" not in name
        stored = np.asarray(want, np.float32)
        if np.ndim(want) >= 2 and not router:
            stored = _stored(stored, kind)
        np.testing.assert_array_equal(np.asarray(got), stored, err_msg=name)

    jax.tree_util.tree_map_with_path(check, params, loaded)
    again = tmp_path / "b.gguf"
    io.save_llama_gguf(again, back, loaded, source=path, tensor_type=kind)
    assert again.read_bytes() == path.read_bytes()


def _rewritten(tmp_path, fields=None, drop=(), tensors_drop=(), extra=None, **change):
    config, params = _tiny(**change)
    src = tmp_path / "a.gguf"
    io.save_llama_gguf(src, config, params)
    g = io.read_gguf(src)
    out = {k: f for k, f in g.fields.items() if k not in drop} | (fields or {})
    tensors = {
        n: io.GGUFTensor(g.raw(n), t.shape, t.type_id)
        for n, t in g.tensors.items()
        if n not in tensors_drop
    } | (extra or {})
    io.write_gguf(tmp_path / "x.gguf", out, tensors)
    return config, params, tmp_path / "x.gguf"


@pytest.mark.parametrize(
    "change",
    [{}, dict(topk_group=4), dict(routed_scaling_factor=1.1),
     dict(num_nextn_predict_layers=0, attention_bias=False, qk_norm=False)],
)  # fmt: skip
def test_a_file_without_entrenars_key_reads_to_the_same_logits(change, tmp_path):
    """As llama.cpp's converter writes it: the keys alone give the model.

    Every group kept is written as one (llama.cpp asserts fewer groups used than
    there are): the same routing; a scale to float32 rounding.
    """
    config, params, path = _rewritten(tmp_path, drop=(FAMILY_KEY,), **change)
    back, loaded, _ = io.load_llama_gguf(path)
    assert back.architecture == "glm4_moe"
    assert io.file_architecture(str(path)) == "glm4_moe"
    assert (back.num_layers, back.num_nextn_predict_layers) == (
        config.num_layers, config.num_nextn_predict_layers,
    )  # fmt: skip
    np.testing.assert_allclose(
        np.asarray(back.apply(loaded, TOKENS)),
        np.asarray(config.apply(params, TOKENS)),
        atol=1e-5,
    )


def test_a_files_mtp_layer_is_skipped(tmp_path):
    """A converter's file with the MTP layer's tensors reads to the trunk.

    ``blk.L.*`` (a whole layer and its ``nextn.*`` tensors) with ``block_count`` L +
    1 and ``nextn_predict_layers`` 1 (not skipped: "unexpected tensors").
    """
    config, params = _tiny()
    g_src = tmp_path / "trunk.gguf"
    io.save_llama_gguf(g_src, config, params)
    g = io.read_gguf(g_src)
    n = config.num_layers
    rng = np.random.default_rng(0)
    extra = {}
    for name, t in g.tensors.items():  # the last layer's tensors, as layer n
        if name.startswith(f"blk.{n - 1}."):
            a = rng.standard_normal(t.shape).astype(np.float32)
            extra[name.replace(f"blk.{n - 1}.", f"blk.{n}.")] = a
    d = config.hidden_size
    extra[f"blk.{n}.nextn.eh_proj.weight"] = np.ones((d, 2 * d), np.float32)
    extra[f"blk.{n}.nextn.enorm.weight"] = np.ones((d,), np.float32)
    extra[f"blk.{n}.nextn.hnorm.weight"] = np.ones((d,), np.float32)
    tensors = {
        k: io.GGUFTensor(g.raw(k), t.shape, t.type_id) for k, t in g.tensors.items()
    } | {
        k: io.GGUFTensor(v.view(np.uint8).reshape(-1), v.shape, 0)
        for k, v in extra.items()
    }
    io.write_gguf(tmp_path / "mtp.gguf", dict(g.fields), tensors)
    back, loaded, _ = io.load_llama_gguf(tmp_path / "mtp.gguf")
    assert back == config
    jax.tree.map(np.testing.assert_array_equal, loaded, params)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (dict(n_shared_experts=0), "adds its shared experts"),
        (dict(num_experts=0, first_k_dense_replace=3), "n_expert > 0"),
        (dict(rope_type="linear", rope_factor=2.0), "rope_type 'linear'"),
    ],
)  # fmt: skip
def test_a_glm4_moe_llama_cpp_cannot_run_is_refused(change, match, tmp_path):
    config = dataclasses.replace(nn.architecture("glm4_moe").tiny(), **change)
    with pytest.raises(UnsupportedError, match=match):
        io.save_llama_gguf(tmp_path / "x.gguf", config, config.init(jax.random.key(0)))
    assert not (tmp_path / "x.gguf").exists()


def test_a_quantized_type_needs_rows_of_whole_blocks(tmp_path):
    config, params = _tiny()  # hidden 32, experts 12 wide
    with pytest.raises(ConfigError, match="whole 32-value blocks"):
        io.save_llama_gguf(tmp_path / "x.gguf", config, params, tensor_type="Q8_0")


@pytest.mark.parametrize(
    ("fields", "tensors_drop", "error", "match"),
    [
        ({"glm4moe.expert_gating_func": GGUFField(1, U32)}, (), UnsupportedError,
         "expert_gating_func = 1"),
        ({"glm4moe.rope.scaling.type": GGUFField("yarn", GGUFValueType.STRING)},
         (), UnsupportedError, "rope.scaling.type = 'yarn'"),
        ({"glm4moe.rope.dimension_sections": GGUFField(
            [8, 8, 0, 0], GGUFValueType.ARRAY, GGUFValueType.INT32)},
         (), UnsupportedError, "M-RoPE"),
        ({"glm4moe.rope.dimension_sections": GGUFField(
            [0, 0, 0, 0], GGUFValueType.ARRAY, GGUFValueType.INT32)},
         (), None, ""),
        ({}, ("blk.0.attn_norm.weight",), UnsupportedError, "without its trunk"),
        ({"glm4moe.nextn_predict_layers": GGUFField(4, U32)}, (), FormatError,
         "leaves no layer"),
        ({"glm4moe.rope.dimension_count": GGUFField(7, U32)}, (), FormatError,
         "must be even"),
    ],
)  # fmt: skip
def test_a_glm4moe_file_entrenar_cannot_read_is_refused(
    fields, tensors_drop, error, match, tmp_path
):
    *_, path = _rewritten(tmp_path, fields, tensors_drop=tensors_drop)
    if error is None:  # (sections all 0: no M-RoPE, read)
        assert io.load_llama_gguf(path)[0].architecture == "glm4_moe"
        return
    with pytest.raises(error, match=match):
        io.load_llama_gguf(path)


def test_a_glm4_moe_load_quantizes_as_asked(tmp_path):
    """``quantize`` on load (QLoRA's base) and ``keep_quantized`` (read dense)."""
    from entrenar import lora
    from entrenar.runs.models import base_quantizer

    config, params = _tiny(**WIDE)
    path = tmp_path / "a.gguf"
    io.save_llama_gguf(path, config, params, tensor_type="Q8_0")
    _, plain, _ = io.load_llama_gguf(path)
    _, kept, _ = io.load_llama_gguf(path, keep_quantized=True)
    jax.tree.map(np.testing.assert_array_equal, kept, plain)
    cfg = lora.LoRAConfig(targets=("o_proj",), quantize_base="nf4")  # 64 wide
    _, q, _ = io.load_llama_gguf(path, quantize=base_quantizer(cfg))
    w = q["model"]["layers"][1]["self_attn"]["o_proj"]["weight"]
    assert isinstance(w, quant.QuantizedWeight)
