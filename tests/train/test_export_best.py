"""``TrainConfig.export_best``: the parameters of the best evaluation, kept on disk.

Hugging Face's ``load_best_model_at_end=True`` with ``metric_for_best_model="loss"``
(``greater_is_better=False``): the model a run returns is the one of its evaluation
with the lowest eval loss, read back from that evaluation's checkpoint, which
``save_total_limit`` never deletes. The references: plain SGD on a linear model in
numpy float64 (the parameters after ``k`` steps), and the checkpoint's arrays read
with orbax's own reader.
"""

import os

import jax.numpy as jnp
import numpy as np
import pytest
from scripted_eval import Scripted

from entrenar.errors import ConfigError
from entrenar.optim import sgd
from entrenar.train import Callback, TrainConfig, Trainer

RNG = np.random.default_rng(3)
X = RNG.normal(size=(16, 3)).astype(np.float32)
Y = (X @ np.array([[1.0], [-2.0], [0.5]], np.float32) + 0.3).astype(np.float32)
DATA = {"x": X, "y": Y}
PARAMS = {"w": jnp.zeros((3, 1)), "b": jnp.zeros(1)}
LR = 0.05


def linear_loss(p, b, *, key):
    if "v" in b:  # scripted evaluation batches carry their own loss
        return jnp.mean(b["v"]) + 0.0 * jnp.sum(p["w"])
    return jnp.mean((b["x"] @ p["w"] + p["b"] - b["y"]) ** 2)


def sgd_reference(steps):
    """Plain SGD on the mean squared error, float64: w, b after ``steps`` steps.

    No shuffling, batches of 4: step s reads rows 4(s-1) .. 4s-1 (mod 16).
    """
    w, b = np.zeros((3, 1)), np.zeros(1)
    x, y = X.astype(np.float64), Y.astype(np.float64)
    for s in range(steps):
        rows = slice(4 * (s % 4), 4 * (s % 4) + 4)
        r = x[rows] @ w + b - y[rows]  # (4, 1)
        w = w - LR * 2 * x[rows].T @ r / 4
        b = b - LR * 2 * r.mean(0)
    return {"w": w, "b": b}


def stored_params(out, step):
    """The trained parameters of checkpoint ``step``, read by orbax's own reader."""
    import orbax.checkpoint as ocp

    with ocp.StandardCheckpointer() as ck:
        state = ck.restore(os.path.join(out, "checkpoints", str(step), "state"))
    return {k: np.asarray(v) for k, v in state["trainable"].items()}


def config(out, **kw):
    base = dict(
        max_steps=12, batch_size=4, shuffle=False, eval_every=2, checkpoint_every=5,
        keep_checkpoints=1, log_every=1, progress=False, output_dir=str(out),
    )  # fmt: skip
    return TrainConfig(**{**base, **kw})


# eval losses at steps 2, 4, ..., 12: the best is step 4's
SCRIPT = [1.0, 0.5, 0.7, 0.5, 1.1, 1.2]


def test_the_best_evaluations_parameters_are_returned_and_its_checkpoint_kept(
    tmp_path,
):
    trainer = Trainer(linear_loss, PARAMS, sgd(LR), config(tmp_path, export_best=True))
    r = trainer.fit(DATA, Scripted(SCRIPT))
    assert (r.best_step, r.params_step, r.steps, int(r.state.step)) == (4, 4, 12, 12)
    assert "parameters of step 4" in repr(r)
    # keep_checkpoints=1 keeps the newest (12) and the best (4), which rotation
    # spared although checkpoints 5 and 10 were written after it
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["12", "4"]
    stored = stored_params(tmp_path, 4)
    for params in (r.params, trainer.params):
        for k in ("w", "b"):
            np.testing.assert_array_equal(np.asarray(params[k]), stored[k])
    ref = sgd_reference(4)
    for k in ("w", "b"):
        np.testing.assert_allclose(np.asarray(r.params[k]), ref[k], rtol=1e-5)
    # the optimizer state and the step stay the last's: an evaluation reads step 4's
    assert trainer.evaluate(DATA)["eval_loss"] == pytest.approx(
        np.mean((X @ ref["w"] + ref["b"] - Y) ** 2), rel=1e-5
    )


