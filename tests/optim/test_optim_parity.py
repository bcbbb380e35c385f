"""Every optimizer against optax, from one table.

For each case: 1,000 steps (one ``lax.scan`` under jit) on a mixed-shape pytree with a
closed-loop noisy convex gradient agree with optax to a relative 1e-5; a few steps run
the same with and without ``jax.jit``; the second jitted step does not recompile.
Interop both ways: optax pieces inside entrenar's ``chain`` and entrenar pieces inside
``optax.chain``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from optim_helpers import problem

from entrenar import optim as eo

STEPS = 1000


def _rank2(params):
    return jax.tree_util.tree_map(lambda x: x.ndim > 1, params)


def _ofreeze(inner):
    def labels(params):
        return jax.tree_util.tree_map(lambda x: "t" if x.ndim > 1 else "f", params)

    return optax.multi_transform({"t": inner, "f": optax.set_to_zero()}, labels)


# name -> (entrenar factory, optax factory)
CASES = {
    "sgd": (lambda: eo.sgd(0.05), lambda: optax.sgd(0.05)),
    "sgd_momentum": (lambda: eo.sgd(0.05, 0.9), lambda: optax.sgd(0.05, 0.9)),
    "sgd_nesterov": (
        lambda: eo.sgd(0.05, 0.9, nesterov=True),
        lambda: optax.sgd(0.05, 0.9, nesterov=True),
    ),
    "sgd_weight_decay": (
        lambda: eo.sgd(0.05, 0.9, weight_decay=0.1),
        lambda: optax.chain(optax.add_decayed_weights(0.1), optax.sgd(0.05, 0.9)),
    ),
    "adam": (lambda: eo.adam(0.01), lambda: optax.adam(0.01)),
    "adam_betas": (
        lambda: eo.adam(0.02, b1=0.8, b2=0.99, eps=1e-6),
        lambda: optax.adam(0.02, b1=0.8, b2=0.99, eps=1e-6),
    ),
    "adamw": (
        lambda: eo.adamw(0.01, weight_decay=0.1),
        lambda: optax.adamw(0.01, weight_decay=0.1),
    ),
    "adamw_mask": (
        lambda: eo.adamw(0.01, weight_decay=0.1, mask=lambda name, x: x.ndim > 1),
        lambda: optax.adamw(0.01, weight_decay=0.1, mask=_rank2),
    ),
    "adam_cosine": (
        lambda: eo.adam(eo.cosine_decay_schedule(0.02, 800, 0.05)),
        lambda: optax.adam(optax.cosine_decay_schedule(0.02, 800, 0.001 / 0.02)),
    ),
    "adam_linear": (
        lambda: eo.adam(eo.linear_schedule(0.02, 0.001, 700, 100)),
        lambda: optax.adam(optax.linear_schedule(0.02, 0.001, 700, 100)),
    ),
    "sgd_exponential": (
        lambda: eo.sgd(eo.exponential_decay(0.05, 300, 0.5), 0.9),
        lambda: optax.sgd(optax.exponential_decay(0.05, 300, 0.5), 0.9),
    ),
    "sgd_step_decay": (
        lambda: eo.sgd(eo.step_decay(0.05, 250, 0.5), 0.9),
        lambda: optax.sgd(optax.exponential_decay(0.05, 250, 0.5, staircase=True), 0.9),
    ),
    "adamw_warmup_cosine": (
        lambda: eo.adamw(
            eo.warmup_cosine_decay_schedule(0.0, 0.02, 100, 1000, 0.002),
            weight_decay=0.1,
        ),
        lambda: optax.adamw(
            optax.warmup_cosine_decay_schedule(0.0, 0.02, 100, 1000, 0.002),
            weight_decay=0.1,
        ),
    ),
    "clip_adam": (
        lambda: eo.chain(eo.clip_by_global_norm(2.0), eo.adam(0.01)),
        lambda: optax.chain(optax.clip_by_global_norm(2.0), optax.adam(0.01)),
    ),
    "accumulate_adamw": (
        lambda: eo.accumulate(eo.adamw(0.01, weight_decay=0.1), 4),
        lambda: optax.MultiSteps(
            optax.adamw(0.01, weight_decay=0.1), 4
        ).gradient_transformation(),
    ),
    "freeze_adam": (
        lambda: eo.freeze(eo.adam(0.01), lambda name, x: x.ndim > 1),
        lambda: _ofreeze(optax.adam(0.01)),
    ),
    # Interop: optax pieces in entrenar's chain, entrenar pieces in optax's chain.
    "optax_in_entrenar_chain": (
        lambda: eo.chain(optax.scale_by_adam(), eo.scale_by_learning_rate(0.01)),
        lambda: optax.adam(0.01),
    ),
    "entrenar_in_optax_chain": (
        lambda: optax.chain(eo.scale_by_adam(), optax.scale(-0.01)),
        lambda: optax.adam(0.01),
    ),
    "entrenar_adamw_in_optax_multisteps": (
        lambda: optax.MultiSteps(
            eo.adamw(0.01, weight_decay=0.1), 2
        ).gradient_transformation(),
        lambda: optax.MultiSteps(
            optax.adamw(0.01, weight_decay=0.1), 2
        ).gradient_transformation(),
    ),
}


# Cases whose entrenar side contains optax pieces; optax itself needs standard dtype
# promotion (its bias correction computes ``b1 ** int32_count``).
OPTAX_INSIDE = {
    "optax_in_entrenar_chain",
    "entrenar_in_optax_chain",
    "entrenar_adamw_in_optax_multisteps",
}


def _promotion(name: str, side: str) -> str:
    return "standard" if side == "optax" or name in OPTAX_INSIDE else "strict"


def _step(tx, grad_fn, one_pass: bool = False):
    def step(params, state, t):
        grads = grad_fn(params, t)
        if one_pass:  # tx.apply where it has one (AdamW's native kernel)
            return eo.apply_gradients(tx, grads, state, params)
        updates, state = tx.update(grads, state, params)
        return eo.apply_updates(params, updates), state

    return step


def _run(tx, steps: int, seed: int = 0, one_pass: bool = False):
    params0, grad_fn = problem(seed)
    step = _step(tx, grad_fn, one_pass)

    @jax.jit
    def run(params):
        def body(carry, t):
            return step(*carry, t), None

        (params, _), _ = jax.lax.scan(
            body, (params, tx.init(params)), jnp.arange(steps)
        )
        return params

    return run(params0)


def _assert_rel_close(actual, expected, rtol: float) -> None:
    """Leaf-wise ``max|a - e| <= rtol · max(max|e|, 1)`` (relative to the leaf size)."""
    for (path, a), e in zip(
        jax.tree_util.tree_flatten_with_path(actual)[0],
        jax.tree_util.tree_leaves(expected),
    ):
        a, e = np.asarray(a, np.float64), np.asarray(e, np.float64)
        assert a.shape == e.shape
        err = np.max(np.abs(a - e)) / max(np.max(np.abs(e)), 1.0)
        assert err <= rtol, f"{jax.tree_util.keystr(path)}: relative error {err:.2e}"


@pytest.mark.parametrize("name", sorted(CASES))
def test_matches_optax_over_1000_steps(name):
    ours, theirs = CASES[name]
    with jax.numpy_dtype_promotion(_promotion(name, "entrenar")):
        actual = _run(ours(), STEPS)
    with jax.numpy_dtype_promotion("standard"):
        expected = _run(theirs(), STEPS)
    jax.tree_util.tree_map(lambda x: np.testing.assert_(np.all(np.isfinite(x))), actual)
    _assert_rel_close(actual, expected, 1e-5)


@pytest.mark.parametrize("name", ["adamw_warmup_cosine", "adamw_mask"])
def test_one_pass_apply_matches_optax_over_1000_steps(name):
    """`apply_gradients` (AdamW's fused ``apply``) keeps the optax parity."""
    ours, theirs = CASES[name]
    assert ours().apply is not None
    with jax.numpy_dtype_promotion("strict"):
        actual = _run(ours(), STEPS, one_pass=True)
    with jax.numpy_dtype_promotion("standard"):
        expected = _run(theirs(), STEPS)
    _assert_rel_close(actual, expected, 1e-5)


@pytest.mark.parametrize("name", sorted(CASES))
def test_same_with_and_without_jit_and_no_recompile(name):
    with jax.numpy_dtype_promotion(_promotion(name, "entrenar")):
        _check_jit_and_recompile(CASES[name][0]())


def _check_jit_and_recompile(tx):
    params0, grad_fn = problem(1)
    step = _step(tx, grad_fn)
    traces = []

    def counted(params, state, t):
        traces.append(1)
        return step(params, state, t)

    jitted = jax.jit(counted)
    p_eager, s_eager = params0, tx.init(params0)
    p_jit, s_jit = params0, tx.init(params0)
    for t in range(3):
        p_eager, s_eager = step(p_eager, s_eager, jnp.int32(t))
        p_jit, s_jit = jitted(p_jit, s_jit, jnp.int32(t))
    assert len(traces) == 1, "step 2 re-traced: the state's types changed"
    assert jitted._cache_size() == 1
    _assert_rel_close(p_jit, p_eager, 1e-6)
    _assert_rel_close(s_jit, s_eager, 1e-6)


def test_state_types_are_named_tuples_and_match_optax_layout():
    params0, _ = problem()
    s = eo.adamw(0.01).init(params0)
    adam_state, decay_state, lr_state = s
    assert type(adam_state).__name__ == "ScaleByAdamState"
    assert type(decay_state).__name__ == "EmptyState"
    assert type(lr_state).__name__ == "LearningRateState"
    o = optax.adamw(0.01).init(params0)[0]
    assert jax.tree_util.tree_structure(adam_state.mu) == jax.tree_util.tree_structure(
        o.mu
    )
