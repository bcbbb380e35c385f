"""The Tensor API used as a PyTorch user uses it, with torch.autograd as the reference.

Values and gradients in float64 (``jax.enable_x64``) against torch's; the semantics
of ``requires_grad``, in-place updates, comparisons and indexing against torch's.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch.nn.functional as F

import entrenar.autograd as ag
from entrenar.autograd import Tensor, backward, no_grad
from entrenar.errors import DTypeError, ShapeError, TapeError

RNG = np.random.default_rng(0)
A, B = RNG.standard_normal((3, 4)), RNG.standard_normal(4)
A_INF = A.copy()
A_INF[0, 1] = -np.inf  # a masked logit
TARGETS = np.array([1, -100, 3])
MASK = np.array([True, False, True])
QKV = [RNG.standard_normal(s) for s in [(1, 4, 3, 2), (1, 2, 5, 2), (1, 2, 5, 2)]]
CAUSAL = torch.ones(3, 5, dtype=torch.bool).tril(2)


def kv(t):
    return t.repeat_interleave(2, 1)  # each k/v head serves two query heads


# name: (entrenar function, torch function, float64 inputs)
CASES = {
    "add_broadcast": (lambda a, b: a + b, lambda a, b: a + b, [A, B]),
    "scalars_on_the_left": (
        lambda a: 2 - a / (3 + a * a) + 2.0**a,
        lambda a: 2 - a / (3 + a * a) + 2.0**a,
        [A],
    ),
    "pow_zero_base": (
        lambda a, b: a**b,
        lambda a, b: a**b,
        [np.array([0.0, 1.0, 2.0]), np.array([2.0, 0.5, 1.5])],
    ),
    "numpy_on_the_left": (
        lambda a: np.ones((2, 3)) @ (np.float64(2.0) * a),
        lambda a: torch.ones(2, 3, dtype=torch.float64) @ (2.0 * a),
        [A],
    ),
    "sum_keepdims_negative_axes": (
        lambda a: a.sum(axis=(-1, 0), keepdims=True),
        lambda a: a.sum((-1, 0), keepdim=True),
        [RNG.standard_normal((2, 3, 4))],
    ),
    "mean_max_ties": (
        lambda a: a.mean(axis=-1) + a.max(axis=1),
        lambda a: a.mean(-1) + a.amax(1),
        [np.array([[1.0, 3, 3], [2, 2, 2]])],
    ),
    "index_negative_and_step": (
        lambda a: a[-1, -3::2] + a[::-1][0, :2].sum(),
        lambda a: a[-1, -3::2] + a.flip(0)[0, :2].sum(),
        [A],
    ),
    "index_repeated_rows_accumulate": (
        lambda a: a[np.array([0, 2, 0, -3])] * 2.0,
        lambda a: a[[0, 2, 0, -3]] * 2.0,
        [A],
    ),
    "index_two_arrays_and_a_tensor": (
        lambda a: a[np.array([0, 2, 0]), Tensor(np.array([1, 1, 3]))],
        lambda a: a[[0, 2, 0], [1, 1, 3]],
        [A],
    ),
    "index_boolean_mask": (
        lambda a: a[MASK] * a[:, np.array([True, False, False, True])].sum(),
        lambda a: (
            a[torch.tensor(MASK)] * a[:, torch.tensor([True, False, False, True])].sum()
        ),
        [A],
    ),
    "index_by_comparison": (
        lambda a: a[a > 0.0] * 3.0,
        lambda a: a[a > 0.0] * 3.0,
        [A],
    ),
    "reshape_transpose_concat_stack": (
        lambda a, b: ag.stack(
            [ag.concatenate([a, b], axis=-1).T, ag.concatenate([a, b]).reshape(4, -1)]
        ),
        lambda a, b: torch.stack(
            [torch.cat([a, b], -1).T, torch.cat([a, b]).reshape(4, -1)]
        ),
        [RNG.standard_normal((3, 2)), RNG.standard_normal((3, 2))],
    ),
    "matmul_1d_1d": (lambda a, b: a @ b, lambda a, b: a @ b, [B, B[::-1].copy()]),
    "matmul_1d_batched": (
        lambda a, b: a @ b,
        lambda a, b: a @ b,
        [RNG.standard_normal(3), RNG.standard_normal((2, 3, 4))],
    ),
    "matmul_broadcast_batches": (
        lambda a, b: a @ b,
        lambda a, b: a @ b,
        [RNG.standard_normal((2, 1, 3, 4)), RNG.standard_normal((5, 4, 2))],
    ),
    "abs_at_zero": (
        lambda a: a.abs(),
        torch.abs,
        [np.array([-1.0, 0.0, 2.0, -0.0])],
    ),
    "activations": (
        lambda a: (
            ag.relu(a)
            + ag.gelu(a)
            + ag.gelu(a, approximate=True)
            + ag.silu(a)
            + ag.sigmoid(a)
            + ag.tanh(a)
        ),
        lambda a: (
            torch.relu(a)
            + F.gelu(a)
            + F.gelu(a, approximate="tanh")
            + F.silu(a)
            + torch.sigmoid(a)
            + torch.tanh(a)
        ),
        [np.concatenate([A.ravel(), [0.0]])],
    ),
    "softmaxes_with_minus_infinity": (
        lambda a: ag.softmax(a) + ag.log_softmax(a, axis=0),
        lambda a: torch.softmax(a, -1) + torch.log_softmax(a, 0),
        [A_INF],
    ),
    "cross_entropy_ignore_index": (
        lambda a: ag.cross_entropy(a, TARGETS),
        lambda a: F.cross_entropy(a, torch.tensor(TARGETS)),
        [A_INF],
    ),
    "cross_entropy_other_ignore_index_sum": (
        lambda a: ag.cross_entropy(a, np.array([1, 0, 3]), 0, reduction="sum"),
        lambda a: F.cross_entropy(
            a, torch.tensor([1, 0, 3]), ignore_index=0, reduction="sum"
        ),
        [A],
    ),
    "cross_entropy_sequence": (
        lambda a: ag.cross_entropy(a, np.array([[1, 2], [-100, 0]])),
        lambda a: F.cross_entropy(
            a.permute(0, 2, 1), torch.tensor([[1, 2], [-100, 0]])
        ),
        [RNG.standard_normal((2, 2, 5))],
    ),
    "bce_mse": (
        lambda a, y: ag.binary_cross_entropy_with_logits(a, y) + ag.mse_loss(a, y),
        lambda a, y: F.binary_cross_entropy_with_logits(a, y) + F.mse_loss(a, y),
        [A, RNG.uniform(size=(3, 4))],
    ),
    "norms": (
        lambda a, w, b: ag.layer_norm(a, w, b) + ag.rms_norm(a, w, eps=1e-6),
        lambda a, w, b: F.layer_norm(a, (4,), w, b) + F.rms_norm(a, (4,), w, 1e-6),
        [A, B, B[::-1].copy()],
    ),
    "where_and_casts": (
        lambda a, b: ag.where(a > 0, a, b).astype(jnp.float32).astype(jnp.float64),
        lambda a, b: torch.where(a > 0, a, b).float().double(),
        [A, RNG.standard_normal((3, 4))],
    ),
    "embedding_repeated_ids": (
        lambda w: ag.embedding(w, np.array([1, 1, 0])),
        lambda w: F.embedding(torch.tensor([1, 1, 0]), w),
        [A],
    ),
    "attention_gqa_causal": (
        lambda q, k, v: ag.scaled_dot_product_attention(q, k, v, causal=True),
        lambda q, k, v: F.scaled_dot_product_attention(q, kv(k), kv(v), CAUSAL),
        QKV,
    ),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_values_and_gradients_equal_torch(name):
    fn, torch_fn, inputs = CASES[name]
    with jax.enable_x64(True):
        xs = [Tensor(x, requires_grad=True) for x in inputs]
        out = fn(*xs)
        ts = [torch.tensor(x, requires_grad=True) for x in inputs]
        ref = torch_fn(*ts)
        seed = np.random.default_rng(1).standard_normal(tuple(ref.shape))
        backward(out, grad=seed)
        ref.backward(torch.tensor(seed))
        assert out.shape == tuple(ref.shape)
        np.testing.assert_allclose(out.numpy(), ref.detach().numpy(), 1e-10, 1e-12)
        for x, t in zip(xs, ts):
            assert x.grad.dtype == np.float64
            np.testing.assert_allclose(x.grad, t.grad.numpy(), 1e-9, 1e-12)


def leaf(v, requires_grad=True):
    return Tensor(np.asarray(v, np.float32), requires_grad=requires_grad)


def test_indices_out_of_range_are_refused_as_torch_does():
    # before: JAX clamped them silently (x[2] of 2 rows gave row 1; iterating a
    # tensor never stopped)
    x = leaf(np.arange(6).reshape(2, 3))
    for index in [2, -3, (0, 3), (..., -4), np.array([0, 2]), [1, -3], (0, [3])]:
        with pytest.raises(ShapeError, match="out of range for axis"):
            x[index]
        with pytest.raises(IndexError):
            torch.zeros(2, 3)[index]
    with pytest.raises(ShapeError, match="too many indices"):
        x[0, 0, 0]
    with pytest.raises(ShapeError, match="does not fit axes"):
        x[np.array([True, False, True])]
    assert x[-2, -3].item() == 0.0 and x[..., 2].tolist() == [2.0, 5.0]
    rows = [r.tolist() for r in x]
    (_, b) = x
    assert rows == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]] and b.tolist() == rows[1]
    assert int(x[1, 1]) == 4


def test_a_boolean_mask_inside_jit_is_refused_clearly():
    @jax.jit
    def f(v):
        t = Tensor(v)
        return t[t > 0.0].data

    with pytest.raises(ShapeError, match="where"):
        f(jnp.ones(3))


def test_requires_grad_set_after_recording_leaves_the_graph_as_recorded():
    # torch: a graph recorded while c was a constant keeps c's value then and gives
    # c no gradient; before, backward read c's new value (w.grad 100) and gave c one
    w, c = leaf([2.0]), leaf([3.0], requires_grad=False)
    y = (w * c).sum()
    c.data = jnp.array([100.0])
    c.requires_grad_(True)
    backward(y)
    wt, ct = torch.tensor([2.0], requires_grad=True), torch.tensor([3.0])
    yt = (wt * ct).sum()
    ct.requires_grad_(True)
    yt.backward()
    assert w.grad.tolist() == wt.grad.tolist() == [3.0]
    assert c.grad is None and ct.grad is None
    assert c._live_uses == 0  # the freed graph did not unpin what it never pinned


def test_requires_grad_attribute_is_checked():
    w = leaf([2.0])
    y = (w * 3.0).sum()
    with pytest.raises(TapeError, match="recorded operations still use"):
        w.requires_grad = False  # the graph still needs w's gradient
    backward(y)
    w.requires_grad = False
    assert not w.requires_grad and w.grad.tolist() == [3.0]
    i = Tensor([1, 2])
    with pytest.raises(TapeError, match="only floating-point"):
        i.requires_grad = True  # before: accepted, then a float0 "gradient"
    with pytest.raises(TapeError, match=r"detach\(\)"):
        (leaf([1.0]) * 2.0).requires_grad = False


def test_a_tensor_computed_from_constants_can_become_a_parameter():
    # torch's w = (torch.randn(...) * 0.02).requires_grad_()
    w = (Tensor.randn((3,), key=jax.random.key(0)) * 0.5).requires_grad_()
    assert w.is_leaf and w.requires_grad
    backward((w * w).sum())
    np.testing.assert_allclose(w.grad, 2 * w.numpy(), rtol=1e-6)


def test_equality_is_elementwise_and_not_differentiable():
    # before: == and != compared identities (t == 1.0 was False)
    x = leaf([1.0, 2.0, 0.0])
    eq, ne = x == 1.0, x != Tensor(np.float32([1.0, 0.0, 0.0]))
    assert eq.dtype == np.bool_ and not eq.requires_grad
    assert eq.tolist() == [True, False, False] and ne.tolist() == [False, True, False]
    backward(ag.where(x == 0.0, 1.0, x * x).sum())
    xt = torch.tensor([1.0, 2.0, 0.0], requires_grad=True)
    torch.where(xt == 0.0, 1.0, xt * xt).sum().backward()
    assert x.grad.tolist() == xt.grad.tolist()
    assert (x == None) is False and (x != None) is True  # noqa: E711
    assert len({x, x}) == 1  # hashable by identity


def test_manual_sgd_in_place_updates_the_parameters_as_torch():
    # before: p -= lr * p.grad rebound the loop variable: the parameters never moved
    params = [leaf([1.0, -2.0]), leaf([[0.5]])]
    tparams = [torch.tensor(p.numpy(), requires_grad=True) for p in params]
    for _ in range(3):
        backward((params[0] * params[0]).sum() + (params[1] * params[0]).sum())
        with no_grad():
            for p in params:
                p -= 0.1 * p.grad
                p *= 0.9
                p.zero_grad()
        ((tparams[0] * tparams[0]).sum() + (tparams[1] * tparams[0]).sum()).backward()
        with torch.no_grad():
            for p in tparams:
                p -= 0.1 * p.grad
                p *= 0.9
                p.grad = None
    for p, t in zip(params, tparams):
        assert p.is_leaf and p.requires_grad
        np.testing.assert_allclose(p.numpy(), t.detach().numpy(), rtol=1e-6)


def test_in_place_refusals_and_rebinding():
    w = leaf([1.0, 2.0])
    same = w
    with pytest.raises(TapeError, match=r"no_grad\(\).*w \+= "):
        w += 1.0  # torch: a leaf requiring grad used in an in-place operation
    c = leaf([1.0, 2.0], requires_grad=False)
    y = c * w
    c += 10.0  # a constant changes in place; y keeps the value recorded
    assert c.tolist() == [11.0, 12.0] and y.tolist() == [1.0, 4.0]
    loss = (w * w).sum()
    with no_grad(), pytest.raises(TapeError, match="still need it"):
        w -= 0.1  # the recorded graph still needs w's value
    backward(loss)
    del y  # the last graph that needs w
    with no_grad():
        w -= 0.5
    assert w is same and w.tolist() == [0.5, 1.5]
    h = w * 2.0
    h += 1.0  # not a leaf: replaced by the result (its graph is kept)
    backward(h.sum())
    assert w.grad.tolist() == [2.0 + 2.0, 4.0 + 2.0]  # 2w at [1, 2], then 2
    with pytest.raises(ShapeError, match="cannot broadcast"):
        c += np.ones((2, 2), np.float32)
    i = Tensor([1, 2])
    with jax.numpy_dtype_promotion("standard"), pytest.raises(DTypeError, match="int"):
        i += 0.5  # the tests' strict promotion would refuse int32 + float at once
    i += 1
    assert i.tolist() == [2, 3] and i.dtype == np.int32
