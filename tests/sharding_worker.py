"""The 8-device checks of test_sharding.py, run in a subprocess with 8 fake CPU devices.

``XLA_FLAGS=--xla_force_host_platform_device_count=8`` must be set before JAX is imported, and
the rest of the suite keeps one device, so test_sharding.py runs this file once as
``python tests/sharding_worker.py OUT.json TMPDIR`` and turns each entry of OUT.json into a
test. Every check compares a sharded computation with the same computation on one device.

Both sides are the phases `train.make_phases` builds, on a 2 x 2 x 2 mesh and on a mesh of one
device. Sharding must not change the math, only the order of float32 reductions (the
all-reduces of a tensor- or fsdp-sharded matmul). So the trainer runs in float32 here
(``train.COMPUTE_DTYPE``), where that reordering is visible only at float32 rounding; the
``*_bf16`` checks repeat scoring and the update in bfloat16, the dtype that ships, with the
tolerance `check_score_bf16` derives.
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
)
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import dataclasses  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from training_run import SHARDED_MODEL  # noqa: E402

from ais_jax import models as model
from ais_jax.config import MeshConfig, OptimConfig, RolloutConfig, TrainConfig
from ais_jax.io.checkpoint import Checkpointer
from ais_jax.models import qwen35
from ais_jax.nn.quant import QArray
from ais_jax.parallel import sharding as shd
from ais_jax.rollout import sampler
from ais_jax.train import step as train

train.COMPUTE_DTYPE = jnp.float32  # see the module docstring
CONFIG = SHARDED_MODEL
N, P, T = 16, 6, 5  # rows, prompt length, response length
RTOL = 1e-5
# A tiny Qwen3.5 (one Gated DeltaNet layer, one gated-attention layer), every dimension the
# 2 x 2 x 2 mesh splits divisible: `check_qwen35_train_step`.
QWEN35 = qwen35.Qwen35Config(
    vocab_size=64,
    hidden_size=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    intermediate_size=128,
    layer_types=("linear_attention", "full_attention"),
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
)


def mesh(data=1, fsdp=1, tensor=1, devices=None):
    return shd.make_mesh(MeshConfig(data=data, fsdp=fsdp, tensor=tensor), devices)


def host_params(config=CONFIG):
    """Random float32 params with matrices of std 0.1 (logits O(1), nothing near 0)."""
    params = model.init_params(config, jax.random.key(0))
    params = jax.tree.map(lambda x: 5 * x if x.ndim == 3 else x, params)
    for name in ("embed", "lm_head"):  # a tied model has no lm_head
        if name in params:
            params[name] = 5 * params[name]
    return jax.device_get(params)


def host_batch(params, config=CONFIG):
    """A rollout batch as the runner builds it: logp_old = the trainer's own log-probs (so
    first-minibatch ratios are 1), logp_rollout = logp_old + noise (the FP8 mismatch)."""
    r = np.random.default_rng(0)
    prompt_mask = np.ones((N, P), bool)
    prompt_mask[::3, :2] = False  # left padding
    mask = np.ones((N, T), bool)
    mask[::2, 3:] = False  # finished early
    prompts = r.integers(0, config.vocab_size, (N, P)).astype(np.int32)
    tokens = r.integers(0, config.vocab_size, (N, T)).astype(np.int32)
    logp_old, _ = train.score(params, config, prompts, prompt_mask, tokens, mask, 1.0)
    logp_old = np.asarray(logp_old)
    return jax.device_get(
        train.Batch(
            prompt_tokens=prompts,
            prompt_mask=prompt_mask,
            tokens=tokens,
            mask=mask,
            logp_rollout=(logp_old + 0.1 * r.normal(size=(N, T)) * mask).astype(np.float32),
            logp_old=logp_old,
            advantages=r.normal(size=N).astype(np.float32),
        )
    )


# Adam with eps=1e-3: with eps=1e-8 an element whose gradient is ~1e-8 moves by up to lr for
# a 1e-7 relative change of that gradient, so even two single-device runs with different XLA
# fusions disagree there. A larger eps keeps the step Lipschitz in the gradient while the
# moments still shard like the params they mirror (what this test is about).
OPTIM = OptimConfig(minibatches=2, learning_rate=1e-3, eps=1e-3)
OPTIMIZER = train.make_optimizer(OPTIM, 1)
BF16 = RolloutConfig(format="bf16", max_new_tokens=6)
FP8 = RolloutConfig(format="float8_e4m3fn", fp8_lm_head=True, max_new_tokens=6)


def one_device():
    return mesh(devices=jax.devices()[:1])


def phases(m, rollout=BF16, dtype=None, config=CONFIG) -> train.Phases:
    """The production phases (`train.make_phases`) of a one-step run with `OPTIM` on mesh
    ``m``; the compute dtype is ``train.COMPUTE_DTYPE`` (float32 here) unless ``dtype``."""
    cfg = TrainConfig(steps=1, optim=OPTIM, rollout=rollout)
    return train.make_phases(m, cfg, config, eos_ids=(3,), compute_dtype=dtype)


def assert_trees_close(actual, expected, what=""):
    """Leafwise ``|a - e| <= RTOL * (|e| + max|e|)``: float32 agreement relative to each
    tensor's scale (a reduction's small elements carry the rounding of its large terms)."""
    pairs = zip(jax.tree_util.tree_leaves_with_path(expected), jax.tree.leaves(actual), strict=True)
    for (path, e), a in pairs:
        e, a = np.asarray(e, np.float32), np.asarray(a, np.float32)
        np.testing.assert_allclose(
            a,
            e,
            rtol=RTOL,
            atol=RTOL * float(np.abs(e).max(initial=0)),
            err_msg=f"{what}{jax.tree_util.keystr(path)}",
        )


def assert_metrics_close(actual, expected, advantages):
    """`assert_trees_close` for an update's metrics, except the losses: ``loss/*`` is a mean
    of per-token terms ``-A * ratio`` (ratios ~1), whose float32 sum in another order (or with
    a last-bit different exp) moves by RTOL of the terms' size, mean |A|, not of the loss, which
    the zero-mean advantages cancel to ~1% of it (measured: 2.1e-7 on a loss of 9.9e-3, with
    mean |A| ~0.8). A sharding bug moves it by a token's share of mean |A|, ~1e-2 here."""
    scale = float(np.abs(advantages).mean())
    losses = {k: v for k, v in expected.items() if k.startswith("loss/")}
    assert_trees_close(
        {k: v for k, v in actual.items() if k not in losses},
        {k: v for k, v in expected.items() if k not in losses},
        what="metrics",
    )
    for name, e in losses.items():
        np.testing.assert_allclose(actual[name], e, rtol=0, atol=RTOL * scale, err_msg=name)


