"""Per-layer ranks (PEFT's rank_pattern / alpha_pattern by layer) against real PEFT.

The layers of a stacked weight hold A, B padded with zeros to the stack's largest
rank; PEFT holds each layer at its own rank. Logits, gradients, trainable counts,
saved files and training steps must agree.
"""

import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from entrenar import lora, nn
from entrenar import optim as eo
from entrenar.errors import ConfigError
from entrenar.lora import LoRAConfig, LoRAWeight

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
st_numpy = pytest.importorskip("safetensors.numpy")

pytestmark = pytest.mark.usefixtures("quick_compiles")
T = 12
TOL = 1e-5


def is_node(x):
    return isinstance(x, LoRAWeight)


def family(name):
    """``(config, params, hf_dict, state)`` of a family's tiny model (random)."""
    arch = nn.architecture(name)
    config = arch.tiny()
    hf_dict = arch.to_hf(config)
    model = hf_model(hf_dict)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    params = nn.from_hf_names({k: v.numpy() for k, v in state.items()}, config)
    return config, params, hf_dict, state


def hf_model(hf_dict, state=None):
    cfg = transformers.AutoConfig.for_model(**hf_dict)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).float().eval()
    if state is not None:
        model.load_state_dict(state)
    return model


def tokens(vocab):
    return np.random.default_rng(0).integers(0, vocab, size=(2, T)).astype(np.int64)


def torch_logits(model, toks):
    with torch.no_grad():
        return model(torch.from_numpy(toks)).logits.numpy()


PATTERNS = [
    # literal module names, as a user writes them
    {"rank_pattern": {"model.layers.0.self_attn.q_proj": 6, "v_proj": 2},
     "alpha_pattern": {"model.layers.1.self_attn.q_proj": 3}},
    # regex keys, per layer and per module type, with rsLoRA
    {"rank_pattern": {r"layers\.1\.mlp\.(up|down)_proj": 5, r".*\.0\.self_attn\..*": 1},
     "alpha_pattern": {r"layers\.0\..*": 2.5}, "use_rslora": True},
    # DoRA with per-layer ranks
    {"rank_pattern": {"model.layers.1.self_attn.o_proj": 7}, "use_dora": True},
]  # fmt: skip


def peft_model_with(hf_dict, state, settings):
    """A PEFT model of ``settings`` with random non-zero A, B (and magnitudes)."""
    model = peft.get_peft_model(
        hf_model(hf_dict, state),
        peft.LoraConfig(
            r=3, lora_alpha=4, target_modules="all-linear", init_lora_weights=False,
            **settings,
        ),
    ).eval()  # fmt: skip
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_" in name:
                p.add_(torch.randn(p.shape, generator=gen) * 0.1)
    return model


