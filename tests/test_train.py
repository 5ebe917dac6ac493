"""Integration specifications of the GRPO training job (`job.run_training`, design.md section 4).

Every arm of the paper (BF16 rollout, FP8 uncorrected, FP8 + TIS, FP8 + AIS) and the extras (MIS,
an FP4 rollout, per-token activation scaling) runs a few RL steps of a one-layer model: each
metrics row holds every documented key and every value is finite. Killing a run and resuming it
gives, on CPU, bitwise the metrics and parameters of an uninterrupted run; half-written
checkpoints are never used, and a damaged one is an error naming its path unless the fallback
is asked for.

All runs share one model shape, so the rollout and scoring programs compile once per process.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import logging
import math
import os
import shutil
import signal
import struct
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import jax
import numpy as np
import pytest
import references
from training_run import MODEL, TINY_RUN

from ais_jax import models as model
from ais_jax.cli.main import main
from ais_jax.config import (
    CorrectionConfig,
    MeshConfig,
    OptimConfig,
    RolloutConfig,
    TrainConfig,
    dump_config,
    from_dict,
    load_config,
)
from ais_jax.io.checkpoint import Checkpointer, _DropEchoes
from ais_jax.io.hf import CheckpointError
from ais_jax.models.qwen3 import ModelConfig
from ais_jax.parallel.sharding import make_mesh
from ais_jax.train.job import run_training
from ais_jax.train.run import Run

# One layer, hidden 64, 16 rollouts (4 prompts x 4 answers) of at most 6 tokens per step. 40 SFT
# steps (well under a second once compiled) teach the model to answer one-digit sums in the right
# format, so rewards differ within groups and updates have non-zero gradients: nothing here is
# tested on all-zero advantages (with 2-5 SFT steps every reward is 0 and every update a no-op).
TINY = TINY_RUN


def tiny_config(**sections) -> TrainConfig:
    """`TINY` with each keyword's dict merged into that section (or a top-level value)."""
    data = {k: dict(v) if isinstance(v, dict) else v for k, v in TINY.items()}
    for key, value in sections.items():
        data[key] = {**data.get(key, {}), **value} if isinstance(value, dict) else value
    return from_dict(TrainConfig, data)


# ---- every arm: keys present, values finite -----------------------------------------------------

ARMS = {
    "bf16": dict(rollout={"format": "bf16"}, correction={"method": "none"}),
    "fp8_none": dict(rollout={"format": "float8_e4m3fn"}, correction={"method": "none"}),
    "fp8_tis": dict(
        rollout={"format": "float8_e4m3fn", "top_k": 16, "top_p": 0.95},
        correction={"method": "tis"},
    ),
    "fp8_ais": dict(rollout={"format": "float8_e4m3fn"}, correction={"method": "ais"}),
    # MIS also covers the KL-to-reference path and several PPO epochs x minibatches
    "fp8_mis": dict(
        rollout={"format": "float8_e4m3fn"},
        correction={"method": "mis"},
        loss={"kl_coef": 0.05},
        optim={"ppo_epochs": 2, "minibatches": 2},
    ),
    "fp4_ais": dict(rollout={"format": "float4_e2m1fn"}, correction={"method": "ais"}),
    "fp8_token_ais": dict(
        rollout={"format": "float8_e4m3fn", "act_scaling": "token"}, correction={"method": "ais"}
    ),
}

REQUIRED = """
    step reward/mean reward/std reward/accuracy response/length_mean response/finished_frac
    policy/entropy
    ais/alpha ais/alpha_ess ais/alpha_mis ais/alpha_var ais/cv ais/degenerate
    ais/ess_ratio_truncated ais/mismatch ais/var_ratio
    is/weight_mean is/weight_max is/clip_frac
    mismatch/k1 mismatch/k3 mismatch/mean_abs mismatch/ratio_max mismatch/ess_ratio_raw
    mismatch/frac_outside mismatch/seq_ess_ratio_raw
    loss/policy loss/kl loss/total loss/clip_frac_low loss/clip_frac_high loss/ratio_mean
    loss/approx_kl
    time/sync_s time/rollout_s time/reward_s time/score_s time/update_s
    train/grad_norm train/skipped train/skipped_steps
""".split()
PLOTS = ["reward.png", "ais.png", "ess.png", "mismatch.png"]

_ARM_RUNS: dict[str, tuple[TrainConfig, Path, dict, list[dict]]] = {}


def read_rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def arm_run(tmp_path_factory):
    """``arm_run(name) -> (cfg, out, summary, rows)``; each arm trains once per module."""

    def run(name: str):
        if name not in _ARM_RUNS:
            cfg = tiny_config(**ARMS[name])
            out = tmp_path_factory.mktemp(name)
            summary = run_training(cfg, out, show_progress=False)
            _ARM_RUNS[name] = (cfg, out, summary, read_rows(out))
        return _ARM_RUNS[name]

    return run


@pytest.mark.slow
@pytest.mark.parametrize("name", list(ARMS))
def test_arm_metrics_present_and_finite(arm_run, name):
    cfg, out, summary, rows = arm_run(name)
    assert [r["step"] for r in rows] == list(range(1, cfg.steps + 1))
    for row in rows:
        missing = [k for k in REQUIRED if k not in row]
        assert not missing, f"{name}: metrics row lacks {missing}"
        bad = {k: v for k, v in row.items() if not math.isfinite(v)}
        assert not bad, f"{name}: non-finite metrics {bad}"
        assert row["train/skipped_steps"] == 0
        assert 0 <= row["reward/mean"] <= 1 and row["reward/std"] >= 0
        assert 1 <= row["response/length_mean"] <= cfg.rollout.max_new_tokens
        assert row["policy/entropy"] > 0
        assert row["time/rollout_s"] > 0 and row["time/update_s"] > 0
        if cfg.loss.kl_coef == 0:
            assert row["loss/kl"] == 0
    learned = [r for r in rows if r["reward/std"] > 0 and r["train/grad_norm"] > 0]
    assert learned, f"{name}: no step had a learning signal; the test would run on zeros"