def test_without_export_best_the_last_parameters_and_checkpoints_only(tmp_path):
    r = Trainer(linear_loss, PARAMS, sgd(LR), config(tmp_path)).fit(
        DATA, Scripted(SCRIPT)
    )
    assert (r.best_step, r.params_step, r.steps) == (4, 12, 12)
    assert "parameters of step" not in repr(r)
    assert os.listdir(tmp_path / "checkpoints") == ["12"]
    stored, ref = stored_params(tmp_path, 12), sgd_reference(12)
    for k in ("w", "b"):
        np.testing.assert_array_equal(np.asarray(r.params[k]), stored[k])
        np.testing.assert_allclose(np.asarray(r.params[k]), ref[k], rtol=1e-5)


def test_the_last_evaluation_best_keeps_the_last_parameters(tmp_path):
    r = Trainer(linear_loss, PARAMS, sgd(LR), config(tmp_path, export_best=True)).fit(
        DATA, Scripted([6, 5, 4, 3, 2, 1])
    )
    assert (r.best_step, r.params_step) == (12, 12)
    assert os.listdir(tmp_path / "checkpoints") == ["12"]


def test_a_better_evaluation_releases_the_previous_best(tmp_path):
    """Only the current best is protected: an older best goes with rotation."""
    r = Trainer(linear_loss, PARAMS, sgd(LR), config(tmp_path, export_best=True)).fit(
        DATA, Scripted([1.0, 0.5, 0.7, 0.4, 1.1, 1.2])
    )
    assert r.params_step == 8
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["12", "8"]


class KillAt(Callback):
    """Raise at step ``n`` (after its evaluation and checkpoint): a crash."""

    def __init__(self, n):
        self.n = n

    def on_step(self, trainer, step, metrics):
        if step == self.n:
            raise KeyboardInterrupt


@pytest.mark.parametrize("crash", [3, 5, 7, 11])
def test_a_crashed_run_resumed_returns_the_same_best_parameters(tmp_path, crash):
    """The best checkpoint survives the crash; the resumed run reads it back."""
    full = Trainer(
        linear_loss, PARAMS, sgd(LR), config(tmp_path / "a", export_best=True)
    ).fit(DATA, Scripted(SCRIPT))
    cfg = config(tmp_path / "b", export_best=True)
    with pytest.raises(KeyboardInterrupt):
        Trainer(linear_loss, PARAMS, sgd(LR), cfg, callbacks=[KillAt(crash)]).fit(
            DATA, Scripted(SCRIPT)
        )
    done = sorted(int(n) for n in os.listdir(tmp_path / "b" / "checkpoints"))
    evals = Scripted(SCRIPT)
    evals.i = done[-1] // 2 if done else 0  # the evaluations already made
    r = Trainer(linear_loss, PARAMS, sgd(LR), cfg).fit(DATA, evals, resume="latest")
    assert (r.params_step, r.steps) == (full.params_step, full.steps) == (4, 12)
    for k in ("w", "b"):
        np.testing.assert_array_equal(
            np.asarray(r.params[k]), np.asarray(full.params[k])
        )
    assert sorted(os.listdir(tmp_path / "b" / "checkpoints")) == ["12", "4"]


def test_export_best_without_eval_data_or_output_dir_is_refused(tmp_path):
    cfg = config(tmp_path, export_best=True)
    cfg = TrainConfig(**{**cfg.to_dict(), "eval_every": None})
    with pytest.raises(
        ConfigError, match="export_best=True: evaluations need eval_data"
    ):
        Trainer(linear_loss, PARAMS, sgd(LR), cfg).fit(DATA)
    with pytest.raises(ConfigError, match="export_best: needs an output_dir"):
        TrainConfig(export_best=True)


def test_export_best_turned_on_at_resume_after_the_best_was_rotated_is_refused(
    tmp_path,
):
    Trainer(linear_loss, PARAMS, sgd(LR), config(tmp_path, max_steps=10)).fit(
        DATA, Scripted(SCRIPT)
    )  # best: step 4, its checkpoint never written (checkpoints 5, 10; 1 kept)
    cfg = config(tmp_path, export_best=True)
    evals = Scripted(SCRIPT)
    evals.i = 5
    with pytest.raises(
        ConfigError, match="best evaluation of the resumed run is step 4"
    ):
        Trainer(linear_loss, PARAMS, sgd(LR), cfg).fit(DATA, evals, resume="latest")
