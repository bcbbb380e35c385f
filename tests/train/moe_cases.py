"""Tiny mixture-of-experts models shared by the MoE training tests.

`models` gives entrenar's tiny config and params and transformers' model with the
same weights; `batch` a left-padded batch (test_moe_training.py,
test_moe_jitter_dropout.py, test_padded_targets.py).

transformers' model runs `EAGER`: its own ``eager_attention_forward``, with the
query rows whose every key is masked recomputed from ``q`` and ``k`` detached
(`eager_masked_rows_detached`): the same forward, bit for bit, and the gradient of
that forward (specs/models.md, "Attention", on a fully masked row).
"""

from __future__ import annotations

import dataclasses
import sys

import jax
import jax.numpy as jnp
import numpy as np
import torch
import transformers
from transformers.masking_utils import AttentionMaskInterface, eager_mask

from entrenar import nn

EAGER = "eager_masked_rows_detached"
"""The attention implementation `models` gives transformers' model."""


def eager_masked_rows_detached(module, query, key, value, attention_mask, *a, **kw):
    """Eager attention (transformers') with a zero gradient through fully masked rows.

    Eager attention adds ``finfo.min`` to masked scores; on a row whose every key is
    masked (a left-padded position: its own and all earlier keys are padding, the
    later ones causal) each ``s + min`` rounds to ``min``, so the row's output is the
    uniform mean of all values whatever ``q`` and ``k`` are, yet autograd passes the
    softmax Jacobian back to ``q`` and ``k`` (``∂(s + min)/∂s = 1``). Those rows are
    recomputed from detached ``q`` and ``k``: the forward is the same floats, and
    ``q``, ``k`` get the derivative of the forward (zero) there; ``v`` keeps its.
    """
    eager = sys.modules[type(module).__module__].eager_attention_forward
    out, weights = eager(module, query, key, value, attention_mask, *a, **kw)
    if attention_mask is None:
        return out, weights
    dead = (attention_mask == torch.finfo(attention_mask.dtype).min).all(-1)  # (B,1,T)
    if not bool(dead.any()):
        return out, weights
    frozen, _ = eager(module, query.detach(), key.detach(), value, attention_mask,
                      *a, **kw)  # fmt: skip
    return torch.where(dead[:, 0, :, None, None], frozen, out), weights  # (B,T,H,d)


transformers.AttentionInterface.register(EAGER, eager_masked_rows_detached)
AttentionMaskInterface.register(EAGER, eager_mask)


def models(family, attention=EAGER, **fields):
    """Our tiny config and params, and transformers' model with the same weights.

    ``attention``: transformers' attention implementation (`EAGER`, or ``"eager"``).
    """
    arch = nn.architecture(family)
    config = dataclasses.replace(arch.tiny(), **fields)
    hf_cfg = transformers.AutoConfig.for_model(**arch.to_hf(config))
    hf_cfg._attn_implementation = attention
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(hf_cfg).float()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=gen))
    flat = {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}
    if arch.from_hf_tensors is not None:  # MoE: transformers' fused expert tensors
        flat = arch.from_hf_tensors(flat, config)
    params = nn.from_hf_names(flat, config)
    return config, jax.tree.map(jnp.asarray, params), model


def batch(vocab):
    """Two rows of 10 tokens, the second left-padded by 3, and their labels.

    The second row's first real token is the label of its last padded position
    (as a left-padded batch whose labels are its tokens, padding -100, gives it):
    transformers and entrenar both count it.
    """
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, vocab, size=(2, 10)).astype(np.int64)
    mask = np.ones((2, 10), np.int64)
    mask[1, :3] = 0  # left padding
    labels = np.where(mask == 1, tokens, -100)
    return tokens, mask, labels
