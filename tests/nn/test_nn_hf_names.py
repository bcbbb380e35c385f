import jax
import jax.numpy as jnp
import numpy as np
import pytest

from entrenar.errors import ConfigError, FormatError, ShapeError
from entrenar.nn import LlamaConfig, from_hf_names, to_hf_names
from entrenar.tree import assert_trees_allclose

TINY = dict(
    vocab_size=11,
    hidden_size=8,
    intermediate_size=12,
    num_layers=3,
    num_heads=4,
    num_kv_heads=2,
    rope_theta=100.0,
)


def test_smollm2_config_is_exact():
    c = LlamaConfig.smollm2_135m()
    assert (c.vocab_size, c.hidden_size, c.intermediate_size) == (49152, 576, 1536)
    assert (c.num_layers, c.num_heads, c.num_kv_heads, c.hd) == (30, 9, 3, 64)
    assert c.rope_theta == 100000.0 and c.rms_norm_eps == 1e-5
    assert c.tie_word_embeddings
    assert c.num_params() == 134_515_008  # published size of SmolLM2-135M
    assert LlamaConfig.from_hf_config(c.to_hf_config()) == c


@pytest.mark.parametrize("tied", [True, False])
def test_hf_names_round_trip(tied):
    c = LlamaConfig(**TINY, tie_word_embeddings=tied)
    p = c.init(jax.random.key(0))
    flat = to_hf_names(p)
    assert ("lm_head.weight" in flat) != tied
    assert flat["model.layers.2.self_attn.k_proj.weight"].shape == (4, 8)
    np.testing.assert_array_equal(
        flat["model.layers.1.mlp.down_proj.weight"],
        p["model"]["layers"]["mlp"]["down_proj"]["weight"][1],
    )
    assert len(flat) == 9 * 3 + 2 + (0 if tied else 1)
    assert_trees_allclose(from_hf_names(flat, c), p)


def test_hf_names_match_transformers_state_dict():
    transformers = pytest.importorskip("transformers")
    c = LlamaConfig(**TINY)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**c.to_hf_config()))
    ours = to_hf_names(c.init(jax.random.key(0)))
    theirs = {k: tuple(v.shape) for k, v in hf.state_dict().items()}
    assert {k: v.shape for k, v in ours.items()} == theirs


def test_from_hf_names_errors():
    c = LlamaConfig(**TINY, tie_word_embeddings=True)
    flat = to_hf_names(c.init(jax.random.key(0)))
    missing = {k: v for k, v in flat.items() if "layers.1.mlp.up" not in k}
    with pytest.raises(FormatError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        from_hf_names(missing, c)
    bad = dict(flat, **{"model.norm.weight": jnp.ones(9)})
    with pytest.raises(ShapeError, match=r"model\.norm\.weight"):
        from_hf_names(bad, c)
    extra = dict(flat, **{"model.extra.weight": jnp.ones(1)})
    with pytest.raises(FormatError, match=r"model\.extra\.weight"):
        from_hf_names(extra, c)
    from_hf_names(extra, c, strict=False)
    # A stored copy of the tied head is accepted and ignored.
    tied_copy = dict(flat, **{"lm_head.weight": flat["model.embed_tokens.weight"]})
    p = from_hf_names(tied_copy, c, dtype=jnp.bfloat16)
    assert "lm_head" not in p
    assert p["model"]["norm"]["weight"].dtype == jnp.bfloat16


@pytest.mark.parametrize(
    "bad",
    [
        dict(num_heads=3),
        dict(num_kv_heads=3),
        dict(dtype="int8"),
        dict(param_dtype="half"),
        dict(num_layers=0),
        dict(head_dim=5),
    ],
)
def test_config_validation(bad):
    with pytest.raises(ConfigError):
        LlamaConfig(**{**TINY, **bad})
