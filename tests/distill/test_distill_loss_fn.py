"""make_distill_loss_fn: a frozen teacher and the student in one jitted step."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from entrenar import lora, optim, quant
from entrenar.distill import (
    ProgressiveDistiller,
    distillation_loss,
    make_distill_loss_fn,
)
from entrenar.errors import ConfigError
from entrenar.nn import MLP, LlamaConfig

TEACHER, STUDENT = MLP((64, 64, 10)), MLP((64, 16, 10))


@pytest.fixture(scope="module")
def inits():
    """Each model's ``init``, once per module (arrays are immutable: shared safely).

    Every weight shape compiles its own ``random.normal``, about half a second apiece
    on a cold compilation cache. ``teacher``, ``student``: `TEACHER`, `STUDENT` with
    keys 0 and 1; ``lm_t``, ``lm_s``: `LM_T`, `LM_S` with keys 0 and 1.
    """
    models = {"teacher": (TEACHER, 0), "student": (STUDENT, 1),
              "lm_t": (LM_T, 0), "lm_s": (LM_S, 1)}  # fmt: skip
    return {k: m.init(jax.random.key(seed)) for k, (m, seed) in models.items()}


def _mlp_setup(inits, **kw):
    tp = inits["teacher"]
    loss_fn = make_distill_loss_fn(
        STUDENT, TEACHER, tp, temperature=3.0, alpha=0.7, **kw
    )
    params = loss_fn.init(inits["student"], key=jax.random.key(2))
    rng = np.random.default_rng(0)
    batch = {
        "x": rng.normal(size=(8, 64)).astype(np.float32),
        "y": rng.integers(0, 10, size=8).astype(np.int32),
    }
    return loss_fn, params, batch


def test_classification_loss_equals_distillation_loss_of_the_two_models(inits):
    loss_fn, params, batch = _mlp_setup(inits)
    loss, metrics = jax.jit(loss_fn)(params, batch)

    @jax.jit
    def reference(params, batch):
        s = STUDENT.apply(params["student"], batch["x"])
        t = TEACHER.apply(params["teacher"], batch["x"])
        return distillation_loss(s, t, batch["y"], 3.0, 0.7)

    np.testing.assert_allclose(float(loss), float(reference(params, batch)), rtol=1e-6)
    assert float(metrics["loss"]) == float(loss)
    np.testing.assert_allclose(
        float(loss), 0.7 * 9 * float(metrics["kl"]) + 0.3 * float(metrics["ce"]), 1e-6
    )


def test_teacher_is_frozen_and_the_step_trains_the_student(inits):
    loss_fn, params, batch = _mlp_setup(inits)
    grads = jax.jit(jax.grad(lambda p: loss_fn(p, batch)[0]))(params)
    assert all(not np.any(np.asarray(g)) for g in jax.tree.leaves(grads["teacher"]))
    assert any(np.any(np.asarray(g)) for g in jax.tree.leaves(grads["student"]))

    tx = optim.freeze(optim.adam(1e-2), loss_fn.trainable)
    state = tx.init(params)

    @jax.jit
    def step(params, state, batch, key):
        (loss, _), g = jax.value_and_grad(loss_fn, has_aux=True)(params, batch, key=key)
        updates, state = tx.update(g, state, params)
        return optim.apply_updates(params, updates), state, loss

    teacher_before = params["teacher"]
    losses = []
    for i in range(30):
        params, state, loss = step(params, state, batch, jax.random.key(i))
        losses.append(float(loss))
    assert losses[-1] < 0.5 * losses[0]
    assert step._cache_size() == 1
    for a, b in zip(
        jax.tree.leaves(teacher_before), jax.tree.leaves(params["teacher"])
    ):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    trainable, frozen = loss_fn.split(params)
    assert sorted(trainable) == ["student"] and sorted(frozen) == ["teacher"]
    assert loss_fn.combine(trainable, frozen).keys() == params.keys()


@pytest.mark.parametrize("kind", ["nf4", "lora"])
def test_quantized_or_lora_teacher_runs_in_the_jitted_step(kind, inits):
    tp = inits["teacher"]
    if kind == "nf4":
        frozen_tp = quant.quantize_params(tp, "nf4")
        dense_tp = quant.dequantize_params(frozen_tp)
        assert any(
            quant.is_quantized(x)
            for x in jax.tree.leaves(frozen_tp, is_leaf=quant.is_quantized)
        )
    else:
        cfg = lora.LoRAConfig(rank=2, alpha=4.0, targets=r"layers\.\d+")
        adapted = lora.apply(tp, cfg, key=jax.random.key(5))
        frozen_tp, dense_tp = {"layers": []}, {"layers": []}
        for k, layer in enumerate(adapted["layers"]):
            w = layer["weight"]
            assert isinstance(w, lora.LoRAWeight)
            w = w.replace(b=jax.random.normal(jax.random.key(k), w.b.shape))
            dense = w.base + w.scale * (w.b @ w.a)  # W + s B A
            frozen_tp["layers"].append({**layer, "weight": w})
            dense_tp["layers"].append({**layer, "weight": dense})
    sp = inits["student"]
    batch = _mlp_setup(inits)[2]
    got = make_distill_loss_fn(STUDENT, TEACHER, frozen_tp)
    want = make_distill_loss_fn(STUDENT, TEACHER, dense_tp)
    k = jax.random.key(3)
    loss_a = jax.jit(got)(got.init(sp, key=k), batch)[0]
    loss_b = want(want.init(sp, key=k), batch)[0]
    np.testing.assert_allclose(float(loss_a), float(loss_b), rtol=1e-5)


def test_ensemble_of_identical_teachers_equals_one_teacher(inits):
    tp = inits["teacher"]
    sp = inits["student"]
    batch = _mlp_setup(inits)[2]
    one = make_distill_loss_fn(STUDENT, TEACHER, tp, temperature=2.0)
    ens = make_distill_loss_fn(STUDENT, [TEACHER] * 3, [tp] * 3, temperature=2.0)
    k = jax.random.key(0)
    a = one(one.init(sp, key=k), batch)[0]
    b = ens(ens.init(sp, key=k), batch)[0]
    np.testing.assert_allclose(float(a), float(b), rtol=1e-5)


LM_T = LlamaConfig(
    vocab_size=50,
    hidden_size=32,
    intermediate_size=64,
    num_layers=4,
    num_heads=4,
    num_kv_heads=2,
    max_position_embeddings=32,
)
LM_S = LlamaConfig(
    vocab_size=50,
    hidden_size=16,
    intermediate_size=32,
    num_layers=2,
    num_heads=2,
    num_kv_heads=1,
    max_position_embeddings=32,
)


def _lm_batch():
    rng = np.random.default_rng(1)
    ids = rng.integers(0, 50, size=(3, 9)).astype(np.int32)
    mask = np.ones((3, 9), bool)
    mask[2, 6:] = False  # right padding
    labels = np.where(mask, ids, -100).astype(np.int32)
    labels[0, :3] = -100  # a prompt
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


def test_causal_lm_shifts_and_masks(inits):
    tp, sp = inits["lm_t"], inits["lm_s"]
    loss_fn = make_distill_loss_fn(LM_S, LM_T, tp, temperature=2.0, alpha=0.5)
    params = loss_fn.init(sp, key=jax.random.key(2))
    batch = _lm_batch()
    f = jax.jit(loss_fn)
    loss, _ = f(params, batch)

    @jax.jit
    def reference(batch):
        mask = batch["attention_mask"]
        s = LM_S.apply(sp, batch["input_ids"], mask=mask)
        t = LM_T.apply(tp, batch["input_ids"], mask=mask)
        return distillation_loss(
            s[:, :-1], t[:, :-1], batch["labels"][:, 1:], 2.0, 0.5, where=mask[:, 1:]
        )

    np.testing.assert_allclose(float(loss), float(reference(batch)), rtol=1e-5)
    # changing a masked-out label or a padded token's id changes nothing
    other = dict(batch, input_ids=batch["input_ids"].copy())
    other["input_ids"][2, 7] = (other["input_ids"][2, 7] + 1) % 50
    np.testing.assert_allclose(float(f(params, other)[0]), float(loss), rtol=1e-6)


def test_packed_rows_without_labels_skip_targets_across_documents(inits):
    # labels default to the input ids; a packed row's position before a new
    # document cannot see it, so (as with the data pipeline's -100 there) that
    # target is skipped: the loss and its weight equal those of explicit labels
    tp, sp = inits["lm_t"], inits["lm_s"]
    loss_fn = make_distill_loss_fn(LM_S, LM_T, tp, temperature=2.0, alpha=0.5)
    params = loss_fn.init(sp, key=jax.random.key(2))
    ids = np.random.default_rng(3).integers(0, 50, size=(2, 9)).astype(np.int32)
    seg = np.array([[1, 1, 1, 1, 2, 2, 2, 2, 2], [1, 1, 2, 2, 2, 3, 3, 3, 3]])
    pos = np.array([[0, 1, 2, 3, 0, 1, 2, 3, 4], [0, 1, 0, 1, 2, 0, 1, 2, 3]])
    labels = np.where(pos == 0, -100, ids).astype(np.int32)  # the pipeline's labels
    batch = {"input_ids": ids, "segment_ids": seg.astype(np.int32),
             "positions": pos.astype(np.int32)}  # fmt: skip
    f = jax.jit(loss_fn)
    got, m = f(params, batch)
    want, mw = f(params, dict(batch, labels=labels))
    assert float(m["loss_weight"]) == float(mw["loss_weight"]) == 13
    np.testing.assert_allclose(float(got), float(want), rtol=1e-6)


def test_progressive_llama_with_projection_and_schedule(inits):
    tp, sp = inits["lm_t"], inits["lm_s"]
    pd = {"student_layers": [1, 2], "teacher_layers": [2, 4], "stage_steps": 5}
    loss_fn = make_distill_loss_fn(LM_S, LM_T, tp, progressive=pd)
    assert isinstance(loss_fn.progressive, ProgressiveDistiller)
    params = loss_fn.init(sp, key=jax.random.key(2))
    assert {k: v["weight"].shape for k, v in params["projection"].items()} == {
        "0": (32, 16),
        "1": (32, 16),
    }
    assert loss_fn.trainable("projection.0.weight", None)
    batch = _lm_batch()
    f = jax.jit(loss_fn)
    _, m0 = f(params, batch, step=0)
    _, m9 = f(params, batch, step=9)
    assert f._cache_size() == 1  # the step is traced, not static

    @jax.jit
    def per_pair(batch):
        mask = batch["attention_mask"]
        _, hs = LM_S.apply(sp, batch["input_ids"], mask=mask, return_hidden=True)
        _, ht = LM_T.apply(tp, batch["input_ids"], mask=mask, return_hidden=True)
        return loss_fn.progressive.pair_losses(hs, ht, params["projection"], where=mask)

    per = per_pair(batch)
    np.testing.assert_allclose(float(m0["hidden"]), float(per[0]), rtol=1e-5)
    np.testing.assert_allclose(float(m9["hidden"]), float(per.mean()), rtol=1e-5)
    # the step may also come in the batch; gradients reach the projections
    g = jax.jit(jax.grad(lambda p: f(p, {**batch, "step": jnp.int32(9)})[0]))(params)
    assert np.any(np.asarray(g["projection"]["1"]["weight"]))
    with pytest.raises(ConfigError, match="training step"):
        loss_fn(params, batch)


def test_progressive_stages_follow_the_trainers_step(inits):
    from entrenar.train import TrainConfig, Trainer

    tp, sp = inits["lm_t"], inits["lm_s"]
    pd = {"student_layers": [1, 2], "teacher_layers": [2, 4], "stage_steps": 2,
          "cumulative": False}  # fmt: skip
    loss_fn = make_distill_loss_fn(LM_S, LM_T, tp, progressive=pd)
    params = loss_fn.init(sp, key=jax.random.key(2))
    batch = _lm_batch()
    f = jax.jit(loss_fn)  # one compile for both steps (the step is traced)
    per = [float(f(params, batch, step=n)[1]["hidden"]) for n in (0, 2)]
    assert abs(per[0] - per[1]) > 0.1 * per[0]  # the two stages differ
    cfg = TrainConfig(max_steps=4, batch_size=3, log_every=1, shuffle=False,
                      progress=False)  # fmt: skip
    trainer = Trainer(loss_fn, params, optim.sgd(0.0), cfg, trainable=loss_fn.trainable)
    result = trainer.fit(batch, batch)  # lr 0: the same params at every step
    hidden = [h["hidden"] for h in result.history]  # steps 0, 1 | 2, 3
    np.testing.assert_allclose(hidden, [per[0], per[0], per[1], per[1]], rtol=1e-5)
    evaluated = trainer.evaluate(batch)["eval_hidden"]  # at the state's step, 4
    np.testing.assert_allclose(evaluated, per[1], rtol=1e-5)


def test_errors(inits):
    tp = inits["teacher"]
    loss_fn, params, _ = _mlp_setup(inits)
    with pytest.raises(ConfigError, match="'x' and 'y'"):
        loss_fn(params, {"inputs": np.zeros((1, 64))})
    with pytest.raises(ConfigError, match="list of as many"):
        make_distill_loss_fn(STUDENT, [TEACHER, TEACHER], tp)
    with pytest.raises(ConfigError, match="ensemble"):
        make_distill_loss_fn(
            STUDENT,
            [TEACHER, TEACHER],
            [tp, tp],
            progressive=ProgressiveDistiller((1,), (1,)),
        )
    with pytest.raises(ConfigError, match="alpha"):
        make_distill_loss_fn(STUDENT, TEACHER, tp, alpha=-0.1)


def test_runs_on_the_trainer_with_the_teacher_frozen(inits):
    from entrenar.train import TrainConfig, Trainer

    loss_fn, params, _ = _mlp_setup(inits)
    rng = np.random.default_rng(3)
    data = {
        "x": rng.normal(size=(64, 64)).astype(np.float32),
        "y": rng.integers(0, 10, size=64).astype(np.int32),
    }
    cfg = TrainConfig(epochs=10, batch_size=16, progress=False, log_every=100)
    trainer = Trainer(
        loss_fn, params, optim.adam(1e-2), cfg, trainable=loss_fn.trainable
    )
    before = trainer.evaluate(data)
    result = trainer.fit(data)
    after = trainer.evaluate(data)
    assert result.steps == 40
    assert after["eval_loss"] < 0.5 * before["eval_loss"]
    assert after["eval_ce"] < before["eval_ce"]
    for a, b in zip(
        jax.tree.leaves(params["teacher"]), jax.tree.leaves(result.params["teacher"])
    ):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # the frozen half holds the teacher; the optimizer keeps no state for it
    assert jax.tree.leaves(result.state.frozen["student"]) == []


def test_progressive_grad_accum_equals_one_batch(inits):
    """Micro-batches k × b give the loss, metrics and gradient of one batch of k·b.

    The hidden term is a mean over attention-masked positions, the logit terms over
    labelled targets: each is summed over the micro-batches and divided by its own
    count over the whole batch. Before, the micro-batches were weighted by the
    targets' count only: the hidden metric was 3% and a projection's gradient 40%
    off (k = 3).
    """
    from entrenar.train import TrainState, make_train_step

    tp, sp = inits["lm_t"], inits["lm_s"]
    pd = {"student_layers": [1, 2], "teacher_layers": [2, 4], "weight": 5.0}
    loss_fn = make_distill_loss_fn(LM_S, LM_T, tp, progressive=pd)
    params = loss_fn.init(sp, key=jax.random.key(2))
    rng = np.random.default_rng(5)
    ids = rng.integers(0, 50, size=(6, 9)).astype(np.int32)
    mask = np.ones((6, 9), bool)
    mask[1, 4:] = mask[4, 2:] = mask[5, 7:] = False  # right padding
    labels = np.where(mask, ids, -100).astype(np.int32)
    labels[0, :6] = labels[3, :5] = -100  # prompts
    labels[2, :] = -100  # a row with no target: its hidden states still count
    batch = {"input_ids": ids, "labels": labels, "attention_mask": mask}
    out = {}
    for k in (1, 3):
        state = TrainState.create(params, optim.sgd(1.0), key=jax.random.key(0),
                                  trainable=loss_fn.trainable)  # fmt: skip
        before = jax.tree.map(jnp.array, state.trainable)  # the step donates it
        step = make_train_step(loss_fn, optim.sgd(1.0), grad_accum=k)
        new, metrics = step(state, batch)
        update = jax.tree.map(jnp.subtract, before, new.trainable)  # = gradient
        out[k] = (metrics, update)
    (m1, g1), (m3, g3) = out[1], out[3]
    for name in ("loss", "kl", "ce", "hidden"):
        np.testing.assert_allclose(float(m3[name]), float(m1[name]), rtol=2e-6)
    for a, b in zip(jax.tree.leaves(g3), jax.tree.leaves(g1)):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-7)
