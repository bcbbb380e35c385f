"""Small random parameter trees (stacked like a Llama) for the merge tests."""

import numpy as np

from entrenar.tree import tree_named_leaves

L, D, H, V = 3, 8, 16, 5


def make_tree(seed: int = 0, dtype=np.float32) -> dict:
    """A stacked tree: two per-layer leaves, an embedding, a norm, a head."""
    rng = np.random.default_rng(seed)

    def normal(*shape):
        return rng.normal(size=shape).astype(dtype)

    return {
        "model": {
            "layers": {
                "up_proj": {"weight": normal(L, H, D)},
                "norm": {"weight": normal(L, D)},
            },
            "embed_tokens": {"weight": normal(V, D)},
            "norm": {"weight": normal(D)},
        },
        "lm_head": {"weight": normal(V, D)},
    }


def finetuned(base: dict, seed: int, scale: float = 0.1) -> dict:
    """``base`` plus Gaussian noise of std ``scale`` (a fine-tuned relative)."""
    rng = np.random.default_rng(seed)

    def bump(x):
        return (x + scale * rng.normal(size=x.shape)).astype(x.dtype)

    return _map(bump, base)


def _map(fn, tree):
    if isinstance(tree, dict):
        return {k: _map(fn, v) for k, v in tree.items()}
    return fn(tree)


def leaves(tree) -> dict:
    return dict(tree_named_leaves(tree))
