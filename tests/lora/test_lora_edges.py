"""Edges of the LoRA transforms that mutation testing found unchecked.

Each test names what it pins down: dtypes kept in bfloat16, the mask's structure with
and without dropout keys, raw uint32 keys, a message with no linear weight at all,
the warning's threshold and its suggestion, the source GGUF's name carried over.
"""

import json
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from lora_helpers import L, is_adapter, make_params, with_b

from entrenar import io, lora, quant
from entrenar.errors import (
    CompatibilityError,
    ConfigError,
    FormatError,
    UnsupportedError,
)
from entrenar.lora import LoRAConfig, LoRAWeight, fold_retention, save_folded_gguf
from entrenar.nn import LlamaConfig, is_weight_node
from entrenar.tree import assert_trees_allclose

KEY = jax.random.key(0)
CFG = LoRAConfig(rank=2, alpha=4.0, targets=("up_proj", "down_proj"))
DROP = LoRAConfig(rank=2, alpha=4.0, targets=("up_proj", "down_proj"), dropout=0.1)
is_node = is_adapter


def nodes(tree):
    return [x for x in jax.tree_util.tree_leaves(tree, is_leaf=is_node) if is_node(x)]


# --- masks and dropout keys ------------------------------------------------------


@pytest.mark.parametrize("dropout_keys", [False, True])
def test_trainable_mask_marks_a_and_b_only_and_keeps_the_tree_structure(dropout_keys):
    lp = lora.apply(make_params(), DROP, key=KEY)
    if dropout_keys:
        lp = lora.with_dropout_keys(lp, key=jax.random.key(3))
    mask = lora.trainable_mask(lp)
    assert jax.tree_util.tree_structure(mask) == jax.tree_util.tree_structure(lp)
    for node in nodes(mask):
        assert (node.base, node.a, node.b) == (False, True, True)
        assert node.dropout_key is (False if dropout_keys else None)


def test_dropout_keys_only_where_dropout_is_on_and_from_a_raw_key():
    p = make_params()
    lp = lora.apply(p, DROP, key=KEY)
    plain = lora.apply(p, CFG, key=KEY)  # dropout 0: no key, even when asked
    keyed_plain = nodes(lora.with_dropout_keys(plain, key=KEY))
    assert all(n.dropout_key is None for n in keyed_plain)
    typed = lora.with_dropout_keys(lp, key=jax.random.key(7))
    raw = lora.with_dropout_keys(lp, key=jax.random.PRNGKey(7))  # uint32 (2,)
    for t, r in zip(nodes(typed), nodes(raw)):
        assert t.dropout_key.shape == (L, 2) and t.dropout_key.dtype == jnp.uint32
        np.testing.assert_array_equal(t.dropout_key, r.dropout_key)


def test_dropout_keys_of_either_half_and_of_the_whole_tree():
    lp = lora.apply(make_params(), DROP, key=KEY)
    trainable, frozen = lora.split(lp)
    k = jax.random.key(1)
    whole = nodes(lora.with_dropout_keys(lp, key=k))
    # the frozen half has the whole tree's leaf order: the same keys
    for f, w in zip(nodes(lora.with_dropout_keys(frozen, key=k)), whole):
        np.testing.assert_array_equal(f.dropout_key, w.dropout_key)
    for t in nodes(lora.with_dropout_keys(trainable, key=k)):
        assert t.base is None and t.dropout_key.shape == (L, 2)  # lead taken from A
        assert len({tuple(k) for k in np.asarray(t.dropout_key)}) == L


def test_combine_takes_a_leaf_trained_beside_the_adapters_from_the_trainable_half():
    w = jnp.arange(3.0)
    assert lora.combine({"w": w}, {"w": None})["w"] is w
    assert lora.combine({"w": None}, {"w": w})["w"] is w


