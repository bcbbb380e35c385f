"""`nn.linear` on quantized weights: the few-rows path equals the whole-matrix product.

With few input rows the weight is dequantized block by block of output rows
(`entrenar.quant.linear`); its values and gradients must equal ``x @ dequantize(w).T``
for every scheme, with and without double quantization, for any leading shape of
``x``, and for row counts that do not divide into the block size.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from entrenar import native, nn, quant
from entrenar.quant import linear as qlinear

RNG = np.random.default_rng(0)
TOL = {"rtol": 1e-5, "atol": 2e-5}  # the blocks sum in another order
CASES = [
    ("nf4", {"double_quant": True}),
    ("nf4", {}),
    ("int4", {}),
    ("int8", {}),
    ("q8_0", {}),
    ("q4_0", {}),
    ("q4_1", {}),
]


@pytest.fixture
def small_blocks(monkeypatch):
    """Blocks of 8 rows of 64 values, so that small matrices take several blocks.

    The native NF4 kernel is switched off: these tests are about the JAX block path.
    """
    monkeypatch.setattr(qlinear, "BLOCK_VALUES", 8 * 64)
    monkeypatch.setattr(qlinear, "_native_nf4", lambda w, x, n: False)


def whole(x, q):
    return x @ quant.dequantize(q, x.dtype).T


@pytest.mark.parametrize(("scheme", "options"), CASES)
def test_blockwise_product_equals_the_whole_product(small_blocks, scheme, options):
    w = jnp.asarray(RNG.normal(size=(48, 64)), jnp.float32)
    q = quant.quantize(w, scheme, **options)
    assert qlinear._block_rows(q, 5) == 8  # six blocks of 8 rows
    x = jnp.asarray(RNG.normal(size=(5, 64)), jnp.float32)
    np.testing.assert_allclose(nn.linear(x, q), whole(x, q), **TOL)
    with native.policy("jax"):  # the JAX path (q8_0/q4 few rows: a native kernel)
        np.testing.assert_allclose(nn.linear(x, q), whole(x, q), **TOL)
        jaxpr = str(jax.make_jaxpr(nn.linear)(x, q))
    assert "scan" in jaxpr  # the blocks are a loop: no (48, 64) matrix is formed


def test_leading_axes_of_x_and_rows_that_do_not_divide(small_blocks):
    w = jnp.asarray(RNG.normal(size=(42, 64)), jnp.float32)  # 42 = 6 blocks of 7
    q = quant.quantize(w, "nf4", double_quant=True)
    assert qlinear._block_rows(q, 6) == 7
    x = jnp.asarray(RNG.normal(size=(2, 3, 64)), jnp.float32)
    got = nn.linear(x, q)
    assert got.shape == (2, 3, 42)
    np.testing.assert_allclose(got, whole(x, q), **TOL)


def test_gradients_through_the_blocks(small_blocks):
    w = jnp.asarray(RNG.normal(size=(48, 64)), jnp.float32)
    q = quant.quantize(w, "nf4")
    x = jnp.asarray(RNG.normal(size=(4, 64)), jnp.float32)
    g = jax.grad(lambda x: jnp.sum(jnp.sin(nn.linear(x, q))))(x)
    want = jax.grad(lambda x: jnp.sum(jnp.sin(whole(x, q))))(x)
    np.testing.assert_allclose(g, want, rtol=1e-5, atol=5e-5)  # summation order


def test_when_the_blocks_apply():
    q = quant.quantize(jnp.ones((4096, 4096)), "nf4")
    assert qlinear._block_rows(q, qlinear.FEW_ROWS) == 512  # 2^21 values a block
    assert qlinear._block_rows(q, qlinear.FEW_ROWS + 1) == 0  # many rows: plain
    assert qlinear._block_rows(quant.quantize(jnp.ones((512, 4096)), "nf4"), 1) == 0
    stacked = quant.quantize(jnp.ones((2, 1024, 4096)), "nf4")
    assert qlinear._block_rows(stacked, 1) == 0  # stacked layers: one per scan step
    per_channel = quant.quantize(jnp.ones((4096, 1024)), "int8", granularity="channel")
    assert qlinear._block_rows(per_channel, 1) == 0


# ---- the native NF4 kernels (entrenar/kernels/nf4_*.cc) -----------------------------

needs_kernel = pytest.mark.skipif(
    not native.load("nf4_matmul"), reason="no C++ compiler: the kernel is off"
)


@needs_kernel
@pytest.mark.parametrize(
    ("shape", "block", "dq"),
    [((3, 40, 128), 64, True), ((24, 96), 16, False), ((7, 256), 128, True)],
)
def test_native_nf4_dequantize_is_the_jax_path_bit_for_bit(shape, block, dq):
    """float32 and bfloat16 (rounded to nearest-even), leading axes, scalar decode."""
    from entrenar.quant import nf4

    rng = np.random.default_rng(7)  # its own stream: the module's RNG feeds the others
    w = jnp.asarray(rng.normal(size=shape), jnp.float32)
    q = quant.quantize(w, "nf4", block_size=block, double_quant=dq)
    for dtype in (jnp.float32, jnp.bfloat16):
        f = jax.jit(lambda q, dtype=dtype: nf4.dequantize_nf4(q, dtype))
        assert "entrenar_nf4_dequantize" in f.lower(q).as_text()
        got = np.asarray(f(q))
        want = np.asarray(jax.jit(lambda q, d=dtype: nf4._dequantize_jax(q, d))(q))
        assert got.dtype == want.dtype and got.shape == shape
        np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))
    c = jnp.asarray(rng.normal(size=shape), jnp.float32)
    grad = functools.partial(jax.grad, allow_int=True)
    got_g = grad(lambda q: jnp.sum(c * nf4.dequantize_nf4(q, jnp.float32)))(q)
    want_g = grad(lambda q: jnp.sum(c * nf4._dequantize_jax(q, jnp.float32)))(q)
    floats = [  # the float leaves: scales, or with DQ the second-level scales
        (a, b)
        for a, b in zip(
            jax.tree_util.tree_leaves(got_g), jax.tree_util.tree_leaves(want_g)
        )
        if jnp.issubdtype(a.dtype, jnp.floating)
    ]
    assert floats
    for a, b in floats:
        np.testing.assert_allclose(a, b, rtol=1e-6)


@needs_kernel
@pytest.mark.parametrize(
    ("out", "fan_in", "block", "n", "dq"),
    [
        (48, 64, 64, 5, True),  # fewer rows than tasks x 16: one task
        (100, 640, 64, 16, False),  # 640 = a 512 chunk and a 128 tail; 100 rows
        (96, 192, 32, 64, True),  # block 32, sixty-four input rows (8 + 4 + 1 tiles)
        (40, 96, 16, 3, False),  # block 16: the scalar decode
        (32, 24, 8, 9, True),  # block 8, 24 columns: sums end between 16-lane steps
        (64, 1024, 128, 1, True),  # block 128, one input row
    ],
)
def test_native_nf4_equals_the_whole_product(out, fan_in, block, n, dq):
    w = jnp.asarray(RNG.normal(size=(out, fan_in)), jnp.float32)
    q = quant.quantize(w, "nf4", block_size=block, double_quant=dq)
    x = jnp.asarray(RNG.normal(size=(n, fan_in)), jnp.float32)
    f = jax.jit(lambda x, q: nn.linear(x, q))  # a fresh trace (jit caches by function)
    assert "entrenar_nf4_matmul" in f.lower(x, q).as_text()
    # the sums run in another order: apart by float32 rounding of |x| @ |Ŵ|ᵀ (a fixed
    # atol failed ~1 draw in 5 for 640 columns; this bound held 150 draws, <= 0.4 of it)
    deq = np.abs(np.asarray(quant.dequantize(q, jnp.float32)))  # (out, fan_in)
    bound = 1e-6 * (np.abs(np.asarray(x)) @ deq.T)  # (n, out), ~8 ulp of the terms
    assert np.all(np.abs(np.asarray(f(x, q)) - np.asarray(whole(x, q))) <= bound)


@needs_kernel
def test_native_nf4_gradients_are_the_whole_products():
    w = jnp.asarray(RNG.normal(size=(48, 128)), jnp.float32)
    q = quant.quantize(w, "nf4", double_quant=True)
    x = jnp.asarray(RNG.normal(size=(2, 3, 128)), jnp.float32)

    c = jnp.asarray(RNG.normal(size=(2, 3, 48)), jnp.float32)

    def loss(f, x, q):  # linear in the product: the gradients do not depend on its
        return jnp.sum(c * f(x, q))  # rounding, only on the backward pass

    grad = functools.partial(jax.grad, argnums=(0, 1), allow_int=True)
    got = grad(lambda x, q: loss(nn.linear, x, q))(x, q)
    want = grad(lambda x, q: loss(whole, x, q))(x, q)
    np.testing.assert_allclose(got[0], want[0], **TOL)
    np.testing.assert_allclose(got[1].scale_scales, want[1].scale_scales, **TOL)


def test_native_nf4_is_skipped_for_other_inputs():
    q = quant.quantize(jnp.ones((32, 64)), "nf4")
    assert not qlinear._native_nf4(q, jnp.ones((65, 64)), 65)  # too many rows
    assert not qlinear._native_nf4(q, jnp.ones((2, 64), jnp.bfloat16), 2)  # dtype
    assert not qlinear._native_nf4(quant.quantize(jnp.ones((32, 64)), "int4"), q, 2)
