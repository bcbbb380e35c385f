"""Bad input is a clear error naming the leaf, the parameter and the value."""

import jax
import numpy as np
import pytest

from entrenar import merge
from entrenar.errors import CompatibilityError, ConfigError, DTypeError, ShapeError


def tree(**over):
    t = {"a": {"w": np.ones((2, 3), np.float32)}, "b": np.zeros(4, np.float32)}
    t.update(over)
    return t


def test_structure_mismatch_names_the_leaves():
    other = {"a": {"w": np.ones((2, 3), np.float32)}, "c": np.zeros(4, np.float32)}
    with pytest.raises(
        CompatibilityError, match=r"model 0 lacks \['b'\].*extra \['c'\]"
    ):
        merge.ties(tree(), [other], 0.5)


def test_shape_mismatch_names_the_leaf():
    with pytest.raises(ShapeError, match=r"leaf 'b': model 1 has shape \(5,\)"):
        merge.task_arithmetic(tree(), [tree(), tree(b=np.zeros(5, np.float32))], 1.0)


def test_dtype_mismatch_names_the_leaf():
    bad = tree(b=np.zeros(4, np.float16))
    with pytest.raises(DTypeError, match=r"leaf 'b': model 0 is float16"):
        merge.slerp(tree(), bad, 0.5)


def test_integer_leaves_must_agree():
    a, b = tree(n=np.arange(3)), tree(n=np.arange(3) + 1)
    np.testing.assert_array_equal(merge.linear([a, a], [1, 1])["n"], np.arange(3))
    with pytest.raises(DTypeError, match="leaf 'n' is int"):
        merge.linear([a, b], [1, 1])


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda t: merge.ties(t, [t], 0.0), r"density = 0.0 is outside \(0.0, 1.0\]"),
        (lambda t: merge.ties(t, [t], 1.5), r"density = 1.5 is outside"),
        (lambda t: merge.ties(t, [t, t], [0.5]), "density has 1 entries for 2 models"),
        (
            lambda t: merge.dare(t, [t], 1.0, key=jax.random.key(0)),
            r"drop_rate = 1.0 is outside \[0.0, 1.0\)",
        ),
        (
            lambda t: merge.dare(t, [t], -0.1, key=jax.random.key(0)),
            "drop_rate = -0.1",
        ),
        (lambda t: merge.slerp(t, t, 1.2), r"t = 1.2 is outside \[0.0, 1.0\]"),
        (lambda t: merge.slerp(t, t, [0.0, -1.0]), "t = -1.0"),
        (lambda t: merge.slerp(t, t, "half"), "t: expected a number"),
        (lambda t: merge.task_arithmetic(t, [t], [float("nan")]), "not a finite"),
        (lambda t: merge.task_arithmetic(t, [], 1.0), "non-empty list"),
        (
            lambda t: merge.ties(t, [t], 0.5, lam=float("inf")),
            "lam must be a finite number, got inf",
        ),
        (lambda t: merge.linear([t, t], [1.0, -1.0]), "weights sum to 0"),
        (lambda t: merge.ties(t, [t], 0.5, lora="both"), "lora must be"),
    ],
)
def test_out_of_range_parameters(call, match):
    with pytest.raises(ConfigError, match=match):
        call(tree())


def test_schedule_out_of_range_names_the_leaf():
    # A conditional t only resolves per tensor, so the error names the leaf.
    t = [{"filter": "b", "value": 2.0}, {"value": 0.5}]
    with pytest.raises(ConfigError, match=r"leaf 'b': t = 2.0"):
        merge.slerp(tree(), tree(), t)
