"""`base_quantizer` chooses, from a leaf's path and shape alone, what `lora.apply` does.

The reference is what `base_quantizer` did before (issue 31): trace `lora.apply` on a
one-leaf tree of `jax.ShapeDtypeStruct` (`jax.eval_shape`) and see whether it wraps
the leaf, an `EntrenarError` (no target matched, a target selecting only some layers
of a stack, a last axis that does not split into blocks) counting as no. The new
choice traces nothing, and must agree on every path, shape and target.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from entrenar import lora, native, quant
from entrenar.errors import EntrenarError
from entrenar.runs.models import BaseQuantize, base_quantizer

PATHS = [
    "model.layers.self_attn.q_proj.weight",
    "model.layers.self_attn.k_proj.weight",
    "model.layers.mlp.down_proj.weight",
    "model.layers.input_layernorm.weight",
    "model.layers.3.self_attn.q_proj.weight",
    "model.embed_tokens.weight",
    "model.norm.weight",
    "lm_head.weight",
    "transformer.h.attn.c_attn.weight",
    "model.layers.self_attn.q_proj.bias",
]
TARGETS = [
    "all-linear",
    ["q_proj", "v_proj"],
    [r"layers\.0\..*"],  # layer 0 only: refused for a stack of more than one
    ["lm_head", "embed_tokens"],
    ["input_layernorm"],
    ["c_attn"],
    [r".*proj"],
]
DIMS = st.sampled_from([1, 2, 3, 64, 96, 128])


def reference_selects(config: lora.LoRAConfig, path: str, shape) -> bool:
    """The choice as `base_quantizer` made it by tracing `lora.apply`."""
    tree = jax.ShapeDtypeStruct(shape, "float32")
    for key in reversed(path.split(".")):
        tree = {key: tree}

    def wrap(t):
        return lora.apply(
            t, config, key=jax.random.key(0), quantize=config.quantize_base
        )

    try:
        out = jax.eval_shape(wrap, tree)
    except EntrenarError:
        return False
    leaves = jax.tree_util.tree_leaves(
        out, is_leaf=lambda x: isinstance(x, lora.LoRAWeight)
    )
    return any(isinstance(x, lora.LoRAWeight) for x in leaves)


@given(
    path=st.sampled_from(PATHS),
    shape=st.lists(DIMS, min_size=1, max_size=4).map(tuple),
    targets=st.sampled_from(TARGETS),
    scheme=st.sampled_from(["nf4", "int4"]),
)
def test_the_choice_is_lora_applys(path, shape, targets, scheme):
    config = lora.LoRAConfig(rank=2, targets=targets, quantize_base=scheme)
    quantize = base_quantizer(config)
    assert quantize is not None
    fn = quantize(path, shape)
    assert (fn is not None) == reference_selects(config, path, shape)
    assert fn is None or fn == BaseQuantize(scheme)


@pytest.mark.parametrize(
    ("targets", "path", "shape", "chosen"),
    [
        ("all-linear", "model.layers.self_attn.q_proj.weight", (2, 64, 64), True),
        ("all-linear", "model.layers.self_attn.q_proj.weight", (2, 64, 96), False),
        ("all-linear", "model.layers.input_layernorm.weight", (2, 64), False),
        ("all-linear", "model.embed_tokens.weight", (256, 64), False),
        ([r"layers\.0\..*"], "model.layers.mlp.up_proj.weight", (2, 8, 64), False),
        ([r"layers\.0\..*"], "model.layers.mlp.up_proj.weight", (1, 8, 64), True),
    ],
)
def test_refusals_are_left_to_lora_apply(targets, path, shape, chosen):
    """A last axis not in blocks, or only some layers of a stack: not quantized."""
    config = lora.LoRAConfig(rank=2, targets=targets, quantize_base="nf4")
    assert reference_selects(config, path, shape) is chosen
    assert (base_quantizer(config)(path, shape) is not None) is chosen


def test_asking_traces_nothing():
    from jax import monitoring

    traced: list[str] = []
    monitoring.register_event_duration_secs_listener(
        lambda name, secs, **kw: traced.append(name) if "trace" in name else None
    )
    config = lora.LoRAConfig(rank=4, targets="all-linear", quantize_base="nf4")
    quantize = base_quantizer(config)
    before = len(traced)
    for path in PATHS:
        quantize(path, (3, 64, 128))
    assert len(traced) == before


def test_the_quantizer_is_quant_quantize_with_double_quantization():
    w = np.random.default_rng(0).standard_normal((2, 8, 64)).astype(np.float32)
    from entrenar import quant

    got = BaseQuantize("nf4")(w)
    want = quant.quantize(w, "nf4", double_quant=True)
    assert got.double_quant
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        np.testing.assert_array_equal(a, b)
    with native.policy("jax"):
        assert BaseQuantize("nf4").on_host(np.float32, np.float32) is None


MOE_PATHS = [
    "model.layers.mlp.experts.up_proj.weight",
    "model.layers.mlp.gate.weight",
    "model.layers.mlp.shared_expert_gate.weight",
]


def reference_quantizes(config: lora.LoRAConfig, path: str, shape) -> bool:
    """Whether tracing `lora.apply` leaves ``path`` 4-bit (wrapped or not).

    The tree also holds ``model.extra.target.weight``, which ``config`` targets,
    so that a leaf no target names still sees `apply` run (``quantize_untargeted``).
    """
    tree: dict = {"model": {"extra": {"target": {"weight": jax.ShapeDtypeStruct(
        (64, 64), "float32")}}}}  # fmt: skip
    node = tree
    keys = path.split(".")
    for key in keys[:-1]:
        node = node.setdefault(key, {})
    node[keys[-1]] = jax.ShapeDtypeStruct(shape, "float32")

    def wrap(t):
        return lora.apply(
            t, config, key=jax.random.key(0), quantize=config.quantize_base
        )

    try:
        out = jax.eval_shape(wrap, tree)
    except EntrenarError:
        return False
    for key in keys:
        out = out[key]
    base = out.base if isinstance(out, lora.LoRAWeight) else out
    return quant.is_quantized(base)


@given(
    path=st.sampled_from([*PATHS, *MOE_PATHS]),
    shape=st.lists(DIMS, min_size=1, max_size=4).map(tuple),
    targets=st.sampled_from(TARGETS),
    scheme=st.sampled_from(["nf4", "int4"]),
)
def test_the_untargeted_choice_is_lora_applys(path, shape, targets, scheme):
    """With ``quantize_untargeted`` the load quantizes what `lora.apply` would."""
    targets = [targets] if isinstance(targets, str) else targets
    config = lora.LoRAConfig(
        rank=2, targets=[*targets, "extra.target"], quantize_base=scheme,
        quantize_untargeted=True,
    )  # fmt: skip
    fn = base_quantizer(config)(path, shape)
    assert (fn is not None) == reference_quantizes(config, path, shape)
