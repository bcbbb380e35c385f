"""Mistakes a new user makes get an error that says what to do."""

import jax.numpy as jnp
import pytest

import entrenar
from entrenar import Tensor


def test_tensor_backward_is_entrenar_backward():
    w = Tensor([2.0, -1.0], requires_grad=True)
    (w * w).sum().backward()
    assert w.grad.tolist() == [4.0, -2.0]


def test_value_and_grad_names_a_tensor_argument_or_result():
    with pytest.raises(TypeError, match=r"arguments must be arrays.*tensor\.data"):
        entrenar.value_and_grad(lambda w: jnp.sum(w))(Tensor([1.0]))
    with pytest.raises(TypeError, match=r"got Tensor.*entrenar\.backward"):
        entrenar.grad(lambda w: (Tensor(w) * Tensor(w)).sum())(jnp.ones(2))
    assert float(entrenar.grad(lambda x: x * x)(3.0)) == 6.0
