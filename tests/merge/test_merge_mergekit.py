"""Each method against mergekit 0.1.5's own functions (the peer extra), to 1e-6.

mergekit merges one tensor at a time (one layer of a stacked leaf), so it is called
per layer here. DARE is not compared: mergekit draws its masks from torch's global
generator and rescales by the L1 norm instead of the paper's 1 / (1 - p)
(test_merge_reference.py checks DARE against the paper).
"""

import numpy as np
import pytest
from merge_helpers import finetuned, leaves, make_tree

from entrenar import merge

torch = pytest.importorskip("torch")
mk = pytest.importorskip("mergekit.merge_methods")


@pytest.fixture(scope="module")
def trees():
    base = make_tree(10)
    return base, [finetuned(base, s, scale=0.2) for s in (11, 12, 13)]


def _layers(name, x):
    return list(x) if ".layers." in f".{name}." else [x]


def _mergekit(name, inputs, method, parameters, base_index):
    per_layer = zip(*[_layers(name, x) for x in inputs])
    out = [
        mk.merge_tensors(
            [torch.from_numpy(np.array(t)) for t in ts],
            method,
            parameters=parameters,
            base_index=base_index,
        ).numpy()
        for ts in per_layer
    ]
    return np.stack(out) if ".layers." in f".{name}." else out[0]


def _compare(out, inputs, method, parameters, base_index=0):
    got = leaves(out)
    flats = [leaves(t) for t in inputs]
    for name in got:
        want = _mergekit(name, [f[name] for f in flats], method, parameters, base_index)
        np.testing.assert_allclose(
            np.asarray(got[name]), want, rtol=1e-6, atol=1e-6, err_msg=name
        )


@pytest.mark.parametrize("normalize", [True, False])
def test_ties_matches_mergekit(trees, normalize):
    base, models = trees
    density, weights = [0.3, 0.6, 0.45], [1.0, 0.7, 1.3]
    out = merge.ties(base, models, density, weights, lam=0.9, normalize=normalize)
    params = {
        "weight": weights,
        "density": density,
        "lambda": 0.9,
        "normalize": normalize,
    }
    _compare(out, [base, *models], "ties", params)


def test_task_arithmetic_matches_mergekit(trees):
    base, models = trees
    out = merge.task_arithmetic(base, models, [0.5, -0.25, 1.0], lam=1.2)
    params = {"weight": [0.5, -0.25, 1.0], "lambda": 1.2}
    _compare(out, [base, *models], "task_arithmetic", params)


def test_linear_matches_mergekit(trees):
    _, models = trees
    out = merge.linear(models, [1.0, 2.0, 3.0])
    _compare(out, models, "linear", {"weight": [1.0, 2.0, 3.0]}, base_index=None)


@pytest.mark.parametrize("t", [0.0, 0.3, 0.5, 1.0])
def test_slerp_matches_mergekit(trees, t):
    base, models = trees
    out = merge.slerp(base, models[0], t)
    _compare(out, [base, models[0]], "slerp", {"t": t})
