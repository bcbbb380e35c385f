"""The blocked quantized matmul (entrenar.quant.blocked) against the dense path.

The reference is the dense computation: the whole weight dequantized and multiplied
(`lowp_matmul` with the dequantizer, the path the CPU takes). The blocked form must
give the same product, input gradient and (for a trained weight) weight gradient,
and its compiled program must hold no more than a block of the weight.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from entrenar import quant
from entrenar.errors import ShapeError
from entrenar.nn.linear import lowp_matmul
from entrenar.quant.blocked import block_rows, blocked_matmul, use_blocked
from entrenar.quant.linear import dequantized


def _weight(scheme, out=64, fan_in=128, dq=False):
    w = jax.random.normal(jax.random.key(0), (out, fan_in)) * 0.05
    if scheme in ("q8_0", "q4_0", "q4_1"):
        return quant.quantize(w, scheme, block_size=32)
    return quant.quantize(w, scheme, block_size=64, double_quant=dq)


def _dense(w, x, md):
    if md is None:
        return x @ quant.dequantize(w, x.dtype).T
    return lowp_matmul(x, w, md, dequantized)


CASES = [
    ("nf4", False, None),
    ("nf4", True, None),
    ("nf4", True, "bfloat16"),
    ("int8", False, "bfloat16"),
    ("int4", False, None),
    ("q8_0", False, "bfloat16"),
    ("q4_0", False, None),
    ("q4_1", False, "bfloat16"),
]


@pytest.mark.parametrize(("scheme", "dq", "md"), CASES)
def test_blocked_equals_dense(scheme, dq, md):
    w = _weight(scheme, dq=dq)
    x = jax.random.normal(jax.random.key(1), (3, 5, 128))  # (..., in)
    g = jax.random.normal(jax.random.key(2), (3, 5, 64))  # output cotangent

    def run(f):
        y, pull = jax.vjp(lambda x: f(w, x, md), x)
        return y, pull(g)[0]

    y, dx = run(lambda w, x, md: blocked_matmul(w, x, md, rows=16))  # 4 blocks
    y_ref, dx_ref = run(_dense)
    tol = 1e-5 if md is None else 1e-2  # bfloat16: the order of the sums differs
    for got, want in ((y, y_ref), (dx, dx_ref)):
        scale = float(jnp.abs(want).max())
        np.testing.assert_allclose(got, want, rtol=0, atol=tol * scale)
    assert y.shape == (3, 5, 64) and y.dtype == dx.dtype == jnp.float32


def test_a_trained_weight_gets_the_dense_gradient():
    w = _weight("int8")  # float32 scales: differentiable
    x = jax.random.normal(jax.random.key(1), (6, 128))

    def loss(f, scales):
        return jnp.sum(jnp.sin(f(dataclasses.replace(w, scales=scales), x, None)))

    got = jax.grad(lambda s: loss(lambda *a: blocked_matmul(*a, rows=8), s))(w.scales)
    want = jax.grad(lambda s: loss(_dense, s))(w.scales)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert float(jnp.abs(want).max()) > 0


def test_compiled_product_and_gradient_hold_less_than_the_dense_matrix():
    w = _weight("nf4", out=1024, fan_in=1024, dq=True)
    x = jnp.ones((16, 1024))

    def blocked(x, w):  # w an argument: a closed-over node would be constant-folded
        return jnp.sum(blocked_matmul(w, x, "bfloat16"))

    def dense(x, w):
        return jnp.sum(_dense(w, x, "bfloat16"))

    def temp_bytes(f):
        memory = jax.jit(f).lower(x, w).compile().memory_analysis()
        if memory is None:  # a backend that does not report it
            pytest.skip("no memory analysis on this backend")
        return memory.temp_size_in_bytes

    dense_bytes = 1024 * 1024 * 2  # the bfloat16 matrix
    assert block_rows(1024, 1024) == 256  # 4 blocks of a quarter each
    assert temp_bytes(dense) >= dense_bytes  # the measure sees a dense matrix
    assert temp_bytes(jax.grad(dense)) >= dense_bytes
    assert temp_bytes(blocked) < dense_bytes / 2
    assert temp_bytes(jax.grad(blocked)) < dense_bytes / 2


def test_many_rows_hold_no_output_sized_float32_buffer():
    """Many rows (a GPU's batch): no ``(n, in)`` float32 accumulator for dx.

    There the activations dominate: the dense form's input gradient holds one (a
    float32 ``dx``); the blocked one writes bfloat16 column blocks of ``dx`` (the
    cotangent and its bfloat16 copy remain, 0.52 of the float32 ``dx`` measured).
    """
    w = jax.eval_shape(lambda: _weight("nf4", out=512, fan_in=1024, dq=True))
    x = jax.ShapeDtypeStruct((4096, 1024), jnp.bfloat16)

    def blocked(x, w):
        return jnp.sum(blocked_matmul(w, x, "bfloat16").astype(jnp.float32))

    def dense(x, w):
        return jnp.sum(_dense(w, x, "bfloat16").astype(jnp.float32))

    def temp_bytes(f):
        memory = jax.jit(f).lower(x, w).compile().memory_analysis()
        if memory is None:
            pytest.skip("no memory analysis on this backend")
        return memory.temp_size_in_bytes

    dx_f32 = 4096 * 1024 * 4
    assert temp_bytes(jax.grad(dense)) >= dx_f32  # the dense form's float32 dx
    assert temp_bytes(jax.grad(blocked)) < 0.75 * dx_f32


def test_never_decodes_more_than_a_block_of_rows():
    w = _weight("nf4", out=64, fan_in=128)
    jaxpr = str(
        jax.make_jaxpr(jax.grad(lambda x: jnp.sum(blocked_matmul(w, x, rows=16))))(
            jnp.ones((4, 128))
        )
    )
    assert "f32[16,128]" in jaxpr and "f32[64,128]" not in jaxpr


def test_selection_and_errors():
    w = _weight("nf4")
    assert not use_blocked(w)  # the CPU keeps the dense path and native kernel
    assert block_rows(4096, 14336) * 14336 <= 1 << 23
    with pytest.raises(ShapeError, match="must divide"):
        blocked_matmul(w, jnp.ones((2, 128)), rows=7)
    with pytest.raises(ShapeError, match="features"):
        blocked_matmul(w, jnp.ones((2, 64)))
    stacked = quant.quantize(jnp.ones((2, 64, 128)), "nf4")
    with pytest.raises(ShapeError, match="per layer"):
        blocked_matmul(stacked, jnp.ones((2, 128)))
