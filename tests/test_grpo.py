"""Specification of ais_jax.grpo: advantages, aggregation, clipping, gradients, jit/vmap."""

import doctest

import hypothesis
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import references
from hypothesis import strategies as st

from ais_jax import ais, grpo

B, T = 4, 5
SETTINGS = hypothesis.settings(max_examples=30, deadline=None, derandomize=True)
AGGREGATIONS = grpo.AGGREGATIONS


def make_batch(seed, per_token=False, density=0.6):
    """(logp_BT, advantages [B] or [B, T], mask_BT); row 0 of the mask is left empty."""
    rng = np.random.default_rng(seed)
    logp = -rng.exponential(2.0, size=(B, T)).astype(np.float32)
    advantages = rng.normal(size=(B, T) if per_token else (B,)).astype(np.float32)
    mask = (rng.uniform(size=(B, T)) < density).astype(np.float32)
    mask[0] = 0.0
    mask[1, 0] = 1.0
    return logp, advantages, mask


# --------------------------------------------------------------------------- group_advantages
def test_group_advantages_by_hand():
    rewards = jnp.array([1.0, 0.0, 0.0, 0.0, 3.0, 1.0])
    got = grpo.group_advantages(rewards, 3)
    s1, s2 = np.std([1, 0, 0], ddof=1), np.std([0, 3, 1], ddof=1)
    expected = [2 / 3 / s1, -1 / 3 / s1, -1 / 3 / s1, -4 / 3 / s2, 5 / 3 / s2, -1 / 3 / s2]
    np.testing.assert_allclose(got, expected, rtol=1e-5)
    assert got.dtype == jnp.float32
    batch_std = np.std([1, 0, 0, 0, 3, 1], ddof=1)
    got = grpo.group_advantages(rewards, 3, scale="batch")
    np.testing.assert_allclose(got, np.array([2, -1, -1, -4, 5, -1]) / 3 / batch_std, rtol=1e-5)
    got = grpo.group_advantages(rewards, 3, scale="none")
    np.testing.assert_allclose(got, np.array([2, -1, -1, -4, 5, -1]) / 3, rtol=1e-6)


def test_group_advantages_degenerate_groups_are_zero():
    np.testing.assert_array_equal(grpo.group_advantages(jnp.array([1.0, 2.0]), 1), [0.0, 0.0])
    np.testing.assert_array_equal(grpo.group_advantages(jnp.full((4,), 0.5), 2), [0.0] * 4)


@pytest.mark.parametrize(
    "kwargs, named",
    [
        (dict(group_size=3), "group_size=3"),
        (dict(group_size=0), "group_size=0"),
        (dict(group_size=2.0), "group_size=2.0"),
        (dict(group_size=2, scale="std"), "scale='std'"),
        (dict(group_size=2, eps=-1.0), "eps=-1.0"),
    ],
)
def test_group_advantages_bad_arguments(kwargs, named):
    with pytest.raises(ValueError, match=named.replace(".", r"\.")):
        grpo.group_advantages(jnp.zeros(4), **kwargs)


# --------------------------------------------------------------------------- loss values
def _hand_example():
    """Two valid tokens in sequence 0 (A = 1), one in sequence 1 (A = -2), width T = 3.

    Ratios: seq 0 [1.5 (clipped high -> 1.2), 0.9], seq 1 [0.5 (clipped low -> 0.8)].
    Token losses -A * r_eff: seq 0 [-1.2, -0.9], seq 1 [1.6].
    """
    logp_old = np.log(np.array([[0.2, 0.5, 0.3], [0.4, 0.1, 0.7]], np.float32))
    logp_new = logp_old + np.log(np.array([[1.5, 0.9, 7.0], [0.5, 3.0, 1.0]], np.float32))
    mask = np.array([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]], np.float32)
    return logp_new, logp_old, np.array([1.0, -2.0], np.float32), mask