# ---- checks -------------------------------------------------------------------------------------


def check_layouts(ctx):
    """Each device holds the shard the table says: q_proj [L, H*E, D] over (tensor, fsdp)."""
    m = mesh(data=2, fsdp=2, tensor=2)
    state = phases(m).init(ctx["params"])
    assert_trees_close(state, train.init_state(ctx["params"], OPTIMIZER))
    q = state.params["layers"]["q_proj"]
    assert q.sharding.spec == jax.P(None, "tensor", "fsdp"), q.sharding
    assert q.addressable_shards[0].data.shape == (2, 32, 32), q.addressable_shards[0].data.shape
    mu = state.opt_state[1][0].mu["layers"]["down_proj"]  # adamw's first moment
    assert mu.sharding.spec == jax.P(None, "fsdp", "tensor"), mu.sharding
    assert state.params["layers"]["input_norm"].sharding.is_fully_replicated
    assert state.step.sharding.is_fully_replicated
    batch = shd.shard_batch(ctx["batch"], m)
    assert batch.tokens.addressable_shards[0].data.shape == (N // 4, T)  # rows over data x fsdp
    assert_trees_close(shd.host_rows(batch), ctx["batch"])  # its inverse (one process: all)
    try:
        shd.shard_batch(np.zeros((6, 3)), m)
        raise AssertionError("a batch of 6 rows on data x fsdp = 4 was accepted")
    except ValueError as e:
        assert "batch size 6 is not divisible by mesh data x fsdp = 4" in str(e), e


def _update_both(ctx, dtype=None):
    """One update (2 minibatches) from the same state and key on one device and on a 2x2x2
    mesh: ``(state before, (state, metrics) on one device, (state, metrics) sharded, step)``."""
    key, one, m = jax.random.key(1), one_device(), mesh(data=2, fsdp=2, tensor=2)
    before = jax.device_get(phases(one).init(ctx["params"]))
    ref = phases(one, dtype=dtype).update(
        phases(one).init(ctx["params"]), shd.shard_batch(ctx["batch"], one), key
    )
    step = phases(m, dtype=dtype).update
    out = step(phases(m).init(ctx["params"]), shd.shard_batch(ctx["batch"], m), key)
    return before, jax.device_get(ref), out, step


def assert_params_after_adam(params, ref, before, *, min_step, norms_may_rest=False):
    """``params`` (sharded update) against ``ref.params`` (one-device update of ``before``) to
    what Adam makes of gradients that agree to RTOL (`check_train_step`'s docstring): per leaf
    ``RTOL * (step size + 2 lr / eps * max |m| / bias correction)`` plus 2 ulp. Every leaf moved
    by more than ``min_step`` (the norms may stay put where ``norms_may_rest``)."""
    adam = ref.opt_state[1][0]  # clip_by_global_norm's state, then adamw's (count, mu, nu)
    bias = 1 - OPTIM.b1 ** int(adam.count)
    for (path, e), a, old, mu in zip(
        jax.tree_util.tree_leaves_with_path(ref.params),
        jax.tree.leaves(params),
        jax.tree.leaves(before),
        jax.tree.leaves(adam.mu),
        strict=True,
    ):
        e, a = np.asarray(e), np.asarray(a)
        step_size = float(np.abs(e - old).max())
        resting = norms_may_rest and path[-1].key.endswith("norm")
        assert step_size > min_step or resting, (path, step_size)
        amplified = 2 * OPTIM.learning_rate / OPTIM.eps * float(np.abs(mu).max()) / bias
        np.testing.assert_allclose(
            a,
            e,
            rtol=2 * np.finfo(np.float32).eps,
            atol=RTOL * (step_size + amplified),
            err_msg=jax.tree_util.keystr(path),
        )


def check_train_step(ctx):
    """One update (2 minibatches) on a 2x2x2 mesh equals the 1-device step.

    The gradient moments agree to RTOL of their scale (float32 reordering of the gradient's
    sums). The params then agree to what Adam makes of that: its step
    ``lr * m / (sqrt(v) + eps)`` (bias-corrected moments, ``|m| <= sqrt(v)``) moves by at most
    ``2 lr / eps`` per unit change of ``m`` and ``sqrt(v)``, so an entry whose gradient is
    small next to eps shows its sum's reordering amplified by ``lr / eps`` (= 1 here):
    ``|sharded - unsharded| <= RTOL * (step size + 2 lr / eps * max |m|)``, plus 2 ulp of
    adding the step. A sharding bug moves entries by the step size itself (~1e-3)."""
    before, (ref, ref_metrics), (out, metrics), step = _update_both(ctx)
    ctx["step"], ctx["state_after"], ctx["mesh_222"] = step, out, mesh(data=2, fsdp=2, tensor=2)
    ctx["update_f32"] = (ref, ref_metrics)
    assert_trees_close(out.opt_state, ref.opt_state, what="opt_state")
    assert_metrics_close(metrics, ref_metrics, ctx["batch"].advantages)
    assert_params_after_adam(out.params, ref, before.params, min_step=1e-4, norms_may_rest=True)
    assert int(out.step) == 1 and metrics["loss/total"].sharding.is_fully_replicated
    assert out.params["layers"]["up_proj"].sharding.spec == jax.P(None, "tensor", "fsdp")


def check_grouped_train_step(ctx):
    """The on-policy update of a batch of groups (`Batch.prompt_group` = 4: each prompt run once
    for its 4 rows, logp_old from the update's own forward) on a 2x2x2 mesh equals the
    1-device update: the gradient moments and metrics as in `check_train_step`."""
    G = 4
    on_policy = TrainConfig(steps=1, optim=dataclasses.replace(OPTIM, minibatches=1), rollout=BF16)
    batch = ctx["batch"]
    batch = batch.replace(
        prompt_tokens=np.repeat(batch.prompt_tokens[::G], G, axis=0),
        prompt_mask=np.repeat(batch.prompt_mask[::G], G, axis=0),
        logp_old=None,
        prompt_group=G,
    )
    key, results = jax.random.key(1), []
    for m in (one_device(), mesh(data=2, fsdp=2, tensor=2)):
        p = train.make_phases(m, on_policy, CONFIG, eos_ids=(3,))
        results.append(
            jax.device_get(p.update(p.init(ctx["params"]), shd.shard_batch(batch, m), key))
        )
    (ref, ref_metrics), (out, metrics) = results
    ctx["grouped"] = batch, ref, ref_metrics
    assert_trees_close(out.opt_state, ref.opt_state, what="opt_state")
    assert_metrics_close(metrics, ref_metrics, batch.advantages)
    assert "policy/entropy" in metrics and float(metrics["train/grad_norm"]) > 1e-3


def check_remat_train_step(ctx):
    """`optim.remat` on the 2x2x2 mesh: the grouped update of `check_grouped_train_step` with
    every layer recomputed in its backward pass (`layers.recompute_layer`, whose ``x + 0 * g``
    ties are elementwise, sharded as the activations are) equals the 1-device update without
    it, to the same tolerances."""
    batch, ref, ref_metrics = ctx["grouped"]
    optim = dataclasses.replace(OPTIM, minibatches=1, remat=True)
    m = mesh(data=2, fsdp=2, tensor=2)
    p = train.make_phases(m, TrainConfig(steps=1, optim=optim, rollout=BF16), CONFIG, eos_ids=(3,))
    out, metrics = jax.device_get(
        p.update(p.init(ctx["params"]), shd.shard_batch(batch, m), jax.random.key(1))
    )
    assert_trees_close(out.opt_state, ref.opt_state, what="opt_state")
    assert_metrics_close(metrics, ref_metrics, batch.advantages)


def check_no_recompile(ctx):
    """Feeding a step's output state back in (a new batch, a new key) compiles nothing."""
    step, state, m = ctx["step"], ctx["state_after"], ctx["mesh_222"]
    batch = jax.tree.map(lambda x: x[::-1].copy(), ctx["batch"])  # same shapes, new values
    compiles = []

    def listener(event, duration, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(duration)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        for i in range(2):
            state, metrics = step(state, shd.shard_batch(batch, m), jax.random.key(2 + i))
        jax.block_until_ready(state)
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert not compiles, f"{len(compiles)} compilation(s) on the 2nd/3rd call"
    assert int(state.step) == 3
    if hasattr(step, "_cache_size"):
        assert step._cache_size() == 1, step._cache_size()


def _score_both(ctx, dtype=None):
    """``score`` of the batch's tokens on one device and on a 2x2x2 mesh."""
    b, out = ctx["batch"], []
    for m in (one_device(), mesh(data=2, fsdp=2, tensor=2)):
        rows = shd.shard_batch((b.prompt_tokens, b.prompt_mask, b.tokens, b.mask), m)
        params = phases(m).init(ctx["params"]).params
        out.append(jax.device_get(phases(m, dtype=dtype).score(params, *rows, np.float32(1.0))))
    return out


def check_score(ctx):
    ref, out = _score_both(ctx)
    assert_trees_close(out, ref, what="logp, entropy")
    ctx["score_f32"] = ref


def check_score_bf16(ctx):
    """Scoring in bfloat16, the dtype that ships, on a 2x2x2 mesh equals the 1-device bf16
    score up to twice the error bf16 rounding itself makes in this computation.

    The tolerance, derived: bf16 keeps 8 significant bits, so rounding an intermediate x
    changes it by at most u |x|, u = 2^-8 (half an ulp). Both runs round the same
    intermediates; sharding only reorders the float32 sums before each rounding (a change of
    about n * 2^-24 relative for the n <= 128 terms of a contraction). Where that moves the sum
    across a rounding boundary, the sharded run rounds to the neighbouring bf16 value: a change
    of one ulp, at most 2u |x|, i.e. twice a rounding error, at a subset of the rounding points.
    So the sharded run differs from the unsharded one by at most twice what rounding every
    intermediate to bf16 does to the result, which we measure rather than bound (a worst-case
    sum of u |x dy/dx| over every rounding point is orders of magnitude looser):
    ``E = max |score_bf16 - score_f32|`` on one device, and the test asks
    ``max |sharded - unsharded| <= 2 E``. It also checks the comparison is not vacuous: E > 0
    (bf16 does round here) and the sharded run carries that rounding too (it is at least E / 2
    from float32: it did run in bf16). A sharding bug moves log-probs by O(1).
    """
    ref, out = _score_both(ctx, jnp.bfloat16)
    f32 = ctx["score_f32"]
    valid = ctx["batch"].mask.astype(bool)
    for name, a, e, x in zip(("logp", "entropy"), out, ref, f32, strict=True):
        a, e, x = (np.asarray(v, np.float64)[valid] for v in (a, e, x))
        rounding = np.abs(e - x).max()
        sharding = np.abs(a - e).max()
        print(f"bf16 {name}: sharded vs 1 device {sharding:.3g}, bf16 vs f32 {rounding:.3g}")
        assert rounding > 0 and np.abs(a - x).max() >= rounding / 2, (name, rounding)
        assert sharding <= 2 * rounding, f"{name}: {sharding:.3g} > 2 x {rounding:.3g}"
        ctx[f"{name}_rounding_bf16"] = np.abs(e - x)  # per valid token: see the bf16 step


def check_train_step_bf16(ctx):
    """One bfloat16 update (2 minibatches) on a 2x2x2 mesh equals the 1-device bf16 update up
    to twice the error bf16 rounding makes in it (the argument of `check_score_bf16`): for
    every parameter tensor and the loss and gradient norm, ``|sharded - unsharded| <= 2 E +
    2 ulp`` with ``E = max |bf16 - float32|`` of that tensor on one device (2 ulp: the float32
    rounding of adding the step). The correction's statistics are float32 functions of the
    batch's float32 log-probs, so they agree to float32 rounding as in `check_train_step`.

    The loss, ``-r A`` averaged over each row's valid tokens and then over the rows (GRPO's
    aggregation; r = 1 up to rounding here), is a sum whose rounding errors cancel: one
    measured ``|bf16 - float32|`` of it may come out far below what rounding can do to it
    (2.6e-4 once, against a sharded-to-unsharded gap of 6.0e-4, while the same run's log-probs
    and parameters agreed as derived). So its E is also at least what rounding the log-probs
    does to it without cancellation: the same average of ``|A| |logp_bf16 - logp_float32|``
    (the unsharded scores of `check_score_bf16`). A sharding bug moves log-probs by O(1), and
    so the loss by about the average ``|A|``, far outside it."""
    before, (ref, ref_metrics), (out, metrics), _ = _update_both(ctx, jnp.bfloat16)
    ref32, ref32_metrics = ctx["update_f32"]
    for (path, e), a, x, old in zip(
        jax.tree_util.tree_leaves_with_path(ref.params),
        jax.tree.leaves(out.params),
        jax.tree.leaves(ref32.params),
        jax.tree.leaves(before.params),
        strict=True,
    ):
        e, a, x = np.asarray(e), np.asarray(a), np.asarray(x)
        rounding = float(np.abs(e - x).max())
        assert float(np.abs(e - old).max()) > 0, path  # the step moved every tensor
        np.testing.assert_allclose(
            a, e, rtol=2 * np.finfo(np.float32).eps, atol=2 * rounding, err_msg=str(path)
        )
    batch = ctx["batch"]
    valid = batch.mask.astype(bool)
    logp_rounding_BT = np.zeros(valid.shape)
    logp_rounding_BT[valid] = ctx["logp_rounding_bf16"]
    per_row = logp_rounding_BT.sum(1) / valid.sum(1)
    logp_rounding = float((np.abs(batch.advantages) * per_row).mean())
    for key in ("loss/total", "train/grad_norm"):
        rounding = abs(ref_metrics[key] - ref32_metrics[key])
        if key == "loss/total":
            rounding = max(rounding, logp_rounding)
        gap = abs(float(metrics[key]) - ref_metrics[key])
        assert rounding > 0 and gap <= 2 * rounding, f"{key}: {gap:.3g} > 2 x {rounding:.3g}"
    for key in ("ais/alpha", "ais/mismatch", "is/weight_max", "mismatch/ratio_max"):
        np.testing.assert_allclose(float(metrics[key]), ref_metrics[key], rtol=RTOL, err_msg=key)


def _generate_both(params_1, params_m, m, rollout=BF16):
    """The same draws on one device (`sampler.generate`) and the generate phase on ``m``."""
    prompts, prompt_mask = sampler.pad_prompts([[5, 6, 7], [8], [9, 10], [11, 12, 13, 14]] * 2)
    key = jax.random.key(7)
    ref = sampler.generate(
        params_1,
        CONFIG,
        prompts,
        key,
        prompt_mask=prompt_mask,
        max_new_tokens=6,
        temperature=1.0,
        eos_ids=(3,),
    )
    gen = phases(m, rollout).generate
    rows = shd.shard_batch((prompts, prompt_mask), m)
    out = gen(params_m, *rows, key, np.float32(1.0), CONFIG.vocab_size, np.float32(1.0))
    return ref, out


def check_generate(ctx):
    """Rollout layout (tensor-parallel, rows over data x fsdp): same tokens for the same key."""
    m = mesh(data=2, fsdp=2, tensor=2)
    params_m = shd.shard_state(ctx["params"], m, shd.ROLLOUT)
    ref, out = _generate_both(ctx["params"], params_m, m)
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(ref.tokens))
    np.testing.assert_array_equal(np.asarray(out.mask), np.asarray(ref.mask))
    assert_trees_close((out.logp, out.logp_plain), (ref.logp, ref.logp_plain))
    assert out.tokens.sharding.spec == jax.P(shd.BATCH)


def check_qwen35_train_step(ctx):
    """A tiny Qwen3.5: the table splits the Gated DeltaNet's value heads over ``tensor`` (its
    projections like attention's, ``a_log``/``dt_bias`` by head), one float32 update (2
    minibatches) on a 2x2x2 mesh equals the 1-device update as in `check_train_step` but to
    1e-4 of each tensor's step instead of 1e-5 (measured: 4.6e-5 on 9 of the 4096 embedding
    entries, whose gradients run through the delta rule's triangular solves and decays,
    float32 sums that sharding reorders; a sharding bug moves a tensor by O(its step)), and
    the generate phase (rollout layout: the recurrent state's heads over tensor) draws the
    1-device tokens for the same key."""
    params = host_params(QWEN35)
    batch = host_batch(params, QWEN35)
    key, one, m = jax.random.key(1), one_device(), mesh(data=2, fsdp=2, tensor=2)
    before = jax.device_get(phases(one, config=QWEN35).init(params))
    ref, ref_metrics = jax.device_get(
        phases(one, config=QWEN35).update(
            phases(one, config=QWEN35).init(params), shd.shard_batch(batch, one), key
        )
    )
    state = phases(m, config=QWEN35).init(params)
    layers = state.params["layers"]
    assert layers["in_proj_z"].sharding.spec == jax.P(None, "tensor", "fsdp")
    assert layers["out_proj"].sharding.spec == jax.P(None, "fsdp", "tensor")
    assert layers["a_log"].sharding.spec == jax.P(None, "tensor")
    out, metrics = phases(m, config=QWEN35).update(state, shd.shard_batch(batch, m), key)
    for (path, e), a, old in zip(
        jax.tree_util.tree_leaves_with_path(ref.params),
        jax.tree.leaves(out.params),
        jax.tree.leaves(before.params),
        strict=True,
    ):
        e, a = np.asarray(e), np.asarray(a)
        step_size = float(np.abs(e - old).max())
        assert step_size > 0, path
        np.testing.assert_allclose(
            a,
            e,
            rtol=2 * np.finfo(np.float32).eps,
            atol=10 * RTOL * step_size,
            err_msg=jax.tree_util.keystr(path),
        )
    assert_trees_close(out.opt_state, ref.opt_state, what="opt_state")
    assert_metrics_close(metrics, ref_metrics, batch.advantages)

    prompts, prompt_mask = sampler.pad_prompts([[5, 6, 7], [8], [9, 10], [11, 12, 13, 14]] * 2)
    key = jax.random.key(7)
    ref = sampler.generate(
        params, QWEN35, prompts, key, prompt_mask=prompt_mask, max_new_tokens=6, eos_ids=(3,)
    )
    rows = shd.shard_batch((prompts, prompt_mask), m)
    params_m = shd.shard_state(params, m, shd.ROLLOUT)
    assert params_m["layers"]["in_proj_qkv"].sharding.spec == jax.P(None, "tensor", None)
    gen = phases(m, config=QWEN35).generate
    out = gen(params_m, *rows, key, np.float32(1.0), QWEN35.vocab_size, np.float32(1.0))
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(ref.tokens))
    assert_trees_close(out.logp_plain, ref.logp_plain)


