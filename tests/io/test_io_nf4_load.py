"""A folder load with NF4 bases quantizes the file's bytes natively (issue 31).

Where the native kernel runs, each layer of a quantized leaf is quantized where it
lies in the memory-mapped file (bfloat16, no float32 copy) by a plain C call: no JAX
program is traced or compiled in a fresh process's load, and the tree is the one
that quantizing after the load gives, bit for bit (tests/io/test_io_streaming.py
compares every array). Under the policy ``"jax"`` the load takes the JAX path and
again equals quantizing after it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import jax
import ml_dtypes
import numpy as np
import pytest

from entrenar import io, lora, native, nn, quant
from entrenar.runs.models import base_quantizer

BF16 = ml_dtypes.bfloat16
ALL_LINEAR = lora.LoRAConfig(rank=4, targets="all-linear", quantize_base="nf4")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    config = nn.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=192, num_layers=5,
        num_heads=4, num_kv_heads=2, max_position_embeddings=32,
    )  # fmt: skip
    rng = np.random.default_rng(0)
    params = jax.tree_util.tree_map(
        lambda s: (rng.standard_normal(s.shape, np.float32) * 0.02).astype(BF16),
        jax.eval_shape(config.init, jax.random.key(0)),
    )
    path = tmp_path_factory.mktemp("nf4load") / "m"
    return io.save_hf_folder(path, config, params, max_shard_bytes=50_000)


TRACES = textwrap.dedent(
    """
    import sys
    import jax
    from jax import monitoring
    from entrenar import io, lora
    from entrenar.runs.models import base_quantizer
    traced = []
    monitoring.register_event_duration_secs_listener(
        lambda name, secs, **kw: traced.append(name) if "trace" in name else None
    )
    cfg = lora.LoRAConfig(rank=4, targets="all-linear", quantize_base="nf4")
    _, params = io.load_hf_folder(sys.argv[1], dtype=sys.argv[2],
                                  quantize=base_quantizer(cfg))
    jax.block_until_ready(params)
    print(len(traced))
    """
)


@pytest.mark.skipif(native.reason("nf4_quantize") is not None, reason="kernel off")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_folder_load_with_nf4_bases_runs_no_jax_program(folder, dtype):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    res = subprocess.run(
        [sys.executable, "-c", TRACES, folder, dtype],
        capture_output=True, text=True, env=env, timeout=120, check=True,
    )  # fmt: skip
    assert res.stdout.split()[-1] == "0", res.stdout + res.stderr[-2000:]


@pytest.mark.parametrize("policy", ["auto", "jax"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_load_equals_quantizing_after_it_under_each_policy(folder, policy, dtype):
    with native.policy(policy):
        _, loaded = io.load_hf_folder(
            folder, dtype=dtype, quantize=base_quantizer(ALL_LINEAR)
        )
        _, plain = io.load_hf_folder(folder, dtype=dtype)
        layers, plain_layers = loaded["model"]["layers"], plain["model"]["layers"]
        for group, name in [("self_attn", "q_proj"), ("mlp", "down_proj")]:
            got = layers[group][name]["weight"]
            want = quant.quantize(
                plain_layers[group][name]["weight"], "nf4", double_quant=True
            )
            assert got.dtype == np.dtype(dtype) == want.dtype
            for a, b in zip(
                jax.tree_util.tree_leaves(got),
                jax.tree_util.tree_leaves(want),
                strict=True,
            ):
                assert np.asarray(a).dtype == np.asarray(b).dtype
                np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