@pytest.mark.parametrize(
    "aggregation, expected",
    [
        ("token_mean", (-1.2 - 0.9 + 1.6) / 3),
        ("seq_mean_token_mean", ((-1.2 - 0.9) / 2 + 1.6) / 2),
        ("seq_mean_token_sum_norm", ((-1.2 - 0.9) / 3 + 1.6 / 3) / 2),
    ],
)
def test_loss_by_hand(aggregation, expected):
    value, m = grpo.loss(*_hand_example(), aggregation=aggregation)
    assert float(value) == pytest.approx(expected, rel=1e-5)
    assert float(m["loss/policy"]) == pytest.approx(expected, rel=1e-5)
    assert float(m["loss/clip_frac_high"]) == pytest.approx(1 / 3)
    assert float(m["loss/clip_frac_low"]) == pytest.approx(1 / 3)
    assert float(m["loss/ratio_mean"]) == pytest.approx((1.5 + 0.9 + 0.5) / 3, rel=1e-5)
    r = np.array([1.5, 0.9, 0.5])
    assert float(m["loss/approx_kl"]) == pytest.approx(np.mean(r - 1 - np.log(r)), rel=1e-5)
    assert float(m["loss/kl"]) == 0.0


def test_kl_term_by_hand():
    logp_new, logp_old, adv, mask = _hand_example()
    logp_ref = logp_new + np.array([[0.5, -0.25, 9.0], [1.0, 9.0, 9.0]], np.float32)
    d = np.array([0.5, -0.25, 1.0])  # ref - new on the valid tokens
    kl = np.mean(np.exp(d) - d - 1)
    policy, _ = grpo.loss(logp_new, logp_old, adv, mask, aggregation="token_mean")
    value, m = grpo.loss(
        logp_new, logp_old, adv, mask, logp_ref_BT=logp_ref, kl_coef=0.1, aggregation="token_mean"
    )
    assert float(m["loss/kl"]) == pytest.approx(kl, rel=1e-5)
    assert float(value) == pytest.approx(float(policy) + 0.1 * kl, rel=1e-5)


# --------------------------------------------------------------------------- gradients
def _normaliser(mask, aggregation):
    if aggregation == "token_mean":
        return np.full_like(mask, mask.sum())
    if aggregation == "seq_mean_token_sum_norm":
        return np.full_like(mask, mask.size)
    count = mask.sum(axis=1, keepdims=True)
    return np.maximum(count, 1) * (count > 0).sum()