LLAMA = dataclasses.replace(CONFIG, qk_norm=False, attention_bias=False, tie_embeddings=True)


def check_llama_train_step_and_fp8_generate(ctx):
    """A tiny Llama (no qk_norm, no biases, tied head, as SmolLM2): one float32 update on a
    2x2x2 mesh equals the 1-device update as `check_train_step` bounds it, and the FP8 rollout
    (sync on the mesh, then the generate phase) draws the 1-device FP8 tokens."""
    assert LLAMA.architecture == "LlamaForCausalLM"
    params = host_params(LLAMA)
    assert "q_norm" not in params["layers"] and "lm_head" not in params
    batch = host_batch(params, LLAMA)
    key, one, m = jax.random.key(1), one_device(), mesh(data=2, fsdp=2, tensor=2)
    before = jax.device_get(phases(one, config=LLAMA).init(params))
    ref, ref_metrics = jax.device_get(
        phases(one, config=LLAMA).update(
            phases(one, config=LLAMA).init(params), shd.shard_batch(batch, one), key
        )
    )
    out, metrics = phases(m, config=LLAMA).update(
        phases(m, config=LLAMA).init(params), shd.shard_batch(batch, m), key
    )
    assert_trees_close(out.opt_state, ref.opt_state, what="opt_state")
    assert_metrics_close(metrics, ref_metrics, batch.advantages)
    assert_params_after_adam(out.params, ref, before.params, min_step=0.0)
    ref_q = phases(one, FP8, config=LLAMA).sync(before.params)
    q = phases(m, FP8, config=LLAMA).sync(phases(m, config=LLAMA).init(params).params)
    prompts, prompt_mask = sampler.pad_prompts([[5, 6, 7], [8], [9, 10], [11, 12, 13, 14]] * 2)
    key = jax.random.key(7)
    expected = sampler.generate(
        jax.device_get(ref_q),
        LLAMA,
        prompts,
        key,
        prompt_mask=prompt_mask,
        max_new_tokens=6,
        eos_ids=(3,),
    )
    gen = phases(m, FP8, config=LLAMA).generate
    rows = shd.shard_batch((prompts, prompt_mask), m)
    drawn = gen(q, *rows, key, np.float32(1.0), LLAMA.vocab_size, np.float32(1.0))
    np.testing.assert_array_equal(np.asarray(drawn.tokens), np.asarray(expected.tokens))
    assert_trees_close(drawn.logp_plain, expected.logp_plain)


