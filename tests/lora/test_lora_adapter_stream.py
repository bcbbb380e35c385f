"""`save_adapter` writes the adapter file tensor by tensor: the `safetensors` bytes."""

import dataclasses

import jax
import numpy as np
import pytest

from entrenar import lora
from entrenar.lora import LoRAConfig, LoRAWeight
from entrenar.lora.adapter_io import PREFIX, WEIGHTS_NAME
from entrenar.nn import LlamaConfig

st_numpy = pytest.importorskip("safetensors.numpy")

CFG = LlamaConfig(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=48,
    num_layers=3,
    num_heads=4,
    num_kv_heads=2,
    max_position_embeddings=32,
)


def test_adapter_file_is_the_safetensors_package_bytes(tmp_path):
    params = lora.apply(
        CFG.init(jax.random.key(0)),
        LoRAConfig(rank=4, targets="all-linear"),
        key=jax.random.key(1),
    )
    # B starts at zero: give both factors distinct values so the order shows
    params = jax.tree_util.tree_map(
        lambda x: (
            dataclasses.replace(x, a=x.a + 0.5, b=x.b + 0.25)
            if isinstance(x, LoRAWeight)
            else x
        ),
        params,
        is_leaf=lambda x: isinstance(x, LoRAWeight),
    )
    lora.save_adapter(params, tmp_path / "ad")
    got = (tmp_path / "ad" / WEIGHTS_NAME).read_bytes()
    # the reference: every layer's A and B by name, written by the safetensors package
    loaded = st_numpy.load(got)
    assert len(loaded) == 2 * 7 * CFG.num_layers
    want = st_numpy.save(loaded, {"format": "pt"})
    assert got == want
    down = params["model"]["layers"]["mlp"]["down_proj"]["weight"]
    a = np.asarray(down.a)  # (L, r, in)
    name = f"{PREFIX}model.layers.2.mlp.down_proj.lora_A.weight"
    np.testing.assert_array_equal(loaded[name], a[2])
