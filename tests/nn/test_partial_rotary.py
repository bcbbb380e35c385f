"""Partial rotary embeddings (Phi-4-mini's ``partial_rotary_factor``) vs transformers.

transformers rotates the first ``r = int(d · factor)`` values of each head with the
inverse frequencies of a head of ``r`` values (every ``_compute_*_parameters``'
``dim``) and passes the rest (``apply_rotary_pos_emb`` when ``cos`` is narrower
than the head). Checked here: the inverse frequencies of every scaling; the
rotation against Phi-3's own ``apply_rotary_pos_emb``; a Phi-3 with partial
rotary in float64 (logits past LongRoPE's switch, KV-cached decoding
and every parameter's gradient) against ``Phi3ForCausalLM``; the Hub's Phi-4-mini,
Phi-4 and Phi-3.5-mini ``config.json`` files; what other families refuse. The
registry tests (tests/nn/test_families.py, tests/io/...) cover LoRA/DoRA/PEFT, fused
attention, the HF and GGUF round trips and llama.cpp with the phi3 tiny config,
which rotates 12 of 16 values.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from entrenar import nn
from entrenar.errors import ConfigError, FormatError, UnsupportedError
from entrenar.nn.losses import causal_lm_loss
from entrenar.nn.rope import rope_tables, rotate
from entrenar.nn.rope_scaling import attention_factor, rope_inv_freq

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
rope_utils = pytest.importorskip("transformers.modeling_rope_utils")
phi3_modeling = pytest.importorskip("transformers.models.phi3.modeling_phi3")

pytestmark = pytest.mark.usefixtures("quick_compiles")

PHI3 = nn.architecture("phi3")
TOL = 1e-5  # float64 both sides, but transformers' angles are float32 (6e-7 off)


# ------------------------------------------------------------ inverse frequencies
BASE = nn.LlamaConfig(
    vocab_size=64, hidden_size=128, intermediate_size=64, num_layers=1,
    num_heads=2, num_kv_heads=2, head_dim=64, max_position_embeddings=64,
    partial_rotary_factor=0.5, architecture="phi3",
)  # fmt: skip  # r = 32: 16 frequencies
HALF = BASE.rotary_dim // 2
SCALINGS = {
    "linear": dict(rope_type="linear", rope_factor=4.0),
    "dynamic": dict(rope_type="dynamic", rope_factor=2.0),
    "llama3": dict(
        rope_type="llama3", rope_factor=8.0, rope_low_freq_factor=1.0,
        rope_high_freq_factor=4.0, rope_original_max_position_embeddings=256,
    ),
    "yarn": dict(
        rope_type="yarn", rope_factor=4.0, rope_original_max_position_embeddings=32,
    ),
    "longrope": dict(
        rope_type="longrope", rope_factor=2.0,
        rope_original_max_position_embeddings=32,
        rope_short_factor=tuple(1.0 + 0.05 * i for i in range(HALF)),
        rope_long_factor=tuple(1.0 + 0.5 * i for i in range(HALF)),
    ),
}  # fmt: skip


def _transformers_config(config):
    """A transformers LlamaConfig with ``config``'s rope parameters and factor.

    The rope init functions read only ``rope_parameters`` and the head sizes.
    """
    rope = PHI3.to_hf(dataclasses.replace(config, sliding_window=None))
    params = dict(rope["rope_scaling"] or {"rope_type": "default"})
    params.update(rope_theta=config.rope_theta, partial_rotary_factor=0.5)
    return transformers.LlamaConfig(
        hidden_size=config.hidden_size, num_attention_heads=config.num_heads,
        head_dim=config.hd, max_position_embeddings=config.max_position_embeddings,
        rope_parameters=params,
    )  # fmt: skip


@pytest.mark.parametrize("kind", sorted(SCALINGS))
@pytest.mark.parametrize("seq_len", [16, 300])  # inside and beyond the contexts
def test_inverse_frequencies_of_a_partial_head_equal_transformers(kind, seq_len):
    config = dataclasses.replace(BASE, **SCALINGS[kind])
    want, want_scale = rope_utils.ROPE_INIT_FUNCTIONS[kind](
        _transformers_config(config), None, seq_len=seq_len
    )
    assert want.shape == (HALF,)
    got = rope_inv_freq(config, jnp.arange(seq_len, dtype=jnp.int32), jnp.float32)
    np.testing.assert_allclose(np.asarray(got), want.numpy(), rtol=2e-6)
    assert attention_factor(config) == pytest.approx(want_scale, rel=1e-12)


def test_default_tables_are_phi3s_rotary_embedding():
    hf = transformers.Phi3Config(**_phi3_dict(partial=0.5, scaling=False))
    emb = phi3_modeling.Phi3RotaryEmbedding(hf)
    positions = torch.arange(20)[None]
    cos, sin = emb(torch.zeros(1, dtype=torch.float32), positions)
    config = PHI3.from_hf(_phi3_dict(partial=0.5, scaling=False))
    got = config._rope(jnp.arange(20), config.rope_theta, scaled=True)
    assert got[0].shape == (1, 20, 1, config.rotary_dim)
    np.testing.assert_allclose(np.asarray(got[0][:, :, 0]), cos.numpy(), atol=1e-6)
    np.testing.assert_allclose(np.asarray(got[1][:, :, 0]), sin.numpy(), atol=1e-6)


@settings(max_examples=20, deadline=None)
@given(
    d=st.sampled_from([8, 16, 96]),
    factor=st.sampled_from([0.25, 0.5, 0.75, 1.0]),
    seed=st.integers(0, 2**16),
)
def test_rotation_is_transformers_apply_rotary_pos_emb(d, factor, seed):
    """``rotate`` with ``r``-wide tables: Phi-3's ``apply_rotary_pos_emb``."""
    r = int(d * factor)
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((2, 5, 3, d))  # (B, T, H, d)
    positions = rng.integers(0, 1000, size=(2, 5))
    with jax.enable_x64(True):
        cos, sin, got = _tables_and_rotation(jnp.asarray(positions), jnp.asarray(q), r)
        got = np.asarray(got)
        assert got.dtype == np.float64
    tq = torch.from_numpy(q).transpose(1, 2)  # (B, H, T, d)
    tc = torch.from_numpy(np.array(cos[:, :, 0]))  # (B, T, r)
    ts = torch.from_numpy(np.array(sin[:, :, 0]))
    want, _ = phi3_modeling.apply_rotary_pos_emb(tq, tq, tc, ts)
    np.testing.assert_allclose(got, want.transpose(1, 2).numpy(), atol=1e-12)
    np.testing.assert_array_equal(got[..., r:], q[..., r:])  # passed through


