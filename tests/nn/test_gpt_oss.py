"""gpt-oss against transformers 5.25's ``GptOssForCausalLM`` and its pieces.

The registry-driven tests cover the tiny family (logits, cached and greedy
generation, LoRA/DoRA against PEFT, HF round trips; tests/train/test_moe_training.py
full fine-tuning, expert LoRA and QLoRA). Here: a folder transformers' own
``save_pretrained`` wrote (float32 and bfloat16) loads to its logits; the attention
sinks on every attention path against transformers' ``eager_attention_forward``
(values and gradients); the clamped SwiGLU against ``GptOssExperts._apply_gate``;
the Hub's config.json keys; MXFP4 experts (the Hub's files) against transformers'
dequantization and load, and loaded as NF4 for QLoRA.
"""

import dataclasses
import json

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from entrenar import io, nn
from entrenar.errors import ConfigError, FormatError, UnsupportedError
from entrenar.nn import attention
from entrenar.nn.attention import cached_attention, causal_mask, dot_product_attention
from entrenar.nn.fused_attention import fused_attention
from entrenar.nn.moe import clamped_swiglu
from entrenar.nn.mxfp4 import dequantize_hf, quantize_hf

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
gpt_oss = pytest.importorskip("transformers.models.gpt_oss.modeling_gpt_oss")
safetensors_torch = pytest.importorskip("safetensors.torch")

T = 12  # longer than the tiny sliding window (4)


def _hf_model(config, seed=1):
    """The transformers model of ``config`` (float32, eager), weights off 0 / 1."""
    hf_dict = nn.architecture("gpt_oss").to_hf(config)
    hf_cfg = transformers.AutoConfig.for_model(**hf_dict)
    hf_cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(hf_cfg).float().eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=gen))
    return model


def _batch(vocab):
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, vocab, size=(2, T)).astype(np.int64)
    mask = np.ones((2, T), bool)
    mask[1, :3] = False  # left padding
    return tokens, mask


def _logits(model, tokens, mask):
    kw = {"attention_mask": torch.from_numpy(mask.astype(int))}
    with torch.no_grad():
        return model(torch.from_numpy(tokens), **kw).logits.float().numpy()


def _folder_equals_transformers(path, config):
    """Load ``path`` with entrenar and transformers; the logits agree within 1e-5.

    Returns transformers' model and entrenar's parameters for further checks.
    """
    want_model = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    info, params = io.load_hf_folder(path, dtype="float32")
    assert info.config == dataclasses.replace(config, max_position_embeddings=2048)
    tokens, mask = _batch(config.vocab_size)
    want = _logits(want_model, tokens, mask)
    got = np.asarray(info.config.apply(params, jnp.asarray(tokens), mask=mask))
    assert np.abs(want[mask]).max() > 0.5
    np.testing.assert_allclose(got[mask], want[mask], atol=1e-5, rtol=1e-5)
    return want_model, params


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_transformers_folder_gives_its_logits(dtype, tmp_path):
    """A ``save_pretrained`` folder (transformers' layout) loads to its logits.

    float32: within 1e-5 of transformers in float32 (measured 6.6e-7). bfloat16
    weights: both sides compute in float32 from the same rounded weights.
    """
    config = nn.architecture("gpt_oss").tiny()
    model = _hf_model(config)
    model.to(getattr(torch, dtype)).save_pretrained(tmp_path)
    _folder_equals_transformers(tmp_path, config)


def test_the_tiny_models_clamp_is_reached():
    """The tiny family's limit (0.5) changes the logits: the clamp is exercised."""
    config = nn.architecture("gpt_oss").tiny()
    model = _hf_model(config)
    flat = {k: v.numpy() for k, v in model.state_dict().items()}
    params = nn.from_hf_names(flat, config)
    tokens, mask = _batch(config.vocab_size)
    loose = dataclasses.replace(config, swiglu_limit=1e3)
    a = np.asarray(config.apply(params, jnp.asarray(tokens), mask=mask))
    b = np.asarray(loose.apply(params, jnp.asarray(tokens), mask=mask))
    assert np.abs(a - b)[mask].max() > 1e-2


# ------------------------------------------------------------- attention sinks
class _Module(torch.nn.Module):
    """What transformers' ``eager_attention_forward`` reads of its module."""

    def __init__(self, sinks, groups):
        super().__init__()
        self.sinks = torch.nn.Parameter(sinks)
        self.num_key_value_groups = groups


