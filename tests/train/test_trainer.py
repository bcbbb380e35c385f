"""Trainer: early stopping, the non-finite guard, outputs, callbacks, resume."""

import dataclasses
import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scripted_eval import Scripted

from entrenar.errors import ConfigError, FormatError, NonFiniteError
from entrenar.nn import MLP
from entrenar.optim import adamw, sgd
from entrenar.train import (
    Callback,
    Checkpointer,
    TrainConfig,
    Trainer,
    plot,
    read_metrics,
)

RNG = np.random.default_rng(0)
X = RNG.normal(size=(16, 3)).astype(np.float32)
Y = (X @ np.array([[1.0], [-2.0], [0.5]], np.float32) + 0.3).astype(np.float32)
DATA = {"x": X, "y": Y}


def linear_loss(p, b, *, key):
    if "v" in b:  # scripted evaluation batches carry their own loss
        return jnp.mean(b["v"]) + 0.0 * jnp.sum(p["w"])
    return jnp.mean((b["x"] @ p["w"] + p["b"] - b["y"]) ** 2)


PARAMS = {"w": jnp.zeros((3, 1)), "b": jnp.zeros(1)}


@pytest.mark.parametrize(
    ("min_delta", "stop_epoch", "best"),
    [(0.05, 4, 0.8), (0.0, 5, 0.79)],
)
def test_early_stopping_at_the_right_epoch(min_delta, stop_epoch, best):
    # eval losses per epoch; patience 2: stop after two evaluations without
    # improving on best - min_delta (Keras' EarlyStopping rule)
    script = [1.0, 0.8, 0.79, 0.85, 0.9, 0.7, 0.6]
    cfg = TrainConfig(epochs=10, batch_size=4, patience=2, min_delta=min_delta,
                      progress=False)  # fmt: skip
    r = Trainer(linear_loss, PARAMS, sgd(0.01), cfg).fit(DATA, Scripted(script))
    assert r.stopped_early
    assert [e["epoch"] for e in r.eval_history] == list(range(1, stop_epoch + 1))
    assert r.steps == stop_epoch * 4  # 16 examples / batch 4
    assert r.best_eval_loss == pytest.approx(best)
    assert r.best_step == 4 * script.index(best) + 4


def test_no_early_stopping_without_patience():
    cfg = TrainConfig(epochs=3, batch_size=4, progress=False)
    r = Trainer(linear_loss, PARAMS, sgd(0.01), cfg).fit(DATA, Scripted([1, 2, 3, 4]))
    assert not r.stopped_early and r.steps == 12 and len(r.eval_history) == 3


def nan_at(step_to_break):
    """A loss that is NaN on the batch seen at optimizer step ``step_to_break``."""

    def loss_fn(p, b, *, key):
        return jnp.mean((b["x"] @ p["w"] + p["b"] - b["y"]) ** 2) + jnp.sum(b["bad"])

    bad = np.zeros((16, 1), np.float32)
    bad[(step_to_break - 1) * 4] = np.nan  # no shuffling: step s sees rows 4(s-1)..
    return loss_fn, {**DATA, "bad": bad}


def test_nonfinite_stops_naming_the_step_and_keeps_last_checkpoint(tmp_path):
    loss_fn, data = nan_at(3)
    cfg = TrainConfig(epochs=2, batch_size=4, shuffle=False, checkpoint_every=1,
                      log_every=1, output_dir=str(tmp_path),
                      progress=False)  # fmt: skip
    t = Trainer(loss_fn, PARAMS, sgd(0.1), cfg)
    with pytest.raises(NonFiniteError, match=r"step 3: the loss is nan") as e:
        t.fit(data)
    assert "last checkpoint: step 2" in str(e.value)
    ck = Checkpointer(tmp_path / "checkpoints")
    assert ck.steps() == [1, 2]
    state, meta = ck.restore(Trainer(loss_fn, PARAMS, sgd(0.1), cfg).state)
    assert int(state.step) == 2 and meta["step"] == 2
    assert all(np.isfinite(x).all() for x in jax.tree_util.tree_leaves(state.trainable))


