"""The GRPO loss and its group advantages, as TRL 1.16's ``GRPOTrainer`` computes them.

Group Relative Policy Optimization (Shao et al. 2024, "DeepSeekMath: Pushing the
Limits of Mathematical Reasoning in Open Language Models", eqs. 3-4) samples ``G``
completions ``o_1..o_G`` of each prompt ``q`` from the policy before the step
(``π_old``), scores them with rewards ``r_i`` and replaces PPO's value baseline by
the group's statistics (TRL's ``scale_rewards``)::

    "group" (default):  A_i = (r_i − mean_j r_j) / (std_j r_j + 1e-4)   j in i's group
    "batch":            A_i = (r_i − mean_j r_j) / (std_k r_k + 1e-4)   k in the batch
    "none":             A_i =  r_i − mean_j r_j                          (Dr. GRPO)

``std`` Bessel-corrected (``torch.std``, TRL's ``nanstd``). Each completion token
``t`` gets the advantage of its sequence and the PPO-clipped surrogate, with the
ratio ``ρ_t = π_θ(o_t | q, o_<t) / π_old(o_t | q, o_<t)`` and, when ``β > 0``, the
k3 estimate of ``KL(π_θ ‖ π_ref)`` (Schulman 2020), weighted by ``ρ_t`` as TRL
1.16 does by default (``use_bias_correction_kl``, DeepSeek-V3.2's unbiased
estimate of the reverse KL's gradient under ``π_old`` samples)::

    ℓ_t = −min(ρ_t A, clip(ρ_t, 1 − ε_low, 1 + ε_high) A) + β ρ_t (e^{d_t} − d_t − 1)
    d_t = log π_ref(o_t|·) − log π_θ(o_t|·)

With one optimisation pass per generation (TRL's ``num_iterations = 1``)
``π_old = π_θ`` detached, so ``ρ = 1`` in value and ``∇ρ = ∇ log π_θ``: the
surrogate's gradient is the policy gradient ``−A ∇ log π_θ``. The per-token losses
``ℓ`` (``(B, T)``, ``m`` the completion mask) are aggregated by ``loss_type``:

- ``grpo`` (the paper): ``mean_i (Σ_t m ℓ / Σ_t m)``, each sequence's mean, then
  the batch's;
- ``bnpo``: ``Σ m ℓ / Σ m``, the micro-batch's token mean;
- ``dr_grpo`` (Liu et al. 2025, "Understanding R1-Zero-Like Training"):
  ``Σ m ℓ / (B · max_completion_length)``, a constant normaliser;
- ``dapo`` (Yu et al. 2025, TRL 1.16's default): ``Σ m ℓ / N``, ``N`` the
  completion tokens of the whole generation batch (all micro-batches), so
  accumulated micro-batches add up to the batch's token mean.

The metrics are TRL's: ``kl`` (the token mean of the k3 term, ``β > 0``),
``entropy`` (computed by the caller), ``clip_ratio/low_mean``, ``high_mean``,
``region_mean`` (token means of ``ρ < 1 − ε_low`` with ``A < 0``, ``ρ > 1 + ε_high``
with ``A > 0``, either), ``clip_ratio/low_min`` and ``high_max`` (the least and
greatest sequence mean); and from the rewards (`group_advantages`) ``reward``,
``reward_std``, ``frac_reward_zero_std``.
"""

from __future__ import annotations

import warnings
from typing import Literal, get_args

import jax
import jax.numpy as jnp
import numpy as np

from entrenar.errors import ConfigError, ShapeError

GRPOLossType = Literal["dapo", "grpo", "bnpo", "dr_grpo"]
GRPO_LOSS_TYPES: tuple[str, ...] = get_args(GRPOLossType)
ScaleRewards = Literal["group", "batch", "none"]
SCALE_REWARDS: tuple[str, ...] = get_args(ScaleRewards)
STD_EPS = 1e-4
"""Added to the standard deviation before dividing (TRL's constant)."""


