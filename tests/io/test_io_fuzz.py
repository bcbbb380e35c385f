"""Mutated, truncated and hostile files: only entrenar errors, no huge allocation."""

import struct
import tracemalloc

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from entrenar.errors import EntrenarError, FormatError
from entrenar.io import (
    Model,
    ModelFormat,
    ModelMetadata,
    SaveConfig,
    load_model,
    read_gguf,
    save_llama_gguf,
    save_model,
)
from entrenar.nn import LlamaConfig

MAX_PEAK = 32 * 2**20  # bytes any load of these ~1 KB files may allocate


def _small_model():
    rng = np.random.default_rng(0)
    params = {
        "enc": {"w": rng.standard_normal((4, 8)).astype(np.float32)},
        "b": np.arange(5, dtype=np.int32),
        "h": rng.standard_normal((2, 3)).astype(np.float16),
    }
    meta = ModelMetadata("fz", "mlp", training_config={"lr": 0.1}, custom={"k": [1]})
    return Model(meta, params)


@pytest.fixture(scope="module")
def seeds(tmp_path_factory):
    d = tmp_path_factory.mktemp("seeds")
    out = {}
    for fmt in ModelFormat:
        p = d / f"m.{fmt.value}"
        save_model(_small_model(), p, SaveConfig(fmt))
        out[fmt.value] = p.read_bytes()
    config = LlamaConfig(
        vocab_size=8,
        hidden_size=32,
        intermediate_size=32,
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
    )
    rng = np.random.default_rng(1)
    params = {
        "model": {
            "embed_tokens": {"weight": rng.standard_normal((8, 32), np.float32)},
            "norm": {"weight": np.ones(32, np.float32)},
            "layers": {
                "input_layernorm": {"weight": np.ones((1, 32), np.float32)},
                "post_attention_layernorm": {"weight": np.ones((1, 32), np.float32)},
                "self_attn": {
                    k: {"weight": rng.standard_normal((1, *s), np.float32)}
                    for k, s in [
                        ("q_proj", (32, 32)),
                        ("k_proj", (16, 32)),
                        ("v_proj", (16, 32)),
                        ("o_proj", (32, 32)),
                    ]
                },
                "mlp": {
                    k: {"weight": rng.standard_normal((1, 32, 32), np.float32)}
                    for k in ("gate_proj", "up_proj", "down_proj")
                },
            },
        },
        "lm_head": {"weight": rng.standard_normal((8, 32), np.float32)},
    }
    p = d / "llama.gguf"
    save_llama_gguf(p, config, params, tensor_type="Q8_0")
    out["llama"] = p.read_bytes()
    return out


def _load_ok_or_entrenar_error(path):
    tracemalloc.start()
    try:
        load_model(path)
    except EntrenarError:
        pass
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    assert peak < MAX_PEAK, f"loading a {path.stat().st_size}-byte file took {peak} B"


mutations = st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)), max_size=6)


@pytest.mark.parametrize("kind", ["json", "yaml", "safetensors", "gguf", "llama"])
@given(muts=mutations, cut=st.one_of(st.none(), st.integers(0, 10**6)))
def test_mutated_files_raise_only_entrenar_errors(
    seeds, tmp_path_factory, kind, muts, cut
):
    data = bytearray(seeds[kind])
    for pos, byte in muts:
        data[pos % len(data)] = byte
    if cut is not None:
        data = data[: cut % (len(data) + 1)]
    ext = "gguf" if kind == "llama" else kind
    path = tmp_path_factory.mktemp("fz") / f"x.{ext}"
    path.write_bytes(bytes(data))
    _load_ok_or_entrenar_error(path)


@pytest.mark.parametrize("kind", ["gguf", "llama", "safetensors"])
@given(pos=st.integers(0, 400), value=st.sampled_from([2**64 - 1, 2**63, 2**40, 2**32]))
def test_huge_integers_anywhere_in_header(seeds, tmp_path_factory, kind, pos, value):
    data = bytearray(seeds[kind])
    pos %= len(data) - 8
    data[pos : pos + 8] = struct.pack("<Q", value)
    path = tmp_path_factory.mktemp("fz") / "x.bin"
    path.write_bytes(bytes(data))
    _load_ok_or_entrenar_error(path)


def _gguf_header(n_tensors, n_kv, rest=b""):
    return b"GGUF" + struct.pack("<IQQ", 3, n_tensors, n_kv) + rest


@pytest.mark.parametrize(
    ("blob", "field"),
    [
        (_gguf_header(2**60, 0), "tensors"),
        (_gguf_header(0, 1, struct.pack("<Q", 2**62)), "metadata key 0"),
        (
            _gguf_header(
                0, 1, struct.pack("<Q", 1) + b"k" + struct.pack("<IIQ", 9, 8, 2**61)
            ),
            "'k'",
        ),
        (
            _gguf_header(0, 1, struct.pack("<Q", 1) + b"k" + struct.pack("<I", 77)),
            "unknown value type 77",
        ),
        (
            _gguf_header(1, 0, struct.pack("<Q", 1) + b"t" + struct.pack("<I", 9)),
            "n_dims 9",
        ),
        (
            _gguf_header(
                1,
                0,
                struct.pack("<Q", 1)
                + b"t"
                + struct.pack("<IQQIQ", 2, 2**32, 2**32, 0, 0),
            ),
            "more than the file",
        ),
    ],
)
def test_hostile_gguf_headers(tmp_path, blob, field):
    p = tmp_path / "h.gguf"
    p.write_bytes(blob + bytes(32))
    with pytest.raises(FormatError, match=field) as e:
        read_gguf(p)
    assert "h.gguf" in str(e.value)


def test_hostile_safetensors_and_json(tmp_path):
    p = tmp_path / "h.safetensors"
    header = b'{"w": {"dtype": "F32", "shape": [1000000000], "data_offsets": [0, 4]}}'
    p.write_bytes(struct.pack("<Q", len(header)) + header + bytes(4))
    with pytest.raises(FormatError, match=r"'w'.*data_offsets"):
        load_model(p)
    p.write_bytes(struct.pack("<Q", 2**40) + b"{}")
    with pytest.raises(FormatError, match="header length"):
        load_model(p)
    j = tmp_path / "h.json"
    j.write_text(
        '{"format": "entrenar.model", "format_version": 1, "tensors": '
        '{"w": {"dtype": "float32", "shape": [100000, 100000], "data": []}}}'
    )
    with pytest.raises(FormatError, match="more values than the file"):
        load_model(j)
    j.write_text(
        '{"format": "entrenar.model", "format_version": 1, "tensors": '
        '{"w": {"dtype": "float16", "shape": [1], "data": [1e10]}}}'
    )
    with pytest.raises(FormatError, match=r"'w'.*not float16"):
        load_model(j)
    j.write_text("[" * 100000)
    with pytest.raises(FormatError, match="invalid JSON"):
        load_model(j)
    y = tmp_path / "h.yaml"
    bomb = "a: &a [1,1,1,1,1,1,1,1,1]\n" + "".join(
        f"{c}: &{c} [*{p},*{p},*{p},*{p},*{p},*{p},*{p},*{p},*{p}]\n"
        for p, c in zip("abcdefgh", "bcdefghi")
    )
    y.write_text(
        "format: entrenar.model\nformat_version: 1\n"
        + bomb
        + "tensors: {w: {dtype: float32, shape: [9,9,9,9,9,9,9,9,9], data: *i}}\n"
    )
    with pytest.raises(FormatError):
        load_model(y)
