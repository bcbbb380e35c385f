"""DeepSeek-V3 (`entrenar.nn.deepseek`) against transformers 5.25's model.

The registry's conformance tests (tests/nn/test_families.py) cover the tiny config
at 1e-4 with the routers' correction biases 0; here: float32 logits to a few 1e-6
with non-zero correction biases that change the choice of experts, the variants the
tiny config does not take (one ``q_proj``, rope pairs not interleaved, no YaRN,
every layer MoE, one group), full fine-tuning gradients of every weight, a Hugging
Face folder written with the Hub's per-expert names and read by transformers, the
multi-token-prediction layers a checkpoint holds, the attention paths with value
heads narrower than the keys, and the refusals.
"""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from entrenar import io, native, nn
from entrenar.errors import ConfigError, FormatError, UnsupportedError
from entrenar.nn.attention import cached_attention, dot_product_attention

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.usefixtures("quick_compiles")

ARCH = nn.architecture("deepseek_v3")
V2 = nn.architecture("deepseek_v2")
T = 12
_PLAIN = dict(rope_type="default", rope_factor=1.0, rope_mscale_all_dim=0.0,
              rope_original_max_position_embeddings=None, rope_attention_factor=None,
              first_k_dense_replace=0, n_group=1, topk_group=1, n_shared_experts=0,
              attention_bias=True, attention_out_bias=True)  # fmt: skip
VARIANTS = {  # (family, fields over its tiny config)
    "v3": ("deepseek_v3", {}),  # q_lora_rank, a dense layer, 4 groups, YaRN
    "v3-plain": ("deepseek_v3", dict(_PLAIN, q_lora_rank=None, rope_interleave=False,
                                     norm_topk_prob=False)),
    "v2": ("deepseek_v2", {}),  # q_proj, group-limited softmax, YaRN + mscale
    "v2-plain": ("deepseek_v2", dict(_PLAIN, q_lora_rank=8, topk_method="greedy")),
}  # fmt: skip


def _hf_model(config_dict, state=None):
    """A float32 eager transformers model: random weights 0.1 off, or ``state``."""
    cfg = transformers.AutoConfig.for_model(**config_dict)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).float().eval()
    if state is not None:
        model.load_state_dict(state)
        return model
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


def test_v2_groups_change_the_experts():
    """V2's group-limited choice (groups by their maximum) differs from greedy."""
    config = V2.tiny()
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(64, config.hidden_size)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(config.num_experts, config.hidden_size)))
    _, chosen = config.route(x, w, None)
    greedy = dataclasses.replace(config, topk_method="greedy")
    _, anywhere = greedy.route(x, w, None)
    assert (np.sort(chosen, -1) != np.sort(anywhere, -1)).any()
    groups = np.asarray(chosen) // (config.num_experts // config.n_group)
    assert max(len(set(g)) for g in groups.tolist()) <= config.topk_group


def test_the_correction_bias_and_the_groups_change_the_experts():
    """The tiny router's choice depends on both (so the logits test sees them)."""
    config = ARCH.tiny()
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(64, config.hidden_size)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(config.num_experts, config.hidden_size)))
    bias = jnp.asarray(0.3 * rng.normal(size=config.num_experts), jnp.float32)
    _, chosen = config.route(x, w, bias)
    _, unbiased = config.route(x, w, jnp.zeros_like(bias))
    flat = dataclasses.replace(config, n_group=1, topk_group=1)
    _, ungrouped = flat.route(x, w, bias)
    assert (np.sort(chosen, -1) != np.sort(unbiased, -1)).any()
    assert (np.sort(chosen, -1) != np.sort(ungrouped, -1)).any()
    groups = np.asarray(chosen) // (config.num_experts // config.n_group)
    assert max(len(set(g)) for g in groups.tolist()) <= config.topk_group


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


