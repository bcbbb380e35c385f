"""QLoRA nodes: quantized bases under an adapter, against a numpy reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from entrenar import lora, quant
from entrenar.errors import CompatibilityError, ConfigError, ShapeError
from entrenar.lora import LoRAConfig, LoRAWeight
from entrenar.nn import linear

RNG = np.random.default_rng(4)
W = RNG.normal(size=(2, 16, 64)).astype(np.float32)  # (L, out, in)
X = RNG.normal(size=(2, 3, 64)).astype(np.float32)  # (L, B, in)
CFG = LoRAConfig(rank=4, alpha=2.0, targets="q_proj")


def adapted(scheme):
    p = {"layers": {"q_proj": {"weight": jnp.asarray(W)}}}
    lp = lora.apply(p, CFG, key=jax.random.key(0), quantize=scheme)
    node = lp["layers"]["q_proj"]["weight"]
    b = jnp.asarray(RNG.normal(size=node.b.shape).astype(np.float32))
    return node.replace(b=b)


@pytest.mark.parametrize("scheme", ["nf4", "int4"])
def test_qlora_forward_and_merge_match_numpy(scheme):
    node = adapted(scheme)
    assert isinstance(node.base, quant.QuantizedWeight)
    assert node.base.scheme == scheme and node.base.double_quant == (scheme == "nf4")
    deq = np.asarray(quant.dequantize(node.base))  # (L, out, in)
    assert np.abs(deq - W).max() < 0.5 * np.abs(W).max()  # a 4-bit copy of W
    a, b = np.asarray(node.a), np.asarray(node.b)
    merged_ref = deq + 0.5 * np.einsum("lor,lri->loi", b, a)  # s = alpha / r = 0.5
    got = jax.vmap(linear)(jnp.asarray(X), node)  # per-layer, as a scan would
    ref = np.einsum("lbi,loi->lbo", X, merged_ref)
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4)
    merged = lora.fold({"w": node})["w"]
    np.testing.assert_allclose(merged, merged_ref, rtol=1e-6, atol=1e-6)


def test_qlora_base_errors():
    with pytest.raises(ShapeError, match=r"'layers\.q_proj\.weight'"):
        lora.apply({"layers": {"q_proj": {"weight": jnp.ones((2, 4, 48))}}}, CFG,
                   key=jax.random.key(0), quantize="nf4")  # fmt: skip
    with pytest.raises(ConfigError, match="quantize"):
        lora.apply({"q_proj": {"weight": jnp.ones((4, 64))}}, CFG,
                   key=jax.random.key(0), quantize="nf8")  # fmt: skip


def test_requantize_only_quantized_bases_and_unmerge_needs_dense():
    node = adapted("nf4")
    dense = LoRAWeight(jnp.asarray(W), node.a, node.b, node.alpha, node.rank)
    out, errors = lora.fold_and_requantize({"q": node, "d": dense})
    assert list(errors) == ["q"]
    assert isinstance(out["q"], quant.QuantizedWeight)
    assert isinstance(out["d"], jax.Array)
    with pytest.raises(CompatibilityError, match="dense merged weight"):
        lora.unfold({"q": out["q"]}, {"q": node})


def test_requantization_report_is_the_error_of_the_requantized_weight():
    node = adapted("int4")
    out, errors = lora.fold_and_requantize({"q": node})
    merged = np.asarray(lora.fold({"q": node})["q"], np.float64)
    diff = np.asarray(quant.dequantize(out["q"]), np.float64) - merged
    rms = np.sqrt(np.mean(diff**2))
    report = errors["q"]
    assert report.max_abs == pytest.approx(np.abs(diff).max(), rel=1e-5)
    assert report.rms == pytest.approx(rms, rel=1e-5)
    assert report.relative_rms == pytest.approx(
        rms / np.sqrt(np.mean(merged**2)), rel=1e-5
    )
    assert 0 < report.relative_rms < 0.2  # a 4-bit copy of the merged weight