def check_fp8(ctx):
    """FP8 on 8 devices == FP8 on 1: the sync quantizes sharded weights with the *global*
    per-tensor amax (bit-identical codes and scales), and the W8A8 forward (batch-sharded
    activation amax) gives the 1-device logits."""
    one, m = one_device(), mesh(data=2, fsdp=2, tensor=2)
    ref_q = phases(one, FP8).sync(phases(one).init(ctx["params"]).params)
    q = phases(m, FP8).sync(phases(m).init(ctx["params"]).params)
    leaves, ref_leaves = jax.tree.leaves(q), jax.tree.leaves(ref_q)
    for a, e in zip(leaves, ref_leaves, strict=True):
        assert a.dtype == e.dtype
        np.testing.assert_array_equal(
            np.asarray(a).view(np.uint8) if a.dtype.itemsize == 1 else np.asarray(a),
            np.asarray(e).view(np.uint8) if e.dtype.itemsize == 1 else np.asarray(e),
        )
    qproj = q["layers"]["q_proj"]
    assert isinstance(qproj, QArray) and qproj.quant.sharding.spec == jax.P(None, "tensor", None)
    assert qproj.scale.sharding.is_fully_replicated
    b = ctx["batch"]
    tokens = np.concatenate([b.prompt_tokens, b.tokens], axis=1)
    mask = np.concatenate([b.prompt_mask, b.mask], axis=1)
    fwd = jax.jit(lambda p, t, mk: model.forward(p, CONFIG, t, mk))
    ref = fwd(jax.device_get(ref_q), tokens, mask)
    fwd_m = jax.jit(
        lambda p, t, mk: model.forward(p, CONFIG, t, mk),
        in_shardings=(
            shd.param_shardings(q, m, shd.ROLLOUT),
            shd.batch_sharding(m),
            shd.batch_sharding(m),
        ),
        out_shardings=shd.batch_sharding(m),
    )
    out = fwd_m(q, *shd.shard_batch((tokens, mask), m))
    valid = mask.astype(bool)
    assert_trees_close(np.asarray(out)[valid], np.asarray(ref)[valid], what="fp8 logits")
    ctx["fp8"] = (jax.device_get(ref_q), q, m)