def test_combine_message_in_full():
    lp = lora.apply(make_params(), CFG, key=KEY)
    _, frozen = lora.split(lp)
    with pytest.raises(ConfigError) as info:
        lora.combine(jax.tree_util.tree_map(lambda x: None, frozen, is_leaf=is_node),
                     frozen)  # fmt: skip
    assert str(info.value) == (
        "combine: the trainable tree has no adapter where the frozen tree has a "
        "LoRAWeight; pass the halves of one lora.split"
    )


# --- messages --------------------------------------------------------------------


def test_no_linear_weight_at_all_is_said_so():
    with pytest.raises(ConfigError) as info:
        lora.apply({"norm": {"weight": jnp.ones(4)}}, CFG, key=KEY)
    assert str(info.value) == (
        "LoRA targets ('up_proj', 'down_proj') matched no weight. The linear weights "
        "here are none (full names like '?'); a target matches the last parts of a "
        "module name, or the whole name as a regex."
    )


def test_two_typos_get_two_hints_in_one_sentence_each():
    with pytest.raises(ConfigError) as info:
        lora.apply(make_params(), LoRAConfig(targets=("up_prj", "dwn_proj")), key=KEY)
    assert str(info.value).endswith(
        "regex. Did you mean 'up_proj' for 'up_prj'? Did you mean 'down_proj' for "
        "'dwn_proj'?"
    )


# --- QLoRA bases, fold, unfold ---------------------------------------------------


def test_qlora_keeps_a_base_that_is_already_quantized():
    p = make_params()
    q = quant.quantize(p["model"]["layers"]["up_proj"]["weight"], "int4", block_size=8)
    p["model"]["layers"]["up_proj"]["weight"] = q
    p["model"]["layers"]["down_proj"]["weight"] = jnp.ones((L, 8, 64))  # out 8, in 64
    lp = lora.apply(p, CFG, key=KEY, quantize="nf4")
    assert lp["model"]["layers"]["up_proj"]["weight"].base is q  # not requantized
    assert lp["model"]["layers"]["down_proj"]["weight"].base.scheme == "nf4"


def test_unfold_keeps_bfloat16_and_drops_the_dropout_key():
    p = jax.tree_util.tree_map(lambda x: x.astype(jnp.bfloat16), make_params())
    lp = with_b(lora.apply(p, DROP, key=KEY), 0.05)
    keyed = lora.with_dropout_keys(lp, key=KEY)
    back = lora.unfold(lora.fold(keyed), keyed)
    for node in nodes(back):
        assert node.base.dtype == jnp.bfloat16 and node.dropout_key is None


def test_requantize_report_is_measured_in_float32_for_bfloat16_bases():
    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.normal(size=(L, 16, 64)), jnp.bfloat16)
    node = LoRAWeight(quant.quantize(w, "nf4"),
                      jnp.asarray(rng.normal(size=(L, 2, 64)), jnp.float32),
                      jnp.asarray(rng.normal(size=(L, 16, 2)) * 0.05, jnp.float32),
                      alpha=2.0, rank=2)  # fmt: skip
    merged = np.asarray(lora.fold({"w": node})["w"], np.float64)  # bfloat16 values
    out, errors = lora.fold_and_requantize({"w": node})
    assert out["w"].dtype == jnp.bfloat16  # dequantizes to the base's dtype
    diff = np.asarray(quant.dequantize(out["w"]), np.float64) - merged
    rms, ref = np.sqrt(np.mean(diff**2)), np.sqrt(np.mean(merged**2))
    np.testing.assert_allclose(errors["w"].rms, rms, rtol=1e-5)
    np.testing.assert_allclose(errors["w"].relative_rms, rms / ref, rtol=1e-5)
    np.testing.assert_allclose(errors["w"].max_abs, np.max(np.abs(diff)), rtol=1e-6)


def test_requantize_report_of_an_all_zero_weight_is_zero():
    z = quant.quantize(jnp.zeros((16, 64)), "nf4")
    node = LoRAWeight(z, jnp.ones((1, 64)), jnp.zeros((16, 1)), alpha=1.0, rank=1)
    _, errors = lora.fold_and_requantize({"w": node})
    assert tuple(errors["w"]) == (0.0, 0.0, 0.0)


