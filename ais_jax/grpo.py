"""GRPO: group-relative advantages and the clipped policy-gradient loss.

One GRPO step samples G responses per prompt, rewards them, and turns each reward into an
advantage relative to its group (`group_advantages`). The policy then takes gradient steps on the
PPO clipped surrogate (`loss`, or `make_loss` for a loss function closing over its
hyper-parameters, optax-style), per valid response token t of sequence b:

    r_bt    = exp(logp_new_bt - logp_old_bt)                       (log-ratio clipped to +-20)
    l_bt    = -min(r_bt * A_bt, clip(r_bt, 1 - clip_low, 1 + clip_high) * A_bt)
    kl_bt   = exp(ref_bt - new_bt) - (ref_bt - new_bt) - 1         (k3 estimator, optional)
    loss    = agg(l) + kl_coef * agg(kl)

`agg` is one of the three token-aggregation rules in use:

| aggregation               | rule                                                  | used by   |
|---------------------------|-------------------------------------------------------|-----------|
| `token_mean`              | sum over valid tokens / number of valid tokens        | DAPO      |
| `seq_mean_token_mean`     | per-sequence token mean, then mean over sequences     | GRPO      |
|                           | that have at least one valid token                    |           |
| `seq_mean_token_sum_norm` | per-sequence token sum / T (the mask width), then     | Dr. GRPO  |
|                           | mean over all B sequences (constant normaliser B * T) |           |

The rollout-vs-trainer correction of `ais_jax.ais` plugs in as `correction=`: the loss then calls
`correction(advantages, logp_old_BT, logp_rollout_BT, mask_BT)` (logp_old is the trainer's
score of the rollout tokens, "logp_train" in ais.py) and trains on the corrected advantages,
merging the correction's metrics into its own. The correction is detached, so gradients flow
only through logp_new.

Precision: every log-prob, ratio and loss is cast to float32. Positions with mask == 0 contribute
nothing to the loss, its gradient or its metrics, whatever they hold. Hyper-parameters are Python
values validated eagerly; to jit, close over them (`make_loss`) rather than passing tracers.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable

import chex
import jax
import jax.numpy as jnp

from ais_jax.checks import choice, number

Metrics = dict[str, jax.Array]
LossFn = Callable[..., tuple[jax.Array, Metrics]]

AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm")
SCALES = ("group", "batch", "none")
LOG_RATIO_LIMIT = 20.0


def _std(x_GN: jax.Array, axis: int | None) -> jax.Array:
    """Sample std (ddof = 1) along `axis`; 0 when it has a single element."""
    n = x_GN.size if axis is None else x_GN.shape[axis]
    return jnp.std(x_GN, axis=axis, ddof=1 if n > 1 else 0, keepdims=axis is not None)


def group_advantages(
    rewards_B: jax.Array, group_size: int, *, scale: str = "group", eps: float = 1e-6
) -> jax.Array:
    """Group-relative advantages A_b = (r_b - mean_group(b)) / (s + eps), float32 [B].

    Rewards are laid out as B / G consecutive groups of `group_size` G (the G responses to one
    prompt). `scale` chooses s: `"group"` the std of the group, `"batch"` the std of all B
    rewards (TRL's `scale_rewards="batch"`), `"none"` no division (Dr. GRPO). Standard
    deviations use ddof = 1, as torch.std in verl and TRL; a single-element group or batch has
    s = 0 (and, for groups, a centred reward of 0).

    >>> [round(a, 3) for a in group_advantages(jnp.array([1.0, 0.0, 0.0, 0.0]), 2).tolist()]
    [0.707, -0.707, 0.0, 0.0]
    """
    rewards_B = jnp.asarray(rewards_B, jnp.float32)
    chex.assert_rank(rewards_B, 1)
    if isinstance(group_size, bool) or not isinstance(group_size, numbers.Integral):
        raise ValueError(f"group_size={group_size!r} must be a positive int")
    if group_size < 1 or rewards_B.shape[0] % group_size:
        raise ValueError(
            f"group_size={group_size!r} must be a positive int dividing the batch size "
            f"B={rewards_B.shape[0]} (rewards are consecutive groups of group_size)"
        )
    scale = choice("scale", scale, SCALES)
    eps = number("eps", eps, lambda x: x >= 0, "a finite float >= 0")

    rewards_NG = rewards_B.reshape(-1, int(group_size))
    centred_NG = rewards_NG - jnp.mean(rewards_NG, axis=1, keepdims=True)
    if scale == "group":
        centred_NG = centred_NG / (_std(rewards_NG, axis=1) + eps)
    elif scale == "batch":
        centred_NG = centred_NG / (_std(rewards_B, axis=None) + eps)
    return centred_NG.reshape(-1)


def _aggregate(x_BT: jax.Array, valid_BT: jax.Array, aggregation: str) -> jax.Array:
    """Reduces per-token values to a scalar by one of AGGREGATIONS (module docstring)."""
    x_BT = jnp.where(valid_BT, x_BT, 0.0)
    if aggregation == "token_mean":
        return jnp.sum(x_BT) / jnp.maximum(jnp.sum(valid_BT, dtype=jnp.float32), 1.0)
    sum_B = jnp.sum(x_BT, axis=1)
    if aggregation == "seq_mean_token_sum_norm":
        return jnp.mean(sum_B / x_BT.shape[1])
    count_B = jnp.sum(valid_BT, axis=1, dtype=jnp.float32)
    has_B = count_B > 0
    seq_B = jnp.where(has_B, sum_B / jnp.maximum(count_B, 1.0), 0.0)
    return jnp.sum(seq_B) / jnp.maximum(jnp.sum(has_B, dtype=jnp.float32), 1.0)


def _token_mean(x_BT: jax.Array, valid_BT: jax.Array) -> jax.Array:
    return _aggregate(x_BT, valid_BT, "token_mean")


def _log_ratio(a_BT: jax.Array, b_BT: jax.Array, valid_BT: jax.Array) -> jax.Array:
    """a - b in float32, 0 where invalid, clipped to [-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT]."""
    diff_BT = jnp.where(valid_BT, a_BT.astype(jnp.float32) - b_BT.astype(jnp.float32), 0.0)
    return jnp.clip(diff_BT, -LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)


def make_loss(
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    kl_coef: float = 0.0,
    aggregation: str = "seq_mean_token_mean",
    correction: Callable | None = None,
) -> LossFn:
    """Validates the hyper-parameters and returns `loss_fn` (same call as `loss`, minus them).

    `loss_fn(logp_new_BT, logp_old_BT, advantages, mask_BT, *, logp_ref_BT=None,
    logp_rollout_BT=None) -> (loss, metrics)`; see `loss` for the meaning of each argument.
    """
    clip_low = number("clip_low", clip_low, lambda x: 0 <= x < 1, "a float in [0, 1)")
    clip_high = number("clip_high", clip_high, lambda x: x >= 0, "a finite float >= 0")
    kl_coef = number("kl_coef", kl_coef, lambda x: x >= 0, "a finite float >= 0")
    aggregation = choice("aggregation", aggregation, AGGREGATIONS)
    if correction is not None and not callable(correction):
        raise ValueError(f"correction={correction!r} must be None or a callable from ais_jax.ais")
    lower, upper = 1.0 - clip_low, 1.0 + clip_high

    def loss_fn(
        logp_new_BT, logp_old_BT, advantages, mask_BT, *, logp_ref_BT=None, logp_rollout_BT=None
    ):
        mask_BT = jax.lax.stop_gradient(jnp.asarray(mask_BT))
        chex.assert_rank(mask_BT, 2)
        chex.assert_equal_shape([logp_new_BT, logp_old_BT, mask_BT])
        valid_BT = mask_BT != 0
        logp_old_BT = jax.lax.stop_gradient(logp_old_BT)
        metrics: Metrics = {}
        if correction is not None:
            if logp_rollout_BT is None:
                raise ValueError("logp_rollout_BT=None, but the correction needs rollout log-probs")
            advantages, metrics = correction(advantages, logp_old_BT, logp_rollout_BT, mask_BT)
        elif logp_rollout_BT is not None:
            raise ValueError(
                "logp_rollout_BT was given but correction=None; pass correction="
                "ais.uncorrected() to train uncorrected while logging the mismatch"
            )
        if kl_coef > 0 and logp_ref_BT is None:
            raise ValueError(f"kl_coef={kl_coef!r} > 0 needs logp_ref_BT")

        advantages = jnp.asarray(advantages, jnp.float32)
        if advantages.ndim == 1:
            chex.assert_shape(advantages, mask_BT.shape[:1])
            advantages = advantages[:, None]
        adv_BT = jnp.broadcast_to(advantages, mask_BT.shape)

        log_ratio_BT = _log_ratio(logp_new_BT, logp_old_BT, valid_BT)
        ratio_BT = jnp.exp(log_ratio_BT)
        # Where min(r A, clip(r) A) picks the clipped term, its value is a constant: zero gradient.
        high_BT = valid_BT & (adv_BT > 0) & (ratio_BT > upper)
        low_BT = valid_BT & (adv_BT < 0) & (ratio_BT < lower)
        ratio_eff_BT = jnp.where(high_BT, upper, jnp.where(low_BT, lower, ratio_BT))
        policy = _aggregate(-adv_BT * ratio_eff_BT, valid_BT, aggregation)

        kl = jnp.zeros((), jnp.float32)
        if logp_ref_BT is not None:
            chex.assert_equal_shape([logp_ref_BT, mask_BT])
            ref_log_ratio_BT = _log_ratio(jax.lax.stop_gradient(logp_ref_BT), logp_new_BT, valid_BT)
            kl = _aggregate(jnp.expm1(ref_log_ratio_BT) - ref_log_ratio_BT, valid_BT, aggregation)
        total = policy + kl_coef * kl

        loss_metrics = {
            "loss/policy": policy,
            "loss/kl": kl,
            "loss/total": total,
            "loss/clip_frac_low": _token_mean(low_BT.astype(jnp.float32), valid_BT),
            "loss/clip_frac_high": _token_mean(high_BT.astype(jnp.float32), valid_BT),
            "loss/ratio_mean": _token_mean(ratio_BT, valid_BT),
            "loss/approx_kl": _token_mean(jnp.expm1(log_ratio_BT) - log_ratio_BT, valid_BT),
        }
        metrics = {**metrics, **jax.lax.stop_gradient(loss_metrics)}
        return total, metrics

    return loss_fn


def loss(
    logp_new_BT: jax.Array,
    logp_old_BT: jax.Array,
    advantages: jax.Array,
    mask_BT: jax.Array,
    *,
    logp_ref_BT: jax.Array | None = None,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    kl_coef: float = 0.0,
    aggregation: str = "seq_mean_token_mean",
    correction: Callable | None = None,
    logp_rollout_BT: jax.Array | None = None,
) -> tuple[jax.Array, Metrics]:
    """GRPO/PPO clipped surrogate (+ optional k3 KL to a reference), float32 scalar and metrics.

    Args:
      logp_new_BT: log-probs of the sampled tokens under the policy being updated (the only
        input gradients flow to).
      logp_old_BT: the same tokens under the pre-update trainer policy (detached).
      advantages: [B] (broadcast to tokens) or [B, T].
      mask_BT: non-zero on the response tokens that count.
      logp_ref_BT: reference-policy log-probs for the KL term (required when kl_coef > 0).
      clip_low, clip_high: the ratio is clipped to [1 - clip_low, 1 + clip_high] (DAPO's
        asymmetric "clip-higher" when clip_high > clip_low); 0 <= clip_low < 1, clip_high >= 0.
      kl_coef: weight of the aggregated k3 KL (>= 0); the KL is logged whenever logp_ref_BT is
        given.
      aggregation: one of AGGREGATIONS (module docstring).
      correction: optional `ais_jax.ais` correction applied to the advantages first.
      logp_rollout_BT: the rollout engine's log-probs of the tokens; only with `correction`.

    Metrics: `loss/policy`, `loss/kl`, `loss/total`, `loss/clip_frac_low` and
    `loss/clip_frac_high` (fraction of valid tokens whose clipped term is active: A < 0 and
    r < 1 - clip_low, resp. A > 0 and r > 1 + clip_high), `loss/ratio_mean` (token mean of r) and
    `loss/approx_kl` (token mean of (r - 1) - log r, k3 of KL(old || new)); plus the
    correction's metrics.

    >>> value, m = loss(jnp.zeros((1, 2)), jnp.zeros((1, 2)), jnp.array([2.0]), jnp.ones((1, 2)))
    >>> float(value), float(m["loss/ratio_mean"])
    (-2.0, 1.0)
    """
    loss_fn = make_loss(
        clip_low=clip_low,
        clip_high=clip_high,
        kl_coef=kl_coef,
        aggregation=aggregation,
        correction=correction,
    )
    return loss_fn(
        logp_new_BT,
        logp_old_BT,
        advantages,
        mask_BT,
        logp_ref_BT=logp_ref_BT,
        logp_rollout_BT=logp_rollout_BT,
    )