def _torch_attention(q, k, v, allowed, sinks, scale):
    """The eager attention of transformers: ``(o (B, T, H, d), grads)``."""
    qt, kt, vt = (torch.tensor(x, requires_grad=True) for x in (q, k, v))
    module = _Module(torch.tensor(sinks), q.shape[2] // k.shape[2]).eval()
    add = torch.where(torch.from_numpy(allowed), 0.0, torch.finfo(torch.float32).min)
    o, _ = gpt_oss.eager_attention_forward(
        module, qt.transpose(1, 2), kt.transpose(1, 2), vt.transpose(1, 2),
        add[:, None], scaling=scale,
    )  # fmt: skip
    (o * torch.from_numpy(_weights(o.shape))).sum().backward()
    grads = [x.grad.numpy() for x in (qt, kt, vt)] + [module.sinks.grad.numpy()]
    return o.detach().numpy(), grads


def _weights(shape):
    return np.random.default_rng(9).normal(size=tuple(shape)).astype(np.float32)


def _inputs(b=2, t=7, s=7, h=4, kv=2, d=8):
    rng = np.random.default_rng(3)
    q = rng.normal(size=(b, t, h, d)).astype(np.float32)
    k = rng.normal(size=(b, s, kv, d)).astype(np.float32)
    v = rng.normal(size=(b, s, kv, d)).astype(np.float32)
    sinks = rng.normal(size=(h,)).astype(np.float32) * 2
    return q, k, v, sinks


@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("path", ["jax", "reference", "fused", "cached"])
def test_attention_sinks_equal_transformers_eager(path, window):
    """Sinks on each attention path: values and gradients (q, k, v, sinks).

    A left-padded row (its first keys masked) and, with ``window``, a sliding
    window; ``jax`` appends the sink as a score column, ``reference`` runs the
    native kernel where it is built (the sink as a key, `sink_key`), ``fused``
    takes the window and causality as the kernel's flags.
    """
    q, k, v, sinks = _inputs()
    b, t, _, d = q.shape
    pos = jnp.arange(t)
    allowed = np.array(causal_mask(pos, t))  # (T, S)
    if window is not None:
        allowed &= (np.arange(t)[:, None] - np.arange(t)[None, :]) < window
    pad = np.ones((b, t), bool)
    pad[1, :2] = False
    full = allowed[None] & pad[:, None, :]  # (B, T, S)
    scale = d**-0.5
    want, want_grads = _torch_attention(q, k, v, full, sinks, scale)

    def run(q, k, v, z):
        if path == "jax":  # the score column (reference: the kernel's sink key)
            return attention._attention_jax(
                q, k, v, jnp.asarray(full), None, scale, None, sinks=z
            )
        if path == "reference":
            return dot_product_attention(
                q, k, v, jnp.asarray(full), sinks=z, impl="reference"
            )
        if path == "fused":
            return fused_attention(
                q, k, v, jnp.asarray(pad[:, None, :]), causal=True, window=window,
                sinks=z, implementation="xla",
            )  # fmt: skip
        buf_k = jnp.stack([jnp.zeros_like(k), k])  # layer 1 of two
        buf_v = jnp.stack([jnp.zeros_like(v), v])
        return cached_attention(q, buf_k, buf_v, 1, jnp.asarray(full), sinks=z)

    @jax.jit  # one program: op by op, each of its operations compiled apart
    def value_and_vjp(q, k, v, z, ct):
        out, vjp = jax.vjp(run, q, k, v, z)
        return out, vjp(ct)

    ct = jnp.asarray(_weights((b, t, q.shape[2], d)))  # (B, T, H, d)
    got, grads = value_and_vjp(*(jnp.asarray(x) for x in (q, k, v, sinks)), ct)
    rows = pad[:, :, None, None].repeat(4, 2)  # padded queries: no key allowed
    np.testing.assert_allclose(
        np.asarray(got)[rows.repeat(d, 3)], want[rows.repeat(d, 3)], atol=2e-6
    )
    for g, w, name in zip(grads, want_grads, "qkvz"):
        np.testing.assert_allclose(np.asarray(g), w, atol=2e-5, err_msg=name)
    plain = dot_product_attention(
        jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(full),
        impl="reference",
    )  # fmt: skip
    assert np.abs(np.asarray(plain) - want).max() > 1e-2  # the sinks matter


# --------------------------------------------------------------- experts' GLU
def test_clamped_swiglu_equals_transformers():
    """Values and gradients of the clamped SwiGLU, limits crossed both ways."""
    rng = np.random.default_rng(0)
    gu = (rng.normal(size=(5, 16)) * 6).astype(np.float32)  # beyond ±limit often
    experts = gpt_oss.GptOssExperts(
        transformers.GptOssConfig(num_local_experts=1, intermediate_size=8)
    )
    x = torch.tensor(gu, requires_grad=True)
    want = experts._apply_gate(x)
    w = rng.normal(size=want.shape).astype(np.float32)
    (want * torch.from_numpy(w)).sum().backward()
    g, u = jnp.asarray(gu[:, 0::2]), jnp.asarray(gu[:, 1::2])
    got, vjp = jax.vjp(lambda g, u: clamped_swiglu(g, u, 7.0, 1.702), g, u)
    dg, du = vjp(jnp.asarray(w))
    assert (np.abs(gu) > 7).mean() > 0.1
    np.testing.assert_allclose(np.asarray(got), want.detach().numpy(), rtol=1e-6)
    want_grad = x.grad.numpy()
    np.testing.assert_allclose(np.asarray(dg), want_grad[:, 0::2], atol=1e-6)
    np.testing.assert_allclose(np.asarray(du), want_grad[:, 1::2], atol=1e-6)


# ----------------------------------------------------------------- config.json
HUB_CONFIG = {
    "architectures": ["GptOssForCausalLM"], "attention_bias": True,
    "attention_dropout": 0.0, "eos_token_id": 200002, "experts_per_token": 4,
    "head_dim": 64, "hidden_act": "silu", "hidden_size": 2880,
    "initial_context_length": 4096, "initializer_range": 0.02,
    "intermediate_size": 2880,
    "layer_types": ["sliding_attention", "full_attention"] * 12,
    "max_position_embeddings": 131072, "model_type": "gpt_oss",
    "num_attention_heads": 64, "num_experts_per_tok": 4, "num_hidden_layers": 24,
    "num_key_value_heads": 8, "num_local_experts": 32, "output_router_logits": False,
    "pad_token_id": 199999,
    "quantization_config": {
        "modules_to_not_convert": ["model.layers.*.self_attn",
                                   "model.layers.*.mlp.router",
                                   "model.embed_tokens", "lm_head"],
        "quant_method": "mxfp4",
    },
    "rms_norm_eps": 1e-05,
    "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                     "original_max_position_embeddings": 4096, "rope_type": "yarn",
                     "truncate": False},
    "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128,
    "swiglu_limit": 7.0, "tie_word_embeddings": False, "use_cache": True,
    "vocab_size": 201088,
}  # fmt: skip
"""openai/gpt-oss-20b's config.json (its keys and values)."""


