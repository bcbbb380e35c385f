"""A ``preference:`` run from YAML through ``entrenar validate`` and ``train``.

The model is the tiny Llama of test_dpo_trl.py (its starting weights as TRL's run
had them) in a Hugging Face folder with the ``qwen2_split`` tokenizer, the data
TRL's recorded records. What is checked against TRL: the pairs kept, and the first
step's figures (loss log 2 and zero rewards at the start, where the policy is the
reference; with LoRA, logps/* of the first batch equal to TRL's: the same rows).
"""

import json
import math
import sys
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from entrenar import io
from entrenar.cli import cli
from entrenar.errors import ConfigError
from entrenar.runs import train_from_yaml

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "io")]
import hf_cases  # noqa: E402
import test_dpo_trl as trl_case  # noqa: E402

REF = trl_case.REF


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    out = tmp_path_factory.mktemp("dpo")
    io.save_hf_folder(out / "model", trl_case.MODEL, trl_case.start_params())
    hf_cases.write_tokenizer(out / "model", REF["tokenizer_style"])
    for run in ("full", "lora"):
        lines = [json.dumps(r) for r in REF["records"][run]]
        (out / f"{run}.jsonl").write_text("\n".join(lines) + "\n")
    return out


def write_run(folder, run, **extra):
    doc = {
        "model": {"path": "model"},
        "data": {"train": f"{run}.jsonl", "batch_size": 2, "seq_len": REF["max_length"],
                 "shuffle": False},
        "optimizer": {"name": "sgd", "lr": REF["settings"]["learning_rate"]},
        "preference": {"beta": REF["settings"]["beta"]},
        "training": {"max_steps": 2, "output_dir": str(folder / f"out-{run}"),
                     "checkpoint_every": 1, "log_every": 1},
        "export": {"formats": ["adapter"] if run == "lora" else ["safetensors"]},
    }  # fmt: skip
    if run == "lora":
        doc["lora"] = {"rank": 4, "alpha": 8, "targets": ["q_proj", "v_proj"]}
    for key, value in extra.items():
        doc[key] = {**doc.get(key, {}), **value}
    path = folder / f"{run}.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


@pytest.mark.parametrize("run", ["full", "lora"])
def test_validate_counts_the_pairs_trl_keeps(folder, run):
    result = CliRunner().invoke(cli, ["validate", str(write_run(folder, run))])
    assert result.exit_code == 0, result.output
    kept = len(REF[run]["tokenized"])
    assert f"Data train: {kept} preference pairs" in result.output


@pytest.mark.parametrize("run", ["full", "lora"])
def test_train_logs_trls_metrics_and_starts_at_the_reference(folder, run):
    result = CliRunner().invoke(cli, ["train", str(write_run(folder, run))])
    assert result.exit_code == 0, result.output
    out = folder / f"out-{run}"
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r and "step" in r]
    assert [r["step"] for r in steps] == [1, 2]
    first = steps[0]
    for key in trl_case.METRICS:
        assert key in first, sorted(first)
    assert first["loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert first["rewards/margins"] == 0.0 and first["rewards/chosen"] == 0.0
    if run == "lora":  # TRL's first batch held pairs 0 and 1, as this one does
        trl_first = REF["lora"]["steps"][0]
        assert trl_first["rows"] == [0, 1]
        for key in ("logps/chosen", "logps/rejected"):
            assert first[key] == pytest.approx(trl_first["metrics"][key], abs=1e-4)
    assert steps[1]["rewards/margins"] != 0.0  # the first step moved the policy
    assert (out / ("model.safetensors" if run == "full" else "adapter")).exists()


def test_bad_preference_sections_are_refused_by_key(folder):
    cases = [
        ({"preference": {"loss_type": "dpo"}}, r"preference.loss_type"),
        ({"preference": {"loss_type": "hinge", "label_smoothing": 0.1}},
         r"preference: label_smoothing is read by"),
        ({"preference": {"reference": "adapters"}}, r"preference.reference: adapters"),
        ({"data": {"format": "chat"}}, r"data.format: a preference run"),
    ]  # fmt: skip
    for extra, message in cases:
        with pytest.raises(ConfigError, match=message):
            train_from_yaml(write_run(folder, "full", **extra), dry_run=True)


def test_evaluation_logs_trls_eval_names(folder):
    """A validation file: eval_loss and eval_rewards/... (TRL's ``eval_`` names)."""
    path = write_run(
        folder, "full",
        data={"validation": "full.jsonl"},
        training={"max_steps": 1, "eval_every": 1, "output_dir": str(folder / "ev")},
    )  # fmt: skip
    train_from_yaml(path, progress=False)
    rows = (folder / "ev" / "metrics.jsonl").read_text().splitlines()
    evals = [json.loads(x) for x in rows if "eval_loss" in x]
    assert evals and all(f"eval_{k}" in evals[0] for k in trl_case.METRICS)


def test_the_example_pairs_are_their_scripts_output():
    """examples/data/iso_date_preferences/train.jsonl is what its script writes."""
    root = HERE.parents[1] / "examples" / "data" / "iso_date_preferences"
    sys.path.insert(0, str(root))
    try:
        import make_iso_date_preferences as script
    finally:
        sys.path.remove(str(root))
    chats = [json.loads(x) for x in Path(script.SOURCE).read_text().splitlines()]
    want = "".join(json.dumps(script.pair(c)) + "\n" for c in chats[: script.PAIRS])
    assert (root / "train.jsonl").read_text() == want
