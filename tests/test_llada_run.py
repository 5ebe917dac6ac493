"""diffu-GRPO for LLaDA in the trainer (`train.make_phases` with `diffusion.ESTIMATOR`, `Run`).

Phases, on one device with a tiny LLaDA: the ratio of a BF16 rollout to the BF16 trainer on the
same prompt mask is exactly 1 (and an FP8 rollout's is not); each inner update gets its own
prompt mask, logp_rollout and logp_old are recomputed on it and equal an independent
`one_step_logp` with that mask's key; the update pairs inner update j's logp_new with mask j.

End to end, from the command line: ``ais-jax train --config configs/llada_tiny.yaml`` (made
tiny with ``--set``) writes the autoregressive run's files and metrics, and a run stopped after
step 1 and resumed with ``--resume`` equals the uninterrupted run bit for bit (rows and weights).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ais_jax.analysis.plots import read_metrics
from ais_jax.cli.main import main
from ais_jax.config import TrainConfig, load_config
from ais_jax.io.hf import load_hf
from ais_jax.models import ModelConfig
from ais_jax.models.llada import LLaDAConfig, init_params
from ais_jax.parallel import sharding as shd
from ais_jax.rollout import diffusion as ds
from ais_jax.tasks import make_task
from ais_jax.train import diffusion as dt
from ais_jax.train import job
from ais_jax.train import step as train
from ais_jax.train.run import Run

LLADA_TINY = Path(__file__).parent.parent / "configs" / "llada_tiny.yaml"
# `configs/llada_tiny.yaml` at test size: one layer, 8 rollouts of 12 tokens, 2 RL steps, on
# 3-number Countdown with d1's prompt masking (30 SFT steps give some rewards > 0 there)
TINY = [
    "task.options={min_numbers: 3, max_numbers: 3, max_number: 10, max_target: 100}",
    "rollout.diffusion.p_mask_prompt=0.15",
    "sft.learning_rate=3.0e-3",
    "steps=2",
    "checkpoint_every=1",
    "eval_every=0",
    "model.hidden_size=32",
    "model.num_layers=1",
    "model.num_heads=2",
    "model.num_kv_heads=2",
    "model.intermediate_size=64",
    "task.eval_examples=4",
    "rollout.prompts_per_step=2",
    "rollout.group_size=4",
    "rollout.max_new_tokens=12",
    "rollout.max_prompt_len=20",
    "rollout.diffusion.block_length=6",
    "rollout.diffusion.steps=4",
    "sft.steps=30",
    "sft.batch_size=8",
    "optim.learning_rate=1.0e-3",
]
CONFIG = LLaDAConfig.preset(  # the model TINY builds
    "tiny", hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=2, intermediate_size=64
)
# the run's batch shapes and inner updates (rows, prompt and response length, J = ppo_epochs), so
# the phases compiled here serve the end-to-end tests too
B, P, T, J = 8, 20, 12, 2


def _cfg(*overrides: str):
    return load_config(LLADA_TINY, [*TINY, *overrides])


def _batch():
    rng = np.random.default_rng(0)
    prompt_mask = np.ones((B, P), bool)
    prompt_mask[::2, :2] = False  # left padding
    mask = np.ones((B, T), bool)
    mask[1, 3:] = False  # an early EOS
    prompts = rng.integers(3, 78, (B, P)).astype(np.int32)
    tokens = rng.integers(3, 78, (B, T)).astype(np.int32)
    return prompts, prompt_mask, tokens, mask


def _scored(fmt: str, p_mask: float = 0.5, *, compute_dtype=None):
    """Phases of a J-update run in ``fmt``: (phases, state, rollout params, batch, keys, Scored)."""
    cfg = _cfg(f"rollout.format={fmt}")
    assert cfg.optim.ppo_epochs == J
    phases = train.make_phases(
        shd.make_mesh(cfg.mesh),
        cfg,
        CONFIG,
        eos_ids=(2,),
        compute_dtype=compute_dtype,
        estimator=dt.ESTIMATOR,
    )
    params = jax.tree.map(lambda x: 10 * x, init_params(CONFIG, jax.random.key(1)))
    state = phases.init(params)
    rollout = phases.sync(state.params)
    batch = _batch()
    keys = jax.random.split(jax.random.key(7), J)
    return (
        phases,
        state,
        rollout,
        batch,
        keys,
        phases.score(rollout, state.params, *batch, keys, p_mask),
    )


@pytest.mark.slow
def test_bf16_rollout_and_bf16_trainer_on_the_same_mask_have_ratio_exactly_one():
    *_, batch, _, scored = _scored("bf16")
    mask = batch[3]
    lr, lo = np.asarray(scored.logp_rollout), np.asarray(scored.logp_old)
    assert lr.shape == lo.shape == (B, J, T) and lr.dtype == np.float32
    valid = mask[:, None].repeat(J, 1)
    assert np.all(lr[valid] <= 0) and np.median(lr[valid]) < -1  # real log-probs, not zeros
    assert np.all(lr[~valid] == 0)
    np.testing.assert_array_equal(lr, lo)
    np.testing.assert_array_equal(np.exp(lo - lr), np.ones_like(lr))
    # ... while an FP8 rollout of the same weights is a (small) precision mismatch
    *_, scored8 = _scored("float8_e4m3fn")
    np.testing.assert_array_equal(np.asarray(scored8.logp_old), lo)
    gap = np.abs(np.asarray(scored8.logp_rollout) - lo)[mask[:, None].repeat(J, 1)]
    assert np.isfinite(gap).all() and gap.max() > 1e-4, gap.max()


@pytest.mark.slow
def test_each_inner_update_has_its_own_mask_and_its_own_logp_rollout():
    phases, state, rollout, batch, keys, scored = _scored("float8_e4m3fn")
    prompts, prompt_mask, tokens, mask = batch
    z = np.asarray(scored.prompt_tokens)
    assert z.shape == (B, J, P)
    hidden = z == CONFIG.mask_token_id
    assert not hidden[~prompt_mask[:, None].repeat(J, 1)].any()  # padding is never masked
    for j in range(J):  # each mask is masked_prompt of its own key ...
        expected = np.asarray(ds.masked_prompt(keys[j], prompt_mask, 0.5))
        np.testing.assert_array_equal(hidden[:, j], expected)
        # ... and logp_rollout / logp_old are the estimator's on that key
        for params, got in ((rollout, scored.logp_rollout), (state.params, scored.logp_old)):
            params = (
                params
                if params is rollout
                else jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
            )
            ref = jax.jit(ds.one_step_logp, static_argnums=1)(
                params, CONFIG, prompts, prompt_mask, tokens, mask, keys[j], 0.5
            )
            np.testing.assert_allclose(np.asarray(got)[:, j], np.asarray(ref), rtol=1e-6, atol=1e-6)
    for a, b in ((0, 1),):  # new masks, so new estimates
        assert (hidden[:, a] != hidden[:, b]).any()
        assert not np.array_equal(
            np.asarray(scored.logp_rollout)[:, a], np.asarray(scored.logp_rollout)[:, b]
        )
    # the run's J mask keys: distinct, and a function of the step's rollout key only
    run_keys = dt.mask_keys(jax.random.key(3), J)[1]
    data = np.asarray(jax.random.key_data(run_keys))
    assert len({tuple(d) for d in data}) == J
    again = dt.mask_keys(jax.random.key(3), J)[1]
    np.testing.assert_array_equal(np.asarray(jax.random.key_data(again)), data)


@pytest.mark.slow
def test_inner_update_j_uses_mask_j():
    """A negligible learning rate keeps the params at their start-of-batch values, so inner
    update j's logp_new on z_j equals logp_old_j and every ratio is 1 (to bf16 rounding of two
    compiled programs); pairing z_j with another mask's logp_old moves the ratios far from 1."""
    phases, state, rollout, batch, keys, scored = _scored("float8_e4m3fn")

    def update(logp_old):
        b = train.Batch(
            prompt_tokens=scored.prompt_tokens,
            prompt_mask=batch[1],
            tokens=batch[2],
            mask=batch[3],
            logp_rollout=scored.logp_rollout,
            logp_old=logp_old,
            advantages=jnp.asarray([1.0, -1.0, 0.5, -0.5] * 2),
        )
        cfg = _cfg("optim.learning_rate=1e-20")
        mesh = shd.make_mesh(cfg.mesh)
        fn = train.make_phases(mesh, cfg, CONFIG, estimator=dt.ESTIMATOR).update
        copy = jax.tree.map(jnp.copy, state)  # the update donates its state
        return jax.device_get(fn(copy, b, jax.random.key(0))[1])

    paired = update(scored.logp_old)
    assert abs(paired["loss/ratio_mean"] - 1.0) < 1e-3, paired["loss/ratio_mean"]
    assert paired["loss/clip_frac_low"] == paired["loss/clip_frac_high"] == 0.0
    shifted = update(jnp.roll(scored.logp_old, 1, axis=1))  # z_j with logp_old_{j-1}
    assert abs(shifted["loss/ratio_mean"] - 1.0) > 1e-2, shifted["loss/ratio_mean"]
    assert paired["ais/mismatch"] > 0  # the FP8 mismatch reached the correction