def check_grpo_settings(
    *,
    beta: float,
    epsilon: float,
    epsilon_high: float | None,
    loss_type: str,
    max_completion_length: int | None = None,
) -> None:
    """Raise `ConfigError` for settings TRL's ``GRPOConfig`` would not accept."""
    if loss_type not in GRPO_LOSS_TYPES:
        raise ConfigError(f"loss_type {loss_type!r} is not one of {GRPO_LOSS_TYPES}")
    if not beta >= 0:
        raise ConfigError(f"beta must be >= 0, got {beta}")
    if not 0 < epsilon < 1:
        raise ConfigError(f"epsilon must be in (0, 1), got {epsilon}")
    if epsilon_high is not None and not epsilon_high > 0:
        raise ConfigError(f"epsilon_high must be > 0, got {epsilon_high}")
    if loss_type == "dr_grpo" and not (max_completion_length or 0) > 0:
        raise ConfigError("loss_type 'dr_grpo' needs max_completion_length > 0")


def group_advantages(
    rewards: np.ndarray, num_generations: int, scale_rewards: str = "group"
) -> tuple[np.ndarray, dict[str, float]]:
    """The advantages ``(N,)`` of ``N = P·G`` rewards, ``G`` per prompt in a row.

    ``rewards`` holds each completion's total (the weighted sum over reward
    functions), the ``G`` completions of a prompt next to each other; NaN marks
    a completion no function scored, left out of the statistics (TRL's
    ``nanmean``/``nanstd``) and given advantage 0. Returns the
    advantages (module docstring) and TRL's ``reward``, ``reward_std`` (over the
    batch) and ``frac_reward_zero_std`` (the fraction of completions whose std,
    group or batch as scaled, is 0: they carry no signal).

    >>> a, m = group_advantages(np.array([1.0, 0.0, 1.0, 1.0]), 2)
    >>> np.round(a, 4).tolist(), m["frac_reward_zero_std"]
    ([0.707, -0.707, 0.0, 0.0], 0.5)
    """
    if scale_rewards not in SCALE_REWARDS:
        raise ConfigError(
            f"scale_rewards {scale_rewards!r} is not one of {SCALE_REWARDS}"
        )
    r = np.asarray(rewards, np.float64)
    if r.ndim != 1 or num_generations < 2 or r.size % num_generations:
        raise ShapeError(
            f"group_advantages needs (P * G,) rewards with G = num_generations >= 2; "
            f"got shape {r.shape} and G = {num_generations}"
        )
    groups = r.reshape(-1, num_generations)  # (P, G)
    with np.errstate(invalid="ignore", divide="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # an all-NaN group
        mean = np.repeat(np.nanmean(groups, axis=1), num_generations)  # (N,)
        if scale_rewards == "batch":
            std = np.full_like(r, np.nanstd(r, ddof=1))
        else:
            std = np.repeat(np.nanstd(groups, ddof=1, axis=1), num_generations)
        adv = r - mean
        if scale_rewards != "none":
            adv = adv / (std + STD_EPS)
        metrics = {
            "reward": float(np.nanmean(r)),
            "reward_std": float(np.nanstd(r, ddof=1)),
            "frac_reward_zero_std": float(np.mean(np.isclose(std, 0.0, atol=1e-8))),
        }
    adv = np.nan_to_num(adv, nan=0.0)  # an unscorable completion: no signal
    return adv, metrics


def grpo_loss(
    logps: jax.Array,
    old_logps: jax.Array | None,
    ref_logps: jax.Array | None,
    advantages: jax.Array,
    mask: jax.Array,
    *,
    beta: float = 0.0,
    epsilon: float = 0.2,
    epsilon_high: float | None = None,
    loss_type: str = "dapo",
    max_completion_length: int | None = None,
    num_items: jax.Array | float | None = None,
    use_bias_correction_kl: bool = True,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The GRPO loss of one (micro-)batch and TRL's metrics (module docstring).

    Args:
        logps: ``(B, T)`` the policy's log-probabilities of each completion token.
        old_logps: ``(B, T)`` those of the sampling policy ``π_old``; None: ``logps``
            detached (one pass per generation).
        ref_logps: ``(B, T)`` the reference's; needed when ``beta > 0``.
        advantages: ``(B,)`` each sequence's advantage (`group_advantages`).
        mask: ``(B, T)`` 1 on the completion tokens that count.
        beta: ``β``, the KL coefficient (TRL's default 0: no reference).
        epsilon: ``ε_low``, and ``ε_high`` unless given.
        epsilon_high: the upper clip (DAPO's clip-higher).
        loss_type: one of `GRPO_LOSS_TYPES`.
        max_completion_length: the normaliser of ``dr_grpo``.
        num_items: ``dapo``'s ``N``, the completion tokens of the whole
            generation batch; None: this batch's.
        use_bias_correction_kl: multiply the k3 term by ``ρ`` (TRL 1.16's
            default, after DeepSeek-V3.2): its gradient is then the unbiased
            reverse-KL gradient, ``∇(ρ k3) = ∇k3 + k3 ∇log π_θ`` even where
            ``ρ = 1``; the ``kl`` metric is of ``ρ k3``.

    >>> lp = jnp.log(jnp.array([[0.5, 0.25]]))
    >>> loss, m = grpo_loss(lp, None, None, jnp.array([2.0]), jnp.ones((1, 2)))
    >>> float(loss)  # −A ρ with ρ = 1
    -2.0
    """
    check_grpo_settings(beta=beta, epsilon=epsilon, epsilon_high=epsilon_high,
                        loss_type=loss_type,
                        max_completion_length=max_completion_length)  # fmt: skip
    logps = jnp.asarray(logps)
    m = jnp.asarray(mask, logps.dtype)  # (B, T)
    if logps.ndim != 2 or m.shape != logps.shape:
        raise ShapeError(
            f"grpo_loss needs (B, T) logps and mask; got {logps.shape} and {m.shape}"
        )
    adv = jnp.asarray(advantages, logps.dtype)
    if adv.shape != logps.shape[:1]:
        raise ShapeError(
            f"advantages must be (B,) = {logps.shape[:1]}, got {adv.shape}"
        )
    adv = adv[:, None]  # (B, 1)
    old = jax.lax.stop_gradient(logps if old_logps is None else jnp.asarray(old_logps))
    ratio = jnp.exp(logps - old)  # (B, T) ρ
    eps_high = epsilon if epsilon_high is None else epsilon_high
    clipped = jnp.clip(ratio, 1.0 - epsilon, 1.0 + eps_high)
    per_token = -jnp.minimum(ratio * adv, clipped * adv)  # (B, T)
    if beta != 0.0:
        if ref_logps is None:
            raise ShapeError("grpo_loss with beta > 0 needs the reference's ref_logps")
        d = jax.lax.stop_gradient(jnp.asarray(ref_logps)) - logps  # (B, T)
        kl = jnp.exp(d) - d - 1.0  # k3
        if use_bias_correction_kl:
            kl = kl * ratio
        per_token = per_token + beta * kl
    tokens = jnp.sum(m, axis=-1)  # (B,)
    total = jnp.sum(per_token * m)
    if loss_type == "grpo":
        loss = jnp.mean(jnp.sum(per_token * m, axis=-1) / jnp.maximum(tokens, 1.0))
    elif loss_type == "bnpo":
        loss = total / jnp.maximum(jnp.sum(m), 1.0)
    elif loss_type == "dr_grpo":
        loss = total / (logps.shape[0] * int(max_completion_length or 1))
    else:  # dapo
        n = jnp.sum(m) if num_items is None else jnp.asarray(num_items, logps.dtype)
        loss = total / jnp.maximum(n, 1.0)

    sg = jax.lax.stop_gradient
    count = jnp.maximum(jnp.sum(m), 1.0)

    def token_mean(x: jax.Array) -> jax.Array:
        return jnp.sum(x * m) / count

    def seq_mean(x: jax.Array) -> jax.Array:  # (B,); NaN for an empty completion
        return jnp.sum(x * m, axis=-1) / tokens

    r = sg(ratio)
    low = ((r < 1.0 - epsilon) & (adv < 0)).astype(logps.dtype)  # (B, T)
    high = ((r > 1.0 + eps_high) & (adv > 0)).astype(logps.dtype)
    metrics = {
        "clip_ratio/low_mean": token_mean(low),
        "clip_ratio/high_mean": token_mean(high),
        "clip_ratio/region_mean": token_mean(jnp.maximum(low, high)),
        "clip_ratio/low_min": jnp.nanmin(seq_mean(low)),
        "clip_ratio/high_max": jnp.nanmax(seq_mean(high)),
    }
    if beta != 0.0:
        metrics["kl"] = token_mean(sg(kl))
    return loss, metrics


__all__ = [
    "GRPO_LOSS_TYPES",
    "SCALE_REWARDS",
    "STD_EPS",
    "GRPOLossType",
    "ScaleRewards",
    "check_grpo_settings",
    "group_advantages",
    "grpo_loss",
]
