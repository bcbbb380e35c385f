"""A plain-numpy Llama forward (Hugging Face semantics), the tests' reference."""

from __future__ import annotations

import numpy as np


def _rms(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def _rope(x: np.ndarray, theta: float) -> np.ndarray:
    """Half-split rotary embedding of ``x: (T, n, d)``."""
    t, _, d = x.shape
    inv = theta ** (-np.arange(0, d, 2, dtype=np.float64) / d)  # (d/2,)
    ang = np.arange(t)[:, None] * inv[None]  # (T, d/2)
    cos, sin = np.cos(ang)[:, None], np.sin(ang)[:, None]  # (T, 1, d/2)
    a, b = x[..., : d // 2], x[..., d // 2 :]
    return np.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)


def llama_forward(cfg, params, tokens: list[int]) -> np.ndarray:
    """Logits ``(T, V)`` in float64 of one sequence."""
    p = {k: v for k, v in params.items()}
    m, lay = p["model"], p["model"]["layers"]
    f = lambda a: np.asarray(a, np.float64)  # noqa: E731
    h = f(m["embed_tokens"]["weight"])[tokens]  # (T, D)
    t = len(tokens)
    nh, nkv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.hd
    mask = np.tril(np.ones((t, t), bool))
    for i in range(cfg.num_layers):
        w = lambda *path, i=i: f(_get(lay, path)[i])  # noqa: E731
        x = _rms(h, w("input_layernorm"), cfg.rms_norm_eps)
        q = (x @ w("self_attn", "q_proj").T).reshape(t, nh, hd)
        k = (x @ w("self_attn", "k_proj").T).reshape(t, nkv, hd)
        v = (x @ w("self_attn", "v_proj").T).reshape(t, nkv, hd)
        q, k = _rope(q, cfg.rope_theta), _rope(k, cfg.rope_theta)
        k, v = np.repeat(k, nh // nkv, axis=1), np.repeat(v, nh // nkv, axis=1)
        s = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(hd)
        s = np.where(mask[None], s, -np.inf)
        a = np.exp(s - s.max(-1, keepdims=True))
        a /= a.sum(-1, keepdims=True)
        o = np.einsum("hqk,khd->qhd", a, v).reshape(t, nh * hd)
        h = h + o @ w("self_attn", "o_proj").T
        x = _rms(h, w("post_attention_layernorm"), cfg.rms_norm_eps)
        g, u = x @ w("mlp", "gate_proj").T, x @ w("mlp", "up_proj").T
        h = h + (g / (1 + np.exp(-g)) * u) @ w("mlp", "down_proj").T
    h = _rms(h, f(m["norm"]["weight"]), cfg.rms_norm_eps)
    head = p["lm_head"]["weight"] if "lm_head" in p else m["embed_tokens"]["weight"]
    return h @ f(head).T


def _get(tree, path):
    for k in path:
        tree = tree[k]
    return tree["weight"]