def test_trainable_report_counts_no_bytes_for_the_empty_places_of_a_half():
    lp = lora.apply(make_params(), CFG, key=KEY)
    trainable, _ = lora.split(lp)
    rep = lora.trainable_report(trainable)
    a_b = [x for n in nodes(trainable) for x in (n.a, n.b)]
    assert rep.trainable_params == sum(x.size for x in a_b)
    assert rep.trainable_bytes == 4 * rep.trainable_params
    assert rep.total_params == rep.trainable_params  # the None places count nothing


# --- the folded GGUF -------------------------------------------------------------

TINY = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=64, num_layers=2,
                   num_heads=2, num_kv_heads=1, tie_word_embeddings=True)  # fmt: skip


def tiny_adapted(b=2e-4):
    dense = TINY.init(jax.random.key(0))
    lp = lora.apply(dense, LoRAConfig(rank=2, targets=("q_proj", "v_proj")), key=KEY)
    return dense, with_b(lp, b)


def test_the_warning_threshold_is_strict_and_q8_0_is_told_to_use_f16(tmp_path):
    _, params = tiny_adapted()
    r = fold_retention(params, "Q8_0")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # kept == min_kept: no warning
        save_folded_gguf(tmp_path / "a.gguf", TINY, params, min_kept=r.kept)
    f16 = fold_retention(params, "F16")
    with pytest.warns(UserWarning) as caught:
        save_folded_gguf(tmp_path / "b.gguf", TINY, params, min_kept=1.5)
    message = str(caught[0].message)
    assert message.endswith(f"F16 keeps {f16.kept:.0%} (tensor_type='F16')"), message
    assert re.match(rf"^{re.escape(str(tmp_path / 'b.gguf'))}: Q8_0 keeps ", message)


def test_the_folded_gguf_keeps_the_source_name_and_writes_the_given_one(tmp_path):
    dense, params = tiny_adapted()
    io.save_llama_gguf(tmp_path / "base.gguf", TINY, dense, name="tiny-base")
    base = tmp_path / "base.gguf"
    save_folded_gguf(tmp_path / "kept.gguf", TINY, params, source=base)
    save_folded_gguf(tmp_path / "new.gguf", TINY, params, source=base, name="tuned")
    assert io.read_gguf(tmp_path / "kept.gguf").metadata["general.name"] == "tiny-base"
    assert io.read_gguf(tmp_path / "new.gguf").metadata["general.name"] == "tuned"


# --- configs, adapters on disk, retention ------------------------------------------


def test_alpha_must_be_positive_and_messages_start_with_their_subject():
    with pytest.raises(ConfigError, match=r"^LoRAConfig\.alpha"):
        LoRAConfig(alpha=0.0)
    with pytest.raises(ConfigError, match=r"^LoRAConfig\.targets: empty; name at"):
        LoRAConfig(targets=())
    with pytest.raises(ConfigError, match=r"^LoRAConfig\.init: must be one of"):
        LoRAConfig(init="xavier")


def test_save_adapter_refuses_a_tree_without_adapters_or_with_mixed_rslora(tmp_path):
    with pytest.raises(CompatibilityError, match=r"^save_adapter: the tree has no"):
        lora.save_adapter(make_params(), tmp_path / "none")
    p = make_params()
    mixed = lora.apply(p, LoRAConfig(rank=2, targets="up_proj"), key=KEY)
    mixed = lora.apply(mixed, LoRAConfig(rank=2, targets="down_proj", rslora=True),
                       key=KEY)  # fmt: skip
    with pytest.raises(CompatibilityError, match=r"^PEFT stores one use_rslora for"):
        lora.save_adapter(mixed, tmp_path / "mixed")