def check_fp8_generate(ctx):
    """FP8 rollout on 8 devices samples the same tokens as on 1, also with the layers' q/k/v
    and gate/up fused (decode layout ``out_in_fused``; the fused weights' rows split over
    ``tensor`` by KV head and MLP channel)."""
    ref_q, q, m = ctx["fp8"]
    for rollout in (FP8, dataclasses.replace(FP8, decode_layout="out_in_fused")):
        ref, out = _generate_both(ref_q, q, m, rollout)
        np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(ref.tokens))
        assert_trees_close(out.logp_plain, ref.logp_plain)


def check_checkpoint(ctx):
    """A TrainState saved from a 2x4 (fsdp x tensor) mesh restores onto 8x1 and 1x1."""
    state = train.init_state(ctx["params"], OPTIMIZER)
    state = state.replace(step=jnp.asarray(7, jnp.int32))
    expected = jax.device_get(state)
    ckpt = Checkpointer(os.path.join(ctx["tmp"], "ckpt"))
    ckpt.save(7, {"train": shd.shard_state(state, mesh(fsdp=2, tensor=4))}, {"step": 7})
    targets = {"8x1": mesh(fsdp=8, tensor=1), "1x1": mesh(devices=jax.devices()[:1])}
    for name, m in targets.items():
        template = {"train": shd.abstract_state(expected, m)}
        step, restored, record = ckpt.restore(template)
        assert step == 7 and record == {"step": 7}
        got = restored["train"]
        q = got.params["layers"]["q_proj"]
        assert q.sharding.mesh.shape == m.shape, (name, q.sharding)
        assert (
            q.sharding.spec == shd.param_shardings(expected, m).params["layers"]["q_proj"].spec
        ), (name, q.sharding)
        for (path, e), a in zip(
            jax.tree_util.tree_leaves_with_path(expected), jax.tree.leaves(got), strict=True
        ):
            np.testing.assert_array_equal(np.asarray(a), e, err_msg=f"{name}: {path}")


