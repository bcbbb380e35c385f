"""fold_retention against numpy; an update on a 4-bit grid survives Q8_0, not Q4_1."""

import os
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from lora_helpers import with_b

from entrenar import io, lora, quant
from entrenar.errors import ConfigError
from entrenar.lora import LoRAWeight, fold_retention, save_folded_gguf
from entrenar.nn import LlamaConfig

RNG = np.random.default_rng(0)


def adapter(base, scale, rank=2):
    """A LoRA node on ``base`` whose update ``B A`` has entries of about ``scale``."""
    out, fan_in = base.shape[-2:]
    a = RNG.normal(size=(*base.shape[:-2], rank, fan_in)).astype(np.float32)
    b = RNG.normal(size=(*base.shape[:-2], out, rank)).astype(np.float32) * scale
    return LoRAWeight(base, jnp.asarray(a), jnp.asarray(b), alpha=rank, rank=rank)


def test_retention_matches_a_numpy_transcription():
    w = RNG.normal(size=(3, 8, 64)).astype(np.float32)
    node = adapter(jnp.asarray(w), 0.01)
    d = np.einsum("lor,lri->loi", np.asarray(node.b), np.asarray(node.a))
    e = (w + d).astype(np.float16).astype(np.float32) - w
    r = fold_retention({"x": {"weight": node}}, "F16")
    np.testing.assert_allclose(r.kept, np.vdot(e, d) / np.vdot(d, d), rtol=1e-5)
    want = np.linalg.norm(e - d) / np.linalg.norm(d)
    np.testing.assert_allclose(r.residual, want, rtol=1e-4)
    assert (r.tensor_type, r.weights) == ("F16", 1)
    assert fold_retention({"x": {"weight": node}}, "f32").kept == pytest.approx(1.0)


def test_a_small_update_on_a_q4_1_grid_is_erased_by_q4_1_kept_by_q8_0():
    w = RNG.normal(size=(64, 128)).astype(np.float32) * 0.05
    base = quant.quantize(jnp.asarray(w), "q4_1")  # the base of a Q4_1 GGUF
    step = float(np.median(np.asarray(base.scales)))  # a Q4_1 grid step
    params = {"q": {"weight": adapter(base, step / 20)}}
    assert fold_retention(params, "Q4_1").kept < 0.3
    assert fold_retention(params, "Q8_0").kept > 0.95
    assert fold_retention(params, "F16").kept > 0.99


def test_no_adapter_or_unknown_type_is_an_error():
    with pytest.raises(ConfigError, match="no LoRA adapter"):
        fold_retention({"w": jnp.ones((2, 32))}, "Q8_0")
    node = adapter(jnp.ones((2, 32)), 0.1, rank=1)
    with pytest.raises(ConfigError, match="Q5_K"):
        fold_retention({"w": node}, "Q5_K")


