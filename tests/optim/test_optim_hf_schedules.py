"""The ``scheduler:`` section against ``transformers.get_scheduler`` at every update.

The reference is Hugging Face's ``LambdaLR``: the rate read from the torch optimizer
before its ``t``-th ``step()`` is the rate of update ``t``; ours is ``schedule(t)``
with ``t`` the updates already applied. Also: the Trainer's first update uses
``schedule(0)`` (an off-by-one would shift every rate).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from entrenar import optim as eo
from entrenar.errors import ConfigError
from entrenar.schema import parse
from entrenar.train import TrainConfig, Trainer

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

PEAK = 3e-4


def section_config(section):
    """A ``scheduler:`` section read as a run's YAML is (aliases included)."""
    return parse(eo.ScheduleConfig, section, "scheduler")


def hf_rates(name, warmup, total, peak=PEAK, **kwargs):
    """The rate of each of ``total`` updates under HF's scheduler ``name``."""
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=peak)
    sched = transformers.get_scheduler(
        name, opt, num_warmup_steps=warmup, num_training_steps=total,
        scheduler_specific_kwargs=kwargs,
    )  # fmt: skip
    rates = []
    for _ in range(total):
        rates.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return np.array(rates)


STEPS = 256  # steps evaluated at once, whatever the run's length (one shape)


def our_rates(section, total, peak=PEAK):
    """The schedule's rate at steps ``0 .. total - 1``.

    Evaluated on ``STEPS`` steps and cut to ``total``: each step's rate is computed
    alone (elementwise), and one shape lets every run reuse the compiled operations
    (a shape per ``total`` compiled them again for each example).
    """
    schedule = section_config(section).build(peak, total)
    steps = jnp.arange(max(total, STEPS), dtype=jnp.int32)
    return np.asarray(schedule(steps))[:total]


def assert_rates_equal(ours, theirs, peak=PEAK):
    np.testing.assert_allclose(ours, theirs, rtol=2e-5, atol=2e-6 * peak)


# (HF name, HF's lr_scheduler_kwargs, our scheduler section without the warm-up)
CASES = [
    ("linear", {}, {"name": "linear"}),
    ("cosine", {}, {"name": "cosine"}),
    ("cosine", {}, {"name": "cosine_decay"}),
    ("constant_with_warmup", {}, {"name": "constant_with_warmup"}),
    ("constant_with_warmup", {}, {"name": "constant"}),
    ("cosine_with_restarts", {}, {"name": "cosine_with_restarts"}),
    (
        "cosine_with_restarts",
        {"num_cycles": 3},
        {"name": "cosine_with_restarts", "num_cycles": 3},
    ),
    ("polynomial", {}, {"name": "polynomial"}),
    (
        "polynomial",
        {"power": 2.0, "lr_end": 1e-5},
        {"name": "polynomial", "power": 2.0, "lr_end": 1e-5},
    ),
    ("inverse_sqrt", {}, {"name": "inverse_sqrt"}),
    ("inverse_sqrt", {"timescale": 7}, {"name": "inverse_sqrt", "timescale": 7}),
    (
        "cosine_with_min_lr",
        {"min_lr_rate": 0.1},
        {"name": "cosine_with_min_lr", "min_lr_rate": 0.1},
    ),
    (
        "cosine_with_min_lr",
        {"min_lr": 1e-5, "num_cycles": 0.7},
        {"name": "cosine_with_min_lr", "min_lr": 1e-5, "num_cycles": 0.7},
    ),
    (
        "warmup_stable_decay",
        {"num_decay_steps": 20},
        {"name": "warmup_stable_decay", "num_decay_steps": 20},
    ),
    (
        "warmup_stable_decay",
        {
            "num_decay_steps": 15,
            "num_stable_steps": 9,
            "decay_type": "1-sqrt",
            "warmup_type": "cosine",
            "min_lr_ratio": 0.1,
        },
        {
            "name": "warmup_stable_decay",
            "decay_steps": 15,
            "stable_steps": 9,
            "decay_type": "1-sqrt",
            "warmup_type": "cosine",
            "min_lr_ratio": 0.1,
        },
    ),
    (
        "warmup_stable_decay",
        {"num_decay_steps": 25, "decay_type": "linear", "warmup_type": "1-sqrt"},
        {
            "name": "warmup_stable_decay",
            "decay_steps": 25,
            "decay_type": "linear",
            "warmup_type": "1-sqrt",
        },
    ),
]


@pytest.mark.parametrize("warmup", [0, 1, 7])
@pytest.mark.parametrize(("hf_name", "kwargs", "section"), CASES)
def test_every_rate_is_hugging_faces(hf_name, kwargs, section, warmup):
    total = 61
    theirs = hf_rates(hf_name, warmup, total, **kwargs)
    ours = our_rates({**section, "warmup_steps": warmup}, total)
    assert_rates_equal(ours, theirs)
    linear_from_0 = section.get("warmup_type", "linear") == "linear"
    if warmup and linear_from_0 and "min_lr_ratio" not in section:
        # HF's warm-up starts at 0 and reaches (W - 1)/W of the peak
        assert ours[0] == 0.0
        assert ours[warmup - 1] == pytest.approx(PEAK * (warmup - 1) / warmup)