@functools.partial(jax.jit, static_argnums=2)
def _tables_and_rotation(positions, q, r):
    """``r``-wide float64 tables and ``q`` rotated: one program per shape and ``r``.

    Op by op, each example ran (and looked up) each operation on its own.
    """
    cos, sin = rope_tables(positions, r, 500.0, jnp.float64)
    return cos, sin, rotate(q, (cos, sin))


def test_rotation_gradient_is_the_inverse_rotation():
    """The VJP of a rotation is the rotation back; the passed values get ``g``."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((1, 4, 2, 16)), jnp.float32)
    g = jnp.asarray(rng.standard_normal((1, 4, 2, 16)), jnp.float32)
    cos, sin = rope_tables(jnp.arange(4), 12, 100.0)
    _, pull = jax.vjp(lambda v: rotate(v, (cos, sin)), x)
    (dx,) = pull(g)
    back = rotate(g, (cos, -sin))  # the opposite angle
    np.testing.assert_allclose(np.asarray(dx), np.asarray(back), atol=1e-6)
    np.testing.assert_array_equal(np.asarray(dx[..., 12:]), np.asarray(g[..., 12:]))


# ----------------------------------------------------- a Phi-3 against transformers
def _phi3_dict(partial=0.75, scaling=True, **extra):
    """A tiny Phi-3 ``config.json`` with Phi-4-mini's layout (top-level factor)."""
    hd = 16
    half = int(hd * partial) // 2
    hf = {
        "architectures": ["Phi3ForCausalLM"], "model_type": "phi3",
        "vocab_size": 96, "hidden_size": 64, "intermediate_size": 64,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 32, "original_max_position_embeddings": 8,
        "partial_rotary_factor": partial, "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0, "tie_word_embeddings": True, "sliding_window": None,
        "rope_scaling": None, "bos_token_id": None, "eos_token_id": None,
        "pad_token_id": None,
    }  # fmt: skip
    if scaling:
        hf["rope_scaling"] = {
            "type": "longrope",
            "short_factor": [1.0 + 0.1 * i for i in range(half)],
            "long_factor": [1.0 + 0.7 * i for i in range(half)],
        }
    return hf | extra