@pytest.mark.slow
@pytest.mark.parametrize("name", list(ARMS))
def test_arm_writes_outputs(arm_run, name):
    cfg, out, summary, rows = arm_run(name)
    assert load_config(out / "config.yaml") == cfg
    events = list((out / "tb").glob("events.out.tfevents.*"))
    assert events, f"no TensorBoard event file in {out / 'tb'}"
    blob = b"".join(e.read_bytes() for e in events)
    for tag in (b"reward/mean", b"ais/alpha", b"mismatch/k3", b"time/update_s"):
        assert tag in blob, f"TensorBoard events lack {tag!r}"
    for png in PLOTS:
        assert (out / "plots" / png).read_bytes().startswith(b"\x89PNG\r\n\x1a\n"), png
    on_disk = json.loads((out / "summary.json").read_text())
    assert on_disk == summary
    assert summary["steps"] == cfg.steps
    assert 0 <= summary["reward/first"] <= 1 and 0 <= summary["reward/last"] <= 1
    for key in (
        "eval/accuracy",
        "initial/eval/accuracy",
        "sft/final_loss",
        "time/sft_s",
        "time/rollout_s_total",
        "time/update_s_total",
    ):
        assert math.isfinite(summary[key]), key
    assert summary["eval/examples"] == cfg.task.eval_examples
    step_s = [
        sum(r[f"time/{p}_s"] for p in ("rollout", "score", "update", "reward", "sync"))
        for r in rows
    ]
    assert summary["time/step_s_median"] == pytest.approx(float(np.median(step_s[1:])))
    assert 0.2 < summary["memory/host_peak_gib"] < 24  # GiB: jaxlib alone takes 0.2
    assert summary["memory/device_peak_gib"] is None  # CPU: the arrays are host memory
    assert Checkpointer(out / "checkpoints").steps() == [0, cfg.steps]
    evals = [json.loads(line) for line in (out / "eval.jsonl").read_text().splitlines()]
    assert [r["step"] for r in evals] == [0, cfg.steps]
    assert evals[0]["eval/accuracy"] == summary["initial/eval/accuracy"]
    assert evals[-1]["eval/accuracy"] == summary["eval/accuracy"]
    prov = summary["provenance"]
    assert prov["versions"]["jax"] == jax.__version__ and prov["device_count"] == 1
    assert prov["cpu"] and prov["python"]


def test_host_peak_gib_is_the_high_water_mark_in_gib():
    """A fresh interpreter's peak rises by the 512 MiB it touches and stays there once they are
    freed: it is the high-water mark (not the current size), in GiB (not kB or bytes)."""
    code = (
        "import numpy as np; from ais_jax.io.provenance import host_peak_gib as p\n"
        "a = p(); x = np.ones(2**26); b = p(); del x; c = p(); print(a, b, c)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    before, touched, freed = map(float, out.stdout.split())
    assert 0.45 < touched - before < 0.6, (before, touched)
    assert freed > touched - 0.01  # the current size (VmRSS) would fall back by 0.5


def test_cpu_model_names_the_vector_extensions():
    """The CPU of every summary and benchmark table: its model name and the vector extensions
    that XLA's and PyTorch's kernels choose from (hosts of one model name differ in them)."""
    from ais_jax.io.provenance import _cpu_model_from

    two_cores = "processor\t: 0\nmodel name\t: Fake EPYC\nflags\t\t: fpu sse2 fma avx2 avx512f\n\n"
    two_cores += "processor\t: 1\nmodel name\t: Fake EPYC\nflags\t\t: fpu sse2 fma avx2 avx512f\n"
    assert _cpu_model_from(two_cores) == "Fake EPYC (avx2, fma, avx512f)"
    assert _cpu_model_from("model name : Old CPU\nflags : fpu sse2\n") == "Old CPU (no AVX2)"


def test_provenance_names_the_checkouts_commit(monkeypatch, tmp_path):
    """Every summary's and comparison's commit is the checkout's HEAD, wherever the command
    runs from (a package move once made it look for .git inside ais_jax/ and write None)."""
    from ais_jax.io.provenance import git_commit

    repo = Path(__file__).resolve().parent.parent
    monkeypatch.chdir(tmp_path)
    if not (repo / ".git").exists():  # an unpacked copy, not a checkout: nothing to name
        assert git_commit() is None
        return
    head = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True, check=True
    ).stdout.strip()
    assert git_commit().removesuffix("+dirty") == head


def test_runs_with_equal_settings_share_compiled_phases(tmp_path):
    """Arms and seeds of a comparison reuse one jitted program per phase: a second `Run` with
    the same settings gets the very same jitted callables (so nothing recompiles), a different
    correction gets its own update and shares every phase the correction does not touch."""
    cfg = from_dict(TrainConfig, TINY_RUN)
    first, second = Run(cfg, tmp_path / "a"), Run(dataclasses.replace(cfg, seed=1), tmp_path / "b")
    for phase in dataclasses.fields(first.phases):
        name = phase.name
        assert getattr(first.phases, name) is getattr(second.phases, name), name
    other = dataclasses.replace(cfg, correction=dataclasses.replace(cfg.correction, method="tis"))
    third = Run(other, tmp_path / "c").phases
    assert third.update is not first.phases.update
    shared = [f.name for f in dataclasses.fields(third) if f.name != "update"]
    for name in shared:
        assert getattr(third, name) is getattr(first.phases, name), name
    bf16 = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, format="bf16"))
    fourth = Run(bf16, tmp_path / "d").phases  # the rollout copy is the evaluation policy's
    assert fourth.sync is first.phases.sync_bf16 and fourth.generate is first.phases.generate_bf16
    assert fourth.sync is not first.phases.sync and fourth.score is first.phases.score


def test_sampled_evaluation_draws_from_the_runs_seed(tmp_path, monkeypatch):
    """The held-out evaluation's samples come from the run's seed: with the same weights, two
    seeds draw different samples (and the same greedy answers), and one run draws the same
    samples at every evaluation (comparable across checkpoints)."""
    from ais_jax.train import data

    texts = []
    decode = data.decode_responses
    monkeypatch.setattr(data, "decode_responses", lambda *a: texts.append(decode(*a)) or texts[-1])
    cfg = tiny_config(sft={"steps": 0})  # a random model: its samples vary
    first = Run(cfg, tmp_path / "a")
    other = Run(dataclasses.replace(cfg, seed=1), tmp_path / "b")
    other.state = first.state  # the same weights
    runs = {}
    for name, run in (("first", first), ("other", other), ("again", first)):
        texts.clear()
        run.evaluate()
        greedy, sampled = texts[0::2], texts[1::2]  # each chunk: greedy, then one sample
        runs[name] = (greedy, sampled)
    assert runs["first"] == runs["again"]
    assert runs["other"][0] == runs["first"][0]
    assert runs["other"][1] != runs["first"][1]


