"""ggml dequantizers against the gguf package's (an independent numpy port)."""

import gguf
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from entrenar.errors import FormatError, UnsupportedError
from entrenar.io import GGML_TYPES, dequantize_ggml, ggml_dequant
from entrenar.io.ggml_dequant import dequantize_ggml_into, row_bytes

TYPES = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"]
TYPES += ["Q4_K", "Q5_K", "Q6_K"]


def _random_blocks(rng, name: str, rows: int, blocks: int) -> np.ndarray:
    """Random bytes whose float16 scale fields are finite, moderate numbers."""
    qt = gguf.GGMLQuantizationType[name]
    _, ts = gguf.GGML_QUANT_SIZES[qt]
    raw = rng.integers(0, 256, size=(rows * blocks, ts), dtype=np.uint8)
    if name in ("F32", "F16", "BF16"):
        dt = {"F32": np.float32, "F16": np.float16}.get(name, np.float32)
        vals = rng.standard_normal(rows * blocks).astype(dt)
        if name == "BF16":
            return (vals.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
        return vals.view(np.uint8)
    # scale positions: Q6_K keeps d at the end; all others start with d (and m/dmin)
    d = rng.uniform(-0.1, 0.1, size=(rows * blocks, 2)).astype(np.float16)
    if name == "Q6_K":
        raw[:, -2:] = d[:, :1].view(np.uint8)
    elif name in ("Q8_0", "Q4_0", "Q5_0"):
        raw[:, :2] = d[:, :1].view(np.uint8)
    else:
        raw[:, :4] = d.view(np.uint8)
    return raw.reshape(-1)


@pytest.mark.parametrize("name", TYPES)
@given(seed=st.integers(0, 2**31), rows=st.integers(1, 3), blocks=st.integers(1, 3))
def test_dequantize_matches_gguf(name, seed, rows, blocks):
    rng = np.random.default_rng(seed)
    qt = gguf.GGMLQuantizationType[name]
    bs, _ = gguf.GGML_QUANT_SIZES[qt]
    raw = _random_blocks(rng, name, rows, blocks)
    shape = (rows, bs * blocks)
    ref = gguf.quants.dequantize(raw.reshape(rows, -1), qt).reshape(shape)
    got = dequantize_ggml(raw, qt.value, shape)
    assert got.dtype == np.float32 and got.shape == shape
    np.testing.assert_array_equal(got, ref.astype(np.float32))


@pytest.mark.parametrize("scheme", ["Q8_0", "Q4_0", "Q4_1"])
def test_dequantize_matches_entrenar_quant(scheme):
    from entrenar.quant import dequantize as qdeq
    from entrenar.quant import from_ggml

    raw = _random_blocks(np.random.default_rng(1), scheme, 4, 2)
    shape = (4, 64)
    ours = dequantize_ggml(raw, gguf.GGMLQuantizationType[scheme].value, shape)
    theirs = np.asarray(qdeq(from_ggml(raw, scheme, shape), np.float32))
    np.testing.assert_array_equal(ours, theirs)


def test_type_table_matches_gguf():
    for t in GGML_TYPES.values():
        qt = gguf.GGMLQuantizationType(t.id)
        assert qt.name == t.name
        assert gguf.GGML_QUANT_SIZES[qt] == (t.block_size, t.type_size)


def test_size_and_type_errors():
    with pytest.raises(FormatError, match="needs 34 bytes"):
        dequantize_ggml(np.zeros(33, np.uint8), 8, (32,))
    with pytest.raises(FormatError, match="block size"):
        row_bytes(8, 31)
    with pytest.raises(FormatError, match="unknown ggml"):
        dequantize_ggml(np.zeros(4, np.uint8), 99, (1,))
    with pytest.raises(UnsupportedError, match="Q8_K"):
        dequantize_ggml(np.zeros(292, np.uint8), 15, (256,))


@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize("chunk", [32, 256, 1 << 18])
def test_dequantize_into_equals_dequantize(name, chunk, monkeypatch):
    """Written into a buffer in chunks (by two threads): gguf's values, bit for bit."""
    monkeypatch.setattr(ggml_dequant, "CHUNK_VALUES", chunk)
    rng = np.random.default_rng(7)
    qt = gguf.GGMLQuantizationType[name]
    bs, _ = gguf.GGML_QUANT_SIZES[qt]
    rows, blocks = 37, max(1, 512 // bs)  # several chunks, a ragged last one
    raw = _random_blocks(rng, name, rows, blocks)
    shape = (rows, bs * blocks)
    out = np.full(shape, np.nan, np.float32)
    got = dequantize_ggml_into(raw, qt.value, out)
    assert got is out
    ref = gguf.quants.dequantize(raw.reshape(rows, -1), qt).reshape(shape)
    np.testing.assert_array_equal(out, ref.astype(np.float32))
    np.testing.assert_array_equal(out, dequantize_ggml(raw, qt.value, shape))


@pytest.mark.parametrize("name", ["Q8_0", "Q4_0", "Q4_1", "Q6_K"])
def test_dequantize_into_a_lazy_buffer_populated_chunk_by_chunk(name, monkeypatch):
    """``populate=True`` into a fresh zeroed map (2 MiB): the same values."""
    from entrenar.nn.host_arrays import host_buffer

    monkeypatch.setattr(ggml_dequant, "CHUNK_VALUES", 1 << 16)  # 8 chunks
    rng = np.random.default_rng(8)
    qt = gguf.GGMLQuantizationType[name]
    bs, _ = gguf.GGML_QUANT_SIZES[qt]
    rows, blocks = 512, 1024 // bs
    raw = _random_blocks(rng, name, rows, blocks)
    out = host_buffer((rows, bs * blocks), np.float32, zeroed=True)
    assert dequantize_ggml_into(raw, qt.value, out, populate=True) is out
    ref = gguf.quants.dequantize(raw.reshape(rows, -1), qt).astype(np.float32)
    np.testing.assert_array_equal(out, ref)


def test_dequantize_into_errors():
    with pytest.raises(FormatError, match="needs 34 bytes"):
        dequantize_ggml_into(np.zeros(33, np.uint8), 8, np.empty(32, np.float32))
    with pytest.raises(FormatError, match="float32"):
        dequantize_ggml_into(np.zeros(34, np.uint8), 8, np.empty(32, np.float64))
    with pytest.raises(UnsupportedError, match="Q8_K"):
        dequantize_ggml_into(np.zeros(292, np.uint8), 15, np.empty(256, np.float32))
