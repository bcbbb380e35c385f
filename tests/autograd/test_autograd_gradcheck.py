"""check_gradient itself: it must fail on wrong gradients, small ones included."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from entrenar import Tensor, autograd, check_gradient
from entrenar.autograd import ops
from entrenar.errors import ConfigError, GradientCheckError


def _scaled_grad(factor):
    """Σ x² whose backward returns ``factor`` times the true gradient."""

    @jax.custom_vjp
    def f(x):
        return jnp.sum(x * x)

    def fwd(x):
        return f(x), x

    def bwd(x, g):
        return (g * 2 * x * factor,)

    f.defvjp(fwd, bwd)
    return f


@pytest.mark.parametrize("scale", [1.0, 1e-2, 1e-4])
def test_jax_api_catches_a_wrong_gradient_at_every_magnitude(scale):
    x = np.array([0.3, -0.7, 0.5]) * scale  # gradients 2x: from 1.4 down to 1.4e-4
    assert check_gradient(_scaled_grad(1.0), [x], api="jax")
    wrong = check_gradient(_scaled_grad(1.05), [x], api="jax")
    if scale >= 1e-2:  # 5% off a gradient of ≥ 0.006 exceeds atol + rtol·|g|
        assert not wrong, wrong.max_error
    else:  # 5% of 1.4e-4 is below atol = 1e-5: tolerated by design
        assert wrong


def test_small_gradient_that_should_be_zero_fails():
    # d/dx of x·stop_gradient(0) is 0; a bug adding 1e-3 must not pass.
    @jax.custom_vjp
    def f(x):
        return jnp.sum(x * 0.0)

    f.defvjp(lambda x: (f(x), None), lambda _, g: (jnp.full(3, 1e-3) * g,))
    result = check_gradient(f, [np.ones(3)], api="jax")
    assert not result
    assert result.max_error > 1
    with pytest.raises(GradientCheckError, match=r"analytic 0\.001 vs numeric 0"):
        check_gradient(f, [np.ones(3)], api="jax", raise_on_failure=True)


def test_tensor_api_catches_a_wrong_tape_rule():
    wrong_square = ops.defop("wrong_square_sum", _scaled_grad(1.01))
    right_square = ops.defop("right_square_sum", _scaled_grad(1.0))
    x = [[0.2, 0.4], [-0.1, 0.3]]
    assert check_gradient(lambda t: autograd.apply_op(right_square, t), [x])
    result = check_gradient(lambda t: autograd.apply_op(wrong_square, t), [x])
    assert not result and result.api == "tensor"


def test_api_must_match_the_function():
    with pytest.raises(ConfigError, match="api='jax'"):
        check_gradient(lambda x: jnp.zeros(()) + 0.0 * np.asarray(x).sum(), [[1.0]])
    with pytest.raises(ConfigError, match="api must be"):
        check_gradient(lambda t: t.sum(), [[1.0]], api="torch")  # type: ignore[arg-type]
    assert isinstance(Tensor([1.0]).sum(), Tensor)