def test_a_folder_has_the_hubs_names_and_transformers_reads_it(case, tmp_path):
    config, params, model = case
    io.save_hf_folder(tmp_path, config, params)
    names = set()
    for f in tmp_path.glob("*.safetensors"):
        names |= set(io.read_safetensors(str(f))[0])
    last = config.num_layers - 1
    assert f"model.layers.{last}.mlp.experts.7.gate_proj.weight" in names
    bias = f"model.layers.{last}.mlp.gate.e_score_correction_bias"
    assert (bias in names) == (config.architecture == "deepseek_v3")
    if config.first_k_dense_replace:
        assert "model.layers.0.mlp.gate_proj.weight" in names
    back = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path), torch_dtype=torch.float32, attn_implementation="eager"
    ).eval()
    tokens, mask = _batch(config.vocab_size)
    np.testing.assert_array_equal(
        _torch_logits(back, tokens, mask), _torch_logits(model, tokens, mask)
    )
    folder, again = io.load_hf_folder(tmp_path)
    assert folder.config == config
    for a, b in zip(jax.tree.leaves(again), jax.tree.leaves(params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_multi_token_prediction_layers_are_skipped():
    config = dataclasses.replace(ARCH.tiny(), num_nextn_predict_layers=1)
    flat = nn.to_hf_names(config.init(jax.random.key(0)))
    n = config.num_layers
    mtp = {f"model.layers.{n}.eh_proj.weight": np.zeros((4, 4), np.float32)}
    nn.from_hf_names({**flat, **mtp}, config)
    without = dataclasses.replace(config, num_nextn_predict_layers=0)
    with pytest.raises(FormatError, match=f"model.layers.{n}.eh_proj"):
        nn.from_hf_names({**flat, **mtp}, without)


def test_cached_generation_with_per_row_positions():
    """Prompts of different lengths decode as they do alone (expanded K/V cache)."""
    config = ARCH.tiny()
    params = config.init(jax.random.key(1))
    rows = [[5, 9, 11, 3, 7], [8, 2]]
    batched = nn.generate(config, params, rows, max_new_tokens=4)
    for row, got in zip(rows, batched, strict=True):
        alone = nn.generate(config, params, [row], max_new_tokens=4)[0]
        np.testing.assert_array_equal(np.asarray(got), np.asarray(alone))


# ------------------------------------------------- value heads narrower than keys
def _qkv(seed, d=20, dv=10, h=4, t=6):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.normal(size=(2, t, h, d)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(2, t, h, d)), jnp.float32)
    v = jnp.asarray(rng.normal(size=(2, t, h, dv)), jnp.float32)
    return q, k, v


def _torch_attention(q, k, v, mask, scale):
    s = torch.einsum("bthd,bshd->bhts", *map(torch.from_numpy, map(np.asarray, (q, k))))
    s = (s * scale).masked_fill(~torch.from_numpy(np.asarray(mask)), float("-inf"))
    p = torch.softmax(s, -1)
    return torch.einsum("bhts,bshd->bthd", p, torch.from_numpy(np.asarray(v))).numpy()


@pytest.mark.parametrize("impl", ["native", "jax"])
def test_attention_takes_value_heads_of_another_width(impl, monkeypatch):
    """Forward and backward with ``d_v != d`` on the kernel and the JAX path."""
    from entrenar.nn import attention

    if impl == "jax":
        monkeypatch.setattr(attention, "_native_ok", lambda *a, **k: False)
    q, k, v = _qkv(0)
    mask = nn.causal_mask(jnp.arange(6), 6)
    if impl == "native":
        if not native.load("attention"):
            pytest.skip("no C++ compiler: the kernel is off")
        assert attention._native_ok(q, k, v, mask, None)
    got = dot_product_attention(q, k, v, mask, scale=0.3, impl="reference")
    want = _torch_attention(q, k, v, mask, 0.3)
    np.testing.assert_allclose(np.asarray(got), want, atol=2e-6)
    cot = jnp.asarray(np.random.default_rng(1).normal(size=got.shape), jnp.float32)

    def f(q, k, v):
        return jnp.sum(
            dot_product_attention(q, k, v, mask, scale=0.3, impl="reference") * cot
        )

    grads = jax.grad(f, argnums=(0, 1, 2))(q, k, v)
    tq, tk, tv = (torch.from_numpy(np.asarray(x)).requires_grad_() for x in (q, k, v))
    s = torch.einsum("bthd,bshd->bhts", tq, tk) * 0.3
    s = s.masked_fill(~torch.from_numpy(np.asarray(mask)), float("-inf"))
    o = torch.einsum("bhts,bshd->bthd", torch.softmax(s, -1), tv)
    (o * torch.from_numpy(np.asarray(cot))).sum().backward()
    for g, t in zip(grads, (tq, tk, tv), strict=True):
        np.testing.assert_allclose(np.asarray(g), t.grad.numpy(), atol=1e-5)


def test_cached_attention_takes_value_heads_of_another_width():
    from entrenar.nn import attention

    q, k, v = _qkv(2)
    kb, vb = jnp.stack([k * 0, k]), jnp.stack([v * 0, v])  # (2, B, S, H, ·)
    mask = nn.causal_mask(jnp.arange(6), 6)
    if native.load("attention"):  # the kernel reads the layer in place
        assert attention._native_ok(q, k, v, mask, None)
    got = cached_attention(q, kb, vb, jnp.int32(1), mask, scale=0.3)
    np.testing.assert_allclose(
        np.asarray(got), _torch_attention(q, k, v, mask, 0.3), atol=2e-6
    )


def test_fused_attention_pads_the_values():
    """``attention_impl="fused"`` (jax.nn.dot_product_attention) on the CPU."""
    config = ARCH.tiny()
    params = config.init(jax.random.key(2))
    tokens, mask = _batch(config.vocab_size)
    want = config.apply(params, jnp.asarray(tokens), mask=jnp.asarray(mask))
    fused = dataclasses.replace(config, attention_impl="fused")
    assert fused.uses_fused_attention()
    got = fused.apply(params, jnp.asarray(tokens), mask=jnp.asarray(mask))
    np.testing.assert_allclose(np.asarray(got)[mask], np.asarray(want)[mask], atol=2e-5)


# ------------------------------------------------------------------ bad input
def test_a_quantized_checkpoint_is_refused_by_name():
    hf = ARCH.to_hf(ARCH.tiny()) | {
        "quantization_config": {"quant_method": "fp8", "fmt": "e4m3"}
    }
    with pytest.raises(UnsupportedError, match=r"quant_method 'fp8'.*bfloat16"):
        ARCH.from_hf(hf)


def test_other_routing_methods_are_refused():
    hf = ARCH.to_hf(ARCH.tiny()) | {"scoring_func": "softmax"}
    with pytest.raises(UnsupportedError, match="scoring_func 'softmax'"):
        ARCH.from_hf(hf)
    v2 = V2.to_hf(V2.tiny())
    with pytest.raises(UnsupportedError, match="topk_method 'noaux_tc'"):
        V2.from_hf(v2 | {"topk_method": "noaux_tc"})
    with pytest.raises(UnsupportedError, match="norm_topk_prob true"):
        V2.from_hf(v2 | {"norm_topk_prob": True})
    with pytest.raises(UnsupportedError, match=r"deepseek_v2's config\.json cannot"):
        V2.to_hf(ARCH.tiny())  # sigmoid routing under V2's name


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        (dict(num_kv_heads=2), "num_kv_heads must equal num_heads"),
        (dict(head_dim=16), "head_dim is the rotary width"),
        (dict(n_group=3), "n_group 3 must divide"),
        (dict(topk_group=5), "topk_group must be in"),
        (dict(num_experts_per_tok=5, topk_group=1), "exceeds the experts"),
        (dict(v_head_dim=40), "v_head_dim 40 exceeds"),
        (dict(first_k_dense_replace=4), "first_k_dense_replace must be in"),
        (dict(output_router_logits=True), "output_router_logits"),
        (dict(scoring_func="softmax"), "topk_method 'noaux_tc' with scoring_func"),
    ],
)
def test_config_errors_name_the_field(fields, named):
    with pytest.raises(ConfigError, match=named):
        dataclasses.replace(ARCH.tiny(), **fields)


