"""Streaming loads: the same tree as the whole-file load, in the memory of one leaf.

A sharded bfloat16 Hugging Face folder and a GGUF are loaded tensor by tensor
(``stream=True``, the default) and the old way (``stream=False``: every tensor
stacked, cast, then quantized); the trees are bit-identical for float32, bfloat16 and
stored dtypes, with and without NF4 bases, as a QLoRA run asks for them. The peak
resident memory of a load, measured in a subprocess (``VmHWM``, counting the mapped
files' pages and JAX's CPU buffers, which tracemalloc does not see), stays under the
final tree plus about one stacked leaf (half a leaf with NF4 bases, quantized layer by
layer), where the old load exceeds it.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import textwrap

import jax
import ml_dtypes
import numpy as np
import pytest

from entrenar import io, lora, nn, quant
from entrenar.errors import QuantizationError
from entrenar.io import ggml_dequant
from entrenar.nn import hf_names
from entrenar.nn.weight_node import is_weight_node
from entrenar.runs.models import base_quantizer, load_built
from entrenar.tree import tree_named_leaves

QLORA = lora.LoRAConfig(
    rank=4, alpha=8, targets=["q_proj", "v_proj", "up_proj"], quantize_base="nf4"
)


def tiny_config(**sizes) -> nn.LlamaConfig:
    fields = dict(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=3,
        num_heads=4, num_kv_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    return nn.LlamaConfig(**(fields | sizes))


def random_params(config: nn.LlamaConfig, dtype: str) -> dict:
    """Random normal weights (scale 0.02) in ``dtype``, one draw per leaf."""
    rng = np.random.default_rng(0)

    def one(shape):
        return (rng.standard_normal(shape, np.float32) * 0.02).astype(dtype)

    def walk(shapes):
        return {
            k: walk(v) if isinstance(v, dict) else one(tuple(v))
            for k, v in shapes.items()
        }

    return walk(config.param_shapes())


def write_folder(path, config, *, dtype="bfloat16", shard_bytes=60_000) -> str:
    params = jax.tree_util.tree_map(np.asarray, random_params(config, dtype))
    return io.save_hf_folder(path, config, params, max_shard_bytes=shard_bytes)


def as_bytes(tree) -> dict[str, tuple[str, str, tuple[int, ...], bytes]]:
    """Every array of ``tree`` by path: type, dtype, shape and raw bytes."""
    out = {}
    for name, leaf in tree_named_leaves(tree, is_leaf=is_weight_node):
        parts = jax.tree_util.tree_leaves(leaf)
        for i, a in enumerate(parts):
            a = np.asarray(a)
            out[f"{name}[{i}]"] = (
                type(leaf).__name__,
                a.dtype.name,
                a.shape,
                a.tobytes(),
            )
    return out


def assert_identical(a, b) -> None:
    ta, tb = jax.tree_util.tree_structure(a), jax.tree_util.tree_structure(b)
    assert ta == tb
    ba, bb = as_bytes(a), as_bytes(b)
    assert ba.keys() == bb.keys()
    for k in ba:
        assert ba[k] == bb[k], k


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = write_folder(tmp_path_factory.mktemp("hf") / "tiny", tiny_config())
    assert os.path.exists(os.path.join(path, "model.safetensors.index.json"))
    return path


@pytest.fixture(scope="module")
def gguf(tmp_path_factory, folder):
    config, params = io.load_hf_llama(folder, dtype="float32")
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    io.save_llama_gguf(path, config, params, tensor_type="Q8_0", embedding_type="F16")
    return str(path)


INT4 = functools.partial(quant.quantize, scheme="int4")


def int4_projections(path: str, shape: tuple[int, ...]):
    return INT4 if path.endswith("_proj.weight") else None


@pytest.mark.parametrize("dtype", [None, "float32", "bfloat16"])
@pytest.mark.parametrize("quantize", ["none", "qlora", "int4"])
def test_hf_folder_stream_equals_whole_load(folder, dtype, quantize):
    q = {"none": None, "qlora": base_quantizer(QLORA), "int4": int4_projections}
    kw = dict(dtype=dtype, quantize=q[quantize])
    _, streamed = io.load_hf_folder(folder, **kw)
    _, whole = io.load_hf_folder(folder, stream=False, **kw)
    assert_identical(streamed, whole)
    layers = streamed["model"]["layers"]
    if quantize == "qlora":
        assert isinstance(
            layers["self_attn"]["q_proj"]["weight"], quant.QuantizedWeight
        )
        assert not quant.is_quantized(layers["self_attn"]["k_proj"]["weight"])
    norm = layers["input_layernorm"]["weight"]
    assert norm.dtype == np.dtype(dtype or ml_dtypes.bfloat16)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("keep_quantized", [False, True])
@pytest.mark.parametrize("qlora", [False, True])
def test_gguf_stream_equals_whole_load(gguf, dtype, keep_quantized, qlora):
    kw = dict(
        keep_quantized=keep_quantized,
        dtype=dtype,
        quantize=base_quantizer(QLORA) if qlora else None,
    )
    _, streamed, _ = io.load_llama_gguf(gguf, **kw)
    _, whole, _ = io.load_llama_gguf(gguf, stream=False, **kw)
    assert_identical(streamed, whole)


@pytest.mark.parametrize("source", ["folder", "gguf"])
def test_embeddings_read_in_chunks_of_rows_are_the_same(
    folder, gguf, source, monkeypatch
):
    monkeypatch.setattr(hf_names, "CHUNK_BYTES", 1000)  # 7 or 3 rows a chunk
    if source == "folder":
        _, streamed = io.load_hf_folder(folder, dtype="float32")
        _, whole = io.load_hf_folder(folder, dtype="float32", stream=False)
    else:
        _, streamed, _ = io.load_llama_gguf(gguf, dtype="bfloat16")
        _, whole, _ = io.load_llama_gguf(gguf, dtype="bfloat16", stream=False)
    assert_identical(streamed, whole)


@pytest.fixture(scope="module")
def deep(tmp_path_factory):
    """Seven layers, as a folder and as a Q4_0 GGUF with a Q4_0 embedding.

    More layers than `stream_layers`' ring of read buffers and its layers in
    flight; the embedding is not kept but decoded straight into its buffer
    (`dequantize_ggml_into`).
    """
    config = tiny_config(num_layers=7)
    folder = write_folder(tmp_path_factory.mktemp("deep") / "m", config)
    _, params = io.load_hf_llama(folder, dtype="float32")
    path = folder + ".gguf"
    io.save_llama_gguf(path, config, params, tensor_type="Q4_0", embedding_type="Q4_0")
    io.save_llama_gguf(folder + ".q4_1.gguf", config, params, tensor_type="Q4_1")
    return folder, path, folder + ".q4_1.gguf"


@pytest.mark.parametrize("quantize", ["none", "qlora", "int4"])
def test_deep_folder_stream_equals_whole_load(deep, quantize, monkeypatch):
    monkeypatch.setattr(ggml_dequant, "CHUNK_VALUES", 64)  # several chunks a tensor
    q = {"none": None, "qlora": base_quantizer(QLORA), "int4": int4_projections}
    _, streamed = io.load_hf_folder(deep[0], quantize=q[quantize])
    _, whole = io.load_hf_folder(deep[0], stream=False, quantize=q[quantize])
    assert_identical(streamed, whole)


@pytest.mark.parametrize("keep_quantized", [False, True])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1"])
def test_deep_q4_gguf_stream_equals_whole_load(deep, keep_quantized, dtype, kind):
    """Kept Q4_0/Q4_1 bases split layer by layer equal `from_ggml`'s nodes.

    (Into the node's host arrays, q/k un-permuted, against the stacked bytes.)
    """
    kw = dict(keep_quantized=keep_quantized, dtype=dtype)
    path = deep[1] if kind == "Q4_0" else deep[2]
    _, streamed, _ = io.load_llama_gguf(path, **kw)
    _, whole, _ = io.load_llama_gguf(path, stream=False, **kw)
    assert_identical(streamed, whole)
    q = streamed["model"]["layers"]["self_attn"]["q_proj"]["weight"]
    assert not keep_quantized or q.scheme == kind.lower()


def test_a_nan_in_a_layer_quantized_in_flight_is_raised(tmp_path):
    """The layer's error from a worker thread, as the load raised it before."""
    config = tiny_config(num_layers=5)
    params = jax.tree_util.tree_map(np.asarray, random_params(config, "bfloat16"))
    params["model"]["layers"]["self_attn"]["q_proj"]["weight"][3, 2, 1] = np.nan
    folder = io.save_hf_folder(tmp_path / "nan", config, params)
    with pytest.raises(QuantizationError, match="NaN"):
        io.load_hf_folder(folder, quantize=base_quantizer(QLORA))


COMPILES = textwrap.dedent(
    """
    import sys
    import jax
    from jax import monitoring
    from entrenar import io
    traced = []
    monitoring.register_event_duration_secs_listener(
        lambda name, secs, **kw: traced.append(name) if "trace" in name else None
    )
    _, params, _ = io.load_llama_gguf(sys.argv[1], keep_quantized=True)
    jax.block_until_ready(params)
    print(len(traced))
    """
)


@pytest.mark.parametrize("which", ["gguf", "deep"])
def test_a_gguf_load_runs_no_jax_program(gguf, deep, which):
    """No program traced (so none compiled) in a fresh process's GGUF load.

    Kept Q8_0/Q4_0 bases are transferred, float32 leaves filled in numpy.
    """
    path = gguf if which == "gguf" else deep[1]
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    res = subprocess.run(
        [sys.executable, "-c", COMPILES, path],
        capture_output=True, text=True, env=env, timeout=120, check=True,
    )  # fmt: skip
    assert res.stdout.split()[-1] == "0", res.stdout


@pytest.mark.parametrize("source", ["folder", "gguf"])
def test_qlora_bases_quantized_in_the_load_equal_lora_apply(folder, gguf, source):
    """The run's tree: quantizing in the load, then `lora.apply`, is bit-identical."""
    path = folder if source == "folder" else gguf
    key = jax.random.key(3)
    before = load_built(path).params
    today = lora.apply(before, QLORA, key=key, quantize="nf4")
    loaded = load_built(path, quantize=base_quantizer(QLORA)).params
    assert_identical(lora.apply(loaded, QLORA, key=key, quantize="nf4"), today)


def test_base_quantizer_selects_what_lora_apply_wraps():
    q = base_quantizer(QLORA)
    assert q("model.layers.self_attn.q_proj.weight", (2, 64, 64)) is not None
    assert q("model.layers.self_attn.k_proj.weight", (2, 32, 64)) is None
    assert q("model.embed_tokens.weight", (256, 64)) is None
    assert base_quantizer(lora.LoRAConfig(rank=4, targets=["q_proj"])) is None


# ---- peak memory, in a subprocess ---------------------------------------------------

TARGETS = {
    "float32": ("float32", {}),
    "bfloat16": ("bfloat16", {}),
    "nf4": ("float32", {"rank": 4, "targets": "all-linear", "quantize_base": "nf4"}),
    "gguf": ("float32", {}),
}
"""What the peak is measured for: the load's dtype and the run's LoRA section;
``gguf`` loads an F16 GGUF of the same model."""

MEASURE = textwrap.dedent(
    """
    import gc, json, sys
    import jax
    from entrenar import io, lora
    from entrenar.runs.models import base_quantizer

    folder, targets = sys.argv[1], json.loads(sys.argv[2])

    def status(key):
        for line in open("/proc/self/status"):
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024

    def load(name, stream, dtype, cfg):
        quantize = base_quantizer(lora.LoRAConfig(**cfg)) if cfg else None
        if name == "gguf":
            _, p, _ = io.load_llama_gguf(folder + ".gguf", dtype=dtype, stream=stream)
        else:
            _, p = io.load_hf_folder(folder, dtype=dtype, quantize=quantize,
                                     stream=stream)
        return jax.block_until_ready(p)

    out = {}
    for name, (dtype, cfg) in targets.items():
        for stream in (True, False):
            del_ = load(name, stream, dtype, cfg)  # compile first: measure no compiler
            del del_
            gc.collect()
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # reset VmHWM to the current RSS
            before = status("VmRSS")
            params = load(name, stream, dtype, cfg)
            peak = status("VmHWM") - before
            tree = sum(x.nbytes for x in jax.tree_util.tree_leaves(params))
            out[f"{name} {stream}"] = {"peak": peak, "tree": tree}
            del params
            gc.collect()
    print(json.dumps(out))
    """
)


@pytest.fixture(scope="module")
def peaks(tmp_path_factory):
    """Peak RSS growth and final tree bytes of each load of `TARGETS`.

    The model: 40 MB of bfloat16 in shards of 8 MB, 18.6M parameters in 16 layers,
    and the same as an F16 GGUF.
    Large allocations are mapped (``MALLOC_MMAP_THRESHOLD_``) so that what a load
    frees goes back to the system before the next is measured.
    """
    config = tiny_config(
        vocab_size=2048, hidden_size=256, intermediate_size=1024, num_layers=16,
        num_heads=4, num_kv_heads=4,
    )  # fmt: skip
    folder = write_folder(tmp_path_factory.mktemp("big") / "m", config, shard_bytes=8e6)
    _, params = io.load_hf_llama(folder, dtype="float32")
    io.save_llama_gguf(folder + ".gguf", config, params, tensor_type="F16")
    del params
    env = dict(os.environ, JAX_PLATFORMS="cpu", MALLOC_MMAP_THRESHOLD_="65536")
    res = subprocess.run(
        [sys.executable, "-c", MEASURE, folder, json.dumps(TARGETS)],
        capture_output=True, text=True, env=env, timeout=300, check=True,
    )  # fmt: skip
    return json.loads(res.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(
    not os.path.exists("/proc/self/clear_refs"), reason="needs Linux's VmHWM reset"
)
@pytest.mark.parametrize("target", list(TARGETS))
def test_streaming_load_peak_is_the_tree_plus_one_leaf(peaks, target):
    new, old = peaks[f"{target} True"], peaks[f"{target} False"]
    dtype = TARGETS[target][0]
    leaf = 16 * 1024 * 256 * np.dtype(dtype).itemsize  # the largest stacked leaf
    # quantized: one float32 layer (1/16 of the leaf) and its quantization's
    # temporaries at a time; a whole leaf before quantizing layer by layer
    leaves = 0.5 if TARGETS[target][1] else 1
    bound = new["tree"] + leaves * leaf + (8 << 20)  # 8 MB of the interpreter's noise
    assert new["tree"] == old["tree"]
    assert new["peak"] < bound, (new, old, bound)
    # the model is big enough to tell the loads apart:
    assert old["peak"] > bound, (new, old, bound)
