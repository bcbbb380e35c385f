"""The online GRPO loop: sampling, scoring, metrics, built-in rewards, and learning.

The learning check is a task with a known answer: a tiny random Llama is
rewarded for the fraction of its completion's tokens below id 50 (a sixth of
the vocabulary, so about 0.16 at the start; EOS is not among them, or ending at
once would win); GRPO must raise the mean reward, with full fine-tuning and
with QLoRA adapters (on the output head too: the random model's logits are
near zero, and the hidden states alone move them slowly).
"""

import dataclasses
import json
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from entrenar import lora, optim
from entrenar.errors import ConfigError, ShapeError
from entrenar.io import HFTokenizer
from entrenar.preference import GRPO, GRPOSettings, builtin_reward
from entrenar.preference.grpo_run import _encode_prompt

TESTS = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(TESTS), str(TESTS / "io")]
import hf_cases  # noqa: E402  (tests/io)
from peft_cases import CFG  # noqa: E402

PROMPTS = [{"prompt": p} for p in ("Hello world", "The fox", "def f(x):", "1 2 3")]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tok")
    hf_cases.write_tokenizer(folder, "qwen2_split")
    return HFTokenizer.from_folder(folder)


def model_of(tokenizer, **sizes):
    return dataclasses.replace(
        CFG, vocab_size=tokenizer.vocab_size, max_position_embeddings=64, **sizes
    )


def low_ids(prompts, completions, completion_ids, **columns):
    """The fraction of a completion's tokens with ids in [3, 50) (EOS, 2, is not)."""
    return [sum(3 <= t < 50 for t in c) / max(len(c), 1) for c in completion_ids]


@pytest.mark.parametrize("adapters", [False, True])
def test_reward_rises(tokenizer, tmp_path, adapters):
    sizes = dict(hidden_size=64, intermediate_size=128) if adapters else {}
    model = model_of(tokenizer, **sizes)  # NF4 blocks are 64 wide
    params = model.init(jax.random.key(0))
    trainable = None
    if adapters:  # the reference (β > 0) is the model with its adapters off
        heads = ("lm_head", "q_proj", "v_proj", "gate_proj", "up_proj", "down_proj")
        cfg = lora.LoRAConfig(rank=8, alpha=16, targets=heads)
        params = lora.apply(params, cfg, key=jax.random.key(1), quantize="nf4")  # QLoRA
        trainable = "lora"
    settings = GRPOSettings(num_generations=8, max_completion_length=6,
                            prompts_per_step=2, beta=0.02)  # fmt: skip
    opt = optim.adam(0.05 if adapters else 0.03)
    run = GRPO(model, params, opt, tokenizer, [low_ids], settings,
               trainable=trainable, seed=0)  # fmt: skip
    path = tmp_path / "metrics.jsonl"
    hist = run.train(PROMPTS, 30, metrics_path=path)
    rewards = [m["reward"] for m in hist]
    first, last = np.mean(rewards[:5]), np.mean(rewards[-5:])
    assert first < 0.35 and last > first + 0.3, rewards
    assert [json.loads(x)["step"] for x in path.read_text().splitlines()] == list(
        range(1, 31)
    )
    names = ("reward", "reward_std", "frac_reward_zero_std", "rewards/low_ids/mean",
             "completions/mean_length", "completions/clipped_ratio", "kl",
             "entropy", "clip_ratio/region_mean", "loss", "step_time")  # fmt: skip
    assert all(k in hist[-1] for k in names)
    assert hist[-1]["kl"] > 0 and hist[0]["clip_ratio/region_mean"] == 0.0


def test_completions_stop_at_eos_and_metrics_count_them(tokenizer):
    model = model_of(tokenizer)
    stops = list(range(40, 80))  # frequent stops: ragged completions
    settings = GRPOSettings(num_generations=4, max_completion_length=5,
                            prompts_per_step=2)  # fmt: skip
    run = GRPO(model, model.init(jax.random.key(1)), optim.sgd(0.0), tokenizer,
               [low_ids], settings, stop_tokens=stops)  # fmt: skip
    ids = [tokenizer.encode("Hello"), tokenizer.encode("The fox")]
    comps = run.sample(ids, 0)
    assert len(comps) == 8 and all(1 <= len(c) <= 5 for c in comps)
    for c in comps:
        assert all(t not in stops for t in c[:-1])
        assert len(c) == 5 or c[-1] in stops
    assert run.sample(ids, 0) == comps  # the seed and step fix the draw
    m = run.step(PROMPTS[:2], 0)
    assert 1 <= m["completions/min_length"] <= m["completions/max_length"] <= 5


