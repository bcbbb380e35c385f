"""Dropout at rates other than 0.5, where 'drop with p' and 'keep with p' differ.

Each path (nn.dropout's users: the Tensor API, LoRA's adapter input, the MLP) is
checked against a binomial statistic computed here, not against the library's own
Bernoulli draw: the kept fraction must be within 4σ of ``1 - rate`` and the kept
values scaled by ``1 / (1 - rate)``.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from entrenar import Tensor, backward
from entrenar import autograd as ag
from entrenar.lora import LoRAWeight
from entrenar.nn import MLP, linear

N = 4000
RATES = [0.1, 0.3, 0.8]


def _check_mask(y, rate, scale_of_kept=1.0):
    y = np.asarray(y)
    kept = y != 0
    sigma = math.sqrt(rate * (1 - rate) / y.size)
    assert abs(kept.mean() - (1 - rate)) < 4 * sigma, (kept.mean(), rate)
    np.testing.assert_allclose(y[kept], scale_of_kept / (1 - rate), rtol=1e-6)


@pytest.mark.parametrize("rate", RATES)
def test_tensor_dropout_rate_and_gradient(rate):
    x = Tensor(np.ones(N, np.float32), requires_grad=True)
    y = ag.dropout(x, rate, key=jax.random.key(3))
    _check_mask(y.numpy(), rate)
    backward(y.sum())
    np.testing.assert_array_equal(np.asarray(x.grad), y.numpy())  # d y_i / d x_i


@pytest.mark.parametrize("rate", RATES)
def test_lora_adapter_dropout_rate(rate):
    # base 0, A = B = I, scale 1: the layer's output is the dropped input itself.
    n = 64
    eye = jnp.eye(n)
    w = LoRAWeight(
        jnp.zeros((n, n)), eye, eye, alpha=float(n), rank=n, dropout=rate,
        dropout_key=jax.random.key_data(jax.random.key(5)),
    )  # fmt: skip
    y = linear(jnp.ones((N // n, n)), w)
    _check_mask(y, rate)


@pytest.mark.parametrize("rate", RATES)
def test_mlp_hidden_dropout_rate(rate):
    # One hidden layer of N units fed 1.0, read out as their mean: the output is
    # (#kept / N) / (1 - rate), so its distance from 1 measures rate and scale.
    m = MLP((1, N, 1), activation="relu", dropout=rate)
    params = {
        "layers": [
            {"weight": jnp.ones((N, 1)), "bias": jnp.zeros(N)},
            {"weight": jnp.full((1, N), 1.0 / N), "bias": jnp.zeros(1)},
        ]
    }
    x = jnp.ones((1, 1))
    np.testing.assert_allclose(m.apply(params, x), 1.0, rtol=1e-5)  # no key: exact
    out = float(m.apply(params, x, key=jax.random.key(11))[0, 0])
    kept_fraction = out * (1 - rate)
    sigma = math.sqrt(rate * (1 - rate) / N)
    assert abs(kept_fraction - (1 - rate)) < 4 * sigma, (out, rate)
    assert out != pytest.approx(1.0, abs=1e-6)  # dropout really acted
