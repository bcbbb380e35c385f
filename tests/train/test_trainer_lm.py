"""Trainer on a language model: text through entrenar.data's loaders, LoRA, resume."""

import dataclasses

import jax
import numpy as np
import pytest

from entrenar import lora, nn
from entrenar.data import lm_loader
from entrenar.io import BPETokenizer
from entrenar.nn import LlamaConfig
from entrenar.optim import adamw
from entrenar.train import TrainConfig, Trainer

CHARS = "abcdefghijklmnopqrstuvwxyz .,"
TOKENIZER = BPETokenizer(  # byte-level BPE spells a space "Ġ"
    tokens=(*CHARS.replace(" ", "Ġ"), "<e>"), merges=(),
    token_types=(1,) * len(CHARS) + (3,), eos_id=len(CHARS),
)  # fmt: skip
TEXT = [
    {"text": "the cat sat on the mat."}, {"text": "a dog ran in the park."},
    {"text": "the sun is warm, the sky is blue."}, {"text": "birds sing at dawn."},
] * 4  # fmt: skip
MODEL = LlamaConfig(
    vocab_size=len(CHARS) + 1, hidden_size=32, intermediate_size=64, num_layers=2,
    num_heads=4, num_kv_heads=2, max_position_embeddings=64,
)  # fmt: skip


def loader(seed=0):
    return lm_loader(TEXT, TOKENIZER, seq_len=32, batch_size=4, packing=True,
                     seed=seed)  # fmt: skip


@pytest.mark.slow
def test_causal_lm_learns_packed_text_and_resumes_exactly(tmp_path):
    params = MODEL.init(jax.random.key(0))

    def cfg(d):
        return TrainConfig(epochs=6, log_every=2, checkpoint_every=3,
                           keep_checkpoints=10, output_dir=str(d),
                           progress=False)  # fmt: skip

    full = Trainer(MODEL, params, adamw(1e-2), cfg(tmp_path / "a")).fit(
        loader(), loader()
    )
    evals = [e["eval_loss"] for e in full.eval_history]
    assert evals[-1] < 0.6 * evals[0], evals  # log(30) = 3.4 at the start
    assert full.history[-1]["tokens_per_s"] > 0
    # resume from a mid-epoch checkpoint into a fresh loader: the same run
    src = tmp_path / "a" / "checkpoints" / "9"
    assert full.steps % 9 and 9 % len(loader())
    r = Trainer(MODEL, params, adamw(1e-2), cfg(tmp_path / "b")).fit(
        loader(), loader(), resume=src
    )
    for a, b in zip(jax.tree_util.tree_leaves((full.state.trainable,
                                               full.state.opt_state)),
                    jax.tree_util.tree_leaves((r.state.trainable,
                                               r.state.opt_state))):  # fmt: skip
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert r.eval_history == full.eval_history


@pytest.mark.slow
def test_lora_trains_adapters_only_and_beats_the_base():
    # a base whose output head is not near zero, so adapters can steer the logits
    model = dataclasses.replace(MODEL, initializer_range=0.3)
    base = model.init(jax.random.key(0))
    params = lora.apply(base, lora.LoRAConfig(rank=4, alpha=8, targets=lora.ALL_LINEAR,
                                              dropout=0.1),
                        key=jax.random.key(1))  # fmt: skip
    t = Trainer(model, params, adamw(3e-2), TrainConfig(epochs=10, progress=False),
                trainable="lora")  # fmt: skip
    before = t.evaluate(loader())["eval_loss"]
    r = t.fit(loader())
    after = t.evaluate(loader())["eval_loss"]
    assert after < 0.2 * before, (before, after)
    merged = r.params
    for path_leaf, base_leaf in zip(
        jax.tree_util.tree_leaves(lora.split(merged)[1]),
        jax.tree_util.tree_leaves(base),
    ):
        np.testing.assert_array_equal(np.asarray(path_leaf), np.asarray(base_leaf))


def test_bfloat16_matmuls_round_the_frozen_projections_once():
    # matmul_dtype="bfloat16": the step reads the frozen projections as bfloat16 (the
    # same values it would round them to at every step); fit returns them as given
    model = dataclasses.replace(MODEL, matmul_dtype="bfloat16")
    params = lora.apply(model.init(jax.random.key(0)),
                        lora.LoRAConfig(rank=4, alpha=8, targets=("q_proj", "v_proj")),
                        key=jax.random.key(1))  # fmt: skip
    base = lora.split(params)[1]

    def trainer():
        cfg = TrainConfig(max_steps=4, log_every=1, progress=False)
        return Trainer(model, params, adamw(1e-2), cfg, trainable="lora")

    t, ref = trainer(), trainer()
    ref.state = ref.state._replace(frozen=base)  # rounded at every step instead
    is_bf16 = lambda x: isinstance(x, nn.Bfloat16Weight)  # noqa: E731
    rounded = [x for x in jax.tree.leaves(t.state.frozen, is_leaf=is_bf16)
               if is_bf16(x)]  # fmt: skip
    assert len(rounded) == 8  # q, k, v, o, gate, up, down (layer stacks), lm_head
    r, r_ref = t.fit(loader()), ref.fit(loader())
    losses = [h["loss"] for h in r.history]
    np.testing.assert_allclose(losses, [h["loss"] for h in r_ref.history], rtol=1e-6)
    for a, b in zip(jax.tree.leaves(r.state.trainable),
                    jax.tree.leaves(r_ref.state.trainable)):  # fmt: skip
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)
    for a, b in zip(jax.tree.leaves(lora.split(r.params)[1]), jax.tree.leaves(base)):
        assert a.dtype == np.float32
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
