"""NF4 (+ double quantization), int4 and int8: code tables, bounds, bits per value."""

import re
from statistics import NormalDist

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from entrenar.errors import ConfigError, QuantizationError, ShapeError
from entrenar.quant import NF4_CODE, dequantize, quantize, quantize_params
from entrenar.quant.report import bits_per_param

# QLoRA (Dettmers et al., 2023), Appendix E: the NF4 data type, as printed.
PAPER_NF4 = [
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230194568634,
    0.33791524171829224, 0.44070982985687256, 0.5626170039176941,
    0.7229568362236023, 1.0,
]  # fmt: skip


def _normal_float_quantiles(offset: float = 0.9677083) -> np.ndarray:
    """NF4 derived as in the paper: 8 positive and 7 negative normal quantiles + 0."""
    n = NormalDist()
    pos = [n.inv_cdf(p) for p in np.linspace(offset, 0.5, 9)[:-1]]
    neg = [-n.inv_cdf(p) for p in np.linspace(offset, 0.5, 8)[:-1]]
    v = np.sort(np.array([*pos, 0.0, *neg]))
    return v / v.max()


def test_nf4_table_is_the_papers():
    np.testing.assert_array_equal(NF4_CODE, np.array(PAPER_NF4, np.float32))
    np.testing.assert_allclose(NF4_CODE, _normal_float_quantiles(), atol=2e-7)


def test_nf4_codes_are_nearest_table_values():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((4, 128)).astype(np.float32)
    got = np.asarray(dequantize(quantize(w, "nf4")))
    blocks = w.reshape(4, 2, 64)
    s = np.abs(blocks).max(-1, keepdims=True)
    nearest = NF4_CODE[np.abs(blocks[..., None] / s[..., None] - NF4_CODE).argmin(-1)]
    np.testing.assert_allclose(got, (nearest * s).reshape(4, 128), rtol=1e-6)


def _values(draw_scale: float, seed: int, special: str) -> np.ndarray:
    w = np.random.default_rng(seed).standard_normal((4, 256)) * draw_scale
    if special == "zeros":
        w[1] = 0.0
    elif special == "constant":
        w[2, :64] = -draw_scale
    elif special == "spike":
        w[3, 7] = draw_scale * 1e3
    return w.astype(np.float32)


SPECIAL = st.sampled_from(["none", "zeros", "constant", "spike"])
SCALE = st.sampled_from([1e-30, 1e-6, 1.0, 1e6, 1e30])
SEED = st.integers(0, 2**31 - 1)


@given(SCALE, SEED, SPECIAL)
def test_nf4_int4_round_trip_bounds(scale, seed, special):
    w = _values(scale, seed, special)
    blocks = np.abs(w).reshape(4, 4, 64).max(-1, keepdims=True)
    half_gap = np.max(np.diff(NF4_CODE)) / 2
    for scheme, bound in (("nf4", half_gap * blocks), ("int4", blocks / 14)):
        err = np.abs(np.asarray(dequantize(quantize(w, scheme))) - w)
        assert np.all(err.reshape(4, 4, 64) <= bound * (1 + 1e-6)), scheme


@given(SCALE, SEED, SPECIAL)
def test_nf4_double_quant_round_trip_bound(scale, seed, special):
    w = _values(scale, seed, special)
    q = quantize(w, "nf4", double_quant=True)
    s = np.abs(w).reshape(4, 4, 64).max(-1)  # exact block absmax
    centred = np.abs(s - s.mean())
    scale_err = centred.max() / 254 * (1 + 1e-5) + 1e-6 * s.max()
    half_gap = np.max(np.diff(NF4_CODE)) / 2
    err = np.abs(np.asarray(dequantize(q)) - w).reshape(4, 4, 64)
    assert np.all(err <= (half_gap * s + scale_err)[..., None] * (1 + 1e-5))


