"""Conformance of every registered decoder family against transformers and PEFT.

For each language-model entry of the registry with a ``tiny`` config (every feature
of its family switched on), the transformers model of ``arch.to_hf(tiny)`` is built
with random weights (float32, eager attention) and its state dict taken into
entrenar with `from_hf_names`. Then: (1) equal logits on a left-padded batch longer
than the sliding windows; (2) equal logits under KV-cached generation; (3) equal
gradients of a LoRA loss on every linear layer, against PEFT; (4) an adapter written
by `entrenar.lora.save_adapter` loads with ``PeftModel.from_pretrained`` and gives
the same logits; (5) the same for DoRA, logits and gradients. Each model compiles
once per check (module-scoped fixtures).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from entrenar import lora, nn
from entrenar.errors import ConfigError, FormatError, UnsupportedError
from entrenar.lora import LoRAWeight

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

T = 12  # longer than every tiny sliding window (4)
TOL = 1e-4
KNOWN_GAPS = {"gpt2": "GPT-2 registers no tiny/from_hf/to_hf yet (entrenar/nn/gpt2.py)"}
# PEFT 0.21 reads gate_proj / up_proj / down_proj targets of a DeepSeek or GLM-4.5
# model as its fused experts' (transformers 5's conversion): the dense and shared
# MLPs get no adapter there, so the family's adapters go on its attention projections
TARGETS = {
    "deepseek_v3": [
        "q_a_proj",
        "q_b_proj",
        "kv_a_proj_with_mqa",
        "kv_b_proj",
        "o_proj",
    ],
    "deepseek_v2": ["q_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"],
    "glm4_moe": ["q_proj", "k_proj", "v_proj", "o_proj"],  # the same conversion
}
# This module's programs (every family's tiny model, float32, checked against torch
# at 1e-4) compile with XLA:CPU's elemental IR emitter for loop fusions instead of
# the fusion emitters: 40-60% less compile time (QUALITY.md, "Where the suite's time
# goes"). Per program, unlike XLA_FLAGS: every other test compiles as users do.
QUICK = {"xla_cpu_use_fusion_emitters": False}
LANGUAGE_MODELS = [a for a in nn.architectures() if a.hf_class is not None]
FAMILIES = [a for a in LANGUAGE_MODELS if a.name not in KNOWN_GAPS]


def test_every_language_model_entry_is_checkable():
    """A registered language model without a conformance handle fails here."""
    for arch in LANGUAGE_MODELS:
        missing = [
            k for k in ("tiny", "from_hf", "to_hf", "hf_class")
            if getattr(arch, k) is None
        ]  # fmt: skip
        if arch.name in KNOWN_GAPS:
            assert missing, f"{arch.name} is complete: drop it from KNOWN_GAPS"
            continue
        assert not missing, f"architecture {arch.name!r} lacks {missing}"
        tiny = arch.tiny()
        assert arch.from_hf(arch.to_hf(tiny)) == tiny
        assert arch.to_hf(tiny)["architectures"] == [arch.hf_class]
        # transformers 5 writes rope_parameters (per layer type for Gemma 3)
        written = transformers.AutoConfig.for_model(**arch.to_hf(tiny)).to_dict()
        assert arch.from_hf(written) == tiny


# --------------------------------------------------------------------- fixtures
pytestmark = pytest.mark.usefixtures("quick_compiles")


def _hf_model(config_dict, state=None):
    """A float32 eager transformers model of ``config_dict`` (random or ``state``)."""
    hf_cfg = transformers.AutoConfig.for_model(**config_dict)
    hf_cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(hf_cfg).float().eval()
    if state is None:
        gen = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for p in model.parameters():  # biases and norm gains away from 0 / 1
                p.add_(0.1 * torch.randn(p.shape, generator=gen))
    else:
        model.load_state_dict(state)
    return model


@pytest.fixture(scope="module", params=[a.name for a in FAMILIES])
def family(request):
    """``(config, params, hf_dict, state)`` of one family's tiny model."""
    arch = nn.architecture(request.param)
    config = arch.tiny()
    hf_dict = arch.to_hf(config)
    model = _hf_model(hf_dict)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    flat = {k: v.numpy() for k, v in state.items()}
    if arch.from_hf_tensors is not None:  # MoE: transformers' fused experts
        flat = arch.from_hf_tensors(flat, config)
    params = nn.from_hf_names(flat, config)
    return config, params, hf_dict, state


