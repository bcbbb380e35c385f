"""entrenar's GRPO reproduces TRL 1.16's GRPOTrainer on its recorded completions.

tests/oracles/make_trl_grpo_reference.py ran TRL (transformers 5.25, PEFT 0.21.2,
torch CPU float32) on a tiny Llama twice: LoRA with ``loss_type="grpo"``,
``β = 0.04`` against the adapters-off reference, temperature 0.8; and full
fine-tuning with the default ``dapo``, batch-scaled rewards, ``β = 0.04`` against a
copy of the starting model and two passes per generation (``num_iterations=2``,
``ε = 0.05``: the second pass clips). Sampling cannot be replayed, so TRL's
completions and reward scores were recorded; here entrenar packs the same
completions, computes the advantages from the scores and takes the same SGD steps
from the same weights, without TRL.
"""

import dataclasses
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from entrenar import optim
from entrenar.nn import from_hf_names
from entrenar.preference import (
    group_advantages,
    make_grpo_loss_fn,
    pack_completions,
    token_logps,
)
from entrenar.preference.grpo_run import completion_metrics, reward_metrics
from entrenar.train import TrainState, make_train_step

TESTS = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(TESTS)]
import trl_replay  # noqa: E402
from peft_cases import CFG  # noqa: E402

REF = json.loads((TESTS / "data" / "trl_grpo_reference.json").read_text())
ARR = np.load(TESTS / "data" / "trl_grpo_reference.npz")
MODEL = dataclasses.replace(
    CFG, vocab_size=REF["vocab_size"], max_position_embeddings=64
)
NAMES = ("reward_len", "reward_vowels")


def start_params():
    flat = {k[len("init/") :]: ARR[k] for k in ARR.files if k.startswith("init/")}
    return from_hf_names(flat, MODEL)


def lora_start(tmp_path):
    return trl_replay.lora_start(ARR, REF, tmp_path, start_params)


def unpad(ids, mask):
    return [[t for t, m in zip(r, k) if m] for r, k in zip(ids, mask)]


def generation_batch(gen, settings):
    """TRL's left-padded prompts and right-padded completions, packed from the left."""
    batch = pack_completions(
        unpad(gen["prompt_ids"], gen["prompt_mask"]),
        unpad(gen["completion_ids"], gen["completion_mask"]),
        REF["pad_token_id"],
    )
    scores = np.asarray(gen["rewards_per_func"]).T  # (B, F)
    total = scores @ np.asarray(REF["reward_weights"])
    adv, _ = group_advantages(total, REF["num_generations"], settings["scale_rewards"])
    return {**{k: jnp.asarray(v) for k, v in batch.items()},
            "advantages": jnp.asarray(adv, jnp.float32)}  # fmt: skip


@pytest.mark.parametrize("run", ["lora", "full"])
def test_advantages_and_reward_metrics_are_trls(run):
    s = REF[run]["settings"]
    for gen in REF[run]["generations"]:
        scores = np.asarray(gen["rewards_per_func"]).T
        total = scores @ np.asarray(REF["reward_weights"])
        adv, m = group_advantages(total, REF["num_generations"], s["scale_rewards"])
        np.testing.assert_allclose(adv, gen["advantages"], rtol=0, atol=2e-6)
        m.update(reward_metrics(scores, NAMES))
        lengths = [sum(r) for r in gen["completion_mask"]]
        ended = [
            n < REF["max_completion_length"] or ids[n - 1] in REF["eos_token_ids"]
            for ids, n in zip(gen["completion_ids"], lengths)
        ]
        m.update(completion_metrics(lengths, ended))
        for k, v in m.items():
            assert gen["metrics"][k] == pytest.approx(v, rel=1e-5, abs=1e-6), k