@pytest.fixture(scope="module", params=[(0.75, True), (0.5, False)])
def phi3_64(request):
    """``(config, params, torch model)`` in float64: longrope 0.75, or plain 0.5."""
    partial, scaling = request.param
    hf = _phi3_dict(partial, scaling)
    hf_cfg = transformers.AutoConfig.for_model(**hf)
    hf_cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(hf_cfg).double().eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
    config = dataclasses.replace(
        PHI3.from_hf(hf), dtype="float64", param_dtype="float64"
    )
    assert config.rotary_dim == int(16 * partial)
    flat = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    with jax.enable_x64(True):
        params = nn.from_hf_names(flat, config)
    return config, params, model


def _tokens(t=12):
    """Two unpadded rows of ``t`` tokens.

    transformers' float64 eager attention turns padded rows to NaN, which reach
    the next layer's values; tests/nn/test_families.py checks padding in float32.
    """
    rng = np.random.default_rng(0)
    return rng.integers(0, 96, size=(2, t)).astype(np.int64)


def test_phi3_logits_equal_transformers_in_float64(phi3_64):
    config, params, model = phi3_64
    tokens = _tokens()  # 12 > original context 8: the long factors
    with torch.no_grad():
        want = model(torch.from_numpy(tokens)).logits.numpy()
    with jax.enable_x64(True):
        got = np.asarray(jax.jit(config.apply)(params, jnp.asarray(tokens)))
    assert np.abs(want).max() > 0.5
    np.testing.assert_allclose(got, want, atol=TOL, rtol=TOL)
    full = dataclasses.replace(
        config, partial_rotary_factor=1.0, rope_type="default",
        rope_short_factor=None, rope_long_factor=None,
    )  # fmt: skip
    with jax.enable_x64(True):
        whole = np.asarray(jax.jit(full.apply)(params, jnp.asarray(tokens)))
    assert np.abs(whole - want).max() > 1e-3  # the partial rotation mattered


def test_phi3_cached_decoding_equals_transformers_in_float64(phi3_64):
    config, params, model = phi3_64
    tokens = _tokens(8)  # prefill 5, three steps: within the original context
    cache_hf = transformers.DynamicCache(config=model.config)
    got, want = [], []
    with jax.enable_x64(True):
        step = jax.jit(config.apply_cached)
        cache = config.init_cache(2, 8)
        for t0, t1 in [(0, 5), (5, 6), (6, 7), (7, 8)]:
            with torch.no_grad():
                out = model(torch.from_numpy(tokens[:, t0:t1]), cache=cache_hf)
            cache_hf = out.cache
            want.append(out.logits.numpy())
            logits, cache = step(params, jnp.asarray(tokens[:, t0:t1]), cache)
            got.append(np.asarray(logits))
    np.testing.assert_allclose(
        np.concatenate(got, 1), np.concatenate(want, 1), atol=TOL, rtol=TOL
    )


def test_phi3_gradients_equal_torch_autograd_in_float64(phi3_64):
    config, params, model = phi3_64
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
    for name, g in grads.items():
        np.testing.assert_allclose(
            np.asarray(g), want[name], atol=1e-6, rtol=TOL, err_msg=name
        )