def test_the_hubs_config_json_reads_as_transformers_reads_it():
    arch = nn.architecture("gpt_oss")
    c = arch.from_hf(HUB_CONFIG)
    want = transformers.AutoConfig.for_model(**HUB_CONFIG)
    assert (c.num_layers, c.num_experts, c.num_experts_per_tok, c.hd) == (
        want.num_hidden_layers, want.num_local_experts, want.num_experts_per_tok,
        want.head_dim,
    )  # fmt: skip
    assert list(c.layer_types) == want.layer_types and c.sliding_window == 128
    assert (c.rope_type, c.rope_factor, c.rope_truncate, c.rope_theta) == (
        "yarn", 32.0, False, 150000.0,
    )  # fmt: skip
    assert c.attention_sinks and c.moe_bias and c.swiglu_limit == want.swiglu_limit
    assert c.router_aux_loss_coef == 0.9 and c.num_params() > 20e9
    # transformers' defaults for a bare config (GptOssConfig.__post_init__)
    keys = ("model_type", "vocab_size", "hidden_size", "intermediate_size",
            "num_hidden_layers", "num_attention_heads")  # fmt: skip
    bare = {k: HUB_CONFIG[k] for k in keys}
    got = arch.from_hf(bare)
    want = transformers.AutoConfig.for_model(**bare)
    assert list(got.layer_types) == want.layer_types
    assert got.rope_truncate is want.rope_parameters["truncate"] is False
    assert (got.num_experts, got.hd, got.num_kv_heads) == (
        want.num_local_experts, want.head_dim, want.num_key_value_heads,
    )  # fmt: skip
    with pytest.raises(UnsupportedError, match=r"quant_method.*not supported"):
        arch.from_hf({**HUB_CONFIG, "quantization_config": {"quant_method": "fp8"}})
    with pytest.raises(UnsupportedError, match="swiglu_limit"):
        nn.architecture("mixtral").to_hf(
            dataclasses.replace(nn.architecture("mixtral").tiny(), swiglu_limit=7.0)
        )
    json.dumps(arch.to_hf(c))  # a JSON config.json


