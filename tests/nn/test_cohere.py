"""Cohere (Command-R, Aya) and Cohere 2 (Command-R7B, Command-A) vs transformers.

The registry tests (tests/nn/test_families.py, tests/io/...) run the tiny configs
of both families in float32 (padded logits, KV-cached generation, PEFT LoRA/DoRA,
HF and GGUF round trips, llama.cpp). Here, in float64: logits, cached decoding and
every parameter's gradient (full fine-tuning) against ``CohereForCausalLM`` /
``Cohere2ForCausalLM``; the interleaved rotary against Cohere's own
``apply_rotary_pos_emb``; the Hub's ``config.json`` shapes read as transformers
reads them; what the families refuse.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from entrenar import nn
from entrenar.errors import ConfigError, UnsupportedError
from entrenar.nn.cohere import cohere2_nope_layers
from entrenar.nn.losses import causal_lm_loss

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
cohere_modeling = pytest.importorskip("transformers.models.cohere.modeling_cohere")

pytestmark = pytest.mark.usefixtures("quick_compiles")

# float64 both sides, but transformers computes CohereLayerNorm and the rotation in
# float32 (``hidden_states.to(torch.float32)``, ``q.float()``)
TOL = 1e-5


@pytest.fixture(scope="module", params=["cohere", "cohere2"])
def cohere64(request):
    """``(config, params, torch model)`` of the family's tiny config in float64."""
    arch = nn.architecture(request.param)
    tiny = arch.tiny()
    hf_cfg = transformers.AutoConfig.for_model(**arch.to_hf(tiny))
    hf_cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(hf_cfg).double().eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():  # gains and biases away from 1 / 0
            p.add_(0.1 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
    config = dataclasses.replace(tiny, dtype="float64", param_dtype="float64")
    flat = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    with jax.enable_x64(True):
        params = nn.from_hf_names(flat, config)
    return config, params, model


def _tokens(t=12):
    """Two unpadded rows (transformers' float64 eager attention NaNs padded rows)."""
    rng = np.random.default_rng(0)
    return rng.integers(0, 96, size=(2, t)).astype(np.int64)


def test_logits_equal_transformers_in_float64(cohere64):
    config, params, model = cohere64
    tokens = _tokens()  # 12 > the sliding window 4
    with torch.no_grad():
        want = model(torch.from_numpy(tokens)).logits.numpy()
    with jax.enable_x64(True):
        got = np.asarray(jax.jit(config.apply)(params, jnp.asarray(tokens)))
    assert got.dtype == np.float64 and np.abs(want).max() > 0.5
    np.testing.assert_allclose(got, want, atol=TOL, rtol=TOL)


def test_cached_decoding_equals_transformers_in_float64(cohere64):
    config, params, model = cohere64
    tokens = _tokens(9)  # prefill 5, four steps: past the window
    cache_hf = transformers.DynamicCache(config=model.config)
    got, want = [], []
    with jax.enable_x64(True):
        step = jax.jit(config.apply_cached)
        cache = config.init_cache(2, 9)
        for t0, t1 in [(0, 5), (5, 6), (6, 7), (7, 8), (8, 9)]:
            with torch.no_grad():
                out = model(torch.from_numpy(tokens[:, t0:t1]), cache=cache_hf)
            cache_hf = out.cache
            want.append(out.logits.numpy())
            logits, cache = step(params, jnp.asarray(tokens[:, t0:t1]), cache)
            got.append(np.asarray(logits))
        whole = np.asarray(jax.jit(config.apply)(params, jnp.asarray(tokens)))
    np.testing.assert_allclose(
        np.concatenate(got, 1), np.concatenate(want, 1), atol=TOL, rtol=TOL
    )
    np.testing.assert_allclose(np.concatenate(got, 1), whole, atol=1e-12)


def test_gradients_equal_torch_autograd_in_float64(cohere64):
    """Full fine-tuning: every parameter's gradient, the tied table's included."""
    config, params, model = cohere64
    tokens = _tokens()
    model.zero_grad()
    labels = torch.from_numpy(tokens)
    model(labels, labels=labels).loss.backward()
    want = {k: p.grad.numpy() for k, p in model.named_parameters()}

    def loss(p):
        logits = config.apply(p, jnp.asarray(tokens))
        return causal_lm_loss(logits, jnp.asarray(tokens))

    with jax.enable_x64(True):
        grads = nn.to_hf_names(jax.jit(jax.grad(loss))(params))
    assert set(grads) == set(want)
    if config.qk_norm:  # a gain per head
        assert want["model.layers.0.self_attn.q_norm.weight"].shape == (4, 16)
    for name, g in grads.items():
        np.testing.assert_allclose(
            np.asarray(g), want[name], atol=1e-6, rtol=TOL, err_msg=name
        )


def test_interleaved_rotary_is_coheres():
    """Queries and keys rotated in Cohere's pairs give Cohere's scores.

    entrenar reorders both to halves and rotates half against half; the scores
    ``q_i · k_j`` equal those of transformers' own ``apply_rotary_pos_emb`` with
    Cohere's ``repeat_interleave``'d tables.
    """
    config = nn.architecture("cohere").tiny()
    rng = np.random.default_rng(0)
    q = rng.normal(size=(1, 6, 4, 16)).astype(np.float32)  # (B, T, H, d)
    k = rng.normal(size=(1, 6, 4, 16)).astype(np.float32)
    rot = cohere_modeling.CohereRotaryEmbedding(
        transformers.AutoConfig.for_model(**nn.architecture("cohere").to_hf(config))
    )
    x = torch.zeros(1, 6, 16)
    cos, sin = rot(x, torch.arange(6)[None])
    qt, kt = cohere_modeling.apply_rotary_pos_emb(
        torch.from_numpy(q).transpose(1, 2), torch.from_numpy(k).transpose(1, 2),
        cos, sin,
    )  # fmt: skip
    want = torch.einsum("bhtd,bhsd->bhts", qt, kt).numpy()
    tables = config._rope(jnp.arange(6), config.rope_theta, scaled=True)
    pairs = [jnp.concatenate([a[..., 0::2], a[..., 1::2]], -1) for a in (q, k)]
    qe, ke = (nn.rotate(a, tables) for a in pairs)
    got = np.asarray(jnp.einsum("bthd,bshd->bhts", qe, ke))
    np.testing.assert_allclose(got, want, atol=1e-5)
    half = [nn.rotate(jnp.asarray(a), tables) for a in (q, k)]  # Llama's pairs
    other = np.asarray(jnp.einsum("bthd,bshd->bhts", *half))
    assert np.abs(other - want).max() > 0.1


# ---------------------------------------------- config.json files shaped as the Hub's
HUB = {
    # CohereForAI/c4ai-command-r-v01 (35B)
    "command-r": dict(
        model_type="cohere", hidden_size=8192, intermediate_size=22528,
        num_hidden_layers=40, num_attention_heads=64, num_key_value_heads=64,
        layer_norm_eps=1e-5, logit_scale=0.0625, rope_theta=8000000.0,
        use_qk_norm=False, vocab_size=256000, max_position_embeddings=8192,
        tie_word_embeddings=True,
    ),
    # CohereForAI/c4ai-command-r-plus (104B): per-head q/k norms, GQA
    "command-r-plus": dict(
        model_type="cohere", hidden_size=12288, intermediate_size=33792,
        num_hidden_layers=64, num_attention_heads=96, num_key_value_heads=8,
        layer_norm_eps=1e-5, logit_scale=0.8333333333333334, rope_theta=75000000.0,
        use_qk_norm=True, vocab_size=256000, max_position_embeddings=8192,
    ),
    # CohereForAI/aya-expanse-8b
    "aya-expanse-8b": dict(
        model_type="cohere", hidden_size=4096, intermediate_size=14336,
        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
        layer_norm_eps=1e-5, logit_scale=0.125, rope_theta=10000.0,
        use_qk_norm=False, vocab_size=256000, max_position_embeddings=8192,
    ),
    # CohereForAI/c4ai-command-r7b-12-2024: no layer_types, pattern 4
    "command-r7b": dict(
        model_type="cohere2", hidden_size=4096, intermediate_size=14336,
        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
        layer_norm_eps=1e-5, logit_scale=0.25, rope_theta=50000.0,
        sliding_window=4096, sliding_window_pattern=4, vocab_size=256000,
        max_position_embeddings=8192, rotary_pct=1.0,
    ),
    # CohereForAI/c4ai-command-a-03-2025: explicit layer_types
    "command-a": dict(
        model_type="cohere2", hidden_size=12288, intermediate_size=36864,
        num_hidden_layers=64, num_attention_heads=96, num_key_value_heads=8,
        layer_norm_eps=1e-5, logit_scale=0.8333333333333334, rope_theta=50000.0,
        sliding_window=4096, vocab_size=256000, max_position_embeddings=131072,
        layer_types=[
            "full_attention" if (i + 1) % 4 == 0 else "sliding_attention"
            for i in range(64)
        ],
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(HUB))
def test_hub_configs_read_as_transformers_reads_them(name):
    """Sizes, norms, scales and layouts as ``AutoConfig`` reads such files.

    (Each model's sizes and keys; the scales and bases stand for any; the NoPE
    layers are cohere2's
    full-attention ones.)
    """
    hf = HUB[name]
    want = transformers.AutoConfig.for_model(**hf)
    got = nn.LlamaConfig.from_hf_config(hf)
    assert got.architecture == hf["model_type"]
    assert (got.hd, got.num_kv_heads) == (
        getattr(want, "head_dim", None) or want.hidden_size // want.num_attention_heads,
        want.num_key_value_heads,
    )
    assert got.rms_norm_eps == want.layer_norm_eps
    assert got.logit_scale == want.logit_scale
    assert got.rope_theta == want.rope_parameters["rope_theta"]
    assert got.tie_word_embeddings == want.tie_word_embeddings is True
    assert got.layer_norm and got.parallel_residual and got.rope_interleave
    if hf["model_type"] == "cohere":
        assert got.qk_norm == got.qk_norm_heads == want.use_qk_norm
        assert got.sliding_window is None and got.nope_layers is None
    else:
        assert list(got.layer_types) == want.layer_types
        assert got.sliding_window == want.sliding_window
        assert got.nope_layers == tuple(t == "full_attention" for t in want.layer_types)


# ------------------------------------------------------------------ bad input
def test_switches_that_do_not_fit_are_config_errors():
    tiny = nn.architecture("cohere").tiny()
    with pytest.raises(ConfigError, match=r"qk_norm_heads .* needs qk_norm"):
        dataclasses.replace(tiny, qk_norm=False)
    # interleaved pairs over part of each head are GLM's: a LlamaConfig may have
    # them, Cohere's config.json may not
    with pytest.raises(UnsupportedError, match=r"partial_rotary_factor=0\.5 has no"):
        nn.architecture("cohere").to_hf(
            dataclasses.replace(tiny, partial_rotary_factor=0.5)
        )
    with pytest.raises(ConfigError, match=r"parallel_residual .* excludes"):
        dataclasses.replace(tiny, post_norms=True)
    with pytest.raises(ConfigError, match="logit_scale must be > 0"):
        dataclasses.replace(tiny, logit_scale=0.0)


def test_what_coheres_config_json_cannot_hold_is_refused():
    cohere, cohere2 = nn.architecture("cohere"), nn.architecture("cohere2")
    with pytest.raises(UnsupportedError, match="layer_norm must be True"):
        cohere.to_hf(dataclasses.replace(cohere.tiny(), layer_norm=False))
    with pytest.raises(UnsupportedError, match="sliding_window"):
        cohere.to_hf(
            dataclasses.replace(cohere.tiny(), sliding_window=4, layer_types=None)
        )
    tiny2 = cohere2.tiny()
    with pytest.raises(UnsupportedError, match="rotates the sliding layers only"):
        cohere2.to_hf(dataclasses.replace(tiny2, nope_layers=None))
    with pytest.raises(UnsupportedError, match="qk_norm"):
        cohere2.to_hf(dataclasses.replace(tiny2, qk_norm=True, qk_norm_heads=True))
    with pytest.raises(UnsupportedError, match="mlp_bias"):
        cohere.to_hf(dataclasses.replace(cohere.tiny(), mlp_bias=True))
    # other families refuse Cohere's switches
    llama = nn.architecture("llama")
    with pytest.raises(UnsupportedError, match="rope_interleave"):
        llama.to_hf(dataclasses.replace(llama.tiny(), rope_interleave=True))
    with pytest.raises(UnsupportedError, match="logit_scale"):
        llama.to_hf(dataclasses.replace(llama.tiny(), logit_scale=0.5))


def test_cohere2_without_sliding_layers_has_no_rotary():
    """Every layer full: transformers rotates none (sliding_window null)."""
    arch = nn.architecture("cohere2")
    hf = {**arch.to_hf(arch.tiny()), "sliding_window": None}
    hf["layer_types"] = ["full_attention"] * 2
    got = arch.from_hf(hf)
    assert got.sliding_window is None and got.nope_layers == (True, True)
    assert cohere2_nope_layers(got) == (True, True)
    assert arch.from_hf(arch.to_hf(got)) == got


def test_per_head_qk_norm_gains_are_never_adapted_or_quantized():
    """Cohere's ``q_norm (L, H, d)`` looks like a stack of matrices, but is a norm.

    LoRA's ``all-linear``, QLoRA's ``quantize_untargeted`` and `quant.quantize_params`'
    default leave it a float array (before: adapted, 4-bit, and the GGUF writer
    stored it Q8_0, which llama.cpp's LayerNorm cannot read).
    """
    from entrenar import lora, quant

    config = dataclasses.replace(
        nn.architecture("cohere").tiny(), hidden_size=64, head_dim=64
    )  # d = 64: whole quantization blocks
    params = config.init(jax.random.key(0))
    cfg = lora.LoRAConfig(
        rank=2, targets="all-linear", quantize_base="nf4", quantize_untargeted=True
    )
    for tree in (
        lora.apply(params, cfg, key=jax.random.key(1)),
        quant.quantize_params(params, "nf4"),
    ):
        attn = tree["model"]["layers"]["self_attn"]
        for norm in ("q_norm", "k_norm"):
            assert isinstance(attn[norm]["weight"], jax.Array), norm
        assert not isinstance(attn["q_proj"]["weight"], jax.Array)
