"""Mixed precision matmuls (`lowp_matmul`, ``LlamaConfig(matmul_dtype=...)``).

References: numpy float64 products of the bfloat16-rounded inputs (what "bfloat16
inputs, float32 accumulation" means), and the float32 model for the end-to-end
gradients (stated tolerance: 3e-2 relative in norm for adapter gradients, 2e-3
absolute for the loss, on a tiny Llama with small random adapters).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from entrenar import lora, quant
from entrenar.errors import ConfigError
from entrenar.nn import LlamaConfig, causal_lm_loss, linear, lowp_matmul

TINY = LlamaConfig(
    vocab_size=64,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
)


def _bf16(a: np.ndarray) -> np.ndarray:
    """``a`` rounded to bfloat16, as float64."""
    return np.asarray(jnp.asarray(a, jnp.float32).astype(jnp.bfloat16), np.float64)


def _data(seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((3, 5, 48)).astype(np.float32)
    w = rng.standard_normal((40, 48)).astype(np.float32)
    g = rng.standard_normal((3, 5, 40)).astype(np.float32)
    return x, w, g


def test_lowp_forward_is_bf16_inputs_f32_accumulation() -> None:
    x, w, _ = _data()
    y = lowp_matmul(jnp.asarray(x), jnp.asarray(w), "bfloat16")
    ref = _bf16(x) @ _bf16(w).T  # exact products of the rounded inputs
    assert y.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(y), ref, rtol=1e-5, atol=1e-5)
    # the rounding is real: float32 inputs give a different answer
    assert np.max(np.abs(x.astype(np.float64) @ w.T.astype(np.float64) - ref)) > 1e-3


def test_lowp_backward_dx_and_dw_match_reference() -> None:
    x, w, g = _data(1)

    def f(x: jax.Array, w: jax.Array) -> jax.Array:
        return jnp.sum(lowp_matmul(x, w, "bfloat16") * jnp.asarray(g))

    dx, dw = jax.grad(f, argnums=(0, 1))(jnp.asarray(x), jnp.asarray(w))
    ref_dx = _bf16(g) @ _bf16(w)  # (3, 5, 48)
    ref_dw = np.einsum("bto,bti->oi", _bf16(g), _bf16(x))
    np.testing.assert_allclose(np.asarray(dx), ref_dx, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(dw), ref_dw, rtol=1e-5, atol=1e-4)


def test_frozen_weight_gets_no_weight_gradient_matmul() -> None:
    x, w, _ = _data(2)

    def f(x: jax.Array) -> jax.Array:
        return jnp.sum(lowp_matmul(x, jnp.asarray(w), "bfloat16"))

    text = jax.jit(jax.value_and_grad(f)).lower(jnp.asarray(x)).as_text()
    assert text.count("stablehlo.dot_general") == 2  # y = x Wᵀ and dx = g W only

    def both(x: jax.Array, w: jax.Array) -> jax.Array:
        return jnp.sum(lowp_matmul(x, w, "bfloat16"))

    grads = jax.jit(jax.value_and_grad(both, argnums=(0, 1)))
    text_w = grads.lower(jnp.asarray(x), jnp.asarray(w)).as_text()
    assert text_w.count("stablehlo.dot_general") == 3  # + dW = gᵀ x


def test_linear_dtypes_and_bad_matmul_dtype() -> None:
    x, w, _ = _data(3)
    xb = jnp.asarray(x, jnp.bfloat16)
    assert linear(xb, jnp.asarray(w), matmul_dtype="bfloat16").dtype == jnp.bfloat16
    with pytest.raises(ConfigError, match="matmul_dtype"):
        linear(jnp.asarray(x), jnp.asarray(w), matmul_dtype="int8")
    with pytest.raises(ConfigError, match=r"LlamaConfig\.matmul_dtype"):
        dataclasses.replace(TINY, matmul_dtype="float32x")


def _adapter_grads(cfg: LlamaConfig, params: dict, tokens: jax.Array) -> tuple:
    trainable, frozen = lora.split(params)

    def loss(t: dict) -> jax.Array:
        return causal_lm_loss(cfg.apply(lora.combine(t, frozen), tokens), tokens)

    value, grads = jax.jit(jax.value_and_grad(loss))(trainable)
    return float(value), [np.asarray(g) for g in jax.tree_util.tree_leaves(grads)]


def _tiny_lora(quantized: str | None) -> tuple[dict, jax.Array]:
    params = TINY.init(jax.random.key(0))
    if quantized:
        options = {"double_quant": True} if quantized == "nf4" else {}
        params = quant.quantize_params(
            params,
            quantized,
            predicate=lambda name, x: ".layers." in name and "_proj" in name,
            **options,
        )
    params = lora.apply(
        params,
        lora.LoRAConfig(rank=4, alpha=8, targets=["q_proj", "v_proj"]),
        key=jax.random.key(1),
    )
    trainable, frozen = lora.split(params)
    leaves, tree = jax.tree_util.tree_flatten(trainable)
    keys = jax.random.split(jax.random.key(3), len(leaves))
    leaves = [v + 0.05 * jax.random.normal(k, v.shape) for v, k in zip(leaves, keys)]
    params = lora.combine(jax.tree_util.tree_unflatten(tree, leaves), frozen)
    tokens = jax.random.randint(jax.random.key(2), (2, 16), 0, TINY.vocab_size)
    return params, tokens


@pytest.mark.parametrize("quantized", [None, "nf4", "q4_1"])
def test_bf16_matmuls_match_float32_gradients(quantized: str | None) -> None:
    params, tokens = _tiny_lora(quantized)
    l32, g32 = _adapter_grads(TINY, params, tokens)
    mixed = dataclasses.replace(TINY, matmul_dtype="bfloat16")
    l16, g16 = _adapter_grads(mixed, params, tokens)
    assert abs(l16 - l32) < 2e-3
    for a, b in zip(g16, g32):
        assert a.dtype == np.float32  # adapters' gradients stay float32
        rel = np.linalg.norm(a - b) / np.linalg.norm(b)
        assert rel < 3e-2, rel


_SUBPROCESS = """
import dataclasses, json, jax, numpy as np
from tests.nn.test_nn_mixed_precision import TINY, _adapter_grads, _tiny_lora
params, tokens = _tiny_lora("nf4")
cfg = dataclasses.replace(TINY, matmul_dtype="bfloat16")
loss, grads = _adapter_grads(cfg, params, tokens)
print(json.dumps([loss] + [float(np.sum(g * g)) for g in grads]))
"""


@pytest.mark.slow
def test_same_results_without_amx() -> None:
    """XLA:CPU limited to AVX2 (no AMX, no AVX-512 bf16: an AMD-like CPU) agrees."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
    procs = {  # both at once: each is mostly single-threaded compilation
        isa: subprocess.Popen(
            [sys.executable, "-c", _SUBPROCESS],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=dict(os.environ, XLA_FLAGS=isa, PYTHONPATH=root),
            cwd=root,
        )
        for isa in ("", "--xla_cpu_max_isa=AVX2")
    }
    out = {}
    for isa, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=600)
        assert proc.returncode == 0, stderr[-2000:]
        out[isa] = json.loads(stdout.strip().splitlines()[-1])
    np.testing.assert_allclose(out[""], out["--xla_cpu_max_isa=AVX2"], rtol=1e-4)