GRADS = {
    agg: jax.jit(jax.grad(grpo.make_loss(aggregation=agg), has_aux=True)) for agg in AGGREGATIONS
}


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
@SETTINGS
@hypothesis.given(seed=st.integers(0, 2**32 - 1), per_token=st.booleans())
def test_on_policy_gradient_is_reinforce(aggregation, seed, per_token):
    logp, adv, mask = make_batch(seed, per_token)
    grad, _ = GRADS[aggregation](logp, logp, adv, mask)
    adv_BT = np.broadcast_to(adv[:, None], (B, T)) if adv.ndim == 1 else adv
    expected = -adv_BT * mask / _normaliser(mask, aggregation)
    np.testing.assert_allclose(np.asarray(grad), expected, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_clipped_edges_have_zero_gradient(aggregation):
    # Tokens: [r = 1.5, A > 0] clipped, [r = 0.5, A < 0] clipped, [r = 0.5, A > 0] and
    # [r = 1.5, A < 0] not clipped (the pessimistic term is the unclipped one).
    logp_old = np.zeros((4, 1), np.float32)
    logp_new = np.log(np.array([[1.5], [0.5], [0.5], [1.5]], np.float32))
    adv = np.array([1.0, -1.0, 1.0, -1.0], np.float32)
    mask = np.ones((4, 1), np.float32)
    loss_fn = grpo.make_loss(clip_low=0.2, clip_high=0.28, aggregation=aggregation)
    grad, m = jax.grad(loss_fn, has_aux=True)(logp_new, logp_old, adv, mask)
    grad = np.asarray(grad)[:, 0]
    assert grad[0] == 0.0 and grad[1] == 0.0
    np.testing.assert_allclose(grad[2:], [-0.5 / 4, 1.5 / 4], rtol=1e-6)
    assert float(m["loss/clip_frac_high"]) == 0.25 and float(m["loss/clip_frac_low"]) == 0.25


_VALUE_AND_GRAD_WITH_KL = jax.jit(jax.value_and_grad(grpo.make_loss(kl_coef=0.1), has_aux=True))


@SETTINGS
@hypothesis.given(seed=st.integers(0, 2**32 - 1), junk=st.sampled_from([1e4, np.inf, np.nan]))
def test_masked_positions_change_nothing(seed, junk):
    logp, adv, mask = make_batch(seed)
    logp_new = logp + 0.1 * np.random.default_rng(seed).normal(size=(B, T)).astype(np.float32)
    noise = np.where(mask == 0, junk, 0.0).astype(np.float32)
    loss_fn = _VALUE_AND_GRAD_WITH_KL
    (v1, m1), g1 = loss_fn(logp_new, logp, adv, mask, logp_ref_BT=logp)
    (v2, m2), g2 = loss_fn(logp_new + noise, logp - noise, adv, mask, logp_ref_BT=logp + noise)
    assert float(v1) == float(v2) and np.isfinite(float(v1))
    np.testing.assert_array_equal(np.asarray(g1), np.asarray(g2))
    for key in m1:
        assert float(m1[key]) == float(m2[key]), key


def test_no_gradient_through_correction_to_logp_old_or_rollout():
    logp, adv, mask = make_batch(7, per_token=True)
    rng = np.random.default_rng(7)
    logp_rollout = (logp + 0.3 * rng.normal(size=(B, T))).astype(np.float32)
    logp_new = (logp + 0.1 * rng.normal(size=(B, T))).astype(np.float32)
    correction = ais.adaptive()
    corrected, _ = correction(adv, logp, logp_rollout, mask)

    def with_correction(old, rollout):
        return grpo.loss(logp_new, old, adv, mask, correction=correction, logp_rollout_BT=rollout)[
            0
        ]

    def with_constant_advantages(old):
        return grpo.loss(logp_new, old, corrected, mask)[0]

    g_old, g_rollout = jax.grad(with_correction, argnums=(0, 1))(logp, logp_rollout)
    np.testing.assert_array_equal(np.asarray(g_rollout), 0.0)
    np.testing.assert_array_equal(np.asarray(g_old), 0.0)  # logp_old is detached in the loss
    np.testing.assert_array_equal(np.asarray(jax.grad(with_constant_advantages)(logp)), 0.0)
    value = with_correction(logp, logp_rollout)
    _, m = grpo.loss(logp_new, logp, adv, mask, correction=correction, logp_rollout_BT=logp_rollout)
    plain_value, m_plain = grpo.loss(logp_new, logp, corrected, mask)
    assert float(value) == float(plain_value)
    # the loss's metrics are the correction's plus its own, unchanged
    _, m_correction = correction(adv, logp, logp_rollout, mask)
    assert set(m) == set(m_correction) | set(m_plain)
    for key, expected in {**m_correction, **m_plain}.items():
        assert float(m[key]) == float(expected), key


# --------------------------------------------------------------------------- KL gradient
# A softmax policy, logits_BTV = features_BTF @ theta_FV, gives logp_new (theta), logp_old
# (theta_old) and logp_ref (theta_ref) of the same tokens. Only theta may receive a gradient:
# d loss / d logp_new_bt = w_bt (-A_bt r_bt [r_bt's clipped term inactive]
#                                + kl_coef (1 - exp(ref_bt - new_bt)))
# on valid tokens (w_bt: the aggregation's weight 1 / _normaliser), and
# d logp_new_bt / d theta_fv = features_btf (onehot(token_bt)_v - p_btv).
PF, PV = 3, 6
KL_COEF = 0.5  # large enough that the KL term is a fifth or more of the gradient


def _kl_batch(seed):
    rng = np.random.default_rng(seed)
    _, adv, mask = make_batch(seed)
    features = rng.normal(size=(B, T, PF))
    tokens = rng.integers(0, PV, size=(B, T))
    theta = 0.8 * rng.normal(size=(PF, PV))
    theta_old = theta + 0.3 * rng.normal(size=(PF, PV))  # some PPO ratios leave [0.8, 1.2]
    theta_ref = theta + 0.6 * rng.normal(size=(PF, PV))
    return features, tokens, theta, theta_old, theta_ref, adv, mask


def _reference_kl_gradient(features, tokens, theta, theta_old, theta_ref, adv, mask, agg, kl):
    """The float64 gradient of the loss with respect to theta (module comment above), and the
    sum of |terms| of each element (the scale of its float32 rounding)."""
    logp, p_BTV = references.softmax_logp(theta, features, tokens)
    logp_old, _ = references.softmax_logp(theta_old, features, tokens)
    logp_ref, _ = references.softmax_logp(theta_ref, features, tokens)
    adv_BT = np.broadcast_to(adv[:, None], mask.shape).astype(np.float64)
    ratio = np.exp(logp - logp_old)
    clipped = ((adv_BT > 0) & (ratio > 1.2)) | ((adv_BT < 0) & (ratio < 0.8))
    policy_BT = np.where(clipped, 0.0, -adv_BT * ratio)
    kl_BT = kl * (1.0 - np.exp(logp_ref - logp))
    weight_BT = np.where(mask != 0, 1.0 / _normaliser(mask, agg), 0.0)
    dlogp_BTV = np.eye(PV)[tokens] - p_BTV
    grad = np.einsum("bt,btf,btv->fv", weight_BT * (policy_BT + kl_BT), features, dlogp_BTV)
    terms = weight_BT * (np.abs(policy_BT) + np.abs(kl_BT))
    scale = np.einsum("bt,btf,btv->fv", terms, np.abs(features), np.abs(dlogp_BTV))
    return grad, scale, clipped[mask != 0].sum()


def _jax_kl_gradients(features, tokens, theta, theta_old, theta_ref, adv, mask, agg, kl):
    """d loss / d (theta, theta_old, theta_ref) by jax, the policy in float64."""

    def logp(theta_FV):
        logp_BTV = jax.nn.log_softmax(jnp.einsum("btf,fv->btv", features, theta_FV), axis=-1)
        return jnp.take_along_axis(logp_BTV, tokens[..., None], axis=-1)[..., 0]

    def objective(theta_FV, theta_old_FV, theta_ref_FV):
        value, _ = grpo.loss(
            logp(theta_FV),
            logp(theta_old_FV),
            adv,
            mask,
            logp_ref_BT=logp(theta_ref_FV),
            kl_coef=kl,
            aggregation=agg,
        )
        return value

    with jax.enable_x64(True):
        grads = jax.grad(objective, argnums=(0, 1, 2))(theta, theta_old, theta_ref)
        return [np.asarray(g) for g in grads]


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_kl_gradient_matches_float64_reference(aggregation, seed):
    """The gradient of the PPO loss plus kl_coef * k3(ref || new) reaches the policy only
    through logp_new: with respect to theta it is the hand-derived float64 gradient above; the
    reference and old policies' parameters get exactly 0 (logp_ref and logp_old are detached).
    Moving the KL's stop_gradient from logp_ref onto logp_new, or removing it, fails here.

    Tolerance: 4e-7 of the sum of |terms| per element; the loss is float32 (log-ratios, exp,
    sums: a few ulp; measured <= 1.35e-7 over these cases, jax 0.10.2 CPU: 3x margin). The
    KL's share of the gradient (measured >= 0.12 of the largest scale) is checked to be far
    above it, so a loss without the KL gradient cannot pass."""
    batch = _kl_batch(seed)
    ref, scale, n_clipped = _reference_kl_gradient(*batch, aggregation, KL_COEF)
    g_theta, g_old, g_ref = _jax_kl_gradients(*batch, aggregation, KL_COEF)
    assert (np.abs(g_theta - ref) <= 4e-7 * scale).all(), np.abs(g_theta - ref) / scale
    np.testing.assert_array_equal(g_old, 0.0)
    np.testing.assert_array_equal(g_ref, 0.0)
    # preconditions: some PPO-clipped tokens, and a KL gradient far above the tolerance
    without_kl, _, _ = _reference_kl_gradient(*batch, aggregation, 0.0)
    assert n_clipped >= 1
    assert np.abs(ref - without_kl).max() > 1e4 * 4e-7 * scale.max()


# --------------------------------------------------------------------------- transformations
def test_jit_vmap_grad_and_no_recompile():
    traces = []
    loss_fn = grpo.make_loss(aggregation="token_mean", correction=ais.adaptive())

    def step(logp_new, logp_old, adv, mask, logp_rollout):
        traces.append(1)
        return jax.grad(loss_fn, has_aux=True)(
            logp_new, logp_old, adv, mask, logp_rollout_BT=logp_rollout
        )

    jitted = jax.jit(step)
    stacks = []
    for seed in range(3):
        logp, adv, mask = make_batch(seed)
        shift = np.random.default_rng(seed).normal(size=(2, B, T)).astype(np.float32)
        stacks.append((logp + 0.1 * shift[0], logp, adv, mask, logp + 0.5 * shift[1]))
        jitted(*stacks[-1])
    assert len(traces) == 1
    grads, m = jax.vmap(jitted)(*[np.stack(xs) for xs in zip(*stacks, strict=True)])
    for i, args in enumerate(stacks):
        g_i, m_i = jitted(*args)
        np.testing.assert_allclose(grads[i], g_i, rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(m["ais/alpha"][i], m_i["ais/alpha"], rtol=1e-6)


# --------------------------------------------------------------------------- validation
@pytest.mark.parametrize(
    "kwargs, named",
    [
        (dict(clip_low=-0.1), "clip_low=-0.1"),
        (dict(clip_low=1.0), "clip_low=1.0"),
        (dict(clip_high=-0.2), "clip_high=-0.2"),
        (dict(kl_coef=-1.0), "kl_coef=-1.0"),
        (dict(kl_coef=float("nan")), "kl_coef=nan"),
        (dict(aggregation="mean"), "aggregation='mean'.*'token_mean'"),
        (dict(correction="adaptive"), "correction='adaptive'"),
    ],
)
def test_bad_hyperparameters_raise_naming_the_value(kwargs, named):
    with pytest.raises(ValueError, match=named.replace(".", r"\.").replace(r"\.*", ".*")):
        grpo.make_loss(**kwargs)
    logp, adv, mask = make_batch(0)
    with pytest.raises(ValueError, match=named.replace(".", r"\.").replace(r"\.*", ".*")):
        grpo.loss(logp, logp, adv, mask, **kwargs)


def test_boundary_hyperparameters_are_accepted():
    """The edges of each allowed range are valid: clip_low = 0 (no lower clip), clip_high = 0,
    kl_coef = 0."""
    logp, adv, mask = make_batch(0)
    value, _ = grpo.make_loss(clip_low=0.0, clip_high=0.0, kl_coef=0.0)(logp, logp, adv, mask)
    assert np.isfinite(float(value))


def test_docstring_examples():
    results = doctest.testmod(grpo)
    assert results.attempted >= 2 and results.failed == 0


def test_missing_inputs_raise():
    logp, adv, mask = make_batch(0)
    with pytest.raises(ValueError, match="logp_rollout_BT=None"):
        grpo.loss(logp, logp, adv, mask, correction=ais.truncated())
    with pytest.raises(ValueError, match="correction=None"):
        grpo.loss(logp, logp, adv, mask, logp_rollout_BT=logp)
    with pytest.raises(ValueError, match="kl_coef=0.1"):
        grpo.loss(logp, logp, adv, mask, kl_coef=0.1)
