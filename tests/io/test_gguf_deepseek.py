"""DeepSeek-V2/V3 as llama.cpp's ``deepseek2`` GGUF (`entrenar.io.deepseek_gguf`).

Names and keys against the ``gguf`` package (llama.cpp's constants), round trips in
every tensor type, the YaRN keys' inverse, and the refusals. llama.cpp's logits on
entrenar's files are in tests/io/test_gguf_families.py (recorded), the converter's
files in tests/io/test_gguf_moe.py.
"""

from __future__ import annotations

import dataclasses
import json
import math

import jax
import numpy as np
import pytest

from entrenar import io, nn, quant
from entrenar.errors import ConfigError, FormatError, UnsupportedError
from entrenar.io.deepseek_gguf import (
    gguf_tensor_names,
    join_kv_b,
    split_kv_b,
    yarn_fields,
    yarn_keys,
)
from entrenar.io.gguf_families import FAMILY_KEY
from entrenar.io.gguf_reader import GGUFField, GGUFValueType
from entrenar.nn.rope_scaling import attention_factor

gguf = pytest.importorskip("gguf")

FAMILIES = ["deepseek_v3", "deepseek_v2"]
TOKENS = np.arange(11).reshape(1, 11) * 7 % 90  # (1, 11)
WIDE = dict(hidden_size=64, intermediate_size=64, kv_lora_rank=32, q_lora_rank=32,
            qk_nope_head_dim=32, v_head_dim=16, moe_intermediate_size=32)  # fmt: skip
"""Every row a whole number of 32-value blocks (quantized types)."""


def _tiny(family: str, **change) -> tuple[nn.DeepseekConfig, dict]:
    """The family's tiny as llama.cpp can run it (V2: greedy routing)."""
    config = nn.architecture(family).tiny()
    if family == "deepseek_v2":
        config = dataclasses.replace(config, topk_method="greedy")
    config = dataclasses.replace(config, **change)
    params = config.init(jax.random.key(2))
    for layer in params["model"]["layers"]:  # V3's correction bias, off zero
        gate = layer["mlp"].get("gate", {})
        if "e_score_correction_bias" in gate:
            b = gate["e_score_correction_bias"]
            gate["e_score_correction_bias"] = jax.random.normal(
                jax.random.key(4), b.shape
            )
    return config, params


@pytest.mark.parametrize("family", FAMILIES)
def test_names_and_keys_are_llama_cpps(family, tmp_path):
    config, params = _tiny(family)
    path = tmp_path / "m.gguf"
    io.save_llama_gguf(path, config, params)
    g = io.read_gguf(path)
    assert g.metadata["general.architecture"] == "deepseek2"
    arch = gguf.MODEL_ARCH.DEEPSEEK2
    allowed = {gguf.TENSOR_NAMES[t] for t in gguf.MODEL_TENSORS[arch]}
    tmap = gguf.get_tensor_name_map(arch, config.num_layers)
    for hf, ours in gguf_tensor_names(config).items():
        if isinstance(ours, tuple):  # kv_b_proj: the converter's own split
            assert ours == tuple(
                hf.replace(".self_attn.kv_b_proj", f".{p}").replace(
                    "model.layers.", "blk."
                )
                for p in ("attn_k_b", "attn_v_b")
            )
            continue
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
                known.add(value.replace("{arch}", "deepseek2", 1))
    for key in g.metadata:
        if not key.startswith(("general.", "tokenizer.", "entrenar.")):
            assert key in known, key