def test_remat_policy_gives_the_same_gradients() -> None:
    params, tokens = _tiny_lora(None)
    mixed = dataclasses.replace(TINY, matmul_dtype="bfloat16")
    l0, g0 = _adapter_grads(mixed, params, tokens)
    policy = dataclasses.replace(mixed, remat_policy="dots_saveable")
    l1, g1 = _adapter_grads(policy, params, tokens)
    assert abs(l1 - l0) < 1e-6
    for a, b in zip(g1, g0):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
    with pytest.raises(ConfigError, match="remat_policy"):
        dataclasses.replace(TINY, remat_policy="save_nothing_please")


def test_attention_products_take_bf16_inputs_and_accumulate_in_f32() -> None:
    """``dot_product_attention(matmul_dtype="bfloat16")``: exact float64 reference."""
    from entrenar.nn import causal_mask, dot_product_attention

    rng = np.random.default_rng(3)
    q = rng.standard_normal((2, 6, 4, 8)).astype(np.float32)  # (B, T, H, d)
    k = rng.standard_normal((2, 6, 2, 8)).astype(np.float32)  # (B, S, KV, d)
    v = rng.standard_normal((2, 6, 2, 8)).astype(np.float32)
    mask = causal_mask(jnp.arange(6), 6)
    got = dot_product_attention(
        jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), mask, matmul_dtype="bfloat16"
    )
    # reference: scores from the rounded q, k; softmax in float64; probs rounded
    kk = np.repeat(_bf16(k), 2, axis=2)  # each KV head serves G = 2 query heads
    s = np.einsum("bthd,bshd->bhts", _bf16(q), kk) / np.sqrt(8)
    s = np.where(np.asarray(mask)[None, None], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p = p / p.sum(-1, keepdims=True)
    ref = np.einsum("bhts,bshd->bthd", _bf16(p), np.repeat(_bf16(v), 2, axis=2))
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), ref, rtol=2e-5, atol=2e-5)
    plain = dot_product_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), mask)
    assert np.max(np.abs(np.asarray(plain) - ref)) > 1e-3  # the rounding is real
