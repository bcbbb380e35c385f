"""The Trainer against Hugging Face's ``transformers.Trainer``: same model and data.

A tiny LlamaForCausalLM holding our weights; rows of unequal lengths (right padding)
and prompts labelled -100, so micro-batches hold unequal numbers of trained tokens;
gradient accumulation, weight decay, clipping and a warm-up. HF's settings map to a
run's keys (``weight_decay``, ``max_grad_norm``, ``gradient_accumulation_steps``,
``scheduler: {name: linear, warmup_steps}``); the losses, gradient norms, learning
rates and final weights must agree.
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from peft_cases import CFG

from entrenar import lora
from entrenar import optim as eo
from entrenar.nn import GPT2Config, to_hf_names
from entrenar.train import TrainConfig, Trainer
from entrenar.tree import key_path_str

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

N, T, LR, STEPS, GA, BS = 8, 12, 1e-2, 3, 2, 2


def rows():
    """Right-padded rows; the first two tokens of each are a prompt (-100)."""
    rng = np.random.default_rng(0)
    lengths = np.array([12, 3, 9, 5, 12, 7, 4, 11])
    mask = (np.arange(T)[None] < lengths[:, None]).astype(np.int64)  # (N, T)
    ids = np.where(mask == 1, rng.integers(3, 64, size=(N, T)), 0)
    labels = np.where(mask == 1, ids, -100)
    labels[:, :2] = -100
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def hf_llama(params):
    """A LlamaForCausalLM holding ``params``."""
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(**CFG.to_hf_config())
    )
    state = {k: torch.from_numpy(np.array(v)) for k, v in to_hf_names(params).items()}
    model.load_state_dict(state, strict=False)
    return model


def hf_trainer(model, data, tmp_path, weight_decay):
    examples = [{k: torch.tensor(v[i]) for k, v in data.items()} for i in range(N)]

    class InOrder(transformers.Trainer):  # our run with shuffle: false
        def _get_train_sampler(self, *args, **kwargs):
            return torch.utils.data.SequentialSampler(self.train_dataset)

    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=BS,
        gradient_accumulation_steps=GA, learning_rate=LR, weight_decay=weight_decay,
        max_grad_norm=0.5, lr_scheduler_type="linear", warmup_steps=1,
        max_steps=STEPS, logging_steps=1, report_to=[], save_strategy="no",
        use_cpu=True, optim="adamw_torch", seed=0, disable_tqdm=True,
    )  # fmt: skip
    trainer = InOrder(model=model, args=args, train_dataset=examples)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    weights = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    return logs, weights


def our_trainer(params, data, weight_decay, trainable=None):
    schedule = eo.ScheduleConfig(name="linear", warmup_steps=1).build(LR, STEPS)
    optimizer = eo.OptimizerConfig(name="adamw", lr=LR, weight_decay=weight_decay)
    config = TrainConfig(
        batch_size=BS, grad_accum=GA, grad_clip=0.5, max_steps=STEPS, shuffle=False,
        progress=False, log_every=1,
    )  # fmt: skip
    trainer = Trainer(
        CFG, params, optimizer.build(schedule), config, trainable=trainable
    )
    result = trainer.fit({k: jnp.asarray(v, jnp.int32) for k, v in data.items()})
    return result.history, trainer.params


def assert_same_steps(ours, theirs):
    assert len(ours) == len(theirs) == STEPS
    for o, t in zip(ours, theirs, strict=True):
        assert o["loss"] == pytest.approx(t["loss"], rel=1e-5)
        assert o["grad_norm"] == pytest.approx(t["grad_norm"], rel=1e-5)
        assert o["lr"] == pytest.approx(t["learning_rate"], abs=1e-9)


def test_trainer_steps_are_hugging_faces(tmp_path):
    """Token-weighted accumulation, global clipping, AdamW, decay not on norms."""
    params, data = CFG.init(jax.random.key(0)), rows()
    model = hf_llama(params)
    theirs, their_weights = hf_trainer(model, data, tmp_path, weight_decay=0.1)
    ours, our_params = our_trainer(params, data, weight_decay=0.1)
    assert_same_steps(ours, theirs)
    our_weights = to_hf_names(our_params)
    assert our_weights.keys() <= their_weights.keys()
    for name, w in our_weights.items():
        np.testing.assert_allclose(
            np.asarray(w), their_weights[name], atol=1e-6, err_msg=name
        )


def hf_decayed(model):
    return set(transformers.Trainer.get_decay_parameter_names(None, model))


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_decay_mask_is_hugging_faces(family):
    if family == "llama":
        cfg = dataclasses.replace(CFG, attention_bias=True, attention_out_bias=True)
        model = transformers.LlamaForCausalLM(
            transformers.LlamaConfig(**cfg.to_hf_config())
        )
    else:
        cfg = GPT2Config(vocab_size=50, n_positions=16, n_embd=16, n_layer=2, n_head=2)
        model = transformers.GPT2LMHeadModel(
            transformers.GPT2Config(**cfg.to_hf_config())
        )
    decayed = hf_decayed(model)
    names = to_hf_names(cfg.init(jax.random.key(0)))
    assert names.keys() <= dict(model.named_parameters()).keys()
    assert {n for n in names if not eo.hf_decay_mask(n)}  # some leaves left out
    for name in names:  # as the optimizer sees them: unstacked and stacked
        stacked = re.sub(r"\.\d+\.", ".", name)
        assert eo.hf_decay_mask(name) == (name in decayed), name
        assert eo.hf_decay_mask(stacked) == (name in decayed), stacked


def test_a_runs_optimizer_decays_as_hf_unless_told():
    params = {"dense": {"weight": jnp.ones(2), "bias": jnp.ones(2)}, "norm": {
        "weight": jnp.ones(2)}}  # fmt: skip
    zeros = jax.tree_util.tree_map(jnp.zeros_like, params)

    def step(**keys):
        tx = eo.OptimizerConfig(name="sgd", lr=1.0, weight_decay=0.5, **keys).build()
        updates, _ = tx.update(zeros, tx.init(params), params)
        return {k: float(v[0]) for k, v in to_hf_names(updates).items()}

    assert step() == {"dense.weight": -0.5, "dense.bias": 0.0, "norm.weight": 0.0}
    assert set(step(decay_norms_and_biases=True).values()) == {-0.5}


@pytest.mark.parametrize(
    "patterns",
    [
        {},
        {  # ranks and alphas by layer: padded stacks here, real ranks in PEFT
            "rank_pattern": {
                "model.layers.0.self_attn.q_proj": 6,
                r"layers\.1\.self_attn\.v_proj": 2,
            },
            "alpha_pattern": {r"layers\.1\.self_attn\.q_proj": 3},
        },
    ],
    ids=["plain", "per_layer_ranks"],
)  # fmt: skip
def test_lora_steps_are_hugging_faces_with_peft(tmp_path, patterns):
    """The same with LoRA adapters: our Trainer vs HF's Trainer on a PEFT model."""
    peft = pytest.importorskip("peft")
    cfg = lora.LoRAConfig(rank=4, alpha=8.0, targets=("q_proj", "v_proj"), **patterns)
    base, data = CFG.init(jax.random.key(0)), rows()
    adapted = lora.apply(base, cfg, key=jax.random.key(1))  # B = 0, A random
    lora.save_adapter(
        adapted, tmp_path / "start", base_model_name_or_path=str(tmp_path)
    )
    model = peft.PeftModel.from_pretrained(
        hf_llama(base), str(tmp_path / "start"), is_trainable=True
    )
    theirs, _ = hf_trainer(model, data, tmp_path / "hf", weight_decay=0.1)
    ours, our_params = our_trainer(adapted, data, weight_decay=0.1, trainable="lora")
    assert_same_steps(ours, theirs)
    model.save_pretrained(str(tmp_path / "theirs"))
    lora.save_adapter(
        our_params, tmp_path / "ours", base_model_name_or_path=str(tmp_path)
    )
    name = "adapter_model.safetensors"
    st = pytest.importorskip("safetensors.numpy")
    want = st.load_file(str(tmp_path / "theirs" / name))
    got = st.load_file(str(tmp_path / "ours" / name))
    assert got.keys() == want.keys()
    for key, value in got.items():
        np.testing.assert_allclose(value, want[key], atol=1e-6, err_msg=key)


def test_lora_adapters_are_decayed_as_under_peft():
    peft = pytest.importorskip("peft")
    model = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(**CFG.to_hf_config())
    )
    model = peft.get_peft_model(
        model, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"])
    )
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trained and trained <= hf_decayed(model)  # PEFT's lora_A, lora_B
    adapted = lora.apply(
        CFG.init(jax.random.key(0)),
        lora.LoRAConfig(rank=4, targets=("q_proj", "v_proj")),
        key=jax.random.key(1),
    )
    flat = jax.tree_util.tree_flatten_with_path(adapted)[0]
    names = [key_path_str(path) for path, _ in flat if "lora_" in key_path_str(path)]
    assert len(names) == 2 * 2  # A and B of two targets (layers stacked)
    assert all(eo.hf_decay_mask(n) for n in names)
