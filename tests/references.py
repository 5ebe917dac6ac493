"""Float64 NumPy references shared by several test modules, written independently of ais_jax.

`ais` is docs/design.md section 3 (adaptive importance sampling) from the raw log-probs: every
diagnostic, alpha and the corrected advantages. `softmax_logp` is a small softmax policy, logits =
features @ theta, whose gradients the GRPO tests derive by hand.
"""

from __future__ import annotations

import math

import numpy as np


def ais(
    advantages,
    logp_train,
    logp_rollout,
    mask,
    *,
    clip: float = 5.0,
    delta: float = 0.02,
    gamma: float = 1.2,
    beta_var: float = 1.0,
    eps: float = 1e-6,
) -> dict:
    """AIS over the valid (mask != 0) tokens, in float64 from the given (float32) inputs.

    Returns ``advantages`` (A_tilde [B, T]: A broadcast to the tokens, weighted on valid ones),
    ``alpha``, and the diagnostics ``cv``, ``alpha_ess``, ``mismatch``, ``alpha_mis``,
    ``var_ratio`` (Delta_sig), ``alpha_var``. Standard deviations use ddof = 1; with fewer than
    two valid tokens alpha is 0 and A_tilde = A (the diagnostics are then NaN: undefined)."""
    mask = np.asarray(mask)
    advantages = np.asarray(advantages, np.float64)
    if advantages.ndim == 1:
        advantages = advantages[:, None]
    a = np.broadcast_to(advantages, mask.shape).copy()
    valid = mask != 0
    d = np.asarray(logp_train, np.float64) - np.asarray(logp_rollout, np.float64)
    log_rho = np.clip(np.where(valid, d, 0.0), -20.0, 20.0)[valid]
    if log_rho.size < 2:
        nan = float("nan")
        names = ("cv", "alpha_ess", "mismatch", "alpha_mis", "var_ratio", "alpha_var")
        return dict(advantages=a, alpha=0.0, **dict.fromkeys(names, nan))
    w_bar = np.minimum(np.exp(log_rho), clip)
    a_valid = a[valid]
    cv = np.std(w_bar, ddof=1) / np.mean(w_bar)
    alpha_ess = 1.0 / math.sqrt(1.0 + cv**2)
    mismatch = float(np.mean(np.abs(log_rho)))
    alpha_mis = min(1.0, mismatch / delta)
    var_ratio = np.std(a_valid * w_bar, ddof=1) / (np.std(a_valid, ddof=1) + eps)
    alpha_var = max(0.0, (var_ratio - gamma) / gamma)
    alpha = min(max(alpha_ess - beta_var * alpha_var, 0.0), 1.0) * alpha_mis
    a[valid] = (1.0 + alpha * (w_bar - 1.0)) * a_valid
    return dict(
        advantages=a,
        alpha=float(alpha),
        cv=float(cv),
        alpha_ess=alpha_ess,
        mismatch=mismatch,
        alpha_mis=alpha_mis,
        var_ratio=float(var_ratio),
        alpha_var=float(alpha_var),
    )


def softmax_logp(theta_FV, features_BTF, tokens_BT):
    """log softmax(features @ theta)[token] [B, T] and the probabilities [B, T, V], float64."""
    logits_BTV = np.einsum(
        "btf,fv->btv", np.asarray(features_BTF, np.float64), np.asarray(theta_FV, np.float64)
    )
    logits_BTV -= logits_BTV.max(-1, keepdims=True)
    logp_BTV = logits_BTV - np.log(np.exp(logits_BTV).sum(-1, keepdims=True))
    logp_BT = np.take_along_axis(logp_BTV, np.asarray(tokens_BT)[..., None], -1)[..., 0]
    return logp_BT, np.exp(logp_BTV)