def _batch(vocab):
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, vocab, size=(2, T)).astype(np.int64)
    mask = np.ones((2, T), bool)
    mask[1, :3] = False  # left padding
    return tokens, mask


def _torch_logits(model, tokens, mask=None):
    kw = {} if mask is None else {"attention_mask": torch.from_numpy(mask.astype(int))}
    with torch.no_grad():
        return model(torch.from_numpy(tokens), **kw).logits.numpy()


# ----------------------------------------------------------------------- checks
def test_logits_equal_transformers(family):
    config, params, hf_dict, state = family
    tokens, mask = _batch(config.vocab_size)
    want = _torch_logits(_hf_model(hf_dict, state), tokens, mask)
    apply = jax.jit(config.apply, compiler_options=QUICK)
    got = apply(params, jnp.asarray(tokens), mask=jnp.asarray(mask))
    got = np.asarray(got)
    assert np.abs(want[mask]).max() > 0.5  # not a degenerate model
    np.testing.assert_allclose(got[mask], want[mask], atol=TOL, rtol=TOL)


def test_cached_generation_equals_transformers(family):
    config, params, hf_dict, state = family
    tokens, _ = _batch(config.vocab_size)
    model = _hf_model(hf_dict, state)  # fresh: dynamic rope keeps no state
    cache_hf = transformers.DynamicCache(config=model.config)
    step = jax.jit(config.apply_cached, compiler_options=QUICK)
    cache = config.init_cache(2, T)
    got, want = [], []
    for t0, t1 in [(0, 5), *((t, t + 1) for t in range(5, T))]:  # prefill, steps
        with torch.no_grad():
            out = model(torch.from_numpy(tokens[:, t0:t1]), cache=cache_hf)
        cache_hf = out.cache
        want.append(out.logits.numpy())
        logits, cache = step(params, jnp.asarray(tokens[:, t0:t1]), cache)
        got.append(np.asarray(logits))
    np.testing.assert_allclose(
        np.concatenate(got, 1), np.concatenate(want, 1), atol=TOL, rtol=TOL
    )


@pytest.fixture(scope="module")
def adapted(family, tmp_path_factory):
    """A LoRA tree on every linear layer (B non-zero) and PEFT's twin of it."""
    config, params, hf_dict, state = family
    targets = TARGETS.get(config.architecture, "all-linear")
    cfg = lora.LoRAConfig(rank=2, alpha=4.0, targets=targets)
    lp = lora.apply(params, cfg, key=jax.random.key(3))
    rng = np.random.default_rng(5)

    def fill(x):
        if isinstance(x, LoRAWeight):
            b = (rng.normal(size=x.b.shape) * 0.1).astype(np.float32)
            return x.replace(b=jnp.asarray(b))
        return x

    lp = jax.tree_util.tree_map(fill, lp, is_leaf=lambda x: isinstance(x, LoRAWeight))
    folder = tmp_path_factory.mktemp("adapter")
    lora.save_adapter(lp, folder, base_model_name_or_path="tiny")
    model = _hf_model(hf_dict, state)
    peft_model = peft.PeftModel.from_pretrained(model, str(folder), is_trainable=True)
    tokens, mask = _batch(config.vocab_size)
    trainable, frozen = lora.split(lp)
    grad_fn = _loss_grad()
    grads, logits = grad_fn(config, trainable, frozen, jnp.asarray(tokens), mask)
    return config, grads, np.asarray(logits), peft_model.eval()


def _loss_grad():
    """The LoRA loss's gradient in the trainable tree, and the logits (aux)."""
    grad = jax.grad(_loss_jax, argnums=1, has_aux=True)
    return jax.jit(grad, static_argnums=0, compiler_options=QUICK)