# ----------------------------------------------------------------------- MXFP4
def test_mxfp4_dequantization_equals_transformers():
    """Every code and a spread of scales, against ``convert_moe_packed_tensors``."""
    mxfp4 = pytest.importorskip("transformers.integrations.mxfp4")
    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 256, size=(3, 8, 4, 16), dtype=np.uint8)
    scales = rng.integers(110, 140, size=(3, 8, 4), dtype=np.uint8)
    want = mxfp4.convert_moe_packed_tensors(
        torch.from_numpy(blocks), torch.from_numpy(scales), dtype=torch.float32
    ).numpy()  # (E, in, out): transformers transposes to its x @ W layout
    got = dequantize_hf(blocks, scales)  # (E, out, in)
    np.testing.assert_array_equal(got.swapaxes(1, 2), want)
    bf16 = dequantize_hf(blocks, scales, ml_dtypes.bfloat16)  # exact in bfloat16
    np.testing.assert_array_equal(bf16.astype(np.float32), got)
    b, s = quantize_hf(got)
    np.testing.assert_array_equal(dequantize_hf(b, s), got)  # MXFP4 values: exact
    with pytest.raises(FormatError, match="do not pair"):
        dequantize_hf(blocks, scales[..., :3])


def _mxfp4_folder(path):
    """A tiny gpt-oss folder as the Hub's: MXFP4 experts, quantization_config.

    Returns the config (sizes 64: whole MXFP4 blocks, and NF4's).
    """
    config = dataclasses.replace(
        nn.architecture("gpt_oss").tiny(), hidden_size=64, intermediate_size=64
    )
    model = _hf_model(config)
    tensors = {}
    for name, value in model.state_dict().items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            w = value.numpy().swapaxes(1, 2)  # (E, out, in), the Hub's layout
            blocks, scales = quantize_hf(w)
            tensors[f"{name}_blocks"] = torch.from_numpy(blocks)
            tensors[f"{name}_scales"] = torch.from_numpy(scales)
        else:
            tensors[name] = value.to(torch.bfloat16).contiguous()
    safetensors_torch.save_file(
        tensors, str(path / "model.safetensors"), metadata={"format": "pt"}
    )
    hf = nn.architecture("gpt_oss").to_hf(config)
    hf["quantization_config"] = HUB_CONFIG["quantization_config"]
    (path / "config.json").write_text(json.dumps(hf))
    return config


def test_an_mxfp4_folder_gives_transformers_logits(tmp_path):
    """The Hub's layout, dequantized on load, against transformers' own load.

    transformers without Triton dequantizes MXFP4 (``convert_moe_packed_tensors``);
    both then compute in float32.
    """
    config = _mxfp4_folder(tmp_path)
    want_model, params = _folder_equals_transformers(tmp_path, config)
    ex = want_model.model.layers[1].mlp.experts
    np.testing.assert_array_equal(  # the experts as transformers dequantized them
        np.asarray(params["model"]["layers"]["mlp"]["experts"]["up_proj"]["weight"][1]),
        ex.gate_up_proj.detach().numpy()[:, :, 1::2].swapaxes(1, 2),
    )


def test_entrenar_info_counts_an_mxfp4_folders_parameters(tmp_path):
    """Two values a block byte, the scales apart: the config's parameter count.

    (Before, the uint8 bytes counted as parameters: 91856 of 137936.)
    """
    from entrenar.runs.info import model_info

    config = _mxfp4_folder(tmp_path)
    info = model_info(str(tmp_path))
    assert info["architecture"] == "gpt_oss"
    assert info["parameters"] == config.num_params()
    assert info["types"]["mxfp4"] == 3 * config.num_layers * 4 * 64 * 64


