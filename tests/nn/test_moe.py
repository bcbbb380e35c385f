"""The sparse MoE MLP (entrenar.nn.moe) against its formula and transformers.

Also finite differences (float64) and transformers' load-balancing loss.

The reference here is the formula of the module docstring written densely in
numpy / jax: every expert computed on every token and combined with an ``(N, E)``
matrix that is zero off the top-k; the module computes only the chosen experts
(sorted slots, `jax.lax.ragged_dot`).
"""

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jax.test_util import check_grads

from entrenar.nn import moe


def _silu(x):
    return x / (1.0 + np.exp(-x))


def _softmax(z):
    z = z - z.max(-1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(-1, keepdims=True)


def _combine(logits, k, normalize):
    """``(N, E)`` routing weights, zero off each row's top-k (numpy)."""
    p = _softmax(logits.astype(np.float64))
    top = np.argsort(-p, axis=-1, kind="stable")[:, :k]  # (N, k)
    w = np.zeros_like(p)
    rows = np.arange(p.shape[0])[:, None]
    w[rows, top] = p[rows, top]
    if normalize:
        w = w / w.sum(-1, keepdims=True)
    return w


def _dense_reference(p, x, k, normalize):
    """The formula with every expert on every token, float64 numpy."""
    x = np.asarray(x, np.float64)
    logits = x @ np.asarray(p["gate"]["weight"], np.float64).T  # (N, E)
    comb = _combine(logits, k, normalize)  # (N, E)
    ex = {n: np.asarray(v["weight"], np.float64) for n, v in p["experts"].items()}
    g = np.einsum("nd,eid->nei", x, ex["gate_proj"])  # (N, E, I)
    u = np.einsum("nd,eid->nei", x, ex["up_proj"])
    y = np.einsum("nei,edi->ned", _silu(g) * u, ex["down_proj"])  # (N, E, D)
    out = np.einsum("ne,ned->nd", comb, y)
    if "shared_expert" in p:
        sp = {
            n: np.asarray(v["weight"], np.float64)
            for n, v in p["shared_expert"].items()
        }
        h = _silu(x @ sp["gate_proj"].T) * (x @ sp["up_proj"].T)
        gate = x @ np.asarray(p["shared_expert_gate"]["weight"], np.float64).T
        out = out + (1 / (1 + np.exp(-gate))) * (h @ sp["down_proj"].T)
    return out


def _params(seed, d, e, i, shared=0, dtype=jnp.float32):
    """Router, expert stacks and (``shared`` > 0) a gated shared expert, from numpy.

    Drawn with numpy, not ``jax.random``: each eager ``jax.random.normal`` of a new
    shape compiles its own small programs (about ten per call of this function), and
    most examples here have new shapes.
    """
    rng = np.random.default_rng(seed)

    def n(s, sd=0.3):
        return jnp.asarray((sd * rng.normal(size=s)).astype(dtype))

    p = {
        "gate": {"weight": n((e, d), 1.0)},
        "experts": {
            "gate_proj": {"weight": n((e, i, d))},
            "up_proj": {"weight": n((e, i, d))},
            "down_proj": {"weight": n((e, d, i))},
        },
    }
    if shared:
        p["shared_expert"] = {
            "gate_proj": {"weight": n((shared, d))},
            "up_proj": {"weight": n((shared, d))},
            "down_proj": {"weight": n((d, shared))},
        }
        p["shared_expert_gate"] = {"weight": n((1, d))}
    return p


def _normal(seed, shape, dtype=jnp.float32):
    """Standard normal inputs from numpy (no compilation: see `_params`)."""
    rng = np.random.default_rng(seed)
    return jnp.asarray(rng.normal(size=shape).astype(dtype))


# one program per example: run op by op, each example's new shapes compiled (or read
# from the persistent cache) every small operation of the module, ~100 per example
_sparse_moe = jax.jit(moe.sparse_moe, static_argnums=(2, 3), static_argnames="impl")


@settings(max_examples=12, deadline=None)
@given(
    e=st.integers(1, 6),
    data=st.data(),
    normalize=st.booleans(),
    shared=st.sampled_from([0, 5]),
    n=st.integers(1, 9),
    seed=st.integers(0, 2**16),
    impl=st.sampled_from(moe.GROUPED_IMPLS),
)
def test_sparse_moe_equals_the_dense_formula(e, data, normalize, shared, n, seed, impl):
    k = data.draw(st.integers(1, e))
    d, i = 6, 4
    p = _params(seed, d, e, i, shared)
    x = _normal(seed + 2**17, (n, d))
    y, logits = _sparse_moe(p, x, k, normalize, impl=impl)
    want = _dense_reference(p, x, k, normalize)
    np.testing.assert_allclose(np.asarray(y), want, atol=2e-5, rtol=1e-4)
    assert logits.shape == (n, e)


def test_route_matches_softmax_top_k():
    logits = np.random.default_rng(0).normal(size=(7, 5)).astype(np.float32)
    for normalize in (False, True):
        w, idx = moe.route(jnp.asarray(logits), 2, normalize)
        comb = _combine(logits, 2, normalize)
        np.testing.assert_array_equal(
            np.asarray(idx), np.argsort(-comb, axis=-1, kind="stable")[:, :2]
        )
        np.testing.assert_allclose(
            np.asarray(w), np.take_along_axis(comb, np.asarray(idx), -1), rtol=1e-6
        )
        assert w.dtype == jnp.float32


def test_batched_input_keeps_its_shape():
    p = _params(0, 6, 4, 3)
    x = _normal(1, (2, 3, 6))
    y, logits = _sparse_moe(p, x, 2, True)
    assert y.shape == (2, 3, 6) and logits.shape == (6, 4)
    flat, _ = _sparse_moe(p, x.reshape(6, 6), 2, True)
    np.testing.assert_allclose(np.asarray(y).reshape(6, 6), np.asarray(flat))


@pytest.fixture
def x64():
    jax.config.update("jax_enable_x64", True)
    yield
    jax.config.update("jax_enable_x64", False)


@settings(
    max_examples=10,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],  # x64: all runs
)
@given(
    sizes=st.lists(st.integers(0, 7), min_size=1, max_size=5),
    c=st.sampled_from([1, 2, 3, 8]),
    seed=st.integers(0, 2**16),
)
def test_tiled_grouped_matmul_equals_its_formula(x64, sizes, c, seed):
    """Values and gradients of the tile scan against the rows multiplied one by one."""
    rng = np.random.default_rng(seed)
    m, e = sum(sizes), len(sizes)
    x = jnp.asarray(rng.normal(size=(m, 3)))
    w = jnp.asarray(rng.normal(size=(e, 3, 2)))
    group = np.repeat(np.arange(e), sizes)  # (M,) each sorted row's group
    s = jnp.asarray(sizes, jnp.int32)

    def tiled(x, w):
        return jnp.sum(jnp.sin(moe.tiled_grouped_matmul(x, w, s, c)))

    def rows(x, w):  # each row times its group's matrix
        return jnp.sum(jnp.sin(jnp.einsum("mi,mio->mo", x, w[group])))

    (vt, gt), (vr, gr) = (
        jax.jit(jax.value_and_grad(f, (0, 1)))(x, w) for f in (tiled, rows)
    )
    np.testing.assert_allclose(vt, vr, rtol=1e-12)
    for a, b in zip(gt, gr):
        np.testing.assert_allclose(a, b, atol=1e-12)


