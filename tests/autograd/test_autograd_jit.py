"""Tensor code inside jax.jit gives what jax.grad gives; the quickstart converges."""

import runpy
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import entrenar.autograd as ag
from entrenar.autograd import Tensor, backward


def init_mlp(key):
    k1, k2 = jax.random.split(key)
    return {
        "w1": jax.random.normal(k1, (4, 8)) * 0.5,
        "b1": jnp.zeros(8),
        "w2": jax.random.normal(k2, (8, 3)) * 0.5,
        "b2": jnp.zeros(3),
    }


def loss_jnp(p, x, y):
    h = jax.nn.gelu(x @ p["w1"] + p["b1"], approximate=False)
    logits = h @ p["w2"] + p["b2"]
    return -jnp.mean(jax.nn.log_softmax(logits)[jnp.arange(x.shape[0]), y])


def loss_tensor(p, x, y):
    h = ag.gelu(x @ p["w1"] + p["b1"])
    return ag.cross_entropy(h @ p["w2"] + p["b2"], y)


@jax.jit
def tensor_step(params, x, y):
    tp = {k: Tensor(v, requires_grad=True) for k, v in params.items()}
    loss = loss_tensor(tp, x, y)
    backward(loss)
    new = {k: v - 0.1 * tp[k].grad for k, v in params.items()}
    return new, loss.data


@jax.jit
def jax_step(params, x, y):
    loss, g = jax.value_and_grad(loss_jnp)(params, x, y)
    return jax.tree_util.tree_map(lambda p, gi: p - 0.1 * gi, params, g), loss


def test_jitted_tensor_step_equals_jax_grad_step():
    key = jax.random.key(0)
    params = init_mlp(key)
    x = jax.random.normal(jax.random.key(1), (16, 4))
    y = jax.random.randint(jax.random.key(2), (16,), 0, 3)
    p_t, p_j = params, params
    for _ in range(5):
        p_t, loss_t = tensor_step(p_t, x, y)
        p_j, loss_j = jax_step(p_j, x, y)
        np.testing.assert_allclose(loss_t, loss_j, rtol=1e-6)
    for k in params:
        np.testing.assert_allclose(p_t[k], p_j[k], rtol=1e-6, atol=1e-7)


def test_jitted_tensor_step_compiles_to_the_same_program_as_jax_grad():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))
    import tape as bench  # the benchmark's MLP steps and HLO histogram

    params = bench.mlp_params(jax.random.key(0), [6, 8, 3])
    x = jax.random.normal(jax.random.key(1), (4, 6))
    y = jnp.array([0, 2, -100, 1])
    hist_t = bench.op_histogram(
        bench.step_tensor.lower(params, x, y).compile().as_text()
    )
    hist_j = bench.op_histogram(bench.step_jax.lower(params, x, y).compile().as_text())
    assert hist_t == hist_j and hist_t["dot"] >= 4


def test_tensor_code_under_jax_grad_of_data():
    # The tape also works on tracers of an outer transformation.
    def f(w):
        t = Tensor(w, requires_grad=True)
        out = (ag.tanh(t) * t).sum()
        backward(out)
        return t.grad

    w = jnp.array([0.3, -1.2, 2.0])
    expected = jax.grad(lambda v: jnp.sum(jnp.tanh(v) * v))(w)
    np.testing.assert_allclose(jax.jit(f)(w), expected, rtol=1e-6)


def test_quickstart_learns_two_x_plus_one(capsys):
    path = Path(__file__).parents[2] / "examples" / "quickstart.py"
    ns = runpy.run_path(str(path))
    w, b = ns["main"]()
    assert abs(w - 2.0) < 0.02 and abs(b - 1.0) < 0.05
    assert "Learned parameters" in capsys.readouterr().out
