r"""Record TRL's GRPOTrainer on a tiny Llama: completions, rewards, losses, weights.

TRL 1.16's `GRPOTrainer` (transformers 5.25, PEFT 0.21.2, torch CPU, float32)
trains the tiny Llama of tests/peft_cases.py (the vocabulary of the tiny
``qwen2_split`` tokenizer of tests/io/hf_cases.py) on `PROMPTS` with the reward
functions `reward_len` and `reward_vowels`, for a few SGD steps, twice:

- ``lora``: LoRA through ``peft_config`` (r 4, alpha 8, q/v projections, no
  dropout), ``loss_type="grpo"``, ``beta=0.04`` (the reference: the adapters off),
  ``temperature=0.8`` (TRL divides the logits by it when it scores), one pass per
  generation;
- ``full``: full fine-tuning, TRL's default ``loss_type="dapo"``,
  ``scale_rewards="batch"``, ``beta=0.04`` (the reference a second copy loaded
  from the saved starting model), ``num_iterations=2`` with ``epsilon=0.05``: the
  second pass over a generation has ``π_θ ≠ π_old`` and clips.

Generation samples, so the test cannot regenerate TRL's completions; each
generation's output (`_generate_and_score_completions`: ``prompt_ids`` left
padded, ``completion_ids`` right padded, their masks, the advantages) and each
reward function's scores are recorded, then each step's loss (`_compute_loss`)
and TRL's metrics of that step, and the trained weights (LoRA: PEFT's adapter
tensors; full: every weight). The starting weights (entrenar's
``CFG.init(key(0))`` under Hugging Face names) and PEFT's initial adapter are
stored, so tests/preference/test_grpo_trl.py replays the steps without TRL.

Dropout off, gradient clipping off (``max_grad_norm=0``), constant learning rate.
Run it with a Python that has TRL 1.16::

    PYTHONPATH=$PWD:$PWD/tests:$PWD/tests/io /tmp/trlvenv/bin/python \
        tests/oracles/make_trl_grpo_reference.py --out tests/data
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import jax
import numpy as np

PROMPTS = ["Hello world, how", "The quick brown fox", "def add(a, b):",
           "Numbers 12345 and", "café, naïve", "Once upon a time"]  # fmt: skip
STYLE = "qwen2_split"
LORA = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
RUNS = {
    "lora": dict(loss_type="grpo", beta=0.04, temperature=0.8, scale_rewards="group",
                 num_iterations=1, epsilon=0.2, steps=3, learning_rate=0.5),
    "full": dict(loss_type="dapo", beta=0.04, temperature=1.0, scale_rewards="batch",
                 num_iterations=2, epsilon=0.05, steps=4, learning_rate=0.5),
}  # fmt: skip
NUM_GENERATIONS = 4
BATCH = 8  # 2 prompts x 4 completions per step
MAX_COMPLETION_LENGTH = 8
REWARD_WEIGHTS = [1.0, 0.5]
STOP_IDS = list(range(40, 70))


def reward_len(completions, **kwargs):
    """Shorter is better: ``−|len − 6| / 6`` of the completion text."""
    return [-abs(len(c) - 6) / 6.0 for c in completions]


def reward_vowels(completions, **kwargs):
    """The fraction of the completion's characters that are vowels."""
    return [sum(ch in "aeiou" for ch in c) / max(len(c), 1) for c in completions]


def model_config(vocab_size: int):
    import dataclasses

    from peft_cases import CFG

    return dataclasses.replace(CFG, vocab_size=vocab_size, max_position_embeddings=64)