def _loss_jax(config, trainable, frozen, tokens, mask):
    logits = config.apply(lora.combine(trainable, frozen), tokens, mask=mask)
    logp = jax.nn.log_softmax(logits[:, :-1], axis=-1)  # (B, T-1, V)
    picked = jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]
    w = (mask[:, 1:] & mask[:, :-1]).astype(logp.dtype)  # no padded position
    return -jnp.sum(picked * w) / jnp.sum(w), logits


def test_peft_adapter_gives_the_same_logits(adapted):
    config, _, got, peft_model = adapted
    tokens, mask = _batch(config.vocab_size)
    assert {n for n, _ in peft_model.named_modules() if n.endswith(".lora_A")}
    want = _torch_logits(peft_model, tokens, mask)
    np.testing.assert_allclose(got[mask], want[mask], atol=TOL, rtol=TOL)


def test_lora_gradients_equal_peft(adapted):
    config, grads, _, peft_model = adapted
    tokens, mask = _batch(config.vocab_size)
    peft_model.zero_grad()
    logits = peft_model(
        torch.from_numpy(tokens), attention_mask=torch.from_numpy(mask.astype(int))
    ).logits
    logp = torch.log_softmax(logits[:, :-1], -1)
    picked = logp.gather(-1, torch.from_numpy(tokens[:, 1:, None]))[..., 0]
    w = torch.from_numpy((mask[:, 1:] & mask[:, :-1]).astype(np.float32))
    (-(picked * w).sum() / w.sum()).backward()
    ours = nn.to_hf_names(grads)
    checked = 0
    for name, p in peft_model.named_parameters():
        if ".lora_" not in name:
            continue
        module, _, rest = name.removeprefix("base_model.model.").partition(".lora_")
        node = ours[f"{module}.weight"]
        g = node.a if rest.startswith("A") else node.b
        np.testing.assert_allclose(
            np.asarray(g), p.grad.numpy(), atol=TOL, rtol=1e-3, err_msg=name
        )
        checked += 1
    adapted = [k for k, v in ours.items() if isinstance(v, LoRAWeight)]
    assert checked == 2 * len(adapted)  # every adapted weight, A and B


def test_dora_logits_and_gradients_equal_peft(family, tmp_path):
    """(5) DoRA on every linear layer (use_dora): logits and A, B, m gradients.

    The families' biases (Qwen2's q/k/v) stay outside DoRA's rescaling, as in PEFT.
    """
    config, params, hf_dict, state = family
    targets = TARGETS.get(config.architecture, "all-linear")
    cfg = lora.LoRAConfig(rank=2, alpha=4.0, targets=targets, use_dora=True)
    lp = lora.apply(params, cfg, key=jax.random.key(3))
    rng = np.random.default_rng(5)

    def fill(x):
        if isinstance(x, LoRAWeight):
            b = (rng.normal(size=x.b.shape) * 0.1).astype(np.float32)
            m = np.asarray(x.magnitude) * rng.uniform(0.7, 1.3, x.magnitude.shape)
            return x.replace(b=jnp.asarray(b), magnitude=jnp.asarray(m, jnp.float32))
        return x

    lp = jax.tree_util.tree_map(fill, lp, is_leaf=lambda x: isinstance(x, LoRAWeight))
    lora.save_adapter(lp, tmp_path)
    peft_model = peft.PeftModel.from_pretrained(
        _hf_model(hf_dict, state), str(tmp_path), is_trainable=True
    ).eval()
    tokens, mask = _batch(config.vocab_size)
    trainable, frozen = lora.split(lp)
    grad_fn = _loss_grad()
    grads, logits = grad_fn(config, trainable, frozen, jnp.asarray(tokens), mask)
    out = peft_model(
        torch.from_numpy(tokens), attention_mask=torch.from_numpy(mask.astype(int))
    ).logits
    np.testing.assert_allclose(
        np.asarray(logits)[mask], out.detach().numpy()[mask], atol=TOL, rtol=TOL
    )
    logp = torch.log_softmax(out[:, :-1], -1)
    picked = logp.gather(-1, torch.from_numpy(tokens[:, 1:, None]))[..., 0]
    w = torch.from_numpy((mask[:, 1:] & mask[:, :-1]).astype(np.float32))
    (-(picked * w).sum() / w.sum()).backward()
    ours = nn.to_hf_names(grads)
    checked = 0
    for name, p in peft_model.named_parameters():
        if ".lora_" not in name:
            continue
        module, _, rest = name.removeprefix("base_model.model.").partition(".lora_")
        node = ours[f"{module}.weight"]
        g = {"A": node.a, "B": node.b, "m": node.magnitude}[rest[0]]
        np.testing.assert_allclose(
            np.asarray(g), p.grad.numpy(), atol=TOL, rtol=1e-3, err_msg=name
        )
        checked += 1
    adapted = [k for k, v in ours.items() if isinstance(v, LoRAWeight)]
    assert checked == 3 * len(adapted)  # every adapted weight: A, B and m