def test_message_prompts_go_through_the_chat_template(tokenizer):
    """A conversational prompt is sampled after the template's generation prompt."""
    from entrenar.data.formatting import apply_chat_template

    model = model_of(tokenizer)
    seen = {}

    def spy(prompts, completions, completion_ids, **columns):
        seen["prompts"], seen["answer"] = prompts, columns["answer"]
        return [0.0] * len(completions)

    settings = GRPOSettings(num_generations=2, max_completion_length=3)
    run = GRPO(model, model.init(jax.random.key(2)), optim.sgd(0.0), tokenizer,
               [spy], settings)  # fmt: skip
    talk = [{"role": "user", "content": "Hello"}]
    m = run.step([{"prompt": talk, "answer": "hi"}], 0)
    assert seen == {"prompts": [talk, talk], "answer": ["hi", "hi"]}
    assert m["frac_reward_zero_std"] == 1.0 and m["loss"] == 0.0
    ids = apply_chat_template(tokenizer, talk, add_generation_prompt=True)
    assert tokenizer.decode(ids, special=True).endswith("<|im_start|>assistant\n")
    assert _encode_prompt(tokenizer, talk, None) == ids
    assert _encode_prompt(tokenizer, "Hello", None) == tokenizer.encode(
        "Hello", special=True
    )

    def short(prompts, completions, **columns):
        return [1.0]

    bad = GRPO(model, model.init(jax.random.key(2)), optim.sgd(0.0), tokenizer,
               [short], settings)  # fmt: skip
    with pytest.raises(ShapeError, match="returned 1 rewards for 2 completions"):
        bad.step([{"prompt": "Hello"}], 0)


def test_builtin_rewards():
    em = builtin_reward("exact_match", column="answer")
    assert em(prompts=["q"] * 3, completions=[" 42\n", "41", "42!"],
              answer=["42", "42", "42"]) == [1.0, 0.0, 0.0]  # fmt: skip
    has = builtin_reward("contains", column="answer")
    assert has(prompts=["q"] * 2, completions=["it is 42!", "no"],
               answer=["42", "42"]) == [1.0, 0.0]  # fmt: skip
    rx = builtin_reward("regex", pattern=r"\d{4}-\d\d-\d\d", fullmatch=True)
    assert rx(prompts=["q"] * 2, completions=["1988-07-14", "July"]) == [1.0, 0.0]
    with pytest.raises(ConfigError, match="unknown reward 'python'"):
        builtin_reward("python", code="import os")
    with pytest.raises(ConfigError, match="takes one option, column"):
        builtin_reward("exact_match", column="a", other=1)
    with pytest.raises(ConfigError, match="does not compile"):
        builtin_reward("regex", pattern="(")
    with pytest.raises(ConfigError, match="longer than 256"):
        builtin_reward("regex", pattern="a" * 300)
    with pytest.raises(ShapeError, match="reads the column 'answer'"):
        em(prompts=["q"], completions=["x"])


def test_bad_settings_are_named():
    with pytest.raises(ConfigError, match="num_generations: must be >= 2"):
        GRPOSettings(num_generations=1)
    with pytest.raises(ConfigError, match="grad_accum 3 must divide"):
        GRPOSettings(num_generations=4, grad_accum=3)
    with pytest.raises(ConfigError, match="loss_type: must be one of"):
        GRPOSettings(loss_type="ppo")
    with pytest.raises(ConfigError, match="scale_rewards: must be one of"):
        GRPOSettings(scale_rewards="std")
    with pytest.raises(ConfigError, match="at least one reward"):
        GRPO(None, {}, None, None, [], GRPOSettings())
    with pytest.raises(ConfigError, match="2 reward_weights for 1 reward"):
        GRPO(None, {}, None, None, [low_ids], GRPOSettings(reward_weights=(1.0, 2.0)))