# ---------------------------------------------------------- the Hub's config files
def _hub(name):
    """``config.json`` of Phi-4-mini-instruct, Phi-4 and Phi-3.5-mini-instruct.

    Their sizes and switches as the Hub's files give them; the LongRoPE factors'
    values are stand-ins (their count, ``rotary_dim / 2``, is the file's).
    """
    common = {
        "architectures": ["Phi3ForCausalLM"], "model_type": "phi3",
        "attention_bias": False, "attention_dropout": 0.0, "embd_pdrop": 0.0,
        "hidden_act": "silu", "initializer_range": 0.02, "resid_pdrop": 0.0,
        "rms_norm_eps": 1e-05, "torch_dtype": "bfloat16", "use_cache": True,
    }  # fmt: skip
    if name == "phi-4-mini":
        return common | {
            "bos_token_id": 199999, "eos_token_id": 199999, "pad_token_id": 199999,
            "full_attn_mod": 1, "hidden_size": 3072, "intermediate_size": 8192,
            "interpolate_factor": 1, "lm_head_bias": False,
            "max_position_embeddings": 131072, "mlp_bias": False,
            "num_attention_heads": 24, "num_hidden_layers": 32,
            "num_key_value_heads": 8, "original_max_position_embeddings": 4096,
            "partial_rotary_factor": 0.75, "rope_theta": 10000.0,
            "rope_scaling": {
                "long_factor": [1.0 + 0.5 * i for i in range(48)],
                "short_factor": [1.0] * 48,
                "type": "longrope",
            },
            "sliding_window": 262144, "tie_word_embeddings": True,
            "vocab_size": 200064,
        }  # fmt: skip
    if name == "phi-4":
        return common | {
            "bos_token_id": 100257, "eos_token_id": 100265, "pad_token_id": 100349,
            "hidden_size": 5120, "intermediate_size": 17920,
            "max_position_embeddings": 16384, "num_attention_heads": 40,
            "num_hidden_layers": 40, "num_key_value_heads": 10,
            "original_max_position_embeddings": 16384, "rope_scaling": None,
            "rope_theta": 250000, "sliding_window": None,
            "tie_word_embeddings": False, "vocab_size": 100352,
        }  # fmt: skip
    return common | {  # Phi-3.5-mini-instruct
        "bos_token_id": 1, "eos_token_id": 32000, "pad_token_id": 32000,
        "hidden_size": 3072, "intermediate_size": 8192,
        "max_position_embeddings": 131072, "num_attention_heads": 32,
        "num_hidden_layers": 32, "num_key_value_heads": 32,
        "original_max_position_embeddings": 4096, "rope_theta": 10000.0,
        "rope_scaling": {
            "long_factor": [1.0 + 0.5 * i for i in range(48)],
            "short_factor": [1.0 + 0.01 * i for i in range(48)],
            "type": "longrope",
        },
        "sliding_window": 262144, "tie_word_embeddings": False, "vocab_size": 32064,
    }  # fmt: skip


@pytest.mark.parametrize(
    "name, rotary, tied",
    [("phi-4-mini", 96, True), ("phi-4", 128, False), ("phi-3.5-mini", 96, False)],
)
def test_hub_phi_configs_load_as_transformers_reads_them(name, rotary, tied):
    hf = _hub(name)
    config = nn.LlamaConfig.from_hf_config(hf)
    assert config.architecture == "phi3" and config.tie_word_embeddings is tied
    assert config.vocab_size == hf["vocab_size"] and config.hd == 128 - 32 * (
        name == "phi-3.5-mini"
    )
    assert config.rotary_dim == rotary
    assert config.rope_type == ("default" if name == "phi-4" else "longrope")
    theirs = transformers.AutoConfig.for_model(**hf)
    for length in (100, 5000):  # below and past the original context (4096)
        emb = phi3_modeling.Phi3RotaryEmbedding(theirs)  # fresh: no long state
        positions = torch.arange(length)[None]
        cos, sin = emb(torch.zeros(1, dtype=torch.float32), positions)  # (1, T, r)
        got = config._rope(jnp.arange(length), config.rope_theta, scaled=True)
        assert got[0].shape == (1, length, 1, rotary)
        # angles up to 5000 rad in float32 on both sides: 5e-4 apart at most
        np.testing.assert_allclose(np.asarray(got[0][:, :, 0]), cos.numpy(), atol=1e-3)
        np.testing.assert_allclose(np.asarray(got[1][:, :, 0]), sin.numpy(), atol=1e-3)
        inv = rope_inv_freq(config, jnp.arange(length), jnp.float32)
        if inv is not None:
            np.testing.assert_allclose(np.asarray(inv), emb.inv_freq.numpy(), rtol=2e-6)
        assert attention_factor(config) == pytest.approx(emb.attention_scaling)
    written = config.to_hf_config()
    read = nn.LlamaConfig.from_hf_config(written)
    assert read == dataclasses.replace(config, head_dim=config.hd)  # written there
    again = transformers.AutoConfig.for_model(**written).to_dict()
    assert nn.LlamaConfig.from_hf_config(again) == read


