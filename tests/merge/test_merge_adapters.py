"""The adapter path: merging LoRA fine-tunes through their adapters.

Where the method is linear in the weights, the merged adapter (the concatenation of
the scaled adapters) folds to exactly what folding each adapter and merging the
float models gives; other methods merge the updates densely, with the same result.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from entrenar import lora, merge
from entrenar.lora import LoRAWeight
from entrenar.merge.adapters import linear_coefficients, merge_adapters

L, OUT, IN = 2, 8, 16


def frozen():
    rng = np.random.default_rng(0)
    return {
        "layers": {
            "q_proj": {
                "weight": jnp.asarray(rng.normal(size=(L, OUT, IN)), jnp.float32)
            }
        },
        "norm": {"weight": jnp.ones((IN,), jnp.float32)},
    }


def adapted(seed, rank, alpha):
    rng = np.random.default_rng(seed)
    base = frozen()
    w = base["layers"]["q_proj"]["weight"]
    a = jnp.asarray(rng.normal(size=(L, rank, IN)), jnp.float32)
    b = jnp.asarray(rng.normal(size=(L, OUT, rank)) * 0.1, jnp.float32)
    base["layers"]["q_proj"]["weight"] = LoRAWeight(w, a, b, alpha=alpha, rank=rank)
    return base


PLANS = {
    "task_arithmetic": merge.Plan("task_vectors", weights=(0.7, 1.3), lam=0.8),
    "linear": merge.Plan("linear", weights=(1.0, 3.0), normalize=True),
    "ties": merge.Plan(
        "task_vectors",
        weights=(1.0, 1.0),
        density=(0.5, 0.5),
        elect=True,
        normalize=True,
    ),
}


@pytest.mark.parametrize("method", sorted(PLANS))
def test_adapter_merge_equals_merging_the_folded_float_models(method):
    plan = PLANS[method]
    fts = [adapted(1, 2, 4.0), adapted(2, 3, 3.0)]
    got = merge_adapters(plan, fts)
    base = None if plan.kind == "linear" else frozen()
    want = merge.merge_trees(plan, base, [lora.fold(t) for t in fts])
    node = got["layers"]["q_proj"]["weight"]
    assert isinstance(node, LoRAWeight) == (method != "ties")
    if method != "ties":
        assert node.rank == 5  # the two adapters side by side
    jax.tree_util.tree_map(
        lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6),
        lora.fold(got),
        want,
    )


def dora(seed, rank, alpha):
    """`adapted` with DoRA magnitudes away from ‖W + s·BA‖."""
    tree = adapted(seed, rank, alpha)
    node = tree["layers"]["q_proj"]["weight"]
    m = np.random.default_rng(seed + 10).uniform(1.0, 5.0, size=(L, OUT))
    tree["layers"]["q_proj"]["weight"] = node.replace(
        magnitude=jnp.asarray(m, jnp.float32)
    )
    return tree


def np_fold(tree):
    """DoRA's fold written out: m/‖W + s·BA‖_row ⊙ (W + s·BA), float64."""
    x = tree["layers"]["q_proj"]["weight"]
    v = np.asarray(x.base, np.float64) + x.scale * np.einsum(
        "lor,lri->loi", np.asarray(x.b, np.float64), np.asarray(x.a, np.float64)
    )
    v *= np.asarray(x.magnitude)[..., None] / np.linalg.norm(v, axis=-1)[..., None]
    return {"layers": {"q_proj": {"weight": jnp.asarray(v, jnp.float32)}},
            "norm": tree["norm"]}  # fmt: skip


@pytest.mark.parametrize("method", sorted(PLANS))
def test_dora_fine_tunes_merge_their_folds_densely(method):
    """A DoRA task vector is W' - W, not s·BA: merged densely for every method."""
    plan = PLANS[method]
    fts = [dora(1, 2, 4.0), dora(2, 3, 3.0)]
    got = merge_adapters(plan, fts)
    assert not isinstance(got["layers"]["q_proj"]["weight"], LoRAWeight)
    base = None if plan.kind == "linear" else frozen()
    want = merge.merge_trees(plan, base, [np_fold(t) for t in fts])
    jax.tree_util.tree_map(
        lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-5),
        got,
        want,
    )


def test_linear_coefficients_only_for_linear_plans():
    assert linear_coefficients(PLANS["task_arithmetic"]) == pytest.approx((0.56, 1.04))
    assert linear_coefficients(PLANS["linear"]) == pytest.approx((0.25, 0.75))
    assert linear_coefficients(PLANS["ties"]) is None
    assert linear_coefficients(merge.Plan("linear", weights=(1.0, 1.0))) is None


def test_adapters_with_ranks_by_layer_merge_at_each_layers_scale():
    """Per-layer ranks and alphas: each layer's update is s_i B_i A_i at its real rank.

    The reference is numpy on the unpadded factors, W + λ Σ_k w_k s_ki B_ki A_ki.
    """
    plan = PLANS["task_arithmetic"]
    fts, want = [], np.array(frozen()["layers"]["q_proj"]["weight"], np.float64)
    for k, (seed, ranks, alphas) in enumerate([(1, (2, 5), (4.0, 1.0)),
                                               (2, (3, 1), (2.0, 2.0))]):  # fmt: skip
        tree = adapted(seed, max(ranks), 1.0)
        node = lora.with_layer_ranks(tree["layers"]["q_proj"]["weight"], ranks, alphas)
        assert node.per_layer and node.rank == max(ranks)
        tree["layers"]["q_proj"]["weight"] = node
        fts.append(tree)
        for i, (r, alpha) in enumerate(zip(ranks, alphas)):
            a = np.asarray(node.a[i, :r], np.float64)  # (r, in)
            b = np.asarray(node.b[i, :, :r], np.float64)  # (out, r)
            want[i] += plan.lam * plan.weights[k] * (alpha / r) * (b @ a)
    got = lora.fold(merge_adapters(plan, fts))["layers"]["q_proj"]["weight"]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