# ------------------------------------------------------------------ bad input
def test_unknown_rope_type_names_the_field():
    hf = nn.architecture("llama").to_hf(nn.architecture("llama").tiny())
    hf["rope_scaling"] = {"rope_type": "mrope", "factor": 2.0}
    with pytest.raises(UnsupportedError, match="rope_type 'mrope'"):
        nn.LlamaConfig.from_hf_config(hf)


def test_unknown_model_type_is_named():
    with pytest.raises(UnsupportedError, match="model_type 'falcon'"):
        nn.LlamaConfig.from_hf_config({"model_type": "falcon"})


def test_switch_without_config_json_form_is_refused():
    tiny = nn.architecture("llama").tiny()
    with pytest.raises(UnsupportedError, match="qk_norm"):
        nn.architecture("llama").to_hf(dataclasses.replace(tiny, qk_norm=True))


def test_bad_switches_are_config_errors():
    base = nn.LlamaConfig(hidden_size=32, num_heads=4, num_kv_heads=4, num_layers=2)
    with pytest.raises(ConfigError, match="unknown architecture 'falcon'"):
        dataclasses.replace(base, architecture="falcon")
    with pytest.raises(ConfigError, match="not a LlamaConfig family"):
        dataclasses.replace(base, architecture="gpt2")
    with pytest.raises(ConfigError, match="layer_types"):
        dataclasses.replace(base, layer_types=("full_attention",))
    with pytest.raises(ConfigError, match="sliding_window"):
        dataclasses.replace(base, layer_types=("sliding_attention",) * 2)
    with pytest.raises(ConfigError, match="rope_original_max_position_embeddings"):
        dataclasses.replace(base, rope_type="llama3", rope_factor=8.0)
    with pytest.raises(ConfigError, match="rope_freq_divisors"):
        dataclasses.replace(base, rope_freq_divisors=(1.0, 2.0))
    with pytest.raises(ConfigError, match="attention_multiplier and query_pre"):
        dataclasses.replace(base, attention_multiplier=0.1, query_pre_attn_scalar=8.0)
    with pytest.raises(ConfigError, match="logits_scaling must be > 0"):
        dataclasses.replace(base, logits_scaling=0.0)
    with pytest.raises(ConfigError, match="qk_norm_whole needs qk_norm"):
        dataclasses.replace(base, qk_norm_whole=True)
    with pytest.raises(ConfigError, match=r"post_norms .* exclude"):
        dataclasses.replace(base, post_norms=True, sandwich_norms=True)


def test_gemma_legacy_gelu_and_missing_head_dim_read_as_transformers():
    """Gemma 1's legacy ``hidden_act: gelu`` and a missing ``head_dim``.

    transformers reads them as the tanh GELU and 256 (not D / H).
    """
    arch = nn.architecture("gemma")
    hf = {**arch.to_hf(arch.tiny()), "hidden_act": "gelu"}
    del hf["head_dim"]
    want = transformers.AutoConfig.for_model(**hf)
    got = arch.from_hf(hf)
    assert (got.hd, got.hidden_act) == (want.head_dim, want.hidden_act)
    assert got.hd == 256 and got.hidden_act == "gelu_pytorch_tanh"
    with pytest.raises(UnsupportedError, match="hidden_act 'relu'"):
        arch.from_hf({**hf, "hidden_act": "relu"})
    with pytest.raises(UnsupportedError, match="sandwich_norms"):
        arch.to_hf(dataclasses.replace(arch.tiny(), sandwich_norms=True))