def test_key_paths_of_an_adapter_use_peft_names():
    node = LoRAWeight(jnp.ones((2, 3)), jnp.ones((1, 3)), jnp.zeros((2, 1)), 1.0, 1)
    paths = [jax.tree_util.keystr(p) for p, _ in
             jax.tree_util.tree_flatten_with_path(node)[0]]  # fmt: skip
    assert paths == [".base", ".lora_A", ".lora_B"]


def test_retention_sums_over_every_adapter_and_is_whole_when_untrained():
    rng = np.random.default_rng(1)
    nodes_ = {}
    for i, scale in enumerate([0.01, 0.3]):  # two adapters of very different sizes
        w = rng.normal(size=(8, 64)).astype(np.float32)
        a = rng.normal(size=(2, 64)).astype(np.float32)
        b = (rng.normal(size=(8, 2)) * scale).astype(np.float32)
        nodes_[f"m{i}"] = {"weight": LoRAWeight(jnp.asarray(w), jnp.asarray(a),
                                                jnp.asarray(b), 2.0, 2)}  # fmt: skip
    dot = sq = err = 0.0
    for m in nodes_.values():
        n = m["weight"]
        d = np.asarray(n.b, np.float64) @ np.asarray(n.a, np.float64)
        w = np.asarray(n.base, np.float64)
        e = (w + d).astype(np.float16).astype(np.float64) - w
        dot, sq = dot + np.vdot(e, d), sq + np.vdot(d, d)
        err += np.sum((e - d) ** 2)
    r = fold_retention(nodes_, "F16")
    np.testing.assert_allclose(r.kept, dot / sq, rtol=1e-4)
    np.testing.assert_allclose(r.residual, np.sqrt(err / sq), rtol=1e-3)
    assert r.weights == 2
    untrained = with_b(nodes_, 0.0)
    assert tuple(fold_retention(untrained, "Q4_0")) == ("Q4_0", 1.0, 0.0, 2)


def test_adapter_files_carry_peft_metadata_and_an_indented_config(tmp_path):
    from safetensors import safe_open

    lora.save_adapter(lora.apply(make_params(), CFG, key=KEY), tmp_path)
    with safe_open(str(tmp_path / "adapter_model.safetensors"), "np") as f:
        assert f.metadata() == {"format": "pt"}  # transformers refuses other formats
    text = (tmp_path / "adapter_config.json").read_text()
    assert text == json.dumps(json.loads(text), indent=2)  # as PEFT writes it


def test_targets_become_an_exact_regex_when_a_suffix_would_adapt_more(tmp_path):
    rng = np.random.default_rng(0)
    mat = lambda *s: jnp.asarray(rng.normal(size=s), jnp.float32)  # noqa: E731
    p = {"a": {"up_proj": {"weight": mat(6, 4)}, "down_proj": {"weight": mat(4, 6)}},
         "b": {"up_proj": {"weight": mat(6, 4)}}}  # fmt: skip
    lp = lora.apply(p, LoRAConfig(rank=1, targets=r"a\..*"), key=KEY)
    lora.save_adapter(lp, tmp_path)
    cfg = json.loads((tmp_path / "adapter_config.json").read_text())
    assert cfg["target_modules"] == r"a\.down_proj|a\.up_proj"
    back = lora.load_adapter(tmp_path, p)
    assert is_node(back["a"]["up_proj"]["weight"])
    assert is_node(back["a"]["down_proj"]["weight"])
    assert not is_node(back["b"]["up_proj"]["weight"])


def test_a_config_without_lora_dropout_loads_without_dropout(tmp_path):
    lora.save_adapter(lora.apply(make_params(), DROP, key=KEY), tmp_path)
    cfg = json.loads((tmp_path / "adapter_config.json").read_text())
    assert cfg.pop("lora_dropout") == 0.1
    for value in ("missing", None):  # old PEFT configs write null for "no dropout"
        if value is None:
            cfg["lora_dropout"] = None
        (tmp_path / "adapter_config.json").write_text(json.dumps(cfg))
        loaded = nodes(lora.load_adapter(tmp_path, make_params()))
        assert {n.dropout for n in loaded} == {0.0}


