"""A ``grpo:`` run from YAML: errors name the key, a short run writes TRL's metrics.

The model is the tiny Llama of tests/peft_cases.py in a Hugging Face folder with
the ``qwen2_split`` tokenizer; the prompts are texts with an ``answer`` column.
"""

import json
import os
import sys
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from entrenar import io
from entrenar.cli import cli
from entrenar.config import load_config
from entrenar.errors import ConfigError
from entrenar.runs import train_from_yaml

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE.parent / "io")]
import hf_cases  # noqa: E402

sys.path.insert(0, str(HERE))
import test_grpo_trl as trl_case  # noqa: E402

RECORDS = [{"prompt": p, "answer": a} for p, a in
           (("Hello world", "hi"), ("The fox", "jumps"), ("1 2 3", "4"))]  # fmt: skip


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    out = tmp_path_factory.mktemp("grpo")
    io.save_hf_folder(out / "model", trl_case.MODEL, trl_case.start_params())
    hf_cases.write_tokenizer(out / "model", trl_case.REF["tokenizer_style"])
    lines = [json.dumps(r) for r in RECORDS]
    (out / "prompts.jsonl").write_text("\n".join(lines) + "\n")
    return out


def write_run(folder, name="run", **extra):
    doc = {
        "model": {"path": "model"},
        "data": {"train": "prompts.jsonl"},
        "lora": {"rank": 4, "alpha": 8, "targets": ["q_proj", "v_proj"]},
        "grpo": {"num_generations": 4, "prompts_per_step": 2, "beta": 0.04,
                 "max_completion_length": 6, "loss_type": "grpo",
                 "rewards": [{"type": "contains", "column": "answer"},
                             {"type": "regex", "pattern": "[a-z]+", "weight": 0.5,
                              "name": "letters"}]},
        "optimizer": {"name": "sgd", "lr": 0.5},
        "training": {"max_steps": 2, "output_dir": str(folder / f"out-{name}"),
                     "log_every": 1},
        "export": {"formats": ["adapter"]},
    }  # fmt: skip
    for key, value in extra.items():
        doc[key] = value if value is None else {**doc.get(key, {}), **value}
        if value is None:
            del doc[key]
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def test_validate_counts_the_prompts(folder):
    result = CliRunner().invoke(cli, ["validate", str(write_run(folder))])
    assert result.exit_code == 0, result.output
    assert "Data train: 3 GRPO prompts" in result.output


def test_train_writes_trls_metrics_and_the_adapter(folder):
    run = train_from_yaml(write_run(folder), progress=False)
    lines = (Path(run.output_dir) / "metrics.jsonl").read_text().splitlines()
    steps = [json.loads(x) for x in lines]
    assert [s["step"] for s in steps] == [1, 2]
    for key in ("reward", "reward_std", "frac_reward_zero_std",
                "rewards/contains_answer/mean", "rewards/letters/mean", "kl",
                "entropy", "completions/mean_length", "clip_ratio/region_mean",
                "loss"):  # fmt: skip
        assert key in steps[0], key
    assert steps[0]["kl"] == 0.0  # the adapters start at B = 0: the reference
    assert (Path(run.files["adapter"]) / "adapter_model.safetensors").is_file()
    # the reward is the weighted sum: contains + 0.5 letters
    want = (
        steps[0]["rewards/contains_answer/mean"]
        + 0.5 * steps[0]["rewards/letters/mean"]
    )
    assert steps[0]["reward"] == pytest.approx(want)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"grpo": {"rewards": []}}, "grpo.rewards: name at least one reward"),
        ({"grpo": {"rewards": [{"type": "exact_match"}]}},
         r"grpo.rewards\[0\]: .*takes one option, column"),
        ({"grpo": {"rewards": [{"type": "python", "column": "a"}]}},
         r"grpo.rewards\[0\].type: must be one of"),
        ({"grpo": {"rewards": [{"type": "regex", "pattern": "("}]}},
         "does not compile"),
        ({"grpo": {"num_generations": 1}}, "grpo.num_generations"),
        ({"grpo": {"loss_type": "ppo"}}, "grpo.loss_type: must be one of"),
        ({"preference": {"beta": 0.1}}, "a run is GRPO, DPO or distillation"),
        ({"training": {"max_steps": None}}, "training.max_steps: a GRPO run counts"),
        ({"data": {"validation": "prompts.jsonl"}, "training": {"export_best": True}},
         "training.export_best: a GRPO run's evaluations score rewards"),
    ],
)  # fmt: skip
def test_bad_sections_name_the_key(folder, change, message):
    path = write_run(folder, "bad", **change)
    with pytest.raises(ConfigError, match=message):
        load_config(path)


def test_records_need_the_reward_columns(folder):
    (folder / "no_answer.jsonl").write_text(json.dumps({"prompt": "x"}) + "\n")
    path = write_run(folder, "cols", data={"train": "no_answer.jsonl"})
    result = CliRunner().invoke(cli, ["validate", str(path)])
    assert result.exit_code != 0
    assert "answer (contains)" in result.output


def test_example_config_validates():
    spec = load_config(HERE.parents[1] / "examples" / "configs" / "smollm2-grpo.yaml")
    assert spec.grpo is not None and len(spec.grpo.rewards) == 4
    assert [r.weight for r in spec.grpo.rewards] == [1.0] * 4


