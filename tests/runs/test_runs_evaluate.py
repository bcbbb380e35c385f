"""``entrenar eval`` of chat data without a config: exact match, loss, --compare."""

from __future__ import annotations

import dataclasses
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from click.testing import CliRunner
from config_cases import WORDS, write

from entrenar import chat, data, io, nn
from entrenar.cli import cli
from entrenar.runs import evaluate, load_built

TEMPLATE = (
    "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)
CONFIG = nn.LlamaConfig(
    vocab_size=320, hidden_size=32, intermediate_size=64, num_layers=1,
    num_heads=2, num_kv_heads=2, max_position_embeddings=64,
)  # fmt: skip


def _conversation(n: int) -> dict:
    return {
        "messages": [
            {"role": "user", "content": f"{n} in words?"},
            {"role": "assistant", "content": f"{n}"},
        ]
    }


@pytest.fixture(scope="module")
def chat_models(tmp_path_factory):
    """Two tiny random Llama GGUFs (base, tuned) with a chat template, and chat data."""
    folder = tmp_path_factory.mktemp("chat")
    g = io.read_gguf(WORDS / "tokenizer.gguf")
    fields = dict(g.fields)
    fields["tokenizer.chat_template"] = io.GGUFField(TEMPLATE, io.GGUFValueType.STRING)
    io.write_gguf(folder / "tok.gguf", fields, {})
    for name, seed in (("base", 0), ("tuned", 1)):
        params = CONFIG.init(jax.random.key(seed))
        io.save_llama_gguf(
            folder / f"{name}.gguf", CONFIG, params, source=folder / "tok.gguf"
        )
    with open(folder / "chat.jsonl", "w") as f:
        for n in (3, 14, 159):
            f.write(json.dumps(_conversation(n)) + "\n")
    return folder


def _loss_on_replies(path, data_path) -> tuple[float, int]:
    """Mean loss over the assistant's tokens, computed one conversation at a time."""
    built = load_built(str(path))
    recs = data.load_records(data_path)
    total, count = 0.0, 0
    for ids, labels in data.encode_records(recs, built.tokenizer, format="chat"):
        logits = built.config.apply(built.params, jnp.asarray(ids)[None])[0]  # (T, V)
        logp = jax.nn.log_softmax(logits[:-1], axis=-1)  # predicts tokens 1..T-1
        at = np.nonzero(labels[1:] != data.IGNORE_INDEX)[0]
        total -= float(jnp.sum(logp[at, labels[1:][at]]))
        count += len(at)
    return total / count, count


def test_chat_eval_scores_the_replies(chat_models):
    model, path = chat_models / "tuned.gguf", str(chat_models / "chat.jsonl")
    out = evaluate.evaluate_model(str(model), path, fmt="chat")
    loss, tokens = _loss_on_replies(model, path)
    assert out["tokens"] == tokens and out["eval_loss"] == pytest.approx(loss, 1e-4)
    built = load_built(str(model))
    session = chat.ChatModel(built.config, built.params, built.tokenizer)
    em = chat.exact_match(session, data.load_records(path))
    assert (out["exact_match"], out["examples"]) == (em.accuracy, 3)


def test_rows_are_as_long_as_the_longest_conversation(chat_models, monkeypatch):
    lengths = []
    real = data.lm_loader

    def spy(*args, **kwargs):
        lengths.append(kwargs["seq_len"])
        return real(*args, **kwargs)

    monkeypatch.setattr(data, "lm_loader", spy)
    path = str(chat_models / "chat.jsonl")
    built = load_built(str(chat_models / "base.gguf"))
    longest = max(
        len(ids)
        for ids, _ in data.encode_records(
            data.load_records(path), built.tokenizer, format="chat"
        )
    )
    evaluate.evaluate_built(built, path, fmt="chat")
    assert lengths == [-(-longest // 8) * 8] and lengths[0] < 64


def test_a_run_config_evaluates_its_renamed_fields(chat_models, tmp_path):
    """``eval CONFIG`` reads the columns the run trained on (``data.*_field``).

    It read ``messages``/``text`` whatever the config named, so a run that trained
    on ``messages_field: conversation`` could not be evaluated (column missing).
    """
    path = chat_models / "chat.jsonl"
    renamed = tmp_path / "valid.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    renamed.write_text("".join(
        json.dumps({"conversation": r["messages"]}) + "\n" for r in rows))  # fmt: skip
    tuned = str(chat_models / "tuned.gguf")
    want = evaluate.evaluate_model(tuned, str(path), fmt="chat")
    for fmt in ("auto", "chat"):
        doc = {
            "model": {"path": tuned},
            "data": {"train": str(renamed), "validation": str(renamed),
                     "messages_field": "conversation", "format": fmt},
            "training": {"output_dir": str(tmp_path / "out")},
        }  # fmt: skip
        config = str(write(tmp_path / "run.yaml", doc))
        assert evaluate.evaluate_config(config, model=tuned) == want


def test_eval_format_chat_and_compare_on_the_command_line(chat_models):
    base, tuned = chat_models / "base.gguf", chat_models / "tuned.gguf"
    path = chat_models / "chat.jsonl"
    runner = CliRunner()
    alone = runner.invoke(cli, ["eval", str(tuned), "--data", str(path), "--format",
                                "chat", "--json"])  # fmt: skip
    assert alone.exit_code == 0, alone.output
    got = json.loads(alone.stdout)
    assert {"exact_match", "eval_loss", "tokens", "examples"} <= set(got)
    both = runner.invoke(cli, ["eval", str(tuned), "--data", str(path), "--format",
                               "chat", "--compare", str(base)])  # fmt: skip
    assert both.exit_code == 0, both.output
    lines = both.stdout.splitlines()
    assert lines[0].split() == ["metric", "base", "model"]
    rows = {line.split()[0]: line.split()[1:] for line in lines[1:]}
    before = evaluate.evaluate_model(str(base), str(path), fmt="chat")
    assert rows["eval_loss"] == [
        f"{before['eval_loss']:.4g}",
        f"{got['eval_loss']:.4g}",
    ]
    assert rows["exact_match"][1] == f"{got['exact_match']:.4g}"
    assert re.search(r"evaluating .*base\.gguf on", both.stderr)


def test_kept_quantized_eval_reads_a_tied_head_as_generate_does(chat_models, tmp_path):
    """``eval --keep-quantized`` multiplies a tied head as Q8_0, like ``generate``.

    The Q8_0 embedding is kept as stored, so the head is that node itself.
    """
    from entrenar.quant import QuantizedWeight
    from entrenar.runs.inference import decoding_params, load_chat

    tied = dataclasses.replace(CONFIG, tie_word_embeddings=True)
    model = tmp_path / "tied.gguf"
    io.save_llama_gguf(model, tied, tied.init(jax.random.key(2)),
                       source=chat_models / "tok.gguf", tensor_type="Q8_0")  # fmt: skip
    kept = load_built(str(model), keep_quantized=True)
    head = decoding_params(kept, keep_quantized=True)["model"]["embed_tokens"]["weight"]
    assert isinstance(head, QuantizedWeight) and head.scheme == "q8_0"
    assert head is kept.params["model"]["embed_tokens"]["weight"]
    assert decoding_params(kept, keep_quantized=False) is kept.params
    path = str(chat_models / "chat.jsonl")
    out = evaluate.evaluate_model(
        str(model), path, fmt="chat", generate=True, keep_quantized=True
    )
    em = chat.exact_match(load_chat(str(model), keep_quantized=True),
                          data.load_records(path), generate=True)  # fmt: skip
    assert (out["exact_match"], out["examples"]) == (em.accuracy, 3)
