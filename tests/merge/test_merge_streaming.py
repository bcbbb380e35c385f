"""Merges written leaf by leaf: the in-memory merge's file, in a few leaves' memory.

`entrenar.merge.run.merge_streamed` (``run_recipe(..., stream=True)``, the default
for ``.safetensors`` and folder outputs) against ``stream=False`` (the whole merged
model in memory, then `entrenar.io.save_safetensors`): the files are byte for byte
the same (the ``__metadata__`` keys aside, whose order the ``safetensors`` package
changes from save to save), and the peak resident memory of the streamed merge,
measured in a subprocess, is bounded by a multiple of the largest tensor while the
in-memory merge's grows with the model.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import textwrap

import ml_dtypes
import numpy as np
import pytest
from merge_helpers import finetuned, make_tree

from entrenar import io, merge
from entrenar.io.safetensors_io import safetensors_header, save_safetensors


def write_folder(path, tree, *, shards=2) -> str:
    """``tree`` as a Hugging Face folder: flat names, ``shards`` files, an index."""
    os.makedirs(path, exist_ok=True)
    flat = io.flatten_params(tree)
    names = sorted(flat)
    weight_map = {}
    for i in range(shards):
        part = names[i::shards]
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        save_safetensors({n: flat[n] for n in part}, os.path.join(path, file), {})
        weight_map |= dict.fromkeys(part, file)
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({"model_type": "llama"}, f)
    return str(path)


def parts(path):
    """``(header dict, data bytes)`` of a safetensors file."""
    raw = open(path, "rb").read()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("stream")
    out = {}
    for dtype, tag in ((np.float32, "f32"), (ml_dtypes.bfloat16, "bf16")):
        base = make_tree(0, dtype)
        trees = {"base": base, "a": finetuned(base, 1), "b": finetuned(base, 2)}
        for name, tree in trees.items():
            tree = dict(tree, step={"count": np.array([3, 4], np.int32)})  # not float
            path = str(tmp / f"{tag}-{name}.safetensors")
            io.save_model(io.Model(io.ModelMetadata(name, "llama"), tree), path)
            out[f"{tag}-{name}"] = path
            out[f"{tag}-{name}-dir"] = write_folder(tmp / f"{tag}-{name}", tree)
    return out


CASES = [
    ("ties", {"density": 0.5}),
    ("dare_ties", {"density": 0.6, "seed": 3}),
    ("task_arithmetic", {"lam": 0.7, "weights": [1.0, 0.5]}),
    ("linear", {"weights": [0.3, 0.7]}),
    ("slerp", {"t": 0.4}),
]


@pytest.mark.parametrize("method,opts", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("tag", ["f32", "bf16"])
@pytest.mark.parametrize("folder", [False, True], ids=["file", "folder"])
def test_streamed_merge_writes_the_in_memory_merge_bytes(
    models, tmp_path, method, opts, tag, folder
):
    suffix = "-dir" if folder else ""
    inputs = [models[f"{tag}-a{suffix}"]] + (
        [models[f"{tag}-b{suffix}"]] if method != "slerp" else []
    )
    base = models[f"{tag}-base{suffix}"]
    kw = dict(opts, base=base) if method != "linear" else dict(opts)
    outs = {}
    for stream in (False, True):
        out = str(tmp_path / (f"{stream}" if folder else f"{stream}.safetensors"))
        merge.merge_files(inputs, method, out, stream=stream, **kw)
        outs[stream] = os.path.join(out, "model.safetensors") if folder else out
    old, new = (open(outs[s], "rb").read() for s in (False, True))
    if folder:  # metadata {"format": "pt"}: one key, so the very same bytes
        assert new == old
        assert sorted(os.listdir(tmp_path / "True")) == sorted(
            os.listdir(tmp_path / "False")
        )
    else:  # several metadata keys: the package orders them at random
        (h_old, d_old), (h_new, d_new) = parts(outs[False]), parts(outs[True])
        assert h_new == h_old and list(h_new) == list(h_old)
        assert d_new == d_old and len(new) == len(old)


def test_streamed_merge_returns_the_merged_params(models, tmp_path):
    kw = dict(base=models["f32-base"], density=0.5)
    ab = [models["f32-a"], models["f32-b"]]
    got = merge.merge_files(ab, "ties", str(tmp_path / "m.safetensors"), **kw)
    want = merge.merge_files(ab, "ties", None, **kw)
    flat_got, flat_want = io.flatten_params(got.params), io.flatten_params(want.params)
    assert flat_got.keys() == flat_want.keys()
    for k in flat_want:
        np.testing.assert_array_equal(flat_got[k], flat_want[k])


def test_header_is_the_safetensors_package_header():
    import safetensors.numpy

    arrays = {
        "b.w": np.ones((2, 3), np.float32),
        "a.w": np.ones((3,), ml_dtypes.bfloat16),
        "c": np.ones((1,), np.int64),
        "z": np.ones((5,), np.float16),
        "é.x": np.zeros((0, 4), np.float32),
        "u": np.ones((3,), np.uint8),
    }
    for meta in ({"format": "pt"}, {}):
        specs = {k: (v.dtype, v.shape) for k, v in arrays.items()}
        head, order = safetensors_header(specs, meta)
        mine = head + b"".join(arrays[k].tobytes() for k in order)
        assert mine == safetensors.numpy.save(arrays, meta)


# ---- peak memory, in a subprocess ---------------------------------------------------

ROWS, COLS, LEAVES = 512, 1024, 32
"""The measured models: 32 leaves of 512 x 1024 float32 (2 MB each, 64 MB)."""

MEASURE = textwrap.dedent(
    """
    import gc, json, sys
    from entrenar import merge

    folder, out = sys.argv[1], sys.argv[2]

    def status(key):
        for line in open("/proc/self/status"):
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024

    def run(stream):
        merge.merge_files([folder + "/a.safetensors", folder + "/b.safetensors"],
                          "ties", out, base=folder + "/base.safetensors",
                          density=0.5, stream=stream)

    result = {}
    for stream in (True, False):
        run(stream)  # compile first: measure no compiler
        gc.collect()
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM to the current RSS
        before = status("VmRSS")
        run(stream)
        result[str(stream)] = status("VmHWM") - before
        gc.collect()
    print(json.dumps(result))
    """
)


@pytest.mark.skipif(
    not os.path.exists("/proc/self/clear_refs"), reason="needs Linux's VmHWM reset"
)
def test_streamed_merge_peak_is_a_few_leaves(tmp_path):
    rng = np.random.default_rng(0)
    base = {f"w{i}": rng.normal(size=(ROWS, COLS)).astype(np.float32)
            for i in range(LEAVES)}  # fmt: skip
    for name, seed in (("base", None), ("a", 1), ("b", 2)):
        tree = base if seed is None else {
            k: v + np.float32(0.01) * np.random.default_rng(seed).normal(
                size=v.shape).astype(np.float32) for k, v in base.items()}  # fmt: skip
        save_safetensors(tree, tmp_path / f"{name}.safetensors", {})
    del base
    env = dict(os.environ, JAX_PLATFORMS="cpu", MALLOC_MMAP_THRESHOLD_="65536")
    res = subprocess.run(
        [sys.executable, "-c", MEASURE, str(tmp_path), str(tmp_path / "m.safetensors")],
        capture_output=True, text=True, env=env, timeout=600, check=True,
    )  # fmt: skip
    peak = json.loads(res.stdout.strip().splitlines()[-1])
    leaf = ROWS * COLS * 4
    model = LEAVES * leaf
    # one leaf of each of 3 inputs (pages, then float32 copies), TIES' temporaries
    # (task vectors, magnitudes, masks of the threshold search) and the output:
    # measured 18-19 leaves of 2 MB (64 leaves) and of 4 MB (16 leaves) alike
    bound = 24 * leaf + (8 << 20)  # 56 MB, under one model (64 MB)
    assert peak["True"] < bound, (peak, bound)
    # in memory: the whole merged model and the inputs' pages (measured 100 MB;
    # 160 MB while save_safetensors also held the file's bytes, before it wrote
    # the tensors one by one)
    assert peak["False"] > model + 8 * leaf, (peak, model)