def test_an_mxfp4_folder_loads_with_nf4_experts_for_qlora(tmp_path):
    """QLoRA's load quantizes each MXFP4 stack to NF4 as it reads it.

    The same NF4 bases as quantizing the float load afterwards; no expert stays
    float.
    """
    from entrenar import lora, quant
    from entrenar.runs.models import base_quantizer

    _mxfp4_folder(tmp_path)
    targets = ("q_proj", "experts.gate_proj", "experts.up_proj", "experts.down_proj")
    cfg = lora.LoRAConfig(targets=targets, quantize_base="nf4")
    _, params = io.load_hf_folder(tmp_path, quantize=base_quantizer(cfg))
    _, dense = io.load_hf_folder(tmp_path)
    ex, want = params["model"]["layers"]["mlp"]["experts"], dense["model"]["layers"]
    for proj in ("gate_proj", "up_proj", "down_proj"):
        node = ex[proj]["weight"]
        assert quant.is_quantized(node) and not quant.is_quantized(ex[proj]["bias"])
        base = quant.quantize(want["mlp"]["experts"][proj]["weight"], "nf4",
                              double_quant=True)  # fmt: skip
        np.testing.assert_array_equal(
            np.asarray(quant.dequantize(node, jnp.float32)),
            np.asarray(quant.dequantize(base, jnp.float32)),
        )


def test_mxfp4_tensors_that_do_not_fit_are_named(tmp_path):
    _mxfp4_folder(tmp_path)
    file = tmp_path / "model.safetensors"
    tensors = safetensors_torch.load_file(str(file))
    key = "model.layers.1.mlp.experts.down_proj_scales"
    scales = tensors.pop(key)
    safetensors_torch.save_file(tensors, str(file), metadata={"format": "pt"})
    with pytest.raises(FormatError, match=r"layers\.1\.mlp\.experts\.down_proj: MXFP4"):
        io.load_hf_folder(tmp_path)
    tensors[key] = scales[:, :, :1].contiguous()
    safetensors_torch.save_file(tensors, str(file), metadata={"format": "pt"})
    with pytest.raises(FormatError, match=r"down_proj_scales \(4, 64, 1\)"):
        io.load_hf_folder(tmp_path)


@pytest.mark.parametrize(
    ("key", "change", "match"),
    [  # each loaded before: the first two with NaN / infinite experts
        ("down_proj_scales", lambda t: torch.full_like(t, 255), "the byte 255: E8M0"),
        ("gate_up_proj_scales", lambda t: t.clone().fill_(254), "the byte 254"),
        ("down_proj_blocks", lambda t: t.view(torch.int8), "down_proj_blocks is int8"),
    ],
)
def test_mxfp4_bytes_that_are_no_weights_are_refused_by_name(
    tmp_path, key, change, match
):
    _mxfp4_folder(tmp_path)
    file = tmp_path / "model.safetensors"
    tensors = safetensors_torch.load_file(str(file))
    name = f"model.layers.1.mlp.experts.{key}"
    tensors[name] = change(tensors[name]).contiguous()
    safetensors_torch.save_file(tensors, str(file), metadata={"format": "pt"})
    with pytest.raises(FormatError, match=rf"{tmp_path}: model\.layers\.1.*{match}"):
        io.load_hf_folder(tmp_path)


