"""MXFP4's GGML quantizer: byte for byte gguf-py's (ggml's quantize_row_mxfp4_ref).

`entrenar.nn.mxfp4.quantize_ggml` against ``gguf.quants.quantize(x, MXFP4)`` on
random data at several scales, all-zero blocks, values at every code and midpoint
(ties), powers of two and their neighbours, and a hypothesis property; where ggml's
uint8 exponent would wrap (``amax < 2^-125``) the documented clamp instead; NaN,
Inf and values beyond float32 refused by the tensor's name.
"""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from entrenar.errors import FormatError, QuantizationError
from entrenar.nn.mxfp4 import dequantize_ggml, dequantize_hf, quantize_ggml, quantize_hf

MXFP4 = GGMLQuantizationType.MXFP4
CODES = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], np.float32)  # E2M1 magnitudes
MIDS = (CODES[1:] + CODES[:-1]) / 2  # the ties: 0.25, 0.75, ..., 5
BIG = float(np.finfo(np.float32).max)


def _ref(x: np.ndarray) -> np.ndarray:
    return gguf_quantize(np.asarray(x, np.float32), MXFP4)


@pytest.mark.parametrize("scale", [1e-30, 1e-3, 1.0, 7.0, 1e6, 1e30])
def test_random_blocks_are_gguf_pys_bytes(scale):
    rng = np.random.default_rng(int(np.log10(scale)) + 40)
    x = (rng.standard_normal((16, 256)) * scale).astype(np.float32)  # (rows, 8·32)
    x[3, :32] = 0.0  # an all-zero block
    x[4, 32:64] = -x[4, 32:64]
    got = quantize_ggml(x)
    assert got.shape == (16, 8 * 17) and got.dtype == np.uint8
    np.testing.assert_array_equal(got, _ref(x))


def test_stacked_experts_keep_their_leading_axes():
    x = np.random.default_rng(1).standard_normal((3, 4, 64)).astype(np.float32)
    got = quantize_ggml(x)  # (E, out, in) -> (E, out, in/32·17)
    assert got.shape == (3, 4, 34)
    np.testing.assert_array_equal(got.reshape(12, 34), _ref(x.reshape(12, 64)))


@pytest.mark.parametrize("k", range(-3, 4))
def test_ties_codes_and_zeros(k):
    """Every code and every midpoint, both signs, ±0, in blocks of amax 6·2^k."""
    d = np.float32(2.0**k)
    vals = np.concatenate([CODES, MIDS, -CODES, -MIDS, [-0.0, 0.0]]) * d  # (32,)
    assert vals.size == 32
    x = np.stack([vals, vals[::-1], np.zeros(32, np.float32)]).astype(np.float32)
    got = quantize_ggml(x)
    np.testing.assert_array_equal(got, _ref(x))
    back = dequantize_ggml(got, x.shape)
    np.testing.assert_array_equal(np.abs(back[0, :8]), CODES * d)  # codes exact
    # a tie takes the smaller magnitude (the first code in ggml's table)
    np.testing.assert_array_equal(np.abs(back[0, 8:15]), CODES[:-1] * d)
    assert not (got[2] != 0).any()  # an all-zero block: e = 0, code 0
    # -0 (value 30: qs[14]'s high nibble) and -0.25 (value 23: qs[7]'s) take
    # code 0, never -0's code 8
    assert got[0, 1 + 14] >> 4 == 0 and got[0, 1 + 7] >> 4 == 0
    assert (back[0, 30:] == 0).all() and not np.signbit(back[0, 30:]).any()