def test_a_resumed_run_samples_what_the_uninterrupted_run_sampled(tokenizer, tmp_path):
    """Checkpointed after step k and restored into a new GRPO: the same steps after.

    3 prompts, 2 a step (step 2 crosses into the second shuffle). Each reward call
    records the prompts and completion ids it scores: the resumed run's steps
    k + 1.. sample the uninterrupted run's completions of the same prompts, and
    end at the same weights. Restoring the weights and not the prompt order
    (`GRPO.state_dict`) picks other prompts.
    """
    from entrenar.train.checkpoint import Checkpointer

    model = model_of(tokenizer)
    start = model.init(jax.random.key(3))
    settings = GRPOSettings(num_generations=4, max_completion_length=4,
                            prompts_per_step=2, temperature=0.8)  # fmt: skip
    prompts = PROMPTS[:3]

    def new_run(seen):
        def record(prompts, completions, completion_ids, **columns):
            seen.append((list(prompts), [list(c) for c in completion_ids]))
            return low_ids(prompts, completions, completion_ids)

        return GRPO(model, start, optim.adam(0.05), tokenizer, [record], settings,
                    seed=5)  # fmt: skip

    full_seen: list = []
    full = new_run(full_seen)
    full_hist = full.train(prompts, 5)
    k = 2
    first_seen: list = []
    first = new_run(first_seen)
    first.train(prompts, k)
    assert first_seen == full_seen[:k]
    ckpt = Checkpointer(tmp_path / "checkpoints")
    ckpt.save(first.state, first.state_dict())
    resumed_seen: list = []
    resumed = new_run(resumed_seen)
    state, meta = ckpt.restore(resumed.state)
    ckpt.close()
    resumed.state = state
    resumed.load_state_dict(meta, len(prompts))
    hist = resumed.train(prompts, 5 - k)
    assert resumed_seen == full_seen[k:]  # prompts and completions, step by step
    assert len({str(c) for _, c in full_seen}) == 5  # each step sampled anew
    for a, b in zip(hist, full_hist[k:]):
        assert {**a, "step_time": 0} == {**b, "step_time": 0}
    assert [m["step"] for m in resumed.history] == [1, 2, 3, 4, 5]
    for x, y in zip(jax.tree.leaves(resumed.params), jax.tree.leaves(full.params)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    took = [prompts.index({"prompt": p}) for p in resumed_seen[0][0][::4]]
    assert new_run([]).next_prompts(len(prompts), 2) != took  # the order lost
    ids = [tokenizer.encode(prompts[i]["prompt"], special=True) for i in took]
    assert new_run([]).sample(ids, k) != full_seen[k][1]  # the weights lost


def test_evaluate_scores_completions_sampled_with_its_own_keys(tokenizer):
    """`GRPO.evaluate`: ``G`` samples of each prompt, ``prompts_per_step`` at a time.

    Each chunk is sampled with ``fold_in(fold_in(fold_in(key(seed), 2³¹), step),
    chunk)`` (recomputed here with `generate`), the rewards' mean and std over
    all completions are eval_reward and eval_reward_std (numpy), and the params
    are not touched.
    """
    from entrenar.nn.generate import generate

    model = model_of(tokenizer)
    params = model.init(jax.random.key(4))
    seen = []

    def record(prompts, completions, completion_ids, **columns):
        seen.append([list(c) for c in completion_ids])
        return low_ids(prompts, completions, completion_ids)

    settings = GRPOSettings(num_generations=3, max_completion_length=4,
                            prompts_per_step=2)  # fmt: skip
    run = GRPO(model, params, optim.sgd(0.1), tokenizer, [record], settings, seed=9)
    m = run.evaluate(PROMPTS[:3], 5)
    (comps,) = seen
    root = jax.random.fold_in(jax.random.fold_in(jax.random.key(9), 2**31), 5)
    want = []
    for n, chunk in enumerate((PROMPTS[:2], PROMPTS[2:3])):
        rows = [tokenizer.encode(r["prompt"], special=True) for r in chunk
                for _ in range(3)]  # fmt: skip
        out = np.asarray(generate(model, params, rows, max_new_tokens=4,
                                  key=jax.random.fold_in(root, n), temperature=1.0,
                                  stop_tokens=run.stop_tokens, pad_token=run.pad_id,
                                  vocab_limit=tokenizer.vocab_size))  # fmt: skip
        for r in out.tolist():
            ends = [i for i, t in enumerate(r) if t in run.stop_tokens]
            want.append(r[: ends[0] + 1] if ends else r)
    assert comps == want and len(comps) == 9
    assert comps != run.sample([tokenizer.encode("Hello world", special=True)], 5)
    r = np.asarray(low_ids(None, None, comps))
    assert m["eval_reward"] == pytest.approx(r.mean())
    assert m["eval_reward_std"] == pytest.approx(r.std(ddof=1))
    assert m["eval_completions/mean_length"] == np.mean([len(c) for c in comps])
    assert "eval_loss" not in m and int(run.state.step) == 0
    for x, y in zip(jax.tree.leaves(run.params), jax.tree.leaves(params)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
