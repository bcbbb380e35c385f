import jax.numpy as jnp
import numpy as np
import pytest

import entrenar
from entrenar.errors import ShapeError
from entrenar.tree import check_same_structure, tree_named_leaves


def test_tree_size_and_bytes():
    tree = {"a": jnp.zeros((2, 3), jnp.float32), "b": [jnp.zeros(5, jnp.bfloat16)]}
    assert entrenar.tree_size(tree) == 11
    assert entrenar.tree_bytes(tree) == 6 * 4 + 5 * 2


def test_named_leaves_use_dotted_paths():
    tree = {"layers": {"q_proj": {"weight": jnp.zeros(1)}}, "head": [jnp.zeros(1)]}
    names = [n for n, _ in tree_named_leaves(tree)]
    assert names == ["head.0", "layers.q_proj.weight"]


def test_assert_trees_allclose_names_the_leaf():
    a = {"x": {"y": np.ones(3)}}
    b = {"x": {"y": np.array([1.0, 1.0, 1.5])}}
    entrenar.assert_trees_allclose(a, a)
    with pytest.raises(AssertionError, match=r"x\.y"):
        entrenar.assert_trees_allclose(a, b)
    with pytest.raises(AssertionError, match="structures differ"):
        entrenar.assert_trees_allclose(a, {"x": np.ones(3)})


def test_check_same_structure():
    check_same_structure({"a": np.ones(2)}, {"a": np.zeros(2)})
    with pytest.raises(ShapeError, match="'a'"):
        check_same_structure({"a": np.ones(2)}, {"a": np.zeros(3)})


def test_value_and_grad_has_aux_and_argnums():
    def loss(p, x):
        return jnp.sum((p["w"] * x) ** 2), {"n": x.shape[0]}

    (v, aux), g = entrenar.value_and_grad(loss, argnums=(0, 1), has_aux=True)(
        {"w": jnp.array(2.0)}, jnp.array([1.0, 3.0])
    )
    assert float(v) == pytest.approx(40.0)
    assert aux == {"n": 2}
    assert float(g[0]["w"]) == pytest.approx(2 * 2.0 * 10.0)
    np.testing.assert_allclose(g[1], [8.0, 24.0])
    g1 = entrenar.grad(lambda x: jnp.sum(x**3))(jnp.array([2.0]))
    np.testing.assert_allclose(g1, [12.0])