@pytest.mark.parametrize("interval", [1, 2, 3, 4])
@pytest.mark.parametrize("window", [None, 4])
def test_smollm3_nope_and_sliding_layers_follow_transformers_rule(interval, window):
    """SmolLM3's interval and ``use_sliding_window`` without explicit lists.

    The NoPE and sliding layers are those transformers' SmolLM3Config derives.
    """
    arch = nn.architecture("smollm3")
    seven = dataclasses.replace(
        arch.tiny(), num_layers=7, layer_types=None, nope_layers=None,
        sliding_window=window,
    )  # fmt: skip
    hf = arch.to_hf(seven)
    for key in ("no_rope_layers", "layer_types"):
        del hf[key]
    hf["no_rope_layer_interval"] = interval
    want = transformers.AutoConfig.for_model(**hf)
    got = arch.from_hf(hf)
    nope = got.nope_layers or (False,) * 7
    assert [int(not x) for x in nope] == want.no_rope_layers
    slides = [t == "sliding_attention" for t in got.layer_types or ("",) * 7]
    assert slides == [t == "sliding_attention" for t in want.layer_types]
    assert got.sliding_window == (window if want.use_sliding_window else None)


def test_smollm3_sliding_layer_types_slide_without_use_sliding_window():
    """Sliding layer_types slide in transformers whatever use_sliding_window says.

    Eager: 0.0 apart from the sliding model, 0.1 from the full one; before,
    entrenar read such a file as all full attention.
    """
    arch = nn.architecture("smollm3")
    config = arch.tiny()
    hf = {**arch.to_hf(config), "use_sliding_window": False}
    assert arch.from_hf(hf) == config
    model = _hf_model(hf)
    params = nn.from_hf_names(
        {k: v.detach().numpy() for k, v in model.state_dict().items()}, config
    )
    tokens, mask = _batch(config.vocab_size)
    want = _torch_logits(model, tokens, mask)
    got = np.asarray(config.apply(params, jnp.asarray(tokens), mask=jnp.asarray(mask)))
    np.testing.assert_allclose(got[mask], want[mask], atol=TOL, rtol=TOL)
    with pytest.raises(UnsupportedError, match="sliding_window is null"):
        arch.from_hf({**hf, "sliding_window": None})


def test_smollm3_bad_no_rope_layers_are_named():
    arch = nn.architecture("smollm3")
    hf = arch.to_hf(arch.tiny())
    with pytest.raises(FormatError, match="no_rope_layers must list 4 values"):
        arch.from_hf({**hf, "no_rope_layers": [1, 0]})
    with pytest.raises(ConfigError, match="nope_layers must be 4 booleans"):
        dataclasses.replace(arch.tiny(), nope_layers=(True,))


@pytest.mark.parametrize("layered", [False, True])
def test_olmo3_default_layers_and_rope_follow_transformers(layered):
    """OLMo 3 without ``layer_types``: transformers' layers, bases and scaling.

    Its rope as ``rope_theta`` + ``rope_scaling`` (old style) or per layer type.
    """
    arch = nn.architecture("olmo3")
    hf = arch.to_hf(dataclasses.replace(arch.tiny(), num_layers=6, layer_types=None))
    del hf["layer_types"]
    if not layered:
        full = hf.pop("rope_parameters")["full_attention"]
        hf["rope_theta"] = full.pop("rope_theta")
        hf["rope_scaling"] = full
    want = transformers.AutoConfig.for_model(**hf)
    got = arch.from_hf(hf)
    assert list(got.layer_types) == want.layer_types
    params = want.rope_parameters
    assert got.rope_theta == params["full_attention"]["rope_theta"]
    assert got.rope_local_theta == params["sliding_attention"]["rope_theta"]
    assert got.rope_type == params["full_attention"]["rope_type"] == "yarn"
    assert params["sliding_attention"]["rope_type"] == "default"
    with pytest.raises(UnsupportedError, match="sliding_window is null"):
        arch.from_hf({**hf, "sliding_window": None})
    full = {**hf, "sliding_window": None, "layer_types": ["full_attention"] * 6}
    assert arch.from_hf(full).sliding_window is None


