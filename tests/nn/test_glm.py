"""GLM, GLM-4 and GLM-4.5 (`entrenar.nn.glm`, `entrenar.nn.glm4_moe`) vs transformers.

The registry's conformance tests (tests/nn/test_families.py) cover the tiny configs
at 1e-4: logits, cached generation, LoRA and DoRA against PEFT. Here: float32 logits
to a few 1e-6 with GLM-4.5's correction biases non-zero (they change the choice),
a GLM-4.5 variant without dense layers, groups, q/k norms, biases or shared experts,
full fine-tuning gradients of every weight, a Hugging Face folder written by
entrenar read by transformers, the multi-token-prediction layer of the Hub's
checkpoints skipped, GLM's interleaved rotary against transformers' own function,
``partial_rotary_factor``'s default, and the refusals.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from entrenar import io, nn
from entrenar.errors import ConfigError, FormatError, UnsupportedError
from entrenar.io.glm4moe_gguf import glm4moe_keys
from entrenar.nn.glm4_moe import Glm4MoeConfig
from entrenar.nn.rope import interleaved_as_halves, rope_tables, rotate

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.usefixtures("quick_compiles")

MOE = nn.architecture("glm4_moe")
T = 12
VARIANTS = {  # (family, fields over its tiny config)
    "glm": ("glm", {}),
    "glm4": ("glm4", {}),
    "glm4_moe": ("glm4_moe", {}),  # a dense layer, 4 groups, q/k norms, biases
    "glm4_moe-plain": ("glm4_moe", dict(
        first_k_dense_replace=0, n_group=1, topk_group=1, qk_norm=False,
        attention_bias=False, norm_topk_prob=False, n_shared_experts=0,
        num_nextn_predict_layers=0,
    )),
}  # fmt: skip


def _hf_model(config_dict):
    """A float32 eager transformers model, weights and correction biases 0.1 off."""
    cfg = transformers.AutoConfig.for_model(**config_dict)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).float().eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=gen))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # a buffer: 0 otherwise
                b.copy_(0.3 * torch.randn(b.shape, generator=gen))
    return model


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def case(request):
    """``(config, params, transformers model)`` of one variant."""
    family, fields = VARIANTS[request.param]
    arch = nn.architecture(family)
    config = dataclasses.replace(arch.tiny(), **fields)
    model = _hf_model(arch.to_hf(config))
    flat = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    return config, nn.from_hf_names(flat, config), model


def _batch(vocab):
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, vocab, size=(2, T)).astype(np.int64)
    mask = np.ones((2, T), bool)
    mask[1, :3] = False  # left padding
    return tokens, mask


def _torch_logits(model, tokens, mask):
    with torch.no_grad():
        out = model(
            torch.from_numpy(tokens), attention_mask=torch.from_numpy(mask.astype(int))
        )
    return out.logits.numpy()


def test_logits_equal_transformers_in_float32(case):
    config, params, model = case
    tokens, mask = _batch(config.vocab_size)
    want = _torch_logits(model, tokens, mask)
    got = np.asarray(
        jax.jit(config.apply)(params, jnp.asarray(tokens), mask=jnp.asarray(mask))
    )
    assert np.abs(want[mask]).max() > 0.5  # not a degenerate model
    np.testing.assert_allclose(got[mask], want[mask], atol=5e-6, rtol=1e-5)


def test_full_finetuning_gradients_equal_transformers(case):
    """Every weight's gradient of the masked next-token loss, as torch's."""
    config, params, model = case
    tokens, mask = _batch(config.vocab_size)

    def loss(p):
        logits = config.apply(p, jnp.asarray(tokens), mask=jnp.asarray(mask))
        logp = jax.nn.log_softmax(logits[:, :-1], axis=-1)
        picked = jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]
        w = jnp.asarray(mask[:, 1:] & mask[:, :-1], jnp.float32)
        return -jnp.sum(picked * w) / jnp.sum(w)

    ours = nn.to_hf_names(jax.jit(jax.grad(loss))(params))
    model.zero_grad()
    logits = model(
        torch.from_numpy(tokens), attention_mask=torch.from_numpy(mask.astype(int))
    ).logits
    logp = torch.log_softmax(logits[:, :-1], -1)
    picked = logp.gather(-1, torch.from_numpy(tokens[:, 1:, None]))[..., 0]
    w = torch.from_numpy((mask[:, 1:] & mask[:, :-1]).astype(np.float32))
    (-(picked * w).sum() / w.sum()).backward()
    i = config.expert_size
    checked = 0
    for name, p in model.named_parameters():
        if not p.numel():  # n_shared_experts 0: transformers' empty shared MLP
            continue
        g = p.grad.numpy()
        if name.endswith("experts.gate_up_proj"):  # (E, 2I, D): [gate; up]
            base = name.removesuffix("gate_up_proj")
            pairs = [(base + "gate_proj.weight", g[:, :i]),
                     (base + "up_proj.weight", g[:, i:])]  # fmt: skip
        elif name.endswith("experts.down_proj"):  # (E, D, I), as the tree's
            pairs = [(name + ".weight", g)]
        else:
            pairs = [(name, g)]
        for key, want in pairs:
            np.testing.assert_allclose(
                np.asarray(ours[key]), want, atol=2e-6, rtol=1e-4, err_msg=key
            )
            checked += 1
    biases = [k for k in ours if k.endswith("e_score_correction_bias")]
    assert checked + len(biases) == len(ours)
    for k in biases:  # the choice only: no gradient reaches it
        assert not np.asarray(ours[k]).any()


def test_a_folder_transformers_reads(case, tmp_path):
    """A folder written by entrenar: transformers' logits bit for bit, and back."""
    config, params, model = case
    io.save_hf_folder(tmp_path, config, params)
    names = set()
    for f in tmp_path.glob("*.safetensors"):
        names |= set(io.read_safetensors(str(f))[0])
    last = config.num_layers - 1
    if config.num_experts:  # the Hub's per-expert names
        assert f"model.layers.{last}.mlp.experts.7.gate_proj.weight" in names
        assert f"model.layers.{last}.mlp.gate.e_score_correction_bias" in names
    else:  # GLM's fused gate_up_proj, GLM-4's four norms
        assert "model.layers.0.mlp.gate_up_proj.weight" in names
        post = "model.layers.0.post_mlp_layernorm.weight"
        assert (post in names) == (config.architecture == "glm4")
    back = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path), dtype=torch.float32, attn_implementation="eager"
    ).eval()
    tokens, mask = _batch(config.vocab_size)
    np.testing.assert_array_equal(
        _torch_logits(back, tokens, mask), _torch_logits(model, tokens, mask)
    )
    folder, again = io.load_hf_folder(tmp_path)
    assert folder.config == config
    for a, b in zip(jax.tree.leaves(again), jax.tree.leaves(params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_the_correction_bias_and_the_groups_change_the_experts():
    """The tiny router's choice depends on both (so the logits test sees them)."""
    config = MOE.tiny()
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(64, config.hidden_size)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(config.num_experts, config.hidden_size)))
    bias = jnp.asarray(0.3 * rng.normal(size=config.num_experts), jnp.float32)
    _, chosen = config.route(x, w, bias)
    _, unbiased = config.route(x, w, jnp.zeros_like(bias))
    _, ungrouped = dataclasses.replace(config, n_group=1, topk_group=1).route(
        x, w, bias
    )
    assert (np.sort(chosen, -1) != np.sort(unbiased, -1)).any()
    assert (np.sort(chosen, -1) != np.sort(ungrouped, -1)).any()