@given(SCALE, SEED, SPECIAL, st.booleans(), st.sampled_from(["block", "channel"]))
def test_int8_round_trip_bound(scale, seed, special, symmetric, granularity):
    w = _values(scale, seed, special)
    q = quantize(w, "int8", symmetric=symmetric, granularity=granularity)
    err = np.abs(np.asarray(dequantize(q)) - w)
    g = w.reshape(4, 4, 64) if granularity == "block" else w.reshape(4, 1, 256)
    if symmetric:
        step = np.abs(g).max(-1, keepdims=True) / 127
    else:
        lo, hi = np.minimum(g.min(-1), 0), np.maximum(g.max(-1), 0)
        step = ((hi - lo) / 255)[..., None]
    assert np.all(err.reshape(g.shape) <= step / 2 * (1 + 1e-5) + 1e-37)


def test_int8_granularities_and_axes():
    rng = np.random.default_rng(1)
    w = rng.standard_normal((3, 8, 64)).astype(np.float32)  # stacked (L, out, in)
    cases = {
        ("tensor", -2): (3, 1, 1),
        ("channel", -2): (3, 8, 1),
        ("channel", -1): (3, 1, 64),
        ("block", -2): (3, 8, 2),
    }
    for (gran, axis), scale_shape in cases.items():
        for sym in (True, False):
            q = quantize(
                w, "int8", granularity=gran, axis=axis, symmetric=sym, block_size=32
            )
            assert q.scales.shape == scale_shape
            assert q.codes.dtype == (jnp.int8 if sym else jnp.uint8)
            if not sym:
                assert q.offsets.shape == scale_shape
            # scale per group = its absmax / 127 (sym) or range / 255 (asym)
            red = {"tensor": (1, 2), "channel": (2,) if axis == -2 else (1,)}
            g = w.reshape(3, 8, 2, 32) if gran == "block" else w
            ax = (3,) if gran == "block" else red[gran]
            if sym:
                expected = np.abs(g).max(ax, keepdims=True) / 127
            else:
                expected = (
                    np.maximum(g.max(ax, keepdims=True), 0)
                    - np.minimum(g.min(ax, keepdims=True), 0)
                ) / 255
            np.testing.assert_allclose(
                q.scales, expected.reshape(scale_shape), rtol=1e-6
            )
            err = np.abs(np.asarray(dequantize(q)) - w)
            assert err.max() <= float(np.max(q.scales)) / 2 * (1 + 1e-5)


def test_asymmetric_int8_keeps_zero_exact_and_uses_uint8_range():
    w = np.linspace(-1.0, 3.0, 64, dtype=np.float32).reshape(1, 64)
    w[0, 10] = 0.0
    q = quantize(w, "int8", symmetric=False, granularity="tensor")
    assert float(dequantize(q)[0, 10]) == 0.0
    assert int(q.codes.min()) == 0 and int(q.codes.max()) == 255


