"""QuantizedWeight as a pytree node: stacking, scan, nn.linear, trees, memory."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import entrenar.nn
from entrenar.errors import ShapeError
from entrenar.quant import (
    NF4_CODE,
    QuantizedWeight,
    dequantize,
    dequantize_params,
    quantize,
    quantize_like,
    quantize_params,
)
from entrenar.quant.api import layer_axes
from entrenar.quant.report import bits_per_param, memory_report
from entrenar.tree import tree_named_leaves

SCHEMES = [
    ("nf4", {}),
    ("nf4", {"double_quant": True}),
    ("int4", {}),
    ("int8", {"granularity": "channel"}),
    ("int8", {"symmetric": False}),
    ("q4_1", {}),
]


def _stack(key=0, layers=3, out=8, inp=64):
    return jax.random.normal(jax.random.key(key), (layers, out, inp), jnp.float32)


@pytest.mark.parametrize(("scheme", "kw"), SCHEMES)
def test_stacked_node_slices_and_scans_per_layer(scheme, kw):
    w = _stack()
    q = quantize(w, scheme, **kw)
    assert q.shape == (3, 8, 64)
    dense = dequantize(q)
    # a layer of the stacked node equals that layer quantized on its own
    for i in range(3):
        np.testing.assert_array_equal(np.asarray(dequantize(q[i])), dense[i])
        np.testing.assert_array_equal(
            np.asarray(dequantize(quantize(w[i], scheme, **kw))), dense[i]
        )
    x = jnp.ones((2, 64), jnp.float32)

    def body(h, layer_w):
        return h, entrenar.nn.linear(h, layer_w)[:, :1].sum() + 0 * h.sum()

    _, ys = jax.lax.scan(body, x, q)
    expected = jnp.stack([(x @ dense[i].T)[:, :1].sum() for i in range(3)])
    np.testing.assert_allclose(ys, expected, rtol=1e-5)


@pytest.mark.parametrize(("scheme", "kw"), SCHEMES)
def test_linear_dispatches_and_jits(scheme, kw):
    w = _stack(1)[0]
    q = quantize(w, scheme, **kw)
    x = jax.random.normal(jax.random.key(2), (4, 64), jnp.float32)
    b = jnp.arange(8.0)
    expected = x @ dequantize(q).T + b
    got = jax.jit(entrenar.nn.linear)(x, q, b)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
    # the compute dtype follows x
    assert entrenar.nn.linear(x.astype(jnp.bfloat16), q).dtype == jnp.bfloat16


def test_pytree_round_trip_keeps_static_aux():
    q = quantize(_stack()[0], "nf4", double_quant=True, block_size=32)
    leaves, treedef = jax.tree_util.tree_flatten(q)
    assert len(leaves) == 4  # codes, int8 scales, group absmax, mean
    back = jax.tree_util.tree_unflatten(treedef, leaves)
    assert (back.scheme, back.block_size, back.dtype) == ("nf4", 32, jnp.float32)
    names = [n for n, _ in tree_named_leaves({"w": q})]
    assert names == ["w.codes", "w.scales", "w.scale_scales", "w.scale_offset"]
    # the codes are packed: two per byte
    assert q.codes.dtype == jnp.uint8 and q.codes.shape == (8, 32)


def test_gradient_flows_to_input_through_quantized_linear():
    q = quantize(_stack()[0], "int4")
    x = jnp.ones((2, 64), jnp.float32)
    g = jax.grad(lambda x: entrenar.nn.linear(x, q).sum())(x)
    np.testing.assert_allclose(g, jnp.broadcast_to(dequantize(q).sum(0), (2, 64)))


def test_quantize_params_selects_weights_and_does_not_mutate():
    params = {
        "layers": {"w": _stack(), "norm": jnp.ones((3, 64))[:, :10]},
        "bias": jnp.zeros(8),
        "odd": jnp.ones((4, 30)),
    }
    before = jax.tree_util.tree_map(np.asarray, params)
    qp = quantize_params(params, "nf4", double_quant=True)
    assert isinstance(qp["layers"]["w"], QuantizedWeight)
    assert qp["layers"]["norm"] is params["layers"]["norm"]
    assert qp["bias"] is params["bias"] and qp["odd"] is params["odd"]
    for a, b in zip(
        jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(before)
    ):
        np.testing.assert_array_equal(np.asarray(a), b)
    dense = dequantize_params(qp)
    assert dense["layers"]["w"].shape == (3, 8, 64)
    # Values, not only shapes: each layer dequantizes like the node alone, within
    # NF4's error of the original, and untouched leaves pass through.
    node = qp["layers"]["w"]
    np.testing.assert_array_equal(dense["layers"]["w"], dequantize(node))
    w = np.asarray(params["layers"]["w"])
    err = np.abs(np.asarray(dense["layers"]["w"]) - w)
    assert err.max() <= 0.2 * np.abs(w).max()  # NF4 steps are < 0.2 of the absmax
    assert np.corrcoef(np.asarray(dense["layers"]["w"]).ravel(), w.ravel())[0, 1] > 0.99
    assert dense["layers"]["norm"] is params["layers"]["norm"]
    only_w = quantize_params(params, "int8", predicate=lambda n, _: n == "layers.w")
    assert isinstance(only_w["layers"]["w"], QuantizedWeight)


def test_memory_report_counts_stored_arrays():
    params = {"w": _stack(), "b": jnp.zeros(8)}
    qp = quantize_params(params, "nf4")
    r = memory_report(qp)
    entry = {e.name: e for e in r.entries}
    assert entry["w"].params == 3 * 8 * 64
    assert entry["w"].bytes == 3 * 8 * 32 + 3 * 8 * 4  # packed codes + f32 scales
    assert entry["w"].bits_per_param == 4.5
    assert entry["b"].bytes == 32
    assert r.bytes == entry["w"].bytes + 32
    assert "total" in str(r)


@pytest.mark.parametrize(
    ("scheme", "kw"),
    [
        *SCHEMES,
        ("int8", {"granularity": "channel", "axis": -1, "symmetric": False}),
        ("int8", {"granularity": "tensor"}),
        ("int8", {"granularity": "channel", "axis": 0}),  # leading axis = per matrix
        ("nf4", {"block_size": 32, "double_quant": True}),
    ],
)
def test_quantize_like_reproduces_every_option(scheme, kw):
    w = _stack(4)
    q = quantize(w, scheme, **kw)
    again = quantize_like(w, q)
    assert jax.tree_util.tree_structure(again) == jax.tree_util.tree_structure(q)
    for a, b in zip(jax.tree_util.tree_leaves(again), jax.tree_util.tree_leaves(q)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_memory_report_kinds_table_and_bits_of_plain_leaves():
    w = jnp.ones((4, 64))
    tree = {
        "a": quantize(w, "nf4", double_quant=True),
        "b": quantize(w, "nf4"),
        "h": jnp.zeros((3, 5), jnp.float16),
        "s": 2.5,  # a Python float counts as one float32 value
    }
    r = memory_report(tree)
    assert [(e.name, e.kind, e.params) for e in r.entries] == [
        ("a", "nf4+dq", 256),
        ("b", "nf4", 256),
        ("h", "float16", 15),
        ("s", "float32", 1),
    ]
    entry = {e.name: e for e in r.entries}
    assert entry["h"].bytes == 30 and entry["s"].bytes == 4
    assert bits_per_param(tree["h"]) == 16.0 and bits_per_param(2.5) == 32.0
    assert bits_per_param(tree["b"]) == 4.5  # 4-bit codes + a float32 scale per 64
    # the table: a header, one row per leaf, the total; kinds and counts as above
    lines = str(r).splitlines()
    assert lines[0].split() == ["name", "kind", "params", "bytes", "bits"]
    assert lines[1].split()[:3] == ["a", "nf4+dq", "256"]
    assert lines[3].split() == ["h", "float16", "15", "30", "16.000"]
    assert lines[-1].split()[0] == "total" and lines[-1].split()[1] == "528"


@pytest.mark.parametrize(
    ("scheme", "options", "chosen"),
    [
        ("q8_0", {}, {"w32", "w64"}),  # blocks of 32
        ("nf4", {}, {"w64"}),  # blocks of 64 by default
        ("nf4", {"block_size": 16}, {"w32", "w48", "w64"}),
        ("int8", {}, {"w64"}),  # blocks of 64 by default, as quantize()
        ("int8", {"granularity": "channel"}, {"w32", "w48", "w64"}),  # any width
    ],
)
def test_quantize_params_default_choice_follows_the_scheme_blocks(
    scheme, options, chosen
):
    already = quantize(jnp.ones((2, 64)), "int4")
    params = {
        "w32": jnp.ones((4, 32)),
        "w48": jnp.ones((2, 48)),
        "w64": jnp.ones((4, 64)),
        "b": jnp.ones(64),  # one axis: a bias
        "ids": jnp.ones((4, 64), jnp.int32),  # not floating
        "q": already,
    }
    out = quantize_params(params, scheme, **options)
    got = {k for k, v in out.items() if isinstance(v, QuantizedWeight) and k != "q"}
    assert got == chosen
    assert out["q"] is already  # a quantized leaf is left as it is
    for k in chosen:
        assert out[k].scheme == scheme


@pytest.mark.parametrize(
    ("scheme", "options"),
    [("nf4", {"double_quant": True}), ("int8", {"granularity": "channel"}),
     ("q4_1", {})],
)  # fmt: skip
def test_quantize_params_of_a_stacked_model_keeps_its_norms_and_runs(scheme, options):
    """A layer stack's ``(L, D)`` norms are vectors in each layer: left as they are.

    They were quantized as ``(L, D)`` matrices (D splits into blocks), and the
    model's layer scan then failed with ``IndexError: tuple index out of range``.
    """
    cfg = entrenar.nn.LlamaConfig(
        vocab_size=96, hidden_size=128, intermediate_size=256, num_layers=2,
        num_heads=4, num_kv_heads=2,
    )  # fmt: skip
    params = cfg.init(jax.random.key(0))
    qp = quantize_params(params, scheme, **options)
    layers = qp["model"]["layers"]
    for norm in ("input_layernorm", "post_attention_layernorm"):
        assert layers[norm]["weight"] is params["model"]["layers"][norm]["weight"]
    assert isinstance(layers["mlp"]["down_proj"]["weight"], QuantizedWeight)
    assert layers["mlp"]["down_proj"]["weight"].shape == (2, 128, 256)
    assert isinstance(qp["lm_head"]["weight"], QuantizedWeight)
    ids = jax.random.randint(jax.random.key(1), (2, 9), 0, 96)
    got = np.asarray(jax.jit(cfg.apply)(qp, ids))
    want = np.asarray(jax.jit(cfg.apply)(dequantize_params(qp), ids))
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6 * np.abs(want).max())
    # the names the rule reads: a stacked key not followed by a layer index
    assert layer_axes("transformer.h.ln_1.weight") == 1
    assert layer_axes("transformer.h.3.ln_1.weight") == 0
    assert layer_axes("layers.[2].norm.weight") == 0  # a stored list position


@pytest.mark.parametrize(
    ("scheme", "grid"),
    [
        ("int4", np.arange(-7.0, 8.0)),  # d = 7 / 7 = 1 exactly
        ("int8", np.arange(-127.0, 128.0)),  # d = 127 / 127 = 1 exactly
        ("nf4", None),  # the NF4 code values themselves, absmax 1
    ],
)
def test_values_on_the_grid_with_scale_one_round_trip_exactly(scheme, grid):
    grid = np.asarray(NF4_CODE, np.float32) if grid is None else grid
    rng = np.random.default_rng(0)
    w = rng.choice(grid, size=(3, 64)).astype(np.float32)
    w[:, 0] = grid.max()  # every block reaches the largest value: scale 1
    w[:, 1] = grid.min()
    q = quantize(jnp.asarray(w), scheme)
    np.testing.assert_array_equal(np.asarray(dequantize(q)), w)


@pytest.mark.parametrize("scheme", ["nf4", "int4", "int8"])
def test_block_errors_name_the_scheme(scheme):
    with pytest.raises(ShapeError, match=rf"^'{scheme}' quantizes blocks of 64 values"):
        quantize(jnp.ones((2, 40)), scheme)
