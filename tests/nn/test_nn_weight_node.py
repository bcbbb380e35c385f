"""Every registered weight node answers the weight-node protocol the same way.

One small instance of each node type (a new type without an entry here fails
`test_every_registered_node_type_is_covered`) is checked for its logical shape,
dtype and stored bytes, its pytree keys and round trip, and ``weight_matmul``
against the dense product of ``to_dense``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from entrenar import lora, nn, quant
from entrenar.nn import Bfloat16Weight, TiedEmbedding
from entrenar.tree import key_path_str

OUT, IN = 8, 64
W = jnp.asarray(np.random.default_rng(0).normal(size=(OUT, IN)), jnp.float32)
A = jnp.asarray(np.random.default_rng(1).normal(size=(2, IN)), jnp.float32)
B = jnp.asarray(np.random.default_rng(2).normal(size=(OUT, 2)), jnp.float32)
Q = quant.quantize(W, "nf4", double_quant=True)

# name -> (node, its children's pytree keys: checkpoints and sharding rules use them)
QKEYS = ["codes", "scales", "scale_scales", "scale_offset"]
NODES = {
    "quantized": (Q, QKEYS),
    "lora": (lora.LoRAWeight(W, A, B, 4.0, 2), ["base", "lora_A", "lora_B"]),
    "qlora": (
        lora.LoRAWeight(Q, A, B, 4.0, 2, dropout=0.1),
        [f"base.{k}" for k in QKEYS] + ["lora_A", "lora_B"],
    ),
    "bfloat16": (Bfloat16Weight.from_array(W), ["bits"]),
    "tied": (TiedEmbedding.from_array(W), ["table", "head_t"]),
    "ggml": (  # a GGUF base kept as stored: here BF16 rows, 2 bytes per value
        quant.GGMLWeight(
            jnp.asarray(np.asarray(W, ml_dtypes.bfloat16).view(np.uint8)), "BF16"
        ),
        ["data"],
    ),
    "ggml_mixed": (  # a llama.cpp mix, one layer of a BF16 / F16 stack
        quant.ggml_mixed.mixed_ggml_weight(
            [
                (np.asarray(W, ml_dtypes.bfloat16).view(np.uint8), "BF16"),
                (np.asarray(W, np.float16).view(np.uint8), "F16"),
            ],
            (2, OUT, IN),
        )[1],
        ["data", "kind"],
    ),
    "tied_q8_0": (  # a tied embedding whose head is read as Q8_0 (decoding)
        quant.matvec.QuantizedTiedEmbedding.from_array(W),
        ["table", "head_t.codes", "head_t.scales"],
    ),
    "stacked_layer": (  # layer 1 of a Q8_0 stack, read in place (decoding scans)
        quant.matvec.StackedLayer(
            quant.ggml.quantize_ggml(jnp.stack([-W, W]), "q8_0"), jnp.int32(1)
        ),
        ["stack.codes", "stack.scales", "index"],
    ),
}


def keys(tree):
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    return [key_path_str(p) for p, _ in flat]


def test_every_registered_node_type_is_covered():
    registered = set(nn.is_weight_node.registry) - {object}
    assert registered == {type(node) for node, _ in NODES.values()}


@pytest.mark.parametrize("name", NODES)
def test_logical_shape_dtype_and_bytes(name):
    node, _ = NODES[name]
    dense = nn.to_dense(node)
    assert nn.is_weight_node(node)
    assert nn.logical_shape(node) == dense.shape == (OUT, IN)
    assert nn.logical_dtype(node) == dense.dtype
    stored = sum(np.asarray(x).nbytes for x in jax.tree_util.tree_leaves(node))
    assert nn.nbytes(node) == stored
    assert nn.nbytes(jax.eval_shape(lambda: node)) == stored  # sized without arrays


@pytest.mark.parametrize("name", NODES)
def test_flatten_unflatten_round_trip(name):
    node, child_keys = NODES[name]
    leaves, treedef = jax.tree_util.tree_flatten(node)
    back = jax.tree_util.tree_unflatten(treedef, leaves)
    assert type(back) is type(node)
    assert jax.tree_util.tree_structure(back) == treedef
    assert all(x is y for x, y in zip(jax.tree_util.tree_leaves(back), leaves))
    assert keys(node) == child_keys
    through_jit = jax.jit(lambda n: n)(node)
    assert jax.tree_util.tree_structure(through_jit) == treedef


@pytest.mark.parametrize("name", NODES)
@pytest.mark.parametrize("matmul_dtype", [None, "bfloat16"])
def test_weight_matmul_is_the_dense_product(name, matmul_dtype):
    node, _ = NODES[name]
    x = jnp.asarray(np.random.default_rng(3).normal(size=(3, IN)), jnp.float32)
    got = jax.jit(nn.weight_matmul, static_argnums=2)(node, x, matmul_dtype)
    dense = nn.to_dense(node).astype(jnp.float32)  # (OUT, IN)
    if name == "tied_q8_0":  # the head reads the Q8_0 values, lookups the table
        dense = node.head_value().astype(jnp.float32)
        assert float(jnp.abs(dense - nn.to_dense(node)).max()) > 0
    if matmul_dtype is not None:  # inputs rounded to bfloat16, float32 sums
        x, dense = (v.astype(jnp.bfloat16).astype(jnp.float32) for v in (x, dense))
    tol = 0.05 if matmul_dtype else 1e-4
    np.testing.assert_allclose(got, x @ dense.T, rtol=tol, atol=tol)


@pytest.mark.parametrize(
    ("x", "shape", "dtype", "size"),
    [
        (jnp.ones((2, 3), jnp.bfloat16), (2, 3), "bfloat16", 12),
        (np.ones(4, np.float64), (4,), "float64", 32),
        (jax.ShapeDtypeStruct((4, 3), jnp.int8), (4, 3), "int8", 12),
        (2.5, (), "float32", 4),
    ],
)
def test_plain_array_rules(x, shape, dtype, size):
    assert not nn.is_weight_node(x)
    assert nn.logical_shape(x) == shape and nn.logical_dtype(x).name == dtype
    assert nn.nbytes(x) == size and nn.to_dense(x) is x
