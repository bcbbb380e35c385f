"""Exported helpers that the rest of the suite reaches only through other functions.

Each is checked directly against what its docstring promises (issue 12: an exported
name no test names can break unnoticed).
"""

from __future__ import annotations

import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from entrenar import autograd, data, io, nn, optim, train, tree
from entrenar.errors import FormatError

# ---- autograd: recording switches ---------------------------------------------------


def test_enable_grad_records_inside_no_grad():
    x = autograd.Tensor([2.0], requires_grad=True)
    assert autograd.is_grad_enabled()
    with autograd.no_grad():
        assert not autograd.is_grad_enabled()
        assert not (x * x).requires_grad
        with autograd.enable_grad():
            assert autograd.is_grad_enabled()
            y = x * x
        assert not autograd.is_grad_enabled()
    assert autograd.is_grad_enabled()
    autograd.backward(y.sum())
    assert x.grad.tolist() == [4.0]


# ---- optim: the smallest transformations ---------------------------------------------


def test_identity_and_stateless():
    u = {"w": jnp.array([1.0, -2.0])}
    out, _ = optim.identity().update(u, optim.identity().init(u))
    np.testing.assert_array_equal(np.asarray(out["w"]), [1.0, -2.0])
    double = optim.stateless(
        lambda updates, params: jax.tree.map(lambda g: 2 * g, updates)
    )
    out, _ = double.update(u, double.init(u))
    np.testing.assert_array_equal(np.asarray(out["w"]), [2.0, -4.0])


@pytest.mark.parametrize("nesterov", [False, True])
def test_scale_by_momentum_equals_optax_trace(nesterov):
    ours = optim.scale_by_momentum(0.9, nesterov=nesterov)
    ref = optax.trace(decay=0.9, nesterov=nesterov)
    p = jnp.zeros(3)
    s, r = ours.init(p), ref.init(p)
    for t in range(5):
        g = jnp.array([1.0, -0.5, 2.0]) * (t + 1)
        u, s = ours.update(g, s)
        v, r = ref.update(g, r)
        np.testing.assert_allclose(np.asarray(u), np.asarray(v), rtol=1e-6)


# ---- nn: masks and rotary embedding pieces -------------------------------------------


def test_causal_mask_with_offset_queries():
    m = np.asarray(nn.causal_mask(jnp.array([2, 3]), 5))  # queries at positions 2, 3
    np.testing.assert_array_equal(m, [[1, 1, 1, 0, 0], [1, 1, 1, 1, 0]])


def test_rope_angles_and_rotate_half_are_their_formulas():
    pos = jnp.array([0, 1, 7])
    ang = np.asarray(nn.rope_angles(pos, 8, 10000.0))  # (3, 4)
    want = np.array(
        [[p * 10000.0 ** (-2 * i / 8) for i in range(4)] for p in (0, 1, 7)]
    )
    np.testing.assert_allclose(ang, want, rtol=1e-6)
    x = jnp.arange(1.0, 7.0)
    assert nn.rotate_half(x).tolist() == [-4.0, -5.0, -6.0, 1.0, 2.0, 3.0]


# ---- io: atomic writes and the JSON/YAML formats -------------------------------------


def test_atomic_write_keeps_the_old_file_when_writing_fails(tmp_path):
    path = tmp_path / "out.bin"
    path.write_bytes(b"old")
    with pytest.raises(RuntimeError):
        with io.atomic_write(path) as f:
            f.write(b"half of the new")
            raise RuntimeError("crash mid-write")
    assert path.read_bytes() == b"old"
    assert os.listdir(tmp_path) == ["out.bin"]  # no temporary left behind
    with io.atomic_write(path) as f:
        f.write(b"new")
    assert path.read_bytes() == b"new"


def test_flatten_unflatten_and_json_yaml_round_trips(tmp_path):
    params = {"layers": [{"w": np.ones((2, 3), np.float32)}], "b": np.arange(3.0)}
    flat = io.flatten_params(params)
    assert sorted(flat) == ["b", "layers.[0].w"]  # a list position in brackets
    back = io.unflatten_params(flat)
    np.testing.assert_array_equal(back["layers"][0]["w"], params["layers"][0]["w"])
    model = io.Model(io.ModelMetadata(name="tiny"), params)
    for save, load, name in ((io.save_json, io.load_json, "m.json"),
                             (io.save_yaml, io.load_yaml, "m.yaml")):  # fmt: skip
        save(model, tmp_path / name)
        got = load(tmp_path / name)
        assert got.metadata.name == "tiny"
        np.testing.assert_array_equal(got.params["b"], params["b"])
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(FormatError, match=r"bad\.json"):
        io.load_json(tmp_path / "bad.json")


# ---- tree, data, train ---------------------------------------------------------------


def test_key_path_str_and_list_index():
    paths = [p for p, _ in jax.tree_util.tree_flatten_with_path({"a": [{"b": 1}]})[0]]
    assert tree.key_path_str(paths[0]) == "a.0.b"
    assert tree.list_index("[3]") == 3 and tree.list_index("q_proj") is None


def test_epoch_permutation_is_a_function_of_seed_and_epoch():
    a = data.epoch_permutation(50, seed=1, epoch=2)
    assert sorted(a.tolist()) == list(range(50))
    np.testing.assert_array_equal(a, data.epoch_permutation(50, seed=1, epoch=2))
    assert not np.array_equal(a, data.epoch_permutation(50, seed=1, epoch=3))
    assert not np.array_equal(a, data.epoch_permutation(50, seed=2, epoch=2))


def test_partition_and_combine_round_trip():
    params = {"w": jnp.ones(2), "b": jnp.zeros(1)}
    trainable, frozen = train.partition(params, {"w": True, "b": False})
    assert trainable["b"] is None and frozen["w"] is None
    joined = train.combine(trainable, frozen)
    assert jax.tree.structure(joined) == jax.tree.structure(params)
    assert math.isclose(float(joined["w"].sum()), 2.0)