@pytest.mark.parametrize("impl", moe.GROUPED_IMPLS)
@pytest.mark.parametrize("normalize,shared", [(True, 0), (False, 3)])
def test_gradients_equal_finite_differences(x64, normalize, shared, impl):
    """float64 central differences through router, experts and the shared expert."""
    p = _params(2, 5, 4, 3, shared, dtype=jnp.float64)
    x = _normal(3, (6, 5), jnp.float64)

    def f(p, x):
        y, _ = moe.sparse_moe(p, x, 2, normalize, impl=impl)
        return jnp.sum(jnp.sin(y))

    # jitted: each of check_grads' evaluations one program, not one per operation
    check_grads(
        jax.jit(f), (p, x), order=1, modes=["rev"], eps=1e-6, atol=1e-6, rtol=1e-6
    )


@pytest.mark.parametrize("impl", moe.GROUPED_IMPLS)
def test_gradients_equal_the_dense_formula(x64, impl):
    """jax.grad of the sparse path against jax.grad of the dense formula."""
    p = _params(4, 5, 6, 3, 4, dtype=jnp.float64)
    x = _normal(5, (8, 5), jnp.float64)

    def dense(p, x):  # every expert on every token, combined by the top-k matrix
        logits = x @ p["gate"]["weight"].T  # (N, E)
        prob = jax.nn.softmax(logits, -1)
        top = jax.lax.top_k(prob, 3)[1]
        keep = jax.nn.one_hot(top, 6).sum(1)  # (N, E)
        comb = prob * keep
        comb = comb / comb.sum(-1, keepdims=True)
        ex = p["experts"]
        g = jnp.einsum("nd,eid->nei", x, ex["gate_proj"]["weight"])
        u = jnp.einsum("nd,eid->nei", x, ex["up_proj"]["weight"])
        y = jnp.einsum("nei,edi->ned", jax.nn.silu(g) * u, ex["down_proj"]["weight"])
        out = jnp.einsum("ne,ned->nd", comb, y)
        sp = p["shared_expert"]
        h = jax.nn.silu(x @ sp["gate_proj"]["weight"].T) * (
            x @ sp["up_proj"]["weight"].T
        )
        s = jax.nn.sigmoid(x @ p["shared_expert_gate"]["weight"].T)
        return jnp.sum(jnp.sin(out + s * (h @ sp["down_proj"]["weight"].T)))

    def sparse(p, x):
        return jnp.sum(jnp.sin(moe.sparse_moe(p, x, 3, True, impl=impl)[0]))

    got = jax.jit(jax.grad(sparse, (0, 1)))(p, x)
    want = jax.jit(jax.grad(dense, (0, 1)))(p, x)
    err = jax.tree_util.tree_map(lambda a, b: float(jnp.abs(a - b).max()), got, want)
    assert max(jax.tree_util.tree_leaves(err)) < 1e-12, err