def check_runner(ctx):
    """`runner.Run` steps on a 2x2x2 mesh (``mesh:`` in the config) and, from the 2nd step on,
    compiles nothing."""
    from training_run import TINY_MODEL

    from ais_jax.config import TrainConfig, from_dict
    from ais_jax.train.run import Run

    cfg = from_dict(
        TrainConfig,
        {
            "steps": 3,
            "sft": {"steps": 0},
            "mesh": {"data": 2, "fsdp": 2, "tensor": 2},
            "model": TINY_MODEL,
            "rollout": {
                "prompts_per_step": 4,
                "group_size": 4,
                "max_new_tokens": 6,
                "max_prompt_len": 10,
            },
        },
    )
    run = Run(cfg, os.path.join(ctx["tmp"], "run"))
    rows = [run.step()]
    compiles = []
    listener = lambda event, duration, **kw: compiles.append(event)  # noqa: E731
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        rows.append(run.step())
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert "/jax/core/compile/backend_compile_duration" not in compiles, compiles
    assert all(np.isfinite(v) for row in rows for v in row.values()), rows
    q = run.state.params["layers"]["q_proj"]
    assert q.sharding.spec == jax.P(None, "tensor", "fsdp") and int(run.state.step) == 2


def check_training_run_reference(ctx):
    """The one-process run of `training_run.RUN` on the same 8-device mesh: test_sharding
    compares the two-process run's metrics with this one's."""
    from training_run import RUN

    from ais_jax.config import TrainConfig, from_dict
    from ais_jax.train.job import run_training

    out = os.path.join(ctx["tmp"], "run_one_process")
    run_training(from_dict(TrainConfig, RUN), out, show_progress=False)


CHECKS = [
    check_layouts,
    check_train_step,
    check_grouped_train_step,
    check_remat_train_step,
    check_no_recompile,
    check_score,
    check_score_bf16,
    check_train_step_bf16,
    check_qwen35_train_step,
    check_llama_train_step_and_fp8_generate,
    check_generate,
    check_fp8,
    check_fp8_generate,
    check_checkpoint,
    check_runner,
    check_training_run_reference,
]


def main(out_path: str, tmp: str) -> None:
    assert jax.device_count() == 8, jax.devices()
    params = host_params()
    ctx = {"params": params, "batch": host_batch(params), "tmp": tmp}
    results = {}
    for check in CHECKS:
        t0, c0 = time.perf_counter(), time.process_time()
        try:
            skipped = check(ctx)
            results[check.__name__] = {"ok": True, "skipped": skipped}
        except Exception:
            results[check.__name__] = {"ok": False, "error": traceback.format_exc()}
        results[check.__name__]["seconds"] = round(time.perf_counter() - t0, 2)
        results[check.__name__]["cpu_seconds"] = round(time.process_time() - c0, 2)
        print(check.__name__, results[check.__name__], flush=True)
    with open(out_path, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
