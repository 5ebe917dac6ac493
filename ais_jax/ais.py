"""Importance-sampling corrections for rollout/trainer mismatch (AIS, TIS, MIS).

The rollout engine samples tokens from an FP8 copy of the policy, pi_rollout, while the trainer
scores the same tokens in BF16, pi_train (the "old" log-probs of PPO/GRPO). The two differ, so
training on rollout samples as if they came from pi_train biases the gradient. The
rollout-vs-trainer ratio

    rho_t = exp(logp_train_t - logp_rollout_t)

re-weights each token's advantage. This module turns it into corrected advantages; the usual
GRPO objective (`ais_jax.grpo.loss`) then consumes them unchanged.

Every correction is built by a factory that validates its hyper-parameters eagerly and returns a
pure, jittable callable

    correction(advantages, logp_train_BT, logp_rollout_BT, mask_BT) -> (advantages_BT, metrics)

with `advantages` of shape [B] (one value per sequence, broadcast to its tokens) or [B, T].

| factory         | weight on A                                   | ais/alpha |
|-----------------|-----------------------------------------------|-----------|
| `uncorrected()` | 1 (the "FP8 rollout" baseline)                | 0         |
| `truncated(C)`  | w_bar = min(rho, C)                           (TIS)  | 1 |
| `adaptive(C)`   | w_tilde = 1 + alpha * (w_bar - 1)             (AIS)  | alpha |
| `masked(l, h)`  | 1 if rho in [l, h] else 0            (MIS / IcePop)  | 1 |

AIS (design.md section 3) picks one alpha per call (= per mini-batch) from three diagnostics of
the valid (mask != 0) tokens, standard deviations with ddof = 1:

    alpha_ess = (1 + CV(w_bar)^2)^(-1/2),    CV = std(w_bar) / mean(w_bar)
    alpha_mis = min(1, mean|logp_train - logp_rollout| / delta)
    Delta_sig = std(A * w_bar) / (std(A) + eps)
    alpha_var = max(0, (Delta_sig - gamma) / gamma)
    alpha     = clip(alpha_ess - beta_var * alpha_var, 0, 1) * alpha_mis

Metrics. Every correction returns the same keys, float32 scalars over the valid tokens of the
call (n of them). With d_t = logp_train_t - logp_rollout_t (clipped to [-20, 20]), the raw
ratio r_t = exp(d_t), w_bar_t = min(r_t, C) and w_t the weight the correction applies to A_t:

| key                       | definition                                          | reduce |
|---------------------------|-----------------------------------------------------|--------|
| `ais/alpha`               | alpha applied: 0 (uncorrected), 1 (TIS, MIS), AIS's | mean   |
| `ais/alpha_ess`           | (1 + cv^2)^(-1/2)                                   | mean   |
| `ais/alpha_mis`           | min(1, ais/mismatch / delta)                        | mean   |
| `ais/alpha_var`           | max(0, (ais/var_ratio - gamma) / gamma)             | mean   |
| `ais/cv`                  | std(w_bar) / mean(w_bar), ddof = 1                  | mean   |
| `ais/degenerate`          | 1 if n < 2 (AIS then applies alpha = 0), else 0     | mean   |
| `ais/ess_ratio_truncated` | 1 / (1 + cv^2) = alpha_ess^2: ESS / n of the        | mean   |
|                           | truncated weights w_bar, ddof = 1 (design.md section 3)  |        |
| `ais/mismatch`            | mean abs(d_t), the same value as mismatch/mean_abs  | mean   |
| `ais/var_ratio`           | Delta_sig = std(A w_bar) / (std(A) + eps), ddof = 1 | mean   |
| `is/weight_mean`          | mean w_t                                            | mean   |
| `is/weight_max`           | max w_t                                             | max    |
| `is/clip_frac`            | fraction of tokens whose weight was capped (TIS,    | mean   |
|                           | AIS: ratio > C) or dropped (MIS); 0 if uncorrected  |        |
| `mismatch/mean_abs`       | mean abs(d_t)                                       | mean   |
| `mismatch/k1`             | mean(-d_t): k1 estimate of KL(rollout || train)     | mean   |
| `mismatch/k3`             | mean(r_t - 1 - d_t): k3 estimate of it, >= 0        | mean   |
| `mismatch/ratio_max`      | max r_t (raw, untruncated)                          | max    |
| `mismatch/ess_ratio_raw`  | (sum r)^2 / (n sum r^2) = 1 / (1 + cv0(r)^2):       | mean   |
|                           | Kish's ESS / n of the raw ratios (cv0: ddof = 0)    |        |
| `mismatch/frac_outside`   | fraction of tokens with r_t outside [1/C, C]        | mean   |
| `mismatch/seq_ess_ratio_raw` | the same Kish ratio of R_b = exp(sum_t d_bt), one | mean   |
|                           | per response (rows without a valid token left out)  |        |

With n = 0, means are 0 and `ais/alpha_ess`, `ais/degenerate`, the three ESS ratios and
`mismatch/ratio_max` are 1.

The two ESS ratios are different quantities and named apart: `ais/ess_ratio_truncated` is the
one AIS acts on (truncated weights, ddof 1: design.md's alpha_ess^2), `mismatch/ess_ratio_raw` the
raw-weight (Kish) ESS other libraries log. "reduce" is how per-minibatch values combine into
one per step (`reduce_minibatch_metrics`): maxima, whose keys all end in `_max`, by max;
everything else by mean.

Conventions (shared by every correction):
- Inputs are cast to float32; each token log-ratio is formed in float32, zeroed where mask == 0
  and clipped to [-20, 20] before exp, so every output is finite unless a valid token's
  log-prob difference is NaN (e.g. -inf - -inf).
- Masked positions (mask == 0) return the broadcast input advantage unchanged and never enter a
  statistic: whatever the log-probs hold there, outputs and metrics are identical. The GRPO loss
  ignores those positions anyway.
- The whole output (advantages and metrics) is under `jax.lax.stop_gradient`: no gradient flows
  to any input through a correction (A is a constant in GRPO).
- On-policy inputs (logp_train == logp_rollout) give rho = 1 exactly and return the advantages
  bitwise unchanged, for every factory.
- Every correction returns the same metric keys (finite even for an all-zero mask), so the
  arms of an experiment plot side by side; the `ais/*` diagnostics are computed for every arm
  from the token-level w_bar = min(rho, C), with the arm's own (delta, gamma, beta_var, eps).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import chex
import jax
import jax.numpy as jnp

from ais_jax.checks import choice, number

Metrics = dict[str, jax.Array]
Correction = Callable[[jax.Array, jax.Array, jax.Array, jax.Array], tuple[jax.Array, Metrics]]

LOG_RATIO_LIMIT = 20.0
LEVELS = ("token", "sequence", "geometric")


# ----------------------------------------------------------------------------- validation
def _clip_value(clip: object) -> float:
    return number("clip", clip, lambda c: c >= 1.0, "a finite float C >= 1 (w = min(rho, C))")


def _diagnostic_settings(clip, delta, gamma, beta_var, eps) -> dict[str, float]:
    """Validated (clip, delta, gamma, beta_var, eps) of the AIS diagnostics, design.md section 3."""
    return dict(
        clip=_clip_value(clip),
        delta=number("delta", delta, lambda x: x > 0, "a finite float > 0"),
        gamma=number("gamma", gamma, lambda x: x > 0, "a finite float > 0"),
        beta_var=number("beta_var", beta_var, lambda x: x >= 0, "a finite float >= 0"),
        eps=number("eps", eps, lambda x: x > 0, "a finite float > 0 (std(A) may be 0)"),
    )


# ----------------------------------------------------------------------------- helpers
def _log_ratio(logp_train_BT: jax.Array, logp_rollout_BT: jax.Array, valid_BT: jax.Array):
    """log rho in float32, 0 where invalid, clipped to [-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT]."""
    diff_BT = logp_train_BT.astype(jnp.float32) - logp_rollout_BT.astype(jnp.float32)
    return jnp.clip(jnp.where(valid_BT, diff_BT, 0.0), -LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)


def _prepare(advantages, logp_train_BT, logp_rollout_BT, mask_BT):
    """Detaches and casts inputs; returns (advantages_BT, log_ratio_BT, valid_BT)."""
    inputs = (advantages, logp_train_BT, logp_rollout_BT, mask_BT)
    advantages, logp_train_BT, logp_rollout_BT, mask_BT = jax.lax.stop_gradient(
        tuple(jnp.asarray(x) for x in inputs)
    )
    chex.assert_rank(mask_BT, 2)
    chex.assert_equal_shape([logp_train_BT, logp_rollout_BT, mask_BT])
    valid_BT = mask_BT != 0
    advantages = advantages.astype(jnp.float32)
    if advantages.ndim == 1:
        chex.assert_shape(advantages, mask_BT.shape[:1])
        advantages_BT = jnp.broadcast_to(advantages[:, None], mask_BT.shape)
    else:
        chex.assert_shape(advantages, mask_BT.shape)
        advantages_BT = advantages
    return advantages_BT, _log_ratio(logp_train_BT, logp_rollout_BT, valid_BT), valid_BT


def _count(valid_BT: jax.Array) -> jax.Array:
    return jnp.sum(valid_BT, dtype=jnp.float32)


def _mean(x_BT: jax.Array, valid_BT: jax.Array) -> jax.Array:
    """Mean over valid entries; 0 when there are none."""
    return jnp.sum(jnp.where(valid_BT, x_BT, 0.0)) / jnp.maximum(_count(valid_BT), 1.0)


def _std(x_BT: jax.Array, valid_BT: jax.Array) -> jax.Array:
    """Sample std (ddof = 1) over valid entries; 0 when there are fewer than two."""
    centred_BT = jnp.where(valid_BT, x_BT - _mean(x_BT, valid_BT), 0.0)
    return jnp.sqrt(jnp.sum(centred_BT**2) / jnp.maximum(_count(valid_BT) - 1.0, 1.0))


def _level_log_ratio(log_ratio_BT: jax.Array, valid_BT: jax.Array, level: str) -> jax.Array:
    """Token log-ratios, or each sequence's sum ("sequence") / mean ("geometric") per token."""
    if level == "token":
        return log_ratio_BT
    total_B = jnp.sum(log_ratio_BT, axis=1)
    if level == "sequence":
        seq_B = jnp.clip(total_B, -LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    else:
        seq_B = total_B / jnp.maximum(jnp.sum(valid_BT, axis=1, dtype=jnp.float32), 1.0)
    return jnp.broadcast_to(seq_B[:, None], log_ratio_BT.shape)


def _mismatch(log_ratio_BT: jax.Array, valid_BT: jax.Array, clip: float) -> Metrics:
    """`mismatch/*` metrics from detached, clipped token log-ratios (see `mismatch_metrics`)."""
    n = _count(valid_BT)
    ratio_BT = jnp.where(valid_BT, jnp.exp(log_ratio_BT), 0.0)
    sum_w, sum_w2 = jnp.sum(ratio_BT), jnp.sum(ratio_BT**2)
    ess_ratio = jnp.where(n > 0, sum_w**2 / jnp.maximum(n * sum_w2, 1e-30), 1.0)
    outside_BT = jnp.abs(log_ratio_BT) > math.log(clip)
    # per response: R_b = exp(s_b), Kish's ratio (sum R)^2 / (m sum R^2) in log space
    rows_B = jnp.any(valid_BT, axis=1)
    s_B = jnp.where(rows_B, jnp.sum(jnp.where(valid_BT, log_ratio_BT, 0.0), axis=1), -jnp.inf)
    m = jnp.sum(rows_B, dtype=jnp.float32)
    log_seq_ess = 2.0 * jax.nn.logsumexp(s_B) - jax.nn.logsumexp(2.0 * s_B) - jnp.log(m)
    seq_ess_ratio = jnp.where(m > 0, jnp.exp(jnp.where(m > 0, log_seq_ess, 0.0)), 1.0)
    return {
        "mismatch/mean_abs": _mean(jnp.abs(log_ratio_BT), valid_BT),
        "mismatch/k1": _mean(-log_ratio_BT, valid_BT),
        "mismatch/k3": _mean(jnp.expm1(log_ratio_BT) - log_ratio_BT, valid_BT),
        "mismatch/ratio_max": jnp.where(n > 0, jnp.max(ratio_BT), 1.0),
        "mismatch/ess_ratio_raw": ess_ratio,
        "mismatch/frac_outside": _mean(outside_BT.astype(jnp.float32), valid_BT),
        "mismatch/seq_ess_ratio_raw": seq_ess_ratio,
    }


def _ais_statistics(advantages_BT, log_ratio_BT, valid_BT, *, clip, delta, gamma, beta_var, eps):
    """The AIS diagnostics (design.md section 3) over valid tokens; alpha = 0 if < 2 valid."""
    w_bar_BT = jnp.minimum(jnp.exp(log_ratio_BT), clip)
    cv = _std(w_bar_BT, valid_BT) / jnp.maximum(_mean(w_bar_BT, valid_BT), 1e-30)
    alpha_ess = jax.lax.rsqrt(1.0 + cv**2)
    mismatch = _mean(jnp.abs(log_ratio_BT), valid_BT)
    alpha_mis = jnp.minimum(1.0, mismatch / delta)
    var_ratio = _std(advantages_BT * w_bar_BT, valid_BT) / (_std(advantages_BT, valid_BT) + eps)
    alpha_var = jnp.maximum(0.0, (var_ratio - gamma) / gamma)
    degenerate = _count(valid_BT) < 2
    alpha = jnp.clip(alpha_ess - beta_var * alpha_var, 0.0, 1.0) * alpha_mis
    return w_bar_BT, {
        "ais/alpha": jnp.where(degenerate, 0.0, alpha),
        "ais/alpha_ess": alpha_ess,
        "ais/alpha_mis": alpha_mis,
        "ais/alpha_var": alpha_var,
        "ais/cv": cv,
        "ais/ess_ratio_truncated": alpha_ess**2,
        "ais/mismatch": mismatch,
        "ais/var_ratio": var_ratio,
        "ais/degenerate": degenerate.astype(jnp.float32),
    }


def _finish(advantages_BT, weight_BT, altered_BT, valid_BT, log_ratio_BT, stats, alpha, clip):
    """Applies weights on valid tokens and assembles the common metric dict (all detached)."""
    corrected_BT = jnp.where(valid_BT, weight_BT * advantages_BT, advantages_BT)
    metrics = {
        **stats,
        "ais/alpha": jnp.asarray(alpha, jnp.float32),
        "is/weight_mean": _mean(weight_BT, valid_BT),
        "is/weight_max": jnp.max(jnp.where(valid_BT, weight_BT, 0.0)),
        "is/clip_frac": _mean(altered_BT.astype(jnp.float32), valid_BT),
        **_mismatch(log_ratio_BT, valid_BT, clip),
    }
    metrics = {k: v.astype(jnp.float32) for k, v in metrics.items()}
    return jax.lax.stop_gradient((corrected_BT, metrics))


# ----------------------------------------------------------------------------- public API
def mismatch_metrics(logp_train_BT, logp_rollout_BT, mask_BT, *, clip: float = 5.0) -> Metrics:
    """Rollout-vs-trainer mismatch diagnostics over valid tokens (float32 scalars).

    With d_t = logp_train_t - logp_rollout_t (clipped to [-20, 20]) and r_t = exp(d_t) =
    pi_train / pi_rollout, tokens sampled from pi_rollout:

    - `mismatch/mean_abs`: mean |d_t|.
    - `mismatch/k1`: mean(-d_t) = mean(logp_rollout - logp_train), the k1 estimate of
      KL(rollout || train) (positive when the rollout is more confident in its own samples).
    - `mismatch/k3`: mean((r_t - 1) - log r_t), the non-negative k3 estimate of the same KL.
    - `mismatch/ratio_max`: max r_t.
    - `mismatch/ess_ratio_raw`: (sum r)^2 / (n * sum r^2) on the raw (untruncated) ratio.
    - `mismatch/frac_outside`: fraction of tokens with r_t outside [1/clip, clip].
    - `mismatch/seq_ess_ratio_raw`: (sum R)^2 / (m * sum R^2) of the m responses' ratios
      R_b = exp(sum_t d_bt) (rows with no valid token left out): the ESS of a sequence-level
      correction, which falls with the response length where the token ESS does not.

    With no valid token: means are 0 and ratio_max and both ESS ratios are 1.

    >>> m = mismatch_metrics(jnp.log(jnp.array([[0.5, 2.0]])), jnp.zeros((1, 2)), jnp.ones((1, 2)))
    >>> round(float(m["mismatch/mean_abs"]), 3), round(float(m["mismatch/ess_ratio_raw"]), 3)
    (0.693, 0.735)
    """
    clip = _clip_value(clip)
    mask_BT = jax.lax.stop_gradient(jnp.asarray(mask_BT))
    chex.assert_rank(mask_BT, 2)
    chex.assert_equal_shape([logp_train_BT, logp_rollout_BT, mask_BT])
    valid_BT = mask_BT != 0
    log_ratio_BT = _log_ratio(*jax.lax.stop_gradient((logp_train_BT, logp_rollout_BT)), valid_BT)
    return _mismatch(log_ratio_BT, valid_BT, clip)


def reduce_minibatch_metrics(metrics_U: Metrics) -> Metrics:
    """One value per key from per-minibatch values stacked on a leading axis U.

    Maxima (keys ending in `_max`) combine by max, so a step's `is/weight_max` is the largest
    weight of the step and not a mean of minibatch maxima; every other key by mean.

    >>> m = reduce_minibatch_metrics({"is/weight_max": jnp.array([2.0, 5.0]),
    ...                               "ais/alpha": jnp.array([0.2, 0.4])})
    >>> float(m["is/weight_max"]), round(float(m["ais/alpha"]), 3)
    (5.0, 0.3)
    """
    return {k: jnp.max(v) if k.endswith("_max") else jnp.mean(v) for k, v in metrics_U.items()}


def uncorrected(
    *,
    clip: float = 5.0,
    delta: float = 0.02,
    gamma: float = 1.2,
    beta_var: float = 1.0,
    eps: float = 1e-6,
) -> Correction:
    """The identity ("FP8 rollout, uncorrected" baseline): A_tilde = A, ais/alpha = 0.

    The keyword arguments only set the logged AIS diagnostics (as in `adaptive`): `clip` (C >= 1)
    the w_bar = min(rho, C) behind them, `delta`, `gamma`, `beta_var` and `eps` the gates.

    >>> logp_train, logp_rollout = jnp.log(jnp.array([[0.5, 2.0]])), jnp.zeros((1, 2))
    >>> adv, m = uncorrected()(jnp.array([1.0]), logp_train, logp_rollout, jnp.ones((1, 2)))
    >>> adv.tolist(), float(m["ais/alpha"]), round(float(m["mismatch/k3"]), 3)
    ([[1.0, 1.0]], 0.0, 0.25)
    """
    hyper = _diagnostic_settings(clip, delta, gamma, beta_var, eps)
    clip = hyper["clip"]

    def correction(advantages, logp_train_BT, logp_rollout_BT, mask_BT):
        adv_BT, log_ratio_BT, valid_BT = _prepare(
            advantages, logp_train_BT, logp_rollout_BT, mask_BT
        )
        _, stats = _ais_statistics(adv_BT, log_ratio_BT, valid_BT, **hyper)
        ones_BT = jnp.ones_like(adv_BT)
        no_BT = jnp.zeros_like(valid_BT)
        return _finish(adv_BT, ones_BT, no_BT, valid_BT, log_ratio_BT, stats, 0.0, clip)

    return correction


def truncated(
    clip: float = 5.0,
    *,
    level: str = "token",
    delta: float = 0.02,
    gamma: float = 1.2,
    beta_var: float = 1.0,
    eps: float = 1e-6,
) -> Correction:
    """Truncated IS (TIS): A_tilde = min(rho, C) * A, ais/alpha = 1.

    `level="token"` uses each token's rho; `"sequence"` uses exp(sum_t log rho_t) of the token's
    sequence and `"geometric"` exp(mean_t log rho_t), as in verl's rollout-IS levels.
    `is/clip_frac` is the fraction of valid tokens whose weight was capped at C. `delta`,
    `gamma`, `beta_var` and `eps` only set the logged AIS diagnostics (as in `adaptive`).

    >>> adv, _ = truncated(2.0)(jnp.array([1.0]), jnp.log(jnp.array([[0.5, 3.0]])),
    ...                         jnp.zeros((1, 2)), jnp.ones((1, 2)))
    >>> [round(x, 3) for x in adv[0].tolist()]
    [0.5, 2.0]
    """
    hyper = _diagnostic_settings(clip, delta, gamma, beta_var, eps)
    clip = hyper["clip"]
    level = choice("level", level, LEVELS)

    def correction(advantages, logp_train_BT, logp_rollout_BT, mask_BT):
        adv_BT, log_ratio_BT, valid_BT = _prepare(
            advantages, logp_train_BT, logp_rollout_BT, mask_BT
        )
        _, stats = _ais_statistics(adv_BT, log_ratio_BT, valid_BT, **hyper)
        rho_BT = jnp.exp(_level_log_ratio(log_ratio_BT, valid_BT, level))
        weight_BT = jnp.minimum(rho_BT, clip)
        altered_BT = valid_BT & (rho_BT > clip)
        return _finish(adv_BT, weight_BT, altered_BT, valid_BT, log_ratio_BT, stats, 1.0, clip)

    return correction


def adaptive(
    clip: float = 5.0,
    delta: float = 0.02,
    gamma: float = 1.2,
    beta_var: float = 1.0,
    eps: float = 1e-6,
    *,
    alpha_override: float | None = None,
) -> Correction:
    """Adaptive IS (AIS): A_tilde = (1 + alpha * (min(rho, C) - 1)) * A, one alpha per call.

    alpha = clip(alpha_ess - beta_var * alpha_var, 0, 1) * alpha_mis (module docstring), over the
    valid tokens of the call with ddof = 1; alpha = 0 ("no correction") interpolates to alpha = 1
    (TIS). With fewer than two valid tokens the statistics are undefined: alpha = 0 (identity)
    and `ais/degenerate` = 1. `alpha_override` in [0, 1] fixes alpha (ablations and tests; it
    applies even when degenerate); the diagnostics are still computed and logged.
    `is/clip_frac` counts tokens with rho > C.

    The source's worked example (ais/cv 0.421, alpha_ess 0.922, var_ratio 1.290, alpha 0.847):

    >>> w = jnp.array([[0.8, 1.0, 1.2, 2.0]])
    >>> adv, m = adaptive()(jnp.array([[1.2, 0.4, -0.2, -0.8]]), jnp.log(w), jnp.zeros_like(w),
    ...                     jnp.ones_like(w))
    >>> [round(x, 3) for x in adv[0].tolist()], round(float(m["ais/alpha"]), 3)
    ([0.997, 0.4, -0.234, -1.478], 0.847)
    """
    hyper = _diagnostic_settings(clip, delta, gamma, beta_var, eps)
    clip = hyper["clip"]
    if alpha_override is not None:
        alpha_override = number(
            "alpha_override", alpha_override, lambda x: 0 <= x <= 1, "None or a float in [0, 1]"
        )

    def correction(advantages, logp_train_BT, logp_rollout_BT, mask_BT):
        adv_BT, log_ratio_BT, valid_BT = _prepare(
            advantages, logp_train_BT, logp_rollout_BT, mask_BT
        )
        w_bar_BT, stats = _ais_statistics(adv_BT, log_ratio_BT, valid_BT, **hyper)
        alpha = stats["ais/alpha"] if alpha_override is None else alpha_override
        weight_BT = 1.0 + alpha * (w_bar_BT - 1.0)
        altered_BT = valid_BT & (jnp.exp(log_ratio_BT) > clip)
        return _finish(adv_BT, weight_BT, altered_BT, valid_BT, log_ratio_BT, stats, alpha, clip)

    return correction


def masked(
    low: float = 0.5,
    high: float = 2.0,
    level: str = "token",
    *,
    clip: float = 5.0,
    delta: float = 0.02,
    gamma: float = 1.2,
    beta_var: float = 1.0,
    eps: float = 1e-6,
) -> Correction:
    """Masked IS (MIS / IcePop): A_tilde = A if low <= rho <= high else 0, ais/alpha = 1.

    Requires 0 < low <= 1 <= high (so on-policy tokens, rho = 1, are always kept). `level`:
    `"token"` drops single tokens, `"sequence"` whole sequences by exp(sum_t log rho_t) and
    `"geometric"` by exp(mean_t log rho_t). `is/clip_frac` is the fraction of valid tokens
    dropped; `clip`, `delta`, `gamma`, `beta_var` and `eps` only set the logged AIS diagnostics.

    >>> adv, m = masked()(jnp.array([1.0]), jnp.log(jnp.array([[0.4, 1.5]])), jnp.zeros((1, 2)),
    ...                   jnp.ones((1, 2)))
    >>> adv.tolist(), float(m["is/clip_frac"])
    ([[0.0, 1.0]], 0.5)
    """
    low = number("low", low, lambda x: 0 < x <= 1, "a float in (0, 1]")
    high = number("high", high, lambda x: x >= 1, "a finite float >= 1")
    level = choice("level", level, LEVELS)
    hyper = _diagnostic_settings(clip, delta, gamma, beta_var, eps)
    clip = hyper["clip"]
    log_low, log_high = math.log(low), math.log(high)

    def correction(advantages, logp_train_BT, logp_rollout_BT, mask_BT):
        adv_BT, log_ratio_BT, valid_BT = _prepare(
            advantages, logp_train_BT, logp_rollout_BT, mask_BT
        )
        _, stats = _ais_statistics(adv_BT, log_ratio_BT, valid_BT, **hyper)
        level_BT = _level_log_ratio(log_ratio_BT, valid_BT, level)
        keep_BT = (level_BT >= log_low) & (level_BT <= log_high)
        weight_BT = keep_BT.astype(jnp.float32)
        altered_BT = valid_BT & ~keep_BT
        return _finish(adv_BT, weight_BT, altered_BT, valid_BT, log_ratio_BT, stats, 1.0, clip)

    return correction