@pytest.mark.slow
def test_corrections_behave_as_documented(arm_run):
    """Each arm's weights, seen through the whole training step (one minibatch per step, so
    the logged values are the minibatch's): uncorrected arms weight every token 1; TIS caps
    the largest raw ratio at C; AIS applies w = 1 + alpha (min(rho, C) - 1) with the
    alpha it logged (alpha itself against the float64 reference:
    `test_every_arm_logs_diagnostics_with_the_configured_settings`); MIS keeps (1) or drops (0)
    tokens."""
    clip = CorrectionConfig().clip
    for name in ("bf16", "fp8_none"):
        for row in arm_run(name)[3]:
            assert row["ais/alpha"] == 0 and row["is/weight_mean"] == 1
            assert row["is/clip_frac"] == 0 and row["is/weight_max"] == 1
    for row in arm_run("fp8_tis")[3]:
        assert row["ais/alpha"] == 1
        assert row["is/weight_max"] == pytest.approx(min(row["mismatch/ratio_max"], clip))
    for name in ("fp8_ais", "fp4_ais", "fp8_token_ais"):
        for row in arm_run(name)[3]:
            assert row["ais/degenerate"] == 0
            w_max = 1 + row["ais/alpha"] * (min(row["mismatch/ratio_max"], clip) - 1)
            assert row["is/weight_max"] == pytest.approx(w_max, rel=1e-6)
    mis_rows = arm_run("fp8_mis")[3]
    for row in mis_rows:
        assert row["ais/alpha"] == 1 and row["is/weight_max"] in (0.0, 1.0)
    # the KL term sees a frozen reference the policy moves away from (k3 >= 0 holds anyway;
    # measured 0.003 to 0.054 per step); its gradient: tests/test_grpo.py
    assert all(row["loss/kl"] > 1e-3 for row in mis_rows[1:]), [r["loss/kl"] for r in mis_rows]


# ---- the update phase: metric reductions and the correction's settings --------------------------

SMALL = dataclasses.replace(MODEL, num_layers=1, num_heads=2, num_kv_heads=1)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["out_in_columns", "out_in"])
def test_generate_phase_decodes_in_the_configured_layout(layout):
    """``rollout.decode_layout`` reaches the sampler: the phase's rollout equals
    `sampler.generate` called directly with that layout on the same FP8 copy, token for token;
    "auto" is resolved before the phases are memoised (same callables as the default for the
    backend and the copy's compute dtype)."""
    from ais_jax.rollout import sampler
    from ais_jax.train import step as train

    rollout = RolloutConfig(
        prompts_per_step=2, group_size=2, max_new_tokens=5, decode_layout=layout
    )
    cfg = TrainConfig(steps=1, rollout=rollout)
    mesh = make_mesh(MeshConfig())
    phases = train.make_phases(mesh, cfg, SMALL, eos_ids=(2,))
    params = model.init_params(SMALL, jax.random.key(0))
    copy = phases.sync(params)
    prompts = np.array([[5, 6, 7], [0, 9, 10]], np.int32)
    prompt_mask = prompts != 0
    key = jax.random.key(3)
    got = phases.generate(copy, prompts, prompt_mask, key, 1.0, None, None)
    want = sampler.generate(
        copy,
        SMALL,
        prompts,
        key,
        prompt_mask=prompt_mask,
        max_new_tokens=5,
        eos_ids=(2,),
        layout=layout,
    )
    np.testing.assert_array_equal(got.tokens, want.tokens)
    np.testing.assert_array_equal(got.logp, want.logp)
    auto = dataclasses.replace(cfg, rollout=dataclasses.replace(rollout, decode_layout="auto"))
    same = sampler.default_layout(dtype=copy["embed"].dtype) == layout
    assert (train.make_phases(mesh, auto, SMALL, eos_ids=(2,)).generate is phases.generate) == same


def _update_inputs(correction: CorrectionConfig, *, minibatches=4, ppo_epochs=2):
    """The update phase of a 16-row batch (random tokens; rollout log-probs = trainer's +
    N(0, 0.3) noise on valid tokens), its inputs, and its float64 log-ratios ``d [B, T]``."""
    from ais_jax.train import step as train

    optim = OptimConfig(minibatches=minibatches, ppo_epochs=ppo_epochs)
    rollout = RolloutConfig(prompts_per_step=4, group_size=4, max_new_tokens=5)
    cfg = TrainConfig(steps=1, optim=optim, rollout=rollout, correction=correction)
    phases = train.make_phases(make_mesh(MeshConfig()), cfg, SMALL)
    rng = np.random.default_rng(0)
    B, P, T = 16, 3, 5
    mask = np.arange(T)[None, :] < rng.integers(1, T + 1, (B, 1))
    logp_old = (-rng.uniform(0.5, 4.0, (B, T)) * mask).astype(np.float32)
    logp_rollout = (logp_old + 0.3 * rng.standard_normal((B, T)) * mask).astype(np.float32)
    batch = train.Batch(
        prompt_tokens=rng.integers(1, 64, (B, P)).astype(np.int32),
        prompt_mask=np.ones((B, P), bool),
        tokens=rng.integers(1, 64, (B, T)).astype(np.int32),
        mask=mask,
        logp_rollout=logp_rollout,
        logp_old=logp_old,
        advantages=rng.standard_normal(B).astype(np.float32),
    )
    state = phases.init(model.init_params(SMALL, jax.random.key(0)))
    d = (logp_old.astype(np.float64) - logp_rollout) * mask
    return phases, state, batch, d