@pytest.mark.parametrize("name", ["gemma2", "gemma3", "olmo3", "smollm3"])
def test_sliding_layers_with_a_null_window_are_refused_as_transformers_does(name):
    """One check (`decoder_config.sliding_from_hf`) for every family with layer types.

    transformers' sliding mask fails on such a file at the first forward pass
    (Gemma 2: ``TypeError``); entrenar's Gemma 2/3 read it as full attention in
    every layer, silently, before the check was shared.
    """
    arch = nn.architecture(name)
    hf = arch.to_hf(arch.tiny())
    assert "sliding_attention" in hf["layer_types"]
    with pytest.raises(
        UnsupportedError, match="sliding layers but sliding_window is null"
    ):
        arch.from_hf({**hf, "sliding_window": None})
    n = len(hf["layer_types"])
    full = {**hf, "sliding_window": None, "layer_types": ["full_attention"] * n}
    read = arch.from_hf(full)
    assert read.sliding_window is None and read.layer_types is None


def test_seed_oss_defaults_follow_transformers():
    """A Seed-OSS file without head_dim or bias keys reads as transformers does.

    transformers: ``head_dim`` 128 (not ``D / H``; null: ``D / H``), biased q/k/v,
    unbiased o_proj and MLP. The tiny model's o_proj has no bias: one written with
    ``attention_bias`` for o_proj too would have loaded transformers' state dict
    with an ``o_proj.bias`` entrenar's tree lacks (fails in the family fixture).
    """
    arch = nn.architecture("seed_oss")
    hf = arch.to_hf(arch.tiny())
    for key in ("head_dim", "attention_bias", "attention_out_bias", "mlp_bias"):
        del hf[key]
    want = transformers.AutoConfig.for_model(**hf)
    got = arch.from_hf(hf)
    assert got.hd == want.head_dim == 128
    assert (got.attention_bias, got.attention_out_bias, got.mlp_bias) == (
        want.attention_bias, want.attention_out_bias, want.mlp_bias,
    ) == (True, False, False)  # fmt: skip
    assert arch.from_hf({**hf, "head_dim": None}).hd == 8  # 32 / 4
    split = dataclasses.replace(arch.tiny(), attention_out_bias=True)
    assert arch.from_hf(arch.to_hf(split)) == split


BIASED = {"attention_bias": True, "attention_out_bias": True, "mlp_bias": True}


@pytest.mark.parametrize(
    ("name", "extra"),
    [("ernie4_5", {}), ("arcee", {}), ("arcee", BIASED), ("exaone4", {})],
)
def test_full_finetuning_gradients_equal_transformers(name, extra):
    """Every weight's gradient of the masked next-token loss, as torch's.

    For the families whose switches change the training graph beyond what the
    LoRA/DoRA checks reach (every weight, embeddings and norms too): ERNIE 4.5's
    interleaved rotary (the reordering's transpose), Arcee's ungated squared-ReLU
    MLP (with biases too: its tiny has none, as AFM-4.5B), EXAONE 4's post-norms
    with per-head q/k norms and NoPE global layers.
    """
    arch = nn.architecture(name)
    config = dataclasses.replace(arch.tiny(), **extra)
    model = _hf_model(arch.to_hf(config))
    flat = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    params = nn.from_hf_names(flat, config)
    tokens, mask = _batch(config.vocab_size)
    w = (mask[:, 1:] & mask[:, :-1]).astype(np.float32)

    def loss(p):
        logits = config.apply(p, jnp.asarray(tokens), mask=jnp.asarray(mask))
        logp = jax.nn.log_softmax(logits[:, :-1], axis=-1)
        picked = jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]
        return -jnp.sum(picked * w) / jnp.sum(w)

    ours = nn.to_hf_names(jax.jit(jax.grad(loss), compiler_options=QUICK)(params))
    logits = model(
        torch.from_numpy(tokens), attention_mask=torch.from_numpy(mask.astype(int))
    ).logits
    logp = torch.log_softmax(logits[:, :-1], -1)
    picked = logp.gather(-1, torch.from_numpy(tokens[:, 1:, None]))[..., 0]
    tw = torch.from_numpy(w)
    (-(picked * tw).sum() / tw.sum()).backward()
    grads = {k: p.grad.numpy() for k, p in model.named_parameters()}
    assert set(grads) == set(ours)
    for key, want in grads.items():
        np.testing.assert_allclose(
            np.asarray(ours[key]), want, atol=2e-6, rtol=1e-4, err_msg=key
        )