def test_the_factor_in_rope_scaling_wins_over_the_top_level_as_in_transformers():
    hf = _phi3_dict(0.75)
    hf["rope_scaling"] = hf["rope_scaling"] | {
        "partial_rotary_factor": 0.5,
        "short_factor": [1.0] * 4,
        "long_factor": [2.0] * 4,
    }
    assert PHI3.from_hf(hf).rotary_dim == 8
    theirs = transformers.AutoConfig.for_model(**hf)
    assert theirs.rope_parameters["partial_rotary_factor"] == 0.5


# ------------------------------------------------------------------------ refusals
def test_families_that_rotate_whole_heads_refuse_a_partial_factor():
    llama = nn.architecture("llama")
    hf = llama.to_hf(llama.tiny()) | {"partial_rotary_factor": 0.5}
    with pytest.raises(UnsupportedError, match=r"partial_rotary_factor 0\.5"):
        llama.from_hf(hf)
    partial = dataclasses.replace(llama.tiny(), partial_rotary_factor=0.5)
    with pytest.raises(UnsupportedError, match="partial_rotary_factor"):
        llama.to_hf(partial)
    gemma3 = nn.architecture("gemma3")
    written = transformers.AutoConfig.for_model(**gemma3.to_hf(gemma3.tiny()))
    hf = written.to_dict()
    hf["rope_parameters"]["sliding_attention"]["partial_rotary_factor"] = 0.5
    with pytest.raises(UnsupportedError, match=r"sliding_attention\.partial_rotary"):
        gemma3.from_hf(hf)


@pytest.mark.parametrize(
    "factor, match",
    [
        (0.0, r"in \(0, 1\]"),
        (1.5, r"in \(0, 1\]"),
        (0.1, r"int\(16 x 0.1\) = 1 .*even number >= 2"),
        (0.5625, r"= 9 .*even number >= 2"),  # 9 values: no pairs
    ],
)
def test_bad_factors_name_the_field(factor, match):
    with pytest.raises(ConfigError, match=match):
        dataclasses.replace(PHI3.tiny(), partial_rotary_factor=factor)


def test_the_rotated_width_is_truncated_as_transformers_does():
    plain = dict(rope_type="default", rope_short_factor=None, rope_long_factor=None)
    config = dataclasses.replace(PHI3.tiny(), partial_rotary_factor=0.3, **plain)
    assert config.rotary_dim == int(16 * 0.3) == 4


@pytest.mark.parametrize("value", ["0.75", 0, 2, True])
def test_a_bad_factor_in_config_json_names_the_key(value):
    with pytest.raises(FormatError, match="partial_rotary_factor"):
        PHI3.from_hf(_phi3_dict(1.0) | {"partial_rotary_factor": value})


def test_a_null_factor_is_the_whole_head_as_in_transformers():
    hf = _phi3_dict(1.0) | {"partial_rotary_factor": None}
    assert PHI3.from_hf(hf).rotary_dim == 16


def test_factor_lengths_are_checked_against_the_rotated_half():
    with pytest.raises(ConfigError, match="rotary_dim / 2 = 6"):
        dataclasses.replace(PHI3.tiny(), rope_short_factor=(1.0,) * 8)
