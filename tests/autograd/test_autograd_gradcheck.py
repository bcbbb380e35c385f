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


def test_result_locates_the_worst_element_and_measures_its_error():
    # f(x, y) = sum(x²) + sum(y²); the rule for y is wrong at element 2 only
    @jax.custom_vjp
    def f(x, y):
        return jnp.sum(x**2) + jnp.sum(y**2)

    def bwd(res, g):
        x, y = res
        off = jnp.zeros_like(y).at[2].set(0.003)  # 0.3% too large at y[2]
        return g * 2 * x, g * 2 * y * (1 + off)

    f.defvjp(lambda x, y: (f(x, y), (x, y)), bwd)
    x, y = np.array([0.5, -1.0]), np.array([1.0, 2.0, 3.0])
    r = check_gradient(f, [x, y], api="jax", rtol=2e-3, atol=0.0)
    # |a - n| / (rtol · max|a|,|n|) = 0.003·6 / (2e-3 · 6.018) ≈ 1.5: fails, not by 2x
    assert not r and r.max_error == pytest.approx(0.003 / (2e-3 * 1.003), rel=1e-3)
    assert r.worst == (1, 2)
    np.testing.assert_allclose(r.analytic[1], [2.0, 4.0, 6.018])
    np.testing.assert_allclose(r.numeric[1], [2.0, 4.0, 6.0], rtol=1e-9)
    np.testing.assert_allclose(r.analytic[0], r.numeric[0], rtol=1e-9)
    with pytest.raises(GradientCheckError, match=r"failed at input 1, element 2: "):
        check_gradient(f, [x, y], api="jax", rtol=2e-3, atol=0.0, raise_on_failure=True)
    # a purely relative or purely absolute tolerance is allowed; none at all is not
    assert check_gradient(f, [x, y], api="jax", rtol=4e-3, atol=0.0)
    assert check_gradient(f, [x, y], api="jax", rtol=0.0, atol=0.05)
    for rtol, atol in ((0.0, 0.0), (-1e-3, 1e-5), (1e-3, -1e-5)):
        with pytest.raises(ConfigError, match=r"^need rtol, atol >= 0, not both 0"):
            check_gradient(f, [x, y], api="jax", rtol=rtol, atol=atol)


def _half_wrong(x, y):
    # right in x; in y the gradient is y, not 2y (a stop_gradient hides half of it)
    return jnp.sum(x * x) + jnp.sum(y * jax.lax.stop_gradient(y))


def test_wrt_checks_only_the_named_inputs():
    x, y = np.array([0.5, -1.5]), np.array([1.0, 2.0])
    assert not check_gradient(_half_wrong, [x, y], api="jax")
    only_x = check_gradient(_half_wrong, [x, y], api="jax", wrt=[0])
    assert only_x and len(only_x.analytic) == 1
    for wrong in ([], [2], [0, 2]):
        with pytest.raises(ConfigError, match=r"^check_gradient: wrt=\[.*\] must name"):
            check_gradient(_half_wrong, [x, y, np.arange(2)], api="jax", wrt=wrong)
    with pytest.raises(ConfigError, match=r"floating-point inputs here are \[\]$"):
        check_gradient(lambda i: i * 2, [np.arange(2)], api="jax")


@pytest.mark.parametrize("api", ["jax", "tensor"])
def test_vector_outputs_are_projected_with_the_seeded_direction(api):
    def cube(x):
        return x * x * x  # a vector output: checked through sum(out * r)

    x = np.array([0.3, -0.7, 1.1])
    first = check_gradient(cube, [x], api=api, seed=3)
    again = check_gradient(cube, [x], api=api, seed=3)
    other = check_gradient(cube, [x], api=api, seed=4)
    assert first and again and other
    np.testing.assert_array_equal(first.analytic[0], again.analytic[0])
    assert first.max_error == again.max_error
    r3 = np.random.default_rng(3).standard_normal(3)
    np.testing.assert_allclose(first.analytic[0], 3 * x**2 * r3, rtol=1e-12)
    assert not np.allclose(first.analytic[0], other.analytic[0])


def test_failure_message_names_the_worst_element_of_a_matrix():
    x = np.array([[0.5, 1.0], [1.5, 2.0]])
    y = np.array([[1.0, 1.0], [1.0, 3.0]])  # element 3 of y has the largest error
    with pytest.raises(GradientCheckError) as info:
        check_gradient(_half_wrong, [x, y], api="jax", raise_on_failure=True)
    assert str(info.value).startswith(
        "gradient check failed at input 1, element 3: analytic 3 vs numeric 6"
    )


@pytest.mark.parametrize("api", ["jax", "tensor"])
def test_bfloat16_inputs_are_checked_in_float64(api):
    """A bfloat16 input is floating point (numpy calls its dtype kind "V").

    Before, it was passed through as an integer input would be and the check
    refused to run: ``wrt=[] must name floating-point inputs``.
    """
    x = jnp.asarray([0.5, -1.25, 2.0], jnp.bfloat16)
    result = check_gradient(lambda v: (v * v * v).sum(), [x], api=api)
    assert result and result.analytic[0].dtype == np.float64
    np.testing.assert_allclose(result.analytic[0], 3 * np.asarray(x, np.float64) ** 2)
