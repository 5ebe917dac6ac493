"""Specification of ais_jax.ais: worked example, properties, float64 reference, jit/vmap/grad."""

import math

import hypothesis
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import strategies as st

from ais_jax import ais, grpo

jax.config.update("jax_numpy_rank_promotion", "raise")

B, T = 4, 6
SETTINGS = hypothesis.settings(max_examples=30, deadline=None, derandomize=True)
EXPECTED_KEYS = {
    "ais/alpha",
    "ais/alpha_ess",
    "ais/alpha_mis",
    "ais/alpha_var",
    "ais/cv",
    "ais/degenerate",
    "ais/ess_ratio",
    "ais/mismatch",
    "ais/var_ratio",
    "is/weight_mean",
    "is/weight_max",
    "is/clip_frac",
    "mismatch/mean_abs",
    "mismatch/k1",
    "mismatch/k3",
    "mismatch/max_ratio",
    "mismatch/ess_ratio",
    "mismatch/frac_outside",
}
FACTORIES = {
    "uncorrected": ais.uncorrected,
    "truncated": lambda: ais.truncated(2.0),
    "truncated_sequence": lambda: ais.truncated(2.0, level="sequence"),
    "truncated_geometric": lambda: ais.truncated(2.0, level="geometric"),
    "adaptive": ais.adaptive,
    "adaptive_alpha_half": lambda: ais.adaptive(alpha_override=0.5),
    "masked_token": ais.masked,
    "masked_sequence": lambda: ais.masked(0.5, 2.0, "sequence"),
    "masked_geometric": lambda: ais.masked(0.8, 1.25, "geometric"),
}
# Jitted once per module: hypothesis examples reuse the compiled functions.
JITTED = {name: jax.jit(factory()) for name, factory in FACTORIES.items()}


def make_batch(seed, scale=0.5, per_token=False, density=0.7, shape=(B, T)):
    """(advantages [B] or [B, T], logp_train_BT, logp_rollout_BT, mask_BT) as float32 numpy."""
    rng = np.random.default_rng(seed)
    advantages = rng.normal(size=shape if per_token else shape[:1]).astype(np.float32)
    logp_rollout = -rng.exponential(2.0, size=shape).astype(np.float32)
    logp_train = (logp_rollout + scale * rng.normal(size=shape)).astype(np.float32)
    mask = (rng.uniform(size=shape) < density).astype(np.float32)
    return advantages, logp_train, logp_rollout, mask


def batches():
    return st.builds(
        make_batch,
        seed=st.integers(0, 2**32 - 1),
        scale=st.sampled_from([0.01, 0.1, 0.5, 2.0]),
        per_token=st.booleans(),
        density=st.sampled_from([0.3, 0.7, 1.0]),
    )


def _broadcast(advantages):
    return np.broadcast_to(advantages[:, None], (B, T)) if advantages.ndim == 1 else advantages


def _w_example(layout):
    """The source's worked example as 4 one-token sequences or one 4-token sequence."""
    w = np.array([0.8, 1.0, 1.2, 2.0], np.float32)
    a = np.array([1.2, 0.4, -0.2, -0.8], np.float32)
    if layout == "sequences":
        return a, np.log(w)[:, None], np.zeros((4, 1), np.float32), np.ones((4, 1), np.float32)
    return a[None], np.log(w)[None], np.zeros((1, 4), np.float32), np.ones((1, 4), np.float32)


@pytest.mark.parametrize("layout", ["sequences", "tokens"])
def test_worked_example_to_three_decimals(layout):
    advantages, logp_train, logp_rollout, mask = _w_example(layout)
    out, m = ais.adaptive()(advantages, logp_train, logp_rollout, mask)
    got = {k: round(float(m[k]), 3) for k in m}
    assert got["ais/alpha_mis"] == 1.0  # mean |log w| = 0.32 > delta = 0.02
    assert got["ais/cv"] == 0.421
    assert got["ais/alpha_ess"] == 0.922
    assert got["ais/var_ratio"] == 1.290
    assert got["ais/alpha_var"] == 0.075
    assert got["ais/alpha"] == 0.847
    a_tilde = np.asarray(out, np.float64).reshape(-1)
    w_tilde = a_tilde / advantages.reshape(-1)
    assert [round(x, 3) for x in w_tilde.tolist()] == [0.831, 1.000, 1.169, 1.847]
    assert [round(x, 3) for x in a_tilde.tolist()] == [0.997, 0.400, -0.234, -1.478]


