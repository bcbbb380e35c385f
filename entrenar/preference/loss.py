"""The DPO loss and its variants, from per-sequence log-probabilities.

Direct Preference Optimization (Rafailov et al. 2023, "Direct Preference
Optimization: Your Language Model is Secretly a Reward Model", eq. 7) trains a
policy ``π`` on pairs (prompt ``x``, chosen ``y_c``, rejected ``y_r``) against a
frozen reference ``π_ref``. With ``log π(y|x) = Σ_t log π(y_t | x, y_<t)`` summed
over the completion's tokens (the prompt masked), the implicit rewards are::

    r_c = β (log π(y_c|x) − log π_ref(y_c|x))      r_r = β (log π(y_r|x) − ...)
    Δ   = (log π(y_c|x) − log π_ref(y_c|x)) − (log π(y_r|x) − log π_ref(y_r|x))

and each ``loss_type`` (the names and formulas of TRL 1.16's ``DPOTrainer``) is a
function of them, averaged over the pairs of the batch:

- ``sigmoid`` (DPO): ``−log σ(βΔ)``; with ``label_smoothing = ε`` the conservative
  DPO of Mitchell (2023), ``−(1 − ε) log σ(βΔ) − ε log σ(−βΔ)`` (TRL before 1.0;
  TRL 1.16 reads ``label_smoothing`` only for ``robust`` and ``exo_pair``, so the
  two agree at ``ε = 0``, the default);
- ``robust`` (Chowdhury et al. 2024): ``(−(1 − ε) log σ(βΔ) + ε log σ(−βΔ)) /
  (1 − 2ε)``, ``ε < 1/2``;
- ``hinge`` (SLiC, Zhao et al. 2023): ``relu(1 − βΔ)``;
- ``ipo`` (Azar et al. 2023, eq. 17): ``(Δ̄ − 1/(2β))²``, ``Δ̄`` the log-ratios
  each divided by its completion's token count (TRL's length normalisation;
  ``β`` is the paper's ``τ``);
- ``sigmoid_norm``: ``−log σ(β Δ̄)``;
- ``bco_pair``: ``−log σ(r_c) − log σ(−r_r)``;
- ``nca_pair`` (Chen et al. 2024): ``−log σ(r_c) − ½ log σ(−r_c) − ½ log σ(−r_r)``;
- ``sppo_hard`` (Wu et al. 2024): ``(ρ_c − 1/(2β))² + (ρ_r + 1/(2β))²``, ``ρ`` the
  log-ratios;
- ``apo_zero``, ``apo_down`` (D'Oosterlinck et al. 2024, eqs. 7, 8):
  ``1 − σ(r_c) + σ(r_r)`` and ``σ(r_c) + 1 − σ(r_c − r_r)``;
- ``exo_pair`` (Ji et al. 2024, eq. 16): ``σ(βΔ)(log σ(βΔ) − log(1 − ε)) +
  σ(−βΔ)(log σ(−βΔ) − log ε)``, ``0 < ε``.

The logged metrics are TRL's: ``rewards/chosen`` and ``rewards/rejected`` (means
of ``r_c``, ``r_r``), ``rewards/accuracies`` (the fraction with ``r_c > r_r``),
``rewards/margins`` (mean ``r_c − r_r``), ``logps/chosen`` and ``logps/rejected``
(means of the policy's ``log π(y|x)``).
"""

from __future__ import annotations

from typing import Literal, get_args

import jax
import jax.numpy as jnp

from entrenar.errors import ConfigError, ShapeError

LossType = Literal[
    "sigmoid", "robust", "hinge", "ipo", "sigmoid_norm", "bco_pair", "nca_pair",
    "sppo_hard", "apo_zero", "apo_down", "exo_pair",
]  # fmt: skip
LOSS_TYPES: tuple[str, ...] = get_args(LossType)
NORMALISED = ("ipo", "sigmoid_norm")
"""Loss types that need each completion's token count (``chosen_tokens``...)."""


def check_dpo_settings(beta: float, loss_type: str, label_smoothing: float) -> None:
    """Raise `ConfigError` for settings no loss type accepts."""
    if loss_type not in LOSS_TYPES:
        raise ConfigError(f"loss_type {loss_type!r} is not one of {LOSS_TYPES}")
    if not beta > 0:
        raise ConfigError(f"beta must be > 0, got {beta}")
    if not 0.0 <= label_smoothing < 0.5:
        raise ConfigError(f"label_smoothing must be in [0, 0.5), got {label_smoothing}")
    if loss_type == "exo_pair" and label_smoothing == 0.0:
        raise ConfigError("exo_pair needs label_smoothing > 0 (the paper uses 1e-3)")
    smoothed = ("sigmoid", "robust", "exo_pair")
    if label_smoothing and loss_type not in smoothed:
        raise ConfigError(
            f"label_smoothing is read by the {smoothed} losses only, not {loss_type!r}"
        )