def test_a_folder_written_with_mxfp4_experts_is_the_hubs_layout(tmp_path):
    """``save_hf_folder(expert_type="MXFP4")``: the Hub's tensors and config.

    Written from a float model: the experts read back (by entrenar and by
    transformers, which dequantizes them on the CPU) as their MXFP4 values, to the
    same logits; the other tensors as written in bfloat16. Rewritten from a Hub
    MXFP4 folder: the experts' values exactly.
    """
    config = dataclasses.replace(
        nn.architecture("gpt_oss").tiny(), hidden_size=64, intermediate_size=64
    )
    src = tmp_path / "float"
    src.mkdir()
    model = _hf_model(config)
    model.save_pretrained(src)
    _, params = io.load_hf_folder(src, dtype="float32")
    out = tmp_path / "mx"
    io.save_hf_folder(out, config, params, dtype="bfloat16", expert_type="MXFP4")
    hf = json.loads((out / "config.json").read_text())
    assert hf["quantization_config"] == HUB_CONFIG["quantization_config"]
    stored = safetensors_torch.load_file(str(out / "model.safetensors"))
    ex = "model.layers.1.mlp.experts"
    assert stored[f"{ex}.gate_up_proj_blocks"].dtype == torch.uint8
    assert tuple(stored[f"{ex}.gate_up_proj_blocks"].shape) == (4, 128, 2, 16)
    assert tuple(stored[f"{ex}.down_proj_scales"].shape) == (4, 64, 2)
    assert f"{ex}.gate_up_proj" not in stored
    assert stored[f"{ex}.gate_up_proj_bias"].dtype == torch.bfloat16
    _, back = io.load_hf_folder(out, dtype="float32")
    experts, want = back["model"]["layers"]["mlp"]["experts"], params["model"]["layers"]
    for proj in ("gate_proj", "up_proj", "down_proj"):
        w = np.asarray(want["mlp"]["experts"][proj]["weight"], np.float32)
        mx = dequantize_hf(*quantize_hf(w))  # (L, E, out, in): along in, as stored
        np.testing.assert_array_equal(np.asarray(experts[proj]["weight"]), mx)
        assert not np.array_equal(mx, w)
    _folder_equals_transformers(out, config)  # transformers reads the same values

    hub = tmp_path / "hub"
    hub.mkdir()
    _mxfp4_folder(hub)
    info, loaded = io.load_hf_folder(hub, dtype="float32")
    again = tmp_path / "again"
    io.save_hf_folder(again, info.config, loaded, dtype="bfloat16", expert_type="mxfp4")
    first = safetensors_torch.load_file(str(hub / "model.safetensors"))
    second = safetensors_torch.load_file(str(again / "model.safetensors"))
    assert sorted(first) == sorted(second)
    for name in [n[: -len("_blocks")] for n in first if n.endswith("_blocks")]:
        values = [  # the same values (a block whose largest code is 3 may come
            dequantize_hf(  # back as 6 at half the scale: the same numbers)
                f[f"{name}_blocks"].numpy(), f[f"{name}_scales"].numpy()
            )
            for f in (first, second)
        ]
        np.testing.assert_array_equal(*values, err_msg=name)


def test_mxfp4_experts_are_refused_where_the_folder_cannot_hold_them(tmp_path):
    llama = nn.architecture("llama").tiny()
    params = llama.init(jax.random.key(0))
    with pytest.raises(UnsupportedError, match="a llama folder holds its experts"):
        io.save_hf_folder(tmp_path / "a", llama, params, expert_type="MXFP4")
    odd = nn.architecture("gpt_oss").tiny()
    odd = dataclasses.replace(odd, hidden_size=64, intermediate_size=48)
    with pytest.raises(ConfigError, match="expert_size 48: leave the expert type"):
        io.save_hf_folder(tmp_path / "b", odd, odd.init(jax.random.key(0)),
                          expert_type="MXFP4")  # fmt: skip
    with pytest.raises(ConfigError, match="expected 'MXFP4'"):
        io.save_hf_folder(tmp_path / "c", odd, {}, expert_type="Q4_0")
    assert not (tmp_path / "a").exists() or not any((tmp_path / "a").iterdir())
    # a run refuses it before training (`runs.run._check_exports`)
    from config_cases import wine_doc, write

    from entrenar.config.summary import validate
    from entrenar.runs.export import check_hf_export
    from entrenar.runs.models import BuiltModel

    doc = wine_doc(tmp_path / "run")
    doc["model"] = {"architecture": "llama", "config": {"hidden_size": 64}}
    doc["data"] = {"train": doc["data"]["train"], "format": "text"}
    doc["training"].pop("eval_every", None)
    doc["export"] = {"formats": ["hf"], "hf_expert_type": "MXFP4"}
    spec = validate(write(tmp_path / "run.yaml", doc))
    with pytest.raises(ConfigError, match=r"^export\.hf_expert_type: .*llama folder"):
        check_hf_export(spec, BuiltModel("llama", llama, params))


