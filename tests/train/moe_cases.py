"""Tiny mixture-of-experts models shared by the MoE training tests.

`models` gives entrenar's tiny config and params and transformers' model with the
same weights; `batch` a left-padded batch (test_moe_training.py,
test_moe_jitter_dropout.py).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import torch
import transformers

from entrenar import nn


def models(family, **fields):
    """Our tiny config and params, and transformers' model with the same weights."""
    arch = nn.architecture(family)
    config = dataclasses.replace(arch.tiny(), **fields)
    hf_cfg = transformers.AutoConfig.for_model(**arch.to_hf(config))
    hf_cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(hf_cfg).float()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=gen))
    flat = {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}
    params = nn.from_hf_names(arch.from_hf_tensors(flat, config), config)
    return config, jax.tree.map(jnp.asarray, params), model


def batch(vocab):
    """Two rows of 10 tokens, the second left-padded by 3, and their labels."""
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, vocab, size=(2, 10)).astype(np.int64)
    mask = np.ones((2, 10), np.int64)
    mask[1, :3] = 0  # left padding
    labels = np.where(mask == 1, tokens, -100)
    labels[1, 3] = -100  # predicted from a padded position: counted by neither
    return tokens, mask, labels
