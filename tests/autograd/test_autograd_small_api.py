"""The Tensor API's small conveniences, pinned down (mutation testing found them loose).

Constructors keep ``requires_grad`` and the default dtype, ``reshape`` takes a tuple,
``repr`` summarises above 20 values, ``np.asarray(t, dtype)`` converts, ``detach``
leaves the tape, the flat ``matmul`` checks its sizes, and ``defop`` keeps its
padding rule.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from entrenar import autograd
from entrenar.autograd import Tensor, backward, functional, ops
from entrenar.autograd.tape import get_tape
from entrenar.errors import ConfigError, ShapeError, TapeError


@pytest.mark.parametrize("make", [Tensor.zeros, Tensor.ones])
def test_zeros_and_ones_keep_requires_grad_and_default_to_float32(make):
    t = make((2, 3), requires_grad=True)
    assert t.requires_grad and t.dtype == jnp.float32 and t.shape == (2, 3)
    assert not make(4).requires_grad
    assert make(4, dtype=jnp.bfloat16).dtype == jnp.bfloat16


def test_randn_takes_an_int_shape_and_keeps_requires_grad():
    key = jax.random.key(0)
    t = Tensor.randn(5, key=key, requires_grad=True)
    assert t.shape == (5,) and t.requires_grad
    np.testing.assert_array_equal(t.numpy(), jax.random.normal(key, (5,)))
    assert not Tensor.randn([2, 2], key=key).requires_grad


def test_reshape_takes_a_tuple_or_separate_sizes():
    t = Tensor(np.arange(6.0))
    assert t.reshape((2, 3)).shape == (2, 3)
    assert t.reshape([3, 2]).shape == (3, 2)
    assert t.reshape(2, -1).shape == (2, 3)


def test_repr_exactly_and_summarised_above_twenty_values():
    assert repr(Tensor([1.0, 2.0])) == "Tensor([1., 2.], shape=(2,), dtype=float32)"
    assert repr(Tensor([1.0], requires_grad=True)) == (
        "Tensor([1.], shape=(1,), dtype=float32, requires_grad=True)"
    )
    assert "..." not in repr(Tensor(np.arange(20.0)))
    assert "..." in repr(Tensor(np.arange(21.0)))


def test_array_protocol_converts_to_the_asked_dtype():
    t = Tensor([1.5, 2.5])
    assert np.asarray(t).dtype == np.float32
    assert np.asarray(t, dtype=np.float64).dtype == np.float64
    np.testing.assert_array_equal(np.asarray(t, dtype=np.int32), [1, 2])


def test_detach_takes_its_node_off_the_tape():
    x = Tensor([1.0, 2.0], requires_grad=True)
    y = x * 2.0
    before = len(get_tape())
    d = y.detach()
    assert not d.requires_grad
    assert len(get_tape()) == before  # the stop_gradient node left the tape again
    np.testing.assert_array_equal(d.numpy(), [2.0, 4.0])


def test_flat_matmul_checks_its_sizes_and_the_plain_form_multiplies():
    a, b = np.arange(6.0).reshape(2, 3), np.arange(12.0).reshape(3, 4)
    np.testing.assert_allclose(functional.matmul(Tensor(a), Tensor(b)).numpy(), a @ b)
    flat = functional.matmul(a.ravel(), Tensor(b.ravel()), 2, 3, 4)
    np.testing.assert_allclose(flat.numpy(), (a @ b).ravel())
    with pytest.raises(ShapeError, match=r"^matmul's flat form needs all of m, k and"):
        functional.matmul(a.ravel(), b.ravel(), 2, 3)
    with pytest.raises(ShapeError, match=r"^matmul's flat form needs all of m, k and"):
        functional.matmul(a.ravel(), b.ravel(), 2, None, 4)
    with pytest.raises(ShapeError, match=r"needs a with m\*k=6 and b with k\*n=12"):
        functional.matmul(a.ravel(), b.ravel()[:-1], 2, 3, 4)  # only b is wrong
    with pytest.raises(ShapeError, match=r"got 5 and 12$"):
        functional.matmul(a.ravel()[:-1], b.ravel(), 2, 3, 4)  # only a is wrong


def test_defop_keeps_its_padding_rule():
    op = ops.defop("twice", lambda x: 2 * x, pad="elementwise")
    assert (op.name, op.pad) == ("twice", "elementwise")
    assert ops.defop("plain", jnp.sin).pad is None
    assert ops.MUL.pad == "elementwise" and ops.MATMUL.pad == "matmul"


def test_transpose_takes_a_tuple_or_separate_axes():
    t = Tensor(np.zeros((2, 3, 4)))
    assert t.transpose((2, 0, 1)).shape == (4, 2, 3)
    assert t.transpose(1, 0, 2).shape == (3, 2, 4)
    assert t.transpose().shape == (4, 3, 2)


def test_layer_norm_with_a_bias_and_no_weight():
    x = np.random.default_rng(0).normal(size=(3, 5)).astype(np.float32)
    b = np.arange(5.0, dtype=np.float32)
    y = functional.layer_norm(Tensor(x), bias=Tensor(b)).numpy()
    mu, var = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)
    np.testing.assert_allclose(y, (x - mu) / np.sqrt(var + 1e-5) + b, atol=1e-5)


def test_dropout_without_a_key_says_how_to_fix_it():
    with pytest.raises(ConfigError, match=r"^dropout needs key=\.\.\. unless determ"):
        functional.dropout(Tensor(np.ones(4)), 0.5, key=None)


def test_attention_takes_plain_arrays():
    rng = np.random.default_rng(0)
    q, k, v = (rng.normal(size=(1, 2, 3, 4)).astype(np.float32) for _ in range(3))
    y = functional.scaled_dot_product_attention(q, k, v).numpy()
    s = np.einsum("bhqd,bhkd->bhqk", q, k) / 2.0  # 1/sqrt(4)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    np.testing.assert_allclose(y, np.einsum("bhqk,bhkd->bhqd", p, v), atol=1e-5)


@pytest.mark.parametrize("reduction", ["sum", "none"])
def test_cross_entropy_passes_its_reduction_on(reduction):
    logits = np.random.default_rng(0).normal(size=(4, 3)).astype(np.float32)
    targets = np.array([0, 2, 1, 2])
    got = functional.cross_entropy(Tensor(logits), targets, reduction=reduction)
    lp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    each = -lp[np.arange(4), targets]
    want = each.sum() if reduction == "sum" else each
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-5)


def test_backward_messages_in_full():
    with pytest.raises(TapeError, match=r"^backward\(\) needs a Tensor, got float$"):
        backward(1.0)
    with pytest.raises(TapeError) as info:
        backward(Tensor([1.0]).sum())
    assert str(info.value) == (
        "backward() on a tensor that does not require grad: no leaf it depends on was "
        "created with requires_grad=True (or it was computed under no_grad())"
    )
    x = Tensor([1.0, 2.0], requires_grad=True)
    y = (x * x).sum()
    backward(y)
    with pytest.raises(TapeError) as info:
        backward(y)
    assert str(info.value) == (
        "backward through a graph that was already freed (op 'sum', output shape ()): "
        "a previous backward() released it; pass retain_graph=True to the first "
        "backward() to differentiate twice"
    )


def test_a_cache_of_one_program_still_hits():
    old = autograd.set_cache_size(1)
    try:
        autograd.engine.clear_caches()
        for _ in range(3):
            x = Tensor([1.0, 2.0], requires_grad=True)
            backward((x * 3.0).sum())
        info = autograd.cache_info()
        assert (info.size, info.hits) == (1, 2)
    finally:
        autograd.set_cache_size(old)
        autograd.engine.clear_caches()