def test_the_multi_token_prediction_layer_is_skipped():
    """The Hub's GLM-4.5 files hold layer ``L`` (``num_nextn_predict_layers``)."""
    config = MOE.tiny()
    assert config.num_nextn_predict_layers == 1
    flat = nn.to_hf_names(config.init(jax.random.key(0)))
    n, d = config.num_layers, config.hidden_size
    mtp = {
        f"model.layers.{n}.eh_proj.weight": np.zeros((d, 2 * d), np.float32),
        f"model.layers.{n}.enorm.weight": np.ones(d, np.float32),
        f"model.layers.{n}.self_attn.q_proj.weight": np.zeros((64, d), np.float32),
    }
    nn.from_hf_names({**flat, **mtp}, config)
    without = dataclasses.replace(config, num_nextn_predict_layers=0)
    with pytest.raises(FormatError, match=f"model.layers.{n}."):
        nn.from_hf_names({**flat, **mtp}, without)


def test_interleaved_rotary_is_transformers_glm_rotary():
    """Rotating the pairs as halves gives transformers' GLM scores."""
    from transformers.models.glm import modeling_glm

    rng = np.random.default_rng(0)
    q = rng.normal(size=(1, 5, 2, 16)).astype(np.float32)  # (B, T, H, d)
    k = rng.normal(size=(1, 5, 2, 16)).astype(np.float32)
    r = 8  # partial_rotary_factor 0.5
    cos, sin = rope_tables(jnp.arange(5), r, 10000.0, jnp.float32)
    ours_q = rotate(interleaved_as_halves(jnp.asarray(q), r), (cos, sin))
    ours_k = rotate(interleaved_as_halves(jnp.asarray(k), r), (cos, sin))
    tc = torch.from_numpy(np.array(cos)[:, :, 0])  # (1, T, r)
    ts = torch.from_numpy(np.array(sin)[:, :, 0])
    tq, tk = modeling_glm.apply_rotary_pos_emb(
        torch.from_numpy(q).transpose(1, 2), torch.from_numpy(k).transpose(1, 2),
        tc, ts,
    )  # (B, H, T, d)  # fmt: skip
    want = torch.einsum("bhtd,bhsd->bhts", tq, tk).numpy()
    got = np.einsum("bthd,bshd->bhts", np.asarray(ours_q), np.asarray(ours_k))
    np.testing.assert_allclose(got, want, atol=1e-5)
    flat = rotate(jnp.asarray(q), (cos, sin))  # halves: other scores
    other = np.einsum("bthd,bshd->bhts", np.asarray(flat), np.asarray(ours_k))
    assert np.abs(other - want).max() > 1e-2