# ---- end to end ---------------------------------------------------------------------------------


class _Stop(Exception):
    pass


def _rows(out: Path) -> list[dict]:
    strip = lambda r: {k: v for k, v in r.items() if not k.startswith("time/")}  # noqa: E731
    return [strip(r) for r in read_metrics(out / "metrics.jsonl")]


def _final_params(out: Path):
    run = job.make_run(load_config(out / "config.yaml"), out)
    _, restored, _ = run.checkpointer.restore(run.checkpoint_template())
    return jax.device_get(restored["train"])


@pytest.mark.slow
def test_train_from_the_command_line_and_resume_bitwise(tmp_path, capsys):
    argv = ["train", "--config", str(LLADA_TINY), *[a for s in TINY for a in ("--set", s)]]
    whole = tmp_path / "whole"
    assert main([*argv, "--out", str(whole), "--no-progress"]) == 0
    files = {p.name for p in whole.iterdir()}
    assert {
        "config.yaml",
        "metrics.jsonl",
        "eval.jsonl",
        "summary.json",
        "plots",
        "checkpoints",
    } <= files
    assert any((whole / "plots").iterdir())
    rows = _rows(whole)
    assert [r["step"] for r in rows] == [1, 2]
    for key in ("ais/alpha", "ais/ess_ratio_truncated", "mismatch/mean_abs", "policy/entropy"):
        assert all(np.isfinite(r[key]) for r in rows), key
    assert all(r["mismatch/mean_abs"] > 0 for r in rows)  # FP8 rollouts vs the BF16 trainer
    # not vacuous: rewards differed within groups (parsable but wrong answers score 0.1), so
    # the updates moved the weights that the resumed run has to reproduce
    assert any(r["train/grad_norm"] > 0 for r in rows), rows
    assert load_config(whole / "config.yaml").model.family == "llada"
    assert [r["step"] for r in read_metrics(whole / "eval.jsonl")] == [0, 2]

    # export-hf writes LLaDA's own checkpoint layout, which load_hf reads back
    assert main(["export-hf", "--run", str(whole), "--to", str(tmp_path / "hf")]) == 0
    config, exported = load_hf(tmp_path / "hf", dtype=jnp.float32)
    assert config == CONFIG
    trained = _final_params(whole).params
    for x, y in zip(jax.tree.leaves(trained), jax.tree.leaves(exported), strict=True):
        np.testing.assert_array_equal(np.asarray(y), np.asarray(x))

    # the same run stopped after step 1 (its checkpoint written), then resumed
    stopped = tmp_path / "stopped"

    def stop(row):
        if row["step"] == 1:
            raise _Stop

    with pytest.raises(_Stop):
        job.run_training(_cfg(), stopped, show_progress=False, on_step=stop)
    assert len(_rows(stopped)) == 1
    assert main(["train", "--out", str(stopped), "--resume", "--no-progress"]) == 0
    assert _rows(stopped) == rows
    a, b = _final_params(whole), _final_params(stopped)
    assert int(a.step) == int(b.step) == 2
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(y), np.asarray(x))