def test_apply_minibatch_takes_one_optimizer_step_or_skips_it():
    """`train.apply_minibatch` (the minibatch step of `train.update` and of the diffusion
    trainer): on a finite loss, one Adam step (the first moves each weight by lr * sign(grad),
    float64 reference) with the gradient's norm logged; on a non-finite loss, params and
    optimizer state unchanged and the skip counted."""
    import jax.numpy as jnp
    import optax

    from ais_jax.train import step as train

    def loss_fn(params, target):
        loss = jnp.sum((params["w"] - target) ** 2)
        return loss, {"loss": loss}

    optimizer = optax.adam(0.1)
    params = {"w": jnp.array([1.0, -2.0], jnp.float32)}
    carry = (params, optimizer.init(params), jnp.int32(3))
    target = np.array([0.5, 0.5], np.float32)
    (stepped, _, skipped), metrics = train.apply_minibatch(carry, target, loss_fn, optimizer)
    grad = 2 * (np.array([1.0, -2.0]) - target.astype(np.float64))
    np.testing.assert_allclose(stepped["w"], [1.0, -2.0] - 0.1 * np.sign(grad), rtol=1e-6)
    assert float(metrics["train/grad_norm"]) == pytest.approx(np.linalg.norm(grad), rel=1e-6)
    assert float(metrics["loss"]) == pytest.approx(np.sum(grad**2) / 4, rel=1e-6)
    assert int(skipped) == 3 and float(metrics["train/skipped"]) == 0.0
    nan_target = np.array([np.nan, 0.5], np.float32)
    (kept, opt_state, skipped), metrics = train.apply_minibatch(
        carry, nan_target, loss_fn, optimizer
    )
    np.testing.assert_array_equal(kept["w"], params["w"])
    assert all(jax.tree.leaves(jax.tree.map(np.array_equal, opt_state, carry[1])))
    assert int(skipped) == 4 and float(metrics["train/skipped"]) == 1.0


@pytest.mark.slow
def test_update_reduces_maxima_over_minibatches_by_max():
    """``is/weight_max`` and ``mismatch/ratio_max`` of a step with 2 epochs x 4 minibatches are
    the largest weight and ratio of the whole batch (every epoch visits every token), not a
    mean of per-minibatch maxima, which would be smaller: each minibatch holds a quarter of
    the rows and only one of them holds the largest ratio. Means stay means."""
    clip = 1.2  # below the largest ratio, so TIS caps it
    phases, state, batch, d = _update_inputs(CorrectionConfig(method="tis", clip=clip))
    _, metrics = phases.update(state, batch, jax.random.key(3))
    valid = batch.mask
    ratio_max = float(np.exp(d[valid]).max())
    assert ratio_max > clip and np.sum(np.exp(d[valid]) == ratio_max) == 1
    assert float(metrics["mismatch/ratio_max"]) == pytest.approx(ratio_max, rel=1e-6)
    assert float(metrics["is/weight_max"]) == pytest.approx(clip, rel=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["none", "tis", "mis", "ais"])
def test_every_arm_logs_diagnostics_with_the_configured_settings(method):
    """The AIS diagnostics every arm logs use the configured delta, gamma, beta_var, eps (not
    the paper's), and AIS's alpha and weights follow from them: every value against
    `references.ais` (float64, from the batch's raw log-probs and advantages). With the
    paper's delta = 0.02 alpha_mis would be 1 here; with delta = 0.5 it is mean|d| / 0.5. With
    beta_var = 0.5 alpha is 0.21; with the default beta_var = 1 it would be clipped to 0."""
    settings = dict(delta=0.5, gamma=0.6, beta_var=0.5, eps=1e-3)
    clip = CorrectionConfig().clip
    phases, state, batch, d = _update_inputs(
        CorrectionConfig(method=method, **settings), minibatches=1, ppo_epochs=1
    )
    _, metrics = phases.update(state, batch, jax.random.key(3))
    inputs = (batch.advantages, batch.logp_old, batch.logp_rollout, batch.mask)
    ref = references.ais(*inputs, clip=clip, **settings)
    assert min(1.0, ref["mismatch"] / 0.02) == 1.0 and ref["alpha_mis"] < 1
    assert ref["alpha_var"] > 0 and 0.1 < ref["alpha"] < 0.9, ref
    for key in ("cv", "alpha_ess", "mismatch", "alpha_mis", "var_ratio", "alpha_var"):
        assert float(metrics[f"ais/{key}"]) == pytest.approx(ref[key], rel=1e-5), key
    if method == "ais":
        assert float(metrics["ais/alpha"]) == pytest.approx(ref["alpha"], rel=1e-5)
        paper_beta = references.ais(*inputs, clip=clip, **{**settings, "beta_var": 1.0})
        assert paper_beta["alpha"] == 0.0  # so beta_var is what keeps alpha above 0 here
        w = 1 + ref["alpha"] * (np.minimum(np.exp(d[batch.mask]), clip) - 1)
        assert float(metrics["is/weight_mean"]) == pytest.approx(w.mean(), rel=1e-5)
        assert float(metrics["is/weight_max"]) == pytest.approx(w.max(), rel=1e-5)


def _on_policy_batch(rng, prompt, prompt_mask, tokens, mask, logp_old):
    """An on-policy batch (logp_old left to the update): rollout log-probs = the trainer's
    ``logp_old`` + N(0, 0.3) noise on valid tokens, standard normal advantages."""
    from ais_jax.train import step as train

    noise = 0.3 * rng.standard_normal(mask.shape) * mask
    return train.Batch(
        prompt_tokens=prompt,
        prompt_mask=prompt_mask,
        tokens=tokens,
        mask=mask,
        logp_rollout=(logp_old + noise).astype(np.float32),
        logp_old=None,
        advantages=rng.standard_normal(mask.shape[0]).astype(np.float32),
    )


def _random_rows(rng, B: int = 16, P: int = 3, T: int = 5, vocab: int = 64):
    """B rows of P prompt tokens (unpadded) and up to T response tokens (each row at least 1)."""
    prompt, prompt_mask = rng.integers(1, vocab, (B, P)).astype(np.int32), np.ones((B, P), bool)
    tokens = rng.integers(1, vocab, (B, T)).astype(np.int32)
    mask = np.arange(T)[None, :] < rng.integers(1, T + 1, (B, 1))
    return prompt, prompt_mask, tokens, mask