def _rows_of_all_scales(seed: int, rows: int = 256) -> np.ndarray:
    """``(rows, 128)`` float32 rows of magnitudes 1e-3..1e3, some off-centre."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, 128)) * 10.0 ** rng.uniform(-3, 3, (rows, 1))
    return (x + rng.uniform(-1, 1, (rows, 1)) * np.abs(x).max(1, keepdims=True)).astype(
        np.float32
    )


def _spec_codes(x, d, z, lo, hi):
    """``clip(round_half_even(x · (1/d)) + z, lo, hi)`` in float32, as the spec."""
    inv = np.where(d == 0, np.float32(0), np.float32(1) / np.where(d == 0, 1, d))
    return np.clip(np.rint(x * inv.astype(np.float32)) + z, lo, hi)


@pytest.mark.parametrize("granularity", ["channel", "tensor"])
@pytest.mark.parametrize("symmetric", [True, False])
def test_int8_scales_and_zero_points_are_pytorchs_observers(symmetric, granularity):
    torch = pytest.importorskip("torch")
    from torch.ao.quantization import observer

    x = _rows_of_all_scales(1)
    if symmetric:  # qint8 on -127..127: scale = max|x| / 127
        kw = {"dtype": torch.qint8, "quant_min": -127, "quant_max": 127}
        schemes = (torch.per_channel_symmetric, torch.per_tensor_symmetric)
    else:  # quint8: scale = (max(x, 0) - min(x, 0)) / 255
        kw = {"dtype": torch.quint8}
        schemes = (torch.per_channel_affine, torch.per_tensor_affine)
    if granularity == "channel":
        obs = observer.PerChannelMinMaxObserver(ch_axis=0, qscheme=schemes[0], **kw)
    else:
        obs = observer.MinMaxObserver(qscheme=schemes[1], **kw)
    obs(torch.from_numpy(x))
    scale, zero = (t.numpy().reshape(-1) for t in obs.calculate_qparams())
    q = quantize(x, "int8", symmetric=symmetric, granularity=granularity)
    # XLA multiplied by the float32 1/127 or 1/255: an ulp off PyTorch's quotient
    # for 11 of these 256 symmetric and 180 of 256 asymmetric channels
    np.testing.assert_array_equal(np.asarray(q.scales).reshape(-1), scale)
    d = np.asarray(q.scales)
    if symmetric:
        codes = _spec_codes(x, d, 0, -127, 127)
    else:
        np.testing.assert_array_equal(np.asarray(q.offsets).reshape(-1), zero)
        codes = _spec_codes(x, d, np.asarray(q.offsets).astype(np.float32), 0, 255)
    # (PyTorch's vectorised quint8 kernel adds the zero point before rounding, so a
    # few of its codes sit a step off this definition; the scales are its own)
    np.testing.assert_array_equal(np.asarray(q.codes), codes)


def test_int4_scale_is_the_quotient_and_half_steps_round_to_even():
    x = _rows_of_all_scales(2)
    d = (np.abs(x.reshape(256, 2, 64)).max(-1) / np.float32(7)).astype(np.float32)
    # values half a step apart: round(x / d) decides every tie, so an ulp of d
    # (x · 0.142857149 for max / 7: 55% of blocks) moved codes across it
    k = np.arange(128) % 29 / 2 - 7  # -7, -6.5, ..., 7
    grid = (np.repeat(d, 64, axis=1) * k).astype(np.float32)
    grid[:, ::64] = np.where(d >= 0, 7 * d, 0)  # the block absmax stays 7 d
    for w in (x, grid):
        q = quantize(w, "int4")
        dw = (np.abs(w.reshape(256, 2, 64)).max(-1) / np.float32(7)).astype(np.float32)
        np.testing.assert_array_equal(np.asarray(q.scales), dw)
        codes = _spec_codes(w.reshape(256, 2, 64), dw[..., None], 8, 1, 15)
        np.testing.assert_array_equal(
            np.asarray(dequantize(q)).reshape(256, 2, 64), dw[..., None] * (codes - 8)
        )


def test_zeros_quantize_to_zeros_everywhere():
    w = np.zeros((2, 64), np.float32)
    for kw in (
        {"scheme": "nf4"},
        {"scheme": "nf4", "double_quant": True},
        {"scheme": "int4"},
        {"scheme": "int8", "symmetric": False},
    ):
        np.testing.assert_array_equal(np.asarray(dequantize(quantize(w, **kw))), w)


@pytest.mark.parametrize("scheme", ["nf4", "int4", "int8"])
def test_nan_inf_rejected(scheme):
    w = np.ones((2, 64), np.float32)
    w[1, 3] = -np.inf
    with pytest.raises(QuantizationError, match=r"NaN/Inf.*\(1, 3\)"):
        quantize(w, scheme)


@pytest.mark.parametrize("shape", [(0, 64), (64, 0), (0,)])
@pytest.mark.parametrize("scheme", ["nf4", "int4", "int8", "q8_0", "q4_1"])
def test_an_empty_array_is_refused_naming_its_shape(scheme, shape):
    """Before: quantize took (0, 64) and its dequantize raised ZeroDivisionError."""
    with pytest.raises(ShapeError, match=rf"shape {re.escape(str(shape))}.*no values"):
        quantize(np.zeros(shape, np.float32), scheme)
    kept = quantize_params({"w": np.zeros(shape, np.float32)}, scheme)  # by default
    assert isinstance(kept["w"], np.ndarray)  # left as it is


@pytest.mark.parametrize("dtype", [np.int32, np.bool_, np.complex64])
def test_weights_that_are_not_real_floats_are_refused(dtype):
    """Integers, booleans and complex numbers are not weights to quantize.

    Before: int8 codes of integers came back truncated in the integer dtype, and a
    complex array quantized its real part and returned complex values.
    """
    with pytest.raises(QuantizationError, match=rf"{np.dtype(dtype).name} values"):
        quantize(np.ones((2, 64), dtype), "int8")


def test_nested_lists_are_quantized_as_float32():
    q = quantize([[0.5] * 64], "nf4")
    assert q.dtype == np.float32 and float(dequantize(q)[0, 0]) == 0.5


def test_bad_requests_are_clear_errors():
    with pytest.raises(QuantizationError, match="unknown scheme"):
        quantize(np.ones((1, 64), np.float32), "fp3")
    with pytest.raises(ShapeError, match="multiple of 64"):
        quantize(np.ones((1, 100), np.float32), "nf4")
    with pytest.raises(ConfigError, match="granularity"):
        quantize(np.ones((1, 64), np.float32), "int8", granularity="row")


def test_bits_per_param_from_stored_arrays():
    w = np.random.default_rng(2).standard_normal((256, 1024)).astype(np.float32)
    bits = {
        "nf4_dq": bits_per_param(quantize(w, "nf4", double_quant=True)),
        "nf4": bits_per_param(quantize(w, "nf4")),
        "int4": bits_per_param(quantize(w, "int4")),
        "int8": bits_per_param(quantize(w, "int8", granularity="channel")),
    }
    assert 4.12 <= bits["nf4_dq"] <= 4.13
    assert bits["nf4"] == 4.5 and bits["int4"] == 4.5
    assert 8.0 < bits["int8"] < 8.05  # 8 + 32 / 1024


def test_dtype_round_trip_and_jit():
    w = jnp.asarray(np.random.default_rng(3).standard_normal((2, 128)), jnp.bfloat16)
    q = quantize(w, "nf4", double_quant=True)
    assert q.dtype == jnp.bfloat16 and dequantize(q).dtype == jnp.bfloat16
    assert dequantize(q, jnp.float32).dtype == jnp.float32
    jq = jax.jit(lambda x: quantize(x, "nf4", double_quant=True))(w)
    np.testing.assert_array_equal(np.asarray(jq.codes), np.asarray(q.codes))
    np.testing.assert_array_equal(
        np.asarray(jax.jit(dequantize)(q)).astype(np.float32),
        np.asarray(dequantize(q)).astype(np.float32),
    )


def test_block_checks_at_their_boundaries():
    v = jnp.arange(64.0) / 64  # a single row (1-d) quantizes
    np.testing.assert_allclose(dequantize(quantize(v, "int8")), v, atol=1 / 127)
    q = quantize(jnp.ones((2, 4)), "int8", block_size=1)  # one value per block
    np.testing.assert_array_equal(dequantize(q), np.ones((2, 4)))
    with pytest.raises(ShapeError, match=r"^cannot quantize a scalar to 'int8'"):
        quantize(jnp.float32(1.0), "int8")
    with pytest.raises(
        ShapeError, match=r"^4-bit scheme 'int4' needs an even block_size"
    ):
        quantize(jnp.ones((2, 6)), "int4", block_size=3)
    quantize(jnp.ones((2, 6)), "int8", block_size=3)  # odd blocks are fine at 8 bits
