"""Sharding rules, meshes and multi-process settings, on one process (no devices).

Layouts are checked on an `AbstractMesh` (rules only read the axis sizes); training
on real meshes runs in subprocesses (test_multidevice.py).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given
from hypothesis import strategies as st
from jax.sharding import AbstractMesh
from jax.sharding import PartitionSpec as P

from entrenar import distributed, lora, nn
from entrenar.distributed import MESH_AXES, ShardingRules, fsdp_axis, param_specs
from entrenar.errors import ConfigError
from entrenar.nn import LlamaConfig
from entrenar.optim import adamw
from entrenar.train import TrainConfig
from entrenar.tree import tree_named_leaves

MESH = AbstractMesh((2, 4), ("data", "fsdp"))
MODEL = LlamaConfig(
    vocab_size=30, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
    num_kv_heads=2, max_position_embeddings=32,
)  # fmt: skip


ALL = ShardingRules(min_size=0)


def specs(tree, rules=ALL, mesh=MESH):
    out = param_specs(tree, mesh, rules)
    return dict(tree_named_leaves(out, is_leaf=lambda s: isinstance(s, P)))


@pytest.mark.parametrize(
    "shape, stacked, min_size, axis",
    [
        ((2, 64, 32), True, 0, 1),  # largest divisible, not the layer axis
        ((16, 6, 12), True, 0, 2),  # axis 0 divisible and largest, but stacked
        ((16, 6, 12), False, 0, 0),
        ((30, 64), False, 0, 1),  # 30 does not split in 4
        ((32, 32), False, 0, 0),  # equal lengths: the first
        ((2, 30), True, 0, None),  # nothing divisible
        ((64, 64), False, 64 * 64 + 1, None),  # small: replicated
        ((), False, 0, None),
    ],
)
def test_fsdp_axis(shape, stacked, min_size, axis):
    assert fsdp_axis(shape, 4, stacked=stacked, min_size=min_size) == axis


def test_llama_layout_never_splits_the_layer_axis():
    params = jax.eval_shape(MODEL.init, jax.random.key(0))
    got = specs(params)
    assert got["model.layers.self_attn.q_proj.weight"] == P(None, "fsdp")  # (2,64,64)
    assert got["model.layers.mlp.down_proj.weight"] == P(None, None, "fsdp")
    assert got["model.embed_tokens.weight"] == P(None, "fsdp")  # (30, 64)
    for name, spec in got.items():
        if name.startswith("model.layers."):
            assert len(spec) == 0 or spec[0] is None, name
    # {data: 8, fsdp: 1}: replicated everywhere
    assert set(specs(params, mesh=AbstractMesh((8, 1), ("data", "fsdp"))).values()) == {
        P()
    }
    # the default threshold (16384 elements) replicates this model's small leaves
    default = specs(params, ShardingRules())
    assert default["model.layers.mlp.up_proj.weight"] == P(None, "fsdp")  # 16384
    assert default["model.layers.self_attn.k_proj.weight"] == P()  # 4096


def test_user_rules_come_first_regex_or_predicate():
    params = jax.eval_shape(MODEL.init, jax.random.key(0))
    rules = ShardingRules(
        min_size=0,
        rules=[
            ("embed_tokens", None),
            (lambda name, x: name.endswith("o_proj.weight"), P(None, None, "fsdp")),
            ("proj", P(None, "fsdp")),  # every other projection, even v_proj (2,32,64)
        ],
    )
    got = specs(params, rules)
    assert got["model.embed_tokens.weight"] == P()
    assert got["model.layers.self_attn.o_proj.weight"] == P(None, None, "fsdp")
    assert got["model.layers.self_attn.v_proj.weight"] == P(None, "fsdp")
    assert got["lm_head.weight"] == P(None, "fsdp")


@pytest.mark.parametrize("dora", [False, True])
@pytest.mark.parametrize("quantize", [None, "nf4"])
def test_lora_adapters_replicated_bases_split_along_out(quantize, dora):
    cfg = lora.LoRAConfig(rank=4, alpha=8, targets=("q_proj", "up_proj"), use_dora=dora)
    params = jax.eval_shape(  # shapes are all the rules read
        lambda k: lora.apply(MODEL.init(k), cfg, key=k, quantize=quantize),
        jax.random.key(0),
    )
    got = specs(params)
    q = "model.layers.self_attn.q_proj.weight"
    assert got[f"{q}.lora_A"] == got[f"{q}.lora_B"] == P()
    if dora:  # DoRA's magnitudes replicated like A and B (an array before)
        assert got[f"{q}.lora_magnitude_vector"] == P()
    if quantize is None:
        assert got[f"{q}.base"] == P(None, "fsdp")
        return
    node = params["model"]["layers"]["mlp"]["up_proj"]["weight"].base
    assert node.codes.shape == (2, 128, 32) and node.scales.shape == (2, 128, 1)
    up = "model.layers.mlp.up_proj.weight.base"
    # out (axis 1) for codes and scales alike, though codes' axis 2 would also split
    assert got[f"{up}.codes"] == got[f"{up}.scales"] == P(None, "fsdp")
    assert got[f"{up}.scale_scales"] == got[f"{up}.scale_offset"] == P()


def test_per_layer_scales_are_replicated_like_the_adapters():
    """Ranks by layer: each layer's scale (L,) is placed as A and B (P()).

    Before, the node's layer_scale child was left out of its specs (the array
    itself stood where a PartitionSpec belongs).
    """
    cfg = lora.LoRAConfig(
        rank=4, targets=("q_proj",), rank_pattern={r"layers\.0\.self_attn\.q_proj": 2}
    )
    params = jax.eval_shape(
        lambda k: lora.apply(MODEL.init(k), cfg, key=k), jax.random.key(0)
    )
    got = specs(params)
    q = "model.layers.self_attn.q_proj.weight"
    assert got[f"{q}.lora_A"] == got[f"{q}.layer_scale"] == P()


@pytest.mark.parametrize(
    "rules",
    [
        ALL,
        ShardingRules(min_size=0, rules=[
            (r"q_proj\.weight\.base$", P(None, None, "fsdp")),
            ("embed_tokens", P(None, "fsdp")),
        ]),
    ],
)  # fmt: skip
def test_a_bfloat16_copy_is_placed_as_the_float32_weights_it_rounds(rules):
    """A bfloat16 copy is split as the float32 weights it rounds (FSDP, user rules).

    The Trainer's copy of a frozen half (`nn.to_bfloat16_weights`): each
    `Bfloat16Weight` where its float32 weight was, a tied
    embedding's table where the embedding was and its head ``(D, V)`` along the
    same axis, transposed (each device holds the same rows of both).

    Before, the nodes' arrays were placed under their own names (``...weight.bits``,
    ``...weight.head_t``): a rule anchored on the weight's name missed the copy,
    and the user rule above split the head ``(64, 30)`` along its 30 rows
    (ConfigError: 30 does not split in 4).
    """
    tied = dataclasses.replace(MODEL, tie_word_embeddings=True)
    cfg = lora.LoRAConfig(rank=4, targets=lora.ALL_LINEAR)
    frozen = jax.eval_shape(
        lambda k: lora.split(lora.apply(tied.init(k), cfg, key=k))[1],
        jax.random.key(0),
    )
    copy = jax.eval_shape(
        lambda f: nn.to_bfloat16_weights(f, tied_embedding="model.embed_tokens.weight"),
        frozen,
    )
    want, got = specs(frozen, rules), specs(copy, rules)
    q = "model.layers.self_attn.q_proj.weight.base"
    assert got[f"{q}.bits"] == want[q] != P()
    emb = "model.embed_tokens.weight"
    assert got[f"{emb}.table"] == want[emb] != P()
    v, d = (*want[emb], None, None)[:2]  # the embedding (V, D)'s split axes
    assert (*got[f"{emb}.head_t"], None, None)[:2] == (d, v)
    for name, spec in want.items():  # every float32 leaf's place is its copy's
        assert got.get(name, got.get(f"{name}.bits", got.get(f"{name}.table"))) == spec


@pytest.mark.parametrize(
    "make_opt",
    [lambda: adamw(1e-3), lambda: optax.chain(optax.clip(1.0), optax.adamw(1e-3))],
)
def test_optimizer_state_placed_like_its_params(make_opt):
    cfg = lora.LoRAConfig(rank=4, alpha=8, targets="q_proj")
    params = jax.eval_shape(
        lambda k: lora.apply(MODEL.init(k), cfg, key=k), jax.random.key(0)
    )
    t, _ = lora.split(params)
    t["model"]["norm"] = params["model"]["norm"]  # a non-LoRA leaf trains too
    opt_state = make_opt().init(t)
    shard = distributed.opt_state_sharding(opt_state, t, MESH, ShardingRules(0))
    flat = tree_named_leaves(jax.tree_util.tree_map(lambda s: s.spec, shard))
    mu = {n.split("mu.", 1)[1]: s for n, s in flat if ".mu." in n}
    assert mu == specs(t)
    assert mu["model.norm.weight"] == P("fsdp")
    assert all(s == P() for n, s in flat if "count" in n or n.endswith("lr"))


def test_mesh_specs_and_errors():
    assert distributed.check_mesh_spec({"data": -1}) == {"data": -1, "fsdp": 1}
    n = jax.device_count()
    mesh = distributed.make_mesh({"fsdp": -1})
    assert mesh.axis_names == ("data", "fsdp") and mesh.shape["fsdp"] == n
    with pytest.raises(ConfigError, match=r"needs 16 devices, but there are .*XLA_FL"):
        distributed.make_mesh({"data": 4, "fsdp": 4})
    with pytest.raises(ConfigError, match="at most one mesh axis"):
        distributed.make_mesh({"data": -1, "fsdp": -1})
    with pytest.raises(ConfigError, match="size >= 1"):
        distributed.check_mesh_spec({"data": 0})
    with pytest.raises(ConfigError, match=r"TrainConfig.mesh: mesh axis 'tp'"):
        TrainConfig(mesh={"tp": 2})
    assert TrainConfig.from_dict({"mesh": {"fsdp": 8}}).mesh == {"data": 1, "fsdp": 8}


def test_process_config_from_arguments_and_environment():
    env = {"JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234", "JAX_NUM_PROCESSES": "4",
           "JAX_PROCESS_ID": "3"}  # fmt: skip
    cfg = distributed.process_config(env=env)
    assert cfg == distributed.ProcessConfig("10.0.0.1:1234", 4, 3)
    cfg = distributed.process_config("h:1", process_id=0, env=env)  # arguments win
    assert (cfg.coordinator, cfg.num_processes, cfg.process_id) == ("h:1", 4, 0)
    assert not distributed.process_config(env={}).multi_process
    with pytest.raises(ConfigError, match=r"incomplete.*JAX_PROCESS_ID"):
        distributed.process_config(env={**env, "JAX_PROCESS_ID": ""})
    with pytest.raises(ConfigError, match="JAX_NUM_PROCESSES must be a whole number"):
        distributed.process_config(env={**env, "JAX_NUM_PROCESSES": "four"})
    with pytest.raises(ConfigError, match="host:port"):
        distributed.process_config(env={**env, "JAX_COORDINATOR_ADDRESS": "10.0.0.1"})
    with pytest.raises(ConfigError, match=r"process_id 4 is not in \[0, num_pro"):
        distributed.process_config(process_id=4, env=env)


ENV3 = {"JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234", "JAX_NUM_PROCESSES": "4",
        "JAX_PROCESS_ID": "3"}  # fmt: skip


@pytest.mark.parametrize(
    "name, value",
    [
        # int() reads these as other numbers than the digits a person sees
        ("JAX_NUM_PROCESSES", "1_0"),
        ("JAX_NUM_PROCESSES", "\u0664"),  # Arabic-Indic four
        ("JAX_PROCESS_ID", "+3"),
        ("JAX_PROCESS_ID", "-1"),
        ("JAX_NUM_PROCESSES", "99999999999999999999"),  # past jax's int32
        ("JAX_NUM_PROCESSES", "0"),
        # coordinators jax.distributed cannot reach
        ("JAX_COORDINATOR_ADDRESS", "10.0.0.1:0"),
        ("JAX_COORDINATOR_ADDRESS", "10.0.0.1:65536"),
        ("JAX_COORDINATOR_ADDRESS", "10.0.0.1:\uff11\uff12"),  # full-width digits
        ("JAX_COORDINATOR_ADDRESS", "h:12\u00b2"),  # superscript two: isdigit()
        ("JAX_COORDINATOR_ADDRESS", "http://10.0.0.1:1234"),
        ("JAX_COORDINATOR_ADDRESS", " 10.0.0.1:1234"),
        ("JAX_COORDINATOR_ADDRESS", "fd00::1:1234"),  # IPv6 needs brackets
    ],
)
def test_process_config_refuses_hostile_environment_values(name, value):
    what = {"JAX_COORDINATOR_ADDRESS": "coordinator address must be host:port"}
    with pytest.raises(ConfigError, match=what.get(name, f"{name}|num_processes")):
        distributed.process_config(env={**ENV3, name: value})


@pytest.mark.parametrize(
    "kw", [{"process_id": 1.9}, {"num_processes": 2.5}, {"num_processes": True},
           {"coordinator": 1234}],
)  # fmt: skip
def test_process_config_refuses_arguments_it_would_truncate(kw):
    # int(1.9) == 1: a float id would silently join as another process
    with pytest.raises(ConfigError, match=r"must be an integer|must be a string"):
        distributed.process_config(env=ENV3, **kw)


@given(st.integers(0, 2**31 - 2), st.sampled_from(["", " ", "0"]))
def test_process_config_reads_ascii_digits_exactly(n, pad):
    got = distributed.process_config(
        "[fd00::1]:65535",
        env={"JAX_NUM_PROCESSES": f"{pad}{n + 1}", "JAX_PROCESS_ID": str(n)},
    )
    assert (got.num_processes, got.process_id) == (n + 1, n)


def test_initialize_alone_is_a_no_op(monkeypatch):
    for name in distributed.ENV.values():
        monkeypatch.delenv(name, raising=False)
    assert not distributed.initialize().multi_process
    assert not jax.distributed.is_initialized() and jax.process_count() == 1


def test_one_device_placement_and_bytes():
    mesh = distributed.make_mesh({"data": -1})
    tree = {"w": jnp.ones((4, 8)), "b": None, "q": np.zeros(3, np.int8)}
    placed = distributed.shard_params(tree, mesh, ShardingRules(min_size=0))
    assert placed["b"] is None and placed["w"].sharding.mesh == mesh
    per_device = distributed.bytes_per_device(placed)
    assert sum(per_device.values()) == (4 * 8 * 4 + 3) * jax.device_count()


def test_mesh_sizes_must_be_whole_numbers_and_known_axes():
    with pytest.raises(
        ConfigError, match=r"whole number of devices .* got 2.0 \(float"
    ):
        distributed.check_mesh_spec({"data": 2.0})
    with pytest.raises(ConfigError, match="tensor and pipeline parallelism are not"):
        distributed.check_mesh_spec({"tensor": 2})
    assert distributed.check_mesh_spec({"fsdp": np.int64(-1)}) == {
        "data": 1,
        "fsdp": -1,
    }


@pytest.mark.parametrize("rows, ok", [(8, True), (16, True), (6, False), (4, False)])
def test_training_batches_must_split_over_the_mesh(rows, ok):
    if ok:
        distributed.check_batch_rows(rows, MESH, "x")
        return
    with pytest.raises(ConfigError, match=rf"{rows} rows \(batch_size 3 × grad_accum"):
        distributed.check_batch_rows(rows, MESH, "batch_size 3 × grad_accum 2")


def test_yaml_mesh_refused_before_the_model_loads(tmp_path, monkeypatch):
    from config_cases import wine_doc, write

    from entrenar.runs import run as run_mod

    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded before the mesh check")

    def doc(mesh):
        train = {"max_steps": 1, "output_dir": str(tmp_path / "out"), "mesh": mesh}
        return write(tmp_path / "run.yaml", wine_doc(tmp_path / "out", training=train))

    monkeypatch.setattr(run_mod, "build_model", no_load)
    n = jax.device_count()
    with pytest.raises(
        ConfigError,
        match=f"^training.mesh: mesh .* needs {n + 1} devices, but there are {n}",
    ):
        run_mod.train_from_yaml(doc({"data": n + 1}), progress=False)
    # 16 rows over 3 devices (the check reads only the mesh's shape)
    monkeypatch.setattr(
        run_mod.distributed, "make_mesh", lambda spec: AbstractMesh((3, 1), MESH_AXES)
    )
    with pytest.raises(ConfigError, match=r"grad_accum = 16 × 1\) do not split over"):
        run_mod.train_from_yaml(doc({"data": -1}), progress=False)
    assert not (tmp_path / "out").exists()


def test_fsdp_that_divides_no_axis_is_reported_not_silent():
    # hidden 64, intermediate 128, vocab 30: fsdp 4 splits every large leaf, fsdp 3
    # none (64 = 2^6, 128 = 2^7; the embedding's 30 rows only as axis 0 of (30, 64))
    params = jax.eval_shape(MODEL.init, jax.random.key(0))
    assert distributed.undivided_leaves(params, MESH, ALL) == []
    three = AbstractMesh((2, 3), ("data", "fsdp"))
    whole = dict((n, s) for n, s, _ in distributed.undivided_leaves(params, three, ALL))
    assert whole["model.layers.mlp.up_proj.weight"] == (2, 128, 64)
    assert "model.embed_tokens.weight" not in whole  # 30 rows split in 3
    with pytest.warns(UserWarning, match=r"FSDP over 3 devices keeps \d+ arrays .*"
                      r"of the params\) whole on every device"):  # fmt: skip
        distributed.warn_undivided(params, three, ALL)
    # {data: 6}: nothing is meant to be split; the default threshold: small leaves
    # are replicated on purpose
    six = AbstractMesh((6, 1), ("data", "fsdp"))
    assert distributed.undivided_leaves(params, six, ALL) == []
    small = distributed.undivided_leaves(params, three, ShardingRules())
    assert {n for n, *_ in small} == {
        f"model.layers.mlp.{p}_proj.weight" for p in ("up", "gate", "down")
    }


@pytest.mark.parametrize(
    "rule, message",
    [
        (("embed", P("model")), r"names \['model'\], not mesh axes"),
        (("embed", "fsdp"), "must be a jax.sharding.PartitionSpec or None"),
        (("embed[", None), "is not a regex"),
        ((3, None), "match must be a regex or fn"),
        (("embed",), r"must be a \(match, PartitionSpec \| None\) pair"),
    ],
)
def test_malformed_sharding_rules_are_refused_when_made(rule, message):
    with pytest.raises(ConfigError, match=rf"ShardingRules.rules\[0\].*{message}"):
        ShardingRules(rules=[rule])


@pytest.mark.parametrize(
    "spec, problem",
    [
        (P(None, None, "fsdp"), "it has 3 entries for 2 axes"),
        (P("fsdp"), "axis 0 of length 30 does not split in 4"),  # 30 rows
        (P(None, ("data", "fsdp")), None),  # 64 columns over 2 × 4: fits
    ],
)
def test_a_rule_that_does_not_fit_its_leaf_names_both(spec, problem):
    # before: jax's error at placement ("One of device_put args is incompatible
    # with its sharding annotation ...") named neither the leaf nor the rule
    params = jax.eval_shape(MODEL.init, jax.random.key(0))
    rules = ShardingRules(min_size=0, rules=[("embed_tokens", spec)])
    if problem is None:
        assert specs(params, rules)["model.embed_tokens.weight"] == spec
        return
    leaf = r"model.embed_tokens.weight of shape \(30, 64\)"
    with pytest.raises(ConfigError, match=rf"does not fit {leaf}: {problem}"):
        param_specs(params, MESH, rules)