def _on_policy_pair(method: str, dtype: str):
    """One on-policy update two ways from the same params, batch and key: scored first (the
    score phase's logp_old, as before) and with ``logp_old=None`` (computed in the update).
    Returns both (state, metrics), the scored logp_old, entropy and the batch."""
    import jax.numpy as jnp

    from ais_jax.train import step as train

    rollout = RolloutConfig(prompts_per_step=4, group_size=4, max_new_tokens=5)
    cfg = TrainConfig(
        steps=1,
        optim=OptimConfig(learning_rate=1e-3),
        rollout=rollout,
        correction=CorrectionConfig(method=method),
    )
    phases = train.make_phases(make_mesh(MeshConfig()), cfg, SMALL, compute_dtype=jnp.dtype(dtype))
    params = model.init_params(SMALL, jax.random.key(0))
    rng = np.random.default_rng(0)
    prompt, prompt_mask, tokens, mask = _random_rows(rng)
    logp_old, entropy = phases.score(params, prompt, prompt_mask, tokens, mask, np.float32(1.0))
    logp_old, entropy = np.asarray(logp_old), np.asarray(entropy)
    batch = _on_policy_batch(rng, prompt, prompt_mask, tokens, mask, logp_old)
    key = jax.random.key(3)
    scored = phases.update(phases.init(params), batch.replace(logp_old=logp_old), key)
    inside = phases.update(phases.init(params), batch, key)
    return scored, inside, logp_old, entropy, batch


@pytest.mark.slow
@pytest.mark.parametrize(
    "method,dtype",
    [("none", "float32"), ("tis", "float32"), ("ais", "float32"), ("mis", "float32")]
    + [("ais", "bfloat16")],
)
def test_on_policy_update_scores_in_its_own_forward(method, dtype):
    """On-policy (1 epoch, 1 minibatch) ``logp_old=None`` makes the update use
    stop_gradient(logp_new) of its own forward instead of a separate score pass: same params
    and metrics as score-then-update. The two logp_old are the same forward of the same params
    in the same dtype, differing only in XLA's fusion (~1 float32 ulp of a log-prob ~ 4e-7):
    the ratio is 1 to ~1e-7 either way, so every metric agrees to 1e-5 absolute (alpha, the
    mismatch and weights to 1e-6 relative), the gradient norm to 1e-6 relative and, after one
    Adam step of lr 1e-3, the params to 1e-6 (a thousandth of the step): Adam's first step is
    lr * g / (|g| + 1e-8) per weight, which turns a 1e-7 relative difference of a gradient near
    Adam's eps into up to ~1e-3 of a step (measured: 3.8e-7 on the embedding, <= 1.4e-7
    elsewhere). Every correction still sees d = logp_old - logp_rollout: mismatch/mean_abs is
    that of the score phase's logp_old (float64 reference)."""
    (state_a, m_a), (state_b, m_b), logp_old, entropy, batch = _on_policy_pair(method, dtype)
    m_a, m_b = jax.device_get(m_a), jax.device_get(m_b)
    valid = batch.mask
    d = logp_old.astype(np.float64) - batch.logp_rollout
    assert float(m_b["mismatch/mean_abs"]) == pytest.approx(np.abs(d[valid]).mean(), rel=1e-6)
    assert float(m_b["policy/entropy"]) == pytest.approx(entropy[valid].mean(), rel=1e-6)
    assert "policy/entropy" not in m_a and set(m_a) | {"policy/entropy"} == set(m_b)
    assert abs(float(m_a["loss/policy"])) > 1e-3 and float(m_a["train/grad_norm"]) > 1e-3
    for name in m_a:
        np.testing.assert_allclose(m_b[name], m_a[name], atol=1e-5, rtol=1e-6, err_msg=name)
    for name in ("ais/alpha", "mismatch/mean_abs", "is/weight_mean", "mismatch/ratio_max"):
        assert float(m_b[name]) == pytest.approx(float(m_a[name]), rel=1e-6), name
    moved = jax.tree.map(
        lambda a, b: np.max(np.abs(np.asarray(a) - np.asarray(b))),
        state_a.params,
        model.init_params(SMALL, jax.random.key(0)),
    )
    assert max(jax.tree.leaves(moved)) > 1e-4, "the update did not move the params"
    diff = jax.tree.map(
        lambda a, b: np.max(np.abs(np.asarray(a) - np.asarray(b))), state_a.params, state_b.params
    )
    print(
        f"{method} {dtype}: params max diff {max(jax.tree.leaves(diff)):.3g}, metrics max diff "
        f"{max(abs(float(m_a[k]) - float(m_b[k])) for k in m_a):.3g}"
    )
    assert float(m_b["train/grad_norm"]) == pytest.approx(float(m_a["train/grad_norm"]), rel=1e-6)
    assert max(jax.tree.leaves(diff)) <= 1e-6


@pytest.mark.slow
def test_optim_remat_reaches_the_update():
    """``optim.remat=True``: the update phase recomputes its layers in the backward pass (less
    than 60% of the temporaries, float32) and takes the same step: its metrics to 1e-6 and its
    params to 1e-6 after one Adam step of lr 1e-3 (as in the test above, a float32 gradient's
    last bits can move a weight near Adam's eps by ~1e-3 of a step)."""
    import jax.numpy as jnp

    from ais_jax.train import step as train

    config = dataclasses.replace(SMALL, num_layers=4)  # one layer would keep its own anyway
    rollout = RolloutConfig(prompts_per_step=4, group_size=4, max_new_tokens=5)
    params = model.init_params(config, jax.random.key(0))
    rng = np.random.default_rng(0)
    prompt, prompt_mask, tokens, mask = _random_rows(rng)
    logp_old = rng.normal(-3.0, 1.0, mask.shape).astype(np.float32) * mask
    batch = _on_policy_batch(rng, prompt, prompt_mask, tokens, mask, logp_old)
    key = jax.random.key(3)
    runs = {}
    for remat in (False, True):
        optim = OptimConfig(learning_rate=1e-3, remat=remat)
        cfg = TrainConfig(steps=1, optim=optim, rollout=rollout)
        phases = train.make_phases(make_mesh(MeshConfig()), cfg, config, compute_dtype=jnp.float32)
        state = phases.init(params)
        temp = phases.update.lower(state, batch, key).compile().memory_analysis().temp_size_in_bytes
        runs[remat] = (temp, *jax.device_get(phases.update(state, batch, key)))
    (temp_plain, state_plain, m_plain), (temp_remat, state_remat, m_remat) = runs[0], runs[1]
    assert temp_remat < 0.6 * temp_plain, (temp_remat, temp_plain)
    assert abs(float(m_plain["loss/policy"])) > 1e-3
    for name in m_plain:
        np.testing.assert_allclose(m_remat[name], m_plain[name], atol=1e-6, rtol=1e-6, err_msg=name)
    diff = jax.tree.map(lambda a, b: np.abs(a - b).max(), state_remat.params, state_plain.params)
    assert max(jax.tree.leaves(diff)) <= 1e-6


