"""The paper's four-arm comparison (Table 1 of SPEC.md section 5) at any scale.

Arms, all on the same task, budget and seeds:

    bf16        BF16 rollout, no correction       (the reference the others try to match)
    <fmt>       low-precision rollout, uncorrected (the "FP8 rollout" baseline)
    <fmt>+tis   low-precision rollout, truncated IS (fixed cap C)
    <fmt>+ais   low-precision rollout, AIS

``<fmt>`` is the config's ``rollout.format`` (float8_e4m3fn by default; float4_e2m1fn or an FP6
format make the mismatch material at toy scale). Each seed's SFT warm start is run once and
shared by its arms, so arms differ only in the RL phase. The result is a markdown table of
held-out accuracy of the final BF16 policy (mean +- std over seeds) beside each arm's measured
mismatch and ESS, and plots of reward, ESS and mismatch over steps per arm.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np

from ais_jax.config import TrainConfig, dump_config
from ais_jax.plots import plot_arms, read_metrics


def arms_for(cfg: TrainConfig) -> dict[str, TrainConfig]:
    fmt = "float8_e4m3fn" if cfg.rollout.format == "bf16" else cfg.rollout.format
    short = fmt.replace("float", "fp").split("_")[0] if fmt != "float8_e4m3fn" else "fp8"

    def arm(format_: str, method: str) -> TrainConfig:
        return dataclasses.replace(
            cfg,
            rollout=dataclasses.replace(cfg.rollout, format=format_),
            correction=dataclasses.replace(cfg.correction, method=method),
        )

    return {
        "bf16": arm("bf16", "none"),
        short: arm(fmt, "none"),
        f"{short}+tis": arm(fmt, "tis"),
        f"{short}+ais": arm(fmt, "ais"),
    }


def run_comparison(
    cfg: TrainConfig,
    out: str | Path,
    *,
    seeds: int = 3,
    arms: str | None = None,
    show_progress: bool = True,
) -> str:
    """Run every arm for ``seeds`` seeds under ``out``; write and return the markdown table."""
    from ais_jax.runner import Run, run_training

    if seeds < 1:
        raise ValueError(f"--seeds must be >= 1, got {seeds}.")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    all_arms = arms_for(cfg)
    chosen = list(all_arms) if arms is None else [a.strip() for a in arms.split(",")]
    unknown = [a for a in chosen if a not in all_arms]
    if unknown:
        raise ValueError(f"Unknown arm(s) {unknown}; arms of this config: {list(all_arms)}.")
    (out / "config.yaml").write_text(dump_config(cfg))
    results: dict[str, list[dict]] = {a: [] for a in chosen}
    curves: dict[str, list[list[dict]]] = {a: [] for a in chosen}
    for seed in range(cfg.seed, cfg.seed + seeds):
        warm = Run(dataclasses.replace(cfg, seed=seed), out / f"sft-seed{seed}")
        warm.sft()
        for name in chosen:
            arm_cfg = dataclasses.replace(all_arms[name], seed=seed)
            run_dir = out / name.replace("+", "_") / f"seed{seed}"
            summary = run_training(
                arm_cfg, run_dir, show_progress=show_progress, initial_params=warm.state.params
            )
            results[name].append(summary)
            curves[name].append(read_metrics(run_dir / "metrics.jsonl"))
    table = format_table(cfg, results, curves)
    (out / "results.md").write_text(table + "\n")
    (out / "results.json").write_text(
        json.dumps({a: {"summaries": results[a]} for a in chosen}, indent=2)
    )
    plot_arms(
        curves, ["reward/mean", "ais/ess_ratio", "ais/mismatch", "ais/alpha"], out / "arms.png"
    )
    return table


def _mean_std(values: list[float], scale: float = 1.0, digits: int = 1) -> str:
    v = np.asarray(values, float) * scale
    return f"{v.mean():.{digits}f} ± {v.std():.{digits}f}" if len(v) > 1 else f"{v[0]:.{digits}f}"


def format_table(
    cfg: TrainConfig, results: dict[str, list[dict]], curves: dict[str, list[list[dict]]]
) -> str:
    n = len(next(iter(results.values())))
    lines = [
        f"Task `{cfg.task.name}` {cfg.task.options or ''}, {cfg.steps} RL steps, "
        f"{cfg.rollout.prompts_per_step}x{cfg.rollout.group_size} rollouts/step, "
        f"max_new_tokens {cfg.rollout.max_new_tokens}, {n} seed(s); held-out accuracy "
        f"(greedy, BF16 policy, {cfg.task.eval_examples} prompts never trained on).",
        "",
        "| arm | held-out acc. % (greedy) | sampled acc. % | start acc. % greedy / sampled "
        "| reward first→last 10 steps | mean abs dlogp | ESS ratio mean (min) | alpha (mean) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for arm, summaries in results.items():
        rows = [r for seed_rows in curves[arm] for r in seed_rows]
        first = np.mean([np.mean([r["reward/mean"] for r in c[:10]]) for c in curves[arm]])
        last = np.mean([np.mean([r["reward/mean"] for r in c[-10:]]) for c in curves[arm]])
        lines.append(
            f"| {arm} | {_mean_std([s['eval/accuracy'] for s in summaries], 100)} "
            f"| {_mean_std([s['eval/sampled_accuracy'] for s in summaries], 100)} "
            f"| {_mean_std([s['initial/eval/accuracy'] for s in summaries], 100)} / "
            f"{_mean_std([s['initial/eval/sampled_accuracy'] for s in summaries], 100)} "
            f"| {first:.3f}→{last:.3f} "
            f"| {np.mean([r['ais/mismatch'] for r in rows]):.4f} "
            f"| {np.mean([r['ais/ess_ratio'] for r in rows]):.4f} "
            f"({np.min([r['ais/ess_ratio'] for r in rows]):.4f}) "
            f"| {np.mean([r['ais/alpha'] for r in rows]):.3f} |"
        )
    return "\n".join(lines)
