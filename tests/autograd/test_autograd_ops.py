"""Every op against jax.grad of the same jnp function and finite differences.

Hypothesis covers broadcasting shapes and reduction axes.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import entrenar.autograd as ag
from entrenar.autograd import Tensor, backward, check_gradient

RNG = np.random.default_rng(0)


def rand(*shape, low=-1.0, high=1.0):
    return RNG.uniform(low, high, shape).astype(np.float32)


def pos(*shape):
    return rand(*shape, low=0.5, high=2.0)


def away_from_zero(*shape):
    x = rand(*shape)
    return np.where(np.abs(x) < 0.1, 0.5, x).astype(np.float32)


IDS = np.array([[1, 3], [0, 3]], np.int32)
TARGETS = np.array([2, 0, -100, 1], np.int32)
KEY = jax.random.key(7)
MASK = np.tril(np.ones((3, 5), bool), k=2)

# name: (tensor function, jnp function, inputs)
CASES = {
    "add_broadcast": (lambda a, b: a + b, lambda a, b: a + b, [rand(3, 1), rand(4)]),
    "sub": (lambda a, b: a - b, lambda a, b: a - b, [rand(2, 3), rand(2, 3)]),
    "mul_scalar": (lambda a: 3.0 * a * 2.0, lambda a: 3.0 * a * 2.0, [rand(3)]),
    "div": (lambda a, b: a / b, lambda a, b: a / b, [rand(2, 3), pos(3)]),
    "rdiv": (lambda a: 1.0 / a, lambda a: 1.0 / a, [pos(4)]),
    "pow_scalar": (lambda a: a**3, lambda a: a**3, [rand(4)]),
    "pow_tensor": (lambda a, b: a**b, lambda a, b: a**b, [pos(3), rand(3)]),
    "neg": (lambda a: -a, lambda a: -a, [rand(3)]),
    "matmul": (lambda a, b: a @ b, lambda a, b: a @ b, [rand(2, 3), rand(3, 4)]),
    "matmul_batched": (lambda a, b: a @ b, jnp.matmul, [rand(2, 2, 3), rand(3, 2)]),
    "matmul_flat": (
        lambda a, b: ag.matmul(a, b, 2, 3, 2),
        lambda a, b: (a.reshape(2, 3) @ b.reshape(3, 2)).reshape(4),
        [rand(6), rand(6)],
    ),
    "sum_axis": (lambda a: a.sum(axis=1), lambda a: a.sum(axis=1), [rand(2, 3, 2)]),
    "sum_keepdims": (
        lambda a: a.sum(axis=(0, 2), keepdims=True),
        lambda a: a.sum(axis=(0, 2), keepdims=True),
        [rand(2, 3, 2)],
    ),
    "mean": (lambda a: a.mean(axis=0), lambda a: a.mean(axis=0), [rand(3, 2)]),
    "max": (lambda a: a.max(axis=-1), lambda a: a.max(axis=-1), [rand(3, 4)]),
    "reshape": (lambda a: a.reshape(3, -1), lambda a: a.reshape(3, -1), [rand(2, 3)]),
    "transpose": (
        lambda a: a.transpose(2, 0, 1),
        lambda a: a.transpose(2, 0, 1),
        [rand(2, 3, 4)],
    ),
    "T": (lambda a: a.T, lambda a: a.T, [rand(2, 3)]),
    "getitem": (
        lambda a: a[1:, None, ::2],
        lambda a: a[1:, None, ::2],
        [rand(3, 4)],
    ),
    "getitem_int_array": (
        lambda a: a[np.array([2, 0, 2])],
        lambda a: a[np.array([2, 0, 2])],
        [rand(3, 2)],
    ),
    "getitem_ellipsis": (lambda a: a[..., 1], lambda a: a[..., 1], [rand(2, 3)]),
    "concatenate": (
        lambda a, b: ag.concatenate([a, b, a], axis=1),
        lambda a, b: jnp.concatenate([a, b, a], axis=1),
        [rand(2, 1), rand(2, 3)],
    ),
    "stack": (
        lambda a, b: ag.stack([a, b], axis=-1),
        lambda a, b: jnp.stack([a, b], axis=-1),
        [rand(2, 3), rand(2, 3)],
    ),
    "where": (
        lambda a, b: ag.where(a > 0.0, a, b),
        lambda a, b: jnp.where(a > 0.0, a, b),
        [away_from_zero(5), rand(5)],
    ),
    "exp": (ag.exp, jnp.exp, [rand(4)]),
    "log": (ag.log, jnp.log, [pos(4)]),
    "sqrt": (ag.sqrt, jnp.sqrt, [pos(4)]),
    "tanh": (ag.tanh, jnp.tanh, [rand(4)]),
    "abs": (lambda x: x.abs(), jnp.abs, [away_from_zero(4)]),
    "sigmoid": (ag.sigmoid, jax.nn.sigmoid, [rand(4)]),
    "relu": (ag.relu, jax.nn.relu, [away_from_zero(6)]),
    "gelu_exact": (ag.gelu, lambda x: jax.nn.gelu(x, approximate=False), [rand(5)]),
    "gelu_tanh": (
        lambda x: ag.gelu(x, approximate=True),
        lambda x: jax.nn.gelu(x, approximate=True),
        [rand(5)],
    ),
    "silu": (ag.silu, jax.nn.silu, [rand(5)]),
    "softmax": (ag.softmax, jax.nn.softmax, [rand(2, 4)]),
    "log_softmax": (
        lambda x: ag.log_softmax(x, axis=0),
        lambda x: jax.nn.log_softmax(x, axis=0),
        [rand(3, 2)],
    ),
    "layer_norm": (
        lambda x, w, b: ag.layer_norm(x, w, b, eps=1e-5),
        lambda x, w, b: (
            (x - x.mean(-1, keepdims=True))
            / jnp.sqrt(x.var(-1, keepdims=True) + 1e-5)
            * w
            + b
        ),
        [rand(2, 5), rand(5), rand(5)],
    ),
    "rms_norm": (
        lambda x, w: ag.rms_norm(x, w, eps=1e-6),
        lambda x, w: x / jnp.sqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * w,
        [rand(3, 4), rand(4)],
    ),
    "embedding": (
        lambda w: ag.embedding(w, IDS),
        lambda w: w[IDS],
        [rand(4, 3)],
    ),
    "dropout": (
        lambda x: ag.dropout(x, 0.5, key=KEY),
        lambda x: jnp.where(jax.random.bernoulli(KEY, 0.5, x.shape), x / 0.5, 0.0),
        [rand(3, 4)],
    ),
    "attention_causal_gqa": (
        lambda q, k, v: ag.scaled_dot_product_attention(q, k, v, causal=True),
        None,  # reference below
        [rand(1, 4, 3, 2), rand(1, 2, 3, 2), rand(1, 2, 3, 2)],
    ),
    "attention_mask": (
        lambda q, k, v: ag.scaled_dot_product_attention(q, k, v, MASK),
        None,
        [rand(2, 2, 3, 2), rand(2, 2, 5, 2), rand(2, 2, 5, 3)],
    ),
    "mse": (ag.mse_loss, lambda p, y: jnp.mean((p - y) ** 2), [rand(3, 2), rand(3, 2)]),
    "cross_entropy_ignore": (
        lambda x: ag.cross_entropy(x, TARGETS),
        None,
        [rand(4, 3)],
    ),
    "bce_logits": (
        ag.binary_cross_entropy_with_logits,
        lambda x, y: jnp.mean(
            -(y * jnp.log(jax.nn.sigmoid(x)) + (1 - y) * jnp.log(1 - jax.nn.sigmoid(x)))
        ),
        [rand(6) * 3, (rand(6) > 0).astype(np.float32)],
    ),
}


def ref_attention(q, k, v, mask=None, causal=False):
    """Plain attention with k/v heads repeated for GQA."""
    group = q.shape[1] // k.shape[1]
    k = jnp.repeat(k, group, axis=1)
    v = jnp.repeat(v, group, axis=1)
    s = q @ jnp.swapaxes(k, -1, -2) / np.sqrt(q.shape[-1])
    t, n = s.shape[-2], s.shape[-1]
    if causal:
        s = jnp.where(np.tril(np.ones((t, n), bool), k=n - t), s, -1e30)
    if mask is not None:
        s = jnp.where(mask, s, -1e30)
    return jax.nn.softmax(s, -1) @ v


def ref_cross_entropy(x):
    valid = TARGETS != -100
    logp = jax.nn.log_softmax(x, -1)
    nll = -logp[np.arange(4), np.where(valid, TARGETS, 0)]
    return jnp.sum(jnp.where(valid, nll, 0.0)) / float(valid.sum())


REFS = {
    "attention_causal_gqa": lambda q, k, v: ref_attention(q, k, v, causal=True),
    "attention_mask": lambda q, k, v: ref_attention(q, k, v, mask=MASK),
    "cross_entropy_ignore": ref_cross_entropy,
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_op_value_and_grad_match_jax(name):
    tfn, jfn, inputs = CASES[name]
    jfn = jfn or REFS[name]
    out_ref = jfn(*[jnp.asarray(x) for x in inputs])
    proj = RNG.standard_normal(out_ref.shape).astype(np.float32)
    tensors = [Tensor(x, requires_grad=x.dtype == np.float32) for x in inputs]
    out = tfn(*tensors)
    np.testing.assert_allclose(out.numpy(), out_ref, rtol=1e-5, atol=1e-6)
    backward((out * proj).sum())
    diff_idx = [i for i, x in enumerate(inputs) if x.dtype == np.float32]
    ref_grads = jax.grad(lambda *xs: jnp.sum(jfn(*xs) * proj), argnums=tuple(diff_idx))(
        *[jnp.asarray(x) for x in inputs]
    )
    for i, g in zip(diff_idx, ref_grads):
        np.testing.assert_allclose(tensors[i].grad, g, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", sorted(CASES))
def test_op_finite_differences(name):
    tfn, _, inputs = CASES[name]
    if name == "bce_logits":
        result = check_gradient(tfn, inputs, wrt=[0])
    else:
        result = check_gradient(tfn, inputs)
    assert result, f"{name}: max error {result.max_error}"


@settings(max_examples=12)
@given(
    hnp.mutually_broadcastable_shapes(num_shapes=2, min_dims=0, max_dims=3, max_side=3),
    st.sampled_from(["add", "sub", "mul", "div"]),
)
def test_broadcasting_binary_ops(shapes, opname):
    a_shape, b_shape = shapes.input_shapes
    a, b = rand(*a_shape), pos(*b_shape)
    fn = {
        "add": lambda x, y: x + y,
        "sub": lambda x, y: x - y,
        "mul": lambda x, y: x * y,
        "div": lambda x, y: x / y,
    }[opname]
    ta, tb = Tensor(a, requires_grad=True), Tensor(b, requires_grad=True)
    out = fn(ta, tb)
    assert out.shape == shapes.result_shape
    backward(out.sum())
    ga, gb = jax.grad(lambda x, y: jnp.sum(fn(x, y)), argnums=(0, 1))(a, b)
    assert ta.grad.shape == a.shape and tb.grad.shape == b.shape
    np.testing.assert_allclose(ta.grad, ga, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(tb.grad, gb, rtol=1e-5, atol=1e-6)


@settings(max_examples=10)
@given(st.lists(st.integers(1, 3), min_size=1, max_size=3), st.data())
def test_reductions_over_any_axis(shape, data):
    x = rand(*shape)
    axis = data.draw(st.sampled_from([None, *range(len(shape))]))
    keep = data.draw(st.booleans())
    for name, reduce in (("sum", jnp.sum), ("mean", jnp.mean)):
        t = Tensor(x, requires_grad=True)
        out = getattr(t, name)(axis=axis, keepdims=keep)
        ref = reduce(x, axis=axis, keepdims=keep)
        np.testing.assert_allclose(out.numpy(), ref, rtol=1e-5, atol=1e-6)
        backward(out.sum())
        g = jax.grad(lambda v, f=reduce: jnp.sum(f(v, axis=axis)))(x)
        np.testing.assert_allclose(t.grad, g, rtol=1e-5, atol=1e-6)


def test_cross_entropy_all_ignored_is_zero():
    x = Tensor(rand(2, 3), requires_grad=True)
    loss = ag.cross_entropy(x, np.array([-100, -100], np.int32))
    assert loss.item() == 0.0
    backward(loss)
    assert np.all(np.asarray(x.grad) == 0.0)


def test_dropout_identity_when_not_training():
    x = Tensor(rand(4), requires_grad=True)
    y = ag.dropout(x, 0.3, key=KEY, deterministic=True)
    np.testing.assert_array_equal(y.numpy(), x.numpy())


def test_astype_mixed_precision_gradient():
    x = Tensor(rand(3), requires_grad=True)
    y = x.astype(jnp.bfloat16)
    assert y.dtype == jnp.bfloat16
    backward((y * y).astype(jnp.float32).sum())
    assert x.grad.dtype == np.float32
    np.testing.assert_allclose(x.grad, 2 * x.numpy(), rtol=1e-2)


def test_max_ties_share_the_gradient_equally():
    # row 0: three-way tie; row 1: a single maximum; row 2: all equal (four-way)
    x = Tensor(
        [[1.0, 5.0, 5.0, 5.0], [2.0, 9.0, 0.0, 1.0], [3.0, 3.0, 3.0, 3.0]],
        requires_grad=True,
    )
    backward(x.max(axis=1).sum())
    third, quarter = 1.0 / 3.0, 0.25
    expected = [[0.0, third, third, third], [0.0, 1.0, 0.0, 0.0], [quarter] * 4]
    np.testing.assert_allclose(np.asarray(x.grad), expected, rtol=1e-6)
    # the same as jax.grad of jnp.max
    ref = jax.grad(lambda a: jnp.max(a, axis=1).sum())(jnp.asarray(x.data))
    np.testing.assert_allclose(np.asarray(x.grad), np.asarray(ref), rtol=1e-6)