def test_logp_old_is_computed_inside_only_on_policy():
    """Several minibatches (or epochs) need the pre-update policy's log-probs scored before the
    first update: a batch without logp_old is then an error naming the settings."""
    phases, state, batch, _ = _update_inputs(CorrectionConfig(method="ais"), minibatches=2)
    with pytest.raises(ValueError, match=r"ppo_epochs=2, minibatches=2.*on-policy"):
        phases.update(state, batch.replace(logp_old=None), jax.random.key(3))


@pytest.mark.slow
def test_a_batch_of_groups_runs_each_prompt_once_with_the_same_update():
    """`Batch.prompt_group` = G, as `Run` builds its batches (G consecutive rows answer one
    prompt): the on-policy update and the score phase run each prompt through the model once
    (`qwen3.response_hidden`), with the result of running every row's own copy (float32):
    log-probs and entropies to 1e-6 relative, every metric to 1e-5 absolute and 1e-6 relative,
    and the params after one lr-1e-3 Adam step to 1e-6 (a thousandth of the step; Adam's first
    step, lr * g / (|g| + 1e-8), turns a float32-rounding difference of a gradient near its eps
    into up to ~1e-3 of a step, as in the test above). A group that does not divide the rows
    is an error."""
    from ais_jax.train import step as train

    rollout = RolloutConfig(prompts_per_step=4, group_size=4, max_new_tokens=5)
    cfg = TrainConfig(steps=1, optim=OptimConfig(learning_rate=1e-3), rollout=rollout)
    f32 = jax.numpy.dtype("float32")  # bfloat16 rounds the two sums differently (test_sampler)
    phases = train.make_phases(make_mesh(MeshConfig()), cfg, SMALL, compute_dtype=f32)
    params = model.init_params(SMALL, jax.random.key(0))
    rng = np.random.default_rng(0)
    N, G, P, T = 4, 4, 3, 5
    B = N * G
    prompt = np.repeat(rng.integers(1, 64, (N, P)).astype(np.int32), G, axis=0)
    prompt_mask = np.repeat(np.arange(P)[None] >= rng.integers(0, P, (N, 1)), G, axis=0)
    tokens = rng.integers(1, 64, (B, T)).astype(np.int32)
    mask = np.arange(T)[None, :] < rng.integers(1, T + 1, (B, 1))
    scored = (prompt, prompt_mask, tokens, mask, np.float32(1.0))
    per_row, per_group = phases.score(params, *scored), phases.score(params, *scored, G)
    for a, b in zip(per_group, per_row, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6 * float(np.abs(b).max()))
    batch = _on_policy_batch(rng, prompt, prompt_mask, tokens, mask, np.asarray(per_row[0]))
    key = jax.random.key(3)
    state_a, m_a = phases.update(phases.init(params), batch, key)
    state_b, m_b = phases.update(phases.init(params), batch.replace(prompt_group=G), key)
    m_a, m_b = jax.device_get(m_a), jax.device_get(m_b)
    assert abs(float(m_a["loss/policy"])) > 1e-3 and float(m_a["train/grad_norm"]) > 1e-3
    for name in m_a:
        np.testing.assert_allclose(m_b[name], m_a[name], atol=1e-5, rtol=1e-6, err_msg=name)
    diff = jax.tree.map(
        lambda a, b: np.max(np.abs(np.asarray(a) - np.asarray(b))), state_a.params, state_b.params
    )
    assert max(jax.tree.leaves(diff)) <= 1e-6, diff
    with pytest.raises(
        ValueError, match="prompt_group=3 must be a positive integer dividing the 16 rows"
    ):
        phases.update(phases.init(params), batch.replace(prompt_group=3), key)
    with pytest.raises(
        ValueError, match="prompt_group=3 must be a positive integer dividing the 16 rows"
    ):
        phases.score(params, *scored, 3)


@pytest.mark.slow
def test_rollout_mismatch_grows_as_precision_drops(arm_run):
    """Step 1 of every arm starts from the same SFT weights: the rollout-vs-trainer mismatch
    of a BF16 engine is below FP8's, which is below FP4's."""
    first = {
        name: arm_run(name)[3][0]["mismatch/mean_abs"] for name in ("bf16", "fp8_none", "fp4_ais")
    }
    assert first["bf16"] < first["fp8_none"] < first["fp4_ais"], first


@pytest.mark.slow
def test_bf16_rollout_is_on_policy(arm_run):
    """The BF16 rollout engine (KV-cached decode) and the BF16 trainer (full-sequence scoring)
    agree up to float rounding: mismatch orders of magnitude below FP8's, weights ~ 1."""
    fp8 = arm_run("fp8_none")[3]
    for row, row_fp8 in zip(arm_run("bf16")[3], fp8, strict=True):
        assert row["mismatch/mean_abs"] < 1e-5, row
        assert row_fp8["mismatch/mean_abs"] > 100 * row["mismatch/mean_abs"]
        assert abs(row["mismatch/ratio_max"] - 1) < 1e-3 and row["mismatch/ess_ratio_raw"] > 0.9999
        assert row["ais/alpha_mis"] < 1e-3 and row["mismatch/frac_outside"] == 0


