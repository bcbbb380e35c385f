"""entrenar's DPO reproduces TRL 1.16's DPOTrainer, recorded on a tiny Llama.

tests/oracles/make_trl_dpo_reference.py ran TRL (transformers 5.25, PEFT 0.21.2,
torch CPU float32) for three SGD steps twice: LoRA on conversational records with
implicit prompts (reference: the adapters off) and full fine-tuning on standard
records (reference log-probabilities precomputed). Here entrenar tokenizes the
same records with the same tokenizer, collates the batches TRL drew, and trains
from the same starting weights; TRL is not needed.
"""

import dataclasses
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from entrenar import lora, optim
from entrenar.data import collate_preference, encode_preference
from entrenar.io import HFTokenizer
from entrenar.nn import from_hf_names
from entrenar.preference import make_dpo_loss_fn, reference_logps
from entrenar.train import TrainState, make_train_step

TESTS = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(TESTS), str(TESTS / "io")]
import hf_cases  # noqa: E402  (tests/io)
import trl_replay  # noqa: E402
from peft_cases import CFG  # noqa: E402

REF = json.loads((TESTS / "data" / "trl_dpo_reference.json").read_text())
ARR = np.load(TESTS / "data" / "trl_dpo_reference.npz")
MODEL = dataclasses.replace(
    CFG, vocab_size=REF["vocab_size"], max_position_embeddings=64
)
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies",
           "rewards/margins", "logps/chosen", "logps/rejected")  # fmt: skip


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tok")
    hf_cases.write_tokenizer(folder, REF["tokenizer_style"])
    return HFTokenizer.from_folder(folder)


def _oracle():
    sys.path.insert(0, str(TESTS / "oracles"))
    try:
        import make_trl_dpo_reference as oracle
    finally:
        sys.path.remove(str(TESTS / "oracles"))
    return oracle


SP_CHAT = (
    "transformers 5.25's LlamaTokenizer rebuilds a SentencePiece-style tokenizer "
    "from its vocabulary (no '▁' after a control token; phi3: no BOS the template "
    "does not write), while entrenar's HFTokenizer follows tokenizer.json's legacy "
    "Prepend normalizer (and adds the config's BOS): the SFT chat path shares it"
)
TOKENIZATION_CASES = [
    pytest.param(
        style, name,
        marks=[pytest.mark.xfail(strict=True, reason=SP_CHAT)]
        if style in ("mistral", "phi3") and name.startswith("conversational") else [],
    )
    for style in sorted(REF["tokenization"])
    for name in sorted(REF["tokenization"][style])
]  # fmt: skip


@pytest.mark.parametrize(("style", "name"), TOKENIZATION_CASES)
def test_every_preference_format_tokenizes_as_trl(style, name, tmp_path):
    """Standard or conversational, prompt given or implicit, five tokenizers.

    BOS added by the tokenizer (Llama 3, Mistral, Phi-3) or written by the chat
    template (Llama 3, Mistral, Gemma), byte-level and SentencePiece-style: the
    prompt, chosen and rejected ids TRL 1.16 made of the same records
    (``max_length=None``: nothing dropped). Message lists through the
    SentencePiece-style Mistral and Phi-3 tokenizers differ (`SP_CHAT`).
    """
    hf_cases.write_tokenizer(tmp_path, style)
    tok = HFTokenizer.from_folder(tmp_path)
    records = _oracle().tokenization_sets()[name]
    pairs = encode_preference(records, tok, max_length=None)
    got = [
        {"prompt_ids": p.prompt, "chosen_ids": p.chosen, "rejected_ids": p.rejected}
        for p in pairs
    ]
    assert got == REF["tokenization"][style][name]


def start_params():
    flat = {k[len("init/") :]: ARR[k] for k in ARR.files if k.startswith("init/")}
    return from_hf_names(flat, MODEL)


@pytest.mark.parametrize("run", ["full", "lora"])
def test_tokenized_pairs_and_batches_are_trls(run, tokenizer):
    pairs = encode_preference(
        REF["records"][run], tokenizer, max_length=REF["max_length"]
    )
    got = [{"prompt_ids": p.prompt, "chosen_ids": p.chosen, "rejected_ids": p.rejected}
           for p in pairs]  # fmt: skip
    assert got == REF[run]["tokenized"]
    for step in REF[run]["steps"]:
        batch = collate_preference(
            [pairs[i] for i in step["rows"]],
            tokenizer.pad_id,
            max_length=REF["max_length"],
        )
        for key in ("input_ids", "attention_mask", "completion_mask"):
            want = np.asarray(step[key])  # (2B, T): all chosen, then all rejected
            b = want.shape[0] // 2
            np.testing.assert_array_equal(batch[key][:, 0], want[:b], err_msg=key)
            np.testing.assert_array_equal(batch[key][:, 1], want[b:], err_msg=key)


def lora_start(tmp_path):
    return trl_replay.lora_start(ARR, REF, tmp_path, start_params)