def _rows(run):
    lines = (Path(run.output_dir) / "metrics.jsonl").read_text().splitlines()
    return [{**json.loads(x), "step_time": 0} for x in lines]


def test_resume_continues_and_refuses_another_grpo_section(folder):
    """A run extended with --resume latest ends as the longer uninterrupted run.

    Checkpoints every step (2 kept); the resume's config is checked against the
    run's config.json: another grpo section is refused naming the key, another
    learning rate or seed is warned about, a fresh start over the checkpoints is
    refused.
    """
    every = {"checkpoint_every": 1, "keep_checkpoints": 2, "eval_every": 1}
    valid = {"validation": "prompts.jsonl"}
    longer = train_from_yaml(
        write_run(folder, "long", training={"max_steps": 3, **every}, data=valid),
        progress=False,
    )
    path = write_run(folder, "short", training=every, data=valid)
    short = train_from_yaml(path, progress=False)
    out = Path(short.output_dir)
    assert sorted(os.listdir(out / "checkpoints")) == ["1", "2"]
    assert json.loads((out / "config.json").read_text())["grpo"]["num_generations"] == 4
    there = {**every, "output_dir": str(out)}
    changed = write_run(folder, "changed", training=there, data=valid,
                        grpo={"num_generations": 2})  # fmt: skip
    with pytest.raises(ConfigError, match=r"grpo.num_generations: 4 then, 2 now"):
        train_from_yaml(changed, resume="latest", progress=False)
    with pytest.raises(ConfigError, match="holds checkpoints of another run"):
        train_from_yaml(path, progress=False)
    extended = train_from_yaml(path, {"training.max_steps": 3}, resume="latest",
                               progress=False)  # fmt: skip
    assert sorted(os.listdir(out / "checkpoints")) == ["2", "3"]
    assert _rows(extended) == _rows(longer)
    evals = [r for r in _rows(longer) if "eval_reward" in r]
    assert [r["step"] for r in evals] == [1, 2, 3]  # the evaluations resumed too
    a = (out / "adapter" / "adapter_model.safetensors").read_bytes()
    b = Path(longer.output_dir, "adapter", "adapter_model.safetensors").read_bytes()
    assert a == b
    assert extended.metrics == longer.metrics
    lr = {"optimizer": {"lr": 0.1}}
    seed = {"training": {**there, "seed": 7}, **lr}
    for change, key in ((lr, "optimizer.lr"), (seed, "seed")):
        changed = write_run(folder, "changed", **{"training": there, "data": valid,
                                                  **change})  # fmt: skip
        with pytest.warns(UserWarning, match=key):
            train_from_yaml(changed, {"training.max_steps": 4}, resume="latest",
                            progress=False)  # fmt: skip
    # config.json: the config of the last run that took a step (step 4, lr 0.1)
    assert json.loads((out / "config.json").read_text())["optimizer"]["lr"] == 0.1


def test_resume_warns_when_a_longer_run_moves_the_schedule(folder):
    """A linear decay laid over 2 steps, extended to 3: step 2's rate moves."""
    extra = {"training": {"max_steps": 2, "checkpoint_every": 1},
             "scheduler": {"name": "linear", "end_value": 0.0}}  # fmt: skip
    path = write_run(folder, "sched", **extra)
    train_from_yaml(path, progress=False)
    with pytest.warns(UserWarning, match="now has 3 steps, 2 before"):
        train_from_yaml(path, {"training.max_steps": 3}, resume="latest",
                        progress=False)  # fmt: skip


def test_evaluation_scores_sampled_completions_of_the_validation_prompts(folder):
    """data.validation: TRL's eval_ metrics after the last step (eval_every unset).

    3 prompts x 4 samples; eval_reward is the weighted sum of the per-reward
    means; evaluating changes nothing of the training (its lines match a run
    without validation).
    """
    valid = {"validation": "prompts.jsonl"}
    plain = _rows(train_from_yaml(write_run(folder, "noeval"), progress=False))
    run = train_from_yaml(write_run(folder, "eval", data=valid), progress=False)
    rows = _rows(run)
    evals = [r for r in rows if "eval_reward" in r]
    assert [r for r in rows if "eval_reward" not in r] == plain
    assert [r["step"] for r in evals] == [2]
    e = evals[0]
    assert e["eval_reward"] == pytest.approx(
        e["eval_rewards/contains_answer/mean"] + 0.5 * e["eval_rewards/letters/mean"]
    )
    assert 1 <= e["eval_completions/mean_length"] <= 6
    assert "eval_frac_reward_zero_std" in e and "eval_loss" not in e
    assert run.metrics["eval_reward"] == e["eval_reward"]
    path = write_run(folder, "eval", data=valid)
    result = CliRunner().invoke(cli, ["validate", str(path)])
    assert result.exit_code == 0, result.output
    assert "Data validation: 3 GRPO prompts" in result.output
    (folder / "bare.jsonl").write_text(json.dumps({"prompt": "x"}) + "\n")
    path = write_run(folder, "eval", data={"validation": "bare.jsonl"})
    result = CliRunner().invoke(cli, ["validate", str(path)])
    assert result.exit_code != 0 and "data.validation: " in result.output
    assert "answer (contains)" in result.output