def test_weight_nodes_are_kept_whole_and_containers_walked():
    node = LoRAWeight(jnp.ones((2, 3)), jnp.ones((1, 3)), jnp.zeros((2, 1)), 1.0, 1)
    q = quant.quantize(jnp.ones((2, 64)), "nf4")
    assert is_weight_node(node) and is_weight_node(q)
    assert not any(is_weight_node(x) for x in (jnp.ones(2), 1.0, None, {}, [], (1,)))


def test_layers_stacked_under_another_key(tmp_path):
    rng = np.random.default_rng(0)
    p = {"blocks": {"up_proj": {"weight": jnp.asarray(rng.normal(size=(L, 6, 4)),
                                                      jnp.float32)}}}  # fmt: skip
    keys = ("blocks",)
    cfg = LoRAConfig(rank=2, targets="up_proj")
    lp = lora.apply(p, cfg, key=KEY, stacked_keys=keys)
    node = lp["blocks"]["up_proj"]["weight"]
    assert node.a.shape == (L, 2, 4) and node.b.shape == (L, 6, 2)
    lora.save_adapter(lp, tmp_path, stacked_keys=keys)
    written = json.loads((tmp_path / "adapter_config.json").read_text())
    assert written["target_modules"] == ["up_proj"]  # all layers: the suffix list
    back = lora.load_adapter(tmp_path, p, stacked_keys=keys)["blocks"]["up_proj"]
    np.testing.assert_array_equal(back["weight"].a, node.a)


@pytest.mark.parametrize(
    ("change", "error", "message"),
    [
        ({"bias": "all"}, UnsupportedError, "bias='all' is not supported"),
        ({"modules_to_save": ["lm_head"]}, UnsupportedError, "modules_to_save=['lm"),
        ({"use_dora": "yes"}, FormatError, "'use_dora' = 'yes' must be true or"),
        ({"lora_bias": True}, UnsupportedError, "lora_bias=True is not supported"),
        ({"init_lora_weights": "pissa"}, UnsupportedError, "init_lora_weights='pi"),
        ({"layer_replication": [[0, 1]]}, UnsupportedError, "layer_replication="),
        ({"alora_invocation_tokens": [3]}, UnsupportedError, "alora_invocation_t"),
        ({"trainable_token_indices": [3]}, UnsupportedError, "trainable_token_in"),
        ({"use_qalora": True}, UnsupportedError, "use_qalora=True is not"),
        ({"new_setting": 0.5}, UnsupportedError, "unknown key 'new_setting' = 0.5"),
        ({"r": 0}, FormatError, "'r' = 0 must be an integer > 0"),
        ({"lora_alpha": "8"}, FormatError, "'lora_alpha' = '8' must be a finite"),
    ],
)
def test_adapter_configs_peft_features_we_do_not_read_are_refused(
    tmp_path, change, error, message
):
    lora.save_adapter(lora.apply(make_params(), CFG, key=KEY), tmp_path)
    file = tmp_path / "adapter_config.json"
    file.write_text(json.dumps({**json.loads(file.read_text()), **change}))
    with pytest.raises(error, match=f"^{re.escape(str(file))}: {re.escape(message)}"):
        lora.load_adapter(tmp_path, make_params())


@pytest.mark.parametrize(
    "change",
    [
        {"fan_in_fan_out": True},  # transposes only a Conv1D base, not A or B
        {"init_lora_weights": "gaussian"},
        {"init_lora_weights": "eva", "eva_config": {"rho": 2.0}},
        {"init_lora_weights": False, "loftq_config": {"loftq_bits": 4}},
        {"runtime_config": {"ephemeral_gpu_offload": False}, "megatron_core": "m"},
        {"new_setting": None, "other_new_setting": False},  # empty: cannot matter
    ],
)
def test_adapter_config_settings_without_effect_on_the_forward_load(tmp_path, change):
    lp = lora.apply(make_params(), CFG, key=KEY)
    lora.save_adapter(lp, tmp_path)
    file = tmp_path / "adapter_config.json"
    file.write_text(json.dumps({**json.loads(file.read_text()), **change}))
    back = lora.load_adapter(tmp_path, make_params())
    assert_trees_allclose(lora.split(back)[0], lora.split(lp)[0], rtol=0)