def test_a_llama_config_cannot_be_a_deepseek_model():
    with pytest.raises(
        ConfigError, match=r"not a LlamaConfig family \(it is a DeepseekConfig\)"
    ):
        nn.LlamaConfig(architecture="deepseek_v3")


def test_gguf_is_llama_cpps_deepseek2(tmp_path):
    """Both families are llama.cpp's deepseek2 (tests/io/test_gguf_deepseek.py)."""
    assert nn.architecture_for_gguf("deepseek2", "m.gguf").name == "deepseek_v3"
    config = ARCH.tiny()
    io.save_llama_gguf(tmp_path / "m.gguf", config, config.init(jax.random.key(0)))
    assert io.read_gguf(tmp_path / "m.gguf").metadata["general.architecture"] == (
        "deepseek2"
    )


def test_the_config_round_trips_a_hub_style_file():
    """Moonlight-16B-A3B's config.json keys (rope_scaling null, q_lora_rank null)."""
    hub = {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
        "vocab_size": 163840, "hidden_size": 2048, "intermediate_size": 11264,
        "moe_intermediate_size": 1408, "num_hidden_layers": 27,
        "num_attention_heads": 16, "num_key_value_heads": 16, "n_shared_experts": 2,
        "n_routed_experts": 64, "routed_scaling_factor": 2.446, "kv_lora_rank": 512,
        "q_lora_rank": None, "qk_rope_head_dim": 64, "v_head_dim": 128,
        "qk_nope_head_dim": 128, "topk_method": "noaux_tc", "n_group": 1,
        "topk_group": 1, "num_experts_per_tok": 6, "first_k_dense_replace": 1,
        "norm_topk_prob": True, "scoring_func": "sigmoid", "hidden_act": "silu",
        "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 50000.0,
        "rope_scaling": None, "tie_word_embeddings": False,
    }  # fmt: skip
    config = ARCH.from_hf(json.loads(json.dumps(hub)))
    assert (config.qk_head_dim, config.hd, config.expert_size) == (192, 64, 1408)
    assert ARCH.from_hf(ARCH.to_hf(config)) == config
    written = transformers.AutoConfig.for_model(**ARCH.to_hf(config)).to_dict()
    assert ARCH.from_hf(written) == config