@pytest.mark.slow
def test_grpo_learns_a_one_token_bandit():
    """End to end, the loop's phases learn: reward 1 for answering token 5 (a random model
    says it with p ~ 1/64). 40 steps of FP8 rollout -> BF16 score -> AIS-corrected GRPO update
    (the phases `train.make_phases` builds) must make it the likely answer."""
    import jax.numpy as jnp

    from ais_jax import grpo
    from ais_jax.train import step as train

    config = ModelConfig(
        vocab_size=64,
        hidden_size=64,
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
        head_dim=32,
        intermediate_size=128,
    )
    G, target = 8, 5
    cfg = TrainConfig(
        steps=40,
        optim=OptimConfig(learning_rate=1e-3, warmup_steps=0, minibatches=2),
        rollout=RolloutConfig(prompts_per_step=16, group_size=G, max_new_tokens=2),
        correction=CorrectionConfig(method="ais"),
    )
    phases = train.make_phases(make_mesh(MeshConfig()), cfg, config)
    state = phases.init(model.init_params(config, jax.random.key(0)))
    prompts = np.tile(np.array([[1, 2, 3]], np.int32), (16 * G, 1))
    prompt_mask = np.ones(prompts.shape, bool)
    one = jnp.float32(1.0)

    def p_target(params):
        answer = np.full((16 * G, 1), target, np.int32)
        logp, _ = phases.score(
            params, prompts, prompt_mask, answer, np.ones_like(answer, bool), one
        )
        return float(jnp.exp(logp[0, 0]))

    p_start, rewards = p_target(state.params), []
    for step in range(40):
        rollout_params = phases.sync(state.params)
        ro = phases.generate(
            rollout_params, prompts, prompt_mask, jax.random.key(step), one, config.vocab_size, one
        )
        reward = (np.asarray(ro.tokens[:, 0]) == target).astype(np.float32)
        rewards.append(reward.mean())
        logp_old, _ = phases.score(
            state.params, ro.prompt_tokens, ro.prompt_mask, ro.tokens, ro.mask, one
        )
        batch = train.Batch(
            ro.prompt_tokens,
            ro.prompt_mask,
            ro.tokens,
            ro.mask,
            ro.logp_plain,
            logp_old,
            grpo.group_advantages(jnp.asarray(reward), G),
        )
        state, _ = phases.update(state, batch, jax.random.key(1000 + step))
    assert p_start < 0.05 and np.mean(rewards[:5]) < 0.1, (p_start, rewards[:5])
    assert p_target(state.params) > 0.8 and np.mean(rewards[-5:]) > 0.8, rewards


def test_package_imports_form_no_cycle_and_the_core_has_no_hidden_imports():
    """The modules' top-level imports of one another form a DAG (config -> sharding ->
    train -> config was a cycle, hidden by imports inside functions), and the training core
    imports nothing of the package inside a function."""
    import ast
    import importlib.util

    package = Path(importlib.util.find_spec("ais_jax").origin).parent
    graph, hidden = {}, {}
    for path in package.rglob("*.py"):
        rel = path.relative_to(package.parent).with_suffix("")
        name = ".".join(rel.parts).removesuffix(".__init__")
        tree = ast.parse(path.read_text())
        top = [n for n in tree.body if isinstance(n, ast.Import | ast.ImportFrom)]
        nested = [n for n in ast.walk(tree) if isinstance(n, ast.Import | ast.ImportFrom)]
        graph[name] = {m for n in top for m in _modules(n, name) if m.startswith("ais_jax")}
        hidden[name] = {m for n in nested if n not in top for m in _modules(n, name)}
    cores = (
        "ais_jax.config",
        "ais_jax.parallel.sharding",
        "ais_jax.train.step",
        "ais_jax.train.run",
        "ais_jax.train.job",
    )
    for core in cores:
        assert not {m for m in hidden[core] if m.startswith("ais_jax")}, (core, hidden[core])
    done, stack = set(), []

    def visit(module):  # depth-first: a module met again on the current path is a cycle
        assert module not in stack, " -> ".join([*stack[stack.index(module) :], module])
        if module in done or module not in graph:
            return
        stack.append(module)
        for dep in sorted(graph[module] - {module}):  # a package importing its own modules
            visit(dep)
        stack.pop()
        done.add(module)

    for module in sorted(graph):
        visit(module)


def _modules(node, importer: str) -> list[str]:
    """The modules an import statement of module ``importer`` names (``from a import b``: a.b
    if that is a module of the package, else a)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    base = node.module or ""
    if node.level:
        base = ".".join(importer.split(".")[: -node.level] + ([base] if base else []))
    return [base] + [f"{base}.{a.name}" for a in node.names]


# ---- kill, resume, damaged checkpoints ----------------------------------------------------------

# Pauses the real `ais-jax train` after RL step `stop` (its row written, its checkpoint if due),
# through `run_training`'s on_step callback, so the test can SIGKILL it at a known point (RL
# steps of this model take milliseconds: polling alone would race).
_KILLABLE = textwrap.dedent("""
    import functools, sys, time
    import ais_jax.train.job as job
    from ais_jax.cli.main import main

    stop = int(sys.argv[1])

    def hang_after_stop(row):
        if row["step"] >= stop:
            time.sleep(3600)

    job.run_training = functools.partial(job.run_training, on_step=hang_after_stop)
    sys.exit(main(sys.argv[2:]))
