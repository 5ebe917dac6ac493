"""Tabulate and draw `ais-jax train` runs of one start in different arms (here SmolLM2-135M with
an FP8 + AIS and a BF16 rollout): held-out accuracy at start and end, reward, mismatch, ESS and
alpha over training, seconds per step, and the paired difference of the arms over prompts.

    ais-jax train --config configs/smollm2_arithmetic.yaml --out runs/fp8ais
    ais-jax train --config configs/smollm2_arithmetic.yaml --out runs/bf16 \\
        --set rollout.format=bf16 --set correction.method=none
    for r in runs/fp8ais runs/bf16; do ais-jax eval --run $r --k 4; done
    ais-jax eval --run runs/bf16 --step 0 --k 4
    python docs/results/smollm2_grpo/arms.py runs/fp8ais runs/bf16 [--plot curves.png]

Prints markdown. The paired difference is over the held-out prompts (each arm's greedy answer
to the same prompt, from ``RUN/eval/step<N>-heldout-k4-*.jsonl``): it measures how sure the
difference is on these prompts, not across RL seeds, which one run per arm cannot tell.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from ais_jax.analysis import stats
from ais_jax.analysis.plots import read_metrics
from ais_jax.io.run_log import PHASES

WINDOW = 10  # "first" and "last": means over the first and last ten steps
CURVES = (  # metrics.jsonl key, what it is
    ("reward/mean", "reward (mean over the step's rollouts)"),
    ("mismatch/ess_ratio_raw", "token ESS / n (rollout vs trainer)"),
    ("mismatch/seq_ess_ratio_raw", "sequence ESS / n"),
    ("ais/alpha", "AIS alpha"),
)


def _greedy(run: Path, step: int) -> np.ndarray:
    """Per-prompt greedy correctness of ``ais-jax eval --run RUN [--step N] --k 4``."""
    (path,) = (run / "eval").glob(f"step{step}-heldout-k4-*.jsonl")
    rows = read_metrics(path)
    return np.array([r["greedy"]["correct"] for r in sorted(rows, key=lambda r: r["index"])], float)


def table(runs: list[Path]) -> str:
    lines = [
        "| arm | greedy at start -> end | sampled at start -> end | reward first -> last 10"
        " | token ESS first -> last 10 | seq ESS first -> last 10 | mean \\|d\\| | alpha"
        " | entropy first -> last 10 | s/step (median) | steps |",
        "|---" * 11 + "|",
    ]
    for run in runs:
        s = json.loads((run / "summary.json").read_text())
        rows = read_metrics(run / "metrics.jsonl")

        def first_last(key, rows=rows):
            v = np.array([r[key] for r in rows])
            return f"{v[:WINDOW].mean():.3f} -> {v[-WINDOW:].mean():.3f}"

        step_s = [sum(r[f"time/{p}_s"] for p in PHASES) for r in rows]
        lines.append(
            f"| {run.name} | {s['initial/eval/accuracy']:.1%} -> {s['eval/accuracy']:.1%}"
            f" | {s['initial/eval/sampled_accuracy']:.1%} -> {s['eval/sampled_accuracy']:.1%}"
            f" | {first_last('reward/mean')} | {first_last('mismatch/ess_ratio_raw')}"
            f" | {first_last('mismatch/seq_ess_ratio_raw')}"
            f" | {np.mean([r['mismatch/mean_abs'] for r in rows]):.4f}"
            f" | {np.mean([r['ais/alpha'] for r in rows]):.2f}"
            f" | {first_last('policy/entropy')} | {np.median(step_s[1:]):.1f}"
            f" | {s['steps']} |"
        )
    return "\n".join(lines)


def paired(runs: list[Path]) -> str:
    """Each later arm's greedy correctness minus the first arm's, and each end minus the
    start, over the same held-out prompts."""
    end = {run.name: _greedy(run, len(read_metrics(run / "metrics.jsonl"))) for run in runs}
    start = _greedy(runs[-1], 0)  # one start for all arms
    lines = ["| difference (greedy, over the held-out prompts) | mean | 95% CI | prompts |"]
    lines.append("|---|---|---|---|")
    pairs = [(f"{run.name} end - start", end[run.name], start) for run in runs]
    pairs += [(f"{r.name} - {runs[0].name}", end[r.name], end[runs[0].name]) for r in runs[1:]]
    for name, a, b in pairs:
        d = stats.paired_difference(a, b)
        lines.append(
            f"| {name} | {100 * d.mean:+.1f} | [{100 * d.low:+.1f}, {100 * d.high:+.1f}] | {d.n} |"
        )
    return "\n".join(lines)


def plot(runs: list[Path], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(10, 7), constrained_layout=True)
    for ax, (key, title) in zip(axes.flat, CURVES, strict=True):
        for run in runs:
            rows = read_metrics(run / "metrics.jsonl")
            ax.plot([r["step"] for r in rows], [r[key] for r in rows], label=run.name)
        ax.set_title(title)
        ax.set_xlabel("GRPO step")
        ax.grid(alpha=0.3)
    axes.flat[0].legend()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path)
    parser.add_argument("--plot", type=Path)
    a = parser.parse_args()
    print(table(a.runs), "", paired(a.runs), sep="\n")
    prov = json.loads((a.runs[0] / "summary.json").read_text())["provenance"]
    print(f"\njax {prov['versions']['jax']}, {prov['cpu']}, commit {prov['commit']}")
    if a.plot:
        plot(a.runs, a.plot)


if __name__ == "__main__":
    main()
