"""Trainer on a language model: text through entrenar.data's loaders, LoRA, resume."""

import dataclasses

import jax
import jax.numpy as jnp
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


@pytest.mark.parametrize("tied", [False, True])
def test_bfloat16_matmuls_round_the_frozen_projections_once(tied):
    # matmul_dtype="bfloat16": the step reads the frozen projections as bfloat16 (the
    # same values it would round them to at every step); fit returns them as given
    model = dataclasses.replace(
        MODEL, matmul_dtype="bfloat16", tie_word_embeddings=tied
    )
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
    # q, k, v, o, gate, up, down (layer stacks); lm_head a bfloat16 array (read
    # whole) or the tied embedding's head
    assert len(rounded) == 7
    embed = t.state.frozen["model"]["embed_tokens"]["weight"]
    assert isinstance(embed, nn.TiedEmbedding) == tied
    if not tied:
        assert t.state.frozen["lm_head"]["weight"].dtype == jnp.bfloat16
    r, r_ref = t.fit(loader()), ref.fit(loader())
    losses = [h["loss"] for h in r.history]
    np.testing.assert_allclose(losses, [h["loss"] for h in r_ref.history], rtol=1e-6)
    for a, b in zip(jax.tree.leaves(r.state.trainable),
                    jax.tree.leaves(r_ref.state.trainable)):  # fmt: skip
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)
    assert all(  # trainer.params: the trained half with the frozen half as given
        a is b for a, b in zip(jax.tree.leaves(lora.split(t.params)[1]),
                               jax.tree.leaves(base))
    )  # fmt: skip
    for a, b in zip(jax.tree.leaves(lora.split(r.params)[1]), jax.tree.leaves(base)):
        assert a.dtype == np.float32
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_dora_trains_its_magnitudes_under_remat_bf16_matmuls_and_dropout():
    """DoRA through the Trainer's step: chunked loss, remat, bfloat16, dropout.

    Remat recomputes the forward in the backward pass: the same losses and
    trained values as without it (to rounding: XLA fuses the recomputed norms
    differently, gradients differ by 6e-7 relative in float32 and 1e-5 with
    bfloat16 matmuls, where plain LoRA's are bit-identical; Adam's first steps
    turn that into ~1e-4 on near-zero entries, of 4e-2 that 4 steps move them);
    the magnitudes train, the base stays as given.
    """
    params = lora.apply(
        MODEL.init(jax.random.key(0)),
        lora.LoRAConfig(rank=4, alpha=8, targets=lora.ALL_LINEAR, dropout=0.1,
                        use_dora=True),
        key=jax.random.key(1),
    )  # fmt: skip

    def fit(remat):
        model = dataclasses.replace(MODEL, matmul_dtype="bfloat16", remat=remat)
        cfg = TrainConfig(max_steps=4, log_every=1, progress=False)
        return Trainer(model, params, adamw(1e-2), cfg, trainable="lora").fit(loader())

    r, r_ref = fit(True), fit(False)
    losses = [h["loss"] for h in r.history]
    assert all(np.isfinite(losses)) and len(losses) == 4
    np.testing.assert_allclose(losses, [h["loss"] for h in r_ref.history], rtol=1e-5)
    for a, b in zip(jax.tree.leaves(r.state.trainable),
                    jax.tree.leaves(r_ref.state.trainable)):  # fmt: skip
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-3)
    before = params["model"]["layers"]["mlp"]["down_proj"]["weight"].magnitude
    after = r.params["model"]["layers"]["mlp"]["down_proj"]["weight"].magnitude
    assert np.abs(np.asarray(after) - np.asarray(before)).max() > 1e-3
    for a, b in zip(jax.tree.leaves(lora.split(r.params)[1]),
                    jax.tree.leaves(lora.split(params)[1])):  # fmt: skip
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("md", [None, "bfloat16"])
def test_llama_loss_is_the_mean_causal_lm_loss_of_the_logits(md):
    # the Trainer's Llama loss goes through chunked_causal_lm_loss (no whole logits);
    # it equals the plain loss of apply's logits, with padding, packing and labels
    from entrenar.nn import causal_lm_loss
    from entrenar.train.model_loss import loss_for_model

    model = dataclasses.replace(MODEL, matmul_dtype=md)
    params = model.init(jax.random.key(0))
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, MODEL.vocab_size, (3, 20)).astype(np.int32)
    labels = tokens.copy()
    labels[0, :5] = -100  # a prompt not counted
    mask = np.ones((3, 20), bool)
    mask[2, 14:] = False  # padding
    segments = np.zeros((3, 20), np.int32)
    segments[1, 9:] = 1  # two packed documents
    positions = np.tile(np.arange(20, dtype=np.int32), (3, 1))
    positions[1, 9:] -= 9
    batch = dict(input_ids=tokens, labels=labels, attention_mask=mask,
                 segment_ids=segments, positions=positions)  # fmt: skip

    targets = labels.copy()
    targets[1, 9] = -100  # the second document's first token: no target (conventions)

    def plain(p):
        z = model.apply(p, tokens, mask=mask, segment_ids=segments,
                        positions=positions)  # fmt: skip
        counted = (targets[:, 1:] != -100) & mask[:, 1:]
        n = jnp.asarray(counted.sum(), jnp.float32)
        return causal_lm_loss(z, targets, "sum", loss_mask=mask) / n

    loss_fn = loss_for_model(model)
    (got, aux), g = jax.value_and_grad(
        lambda p: loss_fn(p, batch, key=None), has_aux=True
    )(params)
    want, gw = jax.value_and_grad(plain)(params)
    assert float(aux["loss_weight"]) == ((targets[:, 1:] != -100) & mask[:, 1:]).sum()
    np.testing.assert_allclose(got, want, rtol=1e-5)
    tol = 1e-4 if md is None else 2e-2  # bfloat16: dz is rounded before/after g
    for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(gw)):
        a, b = np.asarray(a), np.asarray(b)
        assert np.linalg.norm(a - b) <= tol * np.linalg.norm(b) + 1e-7


def test_packed_rows_without_labels_count_no_target_across_documents():
    # labels default to the input ids; in a packed row the id after a document's
    # last token is the next document's first one, which that position cannot see:
    # the loss must skip it as the data pipeline's labels (-100 there) do, so the
    # loss, its weight and the gradients equal those of the documents padded alone
    from entrenar.data import pack_rows, pad_rows
    from entrenar.train.model_loss import loss_for_model

    rng = np.random.default_rng(1)
    docs = [rng.integers(0, MODEL.vocab_size, n).astype(np.int32)
            for n in (3, 7, 12, 5, 9, 2)]  # fmt: skip
    docs = [(ids, ids) for ids in docs]  # every token trained
    packed = pack_rows(docs, 16)
    assert packed["segment_ids"].max() > 1  # rows hold several documents
    unlabelled = {k: v for k, v in packed.items() if k != "labels"}
    params = MODEL.init(jax.random.key(0))
    loss_fn = loss_for_model(MODEL)

    def run(batch):
        vg = jax.value_and_grad(lambda p: loss_fn(p, batch, key=None), has_aux=True)
        return vg(params)

    (alone, a0), g0 = run(pad_rows(docs, 16))
    for batch in (packed, unlabelled):
        (loss, aux), g = run(batch)
        assert float(aux["loss_weight"]) == float(a0["loss_weight"]) == 32
        np.testing.assert_allclose(loss, alone, rtol=1e-6)
        for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g0)):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