""")

# `steps` also sets the length of the learning-rate schedule: the run that is killed is started
# with the full 4 steps, like the uninterrupted one, and the schedule is the default constant one.
# A KL term keeps every step's gradient nonzero whatever the draws (a step whose groups all
# score alike has zero advantages), so the replayed steps after the resume are real updates.
RESUME = dict(steps=4, checkpoint_every=2, loss={"kl_coef": 0.05})


def _params(cfg: TrainConfig, out: Path, step: int):
    """Trainer params and optimizer state of checkpoint ``step`` as numpy arrays."""
    run = Run(cfg, out)
    _, restored, _ = run.checkpointer.restore(run.checkpoint_template(), step)
    return jax.device_get((restored["train"].params, restored["train"].opt_state))


def _assert_same_run(rows_a, rows_b, state_a, state_b):
    strip = lambda r: {k: v for k, v in r.items() if not k.startswith("time/")}  # noqa: E731
    assert [strip(r) for r in rows_b] == [strip(r) for r in rows_a]
    flat_a, tree_a = jax.tree_util.tree_flatten(state_a)
    flat_b, tree_b = jax.tree_util.tree_flatten(state_b)
    assert tree_a == tree_b
    for a, b in zip(flat_a, flat_b, strict=True):
        np.testing.assert_array_equal(np.asarray(b), np.asarray(a), strict=True)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    cfg = tiny_config(**RESUME)
    out = tmp_path_factory.mktemp("uninterrupted")
    run_training(cfg, out, show_progress=False)
    return cfg, out, read_rows(out), _params(cfg, out, cfg.steps)


@pytest.mark.slow
def test_killed_run_resumes_bitwise(uninterrupted, tmp_path, caplog):
    cfg, _, rows_a, state_a = uninterrupted
    config_file = tmp_path / "config.yaml"
    config_file.write_text(dump_config(cfg))
    out = tmp_path / "run"
    argv = ["train", "--config", str(config_file), "--out", str(out), "--no-progress"]
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_NUMPY_RANK_PROMOTION="raise")
    log = tmp_path / "killed.log"
    with log.open("w") as stderr:
        proc = subprocess.Popen(
            [sys.executable, "-c", _KILLABLE, "3", *argv],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=stderr,
        )
    try:
        deadline = time.monotonic() + 400
        metrics = out / "metrics.jsonl"
        while not (metrics.exists() and metrics.read_text().count("\n") >= 3):
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, "the run to kill never reached step 3"
            time.sleep(0.2)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert Checkpointer(out / "checkpoints").steps() == [0, 2]
    assert len(read_rows(out)) == 3  # step 3 was done but not checkpointed

    # A half-written checkpoint (what a kill during a save leaves) must never be picked up:
    # make one that would otherwise be the newest.
    partial = out / "checkpoints" / "6.orbax-checkpoint-tmp-1700000000000000"
    shutil.copytree(out / "checkpoints" / "2", partial)
    assert Checkpointer(out / "checkpoints").latest_step() == 2

    with caplog.at_level("INFO", logger="ais_jax"):
        assert main([*argv, "--resume"]) == 0
    assert "Resumed from" in caplog.text and "at step 2" in caplog.text
    rows_b = read_rows(out)
    assert [r["step"] for r in rows_b] == [1, 2, 3, 4]  # the orphan row of step 3 was replaced
    _assert_same_run(rows_a, rows_b, state_a, _params(cfg, out, cfg.steps))
    # ... and the comparison is not vacuous: steps 3 and 4 had gradients and moved the weights
    assert all(r["train/grad_norm"] > 0 for r in rows_b[2:]), rows_b
    params_2, params_4 = _params(cfg, out, 2)[0], state_a[0]
    assert not np.array_equal(params_2["embed"], params_4["embed"])
    # TensorBoard: the resumed writer purges the killed run's events of step 3 onwards
    purges = [e.step for e in _tb_events(out / "tb") if e.session_log.status == 1]  # START
    assert purges == [3], purges


def _tb_events(directory: Path):
    """Every event of the TensorBoard files in ``directory`` (TFRecord framing, no TF)."""
    from tensorboardX.proto import event_pb2

    for path in sorted(directory.glob("events.out.tfevents.*")):
        data, pos = path.read_bytes(), 0
        while pos < len(data):
            (length,) = struct.unpack("<Q", data[pos : pos + 8])
            yield event_pb2.Event.FromString(data[pos + 12 : pos + 12 + length])
            pos += 12 + length + 4


@pytest.mark.slow
def test_a_run_that_raises_closes_its_events_first(tmp_path):
    """An error that ends a run (here from ``on_step`` after step 1) closes the TensorBoard
    writer before it propagates: the step's scalars are on disk then, not queued in
    tensorboardX's thread for an atexit flush (which a full disk would turn into a traceback)."""

    def fail(row):
        raise RuntimeError(f"stop at step {row['step']}")

    out = tmp_path / "run"
    with pytest.raises(RuntimeError, match="stop at step 1"):
        run_training(tiny_config(steps=3), out, show_progress=False, on_step=fail)
    tags = {v.tag for e in _tb_events(out / "tb") if e.step == 1 for v in e.summary.value}
    assert {"reward/mean", "ais/alpha"} <= tags, sorted(tags)


# orbax/tensorstore: reads still in flight when a damaged checkpoint fails call back into the
# closed event loop ("RuntimeError: Event loop is closed", printed, harmless)
@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_damaged_checkpoint_is_an_error_and_fallback_uses_the_previous(
    uninterrupted, tmp_path, capsys
):
    cfg, out_a, rows_a, state_a = uninterrupted
    out = Path(shutil.copytree(out_a, tmp_path / "run"))
    newest = out / "checkpoints" / "4"
    data_files = [p for p in (newest / "state").rglob("*") if p.is_file() and p.parent.name == "d"]
    assert data_files
    for f in data_files:  # truncate the array data of the newest checkpoint
        f.write_bytes(f.read_bytes()[:7])

    checkpointer = Checkpointer(out / "checkpoints")
    template = Run(cfg, out).checkpoint_template()
    asyncio_log = logging.getLogger("asyncio")
    asyncio_log.filters[:] = [f for f in asyncio_log.filters if not isinstance(f, _DropEchoes)]
    with pytest.raises(CheckpointError, match=str(newest)) as err:
        checkpointer.restore(template)
    assert "--resume-fallback" in str(err.value)
    # the failed reads' late asyncio echoes ("Task exception was never retrieved", with a
    # traceback, once CI's worker exited) are dropped from here on, as after a failed save
    assert any(isinstance(f, _DropEchoes) for f in asyncio_log.filters)
    step, _, record = checkpointer.restore(template, fallback=True)
    assert step == record["step"] == 2

    # The same through the command line: an error naming the path, then the fallback, which
    # re-runs steps 3 and 4 (overwriting the damaged checkpoint) to the uninterrupted result.
    config_file = tmp_path / "config.yaml"
    config_file.write_text(dump_config(cfg))
    argv = ["train", "--config", str(config_file), "--out", str(out), "--no-progress", "--resume"]
    capsys.readouterr()
    assert main(argv) == 2
    err_lines = [ln for ln in capsys.readouterr().err.splitlines() if "error:" in ln]
    assert len(err_lines) == 1 and str(newest) in err_lines[0]
    assert main([*argv, "--resume-fallback"]) == 0
    assert Checkpointer(out / "checkpoints").steps() == [0, 2, 4]
    _assert_same_run(rows_a, read_rows(out), state_a, _params(cfg, out, cfg.steps))


@pytest.mark.slow
def test_fresh_run_refuses_a_directory_with_checkpoints(uninterrupted, tmp_path):
    cfg, out_a, _, _ = uninterrupted
    out = Path(shutil.copytree(out_a, tmp_path / "run"))
    with pytest.raises(ValueError, match="already holds checkpoints.*--resume"):
        run_training(cfg, out, show_progress=False)
    assert read_rows(out) == read_rows(out_a)  # nothing was touched
