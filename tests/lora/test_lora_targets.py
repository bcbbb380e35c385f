"""Target matching against PEFT's own matcher (no JAX involved)."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from entrenar.lora.config import target_matches

peft_utils = pytest.importorskip("peft.tuners.tuners_utils")
peft = pytest.importorskip("peft")

SEGMENTS = ["model", "layers", "0", "1", "self_attn", "mlp", "q_proj", "v_proj",
            "up_proj", "proj", "attn", "lm_head"]  # fmt: skip


@given(
    module=st.lists(st.sampled_from(SEGMENTS), min_size=1, max_size=5),
    target=st.lists(st.sampled_from(SEGMENTS), min_size=1, max_size=2),
)
def test_plain_targets_match_like_peft_lists(module, target):
    name, tgt = ".".join(module), ".".join(target)
    cfg = peft.LoraConfig(target_modules=[tgt])
    expected = bool(peft_utils.check_target_module_exists(cfg, name))
    assert target_matches(tgt, name, 2) == expected, (tgt, name)


def test_regex_targets_are_searched_and_all_linear_skips_heads():
    name = "model.layers.3.mlp.up_proj"
    assert target_matches(r"layers\.\d+\.mlp\..*", name, 2)
    assert target_matches(r"^model\.layers\.3\.mlp\.up_proj$", name, 2)
    assert not target_matches(r"layers\.\d+\.self_attn", name, 2)
    assert target_matches("all-linear", name, 2)
    assert not target_matches("all-linear", "lm_head", 2)
    assert not target_matches("all-linear", "model.embed_tokens", 2)
    assert not target_matches("all-linear", "model.layers.0.input_layernorm", 1)