def train_like_trl(run, tokenizer, tmp_path):
    """Entrenar's steps on TRL's batches: (loss, metrics) per step, final params."""
    pairs = encode_preference(
        REF["records"][run], tokenizer, max_length=REF["max_length"]
    )
    settings = REF["settings"]
    if run == "lora":
        params, trainable, reference = lora_start(tmp_path), "lora", "adapters"
    else:
        params, trainable, reference = start_params(), None, "precomputed"
    loss_fn = make_dpo_loss_fn(MODEL, beta=settings["beta"], reference=reference)
    step_fn = make_train_step(loss_fn, optim.sgd(settings["learning_rate"]))
    state = TrainState.create(params, optim.sgd(settings["learning_rate"]),
                              key=jax.random.key(0), trainable=trainable)  # fmt: skip
    start = params
    seen = []
    for step in REF[run]["steps"]:
        batch = collate_preference(
            [pairs[i] for i in step["rows"]],
            tokenizer.pad_id,
            max_length=REF["max_length"],
        )
        batch = {k: jnp.asarray(v) for k, v in batch.items()}
        if reference == "precomputed":  # the starting model's, as TRL precomputes
            rc, rr = jax.jit(lambda p, b: reference_logps(MODEL, p, b))(start, batch)
            batch.update(ref_chosen_logps=rc, ref_rejected_logps=rr)
        state, metrics = step_fn(state, batch)
        seen.append({k: float(v) for k, v in metrics.items()})
    return seen, state.params


@pytest.mark.parametrize("run", ["full", "lora"])
def test_losses_metrics_and_weights_are_trls(run, tokenizer, tmp_path):
    seen, params = train_like_trl(run, tokenizer, tmp_path)
    for i, (got, want) in enumerate(zip(seen, REF[run]["steps"], strict=True)):
        assert abs(got["loss"] - want["loss"]) < 1e-5, (i, got["loss"], want["loss"])
        for k in METRICS:
            tol = 1e-4 * max(1.0, abs(want["metrics"][k]))  # logps sum ~40 tokens
            assert abs(got[k] - want["metrics"][k]) < tol, (
                i,
                k,
                got[k],
                want["metrics"][k],
            )
    trl_replay.assert_final_weights(ARR, run, params, atol=1e-5)


@pytest.mark.parametrize("run", ["full", "lora"])
def test_micro_batches_give_the_whole_batchs_step(run, tokenizer, tmp_path):
    """``grad_accum=2`` over 2 pairs: the loss, metrics and update of one batch.

    The pairs lie along the batch axis, so a micro-batch holds whole pairs (a
    concatenated ``(2B, T)`` layout would pair one micro-batch's chosen rows with
    another's rejected), and ``loss_weight`` counts pairs, so the mean over
    micro-batches is the mean over pairs.
    """
    pairs = encode_preference(
        REF["records"][run], tokenizer, max_length=REF["max_length"]
    )
    batch = collate_preference(
        pairs[:2], tokenizer.pad_id, max_length=REF["max_length"]
    )
    batch = {k: jnp.asarray(v) for k, v in batch.items()}
    if run == "lora":
        params, trainable, reference = lora_start(tmp_path), "lora", "adapters"
        params = _nonzero_b(params)  # the policy differs from the reference
    else:
        params, trainable, reference = start_params(), None, "precomputed"
        rc, rr = reference_logps(MODEL, params, batch)
        batch.update(ref_chosen_logps=rc - 1.0, ref_rejected_logps=rr + 0.5)
    loss_fn = make_dpo_loss_fn(MODEL, beta=0.5, loss_type="ipo", reference=reference)
    out = []
    for k in (1, 2):
        opt = optim.sgd(0.1)
        state = TrainState.create(
            params, opt, key=jax.random.key(0), trainable=trainable
        )
        state, metrics = make_train_step(loss_fn, opt, grad_accum=k)(state, batch)
        out.append((state.params, metrics))
    (p1, m1), (p2, m2) = out
    for key in ("loss", *METRICS):
        np.testing.assert_allclose(float(m2[key]), float(m1[key]), rtol=2e-6, atol=2e-6)
    for a, b in zip(jax.tree_util.tree_leaves(p1), jax.tree_util.tree_leaves(p2)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=2e-6)
    assert float(m1["loss"]) > 1e-3


def _nonzero_b(params):
    rng = np.random.default_rng(0)

    def fill(x):
        if isinstance(x, lora.LoRAWeight):
            b = rng.normal(size=x.b.shape).astype(np.float32) * 0.05
            return x.replace(b=jnp.asarray(b))
        return x

    is_lora = lambda x: isinstance(x, lora.LoRAWeight)  # noqa: E731
    return jax.tree_util.tree_map(fill, params, is_leaf=is_lora)


def test_lora_dropout_is_off_unless_asked_as_in_trl(tokenizer, tmp_path):
    """TRL's ``disable_dropout=True`` (its default) zeroes LoRA's dropout too."""
    pairs = encode_preference(
        REF["records"]["lora"], tokenizer, max_length=REF["max_length"]
    )
    batch = collate_preference(
        pairs[:2], tokenizer.pad_id, max_length=REF["max_length"]
    )
    params = _nonzero_b(lora_start(tmp_path))

    def with_dropout(x):
        return x.replace(dropout=0.5) if isinstance(x, lora.LoRAWeight) else x

    is_lora = lambda x: isinstance(x, lora.LoRAWeight)  # noqa: E731
    params = jax.tree_util.tree_map(with_dropout, params, is_leaf=is_lora)
    key = jax.random.key(3)
    losses = {}
    for off in (True, False):
        fn = make_dpo_loss_fn(MODEL, reference="adapters", disable_dropout=off)
        losses[off] = float(fn(params, batch, key=key)[0])
    plain = float(make_dpo_loss_fn(MODEL)(params, batch, key=None)[0])
    assert losses[True] == plain
    assert abs(losses[False] - plain) > 1e-4