def test_a_v2_lite_config_reads():
    """DeepSeek-V2-Lite's config.json keys (q_lora_rank null, greedy, YaRN 40)."""
    hub = {
        "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2",
        "vocab_size": 102400, "hidden_size": 2048, "intermediate_size": 10944,
        "moe_intermediate_size": 1408, "num_hidden_layers": 27,
        "num_attention_heads": 16, "num_key_value_heads": 16, "n_shared_experts": 2,
        "n_routed_experts": 64, "routed_scaling_factor": 1.0, "kv_lora_rank": 512,
        "q_lora_rank": None, "qk_rope_head_dim": 64, "v_head_dim": 128,
        "qk_nope_head_dim": 128, "topk_method": "greedy", "n_group": 1,
        "topk_group": 1, "num_experts_per_tok": 6, "first_k_dense_replace": 1,
        "norm_topk_prob": False, "scoring_func": "softmax", "hidden_act": "silu",
        "max_position_embeddings": 163840, "rms_norm_eps": 1e-6,
        "rope_theta": 10000, "tie_word_embeddings": False,
        "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40,
                         "mscale": 0.707, "mscale_all_dim": 0.707,
                         "original_max_position_embeddings": 4096, "type": "yarn"},
    }  # fmt: skip
    config = V2.from_hf(hub)
    assert config.rope_attention_factor == pytest.approx(1.0)  # mscale ratio
    m = 0.1 * 0.707 * np.log(40) + 1  # the softmax scale's YaRN factor
    assert config.softmax_scale() == pytest.approx(192**-0.5 * m * m)
    assert V2.from_hf(V2.to_hf(config)) == config
    written = transformers.AutoConfig.for_model(**V2.to_hf(config)).to_dict()
    assert V2.from_hf(written) == config


def test_per_layer_shapes_spell_out_the_list_of_layers():
    from entrenar.nn.hf_names import per_layer_shapes

    config = ARCH.tiny()
    flat = nn.to_hf_names(config.init(jax.random.key(0)))
    assert per_layer_shapes(config) == {k: tuple(v.shape) for k, v in flat.items()}