def test_nonfinite_skip_drops_the_update_and_counts_it():
    loss_fn, data = nan_at(2)
    cfg = TrainConfig(epochs=1, batch_size=4, shuffle=False, log_every=4,
                      nonfinite="skip", progress=False)  # fmt: skip
    t = Trainer(loss_fn, PARAMS, sgd(0.1), cfg)
    r = t.fit(data)
    assert r.steps == 4 and r.history[-1]["skipped"] == 1
    assert np.isfinite(r.history[-1]["loss"])
    # the same run without the bad batch's step: steps 1, 3, 4 only
    ref = Trainer(linear_loss, PARAMS, sgd(0.1), cfg)
    for i in (0, 2, 3):
        ref.train_step({k: v[4 * i : 4 * i + 4] for k, v in DATA.items()})
    np.testing.assert_array_equal(np.asarray(r.params["w"]), ref.state.params["w"])


def test_config_validation_names_the_field():
    for bad, field in [({"epochs": 0}, "epochs"), ({"grad_clip": -1.0}, "grad_clip"),
                       ({"nonfinite": "ignore"}, "nonfinite"),
                       ({"compute_dtype": "int8"}, "compute_dtype"),
                       ({"loss": "hinge"}, "loss"), ({"patience": 0}, "patience"),
                       ({"batch_size": 2.5}, "batch_size")]:  # fmt: skip
        with pytest.raises(ConfigError, match=field):
            TrainConfig(**bad)
    with pytest.raises(ConfigError, match="lerning_rate"):
        TrainConfig.from_dict({"lerning_rate": 1})
    with pytest.raises(ConfigError, match="output_dir"):
        TrainConfig(tensorboard=True)


def test_a_short_last_batch_grad_accum_cannot_split_is_refused_before_training():
    # 16 rows in batches of 3 × 2: the last batch of 4 splits in two micro-batches;
    # in batches of 2 × 3 the last one of 4 does not, and used to fail with a
    # ShapeError only at the epoch's end, after the epoch's steps
    def make(batch_size, accum):
        cfg = TrainConfig(epochs=1, batch_size=batch_size, grad_accum=accum,
                          drop_last=False, progress=False)  # fmt: skip
        return Trainer(linear_loss, PARAMS, sgd(0.1), cfg)

    assert make(3, 2).fit(DATA).steps == 3  # 6 + 6 + 4 rows
    t = make(2, 3)
    with pytest.raises(ConfigError, match=r"last training batch of 4 rows.*drop_last"):
        t.fit(DATA)
    assert t.step == 0


class Recorder(Callback):
    def __init__(self):
        self.calls = []

    def on_step(self, trainer, step, metrics):
        self.calls.append(("step", step))

    def on_eval(self, trainer, step, metrics):
        self.calls.append(("eval", step))

    def on_checkpoint(self, trainer, step, path):
        assert os.path.isdir(path)
        self.calls.append(("checkpoint", step))

    def on_end(self, trainer, result):
        self.calls.append(("end", result.steps))


