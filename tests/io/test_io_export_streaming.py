"""Streaming export: a QLoRA tree written layer by layer, the files of the dense tree.

`save_llama_gguf` and `save_hf_folder` take the trained tree as it is (NF4 bases
with LoRA adapters) and fold and dequantize each layer as they write it. The files
must be those of the export before streaming, which folded the whole tree
(`lora.fold`, `quant.dequantize_params`) and wrote the dense arrays: the GGUF byte for
byte, each Hugging Face shard byte for byte against the ``safetensors`` package's
writer of the dense tensors. The peak resident memory of the export (``VmHWM`` in a
subprocess) stays under a few of the largest tensor, where the whole fold holds the
model in float32.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest

from entrenar import io, lora, nn, quant
from entrenar.io.safetensors_io import save_safetensors


def tiny_config(**sizes) -> nn.LlamaConfig:
    fields = dict(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=3,
        num_heads=4, num_kv_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    return nn.LlamaConfig(**(fields | sizes))


def qlora_tree(config: nn.LlamaConfig, dtype: str) -> dict:
    """Random weights in ``dtype``, NF4 bases on every linear layer, B != 0."""
    params = config.init(jax.random.key(0))
    params = jax.tree_util.tree_map(lambda a: (a * 0.5).astype(dtype), params)
    cfg = lora.LoRAConfig(rank=4, alpha=8, targets="all-linear", quantize_base="nf4")
    p = lora.apply(params, cfg, key=jax.random.key(1), quantize="nf4")

    def trained(x):
        if not isinstance(x, lora.LoRAWeight):
            return x
        b = jax.random.normal(jax.random.key(2), x.b.shape, x.b.dtype) * 0.1
        return x.replace(b=b)

    return jax.tree_util.tree_map(
        trained, p, is_leaf=lambda x: isinstance(x, lora.LoRAWeight)
    )


def dense_of(p) -> dict:
    """The export before streaming: the whole tree folded and dequantized."""
    return jax.device_get(quant.dequantize_params(lora.fold(p)))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("kind", ["F32", "BF16", "Q8_0", "Q4_1"])
def test_gguf_of_the_qlora_tree_is_the_dense_trees(tmp_path, dtype, kind):
    config = tiny_config()
    p = qlora_tree(config, dtype)
    io.save_llama_gguf(tmp_path / "stream.gguf", config, p, tensor_type=kind)
    io.save_llama_gguf(tmp_path / "dense.gguf", config, dense_of(p), tensor_type=kind)
    assert (tmp_path / "stream.gguf").read_bytes() == (
        tmp_path / "dense.gguf"
    ).read_bytes()


def test_gguf_written_lazily_reads_back_as_the_dense_tree(tmp_path):
    config = tiny_config()
    p = qlora_tree(config, "float32")
    io.save_llama_gguf(tmp_path / "m.gguf", config, p, tensor_type="F32")
    _, back, _ = io.load_llama_gguf(str(tmp_path / "m.gguf"), dtype="float32")
    want = dense_of(p)
    for (path, a), (_, b) in zip(
        jax.tree_util.tree_leaves_with_path(back),
        jax.tree_util.tree_leaves_with_path(want),
        strict=True,
    ):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=str(path))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_hf_folder_of_the_qlora_tree_is_the_safetensors_packages(tmp_path, dtype):
    config = tiny_config()
    p = qlora_tree(config, dtype)
    out = io.save_hf_folder(tmp_path / "hf", config, p, max_shard_bytes=60_000)
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2
    flat = nn.to_hf_names(dense_of(p))
    for shard in shards:
        names = [k for k, v in index["weight_map"].items() if v == shard]
        ref = tmp_path / f"ref-{shard}"
        save_safetensors({k: flat[k] for k in names}, ref, {"format": "pt"})
        assert (tmp_path / "hf" / shard).read_bytes() == ref.read_bytes(), shard
    assert index["metadata"]["total_size"] == sum(a.nbytes for a in flat.values())
    config_json = json.loads(open(os.path.join(out, "config.json")).read())
    assert config_json["torch_dtype"] == dtype  # bfloat16's numpy kind is "V"


# ---- peak memory, in a subprocess ---------------------------------------------------

MEASURE = textwrap.dedent(
    """
    import gc, json, sys
    import jax
    sys.path.insert(0, sys.argv[2])
    from test_io_export_streaming import dense_of, qlora_tree, tiny_config
    from entrenar import io

    out = sys.argv[1]
    config = tiny_config(
        vocab_size=2048, hidden_size=256, intermediate_size=1024, num_layers=16,
        num_heads=4, num_kv_heads=4,
    )
    p = jax.block_until_ready(qlora_tree(config, "float32"))

    def status(key):
        for line in open("/proc/self/status"):
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024

    def export(how):
        tree = p if how == "stream" else dense_of(p)
        io.save_llama_gguf(f"{out}/{how}.gguf", config, tree, tensor_type="F32")
        io.save_hf_folder(f"{out}/{how}-hf", config, tree, max_shard_bytes=8 << 20)

    res = {}
    for how in ("stream", "whole"):
        export(how)  # compile first: measure no compiler
        gc.collect()
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM to the current RSS
        before = status("VmRSS")
        export(how)
        res[how] = status("VmHWM") - before
        gc.collect()
    print(json.dumps(res))
    """
)


@pytest.mark.skipif(
    not os.path.exists("/proc/self/clear_refs"), reason="needs Linux's VmHWM reset"
)
def test_streaming_export_peak_is_a_few_tensors_not_the_model(tmp_path):
    """An export holds a few tensors, the whole fold the model.

    18.6M parameters (75 MB of float32) in 16 layers; the largest tensor is the
    embedding (2 MB), a layer's largest 1 MB.
    """
    env = dict(os.environ, JAX_PLATFORMS="cpu", MALLOC_MMAP_THRESHOLD_="65536")
    res = subprocess.run(
        [sys.executable, "-c", MEASURE, str(tmp_path), os.path.dirname(__file__)],
        capture_output=True, text=True, env=env, timeout=600, check=True,
    )  # fmt: skip
    peaks = json.loads(res.stdout.strip().splitlines()[-1])
    largest = 2048 * 256 * 4
    bound = 4 * largest + (8 << 20)  # 8 MB of the interpreter's noise
    assert peaks["stream"] < bound, (peaks, bound)
    assert peaks["whole"] > bound, (peaks, bound)  # the model tells them apart
    assert (tmp_path / "stream.gguf").read_bytes() == (
        tmp_path / "whole.gguf"
    ).read_bytes()
    files = sorted(os.listdir(tmp_path / "stream-hf"))
    assert files == sorted(os.listdir(tmp_path / "whole-hf")) and len(files) > 3
    for name in files:
        a, b = tmp_path / "stream-hf" / name, tmp_path / "whole-hf" / name
        assert a.read_bytes() == b.read_bytes(), name