def test_an_oversized_adapter_config_is_refused_before_reading(tmp_path):
    lora.save_adapter(lora.apply(make_params(), CFG, key=KEY), tmp_path)
    file = tmp_path / "adapter_config.json"
    file.write_text(file.read_text() + " " * (16 * 1024 * 1024))
    with pytest.raises(FormatError, match="over the adapter config limit of 16,777"):
        lora.load_adapter(tmp_path, make_params())


def test_a_long_list_of_problems_is_cut_at_twelve(tmp_path):
    from safetensors.numpy import save_file

    lora.save_adapter(lora.apply(make_params(), CFG, key=KEY), tmp_path)
    bogus = {f"x{i:02d}": np.zeros(1, np.float32) for i in range(14)}
    save_file(bogus, str(tmp_path / "adapter_model.safetensors"))
    with pytest.raises(CompatibilityError) as info:
        lora.load_adapter(tmp_path, make_params())
    lines = str(info.value).splitlines()
    assert lines[0].endswith(": adapter does not match the base model:")
    want = [f"  tensor 'x{i:02d}' is not a LoRA A/B weight" for i in range(12)]
    assert lines[1:13] == want
    assert lines[13] == "  ... and 2 more"
    assert lines[14].startswith("(entrenar reads the lora_A / lora_B weights")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"rank": 0}, "LoRAConfig.rank: must be >= 1, got 0"),
        ({"alpha": -1.0}, "LoRAConfig.alpha: must be > 0, got -1"),
        ({"dropout": 1.0}, "LoRAConfig.dropout: must be < 1, got 1"),
        ({"targets": ("q_proj", 3)}, "LoRAConfig.targets[1]: expected a string, got 3"),
        ({"targets": ("",)}, "LoRAConfig.targets[0]: must not be empty"),
        ({"targets": "q_proj("}, "LoRAConfig.targets: 'q_proj(' is not a valid regex"),
    ],
)
def test_lora_config_messages(kwargs, message):
    with pytest.raises(ConfigError, match=f"^{re.escape(message)}"):
        LoRAConfig(**kwargs)


def test_adapter_product_gradients_match_finite_differences_and_the_formula():
    # the adapter product's custom VJP (dBᵀ = hᵀ g, so XLA transposes the rank-r
    # factor, not the (tokens, out) cotangent) against finite differences and against
    # autodiff of the plain einsum
    from entrenar.autograd import check_gradient
    from entrenar.nn import linear

    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 3, 5))
    w, a, b = (rng.standard_normal(s) for s in ((4, 5), (2, 5), (4, 2)))

    def lora_linear(x, a, b):
        return linear(x, LoRAWeight(w, a, b, alpha=4.0, rank=2))

    res = check_gradient(lora_linear, [x, a, b], api="jax", raise_on_failure=True)
    assert res.passed
    xs, as_, bs = (jnp.asarray(v, jnp.float32) for v in (x, a, b))

    def plain(x, a, b):
        return x @ jnp.asarray(w, jnp.float32).T + 2.0 * (x @ a.T) @ b.T

    r = jnp.asarray(rng.standard_normal((2, 3, 4)), jnp.float32)
    got = jax.grad(lambda *p: jnp.sum(lora_linear(*p) * r), (0, 1, 2))(xs, as_, bs)
    want = jax.grad(lambda *p: jnp.sum(plain(*p) * r), (0, 1, 2))(xs, as_, bs)
    for g, h in zip(got, want, strict=True):
        np.testing.assert_allclose(g, h, rtol=1e-5, atol=1e-6)
