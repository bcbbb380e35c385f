"""make_train_step: accumulation equivalence, trainable halves, guard, donation."""

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from entrenar import lora
from entrenar.errors import ConfigError, ShapeError
from entrenar.nn import MLP, LlamaConfig
from entrenar.nn.losses import causal_lm_loss
from entrenar.optim import MaskedNode, adamw, sgd
from entrenar.train import (
    TrainState,
    make_eval_step,
    make_train_step,
    supervised_loss_fn,
)
from entrenar.tree import assert_trees_allclose

TINY = LlamaConfig(
    vocab_size=32, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2,
    num_kv_heads=1, max_position_embeddings=16,
)  # fmt: skip


def lm_batch(b: int, t: int, seed: int) -> dict[str, np.ndarray]:
    """Rows with very different numbers of counted targets (padding, -100 labels)."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, TINY.vocab_size, (b, t)).astype(np.int32)
    lengths = rng.integers(2, t + 1, b)
    mask = np.arange(t)[None, :] < lengths[:, None]  # (B, T), padding on the right
    labels = np.where(mask, ids, -100).astype(np.int32)
    labels[::3, : t // 2] = -100  # prompts: no loss on their first half
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


def bigram_loss(p, b, *, key):
    """A token-level mean (the mean over counted targets) that reports its count."""
    logits = p["emb"][b["input_ids"]] @ p["out"]  # (B, T, V)
    total = causal_lm_loss(logits, b["labels"], "sum", loss_mask=b["attention_mask"])
    counted = (b["labels"][:, 1:] != -100) & b["attention_mask"][:, 1:]
    n = jnp.sum(counted).astype(jnp.float32)
    return total / jnp.maximum(n, 1.0), {"loss_weight": n}


def leaves(tree):
    return [np.asarray(x) for x in jax.tree_util.tree_leaves(tree)]


def test_grad_accum_equals_one_big_batch_token_weighted():
    k0, k1 = jax.random.split(jax.random.key(0))
    params = {
        "emb": jax.random.normal(k0, (32, 8)),
        "out": jax.random.normal(k1, (8, 32)),
    }
    loss_fn = bigram_loss
    batch = lm_batch(8, 12, seed=1)
    results = {}
    for k in (1, 4):
        state = TrainState.create(params, sgd(1.0), key=jax.random.key(2))
        step = make_train_step(loss_fn, sgd(1.0), grad_accum=k)
        state, m = step(state, batch)
        results[k] = (state, m)
    (s1, m1), (s4, m4) = results[1], results[4]
    assert_trees_allclose(s4.trainable, s1.trainable, atol=1e-6, rtol=0)
    # a few float32 ulps: the sums are grouped differently (jax 0.12.1's XLA:CPU
    # gave 1.4e-6 on a loss of 7.11, 3 ulps; 0.10.2 agreed to 1e-6 absolute)
    for name in ("loss", "grad_norm"):
        np.testing.assert_allclose(float(m4[name]), float(m1[name]), rtol=1e-6)
    # the test can fail: an unweighted mean of the 4 micro-batch means differs
    per_micro = [
        float(jax.jit(loss_fn, static_argnames="key")(
            params, {k: v[i * 2 : i * 2 + 2] for k, v in batch.items()}, key=None)[0])
        for i in range(4)
    ]  # fmt: skip
    assert len({float(np.sum(b)) for b in np.split(batch["labels"] != -100, 4)}) > 1
    assert abs(np.mean(per_micro) - float(m1["loss"])) > 1e-3


def test_the_step_accumulates_through_optim_microbatched_value_and_grad(monkeypatch):
    """One micro-batching implementation: the step has none of its own."""
    from entrenar.optim import microbatched_value_and_grad
    from entrenar.train import step as step_mod

    seen = []

    def spy(fn, k, **kw):
        seen.append(k)
        return microbatched_value_and_grad(fn, k, **kw)

    monkeypatch.setattr(step_mod, "microbatched_value_and_grad", spy)
    state = TrainState.create(jnp.ones(2), sgd(0.1), key=jax.random.key(0))
    step = make_train_step(lambda p, b, *, key: jnp.sum(p * b["x"]), sgd(0.1),
                           grad_accum=2)  # fmt: skip
    step(state, {"x": jnp.ones((4, 2))})
    assert seen == [2]


def test_grad_accum_mean_loss_without_weight_and_adamw_state():
    """Example-mean losses: equal micro-batches average; the whole state matches."""

    def loss_fn(p, b, *, key):
        return jnp.mean((b["x"] @ p["w"] - b["y"]) ** 2)

    rng = np.random.default_rng(0)
    batch = {"x": rng.normal(size=(12, 3)).astype(np.float32),
             "y": rng.normal(size=(12, 2)).astype(np.float32)}  # fmt: skip
    p = {"w": jnp.asarray(rng.normal(size=(3, 2)), jnp.float32)}
    out = []
    for k in (1, 3):
        tx = adamw(0.1)
        state = TrainState.create(p, tx, key=jax.random.key(0))
        step = make_train_step(loss_fn, tx, grad_accum=k)
        for _ in range(3):
            state, m = step(state, batch)
        out.append((state, m))
    assert_trees_allclose(out[1][0].trainable, out[0][0].trainable, atol=1e-6, rtol=0)
    assert_trees_allclose(out[1][0].opt_state, out[0][0].opt_state, atol=1e-6, rtol=0)
    assert abs(float(out[1][1]["loss"]) - float(out[0][1]["loss"])) < 1e-6


def test_make_train_step_takes_no_dead_trainable_argument():
    """The partition lives in the state (`TrainState.create`), not in the step."""
    assert "trainable" not in inspect.signature(make_train_step).parameters


def test_grad_accum_needs_divisible_batch():
    step = make_train_step(lambda p, b, *, key: jnp.sum(p * b["x"]), sgd(0.1),
                           grad_accum=3)  # fmt: skip
    state = TrainState.create(jnp.float32(1.0), sgd(0.1), key=jax.random.key(0))
    with pytest.raises(ShapeError, match="multiple of 3"):
        step(state, {"x": jnp.ones(4)})
    with pytest.raises(ConfigError):
        make_train_step(lambda p, b, *, key: p, sgd(0.1), grad_accum=0)


def test_lora_trainable_has_no_gradient_or_state_for_frozen_weights():
    model = MLP((4, 8, 3))
    params = lora.apply(model.init(jax.random.key(0)),
                        lora.LoRAConfig(rank=2, alpha=4, targets="layers.0"),
                        key=jax.random.key(1))  # fmt: skip
    params = lora.combine(  # B starts at zero: make it non-zero so A gets a gradient
        jax.tree_util.tree_map(lambda x: x + 0.1, lora.split(params)[0]),
        lora.split(params)[1],
    )
    loss_fn = supervised_loss_fn(model, "mse")
    adam_state = TrainState.create(params, adamw(1e-2), key=jax.random.key(2),
                                   trainable="lora")  # fmt: skip
    adapters = leaves(adam_state.trainable)
    assert [a.shape for a in adapters] == [(2, 4), (8, 2)]  # A, B only
    n_opt = len(jax.tree_util.tree_leaves(adam_state.opt_state))
    assert n_opt == 2 * len(adapters) + 2  # mu, nu per adapter; count; lr
    lr = 0.5
    state = TrainState.create(params, sgd(lr), key=jax.random.key(2), trainable="lora")
    frozen_before = leaves(state.frozen)
    step = make_train_step(loss_fn, sgd(lr))
    rng = np.random.default_rng(0)
    batch = {"x": rng.normal(size=(6, 4)).astype(np.float32),
             "y": rng.normal(size=(6, 3)).astype(np.float32)}  # fmt: skip
    state, _ = step(state, batch)
    # frozen weights untouched; the adapters' update is -lr times the gradient the
    # whole tree has at them (so nothing else was differentiated into it)
    for a, b in zip(frozen_before, leaves(state.frozen)):
        np.testing.assert_array_equal(a, b)
    full = jax.grad(lambda p: loss_fn(p, batch, key=None)[0])(params)
    g_full = full["layers"][0]["weight"]
    assert isinstance(g_full, lora.LoRAWeight)
    for new, old, g in zip(leaves(state.trainable), adapters, [g_full.a, g_full.b]):
        assert np.abs(np.asarray(g)).max() > 1e-4
        np.testing.assert_allclose((new - old) / -lr, np.asarray(g), atol=1e-6)


def test_mask_trainable_freezes_leaves():
    p = {"w": jnp.ones((2, 2)), "b": jnp.ones(2)}
    tx = adamw(0.1)
    state = TrainState.create(p, tx, key=jax.random.key(0), trainable={"w": True,
                              "b": False})  # fmt: skip
    assert state.trainable["b"] is None and state.frozen["w"] is None
    assert isinstance(state.opt_state[0].mu, dict) or True
    assert not any(isinstance(x, MaskedNode) for x in leaves(state.opt_state))
    step = make_train_step(lambda q, b, *, key: jnp.sum(q["w"] ** 2 + q["b"] ** 2), tx)
    state, _ = step(state, {})
    np.testing.assert_array_equal(np.asarray(state.params["b"]), np.ones(2))
    assert float(state.params["w"][0, 0]) < 1.0
    with pytest.raises(ConfigError, match="selects no parameter"):
        TrainState.create(p, tx, key=jax.random.key(0), trainable=lambda n, x: False)
    with pytest.raises(ConfigError, match="no LoRA adapter"):
        TrainState.create(p, tx, key=jax.random.key(0), trainable="lora")


def test_skip_nonfinite_keeps_state_and_flags_step():
    def loss_fn(p, b, *, key):
        return jnp.sum(p * b["x"])

    tx = adamw(0.1)
    state = TrainState.create(jnp.ones(3), tx, key=jax.random.key(0))
    step = make_train_step(loss_fn, tx, skip_nonfinite=True)
    state, m = step(state, {"x": jnp.ones(3)})
    before = leaves((state.trainable, state.opt_state))
    state, m = step(state, {"x": jnp.array([1.0, jnp.nan, 1.0])})
    assert not bool(m["finite"]) and int(state.step) == 2
    for a, b in zip(before, leaves((state.trainable, state.opt_state))):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("kernels", ["auto", "jax"])
def test_skipping_nonfinite_steps_costs_no_copy_of_the_state(kernels):
    """The step holds one trainable-sized temporary (the gradient), skip or not.

    Before: ``where(finite, new, old)`` kept the old θ, m and v alive beside the
    new ones; XLA copied all three before the native AdamW kernel's in-place
    update (4 temporaries of the parameters' size, 2 on the pure-JAX path).
    """
    from entrenar import native

    n = 512

    def loss_fn(p, b, *, key):
        return jnp.sum(jnp.tanh(p["w"] @ b["x"]))

    tx = adamw(1e-3)
    p = {"w": jax.ShapeDtypeStruct((n, n), jnp.float32)}
    opt = jax.eval_shape(tx.init, p)
    batch = {"x": jax.ShapeDtypeStruct((n, 4), jnp.float32)}
    args = (p, opt, None, jnp.int32(0), jax.random.key(0), batch)
    temps = []
    with native.policy(kernels):
        for skip in (False, True):
            step = make_train_step(loss_fn, tx, skip_nonfinite=skip)
            m = step.jitted.lower(*args).compile().memory_analysis()
            temps.append(m.temp_size_in_bytes / (n * n * 4))
    assert temps[1] < temps[0] + 0.5, temps


def test_donation_leaves_callers_params_usable_and_step_does_not_recompile():
    p = {"w": jnp.ones(3)}
    tx = sgd(0.1)
    state = TrainState.create(p, tx, key=jax.random.key(0))
    step = make_train_step(lambda q, b, *, key: jnp.sum(q["w"] * b["x"]), tx)
    for _ in range(3):
        state, _ = step(state, {"x": jnp.ones(3)})
    assert float(p["w"][0]) == 1.0  # the caller's array is not donated
    assert step.jitted._cache_size() == 1
    ev = make_eval_step(lambda q, b, *, key: jnp.sum(q["w"] * b["x"]))
    assert abs(float(ev(state, {"x": jnp.ones(3)})["loss"]) - 3 * 0.7) < 1e-5


def test_step_key_is_fold_in_of_root_and_step():
    seen = []

    def loss_fn(p, b, *, key):
        return jnp.sum(p) * 0 + jax.random.uniform(key)

    state = TrainState.create(jnp.ones(1), sgd(0.1), key=jax.random.key(7))
    step = make_train_step(loss_fn, sgd(0.1))
    for _ in range(2):
        state, m = step(state, {})
        seen.append(float(m["loss"]))
    want = [float(jax.random.uniform(jax.random.fold_in(jax.random.key(7), t)))
            for t in range(2)]  # fmt: skip
    assert seen == want