def test_a_llada_config_makes_a_run_with_the_diffusion_estimator(tmp_path):
    """`job.make_run` for ``model.family: llada``: the one `Run`, with the LLaDA model of the
    config's shape fitted to the character tokenizer (its ids, and the mask token above them),
    the diffusion estimator and phases built from it; `mask_keys` gives one prompt-mask key per
    inner update (seconds: the fast tier's check; the tests above train such runs)."""
    run = job.make_run(_cfg(), tmp_path / "run")
    assert type(run) is Run and run.model_config == CONFIG
    assert run.estimator is dt.ESTIMATOR and run.phases.estimator is dt.ESTIMATOR
    assert run.tokenizer.eos_ids == (CONFIG.eos_token_id,)
    assert CONFIG.mask_token_id == run.tokenizer.vocab_size == CONFIG.vocab_size - 1
    sample_key, mask_keys = dt.mask_keys(jax.random.key(0), J)
    assert sample_key.shape == () and mask_keys.shape == (J,)


def test_make_phases_refuses_an_estimator_of_another_kind():
    """A LLaDA config with the autoregressive estimator (the default), or a Qwen3 config with
    the diffusion one, is a ValueError naming both kinds and the table to take it from."""
    cfg = _cfg()
    mesh = shd.make_mesh(cfg.mesh)
    with pytest.raises(ValueError, match="diffusion model .* autoregressive estimator.*ESTIMATORS"):
        train.make_phases(mesh, cfg, CONFIG)
    qwen3 = ModelConfig.preset("tiny")
    with pytest.raises(ValueError, match="autoregressive model .* diffusion estimator"):
        train.make_phases(mesh, TrainConfig(), qwen3, estimator=dt.ESTIMATOR)


