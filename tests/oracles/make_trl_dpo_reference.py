r"""Record TRL's DPOTrainer on a tiny Llama: tokenized pairs, batches, losses, weights.

TRL 1.16's `DPOTrainer` (transformers 5.25, PEFT 0.21.2, torch CPU, float32) trains
the tiny Llama of tests/peft_cases.py (its vocabulary the size of the tiny
``qwen2_split`` tokenizer of tests/io/hf_cases.py, ChatML template) on
`RECORDS` for a few SGD steps, twice:

- ``lora``: LoRA through ``peft_config`` (r 4, alpha 8, q/v projections, no
  dropout) on the conversational records without a ``prompt`` (TRL extracts the
  shared turns) and no reference model: the reference is the model with the
  adapters off;
- ``full``: full fine-tuning on the standard (text) records, the reference
  log-probabilities precomputed with the starting model
  (``precompute_ref_log_probs=True``).

TRL's tokenization alone (``max_length=None``) is also recorded for the tokenizers
of `TOKENIZATION_STYLES`, on the four formats of `tokenization_sets` (standard or
conversational, with or without ``prompt``).

Each run records: the tokenized dataset (``prompt_ids``, ``chosen_ids``,
``rejected_ids`` per record, after TRL's filter of prompts that fill
``max_length``), each step's batch (the dataset rows it drew, and the collated
``input_ids``/``attention_mask``/``completion_mask``), the loss and TRL's metrics
of each step (computed before that step's update), and the trained weights (LoRA:
PEFT's adapter tensors; full: every weight, Hugging Face names). The starting
weights (entrenar's ``CFG.init(key(0))``, written under Hugging Face names) and
PEFT's initial adapter are stored too, so tests/train/test_dpo_trl.py starts
entrenar from the same numbers without TRL, PEFT or torch.

Dropout is off (TRL's ``disable_dropout`` and the LoRA config), gradient
clipping off (``max_grad_norm=0``), bf16 off, a constant learning rate without
warm-up. Run it with a Python that has TRL 1.16 (a venv whose site-packages
adds the project's)::

    PYTHONPATH=$PWD:$PWD/tests:$PWD/tests/io /tmp/trlvenv/bin/python \
        tests/oracles/make_trl_dpo_reference.py --out tests/data
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import tempfile
from pathlib import Path

import jax
import numpy as np

RECORDS_TEXT = [
    {"prompt": "Hello world, how", "chosen": " are you today?", "rejected": " bad."},
    {"prompt": "The quick brown fox", "chosen": " jumps over the lazy dog.",
     "rejected": " is lazy."},
    {"prompt": "def add(a, b):", "chosen": "\n    return a + b\n",
     "rejected": "\n    return a"},
    {"prompt": "Numbers 12345 and", "chosen": " 3.14159 in a sentence.",
     "rejected": " words"},
    {"prompt": "café, naïve", "chosen": " 日本語, emoji 😀.", "rejected": " text"},
    {"prompt": "Hello world, how are you today? The quick brown fox jumps over",
     "chosen": " the lazy dog. The quick brown fox jumps over the lazy dog again.",
     "rejected": " a dog."},
]  # fmt: skip
"""Standard preference records; the last is longer than ``max_length`` (truncated)."""


def _turns(user: str, chosen: str, rejected: str, before=()) -> dict:
    u = [*before, {"role": "user", "content": user}]
    return {
        "chosen": [*u, {"role": "assistant", "content": chosen}],
        "rejected": [*u, {"role": "assistant", "content": rejected}],
    }


RECORDS_CHAT = [
    _turns("Hello world", "Hi, how are you today?", "No."),
    _turns("How are you?", "Quick and brown.", "The lazy dog is lazy and lazy."),
    _turns("add(a, b)?", "return a + b", "a - b",
           before=[{"role": "system", "content": "Be brief."}]),
    _turns("Numbers?", "12345 and 3.14159", "none",
           before=[{"role": "user", "content": "Hello"},
                   {"role": "assistant", "content": "Hi"}]),
    _turns("emoji", "😀", "日本語 text that goes on and on and on past the limit"),
    _turns("The fox?", "It jumps.", "It sleeps."),
]  # fmt: skip
"""Conversational records without ``prompt``: TRL extracts the shared turns."""

MAX_LENGTH = 40
STYLE = "qwen2_split"  # ChatML; Qwen2's split regex, as transformers' Qwen2Tokenizer
SETTINGS = dict(beta=0.1, learning_rate=0.5, batch=2, steps=3)
LORA = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])


def model_config(vocab_size: int):
    """The tiny Llama of tests/peft_cases.py with the tokenizer's vocabulary."""
    from peft_cases import CFG

    return dataclasses.replace(CFG, vocab_size=vocab_size, max_position_embeddings=64)