@pytest.mark.filterwarnings("ignore:overflow:RuntimeWarning")  # gguf-py's errors
def test_powers_of_two_and_their_neighbours():
    p = np.ldexp(np.float32(1), np.arange(-125, 128)).astype(np.float32)
    below = np.nextafter(p, np.float32(0))  # float32 log2 may round these up
    above = np.nextafter(p, np.float32(np.inf))
    vals = np.concatenate([p, -p, below, -below, above[:-1], -above[:-1]])
    x = np.resize(vals, (-(-vals.size // 32), 32)).astype(np.float32)
    np.testing.assert_array_equal(quantize_ggml(x), _ref(x))
    single = np.zeros((p.size, 32), np.float32)  # each power alone in its block
    single[:, 5] = p
    np.testing.assert_array_equal(quantize_ggml(single), _ref(single))


@pytest.mark.filterwarnings("ignore:overflow:RuntimeWarning")
@settings(max_examples=60, deadline=None)
@given(
    hnp.arrays(
        np.float32,
        st.tuples(st.integers(1, 4), st.sampled_from([32, 64])),
        elements=st.floats(-BIG, BIG, width=32, allow_subnormal=True),
    )
)
def test_property_gguf_pys_bytes_where_it_does_not_wrap(x):
    """Any finite float32 rows: gguf-py's bytes, but for blocks ggml would wrap."""
    got, ref = quantize_ggml(x), _ref(x)
    amax = np.abs(x.reshape(-1, 32)).max(-1)
    fine = (amax == 0) | (amax >= np.float32(2.0**-125))  # (blocks,)
    np.testing.assert_array_equal(got.reshape(-1, 17)[fine], ref.reshape(-1, 17)[fine])
    np.testing.assert_array_equal(  # gguf-py's dequantizer reads the same values
        gguf_dequantize(got, MXFP4), dequantize_ggml(got, x.shape)
    )
    back = dequantize_ggml(got, x.shape).reshape(-1, 32)
    err = np.abs(back.astype(np.float64) - x.reshape(-1, 32))
    # at most half the widest gap (2 · 2^(e-127)), or the clip above 6 · 2^(e-127)
    assert (err <= np.maximum(amax / 4, np.float32(2.0**-128))[:, None] * 1.0001).all()


def test_values_already_mxfp4_come_back_exactly():
    rng = np.random.default_rng(3)
    blocks = rng.integers(0, 256, (2, 5, 16), dtype=np.uint8)
    scales = rng.integers(100, 150, (2, 5), dtype=np.uint8)
    w = dequantize_hf(blocks, scales)  # (2, 160): MXFP4 values
    back = dequantize_ggml(quantize_ggml(w), w.shape)
    np.testing.assert_array_equal(back, w)
    hb, hs = quantize_hf(w)  # the HF layout's quantizer agrees on the values
    np.testing.assert_array_equal(dequantize_hf(hb, hs), back)


def test_tiny_blocks_clamp_to_the_smallest_scale_instead_of_wrapping():
    """Blocks of amax < 2^-125, where ggml's exponent wraps, take e = 0."""
    x = np.zeros((3, 32), np.float32)
    x[0, :4] = [2.0**-126, -(2.0**-127), 3 * 2.0**-129, 2.0**-140]
    x[1, 0] = np.float32(1e-45)  # the smallest subnormal
    x[2, 7] = np.float32(2.0**-125)  # at the bound: ggml's own e = 0
    got = quantize_ggml(x)
    assert (got[:, 0] == 0).all()  # e = 0: scale 2^-127
    np.testing.assert_array_equal(got[2], _ref(x[2:])[0])
    back = dequantize_ggml(got, x.shape)
    np.testing.assert_array_equal(back[0, :4], [2.0**-126, -(2.0**-127), 2.0**-128, 0])
    assert (np.abs(back - x) <= 2.0**-128).all()
    assert _ref(x[:1])[0, 0] != 0  # what gguf-py does: a wrapped exponent


@pytest.mark.filterwarnings("ignore:overflow:RuntimeWarning")  # gguf-py's errors
def test_the_top_of_float32_takes_e_253_and_stays_finite():
    """Near float32's max, log2 rounds to 128: e = 253, and codes 4 and 6 overflow."""
    x = np.full((2, 32), BIG, np.float32)
    x[0] = np.nextafter(np.float32(BIG), np.float32(0), dtype=np.float32) * 0.99999
    x[1, ::2] = -BIG
    got = quantize_ggml(x)
    np.testing.assert_array_equal(got, _ref(x))
    assert (got[:, 0] >= 252).all() and (got[:, 0] <= 253).all()
    assert np.isfinite(dequantize_ggml(got, x.shape)).all()


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf, 1e300])
def test_nan_inf_and_values_beyond_float32_are_refused_by_name(bad):
    x = np.zeros((2, 64), np.float64)
    x[1, 40] = bad
    with pytest.raises(QuantizationError, match=r"blk\.3\.ffn_up_exps .*NaN or Inf"):
        quantize_ggml(x, "blk.3.ffn_up_exps")


def test_rows_that_are_not_whole_blocks_are_refused():
    with pytest.raises(FormatError, match="w: MXFP4 needs a last axis multiple of 32"):
        quantize_ggml(np.ones((2, 48), np.float32), "w")
