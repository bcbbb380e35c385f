"""``entrenar merge --eval TASK=FILE --search``: the grid's known best is found.

The models are Llamas that compute a bigram table: one-hot embeddings, zero
attention and MLP outputs, and ``lm_head`` holding the table, so a task vector
edits next-token logits directly and the best merge can be worked out by hand.
The chat template puts the reply straight after the user's text, so the reply's
first token follows the prompt's last character.

Task ``one``: a question ending in ``a`` is answered ``1``; task ``two``: ending in
``b``, ``2``. The base prefers ``z`` after ``a`` and ``b`` (logit 10) and ends the
turn after ``1`` and ``2`` (logit 14). Each fine-tune adds 8 to its own answer
(``a -> 1``) and, drifting, 8 to ``y`` after the other task's answer (``2 -> y``).
Merged with λ (TIES on these disjoint edits is task arithmetic), a task is right
iff ``8λ > 10`` and ``8λ < 14``: of λ in {1, 1.5, 2} only 1.5 keeps both.
"""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest
from click.testing import CliRunner

from entrenar import io, nn
from entrenar.cli import cli
from entrenar.io.gguf_reader import GGUFField, GGUFValueType
from entrenar.io.gguf_writer import write_gguf
from entrenar.io.tokenizer import bytes_to_unicode

V, D = 258, 264  # 256 bytes + <|im_start|> + <|im_end|>; hidden padded for the heads
END = 257
TEMPLATE = (
    "{% for m in messages %}{{ m.content }}{% if m.role == 'assistant' %}"
    "<|im_end|>{% endif %}{% endfor %}"
)
CONFIG = nn.LlamaConfig(
    vocab_size=V, hidden_size=D, intermediate_size=32, num_layers=1, num_heads=2,
    num_kv_heads=2, max_position_embeddings=64, tie_word_embeddings=False,
)  # fmt: skip


def tokenizer_source(path):
    """A GGUF with only a byte-level tokenizer and `TEMPLATE`."""
    b2u = bytes_to_unicode()
    tokens = [b2u[b] for b in range(256)] + ["<|im_start|>", "<|im_end|>"]
    s, a, i32 = GGUFValueType.STRING, GGUFValueType.ARRAY, GGUFValueType.INT32
    fields = {
        "general.architecture": GGUFField("llama", s),
        "tokenizer.ggml.model": GGUFField("gpt2", s),
        "tokenizer.ggml.pre": GGUFField("gpt2", s),
        "tokenizer.ggml.tokens": GGUFField(tokens, a, s),
        "tokenizer.ggml.token_type": GGUFField([1] * 256 + [3, 3], a, i32),
        "tokenizer.ggml.merges": GGUFField([], a, s),
        "tokenizer.ggml.eos_token_id": GGUFField(END, GGUFValueType.UINT32),
        "tokenizer.chat_template": GGUFField(TEMPLATE, s),
    }
    write_gguf(path, fields, {})
    return path


def bigram_lm(table):
    """Params whose next-token logits after token ``t`` are ``table[t]``."""
    params = jax.tree_util.tree_map(np.zeros_like, CONFIG.init(jax.random.key(0)))
    params = jax.tree_util.tree_map(np.asarray, params)
    emb = np.zeros((V, D), np.float32)
    emb[np.arange(V), np.arange(V)] = 1.0  # one-hot rows
    params["model"]["embed_tokens"]["weight"] = emb
    for norm in ("input_layernorm", "post_attention_layernorm"):
        params["model"]["layers"][norm]["weight"] = np.ones((1, D), np.float32)
    params["model"]["norm"]["weight"] = np.full((D,), D**-0.5, np.float32)  # -> e_t
    head = np.zeros((V, D), np.float32)
    head[:, :V] = table.T  # logits[v] = head[v, t] = table[t, v]
    params["lm_head"]["weight"] = head
    return params