def _stored(w, kind: str) -> np.ndarray:
    a = np.asarray(w, np.float32)
    if kind == "F32":
        return a
    if kind in ("F16", "BF16"):
        dt = np.float16 if kind == "F16" else jax.numpy.bfloat16
        return np.asarray(a.astype(dt), np.float32)
    return np.asarray(quant.dequantize(quant.quantize(a, kind.lower()), np.float32))


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("kind", ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1"])
def test_a_deepseek_round_trips_bit_exact(family, kind, tmp_path):
    """Written in ``kind`` and read back: each matrix is its stored rounding.

    Norms and the router (weights, V3's correction bias) stay F32; ``kv_b_proj``
    is stored as its two halves (``attn_k_b`` transposed) and joined again. Read
    and written again, the file is the same bytes.
    """
    config, params = _tiny(family, **WIDE)
    path = tmp_path / "a.gguf"
    io.save_llama_gguf(path, config, params, tensor_type=kind)
    back, loaded, _ = io.load_llama_gguf(path)
    assert back == config
    assert io.file_architecture(str(path)) == family

    def check(kp, want, got):
        name = jax.tree_util.keystr(kp)
        router = "'gate'" in name and "experts" not in name
        stored = np.asarray(want, np.float32)
        if np.ndim(want) >= 2 and not router and "kv_b_proj" not in name:
            stored = _stored(stored, kind)
        elif "kv_b_proj" in name:  # quantized as llama.cpp's two tensors
            k_b, v_b = split_kv_b(stored, config)
            stored = join_kv_b(_stored(k_b, kind), _stored(v_b, kind))
        np.testing.assert_array_equal(np.asarray(got), stored, err_msg=name)

    jax.tree_util.tree_map_with_path(check, params, loaded)
    again = tmp_path / "b.gguf"
    io.save_llama_gguf(again, back, loaded, source=path, tensor_type=kind)
    assert again.read_bytes() == path.read_bytes()


def test_every_group_kept_is_written_as_one(tmp_path):
    """V3 routing over all 4 of 4 groups: keys 1/1 (llama.cpp asserts fewer used).

    The same routing; ``entrenar.family`` keeps the config's groups.
    """
    config, params = _tiny("deepseek_v3", topk_group=4)
    path = tmp_path / "a.gguf"
    io.save_llama_gguf(path, config, params)
    fields = io.read_gguf(path).fields
    assert fields["deepseek2.expert_group_count"].value == 1
    assert fields["deepseek2.expert_group_used_count"].value == 1
    back, loaded, _ = io.load_llama_gguf(path)
    assert back == config
    one = dataclasses.replace(config, n_group=1, topk_group=1)  # what the keys say
    np.testing.assert_array_equal(
        np.asarray(one.apply(loaded, TOKENS)), np.asarray(config.apply(params, TOKENS))
    )


@pytest.mark.parametrize(
    ("family", "drop"),
    [("deepseek_v3", ()), ("deepseek_v2", ()),
     ("deepseek_v2", ("deepseek2.attention.q_lora_rank",))],
)  # fmt: skip
def test_a_file_without_entrenars_key_reads_to_the_same_logits(family, drop, tmp_path):
    """As llama.cpp's converter writes it: the keys alone give the model.

    The family from the gating, YaRN's factors from ``attn_factor`` and
    ``yarn_log_multiplier`` (to float32 rounding); V2-Lite's ``q_proj`` with
    ``q_lora_rank`` 0 or, as the converter writes it, without the key.
    """
    config, params = _tiny(family)
    path = tmp_path / "a.gguf"
    io.save_llama_gguf(path, config, params)
    g = io.read_gguf(path)
    fields = {k: f for k, f in g.fields.items() if k != FAMILY_KEY and k not in drop}
    tensors = {
        n: io.GGUFTensor(g.raw(n), t.shape, t.type_id) for n, t in g.tensors.items()
    }
    io.write_gguf(tmp_path / "plain.gguf", fields, tensors)
    back, loaded, _ = io.load_llama_gguf(tmp_path / "plain.gguf")
    assert back.architecture == family
    assert io.file_architecture(str(tmp_path / "plain.gguf")) == family
    np.testing.assert_allclose(
        np.asarray(back.apply(loaded, TOKENS)),
        np.asarray(config.apply(params, TOKENS)),
        atol=1e-5,
    )


@pytest.mark.parametrize("m", [0.0, 0.707, 0.8, 1.0])
@pytest.mark.parametrize("factor", [None, 1.0, 0.9])
def test_the_yarn_keys_invert(m, factor):
    """`yarn_fields` of `yarn_keys` is the config's factor and mscale_all_dim."""
    config = dataclasses.replace(
        nn.architecture("deepseek_v3").tiny(), rope_mscale_all_dim=m,
        rope_attention_factor=factor,
    )  # fmt: skip
    a, log_mul = yarn_keys(config)
    got = yarn_fields(float(config.rope_factor), a, log_mul)
    want = attention_factor(config)
    assert attention_factor(dataclasses.replace(config, **got)) == pytest.approx(want)
    assert got["rope_mscale_all_dim"] == pytest.approx(m, abs=1e-9)
    # llama.cpp's rule (module docstring): cos by A (A g(1) without the multiplier),
    # the scores by that squared times g(M)^2; transformers' by g(m)^2
    f = float(config.rope_factor)
    cos = a if log_mul is not None else a * (0.1 * math.log(f) + 1)
    g_m = 1 + (log_mul or 0.0) * math.log(f)
    assert cos == pytest.approx(want)
    assert (cos * g_m) ** 2 == pytest.approx((0.1 * m * math.log(f) + 1) ** 2)


@pytest.mark.parametrize(
    ("family", "change", "match"),
    [
        ("deepseek_v3", dict(attention_bias=True, attention_out_bias=True),
         "attention biases"),
        ("deepseek_v3", dict(n_shared_experts=0), "needs its shared experts"),
        ("deepseek_v3", dict(rope_interleave=False), "consecutive pairs"),
        ("deepseek_v2", dict(topk_method="group_limited_greedy"),
         "sum of its top two scores"),
        ("deepseek_v3", dict(rope_type="linear", rope_mscale_all_dim=0.0),
         "rope_type 'linear'"),
    ],
)  # fmt: skip
def test_a_deepseek_llama_cpp_cannot_run_is_refused(family, change, match, tmp_path):
    config = dataclasses.replace(nn.architecture(family).tiny(), **change)
    with pytest.raises(UnsupportedError, match=match):
        io.save_llama_gguf(tmp_path / "x.gguf", config, config.init(jax.random.key(0)))
    assert not (tmp_path / "x.gguf").exists()


def test_a_quantized_type_needs_rows_of_whole_blocks(tmp_path):
    config, params = _tiny("deepseek_v3")  # kv_lora_rank 16
    with pytest.raises(ConfigError, match="whole 32-value blocks"):
        io.save_llama_gguf(tmp_path / "x.gguf", config, params, tensor_type="Q8_0")


def _rewritten(tmp_path, fields=None, drop=(), tensors_drop=(), extra=None):
    config, params = _tiny("deepseek_v3")
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
    return tmp_path / "x.gguf"


U32 = GGUFValueType.UINT32


@pytest.mark.parametrize(
    ("fields", "drop", "match"),
    [
        ({}, ("deepseek2.attention.key_length_mla",), "legacy deepseek2 file"),
        ({"deepseek2.expert_gating_func": GGUFField(3, U32)}, (),
         "expert_gating_func = 3"),
        ({"deepseek2.expert_gating_func": GGUFField(1, U32)}, (FAMILY_KEY,),
         "softmax routing with deepseek2.expert_group_count = 4"),
        ({"deepseek2.rope.scaling.type": GGUFField("linear", GGUFValueType.STRING)},
         (), "rope.scaling.type = 'linear'"),
    ],
)  # fmt: skip
def test_a_deepseek2_file_entrenar_cannot_read_is_refused(
    fields, drop, match, tmp_path
):
    path = _rewritten(tmp_path, fields, drop)
    with pytest.raises(UnsupportedError, match=match):
        io.load_llama_gguf(path)


@pytest.mark.parametrize(
    ("key", "value", "match"),
    [  # each loaded before: NaN logits, or a crash in the first forward pass
        ("rope_mscale_all_dim", math.nan, "rope_mscale_all_dim = nan: want a finite"),
        ("rope_factor", math.inf, "rope_factor = inf: want a finite"),
        ("rope_original_max_position_embeddings", -1, "embeddings = -1 is negative"),
        ("rope_mscale_all_dim", "x", "rope_mscale_all_dim = 'x' is not float"),
        # each refused, but as "'>' not supported between instances of ..."
        ("n_group", [4], r"n_group = \[4\] is not int"),
        ("topk_group", None, "topk_group = None is not int"),
    ],
)
def test_entrenars_family_object_holds_only_sound_values(key, value, match, tmp_path):
    g = io.read_gguf(_rewritten(tmp_path))
    family = json.loads(g.fields[FAMILY_KEY].value) | {key: value}
    text = GGUFField(json.dumps(family), GGUFValueType.STRING)
    path = _rewritten(tmp_path, {FAMILY_KEY: text})
    with pytest.raises(FormatError, match=rf"x\.gguf: .*{match}"):
        io.load_llama_gguf(path)


def test_a_deepseek_load_quantizes_as_asked(tmp_path):
    """``quantize`` on load (QLoRA's base) and ``keep_quantized`` (read dense)."""
    from entrenar import lora
    from entrenar.runs.models import base_quantizer

    config, params = _tiny("deepseek_v3", **WIDE)
    path = tmp_path / "a.gguf"
    io.save_llama_gguf(path, config, params, tensor_type="Q8_0")
    _, plain, _ = io.load_llama_gguf(path)
    _, kept, _ = io.load_llama_gguf(path, keep_quantized=True)
    jax.tree.map(np.testing.assert_array_equal, kept, plain)
    cfg = lora.LoRAConfig(targets=("o_proj",), quantize_base="nf4")  # 64 wide
    _, q, _ = io.load_llama_gguf(path, quantize=base_quantizer(cfg))
    w = q["model"]["layers"][1]["self_attn"]["o_proj"]["weight"]
    assert isinstance(w, quant.QuantizedWeight)
