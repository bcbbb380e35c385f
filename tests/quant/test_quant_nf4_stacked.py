"""NF4 of a layer-stacked leaf is NF4 of each layer, bit for bit (issue 31).

A streaming load quantizes a stacked leaf ``(L, out, in)`` one layer at a time; a
run without streaming quantizes the whole leaf. Both must give the same node.
Double quantization's per-matrix mean is a float32 sum whose last bit depends on
XLA's reduction order: one reduction over ``(L, n)`` differed from ``L`` reductions
over ``(n,)`` in 22 of 30 layers at SmolLM2's k/v shape ``(30, 192, 576)`` before
`quantize_nf4` quantized a stack matrix by matrix. The means are also checked against
an independent float64 numpy mean (to one float32 ulp), and the codes against the
nearest NF4 value of the stored scales.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from entrenar.errors import QuantizationError
from entrenar.quant import NF4_CODE, quantize
from entrenar.quant.nf4 import double_dequantize


def _nodes_equal(a, b) -> None:
    la, lb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
    assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b)
    for x, y in zip(la, lb, strict=True):
        x, y = np.asarray(x), np.asarray(y)
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(x, y)


def _layer(q, i):
    return jax.tree_util.tree_map(lambda a: a[i], q)


@pytest.mark.parametrize("double_quant", [True, False])
@pytest.mark.parametrize(
    "shape", [(30, 192, 576), (3, 576, 1536), (2, 1, 64), (4, 300, 128)]
)
def test_stack_equals_each_layer(shape, double_quant):
    rng = np.random.default_rng(sum(shape))
    w = jnp.asarray(rng.standard_normal(shape, np.float32) * 0.02)
    whole = quantize(w, "nf4", double_quant=double_quant)
    traced = jax.jit(lambda w: quantize(w, "nf4", double_quant=double_quant))(w)
    _nodes_equal(whole, traced)
    for i in range(shape[0]):
        alone = quantize(w[i], "nf4", double_quant=double_quant)
        _nodes_equal(_layer(whole, i), alone)
        one = quantize(w[i : i + 1], "nf4", double_quant=double_quant)  # (1, ...)
        _nodes_equal(_layer(whole, i), _layer(one, 0))


def test_deeper_stacks_are_matrix_by_matrix():
    rng = np.random.default_rng(1)
    w = jnp.asarray(rng.standard_normal((2, 3, 64, 128), np.float32))
    whole = quantize(w, "nf4", double_quant=True)
    assert whole.scale_offset.shape == (2, 3)  # one DQ mean per matrix
    for i in range(2):
        for j in range(3):
            alone = quantize(w[i, j], "nf4", double_quant=True)
            part = jax.tree_util.tree_map(lambda a, at=(i, j): a[at], whole)
            _nodes_equal(part, alone)


def test_stacked_double_quant_against_numpy():
    """Each layer's DQ mean and codes, from numpy.

    The mean is the layer's scales' float64 mean (to 1 ulp); the codes are the
    nearest NF4 values of ``w / s`` with the stored (DQ) scales.
    """
    rng = np.random.default_rng(2)
    w = (rng.standard_normal((5, 192, 576), np.float32) * 0.02).astype(np.float32)
    q = quantize(jnp.asarray(w), "nf4", double_quant=True)
    blocks = w.reshape(5, 192, 9, 64)
    absmax = np.abs(blocks).max(-1)  # (5, 192, 9) float32, exact
    mean64 = absmax.reshape(5, -1).astype(np.float64).mean(-1)
    got = np.asarray(q.scale_offset)
    assert got.shape == (5,)
    np.testing.assert_allclose(got, mean64, rtol=np.finfo(np.float32).eps)
    s = np.asarray(double_dequantize(q.scales, q.scale_scales, q.scale_offset))
    np.testing.assert_allclose(
        s, absmax, atol=np.abs(absmax - mean64[:, None, None]).max() / 127
    )
    y = blocks / s[..., None]
    mid = (NF4_CODE[1:] + NF4_CODE[:-1]) / 2
    want = (y[..., None] > mid).sum(-1)  # (5, 192, 9, 64)
    codes = np.asarray(q.codes).reshape(5, 192, 9, 32)
    low, high = codes & 15, codes >> 4
    np.testing.assert_array_equal(np.concatenate([low, high], -1), want)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("shape", [(3, 8, 128), (8, 128), (128,)])
def test_a_value_that_is_not_finite_is_refused_wherever_it_is(bad, shape):
    """The compiled quantizer's check sees every position of a block.

    It reads the block absmaxes with NaN taken as inf (XLA's fused reduce-max on
    the CPU may drop a NaN).
    """
    x = np.random.default_rng(1).standard_normal(shape).astype(np.float32)
    for i in range(64):
        y = x.copy()
        y[(*(s // 2 for s in shape[:-1]), 64 + i)] = bad
        with pytest.raises(QuantizationError, match="NaN/Inf"):
            quantize(y, "nf4", double_quant=True)
        with pytest.raises(QuantizationError, match="NaN/Inf"):
            quantize(y, "nf4")
