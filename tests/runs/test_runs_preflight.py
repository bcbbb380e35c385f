"""`preflight` (`entrenar validate`) refuses what `train` would, weights unread."""

from __future__ import annotations

import dataclasses
import json
import time

import jax
import pytest
import yaml
from config_cases import REPO, WORDS, write

from entrenar import data, io, nn
from entrenar.config import validate
from entrenar.config.summary import count_params
from entrenar.errors import ConfigError, FormatError, ShapeError
from entrenar.runs import load_built, train_from_yaml
from entrenar.runs.export import write_hf_folder
from entrenar.runs.models import read_header
from entrenar.runs.preflight import preflight

ROWS = [json.loads(x) for x in (WORDS / "train.jsonl").read_text().splitlines()[:40]]


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    """A 1-layer Llama GGUF of the number-words vocabulary (no tokenizer inside)."""
    cfg = nn.LlamaConfig(
        vocab_size=320, hidden_size=32, intermediate_size=64, num_layers=1,
        num_heads=2, num_kv_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    path = tmp_path_factory.mktemp("model") / "model.gguf"
    io.save_llama_gguf(path, cfg, cfg.init(jax.random.key(0)))
    return path


def _run(tmp_path, model, rows=ROWS, **data_keys):
    train = tmp_path / "train.jsonl"
    if isinstance(rows, str):
        train.write_text(rows)
    else:
        train.write_text("".join(json.dumps(r) + "\n" for r in rows))
    doc = {
        "model": {"path": str(model), "tokenizer": str(WORDS / "tokenizer.gguf")},
        "data": {"train": "train.jsonl", "format": "prompt_completion",
                 "batch_size": 4, "seq_len": 12, **data_keys},
        "training": {"max_steps": 3, "output_dir": str(tmp_path / "out")},
    }  # fmt: skip
    return validate(write(tmp_path / "run.yaml", doc))


def test_counts_are_those_of_the_loader_train_builds(tmp_path, tiny_gguf):
    report = preflight(_run(tmp_path, tiny_gguf))
    tok = data.load_fast_tokenizer(WORDS / "tokenizer.gguf")
    fields = {"prompt": "prompt", "completion": "completion"}
    loader = data.lm_loader(
        ROWS, tok, format="prompt_completion", seq_len=12, batch_size=4,
        fields=fields, drop_last=True,
    )  # fmt: skip
    plan = report["data"]["train"]
    assert plan.exact and plan.rows == 40
    assert plan.sequences == 40 and plan.steps == len(loader) == 10
    assert plan.kept == loader.tokens_per_epoch() < plan.tokens  # some cut at 12
    assert plan.tokens == sum(len(i) for i, _ in data.encode_records(
        ROWS, tok, format="prompt_completion"))  # fmt: skip
    config = io.read_llama_header(tiny_gguf)[1]
    assert report["model"]["parameters"] == count_params(config)
    assert report["steps"] == 3


def test_a_sample_estimates_the_counts(tmp_path, tiny_gguf):
    plan = preflight(_run(tmp_path, tiny_gguf), sample=10)["data"]["train"]
    assert not plan.exact and plan.sampled == 10 and plan.rows == 40
    exact = preflight(_run(tmp_path, tiny_gguf))["data"]["train"]
    assert abs(plan.tokens - exact.tokens) < 0.2 * exact.tokens


def test_the_model_header_is_read_not_its_tensors(tmp_path, tiny_gguf, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("preflight read tensor data")

    monkeypatch.setattr(io.GGUFFile, "raw", refuse)
    monkeypatch.setattr(io.GGUFFile, "tensor", refuse)
    assert preflight(_run(tmp_path, tiny_gguf))["model"]["architecture"] == "llama"


def test_a_text_file_named_model_gguf_is_refused(tmp_path):
    fake = tmp_path / "model.gguf"
    fake.write_text("this is a text file, not a model\n")
    with pytest.raises(FormatError, match=r"model\.path: .*model\.gguf: magic"):
        preflight(_run(tmp_path, fake))


def test_a_truncated_tensor_table_is_refused(tmp_path, tiny_gguf):
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(tiny_gguf.read_bytes()[:-100])
    with pytest.raises(FormatError, match=r"cut\.gguf: tensor .* truncated"):
        preflight(_run(tmp_path, cut))


def test_a_malformed_line_names_file_line_and_column(tmp_path, tiny_gguf):
    text = "".join(json.dumps(r) + "\n" for r in ROWS[:5]) + '{"prompt": "1 in'
    with pytest.raises(FormatError, match=r"train\.jsonl line 6, column 12: invalid"):
        preflight(_run(tmp_path, tiny_gguf, text))


def test_an_empty_file_is_named(tmp_path, tiny_gguf):
    with pytest.raises(ConfigError, match=r"train\.jsonl: holds no records"):
        preflight(_run(tmp_path, tiny_gguf, ""))


def test_every_row_is_checked_not_only_the_sample(tmp_path, tiny_gguf):
    rows = [*ROWS[:30], {"prompt": "7 in words:"}, *ROWS[30:]]
    spec = _run(tmp_path, tiny_gguf, rows)
    with pytest.raises(FormatError, match=r"line 31, column 'completion': missing"):
        preflight(spec, sample=5)


def test_a_model_without_a_tokenizer_names_it_and_every_kind_of_fix(
    tmp_path, tiny_gguf
):
    """The message names the model file and each kind of tokenizer that serves.

    Before: "name a .gguf whose tokenizer to use", though a tokenizer.json or its
    folder serves as well, and no file named.
    """
    spec = _run(tmp_path, tiny_gguf)
    spec = dataclasses.replace(
        spec, model=dataclasses.replace(spec.model, tokenizer=None)
    )
    with pytest.raises(ConfigError) as e:
        preflight(spec)
    assert str(e.value) == (
        f"model.tokenizer: {tiny_gguf} has no tokenizer; set model.tokenizer to a "
        ".gguf whose tokenizer to use, or to a tokenizer.json (or the folder "
        "holding it)"
    )


@pytest.mark.parametrize(
    ("lora", "match"),
    [
        ({"targets": ["qq_proj"]},
         r"^lora\.targets: LoRA targets \('qq_proj',\) matched no weight.*'q_proj'"),
        ({"quantize_base": "nf4"},
         r"^lora\.quantize_base: QLoRA cannot quantize the base of .*blocks of 64.*"
         r"lora\.quantize_base: none"),
    ],
)  # fmt: skip
def test_lora_settings_train_refuses_are_refused_without_weights(
    lora, match, tmp_path, tiny_gguf
):
    """`entrenar validate` refuses the LoRA settings `train` refuses.

    Targets that match nothing, QLoRA bases that do not split into NF4 blocks:
    `train` refuses them after loading the weights, validate from the header.

    Before: validate said the config was valid (hidden size 32, nf4 blocks of 64).
    """
    _run(tmp_path, tiny_gguf)
    doc = yaml.safe_load((tmp_path / "run.yaml").read_text())
    path = write(tmp_path / "lora.yaml", {**doc, "lora": lora})
    with pytest.raises(ConfigError, match=match):
        preflight(validate(path))
    with pytest.raises(ConfigError, match=match):
        train_from_yaml(path, dry_run=True, progress=False)


def test_too_few_rows_for_a_step(tmp_path, tiny_gguf):
    """A configuration error naming the key, the file and what to change.

    Before: ArrayLoader's ShapeError (exit code 1) advising "pass drop_last=False",
    which no YAML key sets.
    """
    with pytest.raises(
        ConfigError, match=r"^data\.batch_size: .*train\.jsonl has fewer rows than "
        r"batch_size × grad_accum = 4, one optimizer step; lower data\.batch_size"
    ):  # fmt: skip
        preflight(_run(tmp_path, tiny_gguf, ROWS[:3]))
    plan = preflight(_run(tmp_path, tiny_gguf, ROWS[:6]), sample=3)["data"]["train"]
    assert plan.sampled == 3 and plan.steps == 1  # a sample smaller than a batch


def test_headers_of_hf_folders_and_entrenar_files(tmp_path, tiny_gguf):
    built = load_built(str(tiny_gguf))
    folder = write_hf_folder(built, built.params, str(tmp_path / "hf"))
    head = read_header(folder)
    assert head.config == built.config and head.architecture == "llama"
    assert jax.tree_util.tree_structure(head.params) == jax.tree_util.tree_structure(
        built.params
    )
    (tmp_path / "hf" / "model.safetensors").write_bytes(b"\x08" + b"\x00" * 7 + b"{")
    with pytest.raises(FormatError, match=r"model\.safetensors"):
        read_header(folder)
    gpt2 = REPO / "examples" / "models" / "number-words-gpt2.safetensors"
    head = read_header(str(gpt2))
    assert head.config == load_built(str(gpt2)).config and head.tokenizer is not None


def test_the_shipped_smollm2_config_in_seconds_weights_unread(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("preflight read tensor data")

    monkeypatch.setattr(io.GGUFFile, "raw", refuse)
    start = time.perf_counter()
    report = preflight(validate(REPO / "examples" / "configs" / "smollm2-qlora.yaml"))
    assert time.perf_counter() - start < 30  # ~2 s alone; the machine may be busy
    assert report["model"]["vocabulary"] == 49152
    assert report["data"]["train"].rows == 320 and report["steps"] == 40


def test_format_auto_reads_the_format_from_the_fields(tmp_path, tiny_gguf):
    """``data.format: auto`` (the default) trains prompt-completion rows as such.

    It read every language model's data as text: prompt-completion rows were refused
    (no ``text`` column), and rows that also held a ``text`` column trained on it,
    where ``entrenar eval`` and `lm_loader` read the same file as prompt-completion.
    """
    want = preflight(_run(tmp_path, tiny_gguf))["data"]["train"]
    with_text = [{**r, "text": "unrelated"} for r in ROWS]
    for rows in (ROWS, with_text):
        plan = preflight(_run(tmp_path, tiny_gguf, rows, format="auto"))
        assert plan["data"]["train"] == dataclasses.replace(
            want, path=plan["data"]["train"].path
        )
    renamed = [{"q": r["prompt"], "a": r["completion"]} for r in ROWS]
    keys = dict(format="auto", prompt_field="q", completion_field="a")
    assert (
        preflight(_run(tmp_path, tiny_gguf, renamed, **keys))["data"]["train"].trained
        == want.trained
    )


def test_rows_without_a_loss_within_seq_len_are_counted(tmp_path, tiny_gguf):
    """A prompt that fills seq_len leaves its record out; validate says how many."""
    from entrenar.runs.preflight import format_preflight

    long = {"prompt": " ".join(["3577 in words:"] * 6), "completion": " lost"}
    report = preflight(_run(tmp_path, tiny_gguf, [*ROWS, long]))
    plan = report["data"]["train"]
    assert plan.unlabelled == 1 and plan.sequences == 40
    assert "; 1 rows left out: no loss within seq_len" in "\n".join(
        format_preflight(report)
    )


def test_overflow_split_keeps_every_token_of_long_examples(tmp_path, tiny_gguf):
    """``data.overflow: split`` cuts a long example into rows of seq_len, none lost.

    Before: a run could only truncate (`TextLoader`'s ``overflow`` had no YAML key).
    """
    cut = preflight(_run(tmp_path, tiny_gguf))["data"]["train"]
    split = preflight(_run(tmp_path, tiny_gguf, overflow="split"))["data"]["train"]
    assert cut.kept < split.kept <= split.tokens == cut.tokens
    assert split.sequences + split.unlabelled > cut.sequences == 40
    assert split.unlabelled > 0  # prompt-only pieces: no loss, left out as TRL does


def test_overflow_error_names_the_file_and_the_keys(tmp_path, tiny_gguf):
    with pytest.raises(
        ShapeError, match=r"document \d+ has \d+ tokens, more than seq_len=12; .*"
        r"\(data\.seq_len, data\.overflow in a run config\)"
    ):  # fmt: skip
        preflight(_run(tmp_path, tiny_gguf, overflow="error"))
    ok = preflight(_run(tmp_path, tiny_gguf, seq_len=64, overflow="error"))
    assert ok["data"]["train"].kept == ok["data"]["train"].tokens


def test_only_a_short_file_is_reported_as_too_few_rows(tmp_path, tiny_gguf):
    """Other shape errors of the loader keep their own message.

    Before: every `ShapeError` while building the loader (the memory bound of
    ``seq_len``, a document over ``seq_len`` with ``overflow: error``) was reported
    as "fewer rows than batch_size × grad_accum".
    """
    with pytest.raises(ShapeError) as e:
        preflight(_run(tmp_path, tiny_gguf, overflow="error"))
    assert "fewer rows" not in str(e.value)


def test_validate_shows_pefts_trainable_count_with_per_layer_ranks(tmp_path):
    """`entrenar validate` prints the adapters' trainable parameters.

    With ranks by layer (lora.rank_pattern) the stacks are padded, but the count is
    of the real ranks: PEFT's count of the same model and patterns.
    """
    from click.testing import CliRunner

    from entrenar.cli import cli

    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    cfg = nn.LlamaConfig(
        vocab_size=320, hidden_size=32, intermediate_size=64, num_layers=2,
        num_heads=2, num_kv_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    model = tmp_path / "model.gguf"
    io.save_llama_gguf(model, cfg, cfg.init(jax.random.key(0)))
    patterns = {
        "rank_pattern": {"model.layers.1.self_attn.q_proj": 7, r".*\.0\.mlp\..*": 2},
        "alpha_pattern": {"v_proj": 3},
    }
    _run(tmp_path, model)
    doc = yaml.safe_load((tmp_path / "run.yaml").read_text())
    lora_keys = {"rank": 4, "targets": ["all-linear"], **patterns}
    path = write(tmp_path / "lora.yaml", {**doc, "lora": lora_keys})
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg.to_hf_config()))
    adapted = peft.get_peft_model(
        hf, peft.LoraConfig(r=4, target_modules="all-linear", **patterns)
    )
    want = sum(p.numel() for p in adapted.parameters() if p.requires_grad)
    result = CliRunner().invoke(cli, ["validate", str(path)])
    assert result.exit_code == 0, result.output
    assert f"LoRA: {want:,} trainable parameters" in result.output