def test_ernie4_5_defaults_and_refusals():
    """A file without head_dim, use_bias, tie or rope keys reads as transformers'.

    transformers: ``head_dim`` 128, no biases, a tied head, θ 500000, ε 1e-5.
    """
    arch = nn.architecture("ernie4_5")
    hf = arch.to_hf(arch.tiny())
    for key in ("head_dim", "use_bias", "tie_word_embeddings", "rope_theta",
                "rope_scaling", "rms_norm_eps"):  # fmt: skip
        del hf[key]
    want = transformers.AutoConfig.for_model(**hf)
    got = arch.from_hf(hf)
    assert got.hd == want.head_dim == 128
    assert got.tie_word_embeddings == want.tie_word_embeddings is True
    assert got.rope_theta == want.rope_parameters["rope_theta"] == 500_000.0
    assert got.rms_norm_eps == want.rms_norm_eps == 1e-5
    assert not (got.attention_bias or got.attention_out_bias or got.mlp_bias)
    assert got.rope_interleave
    biased = arch.from_hf({**hf, "use_bias": True})  # every projection's, as torch's
    model = _hf_model(arch.to_hf(biased))
    ours = set(nn.to_hf_names(biased.init(jax.random.key(0))))
    assert set(model.state_dict()) - {"lm_head.weight"} == ours  # tied
    assert sum(k.endswith(".bias") for k in model.state_dict()) == 7 * 2
    tiny = arch.tiny()
    with pytest.raises(UnsupportedError, match="rope_interleave must be True"):
        arch.to_hf(dataclasses.replace(tiny, rope_interleave=False))
    with pytest.raises(UnsupportedError, match="one use_bias"):
        arch.to_hf(dataclasses.replace(tiny, mlp_bias=True))
    with pytest.raises(UnsupportedError, match="rope_interleave"):  # llama's file
        nn.architecture("llama").to_hf(
            dataclasses.replace(nn.architecture("llama").tiny(), rope_interleave=True)
        )
    with pytest.raises(UnsupportedError, match="ernie4_5_moe"):
        nn.LlamaConfig.from_hf_config({**hf, "model_type": "ernie4_5_moe"})


def test_arcee_refusals():
    """Other activations, a gated MLP, and the ungated MLP where it cannot be."""
    arch = nn.architecture("arcee")
    tiny = arch.tiny()
    hf = arch.to_hf(tiny)
    with pytest.raises(UnsupportedError, match="hidden_act 'silu'"):
        arch.from_hf({**hf, "hidden_act": "silu"})
    with pytest.raises(UnsupportedError, match="ungated_mlp must be True"):
        arch.to_hf(dataclasses.replace(tiny, ungated_mlp=False))
    with pytest.raises(UnsupportedError, match="ungated_mlp"):  # llama's file
        llama = dataclasses.replace(tiny, architecture="llama", hidden_act="silu")
        nn.architecture("llama").to_hf(llama)
    with pytest.raises(ConfigError, match="ungated_mlp"):
        dataclasses.replace(tiny, num_experts=4)
    with pytest.raises(ConfigError, match="ungated_mlp"):
        dataclasses.replace(tiny, fused_gate_up=True)
    assert "gate_proj" not in tiny.param_shapes()["model"]["layers"]["mlp"]


