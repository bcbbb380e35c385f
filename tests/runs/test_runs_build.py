"""Schedules and optimizers built from a config equal optax's (the reference)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from config_cases import wine_yaml_factory

from entrenar.config import load_config
from entrenar.errors import ConfigError
from entrenar.runs.build import build_optimizer, build_schedule, train_config


@pytest.fixture
def wine_yaml(tmp_path):
    """``wine_yaml(**sections) -> path`` of a tiny wine run (config_cases)."""
    return wine_yaml_factory(tmp_path)


STEPS = [0, 1, 5, 9, 10, 37, 80, 99, 100, 150]


def _lr(schedule, t):
    return float(schedule(t)) if callable(schedule) else float(schedule)


@pytest.mark.parametrize(
    ("section", "reference"),
    [
        (None, optax.constant_schedule(0.01)),
        (
            {"name": "linear", "end_value": 0.001},
            optax.linear_schedule(0.01, 0.001, 100),
        ),
        (
            {"name": "cosine_decay", "end_value": 0.002},
            optax.cosine_decay_schedule(0.01, 100, alpha=0.2),
        ),
        (
            {"name": "warmup_cosine_decay", "warmup_steps": 10, "end_value": 0.001},
            optax.warmup_cosine_decay_schedule(0.0, 0.01, 10, 100, 0.001),
        ),
        (
            {"name": "exponential_decay", "decay_rate": 0.5, "decay_steps": 20},
            optax.exponential_decay(0.01, 20, 0.5),
        ),
        (
            {
                "name": "exponential_decay",
                "decay_rate": 0.5,
                "decay_steps": 20,
                "staircase": True,
            },
            optax.exponential_decay(0.01, 20, 0.5, staircase=True),
        ),
        (
            {"name": "constant", "warmup_steps": 10, "init_value": 0.001},
            optax.join_schedules(
                [optax.linear_schedule(0.001, 0.01, 10), optax.constant_schedule(0.01)],
                [10],
            ),
        ),
        (
            {"name": "cosine_decay", "warmup_steps": 10},
            optax.join_schedules(
                [
                    optax.linear_schedule(0.0, 0.01, 10),
                    optax.cosine_decay_schedule(0.01, 90),
                ],
                [10],
            ),
        ),
    ],
)
def test_schedules_match_optax(wine_yaml, section, reference):
    spec = load_config(wine_yaml(scheduler=section, optimizer={"lr": 0.01}))
    ours = build_schedule(spec, total=100)
    for t in STEPS:
        assert _lr(ours, t) == pytest.approx(float(reference(t)), rel=1e-5, abs=1e-9)


def test_warmup_longer_than_the_run_is_an_error(wine_yaml):
    spec = load_config(wine_yaml(scheduler={"name": "constant", "warmup_steps": 50}))
    with pytest.raises(ConfigError, match=r"^scheduler\.warmup_steps: 50 is not below"):
        build_schedule(spec, total=50)


@pytest.mark.parametrize(
    ("section", "reference"),
    [
        ({"name": "sgd", "lr": 0.1}, optax.sgd(0.1)),
        (
            {"name": "sgd", "lr": 0.1, "momentum": 0.9, "nesterov": True},
            optax.sgd(0.1, momentum=0.9, nesterov=True),
        ),
        (
            {"name": "adam", "lr": 0.01, "beta1": 0.8, "eps": 1e-6},
            optax.adam(0.01, b1=0.8, eps=1e-6),
        ),
        ({"name": "adamw", "lr": 0.01}, optax.adamw(0.01, weight_decay=0.01)),
        (
            {"name": "adamw", "lr": 0.01, "weight_decay": 0.1, "beta2": 0.99},
            optax.adamw(0.01, b2=0.99, weight_decay=0.1),
        ),
    ],
)
def test_optimizers_match_optax(wine_yaml, section, reference):
    spec = load_config(wine_yaml(optimizer=section))
    ours = build_optimizer(spec, total=100)
    keys = jax.random.split(jax.random.key(0), 4)
    params = {"w": jax.random.normal(keys[0], (3, 4)), "b": jnp.ones(4)}
    p_ours, p_ref = params, params
    s_ours, s_ref = ours.init(params), reference.init(params)
    for k in keys[1:]:
        g = {
            n: jax.random.normal(jax.random.fold_in(k, i), x.shape)
            for i, (n, x) in enumerate(params.items())
        }
        u, s_ours = ours.update(g, s_ours, p_ours)
        p_ours = optax.apply_updates(p_ours, u)
        with jax.numpy_dtype_promotion("standard"):  # optax mixes Python floats
            u, s_ref = reference.update(g, s_ref, p_ref)
        p_ref = optax.apply_updates(p_ref, u)
    for name in params:
        np.testing.assert_allclose(p_ours[name], p_ref[name], rtol=1e-6, atol=1e-7)


def test_train_config_carries_the_training_section(wine_yaml):
    spec = load_config(
        wine_yaml(
            training={
                "max_steps": 7,
                "grad_accum": 2,
                "grad_clip": 0.5,
                "early_stopping": {"patience": 2, "min_delta": 0.01},
                "compute_dtype": "bfloat16",
                "output_dir": "o",
            }
        ),
    )
    cfg = train_config(spec, progress=False)
    assert (cfg.max_steps, cfg.grad_accum, cfg.grad_clip) == (7, 2, 0.5)
    assert (cfg.patience, cfg.min_delta) == (2, 0.01)
    assert cfg.compute_dtype == "bfloat16" and cfg.loss == "cross_entropy"
    assert cfg.batch_size == 16 and cfg.output_dir == "o"


def test_model_precision_options_reach_the_llama_config(monkeypatch):
    """``model.matmul_dtype`` / ``remat_policy`` / ``tied_head_copy``: LlamaConfig's.

    ``matmul_dtype: auto`` by the CPU.
    """
    import entrenar.runs.models as models
    from entrenar import nn
    from entrenar.config.sections import ModelSection

    cfg = nn.LlamaConfig(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_layers=1,
        num_heads=2, num_kv_heads=1,
    )  # fmt: skip
    built = models.BuiltModel("llama", cfg, {})
    same = models.with_precision(built, ModelSection(architecture="llama"))
    assert same is built  # the defaults change nothing
    got = models.with_precision(
        built,
        ModelSection(
            architecture="llama", matmul_dtype="bfloat16", remat_policy="dots_saveable"
        ),
    ).config
    assert (got.matmul_dtype, got.remat_policy) == ("bfloat16", "dots_saveable")
    assert got.tied_head_copy  # the default
    no_copy = ModelSection(architecture="llama", tied_head_copy=False)
    assert not models.with_precision(built, no_copy).config.tied_head_copy
    for flag, want in (("bfloat16", "bfloat16"), (None, None)):
        monkeypatch.setattr(nn, "auto_matmul_dtype", lambda flag=flag: flag)
        auto = ModelSection(architecture="llama", matmul_dtype="auto")
        assert models.with_precision(built, auto).config.matmul_dtype == want
    with pytest.raises(ConfigError, match=r"model: LlamaConfig\.remat_policy"):
        models.with_precision(
            built, ModelSection(architecture="llama", remat_policy="everything")
        )
    mlp = models.BuiltModel("mlp", None, {})
    with pytest.raises(ConfigError, match=r"a Llama-style decoder .*, not mlp"):
        models.with_precision(
            mlp,
            ModelSection(
                architecture="mlp", config={"sizes": [1]}, matmul_dtype="auto"
            ),
        )


def test_auto_matmul_dtype_reads_the_cpu_flags(monkeypatch, tmp_path):
    import builtins

    from entrenar import nn

    real_open = builtins.open
    for flags, want in (("fpu avx2 amx_bf16", "bfloat16"), ("fpu avx2", None)):
        info = tmp_path / "cpuinfo"
        info.write_text(f"processor : 0\nflags\t\t: {flags}\n")

        def fake_open(path, *a, info=info, **k):
            return real_open(info if path == "/proc/cpuinfo" else path, *a, **k)

        monkeypatch.setattr(builtins, "open", fake_open)
        assert nn.auto_matmul_dtype() == want