@settings(max_examples=40, deadline=None)
@given(
    case=st.sampled_from(CASES),
    warmup=st.integers(0, 30),
    decay=st.integers(1, 120),
    peak=st.floats(1e-5, 1.0),
)
def test_every_rate_is_hugging_faces_over_runs(case, warmup, decay, peak):
    hf_name, kwargs, section = case
    total = warmup + decay
    if hf_name == "warmup_stable_decay":  # the decay fits in the run
        n = max(1, decay // 2)
        kwargs = {k: v for k, v in kwargs.items() if k != "num_stable_steps"}
        kwargs["num_decay_steps"] = n
        drop = ("stable_steps", "decay_steps", "num_decay_steps")
        section = {k: v for k, v in section.items() if k not in drop}
        section["decay_steps"] = n
    if "min_lr" in kwargs:  # HF's min_lr is absolute: keep it below the peak
        kwargs = {**kwargs, "min_lr": 0.05 * peak}
        section = {**section, "min_lr": 0.05 * peak}
    if "lr_end" in kwargs or hf_name == "polynomial":
        end = kwargs.get("lr_end", 1e-7)
        if end >= peak:
            return  # HF refuses it (and so do we: test_bad_sections)
    theirs = hf_rates(hf_name, warmup, total, peak, **kwargs)
    ours = our_rates({**section, "warmup_steps": warmup}, total, peak)
    assert_rates_equal(ours, theirs, peak)


@pytest.mark.parametrize("ratio", [0.03, 0.1, 0.25])
@pytest.mark.parametrize("total", [7, 40, 333])
def test_warmup_ratio_is_hugging_faces(tmp_path, ratio, total):
    args = transformers.TrainingArguments(output_dir=str(tmp_path), warmup_steps=ratio)
    warmup = args.get_warmup_steps(total)  # HF 5: warmup_steps < 1 is a ratio
    section = {"name": "linear", "warmup_ratio": ratio}
    assert section_config(section).warmup(total) == warmup
    assert_rates_equal(our_rates(section, total), hf_rates("linear", warmup, total))


def test_the_trainers_first_update_uses_the_rate_of_step_0():
    """SGD on ``loss = θ``: each update moves θ by minus the rate it used."""
    total, warmup = 12, 4
    section = {"name": "cosine", "warmup_steps": warmup}
    schedule = section_config(section).build(PEAK, total)
    trainer = Trainer(
        lambda p, b, *, key: p["w"] * jnp.mean(b["x"]),
        {"w": jnp.float32(0.0)},
        eo.sgd(schedule),
        TrainConfig(batch_size=2, progress=False),
    )
    moves, logged, before = [], [], 0.0
    for _ in range(total):
        metrics = trainer.train_step({"x": jnp.ones(2)})
        now = float(trainer.params["w"])
        moves.append(before - now)
        logged.append(float(metrics["lr"]))
        before = now
    theirs = hf_rates("cosine", warmup, total)
    assert_rates_equal(np.array(moves), theirs)
    assert_rates_equal(np.array(logged), theirs)  # "lr": the rate each step used


@pytest.mark.parametrize(
    ("section", "match"),
    [
        ({"name": "polynomial", "power": 2, "decay_rate": 0.5}, "decay_rate"),
        ({"name": "linear", "num_cycles": 2}, "num_cycles"),
        ({"name": "cosine", "min_lr_ratio": 0.1}, "cosine_with_min_lr"),
        ({"name": "inverse_sqrt", "init_value": 1e-5}, "init_value"),
        ({"name": "cosine_with_min_lr"}, "one of min_lr_ratio and end_value"),
        (
            {"name": "cosine_with_min_lr", "min_lr": 1e-5, "min_lr_ratio": 0.1},
            "one of min_lr_ratio",
        ),
        ({"name": "warmup_stable_decay"}, "one of decay_steps"),
        ({"name": "cosine_with_restarts", "num_cycles": 1.5}, "whole number"),
        ({"name": "linear", "warmup_steps": 3, "warmup_ratio": 0.1}, "not both"),
        ({"name": "warmup_stable_decay", "decay_type": "exp"}, "decay_type"),
        ({"name": "linear", "warmup_steps": 0.1}, "write warmup_ratio: 0.1"),
    ],
)
def test_bad_sections_name_the_key(section, match):
    with pytest.raises(ConfigError, match=match):
        section_config(section)


def test_schedules_that_do_not_fit_the_run_are_refused():
    with pytest.raises(ConfigError, match="end_value"):  # HF: lr_end must be lower
        section_config({"name": "polynomial", "lr_end": 1.0}).build(0.5, 10)
    wsd = {"name": "warmup_stable_decay", "warmup_steps": 5, "decay_steps": 8}
    with pytest.raises(ConfigError, match="exceed the run's 10 steps"):
        section_config(wsd).build(0.1, 10)


def test_hf_names_are_optaxs_schedules():
    pairs = (("cosine", "cosine_decay"), ("constant_with_warmup", "constant"))
    for hf_name, ours in pairs:
        assert section_config({"name": hf_name}).name == ours
    jitted = jax.jit(section_config(CASES[-1][2]).build(PEAK, 40))
    assert jitted(jnp.int32(39)).dtype == jnp.float32
