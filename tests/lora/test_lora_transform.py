"""apply / split / combine / mask / merge / unfold on hand-made trees."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from lora_helpers import D, H, L, forward, make_params, with_b

from entrenar import lora
from entrenar.errors import CompatibilityError, ConfigError, UnsupportedError
from entrenar.lora import LoRAConfig, LoRAWeight
from entrenar.nn import linear
from entrenar.tree import assert_trees_allclose

KEY = jax.random.key(0)
X = jax.random.normal(jax.random.key(1), (4, D))
CFG = LoRAConfig(rank=2, alpha=4.0, targets=("up_proj", "down_proj"))


def randomize_b(params, key):
    """Give every adapter a non-zero B (as after training)."""
    flat, tdef = jax.tree_util.tree_flatten(
        params, is_leaf=lambda x: isinstance(x, LoRAWeight)
    )
    out = []
    for i, x in enumerate(flat):
        if isinstance(x, LoRAWeight):
            b = jax.random.normal(jax.random.fold_in(key, i), x.b.shape) * 0.1
            x = x.replace(b=b)
        out.append(x)
    return jax.tree_util.tree_unflatten(tdef, out)


@settings(max_examples=12)
@given(
    lead=st.sampled_from([(), (2,)]),
    r=st.integers(1, 3),
    out=st.integers(1, 5),
    fan_in=st.integers(1, 5),
    alpha=st.floats(0.5, 8.0),
    rslora=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_lora_matmul_matches_numpy_merged_product(
    lead, r, out, fan_in, alpha, rslora, seed
):
    rng = np.random.default_rng(seed)
    w = rng.normal(size=(*lead, out, fan_in)).astype(np.float32)
    a = rng.normal(size=(*lead, r, fan_in)).astype(np.float32)
    b = rng.normal(size=(*lead, out, r)).astype(np.float32)
    x = rng.normal(size=(*lead, 3, fan_in)).astype(np.float32)
    node = LoRAWeight(jnp.asarray(w), jnp.asarray(a), jnp.asarray(b), alpha, r,
                      rslora=rslora)  # fmt: skip
    s = alpha / (math.sqrt(r) if rslora else r)
    ref = np.einsum("...ti,...oi->...to", x.astype(np.float64), w + s * (b @ a))
    got = jax.vmap(linear)(jnp.asarray(x), node) if lead else linear(x, node)
    np.testing.assert_allclose(np.asarray(got), ref, rtol=1e-4, atol=1e-4)
    assert node.scale == pytest.approx(s)


def test_apply_shapes_init_and_purity():
    p = make_params()
    before = jax.tree_util.tree_map(np.asarray, p)
    lp = lora.apply(p, CFG, key=KEY)
    up = lp["model"]["layers"]["up_proj"]["weight"]
    assert isinstance(up, LoRAWeight)
    assert up.a.shape == (L, 2, D) and up.b.shape == (L, H, 2)
    assert up.a.dtype == jnp.float32 and not np.any(np.asarray(up.b))
    assert up.base is p["model"]["layers"]["up_proj"]["weight"]
    bound = 1 / math.sqrt(D)  # PEFT's kaiming_uniform_(a=sqrt(5))
    assert np.all(np.abs(np.asarray(up.a)) <= bound)
    assert np.abs(np.asarray(up.a)).max() > 0.8 * bound
    assert not isinstance(lp["lm_head"]["weight"], LoRAWeight)
    assert not isinstance(lp["model"]["embed_tokens"]["weight"], LoRAWeight)
    assert_trees_allclose(p, before, rtol=0)  # input untouched
    g = lora.apply(p, LoRAConfig(rank=4, targets="up_proj", init="gaussian"), key=KEY)
    a = np.asarray(g["model"]["layers"]["up_proj"]["weight"].a)
    assert 0.15 < a.std() < 0.35  # N(0, 1/r²), r = 4


def test_adapted_model_equals_base_exactly_at_init():
    p = make_params()
    lp = lora.apply(p, CFG, key=KEY)
    np.testing.assert_array_equal(np.asarray(forward(lp, X)), forward(p, X))
    jitted = jax.jit(forward)(lp, X)
    np.testing.assert_array_equal(np.asarray(jitted), forward(p, X))


def test_merge_of_apply_is_identity_and_unmerge_inverts():
    p = make_params()
    lp = lora.apply(p, CFG, key=KEY)
    assert_trees_allclose(lora.fold(lp), p, rtol=0)
    trained = randomize_b(lp, jax.random.key(5))
    merged = lora.fold(trained)
    w = trained["model"]["layers"]["up_proj"]["weight"]
    ref = np.asarray(w.base) + w.scale * np.einsum(
        "lor,lri->loi", np.asarray(w.b), np.asarray(w.a)
    )
    np.testing.assert_allclose(merged["model"]["layers"]["up_proj"]["weight"], ref,
                               rtol=1e-6, atol=1e-6)  # fmt: skip
    np.testing.assert_allclose(forward(merged, X), forward(trained, X),
                               rtol=1e-5, atol=1e-5)  # fmt: skip
    back = lora.unfold(merged, trained)
    assert_trees_allclose(lora.split(back)[0], lora.split(trained)[0], rtol=0)
    assert_trees_allclose(lora.fold(back), merged, rtol=1e-6, atol=1e-6)
    up = back["model"]["layers"]["up_proj"]["weight"].base
    np.testing.assert_allclose(up, p["model"]["layers"]["up_proj"]["weight"],
                               atol=1e-6)  # fmt: skip
    with pytest.raises(CompatibilityError, match="does not fit"):
        lora.unfold({"w": jnp.zeros((3, 3))}, {"w": w})


def test_split_combine_and_mask():
    lp = randomize_b(lora.apply(make_params(), CFG, key=KEY), KEY)
    t, f = lora.split(lp)
    names = [n for n, _ in jax.tree_util.tree_flatten_with_path(t)[0]]
    assert len(names) == 4  # A and B of two stacked weights, nothing else
    assert lora.trainable_report(t).frozen_params == 0
    assert_trees_allclose(lora.combine(t, f), lp, rtol=0)
    mask = lora.trainable_mask(lp)
    frozen_mask = jax.tree_util.tree_map(lambda m: not m, mask)
    opt = optax.chain(  # masked() passes masked-out updates through: zero them
        optax.masked(optax.sgd(1.0), mask),
        optax.masked(optax.set_to_zero(), frozen_mask),
    )
    grads = jax.tree_util.tree_map(jnp.ones_like, lp)
    upd, _ = opt.update(grads, opt.init(lp), lp)
    new = optax.apply_updates(lp, upd)
    assert_trees_allclose(lora.split(new)[1], f, rtol=0)  # frozen untouched
    up = new["model"]["layers"]["up_proj"]["weight"]
    np.testing.assert_allclose(up.b, lp["model"]["layers"]["up_proj"]["weight"].b - 1)
    only_up = LoRAConfig(rank=2, alpha=4.0, targets="up_proj")
    other_t, _ = lora.split(lora.apply(make_params(), only_up, key=KEY))
    with pytest.raises(ConfigError, match="halves"):
        lora.combine(other_t, f)  # no adapter where f holds down_proj's node
    with pytest.raises(ConfigError, match="no LoRA adapter"):
        lora.split(make_params())  # nothing would train: an error, not all-None


def test_gradients_only_for_adapters_and_match_finite_differences():
    p = make_params()
    lp = randomize_b(lora.apply(p, CFG, key=KEY), KEY)
    t, f = lora.split(lp)

    def loss(tr):
        return jnp.mean(forward(lora.combine(tr, f), X) ** 2)

    g = jax.grad(loss)(t)
    assert jax.tree_util.tree_structure(g) == jax.tree_util.tree_structure(t)
    gb = g["model"]["layers"]["down_proj"]["weight"].b
    eps, idx = 1e-2, (1, 3, 0)
    bump = t["model"]["layers"]["down_proj"]["weight"]

    def shifted(sign):
        node = bump.replace(b=bump.b.at[idx].add(sign * eps))
        tr = {**t, "model": {**t["model"], "layers": {
            **t["model"]["layers"], "down_proj": {"weight": node}}}}  # fmt: skip
        return float(loss(tr))

    fd = (shifted(1) - shifted(-1)) / (2 * eps)
    np.testing.assert_allclose(float(gb[idx]), fd, rtol=2e-2, atol=1e-5)


def test_targets_regex_all_linear_and_errors():
    p = make_params()
    rx = lora.apply(p, LoRAConfig(rank=1, targets=r"layers\.\d+\.up_proj"), key=KEY)
    assert isinstance(rx["model"]["layers"]["up_proj"]["weight"], LoRAWeight)
    assert not isinstance(rx["model"]["layers"]["down_proj"]["weight"], LoRAWeight)
    al = lora.apply(p, LoRAConfig(rank=1, targets="all-linear"), key=KEY)
    adapted = {n for n, _, _ in lora.adapter_io._adapted(al, ("layers",))}
    assert adapted == {
        "model.layers.up_proj.weight",
        "model.layers.down_proj.weight",
    }
    with pytest.raises(UnsupportedError, match="only some layers"):
        lora.apply(p, LoRAConfig(rank=1, targets=r"layers\.1\.up_proj"), key=KEY)
    with pytest.raises(ConfigError, match="matched no weight"):
        lora.apply(p, LoRAConfig(rank=1, targets="q_proj"), key=KEY)
    with pytest.raises(ConfigError, match="already has a LoRA"):
        lora.apply(lora.apply(p, CFG, key=KEY), CFG, key=KEY)
    for bad in (dict(rank=0), dict(alpha=-1.0), dict(dropout=1.0),
                dict(init="xavier"), dict(targets="("), dict(targets=())):  # fmt: skip
        with pytest.raises(ConfigError):
            LoRAConfig(**bad)


def test_dropout_is_exact_without_keys_and_matches_reference_with_keys():
    p = make_params()
    cfg = LoRAConfig(rank=2, alpha=4.0, targets="up_proj", dropout=0.5)
    lp = randomize_b(lora.apply(p, cfg, key=KEY), KEY)
    nodrop = randomize_b(lora.apply(p, LoRAConfig(rank=2, alpha=4.0,
                         targets="up_proj"), key=KEY), KEY)  # fmt: skip
    np.testing.assert_array_equal(forward(lp, X), forward(nodrop, X))  # eval: exact
    keyed = lora.with_dropout_keys(lp, key=jax.random.key(7))
    node = keyed["model"]["layers"]["up_proj"]["weight"]
    assert node.dropout_key.shape == (L, 2) and node.dropout_key.dtype == jnp.uint32
    # Reference for one unstacked layer: mask from the same key, PEFT's formula.
    x = jax.random.normal(KEY, (6, D))
    one = jax.tree_util.tree_map(lambda a: a[0], node)
    keep = jax.random.bernoulli(jax.random.wrap_key_data(one.dropout_key), 0.5, x.shape)
    xd = np.where(np.asarray(keep), np.asarray(x) / 0.5, 0.0)
    w, a, b = (np.asarray(v) for v in (one.base, one.a, one.b))
    ref = np.asarray(x) @ w.T + one.scale * (xd @ a.T) @ b.T
    np.testing.assert_allclose(linear(x, one), ref, rtol=1e-5, atol=1e-5)
    assert not np.allclose(linear(x, one), linear(x, one.replace(dropout_key=None)))
    step = jax.jit(lambda p, k: forward(lora.with_dropout_keys(p, key=k), X))
    eager = forward(lora.with_dropout_keys(lp, key=jax.random.key(7)), X)
    np.testing.assert_allclose(step(lp, jax.random.key(7)), eager, rtol=1e-6)
    assert not np.allclose(step(lp, jax.random.key(8)), eager)
    again = lora.with_dropout_keys(lp, key=jax.random.key(8))
    assert not np.array_equal(
        again["model"]["layers"]["up_proj"]["weight"].dropout_key, node.dropout_key
    )
    t, f = lora.split(keyed)  # keys live in the frozen half; mask is a prefix tree
    assert t["model"]["layers"]["up_proj"]["weight"].dropout_key is None
    assert f["model"]["layers"]["up_proj"]["weight"].dropout_key is node.dropout_key
    mask = lora.trainable_mask(keyed)
    jax.tree_util.tree_map(lambda m, x: None, mask, keyed)  # prefix of the params


def test_memory_report_counts_and_bytes():
    lp = lora.apply(make_params(), CFG, key=KEY)
    rep = lora.trainable_report(lp)
    assert rep.trainable_params == L * 2 * (D + H) * 2
    assert rep.trainable_bytes == 4 * rep.trainable_params
    assert rep.total_params == sum(x.size for x in jax.tree_util.tree_leaves(
        make_params())) + rep.trainable_params  # fmt: skip
    assert rep.frozen_bits_per_param == 32.0
    assert "trainable params: 288" in str(rep)


def test_forward_never_forms_the_merged_matrix():
    out, fan_in, r = 7, 5, 2
    node = LoRAWeight(jnp.ones((out, fan_in)), jnp.ones((r, fan_in)),
                      jnp.ones((out, r)), alpha=1.0, rank=r)  # fmt: skip
    jaxpr = jax.make_jaxpr(linear)(jnp.ones((3, fan_in)), node).jaxpr
    shapes = [v.aval.shape for eqn in jaxpr.eqns for v in eqn.outvars]
    assert (out, fan_in) not in shapes, shapes  # only (3, r) and (3, out) products
    assert (3, r) in shapes


def test_unmatched_target_lists_the_linear_weights_and_the_closest_name():
    with pytest.raises(ConfigError) as info:
        lora.apply(make_params(), LoRAConfig(rank=1, targets="up_prj"), key=KEY)
    assert str(info.value) == (
        "LoRA targets ('up_prj',) matched no weight. The linear weights here are "
        "lm_head, embed_tokens, down_proj, up_proj (full names like "
        "'model.layers.0.down_proj'); a target matches the last parts of a module "
        "name, or the whole name as a regex. Did you mean 'up_proj' for 'up_prj'?"
    )  # the stacked norm (one weight vector per layer) is not listed


def test_unfold_recovers_the_base_from_the_trainable_half_alone():
    p = make_params()
    lp = with_b(lora.apply(p, CFG, key=KEY), 0.05)  # so that folding changes W
    trainable, _ = lora.split(lp)  # adapters with base=None: unfold must compute it
    back = lora.unfold(lora.fold(lp), trainable)
    node = back["model"]["layers"]["up_proj"]["weight"]
    assert isinstance(node, LoRAWeight) and node.dropout_key is None
    np.testing.assert_allclose(
        node.base, p["model"]["layers"]["up_proj"]["weight"], atol=1e-6
    )


def test_trainable_report_prints_the_percentage():
    r = lora.trainable_report(lora.apply(make_params(), CFG, key=KEY))
    pct = float(str(r).split("trainable%: ")[1].split()[0])
    assert pct == pytest.approx(100 * r.trainable_params / r.total_params, abs=1e-4)
    assert 0 < pct < 100