@pytest.mark.parametrize(
    "extra",
    [
        {},  # transformers' default: period 4, window 4096
        {"sliding_window_pattern": 3},
        {"sliding_window": None, "layer_types": ["full_attention"] * 6},
        {"layer_types": ["full_attention"] * 6},  # a window, no sliding layer
        {"layer_types": ["sliding_attention"] * 5 + ["full_attention"]},
    ],
)
def test_exaone4_layers_and_nope_follow_transformers(extra):
    """Which layers slide and which rotate, as transformers' Exaone4Attention.

    transformers rotates a layer when ``sliding_window`` is null or the layer
    slides; its mask slides the ``sliding_attention`` layers. Each case reads
    back from entrenar's own file (`exaone4_to_hf`) as the same config.
    """
    arch = nn.architecture("exaone4")
    hf = arch.to_hf(arch.tiny())
    for key in ("sliding_window", "layer_types"):
        del hf[key]
    hf = {**hf, "num_hidden_layers": 6, **extra}
    want = transformers.AutoConfig.for_model(**hf)
    got = arch.from_hf(hf)
    rotates = [want.sliding_window is None or t == "sliding_attention"
               for t in want.layer_types]  # fmt: skip
    assert [not x for x in got.nope_layers or (False,) * 6] == rotates
    slides = [t == "sliding_attention" for t in want.layer_types]
    assert list(nn.decoder_config.sliding_layers(got)) == slides
    if any(slides):
        assert got.sliding_window == want.sliding_window
    assert arch.from_hf(arch.to_hf(got)) == got


def test_exaone4_refusals():
    arch = nn.architecture("exaone4")
    tiny = arch.tiny()
    hf = arch.to_hf(tiny)
    del hf["layer_types"]
    with pytest.raises(UnsupportedError, match="sliding_window_pattern 'LLLG'"):
        arch.from_hf({**hf, "sliding_window_pattern": "LLLG"})
    with pytest.raises(UnsupportedError, match="nope_layers must be"):
        arch.to_hf(dataclasses.replace(tiny, nope_layers=None))
    with pytest.raises(UnsupportedError, match="qk_norm_whole must be False"):
        arch.to_hf(dataclasses.replace(tiny, qk_norm_whole=True))
    with pytest.raises(UnsupportedError, match="attention_bias"):
        arch.to_hf(dataclasses.replace(tiny, attention_bias=True))


@pytest.mark.parametrize("name", ["seed_oss", "ernie4_5", "arcee", "exaone4"])
def test_an_adapter_peft_saved_gives_peft_logits_here(name, tmp_path):
    """The other way round from the fixtures' checks: PEFT writes, entrenar reads.

    A LoRA on every linear layer of the transformers model (B non-zero), saved by
    ``save_pretrained``, loaded by `lora.load_adapter` onto the same weights: the
    logits of PEFT's model. ERNIE 4.5's q/k adapters stay in the interleaved
    layout (the reordering is in the forward pass), Arcee's have no gate_proj.
    """
    arch = nn.architecture(name)
    config = arch.tiny()
    model = _hf_model(arch.to_hf(config))
    params = nn.from_hf_names(
        {k: v.detach().numpy() for k, v in model.state_dict().items()}, config
    )
    pcfg = peft.LoraConfig(
        r=2, lora_alpha=4, target_modules="all-linear", init_lora_weights=False
    )
    peft_model = peft.get_peft_model(model, pcfg).eval()
    tokens, mask = _batch(config.vocab_size)
    want = _torch_logits(peft_model, tokens, mask)
    with peft_model.disable_adapter():
        base = _torch_logits(peft_model, tokens, mask)
    assert np.abs(want - base).max() > 1e-3  # the adapter matters
    peft_model.save_pretrained(str(tmp_path))
    loaded = lora.load_adapter(tmp_path, params)
    got = np.asarray(config.apply(loaded, jnp.asarray(tokens), mask=jnp.asarray(mask)))
    np.testing.assert_allclose(got[mask], want[mask], atol=TOL, rtol=TOL)