def test_outputs_metrics_plot_tensorboard_and_callbacks(tmp_path):
    model = MLP((3, 8, 1))
    cfg = TrainConfig(epochs=3, batch_size=4, log_every=2, keep_checkpoints=2,
                      output_dir=str(tmp_path), tensorboard=True,
                      progress=True)  # fmt: skip
    rec = Recorder()
    t = Trainer(model, model.init(jax.random.key(0)), adamw(0.05), cfg, callbacks=[rec])
    r = t.fit(DATA, DATA)
    records = read_metrics(tmp_path)
    train = [x for x in records if "loss" in x]
    evals = [x for x in records if "eval_loss" in x]
    assert [x["step"] for x in train] == [2, 4, 6, 8, 10, 12]
    assert [x["step"] for x in evals] == [4, 8, 12]
    assert train == r.history and evals == r.eval_history
    assert {"lr", "grad_norm", "loss", "epoch"} <= set(train[0])
    assert evals[-1]["eval_loss"] < evals[0]["eval_loss"]
    assert os.path.getsize(plot(tmp_path)) > 10_000
    assert any(f.startswith("events") for f in os.listdir(tmp_path / "tensorboard"))
    assert Checkpointer(tmp_path / "checkpoints").steps() == [8, 12]  # last 2 kept
    assert rec.calls.count(("eval", 4)) == 1 and rec.calls[-1] == ("end", 12)
    assert [c for c in rec.calls if c[0] == "checkpoint"] == [
        ("checkpoint", 4), ("checkpoint", 8), ("checkpoint", 12)]  # fmt: skip
    assert sum(c[0] == "step" for c in rec.calls) == 12


def test_resume_in_process_mid_epoch_and_at_epoch_end(tmp_path):
    model = MLP((3, 8, 1), dropout=0.2)  # dropout: the step keys matter
    p = model.init(jax.random.key(0))

    def cfg(d):
        return TrainConfig(epochs=3, batch_size=2, grad_accum=2, checkpoint_every=2,
                           keep_checkpoints=10, log_every=2, output_dir=str(d),
                           progress=False)  # fmt: skip

    full = Trainer(model, p, adamw(0.01), cfg(tmp_path / "full")).fit(DATA, DATA)
    # 4 steps an epoch: step 6 is mid-epoch, step 4 an epoch's end (after its eval)
    for step in (6, 4):
        src = tmp_path / "full" / "checkpoints" / str(step)
        r = Trainer(model, p, adamw(0.01), cfg(tmp_path / f"r{step}")).fit(
            DATA, DATA, resume=src
        )
        for a, b in zip(jax.tree_util.tree_leaves((full.state.trainable,
                                                   full.state.opt_state)),
                        jax.tree_util.tree_leaves((r.state.trainable,
                                                   r.state.opt_state))):  # fmt: skip
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        assert r.history == full.history and r.eval_history == full.eval_history


def test_resume_latest_without_checkpoint_starts_fresh_and_bad_path_errors(tmp_path):
    cfg = TrainConfig(max_steps=2, batch_size=4, output_dir=str(tmp_path),
                      progress=False)  # fmt: skip
    r = Trainer(linear_loss, PARAMS, sgd(0.1), cfg).fit(DATA, resume="latest")
    assert r.steps == 2
    r2 = Trainer(linear_loss, PARAMS, sgd(0.1), cfg).fit(DATA, resume="latest")
    assert r2.steps == 2 and r2.history == r.history  # already done: nothing to run
    with pytest.raises(Exception, match="not a folder"):
        Trainer(linear_loss, PARAMS, sgd(0.1), cfg).fit(DATA, resume=tmp_path / "x")
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == [2]


def test_a_start_without_checkpoint_drops_the_killed_runs_metrics(tmp_path):
    """A run killed before its first checkpoint, restarted: each step logged once.

    ``--resume latest`` with no checkpoint starts fresh, but metrics.jsonl kept the
    killed run's lines and the new run appended its own after them: steps 1, 2, 3
    twice (a run's default checkpoint is at each epoch's end, so any run killed in
    its first epoch). Found by tests/runs/test_cli_kill_resume.py. Here the
    checkpoints are deleted instead of never written.
    """
    cfg = TrainConfig(max_steps=3, batch_size=4, log_every=1, output_dir=str(tmp_path),
                      progress=False)  # fmt: skip
    for resume in ("latest", None):
        Trainer(linear_loss, PARAMS, sgd(0.1), cfg).fit(DATA)
        shutil.rmtree(tmp_path / "checkpoints")
        with open(tmp_path / "metrics.jsonl", "a") as f:
            f.write('{"step": 4, "lo')  # killed mid-line, too
        Trainer(linear_loss, PARAMS, sgd(0.1), cfg).fit(DATA, resume=resume)
        lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
        assert [json.loads(x)["step"] for x in lines] == [1, 2, 3], resume
        shutil.rmtree(tmp_path / "checkpoints")


