"""Quantized and LoRA nodes: dequantized / folded first, or adapters merged."""

import jax
import jax.numpy as jnp
import np_merge
import numpy as np
import pytest
from merge_helpers import finetuned, make_tree

from entrenar import lora, merge, quant
from entrenar.errors import CompatibilityError, UnsupportedError
from entrenar.lora import LoRAConfig, LoRAWeight
from entrenar.tree import assert_trees_allclose

CFG = LoRAConfig(rank=2, alpha=4.0, targets="up_proj")


def adapted(base, seed):
    """``base`` with trained-looking adapters (nonzero B) on up_proj."""
    p = lora.apply(base, CFG, key=jax.random.key(seed))
    w = p["model"]["layers"]["up_proj"]["weight"]
    rng = np.random.default_rng(seed)
    b = jnp.asarray(rng.normal(size=w.b.shape).astype(np.float32))
    p["model"]["layers"]["up_proj"]["weight"] = w.replace(b=b)
    return p


def fold(p):
    return (getattr(lora, "fold", None) or lora.merge)(p)


def test_quantized_leaves_are_dequantized_and_come_out_dense():
    base = make_tree(0)
    models = [finetuned(base, 1), finetuned(base, 2)]
    head = quant.quantize(jnp.asarray(base["lm_head"]["weight"]), "int8", block_size=8)
    qbase = {**base, "lm_head": {"weight": head}}
    dense_base = quant.dequantize_params(qbase)
    out = merge.ties(qbase, models, 0.5)
    assert isinstance(out["lm_head"]["weight"], jax.Array)
    assert out["lm_head"]["weight"].dtype == jnp.float32
    assert_trees_allclose(out, merge.ties(dense_base, models, 0.5), rtol=0, atol=0)


def test_lora_models_are_folded_first():
    base = make_tree(0)
    a, b = adapted(base, 1), adapted(base, 2)
    out = merge.ties(base, [a, b], 0.4, [1.0, 0.5])
    assert_trees_allclose(out, merge.ties(base, [fold(a), fold(b)], 0.4, [1.0, 0.5]))
    assert not isinstance(out["model"]["layers"]["up_proj"]["weight"], LoRAWeight)


def test_qlora_models_are_folded_to_dense():
    rng = np.random.default_rng(0)
    w = rng.normal(size=(2, 4, 64)).astype(np.float32)
    base = {"model": {"layers": {"up_proj": {"weight": jnp.asarray(w)}}}}
    q = lora.apply(base, CFG, key=jax.random.key(3), quantize="int4")
    out = merge.slerp(q, fold(q), 0.5)
    assert_trees_allclose(out, fold(q), rtol=1e-6, atol=1e-6)


def test_adapters_mode_merges_a_and_b():
    base = make_tree(0)
    a, b = adapted(base, 1), adapted(base, 2)
    out = merge.ties(base, [a, b], 0.5, [1.0, 2.0], lora="adapters")
    w = out["model"]["layers"]["up_proj"]["weight"]
    assert isinstance(w, LoRAWeight) and (w.alpha, w.rank) == (4.0, 2)
    np.testing.assert_array_equal(w.base, base["model"]["layers"]["up_proj"]["weight"])
    wa = a["model"]["layers"]["up_proj"]["weight"]
    wb = b["model"]["layers"]["up_proj"]["weight"]
    for part in ("a", "b"):
        xs = [np.asarray(getattr(wa, part)), np.asarray(getattr(wb, part))]
        zero = np.zeros_like(xs[0])
        want = np.stack(
            [
                np_merge.ties(zero[i], [x[i] for x in xs], [0.5, 0.5], [1.0, 2.0])
                for i in range(len(zero))
            ]
        )
        np.testing.assert_allclose(getattr(w, part), want, rtol=1e-6, atol=1e-6)
    # Leaves without adapters are merged as usual.
    np.testing.assert_array_equal(out["lm_head"]["weight"], base["lm_head"]["weight"])


def test_adapters_mode_needs_one_rank():
    base = make_tree(0)
    cfg = LoRAConfig(rank=4, alpha=4.0, targets="up_proj")
    other = lora.apply(base, cfg, key=jax.random.key(0))
    with pytest.raises(CompatibilityError, match="one rank, alpha"):
        merge.linear([adapted(base, 1), other], [1.0, 1.0], lora="adapters")


def test_dora_models_fold_first_and_refuse_adapters_mode():
    """lora='fold' merges DoRA's rescaled folds; 'adapters' would drop m: refused."""
    base = make_tree(0)
    cfg = LoRAConfig(rank=2, alpha=4.0, targets="up_proj", use_dora=True)

    def dora(seed):
        p = lora.apply(base, cfg, key=jax.random.key(seed))
        w = p["model"]["layers"]["up_proj"]["weight"]
        m = w.magnitude * (1 + 0.3 * seed)
        v = np.asarray(w.base, np.float64)  # B = 0: the fold is m/‖W‖ ⊙ W
        want = np.asarray(m)[..., None] / np.linalg.norm(v, axis=-1)[..., None] * v
        p["model"]["layers"]["up_proj"]["weight"] = w.replace(magnitude=m)
        folded = jax.tree_util.tree_map(lambda x: x, base)
        folded["model"]["layers"]["up_proj"]["weight"] = jnp.asarray(want, jnp.float32)
        return p, folded

    (a, fa), (b, fb) = dora(1), dora(2)
    out = merge.linear([a, b], [1.0, 3.0])
    assert_trees_allclose(out, merge.linear([fa, fb], [1.0, 3.0]), rtol=1e-5)
    with pytest.raises(UnsupportedError, match="DoRA adapter's magnitudes"):
        merge.linear([a, b], [1.0, 1.0], lora="adapters")