@pytest.mark.parametrize("name", ["llama", "qwen2"])
@pytest.mark.parametrize("settings", PATTERNS, ids=["literal", "regex", "dora"])
def test_per_layer_ranks_load_save_and_load_in_peft(name, settings, tmp_path):
    """A PEFT file with ranks by layer loads, saves back, and loads in PEFT.

    Loaded padded, it gives PEFT's logits, and saves back the same tensors, each
    layer at its own rank; PEFT loads the file written here with the same ranks,
    scales and logits. Refused before: 'its layers have ranks [...]'.
    """
    config, params, hf_dict, state = family(name)
    theirs = peft_model_with(hf_dict, state, settings)
    theirs.save_pretrained(str(tmp_path / "peft"))
    toks = tokens(config.vocab_size)
    want = torch_logits(theirs, toks)

    loaded = lora.load_adapter(tmp_path / "peft", params)
    nodes = [
        x for x in jax.tree_util.tree_leaves(loaded, is_leaf=is_node) if is_node(x)
    ]
    assert any(x.per_layer for x in nodes)  # some stack has ranks by layer
    got = np.asarray(config.apply(loaded, jnp.asarray(toks)))
    np.testing.assert_allclose(got, want, atol=TOL, rtol=TOL)
    folded = np.asarray(config.apply(lora.fold(loaded), jnp.asarray(toks)))
    np.testing.assert_allclose(folded, want, atol=TOL, rtol=TOL)

    lora.save_adapter(loaded, tmp_path / "back")
    file = "adapter_model.safetensors"
    a = st_numpy.load_file(str(tmp_path / "peft" / file))
    b = st_numpy.load_file(str(tmp_path / "back" / file))
    assert sorted(a) == sorted(b)
    for key, x in a.items():
        np.testing.assert_array_equal(b[key], x, err_msg=key)  # shapes: real ranks

    again = peft.PeftModel.from_pretrained(
        hf_model(hf_dict, state), str(tmp_path / "back")
    ).eval()
    np.testing.assert_allclose(torch_logits(again, toks), want, atol=TOL, rtol=TOL)
    # with the config PEFT's file was made with: its patterns, written as PEFT did
    peft_cfg = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    made_with = LoRAConfig(
        rank=peft_cfg["r"], alpha=peft_cfg["lora_alpha"], targets=("all-linear",),
        rank_pattern=peft_cfg["rank_pattern"], alpha_pattern=peft_cfg["alpha_pattern"],
        rslora=peft_cfg["use_rslora"], use_dora=peft_cfg["use_dora"],
    )  # fmt: skip
    lora.save_adapter(loaded, tmp_path / "same", config=made_with)
    ours_cfg = json.loads((tmp_path / "same" / "adapter_config.json").read_text())
    for key in ("r", "lora_alpha", "rank_pattern", "alpha_pattern"):
        assert ours_cfg[key] == peft_cfg[key], key
    c = st_numpy.load_file(str(tmp_path / "same" / file))
    assert all(np.array_equal(c[k], x) for k, x in a.items()) and c.keys() == a.keys()

    layers = peft.tuners.lora.LoraLayer
    seen = {
        n: (m.r, m.scaling) for n, m in again.named_modules() if isinstance(m, layers)
    }
    want_rs = {
        n: (m.r, m.scaling) for n, m in theirs.named_modules() if isinstance(m, layers)
    }
    assert seen == want_rs  # each module's rank and scale, as PEFT resolved them


def test_trainable_count_and_gradients_equal_peft(tmp_path):
    """LoRAConfig(rank_pattern, alpha_pattern): PEFT's count and gradients.

    The trainable count of the real ranks (no padding), A / B gradients per layer
    equal to PEFT's, and exactly zero gradients on the padding.
    """
    config, params, hf_dict, state = family("llama")
    patterns = PATTERNS[0]
    cfg = LoRAConfig(
        rank=3, alpha=4, targets=("all-linear",),
        rank_pattern=patterns["rank_pattern"], alpha_pattern=patterns["alpha_pattern"],
    )  # fmt: skip
    lp = lora.apply(params, cfg, key=jax.random.key(3))
    rng = np.random.default_rng(5)

    def fill(x):  # B non-zero within each layer's rank
        if is_node(x):
            b = jnp.asarray(rng.normal(size=x.b.shape).astype(np.float32) * 0.1)
            return lora.with_layer_ranks(
                x.replace(b=b), x.real_ranks(), x.real_alphas()
            )
        return x

    lp = jax.tree_util.tree_map(fill, lp, is_leaf=is_node)
    lora.save_adapter(lp, tmp_path)
    model = peft.PeftModel.from_pretrained(
        hf_model(hf_dict, state), str(tmp_path), is_trainable=True
    )
    n_peft = sum(p.numel() for p in model.parameters() if p.requires_grad)
    trainable, frozen = lora.split(lp)
    assert lora.trainable_report(lp).trainable_params == n_peft
    assert lora.trainable_report(trainable).trainable_params == n_peft

    toks = tokens(config.vocab_size)

    def loss(t):
        logits = config.apply(lora.combine(t, frozen), jnp.asarray(toks))
        return jnp.mean(logits**2)

    grads = nn.to_hf_names(jax.grad(loss)(trainable))
    model.zero_grad()
    (model(torch.from_numpy(toks)).logits ** 2).mean().backward()
    checked = 0
    for pname, p in model.named_parameters():
        if ".lora_" not in pname:
            continue
        module, _, rest = pname.removeprefix("base_model.model.").partition(".lora_")
        g = grads[f"{module}.weight"]
        g = np.asarray(g.a if rest.startswith("A") else g.b)
        r = p.shape[0] if rest.startswith("A") else p.shape[1]
        real = g[:r] if rest.startswith("A") else g[:, :r]
        pad = g[r:] if rest.startswith("A") else g[:, r:]
        np.testing.assert_allclose(real, p.grad.numpy(), atol=1e-6, rtol=1e-4)
        assert not pad.any(), pname  # exactly zero on the padding
        checked += 1
    assert checked == sum(1 for n, _ in model.named_parameters() if ".lora_" in n)
    assert checked == 2 * 7 * config.num_layers  # A and B of 7 linears per layer


