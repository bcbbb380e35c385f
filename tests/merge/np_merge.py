"""The merge methods transcribed from their papers in plain numpy (float64).

Each function merges one tensor (one layer of a stacked leaf); the tests apply it
per layer. Task vectors are formed in float32, as the models store them, and
everything after in float64.
"""

import numpy as np


def task_vectors(base, thetas):
    b = np.asarray(base, np.float32)
    return [(np.asarray(t, np.float32) - b).astype(np.float64) for t in thetas]


def trim(tau, density):
    """TIES step 1: keep the k = max(1, floor(density * m)) largest |tau|."""
    flat = tau.ravel()
    k = max(1, int(density * flat.size))
    top = np.argsort(-np.abs(flat), kind="stable")[:k]
    out = np.zeros_like(flat)
    out[top] = flat[top]
    return out.reshape(tau.shape)


def elect_and_merge(taus, weights, normalize=True):
    """TIES steps 2-3 with weights: elect sign(sum w tau), mean over agreeing."""
    wt = [w * t for w, t in zip(weights, taus)]
    gamma = np.where(sum(wt) >= 0, 1.0, -1.0)
    agree = [np.sign(x) == gamma for x in wt]
    num = sum(np.where(a, x, 0.0) for a, x in zip(agree, wt))
    if not normalize:
        return num
    den = sum(np.where(a, w, 0.0) for a, w in zip(agree, weights))
    return num / np.where(den == 0, 1.0, den)


def ties(base, thetas, density, weights, lam=1.0, normalize=True):
    taus = [trim(t, d) for t, d in zip(task_vectors(base, thetas), density)]
    tau = elect_and_merge(taus, weights, normalize)
    return np.asarray(base, np.float64) + lam * tau


def task_arithmetic(base, thetas, weights, lam=1.0):
    taus = task_vectors(base, thetas)
    return np.asarray(base, np.float64) + lam * sum(
        w * t for w, t in zip(weights, taus)
    )


def dare(base, thetas, masks, drop_rate, weights, lam=1.0, ties=False, rescale=True):
    """DARE with the given keep masks (1 = kept), then task arithmetic or TIES."""
    taus = [
        np.where(m, t / (1 - p) if rescale else t, 0.0)
        for t, m, p in zip(task_vectors(base, thetas), masks, drop_rate)
    ]
    if ties:
        tau = elect_and_merge(taus, weights, True)
    else:
        tau = sum(w * t for w, t in zip(weights, taus))
    return np.asarray(base, np.float64) + lam * tau


def slerp(a, b, t, threshold=0.9995, eps=1e-8):
    """Shoemake's slerp of the flattened tensors; linear when colinear or ~zero."""
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    na, nb = np.linalg.norm(a), np.linalg.norm(b)
    if na <= eps or nb <= eps:
        return (1 - t) * a + t * b
    dot = np.sum((a / na) * (b / nb))
    if abs(dot) > threshold:
        return (1 - t) * a + t * b
    theta = np.arccos(dot)
    return (np.sin((1 - t) * theta) * a + np.sin(t * theta) * b) / np.sin(theta)


def linear(thetas, weights, normalize=True):
    total = sum(w * np.asarray(t, np.float64) for w, t in zip(weights, thetas))
    return total / sum(weights) if normalize else total


def by_layer(fn, name, base, thetas, *args, **kw):
    """``fn(base_l, [theta_l...], *args)`` per layer of a stacked leaf, else whole."""
    if ".layers." not in f".{name}.":
        return fn(base, thetas, *args, **kw)
    return np.stack(
        [fn(base[i], [t[i] for t in thetas], *args, **kw) for i in range(len(base))]
    )