def test_sudoku_is_one_setting_away():
    cfg = _cfg(
        "task.name=sudoku",
        "task.options={n_blank: 4}",
        "rollout.max_new_tokens=20",
        "rollout.diffusion.block_length=10",
        "rollout.max_prompt_len=24",
    )
    task = make_task(cfg.task.name, **cfg.task.options)
    ex = task.sample(random.Random(0))
    assert task.reward(ex, ex.demonstration) == 1.0
    assert len(ex.demonstration) + 1 <= cfg.rollout.max_new_tokens  # + EOS
    assert len(ex.prompt) + 1 <= cfg.rollout.max_prompt_len  # + BOS


@pytest.mark.slow
def test_compare_two_arms_of_the_diffusion_model(tmp_path, capsys):
    """``ais-jax compare`` on configs/llada_tiny.yaml: 2 arms, 1 seed, 2 steps (the phases of
    the run above serve it: only the bf16 score and the uncorrected update compile)."""
    out = tmp_path / "compare"
    argv = ["compare", "--config", str(LLADA_TINY), *[a for s in TINY for a in ("--set", s)]]
    argv += ["--arms", "bf16,fp8", "--seeds", "1", "--out", str(out), "--no-progress"]
    assert main(argv) == 0
    table = capsys.readouterr().out
    assert "bf16" in table and "fp8" in table
    results = json.loads((out / "results.json").read_text())
    assert [a["name"] for a in results["arms"]] == ["bf16", "fp8"]
    bf16 = _rows(out / "bf16" / "seed0")
    fp8 = _rows(out / "fp8" / "seed0")
    assert len(bf16) == len(fp8) == 2
    # a BF16 rollout is the trainer's policy exactly: no mismatch; an FP8 one has some
    assert all(r["mismatch/mean_abs"] == 0.0 and r["ais/ess_ratio_truncated"] == 1.0 for r in bf16)
    assert all(r["mismatch/mean_abs"] > 0 for r in fp8)
    start = {
        json.loads((out / a / "seed0" / "start.json").read_text())["sha256"]
        for a in ("bf16", "fp8")
    }
    assert len(start) == 1  # one SFT start for both arms