@pytest.mark.parametrize("family", ["glm", "glm4", "glm4_moe"])
def test_the_partial_rotary_factor_defaults_to_a_half(family):
    """The GLM configs of transformers set 0.5 when a file has none; a file's wins."""
    arch = nn.architecture(family)
    hf = arch.to_hf(arch.tiny())
    del hf["partial_rotary_factor"]
    assert arch.from_hf(hf).partial_rotary_factor == 0.5
    hf["rope_parameters"] = {"rope_type": "default", "rope_theta": 1e4,
                             "partial_rotary_factor": 0.25}  # fmt: skip
    del hf["rope_scaling"]
    assert arch.from_hf(hf).partial_rotary_factor == 0.25
    written = transformers.AutoConfig.for_model(**arch.to_hf(arch.tiny())).to_dict()
    assert arch.from_hf(written) == arch.tiny()


# ------------------------------------------------------------------ bad input
def test_glm4_moe_refusals_name_the_field():
    hf = MOE.to_hf(MOE.tiny())
    with pytest.raises(UnsupportedError, match=r"quant_method 'fp8'.*bfloat16"):
        MOE.from_hf(hf | {"quantization_config": {"quant_method": "fp8"}})
    with pytest.raises(UnsupportedError, match="output_router_logits"):
        MOE.from_hf(hf | {"output_router_logits": True})
    with pytest.raises(UnsupportedError, match="hidden_act 'gelu'"):
        MOE.from_hf(hf | {"hidden_act": "gelu"})
    with pytest.raises(ConfigError, match=r"does not take \['sliding_window'\]"):
        dataclasses.replace(MOE.tiny(), sliding_window=4)
    with pytest.raises(ConfigError, match=r"does not take \['rope_interleave'\]"):
        dataclasses.replace(MOE.tiny(), rope_interleave=True)
    with pytest.raises(ConfigError, match="n_group 3 must divide"):
        dataclasses.replace(MOE.tiny(), n_group=3)
    assert isinstance(MOE.tiny(), Glm4MoeConfig)


