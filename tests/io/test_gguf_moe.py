"""Mixture-of-experts GGUF files: Mixtral (``llama``), Qwen MoE, OLMoE, Granite MoE.

Mixtral as ``llama``, ``qwen3moe``, ``qwen2moe``, ``olmoe`` and ``granitemoe``
(Granite MoE shared included); the converter's files of ``deepseek2`` and
``glm4moe`` (GLM-4.5: a file declaring its MTP layer, without its tensors, as the
converter writes a folder of the trunk) too.

References, recorded by tests/oracles/make_moe_gguf_reference.py into
tests/data/llama_cpp_moe: llama.cpp's own converter's F16 files of tiny random
transformers models, transformers' logits for them, and llama.cpp's logits for the
converter's files and for entrenar's F32 rewrite of each.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from pathlib import Path

import gguf
import jax
import numpy as np
import pytest

from entrenar import io, lora, nn, quant
from entrenar.errors import ConfigError, FormatError, UnsupportedError
from entrenar.io.gguf_reader import GGUFField, GGUFValueType
from entrenar.runs.models import base_quantizer

DATA = Path(__file__).resolve().parents[1] / "data" / "llama_cpp_moe"
FAMILIES = ["mixtral", "qwen3_moe", "qwen2_moe", "olmoe", "granitemoe",
            "granitemoeshared", "deepseek_v3", "deepseek_v2", "glm4_moe"]  # fmt: skip
NAMES = {"mixtral": "llama", "qwen3_moe": "qwen3moe", "qwen2_moe": "qwen2moe",
         "olmoe": "olmoe", "granitemoe": "granitemoe",
         "granitemoeshared": "granitemoe", "deepseek_v3": "deepseek2",
         "deepseek_v2": "deepseek2", "glm4_moe": "glm4moe"}  # fmt: skip
EXTRA_KEYS = {"vocab_size", "rope.dimension_count"}
"""``{arch}.*`` keys entrenar writes for every family and the converter leaves to
llama.cpp's defaults for Qwen (the embedding's rows, the head dimension)."""


@pytest.fixture(scope="module")
def record():
    rec = json.loads((DATA / "reference.json").read_text())
    with np.load(DATA / "reference.npz") as z:
        arrays = dict(z)
    return rec, arrays


def _converted(family, record):
    rec, _ = record
    path = DATA / f"{family}.gguf"
    assert (
        hashlib.sha256(path.read_bytes()).hexdigest()
        == (rec["cases"][family]["sha256"])
    )
    return path


@pytest.mark.parametrize("family", FAMILIES)
def test_the_converters_file_reads_to_transformers(family, record):
    """convert_hf_to_gguf.py's file gives transformers' config and logits.

    Before: refused ('a mixture of experts ... not from GGUF files yet').
    """
    rec, arrays = record
    config, params, _ = io.load_llama_gguf(_converted(family, record))
    folder = rec["cases"][family]["config.json"]
    hf = nn.architecture_for_hf(folder, "config.json").from_hf(folder)
    assert config.architecture == family
    for field in ("num_experts", "num_experts_per_tok", "norm_topk_prob",
                  "expert_size", "shared_expert_intermediate_size",
                  "shared_mlp_intermediate_size", "head_dim"):  # fmt: skip
        assert getattr(config, field) == getattr(hf, field), field
    tokens = np.asarray(rec["how"]["tokens"])
    got = np.asarray(config.apply(params, tokens))
    np.testing.assert_allclose(got, arrays[f"{family}_hf"], atol=2e-5)


@pytest.mark.parametrize("family", FAMILIES)
def test_entrenars_export_is_the_converters_file(family, record, tmp_path):
    """Rewritten in F16: the converter's tensors byte for byte, and its metadata.

    The routers stay F32 as the converter (and llama-quantize) keep them.
    """
    src = _converted(family, record)
    config, params, _ = io.load_llama_gguf(src)
    io.save_llama_gguf(tmp_path / "x.gguf", config, params, source=src,
                       tensor_type="F16")  # fmt: skip
    want, got = io.read_gguf(src), io.read_gguf(tmp_path / "x.gguf")
    assert set(got.tensors) == set(want.tensors)
    for n, t in want.tensors.items():
        u = got.tensors[n]
        assert (u.shape, u.type_name) == (t.shape, t.type_name), n
        np.testing.assert_array_equal(got.raw(n), want.raw(n), err_msg=n)
    p = NAMES[family] + "."
    assert {k for k in got.metadata if k.startswith(p)} - set(want.metadata) <= {
        p + k for k in EXTRA_KEYS
    }
    for k, v in want.metadata.items():
        assert got.metadata[k] == v, k
    assert io.load_llama_gguf(tmp_path / "x.gguf")[0] == config


@pytest.mark.parametrize("family", FAMILIES)
def test_llama_cpp_runs_entrenars_file_to_entrenars_logits(family, record, tmp_path):
    """llama.cpp's recorded logits on entrenar's F32 rewrite equal entrenar's.

    And on the converter's F16 file, within ggml's F16 activations (4e-4 here).
    """
    rec, arrays = record
    src = _converted(family, record)
    config, params, _ = io.load_llama_gguf(src)
    path = tmp_path / f"{family}.gguf"
    io.save_llama_gguf(path, config, params, source=src, tensor_type="F32")
    assert (
        hashlib.sha256(path.read_bytes()).hexdigest()
        == (rec["cases"][family]["entrenar_sha256"])
    ), "the writer changed: rerun tests/oracles/make_moe_gguf_reference.py"
    back, loaded, _ = io.load_llama_gguf(path)
    ours = np.asarray(back.apply(loaded, np.asarray(rec["how"]["tokens"]))[0])
    np.testing.assert_allclose(ours, arrays[f"{family}_cpp_entrenar"], atol=1e-5)
    np.testing.assert_allclose(ours, arrays[f"{family}_cpp_converted"], atol=2e-3)


@pytest.mark.parametrize(
    ("family", "change", "match"),
    [
        ("qwen3_moe", dict(norm_topk_prob=False), "always renormalises"),
        ("mixtral", dict(norm_topk_prob=False), "always renormalises"),
        ("qwen2_moe", dict(norm_topk_prob=True), "never renormalises"),
        ("qwen2_moe", dict(norm_topk_prob=False, shared_expert_intermediate_size=0),
         "needs shared expert"),
        ("qwen3_moe", dict(norm_topk_prob=True, shared_expert_intermediate_size=8),
         "has no shared expert"),
        ("qwen3", dict(num_experts=4), "reads experts only in"),
    ],
)  # fmt: skip
def test_a_routing_llama_cpp_cannot_compute_is_refused(family, change, match, tmp_path):
    config = dataclasses.replace(nn.architecture(family).tiny(), **change)
    with pytest.raises(UnsupportedError, match=match):
        io.save_llama_gguf(tmp_path / "x.gguf", config, config.init(jax.random.key(0)))
    assert not (tmp_path / "x.gguf").exists()


def _mixtral(kind: str, tmp_path: Path) -> tuple[Path, nn.LlamaConfig]:
    """A tiny Mixtral written in ``kind`` (rows of whole 64-value NF4 blocks)."""
    config = dataclasses.replace(
        nn.architecture("mixtral").tiny(), sliding_window=None, hidden_size=64
    )
    path = tmp_path / f"m_{kind}.gguf"
    io.save_llama_gguf(path, config, config.init(jax.random.key(1)), tensor_type=kind)
    return path, config


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0", "Q4_1"])
def test_quantized_experts_are_dequantized_on_load_as_gguf_py(kind, tmp_path):
    """Expert tensors in a ggml block type read to gguf-py's dequantization.

    (``keep_quantized`` keeps the 3-D projections as stored; the experts' 4-D
    leaves are dequantized on load.)
    """
    path, _ = _mixtral(kind, tmp_path)
    ref = gguf.GGUFReader(path)
    stored = {t.name: t for t in ref.tensors}
    assert stored["blk.0.ffn_up_exps.weight"].tensor_type.name == kind
    assert stored["blk.0.ffn_gate_inp.weight"].tensor_type.name == "F32"
    for keep in (False, True):
        _, params, _ = io.load_llama_gguf(path, keep_quantized=keep)
        ex = params["model"]["layers"]["mlp"]["experts"]
        for proj, stem in (("gate_proj", "gate"), ("up_proj", "up"),
                           ("down_proj", "down")):  # fmt: skip
            got = np.asarray(ex[proj]["weight"])  # (L, E, out, in)
            for i in range(got.shape[0]):
                t = stored[f"blk.{i}.ffn_{stem}_exps.weight"]
                want = gguf.quants.dequantize(t.data, t.tensor_type)
                np.testing.assert_array_equal(got[i], want, err_msg=f"{proj} {i}")


def test_quantized_experts_quantize_to_nf4_on_load(tmp_path):
    """A QLoRA load quantizes the Q8_0 experts to NF4 as it reads them.

    As quantizing the dequantized experts afterwards does, bit for bit.
    """
    path, _ = _mixtral("Q8_0", tmp_path)
    targets = ("experts.gate_proj", "experts.up_proj", "experts.down_proj")
    cfg = lora.LoRAConfig(targets=targets, quantize_base="nf4")
    _, streamed, _ = io.load_llama_gguf(path, quantize=base_quantizer(cfg))
    _, plain, _ = io.load_llama_gguf(path)
    ex = streamed["model"]["layers"]["mlp"]["experts"]
    for p in ex:
        want = quant.quantize(
            plain["model"]["layers"]["mlp"]["experts"][p]["weight"], "nf4",
            double_quant=True,
        )  # fmt: skip
        got = ex[p]["weight"]
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=p)


def test_a_quantized_type_needs_expert_rows_of_whole_blocks(tmp_path):
    config = nn.architecture("qwen3_moe").tiny()  # experts 24 wide
    config = dataclasses.replace(config, norm_topk_prob=True)
    with pytest.raises(ConfigError, match="multiples of 32"):
        io.save_llama_gguf(tmp_path / "x.gguf", config, config.init(jax.random.key(0)),
                           tensor_type="Q8_0")  # fmt: skip


def _rewrite(src: Path, dst: Path, fields=None, drop=()) -> Path:
    g = io.read_gguf(src)
    out = {k: f for k, f in g.fields.items() if k not in drop} | (fields or {})
    tensors = {
        n: io.GGUFTensor(g.raw(n), t.shape, t.type_id) for n, t in g.tensors.items()
    }
    io.write_gguf(dst, out, tensors)
    return dst


def test_expert_tensors_without_an_expert_count_are_refused(tmp_path, record):
    path = _rewrite(_converted("qwen3_moe", record), tmp_path / "x.gguf",
                    drop=("qwen3moe.expert_count",))  # fmt: skip
    with pytest.raises(
        FormatError, match=r"expert tensors but no qwen3moe\.expert_count"
    ):
        io.load_llama_gguf(path)


def test_more_experts_used_than_there_are_is_refused(tmp_path, record):
    u32 = GGUFValueType.UINT32
    path = _rewrite(_converted("qwen3_moe", record), tmp_path / "x.gguf",
                    {"qwen3moe.expert_used_count": GGUFField(5, u32)})  # fmt: skip
    with pytest.raises(FormatError, match="expert_used_count = 5 is over"):
        io.load_llama_gguf(path)


@pytest.mark.parametrize(
    ("value", "kind", "shown"),
    [(2.5, GGUFValueType.FLOAT32, r"2\.5"), ("x", GGUFValueType.STRING, "x")],
)
def test_a_scaled_routing_is_refused(value, kind, shown, tmp_path, record):
    """A scale entrenar does not apply, or not a number, is refused by name."""
    path = _rewrite(_converted("mixtral", record), tmp_path / "x.gguf",
                    {"llama.expert_weights_scale": GGUFField(value, kind)})  # fmt: skip
    with pytest.raises(UnsupportedError, match=f"expert_weights_scale = {shown}"):
        io.load_llama_gguf(path)


KQUANT_BLOCKS = {"Q4_K": (144, (0, 2)), "Q6_K": (210, (208,))}
"""ggml K-quant: bytes per 256 values, and the offsets of its float16 scales."""


def _kquant_bytes(kind: str, n: int, seed: int) -> np.ndarray:
    """``n`` values' worth of random ``kind`` blocks with small, finite scales."""
    size, scales = KQUANT_BLOCKS[kind]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (n // 256, size), dtype=np.uint8)
    for at in scales:  # d (and Q4_K's dmin): 0.001 .. 0.01
        d = rng.uniform(1e-3, 1e-2, n // 256).astype(np.float16)
        raw[:, at : at + 2] = d.view(np.uint8).reshape(-1, 2)
    return raw.reshape(-1)


def test_k_quant_experts_read_to_gguf_pys_dequantization(tmp_path):
    """Q4_K and Q6_K expert tensors read to gguf-py's dequantization.

    A Q4_K_M-like mix (layer 0's down in Q6_K), dequantized on load with and
    without ``keep_quantized``.
    """
    config = dataclasses.replace(
        nn.architecture("mixtral").tiny(), sliding_window=None, hidden_size=256,
        intermediate_size=256, head_dim=64,
    )  # fmt: skip
    src = tmp_path / "f32.gguf"
    io.save_llama_gguf(src, config, config.init(jax.random.key(0)))
    g = io.read_gguf(src)
    tensors = {}
    for n, t in g.tensors.items():
        kind = None
        if n.endswith("_exps.weight"):
            kind = "Q6_K" if n == "blk.0.ffn_down_exps.weight" else "Q4_K"
        raw = (
            g.raw(n)
            if kind is None
            else _kquant_bytes(kind, math.prod(t.shape), len(n))
        )
        type_id = t.type_id if kind is None else gguf.GGMLQuantizationType[kind]
        tensors[n] = io.GGUFTensor(raw, t.shape, int(type_id))
    path = tmp_path / "k.gguf"
    io.write_gguf(path, dict(g.fields), tensors)
    ref = {t.name: t for t in gguf.GGUFReader(path).tensors}
    assert ref["blk.0.ffn_down_exps.weight"].tensor_type.name == "Q6_K"
    assert ref["blk.1.ffn_up_exps.weight"].tensor_type.name == "Q4_K"
    for keep in (False, True):
        _, params, _ = io.load_llama_gguf(path, keep_quantized=keep)
        ex = params["model"]["layers"]["mlp"]["experts"]
        for proj in ("gate", "up", "down"):
            got = np.asarray(ex[f"{proj}_proj"]["weight"])  # (L, E, out, in)
            for i in range(config.num_layers):
                t = ref[f"blk.{i}.ffn_{proj}_exps.weight"]
                want = gguf.quants.dequantize(t.data, t.tensor_type)
                np.testing.assert_array_equal(got[i], want, err_msg=f"{proj} {i}")


# ------------------------------------------------------ OLMoE, Granite MoE (shared)
NEW = ["olmoe", "granitemoe", "granitemoeshared"]
LLAMA_CPP_ONLY = {
    "olmoe": dict(clip_qkv=None, attention_out_bias=False, num_kv_heads=4)
}
"""What OLMoE's tiny drops for GGUF (llama.cpp's olmoe has no clipping, no o_proj
bias and no grouped-query attention)."""


def _tiny_new(family: str) -> tuple[nn.LlamaConfig, dict]:
    """The family's tiny with rows of whole 32-value blocks (hidden 64, shared 32)."""
    config = dataclasses.replace(
        nn.architecture(family).tiny(), hidden_size=64,
        **LLAMA_CPP_ONLY.get(family, {}),
    )  # fmt: skip
    if config.shared_mlp_intermediate_size:
        config = dataclasses.replace(config, shared_mlp_intermediate_size=32)
    return config, config.init(jax.random.key(5))


def _stored(w, kind: str):
    """What ``kind`` stores of ``w``: entrenar's rounding or quantization, as f32."""
    a = np.asarray(w, np.float32)
    if kind == "F32":
        return a
    if kind in ("F16", "BF16"):
        dt = np.float16 if kind == "F16" else jax.numpy.bfloat16
        return np.asarray(a.astype(dt), np.float32)
    q = quant.quantize(a, kind.lower())
    return np.asarray(quant.dequantize(q, np.float32))


@pytest.mark.parametrize("family", NEW)
@pytest.mark.parametrize("kind", ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1"])
def test_new_moe_families_round_trip_bit_exact(family, kind, tmp_path):
    """Written in each type and read back: each matrix is its stored rounding.

    Bit for bit: F32 as it was, F16/BF16 rounded, Q8_0/Q4_0/Q4_1 as
    `entrenar.quant` quantizes and dequantizes it (norms, biases and the routers
    stay F32). Read and written again, the file is the same bytes.
    """
    config, params = _tiny_new(family)
    path = tmp_path / "a.gguf"
    io.save_llama_gguf(path, config, params, tensor_type=kind)
    back, loaded, _ = io.load_llama_gguf(path)
    assert back == config
    assert io.file_architecture(str(path)) == family

    def check(kp, want, got):
        name = jax.tree_util.keystr(kp)
        table = "embed" in name or "lm_head" in name
        router = "'gate'" in name and "experts" not in name  # kept F32
        stored = np.asarray(want, np.float32)  # norms, biases: F32
        if table:
            stored = _stored(stored, kind)
        elif want.ndim >= 3 and not router:  # (L, ...) a layer at a time
            stored = np.stack([_stored(w, kind) for w in stored])
        np.testing.assert_array_equal(np.asarray(got), stored, err_msg=name)

    jax.tree_util.tree_map_with_path(check, params, loaded)
    again = tmp_path / "b.gguf"
    io.save_llama_gguf(again, back, loaded, source=path, tensor_type=kind)
    assert again.read_bytes() == path.read_bytes()


def test_granitemoeshared_shared_mlp_is_the_converters_two_halves(tmp_path):
    """``shared_mlp.input_linear (2S, D)`` is stored as ffn_gate_shexp, ffn_up_shexp."""
    config, params = _tiny_new("granitemoeshared")
    path = tmp_path / "a.gguf"
    io.save_llama_gguf(path, config, params)
    g = io.read_gguf(path)
    fused = np.asarray(
        params["model"]["layers"]["shared_mlp"]["input_linear"]["weight"]
    )
    s = config.shared_mlp_intermediate_size
    for i in range(config.num_layers):
        np.testing.assert_array_equal(g.tensor(f"blk.{i}.ffn_gate_shexp.weight"),
                                      fused[i, :s])  # fmt: skip
        np.testing.assert_array_equal(g.tensor(f"blk.{i}.ffn_up_shexp.weight"),
                                      fused[i, s:])  # fmt: skip
    assert g.metadata["granitemoe.expert_shared_feed_forward_length"] == s
    assert g.metadata["general.architecture"] == "granitemoe"


@pytest.mark.parametrize("kind", ["Q8_0", "BF16"])
def test_granitemoeshared_halves_load_alike_every_way(kind, tmp_path):
    """Streamed, unstreamed and ``keep_quantized`` (the halves joined dense)."""
    config, params = _tiny_new("granitemoeshared")
    path = tmp_path / "a.gguf"
    io.save_llama_gguf(path, config, params, tensor_type=kind)
    _, streamed, _ = io.load_llama_gguf(path)
    _, whole, _ = io.load_llama_gguf(path, stream=False)
    jax.tree.map(np.testing.assert_array_equal, whole, streamed)
    _, kept, _ = io.load_llama_gguf(path, keep_quantized=True)
    shared = kept["model"]["layers"]["shared_mlp"]["input_linear"]["weight"]
    want = streamed["model"]["layers"]["shared_mlp"]["input_linear"]["weight"]
    np.testing.assert_array_equal(np.asarray(shared), np.asarray(want))


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (dict(clip_qkv=0.9), "olmoe has clip_qkv=None"),
        (dict(attention_out_bias=True), "olmoe has attention_out_bias=False"),
        (dict(norm_topk_prob=True), "olmoe never renormalises"),
        (dict(num_kv_heads=2), "as many KV heads"),
    ],
)
def test_an_olmoe_llama_cpp_cannot_run_is_refused(change, match, tmp_path):
    config, _ = _tiny_new("olmoe")
    config = dataclasses.replace(config, **change)
    with pytest.raises(UnsupportedError, match=match):
        io.save_llama_gguf(tmp_path / "x.gguf", config, config.init(jax.random.key(0)))
    assert not (tmp_path / "x.gguf").exists()


def test_a_granitemoe_routing_llama_cpp_cannot_compute_is_refused(tmp_path):
    config, _ = _tiny_new("granitemoe")
    config = dataclasses.replace(config, norm_topk_prob=False)
    with pytest.raises(UnsupportedError, match="granitemoe always renormalises"):
        io.save_llama_gguf(tmp_path / "x.gguf", config, config.init(jax.random.key(0)))
