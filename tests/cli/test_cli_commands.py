"""The ``entrenar`` command: exit codes, one-line errors, overrides, files read back."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import jax
import numpy as np
import pytest
import yaml
from cli_cases import CONFIGS, MODELS, REPO, WINE, WORDS, write_tiny_config
from click.testing import CliRunner

from entrenar import io, nn, quant
from entrenar.cli import cli
from entrenar.runs import load_built


@pytest.fixture
def tiny_config(tmp_path):
    return write_tiny_config(tmp_path)


def run(*args: str):
    return CliRunner().invoke(cli, [str(a) for a in args])


def test_help_lists_every_command():
    result = run("--help")
    assert result.exit_code == 0
    for name in (
        "train",
        "validate",
        "info",
        "quantize",
        "merge",
        "generate",
        "eval",
        "plot",
    ):
        assert name in result.output


def test_validate_a_shipped_config():
    result = run("validate", CONFIGS / "wine-mlp.yaml", "--detailed")
    assert result.exit_code == 0, result.output
    assert "Configuration is valid" in result.output
    assert "Optimizer: name=adamw, lr=0.01" in result.output


def test_validate_takes_the_overrides_train_takes():
    """``validate CONFIG --set KEY=VALUE`` checks what ``train`` with it would run."""
    config = CONFIGS / "wine-mlp.yaml"
    result = run("validate", config, "--detailed", "--set", "optimizer.lr=0.5")
    assert result.exit_code == 0, result.output
    assert "Optimizer: name=adamw, lr=0.5" in result.output
    bad = run("validate", config, "--set", "optimizer.lr=-1")
    assert bad.exit_code == 2 and "optimizer.lr: must be > 0, got -1" in bad.stderr
    assert run("validate", config, "--set", "lr").exit_code == 2  # not KEY=VALUE


def test_validate_shows_dora():
    """``lora.use_dora: true`` (YAML or --set) is read and shown by validate."""
    config = CONFIGS / "number-words-gpt2-lora.yaml"
    result = run("validate", config, "--detailed", "--set", "lora.use_dora=true")
    assert result.exit_code == 0, result.output
    assert "use_dora=True" in result.output
    assert "use_dora=False" in run("validate", config, "--detailed").output
    bad = run("validate", config, "--set", "lora.use_dora=3")
    assert bad.exit_code == 2 and "lora.use_dora" in bad.stderr


def _words_config(tmp_path, train_text, model=None):
    """A from-scratch GPT-2 number-words run over ``train_text`` (or ``model``)."""
    (tmp_path / "train.jsonl").write_text(train_text)
    doc = yaml.safe_load((CONFIGS / "number-words-gpt2.yaml").read_text())
    doc["model"]["tokenizer"] = str(WORDS / "tokenizer.gguf")
    if model is not None:
        doc["model"] = {"path": str(model)}
    doc["data"] |= {"train": "train.jsonl", "validation": None}
    doc["training"].pop("eval_every")  # no validation data: nothing to evaluate
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def test_validate_refuses_what_train_would(tmp_path):
    rows = (WORDS / "train.jsonl").read_text().splitlines(keepends=True)[:100]
    good = run("validate", _words_config(tmp_path, "".join(rows)))
    assert good.exit_code == 0, good.output
    assert re.search(
        r"Data train: 100 rows, [\d,]+ tokens, .* 100 sequences", good.output
    )
    assert "Steps: 300 (3 per epoch)" in good.output
    fake = tmp_path / "model.gguf"
    fake.write_text("a text file named like a model\n")
    cut = rows[50].index('"completion"')  # the line ends after '"prompt": "...", '
    cases = [
        ("".join(rows[:50]) + rows[50][:cut] + "\n", f"line 51, column {cut + 1}:"),
        ("", "train.jsonl: holds no records"),
        (rows[0].replace("completion", "answer"), "line 1, column 'completion'"),
    ]
    for text, message in cases:
        result = run("validate", _words_config(tmp_path, text))
        assert result.exit_code == 2 and message in result.stderr, result.output
    result = run("validate", _words_config(tmp_path, "".join(rows), model=fake))
    assert result.exit_code == 2 and "model.gguf: magic" in result.stderr


BROKEN = [
    (
        {"training": {"epochz": 3}},
        "training.epochz: unknown key; did you mean 'epochs'?",
    ),
    ({"data": {"batch_size": "big"}}, "data.batch_size: expected an integer"),
    ({"optimizer": {"lr": -1}}, "optimizer.lr: must be > 0, got -1"),
    ({"data": {"train": "missing.parquet"}}, "data.train: file not found"),
    ({"optimizer": {"name": "adamm"}}, "optimizer.name: must be one of"),
]


@pytest.mark.parametrize(
    ("change", "message"),
    BROKEN,
    ids=["typo", "type", "negative-lr", "missing-file", "unknown-optimizer"],
)
def test_broken_configs_exit_2_with_one_line_naming_the_key(
    tiny_config, change, message
):
    doc = yaml.safe_load(tiny_config.read_text())
    for section, values in change.items():
        doc[section] = {**doc[section], **values}
    tiny_config.write_text(yaml.safe_dump(doc))
    for command in ("validate", "train"):
        result = run(command, tiny_config)
        assert result.exit_code == 2, result.output
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"error: {message}")
        assert "Traceback" not in result.output


def test_verbose_adds_the_traceback(tiny_config):
    tiny_config.write_text(tiny_config.read_text().replace("lr: 0.01", "lr: -1"))
    result = run("validate", tiny_config, "--verbose")
    assert result.exit_code == 2
    assert "Traceback" in result.stderr and "ConfigError" in result.stderr


def test_usage_errors_exit_2(tiny_config):
    assert run("validate").exit_code == 2
    assert run("train", tiny_config, "--lr", "fast").exit_code == 2
    assert run("frobnicate").exit_code == 2


def test_train_writes_metrics_checkpoints_and_model(tiny_config, tmp_path):
    out = tmp_path / "o"
    result = run(
        "train",
        tiny_config,
        "--max-steps",
        "3",
        "--lr",
        "0.05",
        "--output-dir",
        out,
        "--seed",
        "2",
        "--no-progress",
    )
    assert result.exit_code == 0, result.output
    used = json.loads((out / "config.json").read_text())
    assert used["optimizer"]["lr"] == 0.05
    assert used["training"]["max_steps"] == 3 and used["training"]["seed"] == 2
    steps = [json.loads(x)["step"] for x in (out / "metrics.jsonl").open()]
    assert max(steps) == 3
    assert sorted(os.listdir(out / "checkpoints")) == ["2", "3"]
    assert load_built(str(out / "model.safetensors")).config.sizes == (13, 8, 3)


def test_epochs_override_replaces_max_steps(tiny_config, tmp_path):
    result = run(
        "train",
        tiny_config,
        "--epochs",
        "1",
        "--batch-size",
        "71",
        "--output-dir",
        tmp_path / "e",
        "--no-progress",
    )
    assert result.exit_code == 0, result.output
    assert "steps=2" in result.output  # 142 rows / 71 per step, one epoch


def test_set_overrides_any_key(tiny_config, tmp_path):
    result = run(
        "train",
        tiny_config,
        "--set",
        "lora.rank=2",
        "--set",
        "lora.targets=all-linear",
        "--dry-run",
    )
    assert result.exit_code == 0, result.output
    assert "trainable_parameters" in result.output
    bad = run("train", tiny_config, "--set", "lora.rnak=2", "--dry-run")
    assert bad.exit_code == 2
    assert "lora.rnak: unknown key; did you mean 'rank'?" in bad.stderr


def test_resume_continues(tiny_config, tmp_path):
    out = tmp_path / "r"
    first = run(
        "train", tiny_config, "--max-steps", "2", "--output-dir", out, "--no-progress"
    )
    assert first.exit_code == 0, first.output
    again = run(
        "train",
        tiny_config,
        "--max-steps",
        "4",
        "--output-dir",
        out,
        "--resume",
        "latest",
        "--no-progress",
    )
    assert again.exit_code == 0, again.output
    steps = [
        json.loads(x)["step"]
        for x in (out / "metrics.jsonl").open()
        if "loss" in json.loads(x)
    ]
    assert steps == [1, 2, 3, 4]
    resumed = f"resuming from step 2 (checkpoint {out / 'checkpoints' / '2'})"
    assert again.stderr.splitlines().count(resumed) == 1
    assert "resuming" not in first.stderr


def test_a_refused_run_leaves_the_earlier_runs_files(tiny_config, tmp_path):
    """A run refused for its folder leaves the earlier run's files as they were.

    Refused: the folder holds another run's checkpoints, or --resume names no
    checkpoint. Before, config.json was overwritten with the refused run's config.
    """
    out = tmp_path / "r"
    first = run(
        "train", tiny_config, "--max-steps", "4", "--output-dir", out, "--no-progress"
    )
    assert first.exit_code == 0, first.output
    files = {p: p.read_bytes() for p in out.iterdir() if p.is_file()}
    for extra in ([], ["--resume", tmp_path / "nowhere"]):
        again = run(
            "train", tiny_config, "--max-steps", "2", "--lr", "0.5",
            "--output-dir", out, "--no-progress", *extra,
        )  # fmt: skip
        assert again.exit_code == 2 and again.output.startswith("error: ")
        assert {p: p.read_bytes() for p in out.iterdir() if p.is_file()} == files


def test_quantize_writes_a_file_info_and_load_model_read(tmp_path):
    out = tmp_path / "q.safetensors"
    result = run(
        "quantize",
        MODELS / "wine-mlp.safetensors",
        "-o",
        out,
        "--scheme",
        "int8",
        "--block-size",
        "8",
        "--calibration-data",
        WINE / "validation.parquet",
    )
    assert result.exit_code == 0, result.output
    assert "after: {'examples': 36" in result.output
    info = json.loads(run("info", out, "--format", "json").output)
    assert info["quantization"]["layers.1.weight"]["scheme"] == "int8"
    assert info["parameters"] == 13 * 32 + 32 + 32 * 3 + 3
    stored = io.load_model(out).params["layers"]["1"]["weight"]
    assert stored["codes"].dtype == np.int8
    back = load_built(str(out)).params["layers"][1]["weight"]
    ref = quant.quantize(
        load_built(str(MODELS / "wine-mlp.safetensors")).params["layers"][1]["weight"],
        "int8",
        block_size=8,
    )
    np.testing.assert_array_equal(back.codes, ref.codes)


def test_quantize_a_llama_to_gguf(tmp_path):
    cfg = nn.LlamaConfig(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=128,
        num_layers=1,
        num_heads=2,
        num_kv_heads=2,
    )
    src = tmp_path / "l.gguf"
    io.save_llama_gguf(src, cfg, cfg.init(jax.random.key(0)))
    out = tmp_path / "l-q8.gguf"
    result = run("quantize", src, "-o", out, "--bits", "8")
    assert result.exit_code == 0, result.output
    info = json.loads(run("info", out, "--format", "json").output)
    assert info["types"]["Q8_0"] > 0 and info["architecture"] == "llama"
    assert io.load_model(out).metadata.architecture == "llama"
    assert (
        run("quantize", src, "-o", tmp_path / "x.gguf", "--scheme", "nf4").exit_code
        == 2
    )


def test_quantize_calibration_shows_progress_and_loads_the_original_once(
    tmp_path, monkeypatch
):
    from entrenar.runs import evaluate, quantize

    cfg = nn.LlamaConfig(
        vocab_size=320, hidden_size=32, intermediate_size=64, num_layers=1,
        num_heads=2, num_kv_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    src, out = tmp_path / "l.gguf", tmp_path / "q.gguf"
    params = cfg.init(jax.random.key(0))
    io.save_llama_gguf(src, cfg, params, source=WORDS / "tokenizer.gguf")
    calib = tmp_path / "calib.jsonl"
    calib.write_text("".join((WORDS / "validation.jsonl").open().readlines()[:12]))
    loads = []
    for module in (evaluate, quantize):
        monkeypatch.setattr(
            module, "load_built", lambda p, **kw: loads.append(p) or load_built(p, **kw)
        )
    result = run("quantize", src, "-o", out, "--bits", "8", "--calibration-data", calib)
    assert result.exit_code == 0, result.output
    stages = result.stderr.splitlines()
    assert stages[0] == f"quantizing {src} to q8_0"
    assert any(s.startswith(f"wrote {out} (") for s in stages)
    assert any(s.startswith(f"evaluating {out} on ") for s in stages)
    assert loads == [str(src), str(out)]  # the original is loaded once, not twice
    assert "before: {'tokens'" in result.output and "after: {'tokens'" in result.output


def test_merge_writes_a_file_info_and_load_model_read(tmp_path):
    out = tmp_path / "m.safetensors"
    a, b = MODELS / "wine-mlp-ft-a.safetensors", MODELS / "wine-mlp-ft-b.safetensors"
    result = run("merge", a, b, "-o", out, "--method", "average")
    assert result.exit_code == 0, result.output
    assert json.loads(run("info", out, "--format", "json").output)["tensors"] == 4
    merged = io.load_model(out).params
    ref = [io.load_model(p).params for p in (a, b)]
    w = merged["layers"]["0"]["weight"]
    np.testing.assert_allclose(
        w,
        (ref[0]["layers"]["0"]["weight"] + ref[1]["layers"]["0"]["weight"]) / 2,
        rtol=1e-6,
    )
    recipe = run(
        "merge",
        "--config",
        CONFIGS / "wine-merge.yaml",
        "-o",
        tmp_path / "r" / "ties.safetensors",
    )
    assert recipe.exit_code == 0, recipe.output
    assert io.load_model(tmp_path / "r" / "ties.safetensors").metadata.name


def test_merge_takes_the_books_method_dare_as_dare_linear(tmp_path):
    # the book's `entrenar merge a b -o m --method dare --density 0.3`: before, click
    # refused 'dare' (not one of ties, dare_ties, dare_linear, ...)
    a, b = MODELS / "wine-mlp-ft-a.safetensors", MODELS / "wine-mlp-ft-b.safetensors"
    base = MODELS / "wine-mlp.safetensors"
    out = {}
    for method in ("dare", "dare_linear"):
        out[method] = tmp_path / f"{method}.safetensors"
        args = ("--base", base, "--density", "0.3", "--seed", "3")
        result = run("merge", a, b, "-o", out[method], "--method", method, *args)
        assert result.exit_code == 0, result.output
    dare, linear = (io.load_model(out[m]).params for m in ("dare", "dare_linear"))
    jax.tree.map(np.testing.assert_array_equal, dare, linear)
    w = io.load_model(base).params["layers"]["0"]["weight"]
    assert not np.array_equal(dare["layers"]["0"]["weight"], w)  # it merged


def test_info_of_a_config_in_every_format():
    for fmt, parse in (("json", json.loads), ("yaml", yaml.safe_load)):
        result = run("info", CONFIGS / "wine-mlp.yaml", "--format", fmt)
        assert result.exit_code == 0, result.output
        data = parse(result.output)
        assert data["summary"]["model"]["parameters"] == 13 * 32 + 32 + 32 * 3 + 3
        assert data["config"]["optimizer"]["name"] == "adamw"


def test_eval_and_plot(tiny_config, tmp_path):
    assert run("train", tiny_config, "--no-progress").exit_code == 0
    result = run("eval", tiny_config, "--format", "json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["examples"] == 36
    png = tmp_path / "loss.png"
    assert run("plot", tmp_path / "run", "-o", png).exit_code == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_generate_and_the_context_limit(tmp_path):
    cfg = nn.LlamaConfig(
        vocab_size=320,
        hidden_size=32,
        intermediate_size=64,
        num_layers=1,
        num_heads=2,
        num_kv_heads=2,
        max_position_embeddings=32,
    )
    model = tmp_path / "lm.gguf"
    io.save_llama_gguf(model, cfg, cfg.init(jax.random.key(0)))
    tok = WORDS / "tokenizer.gguf"
    result = run(
        "generate",
        model,
        "--tokenizer",
        tok,
        "-p",
        "12 in words:",
        "--max-new-tokens",
        "4",
    )
    assert result.exit_code == 0, result.output
    too_long = run(
        "generate",
        model,
        "--tokenizer",
        tok,
        "-p",
        "12 in words:",
        "--max-new-tokens",
        "40",
    )
    assert too_long.exit_code == 2
    assert "exceeds the model's context of 32 tokens" in too_long.stderr


def test_completion_script():
    result = run("--completion", "bash")
    assert result.exit_code == 0 and "_ENTRENAR_COMPLETE" in result.output


def test_python_dash_m_entrenar_in_a_subprocess(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        (CONFIGS / "wine-mlp.yaml")
        .read_text()
        .replace("lr: 0.01", "lr: -1")
        .replace("../data", str(REPO / "examples" / "data"))
    )
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    ok = subprocess.run(
        [sys.executable, "-m", "entrenar", "validate", str(CONFIGS / "wine-mlp.yaml")],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert ok.returncode == 0, ok.stderr
    assert "Configuration is valid" in ok.stdout
    failed = subprocess.run(
        [sys.executable, "-m", "entrenar", "validate", str(bad)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert failed.returncode == 2
    assert failed.stderr.strip() == "error: optimizer.lr: must be > 0, got -1"


def test_a_resumed_run_says_so_once_in_a_subprocess(tiny_config, tmp_path):
    """The line that says where a run resumes is printed once.

    Before: twice, the second as ``INFO:entrenar.train.trainer:...`` from the
    stderr handler that importing orbax installs on the root logger.
    """
    out = tmp_path / "r"
    train = [sys.executable, "-m", "entrenar", "train", str(tiny_config),
             "--output-dir", str(out), "--no-progress"]  # fmt: skip
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    for extra in (["--max-steps", "2"], ["--max-steps", "4", "--resume", "latest"]):
        done = subprocess.run(
            train + extra, capture_output=True, text=True, env=env, timeout=300
        )
        assert done.returncode == 0, done.stderr
    lines = [x for x in done.stderr.splitlines() if "resuming from step 2" in x]
    assert lines == [f"resuming from step 2 (checkpoint {out / 'checkpoints' / '2'})"]


def test_quantize_with_the_books_bits_and_method(tmp_path):
    out = tmp_path / "a8.safetensors"
    result = run(
        "quantize",
        MODELS / "wine-mlp.safetensors",
        "-o",
        out,
        "--bits",
        "8",
        "--method",
        "asymmetric",
        "--block-size",
        "16",
    )
    assert result.exit_code == 0, result.output
    w = load_built(str(out)).params["layers"][1]["weight"]
    assert w.scheme == "int8" and w.codes.dtype == np.uint8 and w.offsets is not None
    clash = run(
        "quantize",
        MODELS / "wine-mlp.safetensors",
        "-o",
        out,
        "--bits",
        "8",
        "--scheme",
        "q4_0",
    )
    assert clash.exit_code == 2 and "--bits 8 contradicts --scheme q4_0" in clash.stderr