def test_a_new_adapter_is_the_file_peft_writes_for_the_same_config(tmp_path):
    """LoRAConfig(rank_pattern, alpha_pattern) vs peft.LoraConfig with the same keys.

    The same tensor names and shapes (each layer at its own rank), and with
    ``config=`` the same r, lora_alpha and patterns in adapter_config.json.
    """
    _, params, hf_dict, state = family("llama")
    patterns = PATTERNS[1]
    model = peft.get_peft_model(
        hf_model(hf_dict, state),
        peft.LoraConfig(r=3, lora_alpha=4, target_modules="all-linear", **patterns),
    )
    model.save_pretrained(str(tmp_path / "peft"))
    cfg = LoRAConfig(
        rank=3, alpha=4, targets=("all-linear",), rslora=patterns["use_rslora"],
        rank_pattern=patterns["rank_pattern"], alpha_pattern=patterns["alpha_pattern"],
    )  # fmt: skip
    lp = lora.apply(params, cfg, key=jax.random.key(0))
    lp = jax.tree_util.tree_map(  # B != 0 (a zero adapter is not saved)
        lambda x: x.replace(b=x.b + 1.0) if is_node(x) else x, lp, is_leaf=is_node
    )
    lp = jax.tree_util.tree_map(  # zero the padding again
        lambda x: lora.with_layer_ranks(x, x.real_ranks(), x.real_alphas())
        if is_node(x) else x, lp, is_leaf=is_node,
    )  # fmt: skip
    lora.save_adapter(lp, tmp_path / "ours", config=cfg)
    file = "adapter_model.safetensors"
    theirs = st_numpy.load_file(str(tmp_path / "peft" / file))
    ours = st_numpy.load_file(str(tmp_path / "ours" / file))
    assert {k: v.shape for k, v in ours.items()} == {
        k: v.shape for k, v in theirs.items()
    }
    want = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    got = json.loads((tmp_path / "ours" / "adapter_config.json").read_text())
    for key in ("r", "lora_alpha", "rank_pattern", "alpha_pattern", "use_rslora"):
        assert got[key] == want[key], key


def test_module_type_patterns_need_no_padding():
    """q_proj 6, v_proj 2 (by module type): plain nodes of those ranks."""
    _, params, _, _ = family("llama")
    cfg = LoRAConfig(
        rank=3, targets=("q_proj", "v_proj"),
        rank_pattern={"q_proj": 6, "v_proj": 2}, alpha_pattern={"v_proj": 5},
    )  # fmt: skip
    lp = lora.apply(params, cfg, key=jax.random.key(0))
    attn = lp["model"]["layers"]["self_attn"]
    q, v = attn["q_proj"]["weight"], attn["v_proj"]["weight"]
    assert (q.rank, q.alpha, q.per_layer) == (6, 16.0, False)
    assert (v.rank, v.alpha, v.per_layer) == (2, 5.0, False)


