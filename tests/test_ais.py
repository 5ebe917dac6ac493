"""Specification of ais_jax.ais: worked example, properties, float64 reference, jit/vmap/grad,
and the update each correction makes through the GRPO loss (float64 reference gradients)."""

import doctest

import hypothesis
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import references
from hypothesis import strategies as st
from scipy.special import logsumexp

from ais_jax import ais, checks, grpo

B, T = 4, 6
SETTINGS = hypothesis.settings(max_examples=30, deadline=None, derandomize=True)
EXPECTED_KEYS = {
    "ais/alpha",
    "ais/alpha_ess",
    "ais/alpha_mis",
    "ais/alpha_var",
    "ais/cv",
    "ais/degenerate",
    "ais/ess_ratio_truncated",
    "ais/mismatch",
    "ais/var_ratio",
    "is/weight_mean",
    "is/weight_max",
    "is/clip_frac",
    "mismatch/mean_abs",
    "mismatch/k1",
    "mismatch/k3",
    "mismatch/ratio_max",
    "mismatch/ess_ratio_raw",
    "mismatch/frac_outside",
    "mismatch/seq_ess_ratio_raw",
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


def _broadcast(advantages, shape=(B, T)):
    return np.broadcast_to(advantages[:, None], shape) if advantages.ndim == 1 else advantages


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


# beta_var (design.md leaves it open; 0 switches the variance penalty off), drawn with the batch;
# gamma = 0.6 puts alpha_var > 0 on most batches, so beta_var moves alpha there (gamma = 1.2,
# the paper's, with the default beta_var). One compiled correction per setting.
BETA_GAMMA = ((0.0, 0.6), (0.5, 0.6), (1.0, 1.2), (2.0, 0.6))
ADAPTIVE = {bg: jax.jit(ais.adaptive(beta_var=bg[0], gamma=bg[1])) for bg in BETA_GAMMA}
REFERENCE_KEYS = ("cv", "alpha_ess", "mismatch", "alpha_mis", "var_ratio", "alpha_var")


@SETTINGS
@hypothesis.given(batch=batches(), beta_gamma=st.sampled_from(BETA_GAMMA))
def test_adaptive_matches_float64_reference(batch, beta_gamma):
    """alpha, the corrected advantages and every diagnostic against `references.ais` (float64,
    from the raw log-probs) with the drawn beta_var and gamma."""
    beta_var, gamma = beta_gamma
    out, m = ADAPTIVE[beta_gamma](*batch)
    ref = references.ais(*batch, beta_var=beta_var, gamma=gamma)
    np.testing.assert_allclose(np.asarray(out), ref["advantages"], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(float(m["ais/alpha"]), ref["alpha"], rtol=1e-5, atol=1e-5)
    if float(m["ais/degenerate"]) == 0:
        for key in REFERENCE_KEYS:
            np.testing.assert_allclose(float(m[f"ais/{key}"]), ref[key], rtol=1e-5, err_msg=key)


@pytest.mark.parametrize("beta_var", [0.0, 0.5, 1.0, 2.0, 5.0])
def test_beta_var_scales_the_variance_penalty_in_the_worked_example(beta_var):
    """The source's worked example (alpha_ess 0.9217, alpha_var 0.0746) at several beta_var:
    alpha = clip(0.922 - beta_var * 0.075, 0, 1), from 0.922 (beta_var = 0) down to 0.549
    (beta_var = 5), and A_tilde with it, against the float64 reference."""
    batch = _w_example("tokens")
    out, m = ais.adaptive(beta_var=beta_var)(*batch)
    ref = references.ais(*batch, beta_var=beta_var)
    assert ref["alpha"] == pytest.approx(0.92172 - beta_var * 0.07459, abs=1e-4)
    np.testing.assert_allclose(float(m["ais/alpha"]), ref["alpha"], rtol=1e-6)
    np.testing.assert_allclose(np.asarray(out), ref["advantages"], rtol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("name", FACTORIES)
@SETTINGS
@hypothesis.given(batch=batches())
def test_on_policy_returns_advantages_bitwise(name, batch):
    advantages, logp_train, _, mask = batch
    out, m = JITTED[name](advantages, logp_train, logp_train, mask)
    np.testing.assert_array_equal(np.asarray(out), _broadcast(advantages))
    assert float(m["mismatch/mean_abs"]) == 0.0 and float(m["mismatch/k3"]) == 0.0


@pytest.mark.slow
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


@pytest.mark.slow
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


@pytest.mark.slow
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
    assert float(m["mismatch/ratio_max"]) == pytest.approx(3.0, rel=1e-6)
    assert float(m["mismatch/ess_ratio_raw"]) == pytest.approx(r.sum() ** 2 / (3 * (r**2).sum()))
    assert float(m["mismatch/frac_outside"]) == pytest.approx(2 / 3)


def test_sequence_ess_is_kish_over_responses_and_stable_in_float32():
    """`mismatch/seq_ess_ratio_raw` is Kish's ratio of R_b = exp(sum_t d_bt) over the rows with
    a valid token (a masked row, or masked tokens of a row, change nothing), in log space: sums
    of +-60 nats, whose exp overflows float32, give the float64 answer."""
    rng = np.random.default_rng(0)
    d_BT = rng.normal(0.0, 0.4, (5, 7)).astype(np.float32)
    mask_BT = (rng.uniform(size=(5, 7)) < 0.7).astype(np.float32)
    mask_BT[3] = 0.0
    mask_BT[:, 0] = 1.0
    mask_BT[3, 0] = 0.0
    for scale in (1.0, 25.0):
        logp_train = (scale * d_BT).astype(np.float32)
        m = ais.mismatch_metrics(logp_train, np.zeros_like(logp_train), mask_BT, clip=2.0)
        s_B = np.sum(np.where(mask_BT > 0, np.clip(logp_train, -20, 20), 0.0), 1, np.float64)
        s_B = s_B[mask_BT.any(1)]
        ref = np.exp(2 * logsumexp(s_B) - logsumexp(2 * s_B)) / len(s_B)
        assert float(m["mismatch/seq_ess_ratio_raw"]) == pytest.approx(ref, rel=1e-5), scale
    assert 1.0 / 4 <= ref < 0.5  # one response dominates; not the token ratio, not 1
    junk = np.where(mask_BT > 0, logp_train, 1e3).astype(np.float32)
    m2 = ais.mismatch_metrics(junk, np.zeros_like(junk), mask_BT, clip=2.0)
    assert float(m2["mismatch/seq_ess_ratio_raw"]) == float(m["mismatch/seq_ess_ratio_raw"])
    none = ais.mismatch_metrics(logp_train, np.zeros_like(logp_train), 0 * mask_BT)
    assert float(none["mismatch/seq_ess_ratio_raw"]) == 1.0


def test_metric_names_say_which_weights_and_estimator():
    """`ais/ess_ratio_truncated` is 1 / (1 + CV^2) of w_bar = min(rho, C) with ddof 1 (design.md's
    alpha_ess^2); `mismatch/ess_ratio_raw` is Kish's (sum r)^2 / (n sum r^2) of the raw ratios;
    `mismatch/ratio_max` is the largest raw ratio and `is/weight_max` the largest weight the
    correction applied. A ratio above C makes each pair differ."""
    rho = np.array([0.5, 0.9, 1.1, 4.0, 9.0])
    logp_train = np.log(rho)[None].astype(np.float32)
    zeros, ones = np.zeros_like(logp_train), np.ones_like(logp_train)
    _, m = ais.truncated(5.0)(np.array([1.0], np.float32), logp_train, zeros, ones)
    w_bar = np.minimum(rho, 5.0)
    truncated_ess = 1.0 / (1.0 + (np.std(w_bar, ddof=1) / np.mean(w_bar)) ** 2)
    raw_ess = rho.sum() ** 2 / (len(rho) * (rho**2).sum())
    assert float(m["ais/ess_ratio_truncated"]) == pytest.approx(truncated_ess, rel=1e-6)
    assert float(m["mismatch/ess_ratio_raw"]) == pytest.approx(raw_ess, rel=1e-6)
    assert abs(truncated_ess - raw_ess) > 0.05
    assert float(m["mismatch/ratio_max"]) == pytest.approx(9.0, rel=1e-6)
    assert float(m["is/weight_max"]) == 5.0


def test_minibatch_maxima_reduce_by_max_and_everything_else_by_mean():
    """`reduce_minibatch_metrics` over stacked per-minibatch metrics: the two maxima (the only
    keys ending in `_max`) by max, every other key by mean."""
    per_minibatch = [
        JITTED["truncated"](*make_batch(seed, scale=0.3 * (seed + 1)))[1] for seed in range(3)
    ]
    stacked = {k: jnp.stack([m[k] for m in per_minibatch]) for k in EXPECTED_KEYS}
    reduced = ais.reduce_minibatch_metrics(stacked)
    assert {k for k in reduced if k.endswith("_max")} == {"is/weight_max", "mismatch/ratio_max"}
    for key, values in stacked.items():
        values = np.asarray(values, np.float64)
        expected = values.max() if key.endswith("_max") else values.mean()
        assert float(reduced[key]) == pytest.approx(expected, rel=1e-6), key
    assert np.ptp(np.asarray(stacked["mismatch/ratio_max"])) > 0.1  # max != mean here


def test_vmap_over_mini_batches_gives_one_alpha_each():
    batches_ = [make_batch(seed, scale=0.3 * (seed + 1)) for seed in range(3)]
    stacked = [np.stack(xs) for xs in zip(*batches_, strict=True)]
    out, m = jax.vmap(JITTED["adaptive"])(*stacked)
    for i, batch in enumerate(batches_):
        out_i, m_i = JITTED["adaptive"](*batch)
        np.testing.assert_allclose(out[i], out_i, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(m["ais/alpha"][i], m_i["ais/alpha"], rtol=1e-6, atol=1e-6)
    assert len(set(np.round(np.asarray(m["ais/alpha"]), 6).tolist())) == 3


@pytest.mark.slow
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


@pytest.mark.parametrize(
    "arm, factory",
    [
        ("uncorrected", ais.uncorrected),
        ("truncated", lambda **kw: ais.truncated(level="sequence", **kw)),
        ("masked", lambda **kw: ais.masked(0.8, 1.25, **kw)),
    ],
)
def test_every_arm_logs_the_diagnostics_of_its_own_settings(arm, factory):
    """The `ais/*` diagnostics of the non-AIS arms use the (clip, delta, gamma, beta_var, eps)
    they are given: the float64 reference's with those settings, as are AIS's alpha (with
    beta_var = 0.3) and corrected advantages."""
    batch = make_batch(3, scale=0.1, per_token=True)
    settings = dict(clip=5.0, delta=0.5, gamma=0.5, beta_var=0.3, eps=1e-3)
    _, m = factory(**settings)(*batch)
    ref = references.ais(*batch, **settings)
    _, paper = factory()(*batch)
    for key in REFERENCE_KEYS:
        assert float(m[f"ais/{key}"]) == pytest.approx(ref[key], rel=1e-5), key
    assert float(m["ais/alpha_mis"]) < 0.5 * float(paper["ais/alpha_mis"])  # delta matters
    assert float(m["ais/alpha_var"]) > float(paper["ais/alpha_var"]) + 0.1  # gamma matters
    out, m_ais = ais.adaptive(**settings)(*batch)
    np.testing.assert_allclose(float(m_ais["ais/alpha"]), ref["alpha"], rtol=1e-5)
    np.testing.assert_allclose(np.asarray(out), ref["advantages"], rtol=1e-5, atol=1e-6)
    # beta_var matters: with the paper's beta_var = 1 alpha would differ by far more than 1e-5
    other = references.ais(*batch, **{**settings, "beta_var": 1.0})
    assert abs(other["alpha"] - ref["alpha"]) > 1e-2 * ref["alpha"]


def test_docstring_examples():
    """The examples in the docstrings of ais.py and checks.py run and print what they show."""
    for module in (ais, checks):
        results = doctest.testmod(module)
        assert results.attempted >= 2 and results.failed == 0, module.__name__


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
    (ais.uncorrected, dict(delta=0.0), "delta=0.0"),
    (ais.truncated, dict(gamma=float("nan")), "gamma=nan"),
    (ais.masked, dict(eps=-1.0), "eps=-1.0"),
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


# ---- the update each correction makes ----------------------------------------------------------
# A softmax policy over PV ids with a small parameter matrix: logits_BTV = features_BTF @
# theta_FV. Each correction is judged by the gradient of the GRPO loss (default
# seq_mean_token_mean aggregation, PPO clip 0.2) with respect to logp_new and to theta, against
# design.md's formulas evaluated in float64 NumPy.
PB, PT, PF, PV = 8, 12, 3, 7
C_TIS = 2.0
# MIS bands per level: a sequence's mean log-ratio spreads ~sqrt(T) less than its tokens'
BANDS = {"token": (0.5, 2.0), "sequence": (0.5, 2.0), "geometric": (0.9, 1.1)}
POLICY_SEEDS = [0, 1, 2]


def _jax_logp(theta_FV, features_BTF, tokens_BT):
    logits_BTV = jnp.einsum("btf,fv->btv", features_BTF, theta_FV)
    logp_BTV = jax.nn.log_softmax(logits_BTV, axis=-1)
    return jnp.take_along_axis(logp_BTV, tokens_BT[..., None], axis=-1)[..., 0]


def policy_batch(seed):
    """theta, features, tokens, float32 log-probs (old = trainer, rollout = mismatched engine),
    mask and [B] advantages. logp_old is the policy at a nearby theta_old, so the PPO ratio at
    theta is not 1 and some tokens are clipped; the rollout mismatch (std 0.6 in log space)
    puts some ratios above C_TIS and outside [LOW, HIGH]."""
    rng = np.random.default_rng(seed)
    features = rng.normal(size=(PB, PT, PF)).astype(np.float32)
    theta = (0.7 * rng.normal(size=(PF, PV))).astype(np.float32)
    tokens = rng.integers(0, PV, size=(PB, PT))
    theta_old = theta.astype(np.float64) + 0.15 * rng.normal(size=(PF, PV))
    logp_old = references.softmax_logp(theta_old, features, tokens)[0].astype(np.float32)
    logp_rollout = (logp_old + 0.6 * rng.normal(size=(PB, PT))).astype(np.float32)
    mask = (rng.uniform(size=(PB, PT)) < 0.8).astype(np.float32)
    mask[:, 0] = 1.0
    advantages = rng.normal(size=PB).astype(np.float32)
    return dict(
        theta=theta,
        features=features,
        tokens=tokens,
        logp_old=logp_old,
        logp_rollout=logp_rollout,
        mask=mask,
        advantages=advantages,
    )


def jax_gradients(batch, correction, advantages=None):
    """(d loss / d logp_new [B, T], d loss / d theta [F, V]) in float32; `advantages`
    replaces the batch's (e.g. by per-token ones) when given."""
    advantages = batch["advantages"] if advantages is None else advantages
    rollout = None if correction is None else batch["logp_rollout"]

    def loss_of_logp(logp_new_BT):
        value, _ = grpo.loss(
            logp_new_BT,
            batch["logp_old"],
            advantages,
            batch["mask"],
            correction=correction,
            logp_rollout_BT=rollout,
        )
        return value

    def logp_at(theta_FV):
        return _jax_logp(theta_FV, batch["features"], batch["tokens"])

    grad_logp = jax.grad(loss_of_logp)(logp_at(batch["theta"]))
    grad_theta = jax.grad(lambda theta: loss_of_logp(logp_at(theta)))(batch["theta"])
    return np.asarray(grad_logp), np.asarray(grad_theta)


def _level_log_rho(log_rho_BT, valid_BT, level):
    if level == "token":
        return log_rho_BT
    total_B = np.where(valid_BT, log_rho_BT, 0.0).sum(1)
    if level == "sequence":
        seq_B = np.clip(total_B, -20, 20)
    else:
        seq_B = total_B / np.maximum(valid_BT.sum(1), 1)
    return np.broadcast_to(seq_B[:, None], log_rho_BT.shape)


def reference_corrected_advantages(arm, batch):
    """A_tilde [B, T] by design.md's formula of `arm`, in float64 from the float32 inputs."""
    a_BT = _broadcast(batch["advantages"], batch["mask"].shape).astype(np.float64)
    valid_BT = batch["mask"] != 0
    log_rho_BT = np.clip(
        batch["logp_old"].astype(np.float64) - batch["logp_rollout"].astype(np.float64), -20, 20
    )
    method, _, level = arm.partition(":")
    if method in ("uncorrected", "ais_alpha_0"):
        return a_BT
    if method == "ais":
        inputs = (batch[k] for k in ("advantages", "logp_old", "logp_rollout", "mask"))
        return references.ais(*inputs)["advantages"]
    if method == "ais_alpha_1":  # w_tilde = 1 + 1 * (w_bar - 1) = w_bar: TIS with C = 5
        return np.minimum(np.exp(log_rho_BT), 5.0) * a_BT
    rho_BT = np.exp(_level_log_rho(log_rho_BT, valid_BT, level or "token"))
    if method == "tis":
        return np.minimum(rho_BT, C_TIS) * a_BT
    assert method == "mis", arm
    low, high = BANDS[level or "token"]
    return np.where((rho_BT >= low) & (rho_BT <= high), a_BT, 0.0)


def reference_gradients(batch, a_tilde_BT, clip=0.2):
    """float64 gradients of seq_mean_token_mean(-min(r A, clip(r, 1 -+ clip) A)) with respect
    to logp_new and theta, and sum |terms| of the theta gradient (its float32 error scale).

    d loss / d logp_new_bt = -A_bt r_bt / (n_b * S) on valid tokens whose clipped term is not
    the active one (n_b: valid tokens of row b, S: rows with any), else 0;
    d logp_new_bt / d theta_fv = features_btf (onehot(token_bt)_v - p_btv).
    """
    logp_BT, p_BTV = references.softmax_logp(batch["theta"], batch["features"], batch["tokens"])
    ratio_BT = np.exp(logp_BT - batch["logp_old"].astype(np.float64))
    valid_BT = batch["mask"] != 0
    clipped_BT = ((a_tilde_BT > 0) & (ratio_BT > 1 + clip)) | (
        (a_tilde_BT < 0) & (ratio_BT < 1 - clip)
    )
    count_B = valid_BT.sum(1)
    norm_BT = np.maximum(count_B, 1)[:, None] * (count_B > 0).sum()
    grad_logp_BT = np.where(valid_BT & ~clipped_BT, -a_tilde_BT * ratio_BT / norm_BT, 0.0)
    dlogp_BTV = np.eye(PV)[batch["tokens"]] - p_BTV
    features_BTF = batch["features"].astype(np.float64)
    grad_theta = np.einsum("bt,btf,btv->fv", grad_logp_BT, features_BTF, dlogp_BTV)
    scale = np.einsum(
        "bt,btf,btv->fv", np.abs(grad_logp_BT), np.abs(features_BTF), np.abs(dlogp_BTV)
    )
    return grad_logp_BT, grad_theta, scale


POLICY_ARMS = {
    "uncorrected": ais.uncorrected,
    "ais_alpha_0": lambda: ais.adaptive(alpha_override=0.0),
    "ais": ais.adaptive,
    "ais_alpha_1": lambda: ais.adaptive(alpha_override=1.0),
    "tis": lambda: ais.truncated(C_TIS),
    "tis:sequence": lambda: ais.truncated(C_TIS, level="sequence"),
    "tis:geometric": lambda: ais.truncated(C_TIS, level="geometric"),
    "mis": lambda: ais.masked(*BANDS["token"]),
    "mis:sequence": lambda: ais.masked(*BANDS["sequence"], "sequence"),
    "mis:geometric": lambda: ais.masked(*BANDS["geometric"], "geometric"),
}


@pytest.mark.parametrize("seed", POLICY_SEEDS)
def test_policy_batches_exercise_every_branch(seed):
    """Preconditions of the gradient tests below, so none of them passes on a trivial batch:
    ratios beyond C_TIS and outside the token MIS band, PPO-clipped tokens, and an AIS alpha
    strictly between "no correction" and TIS."""
    batch = policy_batch(seed)
    valid = batch["mask"] != 0
    rho = np.exp(batch["logp_old"] - batch["logp_rollout"])[valid]
    low, high = BANDS["token"]
    assert (rho > C_TIS).sum() >= 3 and ((rho < low) | (rho > high)).sum() >= 3
    a_BT = reference_corrected_advantages("uncorrected", batch)
    grad_logp, _, _ = reference_gradients(batch, a_BT)
    assert (valid & (grad_logp == 0)).sum() >= 3, "no PPO-clipped token"
    inputs = (batch[k] for k in ("advantages", "logp_old", "logp_rollout", "mask"))
    alpha = references.ais(*inputs)["alpha"]
    assert 0.1 < alpha < 0.9, alpha


@pytest.mark.slow
@pytest.mark.parametrize("seed", POLICY_SEEDS)
@pytest.mark.parametrize("arm", POLICY_ARMS)
def test_each_correction_moves_the_gradient_as_its_formula_says(arm, seed):
    """The loss gradient under each correction is the float64 gradient of the GRPO loss with
    design.md's corrected advantages (TIS: min(rho, C) A; AIS: (1 + alpha (min(rho, C) - 1)) A with
    design.md's alpha; MIS: A where rho is in [low, high], else 0; at token, sequence and geometric
    level), and differs from the uncorrected gradient by far more than the tolerance.

    Tolerance: 1e-5 relative, per element of d loss / d logp_new and relative to sum |terms|
    for theta. Float32 log-softmax and ratios are good to a few ulp (~1e-6 relative); AIS's
    alpha is a float32 mean and two standard deviations, which the float64 reference test above
    holds to 1e-5. (Largest error seen over these seeds and arms: 8e-7.)
    """
    batch = policy_batch(seed)
    a_tilde = reference_corrected_advantages(arm, batch)
    ref_logp, ref_theta, scale = reference_gradients(batch, a_tilde)
    grad_logp, grad_theta = jax_gradients(batch, POLICY_ARMS[arm]())
    np.testing.assert_allclose(grad_logp, ref_logp, rtol=1e-5, atol=0)
    assert (np.abs(grad_theta - ref_theta) <= 1e-5 * scale).all(), np.abs(grad_theta - ref_theta)

    if arm not in ("uncorrected", "ais_alpha_0"):
        a_BT = reference_corrected_advantages("uncorrected", batch)
        _, plain_theta, _ = reference_gradients(batch, a_BT)
        assert np.abs(ref_theta - plain_theta).max() > 100 * 1e-5 * scale.max()


@pytest.mark.slow
@pytest.mark.parametrize("seed", POLICY_SEEDS)
def test_uncorrected_and_alpha_zero_leave_the_update_bitwise_unchanged(seed):
    """`uncorrected()` and AIS with alpha forced to 0 (w_tilde = 1 + 0 (w_bar - 1) = 1 exactly)
    give the very gradient of the loss without any correction."""
    batch = policy_batch(seed)
    bare = jax_gradients(batch, None)
    for correction in (ais.uncorrected(), ais.adaptive(alpha_override=0.0)):
        for got, expected in zip(jax_gradients(batch, correction), bare, strict=True):
            np.testing.assert_array_equal(got, expected)


@pytest.mark.slow
@pytest.mark.parametrize("seed", POLICY_SEEDS)
def test_tis_gradient_is_the_gradient_with_clipped_weights_on_advantages(seed):
    """TIS: the gradient equals the uncorrected loss's gradient with per-token advantages
    A * min(rho, C), and AIS with alpha forced to 1 equals TIS with the same C (its weight
    1 + (w_bar - 1) is w_bar up to the rounding of two float32 operations: <= 2^-22 max(1, w)
    absolute, hence rtol 1e-6 plus 2^-22 of the largest uncorrected gradient element).

    Within float32 rounding: the weights here are computed outside the loss (one exp, one
    product: 1e-6 relative)."""
    batch = policy_batch(seed)
    log_rho = jnp.clip(jnp.asarray(batch["logp_old"]) - batch["logp_rollout"], -20.0, 20.0)
    weights_BT = np.asarray(jnp.minimum(jnp.exp(log_rho), C_TIS))
    assert (weights_BT[batch["mask"] != 0] == C_TIS).sum() >= 3  # the cap is active
    a_BT = batch["advantages"][:, None] * weights_BT
    expected_logp, expected_theta = jax_gradients(batch, None, advantages=a_BT)
    got_logp, got_theta = jax_gradients(batch, ais.truncated(C_TIS))
    np.testing.assert_allclose(got_logp, expected_logp, rtol=1e-6, atol=0)
    np.testing.assert_allclose(
        got_theta, expected_theta, rtol=1e-6, atol=1e-6 * np.abs(expected_theta).max()
    )

    plain_logp, _ = jax_gradients(batch, None)
    tis5_logp, _ = jax_gradients(batch, ais.truncated(5.0))
    ais1_logp, _ = jax_gradients(batch, ais.adaptive(5.0, alpha_override=1.0))
    np.testing.assert_allclose(
        ais1_logp, tis5_logp, rtol=1e-6, atol=2**-22 * np.abs(plain_logp).max()
    )
    assert np.abs(tis5_logp - plain_logp).max() > 100 * 2**-22 * np.abs(plain_logp).max()


@pytest.mark.slow
@pytest.mark.parametrize("seed", POLICY_SEEDS)
@pytest.mark.parametrize("level", ais.LEVELS)
def test_mis_gradient_drops_exactly_the_tokens_outside_the_band(seed, level):
    """MIS: d loss / d logp_new is exactly 0 on tokens whose (level) ratio leaves [low, high]
    and bitwise the uncorrected gradient on the others (the loss's normaliser still counts
    every valid token)."""
    batch = policy_batch(seed)
    valid = batch["mask"] != 0
    log_rho = np.clip(batch["logp_old"].astype(np.float64) - batch["logp_rollout"], -20, 20)
    rho = np.exp(_level_log_rho(log_rho, valid, level))
    low, high = BANDS[level]
    kept = (rho >= low) & (rho <= high)
    plain_logp, _ = jax_gradients(batch, None)
    got_logp, _ = jax_gradients(batch, ais.masked(low, high, level))
    dropped = valid & ~kept
    assert dropped.any() and (valid & kept & (plain_logp != 0)).any()
    np.testing.assert_array_equal(got_logp[dropped], 0.0)
    assert (plain_logp[dropped] != 0).any()  # the drop is what zeroed them
    np.testing.assert_array_equal(got_logp[kept], plain_logp[kept])