@pytest.mark.parametrize(
    ("params", "optimizer", "names"),
    [
        ({"w": jnp.zeros((3, 2)), "b": jnp.zeros(1)}, sgd(0.1),
         r"trainable\.w: \(3, 1\) in the checkpoint, \(3, 2\) in this run"),
        (PARAMS, adamw(0.1), r"opt_state\.0\.count: not in the checkpoint"),
    ],
)  # fmt: skip
def test_resuming_a_changed_state_names_the_leaf_before_reading(
    params, optimizer, names, tmp_path
):
    """A checkpoint that does not hold the run's state is refused, naming the leaf.

    Read from the checkpoint's metadata: another shape, another optimizer's state.

    Before: orbax's restore failed part-way ("Requested shape: ... is not compatible
    with the stored shape"), naming no leaf, and reads left in flight printed
    "RuntimeError: Event loop is closed" tracebacks around entrenar's error.
    """
    cfg = TrainConfig(max_steps=2, batch_size=4, output_dir=str(tmp_path),
                      progress=False)  # fmt: skip
    Trainer(linear_loss, PARAMS, sgd(0.1), cfg).fit(DATA)
    with pytest.raises(
        FormatError, match=r"does not match this run's state .*" + names
    ):
        Trainer(linear_loss, params, optimizer, cfg).fit(DATA, resume="latest")


def test_fresh_run_into_a_used_output_dir_is_refused_before_training(tmp_path):
    cfg = TrainConfig(max_steps=2, batch_size=4, output_dir=str(tmp_path),
                      progress=False)  # fmt: skip
    Trainer(linear_loss, PARAMS, sgd(0.1), cfg).fit(DATA)
    before = (tmp_path / "metrics.jsonl").read_text()
    trainer = Trainer(linear_loss, PARAMS, sgd(0.1), cfg)
    with pytest.raises(ConfigError, match=r"up to step 2.*resume='latest'"):
        trainer.fit(DATA)
    assert trainer.step == 0  # refused before the first step
    assert (tmp_path / "metrics.jsonl").read_text() == before
    # the same Trainer going on in memory writes on past its own checkpoints
    again = Trainer(linear_loss, PARAMS, sgd(0.1), cfg)
    again.fit(DATA, resume="latest")
    again.config = dataclasses.replace(cfg, max_steps=4)
    assert again.fit(DATA).steps == 4


def test_evaluate_weights_batches_by_loss_weight_and_train_epoch():
    def token_mean(p, b, *, key):
        # per-row losses, counted where mask: a mean over counted entries
        err = (b["x"] @ p["w"] + p["b"] - b["y"])[:, 0] ** 2  # (B,)
        n = jnp.sum(b["m"]).astype(jnp.float32)
        return jnp.sum(jnp.where(b["m"], err, 0.0)) / jnp.maximum(n, 1.0), {
            "loss_weight": n
        }

    m = np.zeros(16, bool)
    m[[0, 1, 2, 5, 9, 10, 11, 12, 13, 14]] = True  # 3, 1, 2, 4 counted per batch of 4
    data = {**DATA, "m": m}
    cfg = TrainConfig(batch_size=4, shuffle=False, progress=False)
    t = Trainer(token_mean, PARAMS, sgd(0.05), cfg)
    whole = float(token_mean(PARAMS, data, key=None)[0])
    assert t.evaluate(data)["eval_loss"] == pytest.approx(whole, rel=1e-6)
    mean_of_means = np.mean([float(token_mean(PARAMS, {k: v[i : i + 4] for k, v in
                                                       data.items()}, key=None)[0])
                             for i in range(0, 16, 4)])  # fmt: skip
    assert abs(mean_of_means - whole) > 1e-3  # so the weighting is what is tested
    first = t.train_epoch(data)["loss"]
    second = t.train_epoch(data)["loss"]
    assert t.step == 8 and t.epoch == 2 and second < first


