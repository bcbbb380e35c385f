"""QAT: straight-through gradients, learnable ranges, training through fake_quant."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import entrenar.nn
from entrenar.errors import ConfigError, QuantizationError
from entrenar.quant import (
    dequantize,
    fake_quant,
    fake_quant_range,
    quantize,
    quantize_params,
    round_ste,
)


@pytest.mark.parametrize(
    ("scheme", "kw"),
    [("int8", {}), ("int4", {"block_size": 16}), ("nf4", {"double_quant": True})],
)
def test_fake_quant_forward_and_straight_through_gradient(scheme, kw):
    x = jax.random.normal(jax.random.key(0), (4, 64), jnp.float32)
    c = jax.random.normal(jax.random.key(1), (4, 64), jnp.float32)
    y = fake_quant(x, scheme, **kw)
    np.testing.assert_array_equal(y, dequantize(quantize(x, scheme, **kw)))
    g = jax.jit(jax.grad(lambda v: jnp.sum(fake_quant(v, scheme, **kw) * c)))(x)
    np.testing.assert_array_equal(g, c)  # STE: the gradient passes unchanged


def test_fake_quant_rejects_nan_eagerly():
    with pytest.raises(QuantizationError):
        fake_quant(jnp.full((1, 64), jnp.nan), "int8")


def test_round_ste():
    x = jnp.array([0.2, 0.5, 1.7, -2.5])
    np.testing.assert_array_equal(round_ste(x), jnp.round(x))
    np.testing.assert_array_equal(jax.grad(lambda v: round_ste(v).sum())(x), 1.0)


def test_fake_quant_range_values_against_numpy():
    x = np.linspace(-3.0, 5.0, 41, dtype=np.float32)
    lo, hi, bits = -1.0, 2.0, 3
    s = (hi - lo) / (2**bits - 1)
    expected = lo + s * np.round((np.clip(x, lo, hi) - lo) / s)
    np.testing.assert_allclose(fake_quant_range(x, lo, hi, bits=bits), expected, 1e-6)


def test_fake_quant_range_gradients():
    x = jnp.array([-5.0, 0.3, 0.71, 9.0])
    lo, hi = jnp.float32(-1.0), jnp.float32(2.0)
    gx, glo, ghi = jax.grad(
        lambda v, a, b: fake_quant_range(v, a, b, bits=4).sum(), argnums=(0, 1, 2)
    )(x, lo, hi)
    np.testing.assert_array_equal(gx, [0.0, 1.0, 1.0, 0.0])  # clipped STE
    # d/dhi of the value clipped at hi is 1, of the one clipped at lo is 0, and of
    # an inside value (round(u) - u) / levels, the LSQ/PACT range gradient.
    s = 3.0 / 15
    inside = sum((np.round((v + 1) / s) - (v + 1) / s) / 15 for v in (0.3, 0.71))
    np.testing.assert_allclose(ghi, 1.0 + inside, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(glo, 1.0 - inside, rtol=1e-5, atol=1e-6)


def test_fake_quant_range_in_bfloat16_is_pytorchs():
    torch = pytest.importorskip("torch")
    x = np.random.default_rng(0).uniform(-1.0, 3.0, 4096).astype(np.float32)
    xb = jnp.asarray(x, jnp.bfloat16)
    lo, hi, s = -1.0, -1.0 + 255 / 64, 1 / 64  # PyTorch's grid, zero point 64
    xt = torch.from_numpy(np.asarray(xb.astype(jnp.float32))).to(torch.bfloat16)
    ref = torch.fake_quantize_per_tensor_affine(xt, s, 64, 0, 255).float().numpy()
    y = fake_quant_range(xb, lo, hi, bits=8)
    assert y.dtype == jnp.bfloat16
    # in bfloat16 arithmetic (x - lo) / s was rounded before round(): 3% of the
    # values were a step off here (65%, up to 1.6 steps, on [-1, 3], s = 4/255)
    np.testing.assert_array_equal(np.asarray(y.astype(jnp.float32)), ref)


def test_fake_quant_range_ends_are_inside_as_in_pytorch():
    torch = pytest.importorskip("torch")
    x = np.array([-2.0, -1.0, -0.25, 0.55, 2.0, 7.0], np.float32)
    lo, hi = -1.0, 2.0  # x[1] and x[4]: a minmax range of x[1:5]
    s = (hi - lo) / 15  # PyTorch's grid: zero point 5, -5 s = lo, 10 s = hi
    xt = torch.tensor(x, requires_grad=True)
    torch.fake_quantize_per_tensor_affine(xt, s, 5, 0, 15).sum().backward()
    gx, glo, ghi = jax.grad(
        lambda v, a, b: fake_quant_range(v, a, b, bits=4).sum(), argnums=(0, 1, 2)
    )(jnp.asarray(x), jnp.float32(lo), jnp.float32(hi))
    # a value equal to lo or hi (a minmax-calibrated range's extremes) passes the
    # whole gradient; jnp.clip gave it 0.5 and the other half to lo / hi
    np.testing.assert_array_equal(gx, xt.grad.numpy())
    np.testing.assert_array_equal(gx, [0.0, 1.0, 1.0, 1.0, 1.0, 0.0])
    # the ends quantize exactly, so they add nothing to the range gradients
    inside = sum((np.round((v - lo) / s) - (v - lo) / s) / 15 for v in (-0.25, 0.55))
    np.testing.assert_allclose(ghi, 1.0 + inside, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(glo, 1.0 - inside, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("bits", [0, -3, 25, 2.5, True])
def test_fake_quant_range_refuses_bits_it_cannot_count(bits):
    with pytest.raises(ConfigError, match="bits must be"):
        fake_quant_range(jnp.array([0.2, 0.7]), 0.0, 1.0, bits=bits)


# --- training through fake_quant: a tiny MLP on a synthetic 4-class task -----------


def _data(key, n):
    """Four overlapping Gaussian classes in 16 dimensions, labels by nearest centre."""
    kc, kx = jax.random.split(key)
    centres = jax.random.normal(jax.random.key(42), (4, 16)) * 1.2
    y = jax.random.randint(kc, (n,), 0, 4)
    x = centres[y] + jax.random.normal(kx, (n, 16))
    return x, y


def _init(key):
    k1, k2 = jax.random.split(key)
    return {
        "w1": jax.random.normal(k1, (64, 16)) / 4.0,
        "b1": jnp.zeros(64),
        "w2": jax.random.normal(k2, (4, 64)) / 8.0,
        "b2": jnp.zeros(4),
    }


def _apply(p, x, quant):
    w1, w2 = p["w1"], p["w2"]
    if quant:  # QAT: the forward pass sees 4-bit weights (16-value blocks)
        w1 = fake_quant(w1, "int4", block_size=16)
        w2 = fake_quant(w2, "int4", block_size=16)
    h = jax.nn.relu(entrenar.nn.linear(x, w1, p["b1"]))  # (N, 64)
    return entrenar.nn.linear(h, w2, p["b2"])  # (N, 4)


def _train(quant, x, y, steps=300, lr=0.1):
    def loss(p):
        logits = _apply(p, x, quant)
        return -jnp.mean(jax.nn.log_softmax(logits)[jnp.arange(len(y)), y])

    @jax.jit
    def step(p, m):
        g = jax.grad(loss)(p)
        m = jax.tree_util.tree_map(lambda m, g: 0.9 * m + g, m, g)
        return jax.tree_util.tree_map(lambda p, m: p - lr * m, p, m), m

    p = _init(jax.random.key(0))
    m = jax.tree_util.tree_map(jnp.zeros_like, p)
    for _ in range(steps):
        p, m = step(p, m)
    return p


def _accuracy(p, x, y):
    return float(jnp.mean(jnp.argmax(_apply(p, x, False), -1) == y))


def test_qat_reaches_float_accuracy_with_real_int4_weights():
    x, y = _data(jax.random.key(1), 1024)
    xt, yt = _data(jax.random.key(2), 2048)
    acc_float = _accuracy(_train(False, x, y), xt, yt)
    p_qat = _train(True, x, y)
    # deploy: really quantize the QAT weights and run through nn.linear
    deployed = quantize_params(p_qat, "int4", block_size=16)
    acc_qat = _accuracy(deployed, xt, yt)
    assert acc_float > 0.8  # the task is learnable but not trivial
    assert acc_qat >= acc_float - 0.02, (acc_float, acc_qat)
