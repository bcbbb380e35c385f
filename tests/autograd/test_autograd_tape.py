"""The tape's behaviour: the book's worked examples, reuse, freeing, modes, errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import entrenar
from entrenar.autograd import Tensor, backward, engine, get_tape, no_grad
from entrenar.errors import ShapeError, TapeError


def leaf(v):
    return Tensor(np.asarray(v, np.float32), requires_grad=True)


def test_square_at_three():
    x = leaf(3.0)
    backward(x * x)
    assert x.grad.item() == 6.0


def test_book_examples():
    x, y = leaf(2.0), leaf(3.0)
    backward((x + y) * x)
    assert (x.grad.item(), y.grad.item()) == (7.0, 2.0)

    x, y = leaf(3.0), leaf(4.0)
    backward((x + y) + (x * y))
    assert (x.grad.item(), y.grad.item()) == (5.0, 4.0)

    w, b = leaf(3.0), leaf(1.0)
    x, y = Tensor(2.0), Tensor(10.0)
    diff = w * x + b - y
    backward(diff * diff)
    assert (w.grad.item(), b.grad.item()) == (-12.0, -6.0)

    x = leaf(5.0)
    backward(x + x)
    assert x.grad.item() == 2.0


def test_reused_intermediate_accumulates_once():
    x = leaf([1.0, -2.0, 3.0])
    y = x * x
    z = y + y
    backward(z.sum())
    np.testing.assert_allclose(x.grad, 4 * np.array([1.0, -2.0, 3.0]))


def test_grad_accumulates_until_zero_grad():
    x = leaf(2.0)
    backward(x * x)
    backward(x * 3.0)
    assert x.grad.item() == 7.0
    x.zero_grad()
    assert x.grad is None


def test_tape_cleared_unless_retain_graph():
    x = leaf(1.5)
    y = x * x * x
    assert len(get_tape()) >= 2
    backward(y, retain_graph=True)
    backward(y)
    assert x.grad.item() == pytest.approx(2 * 3 * 1.5**2)
    with pytest.raises(TapeError, match="retain_graph"):
        backward(y * 1.0)
    assert len(get_tape()) == 0


def test_no_grad_records_nothing():
    x = leaf([1.0, 2.0])
    before = len(get_tape())
    with no_grad():
        y = x * 2.0 + 1.0
    assert not y.requires_grad and y.is_leaf
    assert len(get_tape()) == before
    np.testing.assert_allclose(y.data, [3.0, 5.0])
    with pytest.raises(TapeError, match="does not require grad"):
        backward(y.sum())


def test_changing_data_on_the_tape_raises():
    w = leaf([1.0, 2.0])
    loss = (w * w).sum()
    with pytest.raises(TapeError, match="requires grad"):
        w.data = jnp.zeros(2)
    backward(loss)
    w.data = jnp.zeros(2)  # released by backward: allowed
    assert w.numpy().tolist() == [0.0, 0.0]


def test_dropping_the_graph_releases_its_leaves():
    w = leaf([1.0])
    loss = (w * 3.0).sum()
    del loss
    w.data = jnp.ones(1)


def test_constants_are_snapshotted_at_record_time():
    w = leaf([2.0])
    x = Tensor([3.0])
    y = w * x
    x.data = jnp.array([100.0])  # constants may change: the graph keeps the old value
    backward(y.sum())
    assert y.item() == 6.0 and w.grad.item() == 3.0


def test_seed_and_non_scalar_errors():
    x = leaf([1.0, 2.0])
    y = x * x
    with pytest.raises(TapeError, match="seed"):
        backward(y)
    with pytest.raises(ShapeError, match="seed"):
        backward(y, grad=jnp.ones(3))
    backward(y, grad=jnp.array([1.0, 10.0]))
    np.testing.assert_allclose(x.grad, [2.0, 40.0])


def test_detach_stops_gradient():
    x = leaf(3.0)
    y = x * x
    z = y.detach() * x
    backward(z)
    assert x.grad.item() == 9.0
    assert not y.detach().requires_grad


def test_shape_errors_name_the_op_and_shapes():
    with pytest.raises(ShapeError, match=r"add\(float32\[2\], float32\[3\]\)"):
        Tensor([1.0, 2.0]) + Tensor([1.0, 2.0, 3.0])
    with pytest.raises(ShapeError, match="m\\*k"):
        entrenar.autograd.matmul(Tensor([1.0, 2.0]), Tensor([1.0]), 2, 2, 1)


def test_integer_tensor_cannot_require_grad():
    with pytest.raises(TapeError, match="floating-point"):
        Tensor([1, 2], requires_grad=True)


def test_constructors_properties_and_repr():
    t = Tensor.from_vec([1.0, 2.0, 3.0], requires_grad=True)
    assert t.shape == (3,) and t.dtype == np.float32 and t.requires_grad
    assert Tensor([[1, 2]]).dtype == np.int32
    assert Tensor(np.zeros(2, np.float64)).dtype == np.float32  # canonical dtype
    assert Tensor.zeros((2, 3)).numpy().sum() == 0
    assert Tensor.ones(4).numpy().sum() == 4
    r = Tensor.randn((2, 2), key=jax.random.key(0))
    assert r.shape == (2, 2) and np.isfinite(r.numpy()).all()
    assert isinstance(t.data, jax.Array)
    assert "requires_grad=True" in repr(t) and "[1., 2., 3.]" in repr(t)
    y = t * 2.0
    assert "lazy" in repr(y) and "op=mul" in repr(y)
    assert y.shape == (3,)  # known before the value
    assert y.tolist() == [2.0, 4.0, 6.0]
    assert Tensor([4.5]).item() == 4.5
    with pytest.raises(ShapeError, match="one element"):
        t.item()


def test_repeated_structure_is_compiled_and_fused():
    engine.clear_caches()
    w = leaf([0.5, -0.5])
    for step in range(4):
        x = Tensor(np.array([step, 1.0], np.float32))
        loss = ((w * x).sum() - 1.0) ** 2
        loss.item()  # read before backward, as in the quickstart
        backward(loss)
        expected = (
            2 * (float(np.dot([0.5, -0.5], [step, 1.0])) - 1.0) * np.array([step, 1.0])
        )
        np.testing.assert_allclose(w.grad, expected, rtol=1e-6)
        w.zero_grad()
    assert engine.stats["compiles"] == 2  # forward+grad program, compiled once
    assert engine.stats["fused"] >= 1


def test_each_thread_has_its_own_tape():
    import threading

    x = leaf(1.0)
    keep = x * x
    seen = []

    def worker():
        seen.append(len(get_tape()))
        y = leaf(2.0)
        backward(y * y)
        seen.append(y.grad.item())

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert seen == [0, 4.0]
    assert len(get_tape()) >= 1 and keep.requires_grad