def test_padding_stays_zero_through_training_with_every_optimizer():
    """Zero gradients keep the padding exactly zero in training.

    AdamW with weight decay after global-norm clipping, SGD with momentum; dropout
    and DoRA on; checked on the trained trees.
    """
    config, params, _, _ = family("llama")
    cfg = LoRAConfig(
        rank=2, alpha=4, targets=("all-linear",), dropout=0.1, use_dora=True,
        rank_pattern={r"layers\.1\..*": 5}, alpha_pattern={r"layers\.0\.mlp\..*": 9},
    )  # fmt: skip
    lp = lora.apply(params, cfg, key=jax.random.key(3))
    trainable, frozen = lora.split(lp)
    toks = jnp.asarray(tokens(config.vocab_size))
    opts = [
        eo.chain(eo.clip_by_global_norm(0.1), eo.adamw(1e-2, weight_decay=0.5)),
        eo.sgd(1e-2, momentum=0.9),
    ]
    for opt in opts:
        t, state = trainable, opt.init(trainable)
        for step in range(3):
            f = lora.with_dropout_keys(frozen, key=jax.random.key(step))
            loss = lambda t, f=f: jnp.mean(config.apply(lora.combine(t, f), toks) ** 2)  # noqa: E731
            g = jax.grad(loss)(t)
            updates, state = opt.update(g, state, t)
            t = eo.apply_updates(t, updates)
        for x in jax.tree_util.tree_leaves(t, is_leaf=is_node):
            if not is_node(x) or not x.per_layer:
                continue
            for i, r in enumerate(x.real_ranks()):
                assert not np.asarray(x.a[i, r:]).any()
                assert not np.asarray(x.b[i, :, r:]).any()
                assert np.asarray(x.b[i, :, :r]).any()  # the real part trained


@pytest.mark.parametrize(
    ("patterns", "message"),
    [
        ({"rank_pattern": {"q_proj": 0}}, r"rank_pattern\['q_proj'\] = 0 must"),
        ({"rank_pattern": {"q_proj": 2.5}}, r"rank_pattern\['q_proj'\] = 2.5 must"),
        ({"alpha_pattern": {"q_proj": -1}}, r"alpha_pattern\['q_proj'\] = -1 must"),
        ({"rank_pattern": {"(q": 4}}, r"rank_pattern: .*not a valid regex"),
        ({"rank_pattern": ["q_proj"]}, r"rank_pattern"),
    ],
)
def test_bad_patterns_are_named(patterns, message):
    with pytest.raises(ConfigError, match=message):
        LoRAConfig.from_dict({"rank": 4, **patterns})


def test_yaml_patterns_reach_the_run(tmp_path):
    """lora.rank_pattern / alpha_pattern in a run's YAML: validated and applied."""
    from entrenar.config import load_config

    yaml_text = """
model: {architecture: llama, config: {vocab_size: 64, hidden_size: 32,
        intermediate_size: 48, num_layers: 2, num_heads: 4, num_kv_heads: 2}}
data: {train: t.jsonl}
lora:
  rank: 4
  targets: [q_proj, v_proj]
  rank_pattern: {"model.layers.0.self_attn.q_proj": 8}
  alpha_pattern: {'layers\\.1\\..*': 2}
"""
    (tmp_path / "t.jsonl").write_text(json.dumps({"text": "a b"}) + "\n")
    (tmp_path / "run.yaml").write_text(yaml_text)
    spec = load_config(tmp_path / "run.yaml")
    assert spec.lora.rank_pattern == {"model.layers.0.self_attn.q_proj": 8}
    assert spec.lora.alpha_pattern == {r"layers\.1\..*": 2}
    params = nn.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2,
        num_heads=4, num_kv_heads=2,
    ).init(jax.random.key(0))  # fmt: skip
    lp = lora.apply(params, spec.lora, key=jax.random.key(0))
    q = lp["model"]["layers"]["self_attn"]["q_proj"]["weight"]
    assert q.layer_ranks == (8, 4) and q.layer_alphas == (16.0, 2.0)
    assert re.search("rank_pattern", json.dumps(spec.lora.to_dict()))