@pytest.mark.parametrize(
    ("family", "fields", "named"),
    [
        ("glm", dict(rope_interleave=False), "rope_interleave must be True"),
        ("glm4", dict(glm_norms=False), "glm_norms must be True"),
        ("glm", dict(glm_norms=True), "glm_norms must be False"),
        ("glm4", dict(fused_gate_up=False), "fused_gate_up must be True"),
        ("glm4", dict(mlp_bias=True), "mlp_bias=True has no Glm4"),
    ],
)
def test_a_glm_file_cannot_hold_other_switches(family, fields, named):
    arch = nn.architecture(family)
    with pytest.raises(UnsupportedError, match=named):
        arch.to_hf(dataclasses.replace(arch.tiny(), **fields))


def test_the_norm_switches_exclude_each_other():
    with pytest.raises(ConfigError, match="exclude each other"):
        dataclasses.replace(nn.architecture("glm4").tiny(), sandwich_norms=True)


def test_glm4moe_is_the_gguf_name_of_glm4_moe():
    """llama.cpp's glm4moe is read and written (tests/io/test_gguf_glm4moe.py)."""
    assert nn.architecture_for_gguf("glm4moe", "x.gguf").name == "glm4_moe"


AIR = {  # GLM-4.5-Air's config.json (the Hub's keys, transformers 4.x style)
    "architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe",
    "attention_bias": True, "first_k_dense_replace": 1, "head_dim": 128,
    "hidden_act": "silu", "hidden_size": 4096, "intermediate_size": 10944,
    "max_position_embeddings": 131072, "moe_intermediate_size": 1408, "n_group": 1,
    "n_routed_experts": 128, "n_shared_experts": 1, "norm_topk_prob": True,
    "num_attention_heads": 96, "num_experts_per_tok": 8, "num_hidden_layers": 46,
    "num_key_value_heads": 8, "num_nextn_predict_layers": 1,
    "partial_rotary_factor": 0.5, "rms_norm_eps": 1e-05, "rope_scaling": None,
    "rope_theta": 1000000, "routed_scaling_factor": 1.0, "tie_word_embeddings": False,
    "topk_group": 1, "torch_dtype": "bfloat16", "use_qk_norm": False,
    "vocab_size": 151552,
}  # fmt: skip


@pytest.mark.parametrize(
    ("fields", "billions"),
    [
        ({}, (105, 108)),  # GLM-4.5-Air: 106B without its MTP layer
        (dict(hidden_size=5120, intermediate_size=12288, moe_intermediate_size=1536,
              n_routed_experts=160, num_hidden_layers=92, first_k_dense_replace=3,
              routed_scaling_factor=2.5, use_qk_norm=True), (350, 356)),  # GLM-4.5
    ],
)  # fmt: skip
def test_a_hub_style_config_reads(fields, billions):
    hf = AIR | fields
    config = nn.architecture_for_hf(hf, "config.json").from_hf(hf)
    assert isinstance(config, Glm4MoeConfig)
    assert (config.hd, config.rotary_dim) == (128, 64)
    assert config.num_nextn_predict_layers == 1
    assert config.qk_norm == hf["use_qk_norm"]
    assert billions[0] < config.num_params() / 1e9 < billions[1]
    assert MOE.from_hf(MOE.to_hf(config)) == config
    keys = {k: f.value for k, f in glm4moe_keys(config, 1).items()}  # the converter's
    assert keys["glm4moe.block_count"] == hf["num_hidden_layers"] + 1
    assert keys["glm4moe.nextn_predict_layers"] == 1
    assert keys["glm4moe.rope.dimension_count"] == 64
    assert keys["glm4moe.attention.key_length"] == 128
    assert keys["glm4moe.leading_dense_block_count"] == hf["first_k_dense_replace"]
    assert keys["glm4moe.expert_group_count"] == keys["glm4moe.expert_group_used_count"]
    assert keys["glm4moe.expert_weights_scale"] == hf["routed_scaling_factor"]