# ------------------------------------------------------------------------ GGUF
def test_ggml_mxfp4_dequantization_equals_gguf_py():
    """Type 39 blocks (every scale byte, every code) against llama.cpp's gguf-py."""
    gguf_quants = pytest.importorskip("gguf.quants")
    gguf = pytest.importorskip("gguf")
    from entrenar.io.ggml_dequant import dequantize_ggml

    rng = np.random.default_rng(1)
    blocks = rng.integers(0, 256, size=(256, 17), dtype=np.uint8)
    blocks[:, 0] = np.arange(256)  # E8M0 0 (subnormal) .. 255
    want = gguf_quants.dequantize(blocks, gguf.GGMLQuantizationType.MXFP4)
    got = dequantize_ggml(blocks.reshape(-1), 39, (8, 1024))
    np.testing.assert_array_equal(got.reshape(want.shape), want)


def test_a_gguf_with_mxfp4_experts_loads(tmp_path):
    """llama.cpp's gpt-oss files keep the experts in MXFP4 (type 39): read them.

    The experts quantized by gguf-py (llama.cpp's converter's quantizer) load as
    gguf-py dequantizes them; every other tensor as written.
    """
    gguf_quants = pytest.importorskip("gguf.quants")
    gguf = pytest.importorskip("gguf")
    from entrenar.io.gguf_writer import GGUFTensor, write_gguf

    config = dataclasses.replace(
        nn.architecture("gpt_oss").tiny(), swiglu_limit=7.0, intermediate_size=32
    )
    params = config.init(jax.random.key(0))
    path = tmp_path / "f32.gguf"
    io.save_llama_gguf(path, config, params)
    g = io.read_gguf(path)
    tensors, want = {}, {}
    for name, info in g.tensors.items():
        raw = np.asarray(g.raw(name)).reshape(-1)
        if "_exps.weight" in name:
            w = raw.view(np.float32).reshape(info.shape)
            q = gguf_quants.quantize(w, gguf.GGMLQuantizationType.MXFP4)
            want[name] = gguf_quants.dequantize(q, gguf.GGMLQuantizationType.MXFP4)
            tensors[name] = GGUFTensor(q.reshape(-1), info.shape, 39)
        else:
            tensors[name] = GGUFTensor(raw.copy(), info.shape, info.type_id)
    write_gguf(tmp_path / "mxfp4.gguf", dict(g.fields), tensors)
    back, loaded, _ = io.load_llama_gguf(tmp_path / "mxfp4.gguf")
    assert back == config
    ex = loaded["model"]["layers"]["mlp"]["experts"]
    for i in range(config.num_layers):
        np.testing.assert_array_equal(
            np.asarray(ex["down_proj"]["weight"][i]),
            want[f"blk.{i}.ffn_down_exps.weight"],
        )
    assert np.abs(want["blk.0.ffn_up_exps.weight"]).max() > 0


def test_the_sink_key_keeps_the_sink_logit_under_bfloat16_products():
    """The native path's sink key splits ``z / scale`` in two bfloat16 parts.

    With bfloat16 products it stays within bfloat16 rounding of the JAX path (which
    keeps ``z`` in float32); one bfloat16 part would move a sink logit of 8 by up
    to 0.02.
    """
    q, k, v, sinks = _inputs(t=16, s=16)
    sinks = sinks + 8.0
    mask = jnp.asarray(np.tril(np.ones((16, 16), bool)))
    args = [jnp.asarray(x) for x in (q, k, v)]
    plain = attention._attention_jax(*args, mask, None, 8**-0.5, "bfloat16",
                                     sinks=jnp.asarray(sinks))  # fmt: skip
    got = dot_product_attention(*args, mask, sinks=jnp.asarray(sinks),
                                matmul_dtype="bfloat16", impl="reference")  # fmt: skip
    np.testing.assert_allclose(np.asarray(got), np.asarray(plain), atol=2e-3)
    qk, kk, _, _ = attention.sink_key(*args, mask, jnp.asarray(sinks), 8**-0.5)
    logit = (
        np.einsum("hd,gd->hg", np.asarray(qk)[0, 0], np.asarray(kk)[0, -1]) * 8**-0.5
    )
    np.testing.assert_allclose(logit[[0, 1, 2, 3], [0, 0, 1, 1]], sinks, rtol=1e-6)