def test_unfold_of_a_trainable_half_with_ranks_by_layer_gives_the_base_back():
    """unfold(fold(p), trainable half): the base, and p's forward.

    Before, the unfolded node had no layer_scale (the trainable half holds none),
    and its forward failed under lax.scan broadcasting all layers' scales.
    """
    config, params, _, _ = family("llama")
    cfg = LoRAConfig(rank=3, targets=("all-linear",), rank_pattern={r".*\.1\..*": 5})
    lp = lora.apply(params, cfg, key=jax.random.key(3))
    lp = jax.tree_util.tree_map(  # B != 0 within each layer's rank
        lambda x: lora.with_layer_ranks(x.replace(b=x.b + 0.1), x.real_ranks(),
                                        x.real_alphas()) if is_node(x) else x,
        lp, is_leaf=is_node,
    )  # fmt: skip
    trainable, _ = lora.split(lp)
    back = lora.unfold(lora.fold(lp), trainable)
    toks = jnp.asarray(tokens(config.vocab_size))
    np.testing.assert_allclose(
        config.apply(back, toks), config.apply(lp, toks), atol=1e-5, rtol=1e-5
    )
    w = back["model"]["layers"]["mlp"]["up_proj"]["weight"]
    want = params["model"]["layers"]["mlp"]["up_proj"]["weight"]
    np.testing.assert_allclose(w.base, want, atol=1e-6)


@settings(max_examples=15, deadline=None)
@given(
    ranks=st.lists(st.integers(1, 6), min_size=1, max_size=4),
    alphas=st.lists(st.sampled_from([1.0, 2.5, 8.0]), min_size=4, max_size=4),
    rslora=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_padded_stack_is_each_layers_own_product(ranks, alphas, rslora, seed):
    """Under lax.scan a padded stack computes x Wᵢᵀ + sᵢ (x Aᵢᵀ) Bᵢᵀ at rank rᵢ.

    Reference: numpy on the unpadded factors (float64), sᵢ = αᵢ/rᵢ or αᵢ/√rᵢ.
    """
    n, out, fan_in = len(ranks), 5, 7
    alphas = alphas[:n]
    rng = np.random.default_rng(seed)
    big = max(ranks)
    w = rng.normal(size=(n, out, fan_in)).astype(np.float32)
    a = rng.normal(size=(n, big, fan_in)).astype(np.float32)
    b = rng.normal(size=(n, out, big)).astype(np.float32)
    x = rng.normal(size=(3, fan_in)).astype(np.float32)
    node = LoRAWeight(jnp.asarray(w), jnp.asarray(a), jnp.asarray(b), 1.0, big,
                      rslora=rslora)  # fmt: skip
    node = lora.with_layer_ranks(node, tuple(ranks), tuple(alphas))

    def layer(carry, wi):
        return carry, nn.linear(jnp.asarray(x), wi)

    got = np.asarray(jax.lax.scan(layer, 0, node)[1])  # (n, 3, out)
    for i, (r, alpha) in enumerate(zip(ranks, alphas)):
        s = alpha / (np.sqrt(r) if rslora else r)
        ai, bi = a[i, :r].astype(np.float64), b[i, :, :r].astype(np.float64)
        want = x @ w[i].T.astype(np.float64) + s * (x @ ai.T) @ bi.T
        np.testing.assert_allclose(got[i], want, rtol=1e-4, atol=1e-4)