def run(name, tokenizer, model_dir: Path, workdir: Path) -> tuple[dict, dict]:
    """Train with TRL; return (JSON record, arrays)."""
    import datasets
    import peft
    import torch
    import trl

    s = RUNS[name]
    lora = name == "lora"
    pcfg = None
    if lora:
        pcfg = peft.LoraConfig(**LORA, lora_dropout=0.0, task_type="CAUSAL_LM")
    args = trl.GRPOConfig(
        output_dir=str(workdir / name),
        per_device_train_batch_size=BATCH,
        num_generations=NUM_GENERATIONS,
        max_completion_length=MAX_COMPLETION_LENGTH,
        max_steps=s["steps"],
        learning_rate=s["learning_rate"],
        optim="sgd",
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=0.0,
        beta=s["beta"],
        epsilon=s["epsilon"],
        loss_type=s["loss_type"],
        scale_rewards=s["scale_rewards"],
        temperature=s["temperature"],
        num_iterations=s["num_iterations"],
        reward_weights=REWARD_WEIGHTS,
        bf16=False,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        seed=0,
        use_cpu=True,
        disable_dropout=True,
        model_init_kwargs={"dtype": torch.float32},
    )
    generations: list[dict] = []
    steps: list[dict] = []
    scores: list[list[list[float]]] = []

    def scored(fn):
        def wrapped(**kw):  # TRL passes prompts, completions... by keyword
            out = fn(**kw)
            scores.append(out)
            return out

        wrapped.__name__ = fn.__name__
        return wrapped

    class Recording(trl.GRPOTrainer):
        def _generate_and_score_completions(self, inputs):
            out = super()._generate_and_score_completions(inputs)
            per_func = scores[-2:]  # this call's two reward functions
            generations.append({
                "prompt_ids": out["prompt_ids"].tolist(),
                "prompt_mask": out["prompt_mask"].tolist(),
                "completion_ids": out["completion_ids"].tolist(),
                "completion_mask": out["completion_mask"].tolist(),
                "advantages": out["advantages"].tolist(),
                "rewards_per_func": [list(map(float, r)) for r in per_func],
                "num_items_in_batch": int(out["num_items_in_batch"]),
                "metrics": {k: float(v[-1]) for k, v in self._metrics["train"].items()},
            })  # fmt: skip
            return out

        def _compute_loss(self, model, inputs):
            loss = super()._compute_loss(model, inputs)
            keys = ("kl", "entropy", "clip_ratio/")
            steps.append({
                "loss": float(loss.detach()),
                "generation": len(generations) - 1,
                "metrics": {k: float(v[-1]) for k, v in self._metrics["train"].items()
                            if k.startswith(keys)},
                "advantages": inputs["advantages"].tolist(),
            })  # fmt: skip
            return loss

    trainer = Recording(
        model=str(model_dir),
        reward_funcs=[scored(reward_len), scored(reward_vowels)],
        args=args,
        train_dataset=datasets.Dataset.from_list([{"prompt": p} for p in PROMPTS]),
        processing_class=tokenizer,
        peft_config=pcfg,
    )
    if lora:
        trainer.model.save_pretrained(workdir / "init_adapter")
    trainer.train()
    arrays: dict[str, np.ndarray] = {}
    for key, value in trainer.model.state_dict().items():
        if lora and "lora_" not in key:
            continue
        arrays[f"{name}/final/{key}"] = value.detach().numpy().astype(np.float32)
    out = {"settings": s, "generations": generations, "steps": steps}
    if lora:
        from safetensors.numpy import load_file

        init = load_file(str(workdir / "init_adapter" / "adapter_model.safetensors"))
        for key, value in init.items():
            arrays[f"{name}/init_adapter/{key}"] = value
        out["adapter_config"] = json.loads(
            (workdir / "init_adapter" / "adapter_config.json").read_text()
        )
    return out, arrays


def main() -> None:
    import hf_cases  # tests/io
    import torch
    import transformers
    import trl

    from entrenar.nn import to_hf_names

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    out_dir = parser.parse_args().out
    torch.use_deterministic_algorithms(True)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        hf_cases.write_tokenizer(work / "tok", STYLE)
        tokenizer = transformers.AutoTokenizer.from_pretrained(work / "tok")
        cfg = model_config(len(tokenizer))
        params = cfg.init(jax.random.key(0))
        weights = {k: np.asarray(v, np.float32) for k, v in to_hf_names(params).items()}
        model = transformers.LlamaForCausalLM(
            transformers.LlamaConfig(**cfg.to_hf_config())
        )
        state = {k: torch.from_numpy(v.copy()) for k, v in weights.items()}
        missing, unexpected = model.load_state_dict(state, strict=False)
        assert not unexpected and all("rotary" in m for m in missing)
        # A random tiny model rarely draws its one EOS; STOP_IDS more end ~1 in 10
        # completions early, so the masks are ragged.
        model.generation_config.eos_token_id = [tokenizer.eos_token_id, *STOP_IDS]
        model.save_pretrained(work / "model")
        tokenizer.save_pretrained(work / "model")
        record: dict = {
            "versions": {
                "trl": trl.__version__, "transformers": transformers.__version__,
                "torch": torch.__version__, "peft": __import__("peft").__version__,
            },
            "tokenizer_style": STYLE,
            "vocab_size": len(tokenizer),
            "eos_token_ids": [tokenizer.eos_token_id, *STOP_IDS],
            "pad_token_id": tokenizer.pad_token_id,
            "num_generations": NUM_GENERATIONS,
            "batch": BATCH,
            "max_completion_length": MAX_COMPLETION_LENGTH,
            "reward_weights": REWARD_WEIGHTS,
            "lora": LORA,
            "prompts": PROMPTS,
        }  # fmt: skip
        arrays = {f"init/{k}": v for k, v in weights.items()}
        for name in RUNS:
            torch.manual_seed(7)
            result, arr = run(name, tokenizer, work / "model", work)
            record[name] = result
            arrays.update(arr)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "trl_grpo_reference.json").write_text(json.dumps(record) + "\n")
    np.savez_compressed(out_dir / "trl_grpo_reference.npz", **arrays)
    for name in RUNS:
        print(name, [round(s["loss"], 6) for s in record[name]["steps"]])


if __name__ == "__main__":
    main()