def test_save_folded_gguf_writes_the_folded_model_and_warns_for_q4_1(tmp_path):
    cfg = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=64,
                      num_layers=2, num_heads=2, num_kv_heads=1,
                      tie_word_embeddings=True)  # fmt: skip
    dense = cfg.init(jax.random.key(0))
    grid = quant.dequantize_params(
        jax.tree_util.tree_map(
            lambda x: quant.quantize(x, "q4_1") if x.ndim == 3 else x, dense
        )
    )
    params = lora.apply(grid, lora.LoRAConfig(rank=2, targets=("q_proj", "v_proj")),
                        key=jax.random.key(1))  # fmt: skip
    params = with_b(params, 2e-4)
    with pytest.warns(
        UserWarning,
        match=r"q4\.gguf: Q4_1 keeps \d+% of the LoRA update .* Q8_0 keeps \d+% "
        r"\(tensor_type='Q8_0'\)$",
    ) as caught:
        save_folded_gguf(tmp_path / "q4.gguf", cfg, params, tensor_type="q4_1")
    if "MUTANT_UNDER_TEST" not in os.environ:  # mutmut's trampoline adds a frame
        assert caught[0].filename == __file__  # points at the caller's line
    q4 = io.read_gguf(tmp_path / "q4.gguf")
    assert q4.tensors["blk.0.attn_q.weight"].type_id == io.GGML_TYPE_IDS["Q4_1"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        r = save_folded_gguf(tmp_path / "q8.gguf", cfg, params, name="tuned")
    assert r.tensor_type == "Q8_0" and r.kept > 0.9  # the default type
    q8 = io.read_gguf(tmp_path / "q8.gguf")
    assert q8.tensors["blk.0.attn_q.weight"].type_id == io.GGML_TYPE_IDS["Q8_0"]
    assert q8.metadata["general.name"] == "tuned"
    _, back, _ = io.load_llama_gguf(tmp_path / "q8.gguf")
    folded = lora.fold(params)
    for name in ("q_proj", "v_proj"):
        got = back["model"]["layers"]["self_attn"][name]["weight"]
        want = folded["model"]["layers"]["self_attn"][name]["weight"]
        np.testing.assert_allclose(got, want, atol=float(jnp.abs(want).max()) / 100)


def np_dora_fold(node):
    """DoRA's merged weight written out: m/‖W + s·BA‖_row ⊙ (W + s·BA), float64."""
    v = np.asarray(node.base, np.float64) + node.scale * np.einsum(
        "...or,...ri->...oi", np.asarray(node.b, np.float64), node.a
    )
    norm = np.linalg.norm(v, axis=-1, keepdims=True)
    return np.asarray(node.magnitude, np.float64)[..., None] / norm * v


def test_dora_gguf_holds_the_rescaled_fold_and_retention_measures_it(tmp_path):
    """The GGUF writer folds DoRA as PEFT merges it; kept counts m's change too."""
    cfg = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=64,
                      num_layers=2, num_heads=2, num_kv_heads=1,
                      tie_word_embeddings=True)  # fmt: skip
    dense = cfg.init(jax.random.key(0))
    dcfg = lora.LoRAConfig(rank=2, targets=("q_proj", "v_proj"), use_dora=True)
    params = with_b(lora.apply(dense, dcfg, key=jax.random.key(1)), 0.0)
    node = params["model"]["layers"]["self_attn"]["q_proj"]["weight"]
    m = node.magnitude * jnp.linspace(0.5, 1.5, node.magnitude.size).reshape(
        node.magnitude.shape
    )
    params["model"]["layers"]["self_attn"]["q_proj"]["weight"] = node.replace(
        magnitude=m
    )  # B = 0: only the magnitudes moved, s·BA is zero
    dots = sqs = errs = 0.0
    for name in ("q_proj", "v_proj"):
        x = params["model"]["layers"]["self_attn"][name]["weight"]
        w = np.asarray(x.base, np.float64)
        d = np_dora_fold(x) - w  # the task vector: W' - W, not s·BA (= 0 here)
        e = (w + d).astype(np.float16).astype(np.float64) - w
        dots, sqs = dots + np.vdot(e, d), sqs + np.vdot(d, d)
        errs += np.sum((e - d) ** 2)
    assert sqs > 1e-2
    r16 = fold_retention(params, "F16")
    np.testing.assert_allclose(r16.kept, dots / sqs, rtol=1e-4)
    np.testing.assert_allclose(r16.residual, (errs / sqs) ** 0.5, rtol=0.05)
    r = save_folded_gguf(tmp_path / "f32.gguf", cfg, params, tensor_type="F32")
    assert r.weights == 2
    _, back, _ = io.load_llama_gguf(tmp_path / "f32.gguf")
    got = back["model"]["layers"]["self_attn"]["q_proj"]["weight"]
    want = np_dora_fold(params["model"]["layers"]["self_attn"]["q_proj"]["weight"])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert np.abs(want - np.asarray(node.base)).max() > 1e-2  # not the base