def _intermediate_sizes(e, n=16, k=2, d=8, i=12):
    """Sizes of the jaxpr's values that are neither weights nor router-shaped."""
    p = _params(0, d, e, i)
    x = jnp.ones((n, d))

    def loss(p, x):
        return jnp.sum(moe.sparse_moe(p, x, k, True)[0] ** 2)

    jaxpr = jax.make_jaxpr(jax.grad(loss))(p, x)  # forward and backward
    sizes, ops = [], set()

    def walk(jp):
        for eqn in jp.eqns:
            ops.add(eqn.primitive.name)
            for v in eqn.outvars:
                shape = tuple(v.aval.shape)
                if shape[:1] == (e,) or shape == (n, e):  # weights, sizes; logits
                    continue
                sizes.append(int(np.prod(shape)))
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                walk(sub)

    walk(jaxpr.jaxpr)
    return sorted(sizes), ops


def test_only_the_chosen_experts_are_in_the_program():
    """At fixed k no value but the weights and router logits grows with E.

    The program multiplies tiles of the ``(N k, D)`` sorted slots by their
    expert's weights in a scan, never an ``(N, E, I)`` tensor (as XLA:CPU's
    lowering of ``ragged_dot`` does: specs/models.md).
    """
    small, ops = _intermediate_sizes(3)
    big, _ = _intermediate_sizes(40)
    assert "scan" in ops and "ragged_dot_general" not in ops
    assert max(big) <= max(small) <= (16 * 2 + 16) * 12  # (N k + C) I: slot rows
    assert sum(big) <= sum(small)


def test_load_balancing_loss_equals_transformers():
    torch = pytest.importorskip("torch")
    mixtral = pytest.importorskip("transformers.models.mixtral.modeling_mixtral")
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(3, 10, 6)).astype(np.float32)  # (L, N, E)
    mask = np.ones((2, 5), np.int64)
    mask[1, :2] = 0
    for m in (None, mask):
        want = mixtral.load_balancing_loss_func(
            tuple(torch.from_numpy(x) for x in logits), 6, 2,
            None if m is None else torch.from_numpy(m),
        )  # fmt: skip
        got = moe.load_balancing_loss(
            jnp.asarray(logits), 2, None if m is None else jnp.asarray(m)
        )
        np.testing.assert_allclose(float(got), float(want), rtol=1e-6)


def test_lora_on_nf4_experts_is_made_dense_one_expert_at_a_time():
    """Weight nodes (LoRA over NF4) take the per-expert tile path.

    The same values and LoRA gradients as folding the whole stack first (the
    ragged_dot path), with no dense ``(E, out, in)`` stack in the program.
    """
    from entrenar import lora, quant

    p = _params(6, 64, 5, 64)
    p["experts"] = quant.quantize_params(p["experts"], "nf4", double_quant=True)
    cfg = lora.LoRAConfig(rank=2, targets=("gate_proj", "up_proj", "down_proj"))
    lp = lora.apply({"m": p}, cfg, key=jax.random.key(7))["m"]
    bump = jax.tree_util.tree_map(
        lambda x: x + 0.05 if x.ndim == 3 and x.shape[-1] == 2 else x,
        lp, is_leaf=lambda x: isinstance(x, jax.Array),
    )  # fmt: skip
    trainable, frozen = lora.split(bump)
    x = _normal(8, (11, 64))

    def loss(t, impl):
        y, _ = moe.sparse_moe(lora.combine(t, frozen), x, 2, True, impl=impl)
        return jnp.sum(jnp.sin(y))

    jaxpr = str(jax.make_jaxpr(jax.grad(loss), static_argnums=1)(trainable, "tiles"))
    assert "5,64,64" not in jaxpr.replace(" ", "")  # no dense (E, out, in) stack
    got = jax.value_and_grad(loss)(trainable, "tiles")
    want = jax.value_and_grad(loss)(trainable, "ragged_dot")
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
    for a, b in zip(jax.tree.leaves(got[1]), jax.tree.leaves(want[1]), strict=True):
        np.testing.assert_allclose(a, b, atol=2e-5, rtol=1e-4)
