"""Seconds per whole tunix GRPO step, with and without `ais_jax.integrations.tunix`, side by side.

One workload for every arm (issue 50): a random tunix Qwen3 (`tunix.models.qwen3`, float32
params and compute, the benchmarks' ``tiny`` shape: 4 layers, hidden 128, vocabulary 512, or
``small``: 8 layers, hidden 512, vocabulary 32,000), 16 prompts x 8 answers = 128 rollouts,
prompts of 32 random ids, exactly 64 new tokens per row (no end-of-sequence id is ever
sampled), full-vocabulary sampling at T = 1, one iteration, no KL, AdamW at 1e-5, a cheap host
reward (the parity of the completion's length). Arms, each in its own subprocess:

- ``tunix``: tunix's own `GRPOLearner`, ``"grpo"`` loss, its vanilla rollout on the actor's
  weights (no weight sync), no rollout log-probs;
- ``tunix+ais``: `ais_tunix.GRPOLearner` (AIS, ``"grpo_ais"``), the same vanilla rollout
  returning its log-probs: what the correction and the learner's plumbing add;
- ``tunix+ais_jax-bf16``, ``tunix+ais_jax-fp8``: the AIS learner sampling with `ais_tunix.Rollout`
  (ais_jax's sampler on a BF16 / FP8 copy, re-made at every step's weight sync).

A step is timed from the end of the previous one to the end of its weight sync (or of its
update where there is none): data, rollout, rewards, the update and the sync. ``--warmup`` steps
(compiles) are dropped, the median of ``--steps`` reported with the rollout's own median and the
process's peak resident memory. ``--rounds R`` runs every arm R times, interleaved, and prints
each round's ratios to ``tunix``. The CPU model, jax, tunix and the commit head the table.

    python benchmarks/tunix_ais.py                      # tiny, every arm, one round
    python benchmarks/tunix_ais.py --rounds 2 --steps 5
    python benchmarks/tunix_ais.py --sizes small --arms tunix,tunix+ais_jax-fp8

Needs tunix in this interpreter: the README's test command installs it.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

import common

HERE = Path(__file__).resolve().parent
ARMS = ("tunix", "tunix+ais", "tunix+ais_jax-bf16", "tunix+ais_jax-fp8")
SIZES = common.SIZES
PROMPTS, GROUP, PROMPT_LEN, NEW_TOKENS, LR = 16, 8, 32, 64, 1e-5


def worker(arm: str, size: str, warmup: int, steps: int, seed: int) -> dict:
    import functools
    import importlib.metadata
    import tempfile

    import jax
    import numpy as np
    import optax
    from flax import nnx
    from tunix.models.qwen3 import model as tunix_qwen3
    from tunix.rl import rl_cluster as rl_cluster_lib
    from tunix.rl.grpo import grpo_learner
    from tunix.rl.rollout import base_rollout
    from tunix.sft import metrics_logger

    from ais_jax import init_params
    from ais_jax.integrations import tunix as ais_tunix

    s = SIZES[size]
    config = tunix_qwen3.ModelConfig(
        **common.tunix_shape(s),
        rope_theta=1_000_000,
        norm_eps=1e-6,
        use_tied_embedding=True,
    )
    mesh = jax.make_mesh((1, 1), ("fsdp", "tp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    with jax.set_mesh(mesh):
        model = tunix_qwen3.Qwen3(config, rngs=nnx.Rngs(seed))
    c = ais_tunix.model_config(config)  # ais_jax's random init, written into tunix's model
    weights = ais_tunix.params_to_tunix(init_params(c, jax.random.key(seed)), c)
    nnx.update(model, nnx.from_flat_state(weights))

    ours = arm != "tunix"
    engine = "vanilla"
    if arm.startswith("tunix+ais_jax-"):
        fmt = {"bf16": "bf16", "fp8": "float8_e4m3fn"}[arm.rsplit("-", 1)[1]]
        engine = functools.partial(ais_tunix.Rollout, format=fmt, seed=seed)
    n = warmup + steps
    ids = common.prompt_ids(s["vocab_size"], (n, PROMPTS, PROMPT_LEN), seed)
    data = [{"prompts": np.array([" ".join(map(str, row)) for row in step])} for step in ids]
    cluster = rl_cluster_lib.RLCluster(
        actor=model,
        tokenizer=common.IdsTokenizer(),
        cluster_config=rl_cluster_lib.ClusterConfig(
            role_to_mesh={r: mesh for r in rl_cluster_lib.Role},
            rollout_engine=engine,
            training_config=rl_cluster_lib.RLTrainingConfig(
                actor_optimizer=optax.adamw(LR, weight_decay=0.0),
                eval_every_n_steps=10**6,
                max_steps=n,
                metrics_logging_options=metrics_logger.MetricsLoggerOptions(
                    log_dir=tempfile.mkdtemp(prefix="tunix_ais_")
                ),
                pbar_description=None,
            ),
            rollout_config=common.tunix_rollout_config(
                base_rollout, PROMPT_LEN, NEW_TOKENS, return_logprobs=ours
            ),
        ),
    )
    reward = lambda prompts, completions, **_: [float(len(c) % 2) for c in completions]  # noqa: E731
    if ours:
        learner = ais_tunix.GRPOLearner(
            rl_cluster=cluster,
            algo_config=ais_tunix.GRPOConfig(num_generations=GROUP, beta=0.0),
            reward_fns=reward,
        )
    else:
        learner = grpo_learner.GRPOLearner(
            rl_cluster=cluster,
            algo_config=grpo_learner.GRPOConfig(num_generations=GROUP, beta=0.0),
            reward_fns=reward,
        )
    ends, rollout_s = [time.perf_counter()], []
    generate, global_step, sync = cluster.generate, learner._run_global_step, cluster.sync_weights

    def timed_generate(*args, **kwargs):
        t0 = time.perf_counter()
        out = generate(*args, **kwargs)
        rollout_s.append(time.perf_counter() - t0)
        assert min(len(t) for t in out.tokens) == NEW_TOKENS, "a row stopped early"
        return out

    def timed_global_step(*args, **kwargs):
        global_step(*args, **kwargs)
        jax.block_until_ready(nnx.state(cluster.actor_trainer.model))
        if not learner.should_sync_weights:
            ends.append(time.perf_counter())

    def timed_sync():
        sync()
        jax.block_until_ready(getattr(cluster.rollout, "params", None))
        ends.append(time.perf_counter())

    cluster.generate, learner._run_global_step, cluster.sync_weights = (
        timed_generate,
        timed_global_step,
        timed_sync,
    )
    learner.train(data)
    step_s = [b - a for a, b in zip(ends, ends[1:], strict=False)]
    assert len(rollout_s) == n, (len(rollout_s), n)
    assert len(step_s) == n, (len(step_s), n)
    history = cluster.actor_trainer.metrics_logger.get_metric_history
    mismatch = float(np.mean(history("actor", "mismatch/mean_abs", "train"))) if ours else None
    return common.medians({"step_s": step_s, "rollout_s": rollout_s}, warmup) | {
        "peak_gib": common.peak_gib(),
        "mismatch": mismatch,
        "versions": f"jax {jax.__version__}, "
        f"google-tunix {importlib.metadata.version('google-tunix')}",
    }


def _commit() -> str:
    out = subprocess.run(
        ["git", "-C", str(HERE), "describe", "--always", "--dirty"], capture_output=True, text=True
    )
    return out.stdout.strip() or "unknown"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="tiny", help=f"comma-separated, of {sorted(SIZES)}")
    p.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated, of {list(ARMS)}")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--worker", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.worker:
        arm, size = a.worker.split("@")
        return common.run_worker(worker, arm, size, a.warmup, a.steps, a.seed)
    arms, sizes = a.arms.split(","), a.sizes.split(",")
    for bad, allowed in ((set(arms) - set(ARMS), ARMS), (set(sizes) - set(SIZES), SIZES)):
        if bad:
            p.error(f"unknown {sorted(bad)}; allowed: {list(allowed)}")
    print(f"{common.host_line()}; commit {_commit()}")
    print(f"{PROMPTS} prompts x {GROUP} = {PROMPTS * GROUP} rows, {PROMPT_LEN} + {NEW_TOKENS} ids")
    for size in sizes:
        rows: dict[str, list[dict]] = {arm: [] for arm in arms}
        for r in range(a.rounds):
            for arm in arms:
                cmd = [sys.executable, __file__, f"--worker={arm}@{size}"]
                cmd += [f"--warmup={a.warmup}", f"--steps={a.steps}", f"--seed={a.seed}"]
                result = common.run_child(cmd, None, timeout=None, verbose=True)
                if "error" in result:  # the worker's stderr tail printed above
                    sys.exit(f"{arm} ({size}) failed: {result['error']}")
                rows[arm].append(result)
            base = rows[arms[0]][r]["step_s"]
            ratios = ", ".join(f"{arm} {rows[arm][r]['step_s'] / base:.2f}x" for arm in arms)
            print(f"[{size}] round {r + 1}: step time / {arms[0]}'s: {ratios}")
        versions = rows[arms[0]][0]["versions"]
        print(f"\n{size}: median of {a.steps} steps after {a.warmup} warm-up; {versions}")
        head = f"{'step s':>9}{'rollout s':>11}{'x ' + arms[0]:>10}{'peak GiB':>10}{'mismatch':>10}"
        print(f"{'arm':<22}{head}")
        for arm in arms:
            step = statistics.median(x["step_s"] for x in rows[arm])
            base = statistics.median(x["step_s"] for x in rows[arms[0]])
            roll = statistics.median(x["rollout_s"] for x in rows[arm])
            peak = max(x["peak_gib"] for x in rows[arm])
            mm = rows[arm][0]["mismatch"]
            mm = "-" if mm is None else f"{mm:.4f}"
            print(f"{arm:<22}{step:>9.3f}{roll:>11.3f}{step / base:>9.2f}x{peak:>10.2f}{mm:>10}")


if __name__ == "__main__":
    main()