def _per_pair(
    loss_type: str,
    beta: float,
    eps: float,
    rho_c: jax.Array,
    rho_r: jax.Array,
    n_c: jax.Array | None,
    n_r: jax.Array | None,
) -> jax.Array:
    """The loss of each pair ``(B,)`` from the log-ratios ``ρ = log π − log π_ref``."""
    ls = jax.nn.log_sigmoid
    z = beta * (rho_c - rho_r)  # βΔ
    if loss_type == "sigmoid":
        return -(1.0 - eps) * ls(z) - eps * ls(-z)
    if loss_type == "robust":
        return (-(1.0 - eps) * ls(z) + eps * ls(-z)) / (1.0 - 2.0 * eps)
    if loss_type == "hinge":
        return jax.nn.relu(1.0 - z)
    if loss_type in NORMALISED:
        if n_c is None or n_r is None:
            raise ShapeError(f"loss_type {loss_type!r} needs the completions' lengths")
        mean_delta = rho_c / jnp.maximum(n_c, 1.0) - rho_r / jnp.maximum(n_r, 1.0)
        if loss_type == "ipo":
            return jnp.square(mean_delta - 1.0 / (2.0 * beta))
        return -ls(beta * mean_delta)
    r_c, r_r = beta * rho_c, beta * rho_r
    if loss_type == "bco_pair":
        return -ls(r_c) - ls(-r_r)
    if loss_type == "nca_pair":
        return -ls(r_c) - 0.5 * ls(-r_c) - 0.5 * ls(-r_r)
    if loss_type == "sppo_hard":
        return jnp.square(rho_c - 0.5 / beta) + jnp.square(rho_r + 0.5 / beta)
    if loss_type == "apo_zero":
        return 1.0 - jax.nn.sigmoid(r_c) + jax.nn.sigmoid(r_r)
    if loss_type == "apo_down":
        return jax.nn.sigmoid(r_c) + 1.0 - jax.nn.sigmoid(r_c - r_r)
    if loss_type == "exo_pair":
        return jax.nn.sigmoid(z) * (ls(z) - jnp.log1p(-eps)) + jax.nn.sigmoid(-z) * (
            ls(-z) - jnp.log(eps)
        )
    raise ConfigError(f"loss_type {loss_type!r} is not one of {LOSS_TYPES}")


def dpo_loss(
    chosen_logps: jax.Array,
    rejected_logps: jax.Array,
    ref_chosen_logps: jax.Array,
    ref_rejected_logps: jax.Array,
    *,
    beta: float = 0.1,
    loss_type: str = "sigmoid",
    label_smoothing: float = 0.0,
    chosen_tokens: jax.Array | None = None,
    rejected_tokens: jax.Array | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The mean DPO loss over ``B`` pairs and TRL's metrics (module docstring).

    Args:
        chosen_logps: ``(B,)`` the policy's summed log-probabilities of the chosen
            completions.
        rejected_logps: ``(B,)`` the same of the rejected completions.
        ref_chosen_logps: ``(B,)`` the reference's of the chosen (no gradient
            flows into them).
        ref_rejected_logps: ``(B,)`` the reference's of the rejected.
        beta: ``β``, the strength of the pull towards the reference (IPO's ``τ``).
        loss_type: one of `LOSS_TYPES`.
        label_smoothing: ``ε`` of ``sigmoid`` (cDPO), ``robust`` and ``exo_pair``.
        chosen_tokens: ``(B,)`` the chosen completions' token counts, needed by
            ``ipo`` and ``sigmoid_norm``.
        rejected_tokens: ``(B,)`` the rejected completions' token counts.

    >>> import jax.numpy as jnp
    >>> loss, m = dpo_loss(jnp.array([-1.0]), jnp.array([-3.0]), jnp.array([-2.0]),
    ...                    jnp.array([-2.0]), beta=0.5)
    >>> round(float(loss), 4), float(m["rewards/margins"])  # -log σ(0.5 · 2)
    (0.3133, 1.0)
    """
    check_dpo_settings(beta, loss_type, label_smoothing)
    pol_c, pol_r = jnp.asarray(chosen_logps), jnp.asarray(rejected_logps)
    if pol_c.ndim != 1 or pol_c.shape != pol_r.shape:
        raise ShapeError(
            f"dpo_loss needs (B,) log-probabilities of chosen and rejected; got "
            f"{pol_c.shape} and {pol_r.shape}"
        )
    ref_c = jax.lax.stop_gradient(jnp.asarray(ref_chosen_logps))
    ref_r = jax.lax.stop_gradient(jnp.asarray(ref_rejected_logps))
    rho_c, rho_r = pol_c - ref_c, pol_r - ref_r  # (B,) log-ratios
    n_c = None if chosen_tokens is None else jnp.asarray(chosen_tokens, pol_c.dtype)
    n_r = None if rejected_tokens is None else jnp.asarray(rejected_tokens, pol_c.dtype)
    per_pair = _per_pair(loss_type, beta, label_smoothing, rho_c, rho_r, n_c, n_r)
    r_c = beta * jax.lax.stop_gradient(rho_c)  # (B,) implicit rewards
    r_r = beta * jax.lax.stop_gradient(rho_r)
    metrics = {
        "rewards/chosen": jnp.mean(r_c),
        "rewards/rejected": jnp.mean(r_r),
        "rewards/accuracies": jnp.mean((r_c > r_r).astype(pol_c.dtype)),
        "rewards/margins": jnp.mean(r_c - r_r),
        "logps/chosen": jnp.mean(jax.lax.stop_gradient(pol_c)),
        "logps/rejected": jnp.mean(jax.lax.stop_gradient(pol_r)),
    }
    return jnp.mean(per_pair), metrics


__all__ = ["LOSS_TYPES", "NORMALISED", "LossType", "check_dpo_settings", "dpo_loss"]