@pytest.mark.parametrize("loss", ["mse", "cross_entropy"])
def test_evaluate_of_a_model_counts_a_short_last_batch_for_its_rows(loss):
    model = MLP((3, 4, 2))
    p = model.init(jax.random.key(0))
    y = np.array([0, 1, -100, 1, 0, 0, 1, -100, 1, 0])  # -100: ignored targets
    if loss == "mse":
        y = RNG.normal(size=(10, 2)).astype(np.float32)
    data = {"x": X[:10], "y": y}  # batches of 4, 4 and 2 rows
    cfg = TrainConfig(batch_size=4, loss=loss, shuffle=False, progress=False)
    t = Trainer(model, p, sgd(0.1), cfg)
    whole = float(t.loss_fn(p, data, key=None)[0])
    assert t.evaluate(data)["eval_loss"] == pytest.approx(whole, rel=1e-6)


def test_compute_dtype_casts_params_inside_the_loss_only():
    seen = []

    def loss_fn(p, b, *, key):
        seen.append(p["w"].dtype)
        x, y = b["x"].astype(p["w"].dtype), b["y"].astype(p["w"].dtype)
        return jnp.mean((x @ p["w"] + p["b"] - y) ** 2).astype(jnp.float32)

    cfg = TrainConfig(max_steps=2, batch_size=4, compute_dtype="bfloat16",
                      progress=False)  # fmt: skip
    r = Trainer(loss_fn, PARAMS, sgd(0.05), cfg).fit(DATA)
    assert seen and all(d == jnp.bfloat16 for d in seen)
    assert r.params["w"].dtype == jnp.float32 and r.history[-1]["loss"] > 0


@pytest.mark.parametrize("key", ["eval_every", "patience"])
def test_evaluation_settings_without_eval_data_are_refused(key):
    """Before, fit ran without a word and never evaluated nor stopped early."""
    cfg = TrainConfig(epochs=1, batch_size=4, progress=False, **{key: 2})
    with pytest.raises(ConfigError, match=f"TrainConfig.{key}=2: evaluations need"):
        Trainer(linear_loss, PARAMS, sgd(0.01), cfg).fit(DATA)


def test_donated_params_train_as_copied_ones_and_are_not_held_twice():
    """``donate_params``: the state takes the caller's arrays' memory.

    A run's Trainer does: no second copy of a full fine-tuning's model (the arrays
    XLA owns are taken as they are, in place; the given ones are deleted). The
    result equals the copying Trainer's.
    """
    m = MLP((3, 8, 1))
    x = np.linspace(-1, 1, 48, dtype=np.float32).reshape(16, 3)
    data = {"x": x, "y": x.sum(axis=1, keepdims=True)}
    cfg = TrainConfig(epochs=2, batch_size=8, progress=False)
    results = []
    for donate in (False, True):
        params = m.init(jax.random.key(0))
        given = jax.tree_util.tree_leaves(params)
        memory = [a.unsafe_buffer_pointer() for a in given]
        t = Trainer(m, params, adamw(0.05), cfg, donate_params=donate)
        held = jax.tree_util.tree_leaves(t.state.trainable)
        same = [a.unsafe_buffer_pointer() == p for a, p in zip(held, memory)]
        assert all(s == donate for s in same)
        results.append(t.fit(data).params)
        assert all(a.is_deleted() == donate for a in given)
    for a, b in zip(*(jax.tree_util.tree_leaves(r) for r in results)):
        np.testing.assert_array_equal(a, b)