_DEPTH_PROBE = """
import json, sys
import entrenar  # sets XLA:CPU's memory-minimising scheduler before JAX starts
import jax, jax.numpy as jnp
from entrenar import nn

def temp(layers):
    cfg = nn.architecture("deepseek_v3").make_config(
        vocab_size=512, hidden_size=128, num_layers=layers, num_heads=4,
        num_kv_heads=4, intermediate_size=512, moe_intermediate_size=64,
        num_experts=8, num_experts_per_tok=2, n_shared_experts=1,
        first_k_dense_replace=1, n_group=1, topk_group=1, q_lora_rank=None,
        kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
        remat_policy="nothing_saveable", matmul_dtype="bfloat16")
    params = jax.eval_shape(cfg.init, jax.random.key(0))
    tokens = jax.ShapeDtypeStruct((1, 256), jnp.int32)
    def loss(p, t):
        return jnp.mean(jax.nn.logsumexp(cfg.apply(p, t).astype(jnp.float32), -1))
    compiled = jax.jit(jax.grad(loss)).lower(params, tokens).compile()
    return compiled.memory_analysis().temp_size_in_bytes

print(json.dumps([temp(2), temp(6)]))
"""


def _fresh_python(code, **env):
    """``code``'s last line of output, run by a new interpreter (XLA not started)."""
    import os
    import subprocess
    import sys

    base = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    res = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=False,
        env=base | {"JAX_PLATFORMS": "cpu", "JAX_COMPILATION_CACHE_DIR": ""} | env,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    return res.stdout.strip().splitlines()[-1]


@pytest.mark.slow
def test_step_temporaries_do_not_grow_with_each_unrolled_layer():
    """The layers run unrolled; their step's temporaries stay near one layer's.

    XLA:CPU's breadth-first (concurrency) scheduler ran every layer's
    rematerialisation and zero-initialised scan buffers at once: 10.2 / 29.8 MB of
    temporaries at 2 / 6 layers (x2.9). With the memory-minimising scheduler
    ``import entrenar`` selects: 4.9 / 6.4 MB (x1.3); the bound is x1.6.
    """
    t2, t6 = json.loads(_fresh_python(_DEPTH_PROBE))
    assert t6 < 1.6 * t2, (t2, t6)


def test_a_scheduler_flag_of_the_users_is_kept():
    """``import entrenar`` adds its scheduler flag to XLA_FLAGS, or keeps the user's."""
    code = "import os, entrenar; print(repr(os.environ['XLA_FLAGS']))"
    added = _fresh_python(code)
    assert added == repr("--xla_cpu_enable_concurrency_optimized_scheduler=false")
    mine = "--xla_force_host_platform_device_count=2"
    assert _fresh_python(code, XLA_FLAGS=mine) == repr(
        f"{mine} --xla_cpu_enable_concurrency_optimized_scheduler=false"
    )
    theirs = "--xla_cpu_enable_concurrency_optimized_scheduler=true"
    assert _fresh_python(code, XLA_FLAGS=theirs) == repr(theirs)


@pytest.mark.skipif(
    not native.load("attention"), reason="no C++ compiler: the kernel is off"
)
def test_dots_saveable_keeps_the_attention_kernels_forward():
    """``dots_saveable`` saves the native attention's named outputs, as for Llama.

    DeepSeek's layers take `LlamaConfig._remat`; before, their own copy of the
    policy lacked `attention.ATTENTION_NAME`, and the backward pass ran each
    layer's forward kernel again (6 forward calls for 3 layers).
    """
    cfg = dataclasses.replace(
        nn.architecture("deepseek_v3").tiny(), remat_policy="dots_saveable"
    )
    params = cfg.init(jax.random.key(0))
    tokens = jnp.arange(16).reshape(2, 8) % cfg.vocab_size

    def loss(p):
        return jnp.mean(cfg.apply(p, tokens) ** 2)

    hlo = jax.jit(jax.grad(loss)).lower(params).compile().as_text()
    n = cfg.num_layers
    assert hlo.count('custom_call_target="entrenar_attention_fwd"') == n
    assert hlo.count('custom_call_target="entrenar_attention_bwd"') == n