def train_like_trl(run, tmp_path):
    s = REF[run]["settings"]
    if run == "lora":
        params, trainable, reference = lora_start(tmp_path), "lora", "adapters"
    else:
        params, trainable, reference = start_params(), None, "precomputed"
    loss_fn = make_grpo_loss_fn(
        MODEL, beta=s["beta"], epsilon=s["epsilon"], loss_type=s["loss_type"],
        temperature=s["temperature"], reference=reference,
        max_completion_length=REF["max_completion_length"],
    )  # fmt: skip
    opt = optim.sgd(s["learning_rate"])
    step_fn = make_train_step(loss_fn, opt)
    state = TrainState.create(params, opt, key=jax.random.key(0), trainable=trainable)
    logps = jax.jit(token_logps, static_argnums=(0, 5))
    start, seen, batch, last = params, [], None, None
    for step in REF[run]["steps"]:
        if step["generation"] != last:  # a new generation: score it as TRL does
            last = step["generation"]
            batch = generation_batch(REF[run]["generations"][last], s)
            args = (
                batch["input_ids"],
                batch["attention_mask"],
                batch["completion_mask"],
            )
            if s["num_iterations"] > 1:  # π_old: the params that sampled it
                batch["old_logps"] = logps(MODEL, state.params, *args, s["temperature"])
            if reference == "precomputed":
                batch["ref_logps"] = logps(MODEL, start, *args, s["temperature"])
        state, metrics = step_fn(state, batch)
        seen.append({k: float(v) for k, v in metrics.items()})
    return seen, state.params


@pytest.mark.parametrize("run", ["lora", "full"])
def test_losses_metrics_and_weights_are_trls(run, tmp_path):
    seen, params = train_like_trl(run, tmp_path)
    worst = {}
    for i, (got, want) in enumerate(zip(seen, REF[run]["steps"], strict=True)):
        assert abs(got["loss"] - want["loss"]) < 1e-6, (i, got["loss"], want["loss"])
        for k, v in want["metrics"].items():
            assert abs(got[k] - v) < 1e-5 * max(1.0, abs(v)), (i, k, got[k], v)
            worst[k] = max(worst.get(k, 0.0), abs(got[k] - v))
    if run == "full":  # the second pass over a generation clips
        assert (
            max(s["metrics"]["clip_ratio/region_mean"] for s in REF[run]["steps"]) > 0.5
        )
    trl_replay.assert_final_weights(ARR, run, params, atol=1e-6)


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "dr_grpo"])
def test_micro_batches_give_the_whole_batchs_step(loss_type, tmp_path):
    """``grad_accum=2`` over TRL's 8 completions: the loss and update of one batch.

    ``dapo`` divides by the generation batch's tokens (TRL's
    ``num_items_in_batch``): its ``loss_weight`` is the micro-batch's tokens, so
    the weighted mean over micro-batches is the batch's token mean even though
    the completions' lengths differ between the halves.
    """
    s = REF["full"]["settings"]
    batch = generation_batch(REF["full"]["generations"][0], s)
    first, second = np.split(np.asarray(batch["completion_mask"]).sum(1), 2)
    assert first.sum() != second.sum()  # ragged halves: a plain mean would differ
    params = lora_start(tmp_path)
    longest = REF["max_completion_length"]
    loss_fn = make_grpo_loss_fn(
        MODEL, beta=0.04, loss_type=loss_type, max_completion_length=longest
    )
    out = []
    for k in (1, 2):
        opt = optim.sgd(0.5)
        key = jax.random.key(0)
        state = TrainState.create(params, opt, key=key, trainable="lora")
        state, m = make_train_step(loss_fn, opt, grad_accum=k)(state, batch)
        out.append((state.params, m))
    (p1, m1), (p2, m2) = out
    np.testing.assert_allclose(float(m2["loss"]), float(m1["loss"]), atol=1e-7)
    for a, b in zip(jax.tree_util.tree_leaves(p1), jax.tree_util.tree_leaves(p2)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-6)
    moved = [
        float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
        for a, b in zip(
            jax.tree_util.tree_leaves(p1), jax.tree_util.tree_leaves(params)
        )
    ]
    assert max(moved) > 1e-3