def _reference_ais(advantages, logp_train, logp_rollout, mask, C=5.0, delta=0.02, gamma=1.2):
    """SPEC section 3 in float64 NumPy, written independently of ais.py."""
    a = _broadcast(advantages).astype(np.float64)
    valid = mask != 0
    log_rho = np.clip(logp_train.astype(np.float64) - logp_rollout.astype(np.float64), -20, 20)
    if valid.sum() < 2:
        return a.copy(), 0.0
    w_bar = np.minimum(np.exp(log_rho[valid]), C)
    av = a[valid]
    cv = np.std(w_bar, ddof=1) / np.mean(w_bar)
    alpha_ess = 1.0 / math.sqrt(1.0 + cv**2)
    alpha_mis = min(1.0, np.mean(np.abs(log_rho[valid])) / delta)
    delta_sig = np.std(av * w_bar, ddof=1) / (np.std(av, ddof=1) + 1e-6)
    alpha_var = max(0.0, (delta_sig - gamma) / gamma)
    alpha = min(max(alpha_ess - 1.0 * alpha_var, 0.0), 1.0) * alpha_mis  # beta_var = 1
    out = a.copy()
    out[valid] = (1.0 + alpha * (w_bar - 1.0)) * av
    return out, alpha


@SETTINGS
@hypothesis.given(batch=batches())
def test_adaptive_matches_float64_reference(batch):
    out, m = JITTED["adaptive"](*batch)
    ref_out, ref_alpha = _reference_ais(*batch)
    np.testing.assert_allclose(np.asarray(out), ref_out, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(float(m["ais/alpha"]), ref_alpha, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", FACTORIES)
@SETTINGS
@hypothesis.given(batch=batches())
def test_on_policy_returns_advantages_bitwise(name, batch):
    advantages, logp_train, _, mask = batch
    out, m = JITTED[name](advantages, logp_train, logp_train, mask)
    np.testing.assert_array_equal(np.asarray(out), _broadcast(advantages))
    assert float(m["mismatch/mean_abs"]) == 0.0 and float(m["mismatch/k3"]) == 0.0


@pytest.mark.parametrize("name", FACTORIES)
@SETTINGS
@hypothesis.given(batch=batches(), junk=st.sampled_from([1e4, -1e4, np.inf, -np.inf, np.nan]))
def test_values_under_mask_zero_change_nothing(name, batch, junk):
    advantages, logp_train, logp_rollout, mask = batch
    rng = np.random.default_rng(0)
    noise = np.where(mask == 0, junk * rng.uniform(0.5, 1.5, size=(B, T)), 0).astype(np.float32)
    out, m = JITTED[name](advantages, logp_train, logp_rollout, mask)
    out2, m2 = JITTED[name](advantages, logp_train + noise, logp_rollout - noise, mask)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(out2))
    for key in m:
        np.testing.assert_array_equal(np.asarray(m[key]), np.asarray(m2[key]), err_msg=key)
    np.testing.assert_array_equal(np.asarray(out)[mask == 0], _broadcast(advantages)[mask == 0])


EDGE_CASES = ["huge_log_ratio", "equal_advantages", "one_valid_token", "no_valid_token"]


def _edge_case(case, batch):
    advantages, logp_train, logp_rollout, mask = batch
    if case == "huge_log_ratio":
        sign = np.sign(np.random.default_rng(1).normal(size=(B, T)))
        logp_train = (logp_rollout + 1e4 * sign).astype(np.float32)
    elif case == "equal_advantages":
        advantages = np.full_like(advantages, 0.7)
    elif case == "one_valid_token":
        mask = np.zeros_like(mask)
        mask[1, 2] = 1.0
    else:
        mask = np.zeros_like(mask)
    return advantages, logp_train, logp_rollout, mask


@pytest.mark.parametrize("case", EDGE_CASES)
@pytest.mark.parametrize("name", FACTORIES)
@SETTINGS
@hypothesis.given(batch=batches())
def test_outputs_and_metrics_finite_on_edge_cases(name, case, batch):
    out, m = JITTED[name](*_edge_case(case, batch))
    assert np.isfinite(np.asarray(out)).all()
    assert set(m) == EXPECTED_KEYS
    for key, value in m.items():
        assert value.shape == () and value.dtype == jnp.float32, key
        assert np.isfinite(float(value)), key


@pytest.mark.parametrize("case", ["one_valid_token", "no_valid_token"])
@SETTINGS
@hypothesis.given(batch=batches())
def test_adaptive_is_identity_below_two_valid_tokens(case, batch):
    advantages, logp_train, logp_rollout, mask = _edge_case(case, batch)
    out, m = JITTED["adaptive"](advantages, logp_train, logp_rollout, mask)
    np.testing.assert_array_equal(np.asarray(out), _broadcast(advantages))
    assert float(m["ais/degenerate"]) == 1.0 and float(m["ais/alpha"]) == 0.0


_FORCED_0 = jax.jit(ais.adaptive(alpha_override=0.0))
_FORCED_1 = jax.jit(ais.adaptive(2.0, alpha_override=1.0))  # same C as JITTED["truncated"]


@SETTINGS
@hypothesis.given(batch=batches())
def test_adaptive_alpha_zero_is_uncorrected_and_alpha_one_is_truncated(batch):
    out0, m0 = _FORCED_0(*batch)
    np.testing.assert_array_equal(np.asarray(out0), np.asarray(JITTED["uncorrected"](*batch)[0]))
    assert float(m0["ais/alpha"]) == 0.0
    out1, m1 = _FORCED_1(*batch)
    expected1 = np.asarray(JITTED["truncated"](*batch)[0])
    np.testing.assert_allclose(np.asarray(out1), expected1, rtol=1e-6, atol=1e-6)
    assert float(m1["ais/alpha"]) == 1.0


@pytest.mark.parametrize("name", FACTORIES)
def test_no_gradient_flows_through_a_correction(name):
    advantages, logp_train, logp_rollout, mask = make_batch(0, scale=1.0, per_token=True)
    correction = FACTORIES[name]()

    def summed(adv, lt, lr):
        out, m = correction(adv, lt, lr, mask)
        return jnp.sum(out**2) + sum(jnp.sum(v) for v in m.values())

    grads = jax.grad(summed, argnums=(0, 1, 2))(advantages, logp_train, logp_rollout)
    for g in grads:
        np.testing.assert_array_equal(np.asarray(g), 0.0)

    # Through the GRPO loss: logp_rollout only reaches it via the correction.
    logp_new = logp_train + 0.05
    grad_rollout = jax.grad(
        lambda lr: grpo.loss(
            logp_new, logp_train, advantages, mask, correction=correction, logp_rollout_BT=lr
        )[0]
    )(logp_rollout)
    np.testing.assert_array_equal(np.asarray(grad_rollout), 0.0)


def test_hand_checked_levels_and_mismatch_metrics():
    # One sequence, log-ratios [log 3, log 0.25, 0, 0(masked)].
    logp_train = np.log(np.array([[3.0, 0.25, 1.0, 9.0]], np.float32))
    logp_rollout = np.zeros((1, 4), np.float32)
    mask = np.array([[1.0, 1.0, 1.0, 0.0]], np.float32)
    adv = np.array([2.0], np.float32)
    out, m = ais.truncated(2.0)(adv, logp_train, logp_rollout, mask)
    np.testing.assert_allclose(out, [[4.0, 0.5, 2.0, 2.0]], rtol=1e-6)
    assert float(m["is/clip_frac"]) == pytest.approx(1 / 3)
    out, _ = ais.truncated(2.0, level="sequence")(adv, logp_train, logp_rollout, mask)
    np.testing.assert_allclose(out, [[1.5, 1.5, 1.5, 2.0]], rtol=1e-6)  # ratio 0.75
    out, _ = ais.truncated(2.0, level="geometric")(adv, logp_train, logp_rollout, mask)
    np.testing.assert_allclose(out, [[2 * 0.75 ** (1 / 3)] * 3 + [2.0]], rtol=1e-6)
    out, m = ais.masked(0.5, 2.0)(adv, logp_train, logp_rollout, mask)
    np.testing.assert_array_equal(out, [[0.0, 0.0, 2.0, 2.0]])
    assert float(m["is/clip_frac"]) == pytest.approx(2 / 3)
    out, _ = ais.masked(0.5, 2.0, "sequence")(adv, logp_train, logp_rollout, mask)
    np.testing.assert_array_equal(out, [[2.0, 2.0, 2.0, 2.0]])  # 0.75 is inside [0.5, 2]
    out, _ = ais.masked(0.8, 1.25, "geometric")(adv, logp_train, logp_rollout, mask)
    np.testing.assert_array_equal(out, [[2.0, 2.0, 2.0, 2.0]])  # 0.75^(1/3) = 0.909

    m = ais.mismatch_metrics(logp_train, logp_rollout, mask, clip=2.0)
    d = np.log([3.0, 0.25, 1.0])
    r = np.exp(d)
    assert float(m["mismatch/mean_abs"]) == pytest.approx(np.mean(np.abs(d)), rel=1e-6)
    assert float(m["mismatch/k1"]) == pytest.approx(np.mean(-d), rel=1e-6)
    assert float(m["mismatch/k3"]) == pytest.approx(np.mean(r - 1 - d), rel=1e-6)
    assert float(m["mismatch/max_ratio"]) == pytest.approx(3.0, rel=1e-6)
    assert float(m["mismatch/ess_ratio"]) == pytest.approx(r.sum() ** 2 / (3 * (r**2).sum()))
    assert float(m["mismatch/frac_outside"]) == pytest.approx(2 / 3)


def test_vmap_over_mini_batches_gives_one_alpha_each():
    batches_ = [make_batch(seed, scale=0.3 * (seed + 1)) for seed in range(3)]
    stacked = [np.stack(xs) for xs in zip(*batches_, strict=True)]
    out, m = jax.vmap(JITTED["adaptive"])(*stacked)
    for i, batch in enumerate(batches_):
        out_i, m_i = JITTED["adaptive"](*batch)
        np.testing.assert_allclose(out[i], out_i, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(m["ais/alpha"][i], m_i["ais/alpha"], rtol=1e-6, atol=1e-6)
    assert len(set(np.round(np.asarray(m["ais/alpha"]), 6).tolist())) == 3


@pytest.mark.parametrize("name", FACTORIES)
def test_new_values_do_not_recompile(name):
    traces = []
    correction = FACTORIES[name]()

    def counted(*args):
        traces.append(1)
        return correction(*args)

    jitted = jax.jit(counted)
    for seed in range(3):
        jax.block_until_ready(jitted(*make_batch(seed, scale=0.1 * (seed + 1))))
    assert len(traces) == 1


BAD_HYPERPARAMETERS = [
    (ais.truncated, dict(clip=0.5), "clip=0.5"),
    (ais.truncated, dict(clip=float("inf")), "clip=inf"),
    (ais.truncated, dict(level="tok"), "level='tok'"),
    (ais.uncorrected, dict(clip=-1.0), "clip=-1.0"),
    (ais.adaptive, dict(delta=0.0), "delta=0.0"),
    (ais.adaptive, dict(gamma=-1.0), "gamma=-1.0"),
    (ais.adaptive, dict(beta_var=-0.1), "beta_var=-0.1"),
    (ais.adaptive, dict(eps=0.0), "eps=0.0"),
    (ais.adaptive, dict(alpha_override=1.5), "alpha_override=1.5"),
    (ais.adaptive, dict(clip="5"), "clip='5'"),
    (ais.masked, dict(low=1.5), "low=1.5"),
    (ais.masked, dict(low=0.0), "low=0.0"),
    (ais.masked, dict(high=0.9), "high=0.9"),
    (ais.masked, dict(level="seq"), "level='seq'"),
    (lambda **kw: ais.mismatch_metrics(*np.zeros((3, 1, 1)), **kw), dict(clip=0.0), "clip=0.0"),
]


@pytest.mark.parametrize("factory, kwargs, named", BAD_HYPERPARAMETERS)
def test_bad_hyperparameters_raise_naming_the_value(factory, kwargs, named):
    with pytest.raises(ValueError, match=named.replace("(", r"\(").replace(".", r"\.")):
        factory(**kwargs)


def test_level_error_lists_allowed_values():
    with pytest.raises(ValueError, match="'token', 'sequence', 'geometric'"):
        ais.masked(level="bogus")
