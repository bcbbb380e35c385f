"""A GGUF the writer would refuse is refused before training, with its message.

Each case is a config that passes validation but that `entrenar.io.save_llama_gguf`
refuses (`entrenar.io.check_llama_gguf`, which the writer runs first): EXAONE 4's
sliding layers at a layer count where llama.cpp attends fully, GLM-4.5 with rotary
scaling, Ministral 3 with a sliding window, DeepSeek's experts in MXFP4 at rows
that are not whole blocks, and a
quantized GGUF copy whose rows are not whole blocks. A YAML run asking for that
export fails before its first step (no checkpoint, no metrics), `entrenar
validate`'s preflight with it, and the writer still refuses the same inputs with
the same error.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import warnings
from pathlib import Path

import jax
import pytest
import yaml

from entrenar import io, nn
from entrenar.config import validate
from entrenar.errors import ConfigError, UnsupportedError
from entrenar.runs import train_from_yaml
from entrenar.runs.preflight import preflight

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "io"))
import hf_cases

CASES = {
    "exaone4_sliding_at_2_layers": (
        "exaone4", {}, {"export": {"formats": ["gguf"], "gguf_type": "F16"}},
        "export.formats: 'gguf'", "has sliding layers only at 64 layers",
    ),
    "glm4_moe_yarn": (
        "glm4_moe",
        dict(rope_type="yarn", rope_factor=4.0,
             rope_original_max_position_embeddings=32),
        {"export": {"formats": ["gguf"], "gguf_type": "F16"}},
        "export.formats: 'gguf'", "rope_type 'yarn'",
    ),
    "ministral3_window": (
        "ministral3", dict(sliding_window=16),
        {"export": {"formats": ["gguf"], "gguf_type": "F32"}},
        "export.formats: 'gguf'", "has no sliding window",
    ),
    "deepseek_mxfp4_experts_12_wide": (  # (MXFP4 needs rows of 32-value blocks)
        "deepseek_v3", {},
        {"export": {"formats": ["gguf"], "gguf_type": "F16",
                    "gguf_expert_type": "MXFP4"}},
        "export.gguf_expert_type", "experts' rows of whole 32-value blocks",
    ),
    "deepseek_q8_0_copy": (
        "deepseek_v3", {}, {"quantization": {"scheme": "q8_0"}},
        "quantization.scheme: q8_0", "rows of whole 32-value blocks",
    ),
}  # fmt: skip


def _case(name: str, path: Path) -> tuple[nn.LlamaConfig, dict, dict]:
    """The case's model as a Hugging Face folder, and a 2-step run on it."""
    family, overrides, sections, _, _ = CASES[name]
    config = dataclasses.replace(
        nn.architecture(family).tiny(), vocab_size=512, **overrides
    )  # the tokenizer's 300 tokens fit
    params = config.init(jax.random.key(0))
    hf_cases.write_tokenizer(path / "tok", family)
    tok = io.HFTokenizer.from_folder(path / "tok")
    io.save_hf_folder(path / "hf", config, params, tokenizer=tok)
    rows = [{"messages": hf_cases.MESSAGES[:2]}] * 4
    (path / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    doc = {
        "model": {"path": str(path / "hf")},
        "data": {"train": "chat.jsonl", "format": "chat", "batch_size": 2,
                 "seq_len": 64},
        "training": {"max_steps": 2, "checkpoint_every": 1,
                     "output_dir": str(path / "out")},
        **sections,
    }  # fmt: skip
    (path / "run.yaml").write_text(yaml.safe_dump(doc))
    return config, params, doc


@pytest.mark.parametrize("name", list(CASES))
def test_a_gguf_the_writer_refuses_fails_the_run_before_a_step(name, tmp_path):
    config, params, doc = _case(name, tmp_path)
    _, _, _, key, why = CASES[name]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # llama.cpp-fidelity notes
        with pytest.raises(ConfigError) as run:
            train_from_yaml(tmp_path / "run.yaml", progress=False)
        with pytest.raises(ConfigError) as checked:
            preflight(validate(tmp_path / "run.yaml"))  # entrenar validate
    message = str(run.value)
    assert message.startswith(key) and why in message, message
    assert str(checked.value) == message
    out = tmp_path / "out"
    assert not (out / "checkpoints").exists()  # no step was taken
    assert not (out / "metrics.jsonl").exists() and not (out / "config.json").exists()
    # the writer refuses the same config with the same error, and writes nothing
    q = doc.get("quantization")
    kw = {"tensor_type": q["scheme"]} if q else {
        "tensor_type": doc["export"]["gguf_type"],
        "expert_type": doc["export"].get("gguf_expert_type"),
    }  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        with pytest.raises((ConfigError, UnsupportedError)) as check:
            io.check_llama_gguf(config, **kw)
        with pytest.raises(type(check.value)) as wrote:
            io.save_llama_gguf(tmp_path / "m.gguf", config, params, **kw)
    assert str(wrote.value) == str(check.value) and str(check.value) in message
    assert not list(tmp_path.glob("m.gguf*"))