def torch_model(cfg, weights: dict[str, np.ndarray]):
    import torch
    import transformers

    hf_cfg = transformers.LlamaConfig(**cfg.to_hf_config())
    model = transformers.LlamaForCausalLM(hf_cfg)
    if weights is None:  # tokenization only
        return model
    state = {k: torch.from_numpy(v.copy()) for k, v in weights.items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and all("rotary" in m for m in missing), (missing, unexpected)
    return model


def run(name, records, tokenizer, weights, cfg, workdir: Path) -> tuple[dict, dict]:
    """Train with TRL; return (JSON record, arrays)."""
    import datasets
    import peft
    import torch
    import trl

    model = torch_model(cfg, weights)
    lora = name == "lora"
    pcfg = None
    if lora:  # TRL wraps the model; its reference is the model with adapters off
        torch.manual_seed(7)
        pcfg = peft.LoraConfig(**LORA, lora_dropout=0.0, task_type="CAUSAL_LM")
    args = trl.DPOConfig(
        output_dir=str(workdir / name),
        per_device_train_batch_size=SETTINGS["batch"],
        max_steps=SETTINGS["steps"],
        learning_rate=SETTINGS["learning_rate"],
        optim="sgd",
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=0.0,
        beta=SETTINGS["beta"],
        max_length=MAX_LENGTH,
        bf16=False,
        gradient_checkpointing=False,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        seed=0,
        use_cpu=True,
        precompute_ref_log_probs=not lora,
        dataloader_drop_last=True,
    )
    steps: list[dict] = []

    class Recording(trl.DPOTrainer):
        def _compute_loss(self, model, inputs, return_outputs):
            loss = super()._compute_loss(model, inputs, return_outputs)
            metrics = {k: float(v[-1]) for k, v in self._metrics["train"].items()
                       if k.startswith(("rewards/", "logps/"))}  # fmt: skip
            steps.append({
                "loss": float(loss.detach()),
                "metrics": metrics,
                "input_ids": inputs["input_ids"].tolist(),
                "attention_mask": inputs["attention_mask"].tolist(),
                "completion_mask": inputs["completion_mask"].tolist(),
            })  # fmt: skip
            return loss

    trainer = Recording(
        model=model,
        args=args,
        train_dataset=datasets.Dataset.from_list(records),
        processing_class=tokenizer,
        peft_config=pcfg,
    )
    if lora:
        trainer.model.save_pretrained(workdir / "init_adapter")
    ds = trainer.train_dataset
    tokenized = [
        {k: list(ds[i][k]) for k in ("prompt_ids", "chosen_ids", "rejected_ids")}
        for i in range(len(ds))
    ]
    trainer.train()
    rows = [[ds[i]["prompt_ids"] + ds[i]["chosen_ids"] for i in range(len(ds))]]
    for s in steps:  # which dataset rows each batch drew (HF's seeded shuffle)
        half = len(s["input_ids"]) // 2
        s["rows"] = [
            _row_of(s["input_ids"][j], s["attention_mask"][j], rows[0])
            for j in range(half)
        ]
    arrays: dict[str, np.ndarray] = {}
    trained = trainer.model
    for key, value in trained.state_dict().items():
        if lora and "lora_" not in key:
            continue
        arrays[f"{name}/final/{key}"] = value.detach().numpy().astype(np.float32)
    out = {"tokenized": tokenized, "steps": steps}
    if lora:
        from safetensors.numpy import load_file

        init = load_file(str(workdir / "init_adapter" / "adapter_model.safetensors"))
        for key, value in init.items():
            arrays[f"{name}/init_adapter/{key}"] = value
        out["adapter_config"] = json.loads(
            (workdir / "init_adapter" / "adapter_config.json").read_text()
        )
    return out, arrays


TOKENIZATION_STYLES = ("llama", "mistral", "phi3", "gemma", "qwen2_split")
"""tests/io/hf_cases.py's tokenizers whose TRL tokenization is recorded (BOS or not,
byte-level or SentencePiece-style, templates that write the BOS themselves)."""


def tokenization_sets() -> dict[str, list[dict]]:
    """The four preference formats: standard or conversational, prompt or not."""
    talk = [{k: v for k, v in r.items()} for r in RECORDS_CHAT]
    explicit_talk = []
    for r in talk:
        n = len(r["chosen"]) - 1
        explicit_talk.append({"prompt": r["chosen"][:n], "chosen": r["chosen"][n:],
                              "rejected": r["rejected"][n:]})  # fmt: skip
    implicit_text = [
        {"chosen": r["prompt"] + r["chosen"], "rejected": r["prompt"] + r["rejected"]}
        for r in RECORDS_TEXT
    ]
    return {
        "standard": RECORDS_TEXT,
        "standard_implicit": implicit_text,
        "conversational": explicit_talk,
        "conversational_implicit": RECORDS_CHAT,
    }


def record_tokenization(workdir: Path) -> dict:
    """``{style: {set: [{prompt_ids, chosen_ids, rejected_ids}, ...]}}`` from TRL."""
    import datasets
    import hf_cases  # tests/io
    import transformers
    import trl

    out: dict = {}
    for style in TOKENIZATION_STYLES:
        folder = workdir / f"tok-{style}"
        hf_cases.write_tokenizer(folder, style)
        tok = transformers.AutoTokenizer.from_pretrained(folder)
        if tok.pad_token is None:
            tok.pad_token = tok.eos_token
        model = torch_model(model_config(len(tok)), None)
        out[style] = {}
        for name, recs in tokenization_sets().items():
            args = trl.DPOConfig(output_dir=str(workdir / "t"), report_to=[],
                                 use_cpu=True, bf16=False, max_length=None)  # fmt: skip
            trainer = trl.DPOTrainer(
                model=model, ref_model=copy.deepcopy(model), args=args,
                processing_class=tok,
                train_dataset=datasets.Dataset.from_list(copy.deepcopy(recs)),
            )  # fmt: skip
            ds = trainer.train_dataset
            keys = ("prompt_ids", "chosen_ids", "rejected_ids")
            out[style][name] = [
                {k: list(ds[i][k]) for k in keys} for i in range(len(ds))
            ]
    return out


def _row_of(ids: list[int], mask: list[int], rows: list[list[int]]) -> int:
    n = sum(mask)
    matches = [i for i, r in enumerate(rows) if r[:n] == ids[:n]]
    assert len(matches) == 1, (ids, matches)
    return matches[0]


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
        record: dict = {
            "versions": {
                "trl": trl.__version__, "transformers": transformers.__version__,
                "torch": torch.__version__,
                "peft": __import__("peft").__version__,
            },
            "tokenizer_style": STYLE,
            "vocab_size": len(tokenizer),
            "max_length": MAX_LENGTH,
            "settings": SETTINGS,
            "lora": LORA,
            "records": {"full": RECORDS_TEXT, "lora": RECORDS_CHAT},
        }  # fmt: skip
        arrays = {f"init/{k}": v for k, v in weights.items()}
        for name, recs in (("full", RECORDS_TEXT), ("lora", RECORDS_CHAT)):
            result, arr = run(name, copy.deepcopy(recs), tokenizer, weights, cfg, work)
            record[name] = result
            arrays.update(arr)
        record["tokenization"] = record_tokenization(work)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "trl_dpo_reference.json").write_text(json.dumps(record) + "\n")
    np.savez_compressed(out_dir / "trl_dpo_reference.npz", **arrays)
    for name in ("full", "lora"):
        print(name, [round(s["loss"], 6) for s in record[name]["steps"]])


if __name__ == "__main__":
    main()