def edit(*entries):
    t = np.zeros((V, V), np.float32)
    for a, b, v in entries:
        t[ord(a) if isinstance(a, str) else a, ord(b) if isinstance(b, str) else b] = v
    return t


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("merge_search")
    src = tokenizer_source(tmp / "tok.gguf")
    base = np.random.default_rng(0).normal(size=(V, V)).astype(np.float32) * 0.1
    base += edit(("a", "z", 10), ("b", "z", 10), ("1", END, 14), ("2", END, 14))
    one = edit(("a", "1", 8), ("2", "y", 8))  # learns task one, drifts on two
    two = edit(("b", "2", 8), ("1", "y", 8))
    files = {}
    for name, table in (("base", base), ("one", base + one), ("two", base + two)):
        files[name] = tmp / f"{name}.gguf"
        io.save_llama_gguf(files[name], CONFIG, bigram_lm(table), source=src)
    for task, (end, reply) in {"one": ("a", "1"), "two": ("b", "2")}.items():
        rows = [{"messages": [{"role": "user", "content": f"{q}{end}"},
                              {"role": "assistant", "content": reply}]}
                for q in ("q", "what is ", "x")]  # fmt: skip
        files[f"{task}.jsonl"] = tmp / f"{task}.jsonl"
        files[f"{task}.jsonl"].write_text("".join(json.dumps(r) + "\n" for r in rows))
    return files


def run(*args):
    return CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=False)


def merge(case, out, *opts, tasks=("one", "two")):
    """``entrenar merge one two --base base -o out OPTS --eval TASK=FILE ...``."""
    evals = [x for t in tasks for x in ("--eval", f"{t}={case[t + '.jsonl']}")]
    return run("merge", case["one"], case["two"], "--base", case["base"], "-o", out,
               *opts, *evals)  # fmt: skip


def test_eval_scores_each_task_of_the_merged_model(case, tmp_path):
    out = tmp_path / "merged.gguf"
    r = merge(case, out, "--method", "task_arithmetic", "--lambda", "1.5")
    assert r.exit_code == 0, r.output
    assert "| 1.000 | 1.000 | 1.000 | all |" in r.output  # one, two, worst
    assert f"merged 2 models onto base {case['base']} (task_arithmetic)" in r.output
    r = merge(case, out, "--method", "task_arithmetic", tasks=("one",))
    assert "| 0.000 | 0.000 | all |" in r.output  # λ = 1: 8 < 10, the answer is lost


def test_search_picks_the_known_best_setting(case, tmp_path):
    out = tmp_path / "merged.gguf"
    r = merge(case, out, "--method", "ties", "--density", "0.6", "--search")
    assert r.exit_code == 0, r.output
    rows = [line for line in r.output.splitlines() if line.startswith("| ")]
    assert len(rows) == 1 + 9  # header, density x λ
    assert rows[1].split("|")[2:4] == [" 0.6 ", " 1 "]  # the given setting first
    assert "best worst-task score 1.000 with density=0.6, lambda=1.5" in r.output
    best = [row for row in rows if row.startswith("| * |")]
    assert len(best) == 1 and "| 0.6 | 1.5 | 1.000 | 1.000 | 1.000 | all |" in best[0]
    for row in rows[1:]:  # only λ = 1.5 keeps both tasks, whatever the density
        worst = row.split("|")[-3].strip()  # "<=" marks a pruned setting's bound
        assert (worst == "1.000") == (row.split("|")[3].strip() == "1.5"), row
    from entrenar.chat import ChatModel

    chat = ChatModel.from_gguf(out)  # the written model is the best one
    assert chat([{"role": "user", "content": "xa"}], max_new_tokens=4) == "1"


def test_search_needs_eval(case, tmp_path):
    r = merge(case, tmp_path / "m.gguf", "--search", tasks=())
    assert r.exit_code == 2 and "--eval" in r.output


def test_eval_of_folders_is_one_line_naming_what_it_needs(case, tmp_path):
    """--eval scores through a GGUF's tokenizer: folders are refused for that reason.

    Before: a raw "IsADirectoryError: [Errno 21] Is a directory".
    """
    for name in ("base", "one", "two"):
        config, params, _ = io.load_llama_gguf(io.read_gguf(case[name]))
        io.save_hf_folder(tmp_path / name, config, params)
    r = run("merge", tmp_path / "one", tmp_path / "two", "--base", tmp_path / "base",
            "-o", tmp_path / "m", "--eval", f"one={case['one.jsonl']}")  # fmt: skip
    assert r.exit_code == 2
    assert r.output.startswith("error: --eval scores merges through a GGUF's")
    assert "is not a GGUF" in r.output and "Error" not in r.output
