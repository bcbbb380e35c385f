"""Rotary scaling against transformers' inverse frequencies (ROPE_INIT_FUNCTIONS)."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from entrenar import nn
from entrenar.errors import FormatError, UnsupportedError
from entrenar.nn.rope_scaling import attention_factor, rope_inv_freq, scaling_divisors

transformers = pytest.importorskip("transformers")
rope_utils = pytest.importorskip("transformers.modeling_rope_utils")

BASE = nn.LlamaConfig(
    vocab_size=64,
    hidden_size=128,
    intermediate_size=64,
    num_layers=1,
    num_heads=2,
    num_kv_heads=2,
    head_dim=64,
    rope_theta=10000.0,
    max_position_embeddings=64,
)  # 32 frequencies, wavelengths from 6 to 7e4 positions
HALF = BASE.hd // 2
CASES = {
    "linear": dict(rope_type="linear", rope_factor=4.0),
    "dynamic": dict(rope_type="dynamic", rope_factor=2.0),
    "llama3": dict(
        rope_type="llama3",
        rope_factor=8.0,
        rope_low_freq_factor=1.0,
        rope_high_freq_factor=4.0,
        rope_original_max_position_embeddings=256,
    ),
    "yarn": dict(
        rope_type="yarn",
        rope_factor=4.0,
        rope_original_max_position_embeddings=32,
        rope_beta_fast=32.0,
        rope_beta_slow=1.0,
    ),
    "longrope": dict(
        rope_type="longrope",
        rope_factor=2.0,
        rope_original_max_position_embeddings=32,
        rope_short_factor=tuple(1.0 + 0.05 * i for i in range(HALF)),
        rope_long_factor=tuple(1.0 + 0.5 * i for i in range(HALF)),
    ),
}


def _hf(config):
    return transformers.AutoConfig.for_model(**nn.architecture("llama").to_hf(config))


@pytest.mark.parametrize("kind", sorted(CASES))
@pytest.mark.parametrize("seq_len", [16, 200])  # inside and beyond the contexts
def test_inverse_frequencies_equal_transformers(kind, seq_len):
    config = dataclasses.replace(BASE, **CASES[kind])
    fn = rope_utils.ROPE_INIT_FUNCTIONS[kind]
    # transformers picks longrope's long factors, and grows the dynamic base, only
    # past the original context (its forward's update); the init function takes
    # the sequence length directly
    want, want_scale = fn(_hf(config), None, seq_len=seq_len)
    positions = jnp.arange(seq_len, dtype=jnp.int32)
    got = rope_inv_freq(config, positions, jnp.float32)
    np.testing.assert_allclose(np.asarray(got), want.numpy(), rtol=2e-6)
    assert attention_factor(config) == pytest.approx(want_scale, rel=1e-12)


def test_default_rope_has_no_scaling_and_divisors_are_llama_cpp_freqs():
    assert rope_inv_freq(BASE, jnp.arange(4), jnp.float32) is None
    assert scaling_divisors(BASE) is None
    llama3 = dataclasses.replace(BASE, **CASES["llama3"])
    div = scaling_divisors(llama3)
    assert div is not None and div.shape == (HALF,)
    assert div[0] == 1.0 and div[-1] == 8.0  # high frequencies kept, low divided
    explicit = dataclasses.replace(BASE, rope_freq_divisors=tuple(div))
    np.testing.assert_array_equal(
        np.asarray(rope_inv_freq(explicit, jnp.arange(4), jnp.float32)),
        np.asarray(rope_inv_freq(llama3, jnp.arange(4), jnp.float32)),
    )
    with pytest.raises(UnsupportedError, match="rope_freq_divisors"):
        nn.architecture("llama").to_hf(explicit)


@pytest.mark.parametrize("style", ["rope_scaling", "rope_parameters"])
def test_both_config_json_styles_read_the_same(style):
    config = dataclasses.replace(BASE, **CASES["llama3"])
    hf = nn.architecture("llama").to_hf(config)
    if style == "rope_parameters":  # transformers 5 writes this
        hf = _hf(config).to_dict()
        assert "rope_scaling" not in hf or not hf["rope_scaling"]
    assert nn.LlamaConfig.from_hf_config(hf) == config


def test_su_is_longrope_and_unknown_types_name_the_field():
    hf = nn.architecture("llama").to_hf(dataclasses.replace(BASE, **CASES["longrope"]))
    hf["rope_scaling"]["type"] = "su"
    del hf["rope_scaling"]["rope_type"]
    assert nn.LlamaConfig.from_hf_config(hf).rope_type == "longrope"
    hf["rope_scaling"]["type"] = "ntk-by-parts"
    with pytest.raises(UnsupportedError, match=r"rope_scaling\.rope_type"):
        nn.LlamaConfig.from_hf_config(hf)


def test_a_missing_longrope_factor_is_the_ratio_of_the_contexts():
    """The factor transformers takes when the file has none: max_position / original.

    Phi-3-mini-128k's and Phi-3.5-mini's config.json give LongRoPE no ``factor``,
    only ``max_position_embeddings`` (131072) and the original context (4096); the
    attention factor ``sqrt(1 + ln 32 / ln 4096)`` depends on their ratio. Read as
    factor 1, it was 1 (transformers: 1.19), scaling every score by 1/1.42.
    """
    kind = "longrope"
    config = dataclasses.replace(BASE, max_position_embeddings=256, **CASES[kind])
    hf = nn.architecture("llama").to_hf(config)
    del hf["rope_scaling"]["factor"]
    read = nn.LlamaConfig.from_hf_config(hf)
    assert read.rope_factor == 256 / 32
    want, want_scale = rope_utils.ROPE_INIT_FUNCTIONS[kind](
        transformers.AutoConfig.for_model(**hf), None, seq_len=300
    )
    got = rope_inv_freq(read, jnp.arange(300, dtype=jnp.int32), jnp.float32)
    np.testing.assert_allclose(np.asarray(got), want.numpy(), rtol=2e-6)
    assert attention_factor(read) == pytest.approx(want_scale, rel=1e-12)
    assert want_scale > 1.0


def test_phi3_longrope_without_a_factor_reads_the_top_level_context():
    phi3 = nn.architecture("phi3")
    hf = phi3.to_hf(phi3.tiny())  # max_position_embeddings 32, original 8
    hf["rope_scaling"] = {
        k: v
        for k, v in hf["rope_scaling"].items()
        if k not in ("factor", "original_max_position_embeddings")
    }
    read = phi3.from_hf(hf)
    assert read.rope_factor == 32 / 8
    _, want_scale = rope_utils.ROPE_INIT_FUNCTIONS["longrope"](
        transformers.Phi3Config(**{k: v for k, v in hf.items() if k != "model_type"}),
        None,
    )
    assert attention_factor(read) == pytest.approx(want_scale, rel=1e-12)


@pytest.mark.parametrize(
    "extra",
    [
        {"mscale": 0.707, "mscale_all_dim": 1.0},  # DeepSeek-V2-Lite style
        {"mscale": 1.0, "mscale_all_dim": 1.0},  # DeepSeek-V3: the ratio is 1
        {"mscale": 0.707},  # one alone: transformers ignores it
        {"mscale": 1.0, "mscale_all_dim": 0.5, "attention_factor": 0.9},  # given
    ],
)
def test_yarn_mscale_gives_transformers_attention_factor(extra):
    """``mscale`` / ``mscale_all_dim`` give transformers' attention factor.

    ``get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)`` when both are
    set and ``attention_factor`` is not. Before, such a config.json was refused
    ('mscale, mscale_all_dim ... are not supported').
    """
    config = dataclasses.replace(BASE, **CASES["yarn"])
    hf = nn.architecture("llama").to_hf(config)
    hf["rope_scaling"] |= extra
    read = nn.LlamaConfig.from_hf_config(hf)
    want, want_scale = rope_utils.ROPE_INIT_FUNCTIONS["yarn"](
        transformers.AutoConfig.for_model(**hf), None
    )
    got = rope_inv_freq(read, jnp.arange(16, dtype=jnp.int32), jnp.float32)
    np.testing.assert_allclose(np.asarray(got), want.numpy(), rtol=2e-6)
    assert attention_factor(read) == pytest.approx(want_scale, rel=1e-12)


@pytest.mark.parametrize("gpt_oss", [False, True])
def test_yarn_truncate_false_equals_transformers(gpt_oss):
    """``truncate: false`` keeps the fractional correction range, as transformers.

    Before, entrenar refused it. gpt-oss's own settings (head_dim 64, base 150000,
    factor 32 from 4096) put the range at [8.09, 17.40], which truncation would
    widen to [8, 18]: the frequencies differ by up to 13%.
    """
    config = dataclasses.replace(BASE, **CASES["yarn"])
    if gpt_oss:
        config = dataclasses.replace(
            config, rope_theta=150000.0, rope_factor=32.0,
            rope_original_max_position_embeddings=4096,
        )  # fmt: skip
    hf = nn.architecture("llama").to_hf(config)
    hf["rope_scaling"]["truncate"] = False
    read = nn.LlamaConfig.from_hf_config(hf)
    assert read == dataclasses.replace(config, rope_truncate=False)
    assert nn.architecture("llama").to_hf(read)["rope_scaling"]["truncate"] is False
    want, want_scale = rope_utils.ROPE_INIT_FUNCTIONS["yarn"](
        transformers.AutoConfig.for_model(**hf), None
    )
    got = rope_inv_freq(read, jnp.arange(16, dtype=jnp.int32), jnp.float32)
    np.testing.assert_allclose(np.asarray(got), want.numpy(), rtol=2e-6)
    assert attention_factor(read) == pytest.approx(want_scale, rel=1e-12)
    truncated = rope_inv_freq(config, jnp.arange(16, dtype=jnp.int32), jnp.float32)
    assert np.abs(np.asarray(truncated) / want.numpy() - 1).max() > 1e-3
    hf["rope_scaling"]["truncate"] = "no"
    with pytest.raises(FormatError, match="truncate = 'no'"):
        nn.LlamaConfig.from_hf_config(hf)
