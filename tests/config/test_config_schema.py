"""The schema: every key checked, errors that name the key, aliases, overrides."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from config_cases import CONFIGS, WINE, wine_doc, wine_yaml_factory, write
from hypothesis import given
from hypothesis import strategies as st

from entrenar.config import load_config, validate
from entrenar.config.docs import render
from entrenar.errors import ConfigError
from entrenar.runs.models import dicts_from_lists, lists_from_dicts


@pytest.fixture
def wine_yaml(tmp_path):
    """``wine_yaml(**sections) -> path`` of a tiny wine run (config_cases)."""
    return wine_yaml_factory(tmp_path)


SHIPPED = sorted(CONFIGS.glob("*.yaml"))


def test_there_are_shipped_configs():
    names = {p.name for p in SHIPPED}
    assert {
        "wine-mlp.yaml",
        "wine-distill.yaml",
        "wine-merge.yaml",
        "number-words-gpt2.yaml",
        "number-words-gpt2-lora.yaml",
    } <= names


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_every_shipped_config_validates(path):
    spec = validate(path)
    assert spec.source == str(path.resolve())


def _error(tmp_path: Path, doc: dict) -> str:
    with pytest.raises(ConfigError) as e:
        load_config(write(tmp_path / "bad.yaml", doc))
    return str(e.value)


def _broken(tmp_path: Path, section: str, key: str, value):
    doc = wine_doc(tmp_path / "run")
    doc[section] = {**doc.get(section, {}), key: value}
    return _error(tmp_path, doc)


def test_typo_names_the_key_and_the_closest_valid_one(tmp_path):
    msg = _broken(tmp_path, "training", "epochz", 3)
    assert msg.startswith("training.epochz: unknown key; did you mean 'epochs'?")


def test_typo_of_a_section(tmp_path):
    doc = wine_doc(tmp_path / "run")
    doc["optimiser"] = doc.pop("optimizer")
    assert _error(tmp_path, doc).startswith(
        "optimiser: unknown key; did you mean 'optimizer'?"
    )


def test_wrong_type(tmp_path):
    msg = _broken(tmp_path, "data", "batch_size", "eight")
    assert msg == "data.batch_size: expected an integer, got 'eight' (string)"
    assert _broken(tmp_path, "training", "max_steps", True).startswith(
        "training.max_steps: expected an integer, got True"
    )
    assert _broken(tmp_path, "lora", "targets", 3) == (
        "lora.targets: expected a list of string, got 3 (integer)"
    )
    assert _broken(tmp_path, "lora", "targets", ["q", 3]) == (
        "lora.targets[1]: expected a string, got 3 (integer)"
    )


def test_gguf_expert_type_is_a_type_or_unset(tmp_path):
    msg = _broken(tmp_path, "export", "gguf_expert_type", "MXFP8")
    assert msg.startswith("export.gguf_expert_type: "), msg
    assert "'MXFP4'" in msg


def test_negative_lr(tmp_path):
    assert _broken(tmp_path, "optimizer", "lr", -1) == (
        "optimizer.lr: must be > 0, got -1"
    )


def test_out_of_range(tmp_path):
    assert _broken(tmp_path, "data", "validation_split", 1.0) == (
        "data.validation_split: must be < 1, got 1"
    )
    assert _broken(tmp_path, "lora", "dropout", -0.1).startswith("lora.dropout:")


def test_missing_file(tmp_path):
    msg = _broken(tmp_path, "data", "train", "nope.parquet")
    assert msg == f"data.train: file not found: {tmp_path / 'nope.parquet'}"


def test_unknown_optimizer(tmp_path):
    msg = _broken(tmp_path, "optimizer", "name", "adamm")
    assert msg == (
        "optimizer.name: must be one of ['sgd', 'adam', 'adamw', 'adam_8bit', "
        "'adamw_8bit'], got 'adamm'; "
        "did you mean 'adam'?"
    )


def test_hyperparameter_of_another_optimizer(tmp_path):
    msg = _broken(tmp_path, "optimizer", "momentum", 0.9)
    assert msg.startswith("optimizer.momentum: adam does not use momentum")


def test_model_config_sizes_are_checked(tmp_path):
    doc = wine_doc(tmp_path / "run")
    doc["model"]["config"]["sise"] = [1, 2]
    assert _error(tmp_path, doc).startswith(
        "model.config.sise: unknown key; did you mean 'sizes'?"
    )
    doc = wine_doc(tmp_path / "run")
    doc["model"] = {"architecture": "gpt2", "config": {"n_embd": 30, "n_head": 4}}
    doc["data"] = {"train": str(WINE / "train.parquet"), "format": "text"}
    with pytest.raises(ConfigError, match=r"^model\.config: .*divisible by n_head"):
        validate(write(tmp_path / "g.yaml", doc))
    for key, arch in (("layer_norm_epsilon", "gpt2"), ("rms_norm_eps", "llama")):
        doc["model"] = {"architecture": arch, "config": {key: -1e-5}}  # NaN logits
        with pytest.raises(ConfigError, match=rf"{key} must be a finite number > 0"):
            validate(write(tmp_path / "g.yaml", doc))


def test_required_keys(tmp_path):
    doc = wine_doc(tmp_path / "run")
    del doc["data"]["train"]
    assert _error(tmp_path, doc).startswith("data.train: required key is missing")
    del doc["data"]
    assert _error(tmp_path, doc).startswith("data: required key is missing")


def test_format_must_fit_the_model(tmp_path):
    msg = _broken(tmp_path, "data", "format", "chat")
    assert msg.startswith("data:") or msg.startswith("data.format:")


def test_bad_yaml_and_empty_file(tmp_path):
    p = tmp_path / "x.yaml"
    p.write_text("model: [unclosed\n")
    with pytest.raises(ConfigError, match=r"not valid YAML \(line"):
        load_config(p)
    p.write_text("")
    with pytest.raises(ConfigError, match="empty"):
        load_config(p)


def test_the_books_keys_are_accepted(tmp_path):
    doc = {
        "model": {
            "path": str(CONFIGS.parent / "models" / "wine-mlp.safetensors"),
            "type": "mlp",
        },
        "data": {
            "train": str(WINE / "train.parquet"),
            "batch_size": 4,
            "target": "cultivar",
        },
        "optimizer": {
            "name": "adamw",
            "lr": "1e-4",
            "beta1": 0.9,
            "beta2": 0.999,
            "weight_decay": 0.01,
        },
        "training": {
            "epochs": 3,
            "grad_clip": 1.0,
            "output_dir": "./checkpoints",
            "save_interval": 1000,
        },
        "lora": {
            "enabled": False,
            "rank": 64,
            "alpha": 16,
            "target_modules": ["layers"],
        },
        "quantization": {"enabled": False, "bits": 4},
    }
    spec = load_config(write(tmp_path / "book.yaml", doc))
    assert spec.optimizer.lr == 1e-4  # YAML reads 1e-4 as a string
    assert spec.training.checkpoint_every == 1000
    assert spec.lora is not None and spec.lora.targets == ("layers",)
    assert spec.quantization is not None and spec.quantization.bits == 4
    assert spec.model_architecture == "mlp"


def test_key_and_alias_together_is_an_error(tmp_path):
    doc = wine_doc(tmp_path / "run")
    doc["training"]["save_interval"] = 5
    doc["training"]["checkpoint_every"] = 6
    assert "given twice" in _error(tmp_path, doc)


def test_overrides_override(wine_yaml):
    path = wine_yaml()
    spec = load_config(
        path,
        {
            "optimizer.lr": 0.5,
            "training.max_steps": 2,
            "lora.rank": 4,
            "lora.targets": ["layers"],
        },
    )
    assert spec.optimizer.lr == 0.5
    assert spec.training.max_steps == 2
    assert spec.lora is not None and spec.lora.rank == 4
    assert load_config(path, {"training.max_steps": None}).training.max_steps is None
    with pytest.raises(ConfigError, match=r"^optimizer\.lrr: unknown key; did you"):
        load_config(path, {"optimizer.lrr": 1.0})
    with pytest.raises(ConfigError, match=r"^optimizer\.lr: must be > 0"):
        load_config(path, {"optimizer.lr": 0})


def test_relative_inputs_follow_the_config_file(tmp_path):
    (tmp_path / "sub").mkdir()
    doc = wine_doc(tmp_path / "run")
    doc["data"]["train"] = str(Path("..") / "sub" / "t.csv")
    doc["data"]["validation"] = None
    del doc["training"]["eval_every"]  # no validation data: nothing to evaluate
    (tmp_path / "sub" / "t.csv").write_text("a,cultivar\n1,0\n")
    (tmp_path / "cfg").mkdir()
    spec = load_config(write(tmp_path / "cfg" / "run.yaml", doc))
    assert spec.data is not None
    assert spec.data.train == str(tmp_path / "sub" / "t.csv")


@pytest.mark.parametrize("name", ["cosine_decay_schedule", "cosine_decay"])
def test_optax_schedule_names(wine_yaml, name):
    spec = load_config(wine_yaml(scheduler={"name": name}))
    assert spec.scheduler is not None and spec.scheduler.name == "cosine_decay"


def test_spec_document_is_in_sync():
    doc = (Path(__file__).parents[2] / "specs" / "config.md").read_text()
    assert doc == render(), "run: python -m entrenar.config.docs > specs/config.md"


def test_every_section_key_is_documented():
    doc = render()
    for key in (
        "grad_accum",
        "quantize_base",
        "gguf_type",
        "gguf_expert_type",
        "temperature",
        "seq_len",
        "warmup_steps",
        "early_stopping.patience",
        "keep_quantized",
    ):
        assert f"`{key}`" in doc


trees = st.recursive(
    st.integers(),
    lambda inner: (
        st.lists(inner, min_size=1, max_size=3)
        | st.dictionaries(
            st.sampled_from(["a", "b", "w"]), inner, min_size=1, max_size=3
        )
    ),
    max_leaves=8,
)


@given(trees)
def test_lists_round_trip_through_named_dicts(tree):
    assert lists_from_dicts(dicts_from_lists(tree)) == tree


@given(st.floats(allow_nan=False, allow_infinity=False))
def test_lr_accepted_iff_positive(tmp_path_factory, lr):
    path = write(tmp_path_factory.mktemp("lr") / "r.yaml", wine_doc(Path("/tmp/x")))
    if lr > 0:
        assert load_config(path, {"optimizer.lr": lr}).optimizer.lr == lr
    else:
        with pytest.raises(ConfigError, match=r"^optimizer\.lr: must be > 0"):
            load_config(path, {"optimizer.lr": lr})


def test_yaml_is_read_safely(tmp_path):
    p = tmp_path / "evil.yaml"
    p.write_text("model: !!python/object/apply:os.system ['echo hi']\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(p)
    assert yaml.safe_load("a: 1") == {"a": 1}


def test_export_formats_follow_the_family(tmp_path):
    """Exports in the forms the family has: a qwen2 has hf and gguf, a gpt2 no GGUF."""
    doc = yaml.safe_load((CONFIGS / "number-words-gpt2.yaml").read_text())
    doc["model"]["tokenizer"] = str(CONFIGS / doc["model"]["tokenizer"])
    for key in ("train", "validation"):
        doc["data"][key] = str(CONFIGS / doc["data"][key])
    doc["export"] = {"formats": ["gguf"]}
    with pytest.raises(ConfigError, match=r"^export\.formats: .*\(gpt2\) has no gguf"):
        validate(write(tmp_path / "g.yaml", doc))
    doc["model"] = {
        "architecture": "qwen2",
        "tokenizer": doc["model"]["tokenizer"],
        "config": {"vocab_size": 320, "hidden_size": 32, "intermediate_size": 64,
                   "num_layers": 1, "num_heads": 4, "num_kv_heads": 2},
    }  # fmt: skip
    doc["export"] = {"formats": ["hf", "gguf"]}
    assert validate(write(tmp_path / "q.yaml", doc)).model_architecture == "qwen2"


def test_the_tokenizer_may_be_a_hugging_face_tokenizer_json(tmp_path):
    doc = wine_doc(tmp_path / "run")
    folder = tmp_path / "tok"
    folder.mkdir()
    (folder / "vocab.txt").write_text("not a tokenizer")
    doc["model"]["tokenizer"] = str(folder)
    with pytest.raises(ConfigError, match=r"^model\.tokenizer: 'tok' is neither"):
        validate(write(tmp_path / "a.yaml", doc))
    (folder / "tokenizer.json").write_text("{}")
    doc["model"]["tokenizer"] = str(folder / "tokenizer.json")
    spec = load_config(write(tmp_path / "b.yaml", doc))
    assert spec.model.tokenizer.endswith("tokenizer.json")


@pytest.mark.parametrize("ext", [".ndjson", ".json"])
def test_json_lines_files_by_every_name_load_records_reads_are_accepted(tmp_path, ext):
    # load_records reads .ndjson and .json as JSON Lines (specs/data.md); a run's
    # data.train was refused: "'train.ndjson' is not one of .jsonl, .csv, .parquet"
    from entrenar.runs.preflight import preflight

    doc = yaml.safe_load((CONFIGS / "number-words-gpt2.yaml").read_text())
    words = CONFIGS.parent / "data" / "number_words"
    doc["model"]["tokenizer"] = str(words / "tokenizer.gguf")
    for key in ("train", "validation"):
        copy = tmp_path / f"{key}{ext}"
        copy.write_text((words / f"{key}.jsonl").read_text())
        doc["data"][key] = str(copy)
    spec = validate(write(tmp_path / "run.yaml", doc))
    report = preflight(spec, sample=16)
    assert report["data"]["train"].rows == 2000, report["data"]


@pytest.mark.parametrize(
    ("training", "message"),
    [
        ({"eval_every": 3}, "training.eval_every: evaluations need validation data"),
        ({"early_stopping": {"patience": 2}},
         "training.early_stopping.patience: evaluations need validation data"),
        ({"early_stopping": {}},  # patience 3 by default in a written section
         "or remove early_stopping"),
    ],
)  # fmt: skip
def test_evaluation_settings_without_validation_data_are_refused(
    tmp_path, training, message
):
    """Before, validate accepted them and train never evaluated, without a word."""
    doc = wine_doc(tmp_path / "run")
    del doc["data"]["validation"]
    doc["training"] = {"max_steps": 2, "output_dir": str(tmp_path / "run"), **training}
    assert message in _error(tmp_path, doc)
    doc["data"]["validation_split"] = 0.2  # a tabular split is validation data
    spec = load_config(write(tmp_path / "ok.yaml", doc))
    assert spec.has_validation
    doc["training"]["early_stopping"] = {"patience": None}  # null: never stop early
    del doc["data"]["validation_split"]
    doc["training"].pop("eval_every", None)
    load_config(write(tmp_path / "ok.yaml", doc))
