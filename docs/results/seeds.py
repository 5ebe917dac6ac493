"""Tabulate `ais-jax train` runs of several seeds: held-out greedy accuracy before and after RL.

    for s in 0 1 2 3 4; do ais-jax train --set seed=$s --out runs/quickstart-seed$s; done
    python docs/results/seeds.py runs/quickstart-seed* [--plot docs/results/quickstart.png]

Prints a markdown table (one row per run, from its summary.json and eval.jsonl), the mean and
standard deviation of the start accuracy, the mean gain with its 95% t-interval, and the
versions and CPU the first run recorded and every run's commit.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

from ais_jax.analysis import stats


def main(run_dirs: list[str]) -> str:
    rows, starts, ends = [], [], []
    for d in map(Path, run_dirs):
        summary = json.loads((d / "summary.json").read_text())
        curve = [json.loads(line) for line in (d / "eval.jsonl").read_text().splitlines()]
        start, end = summary["initial/eval/accuracy"], summary["eval/accuracy"]
        starts.append(start)
        ends.append(end)
        seed = summary.get("seed", d.name)
        points = ", ".join(f"{100 * r['eval/accuracy']:.1f}" for r in curve)
        rows.append(
            f"| {seed} | {100 * start:.1f} | {100 * end:.1f} | {100 * (end - start):+.1f} "
            f"| {100 * summary['initial/eval/sampled_accuracy']:.1f} → "
            f"{100 * summary['eval/sampled_accuracy']:.1f} | {points} |"
        )
    gain = stats.paired_difference(ends, starts)
    provs = [json.loads((Path(d) / "summary.json").read_text())["provenance"] for d in run_dirs]
    prov, v = provs[0], provs[0]["versions"]
    commits = ", ".join(sorted({str(p["commit"])[:10] for p in provs}))
    return "\n".join(
        [
            "| run | start greedy % | end greedy % | gain (points) | sampled % start → end "
            "| greedy % at each evaluation |",
            "|---|---|---|---|---|---|",
            *rows,
            "",
            f"Start: mean {100 * np.mean(starts):.1f}%, std {100 * np.std(starts, ddof=1):.1f} "
            f"points. Gain: mean {100 * gain.mean:+.1f} points, 95% t-interval "
            f"[{100 * gain.low:+.1f}, {100 * gain.high:+.1f}], smallest "
            f"{100 * min(np.subtract(ends, starts)):+.1f} ({len(starts)} runs).",
            f"jax {v['jax']}, jaxlib {v['jaxlib']}, commit(s) {commits}, CPU {prov['cpu']}.",
        ]
    )


def plot(run_dirs: list[str], out_file: str) -> None:
    """Held-out greedy and sampled accuracy over GRPO steps, every run a thin line."""
    from ais_jax.analysis.plots import plot_arm_curves, read_metrics

    curves = [read_metrics(Path(d) / "eval.jsonl") for d in run_dirs]
    plot_arm_curves(
        {f"quickstart ({len(curves)} seeds)": curves},
        ["eval/accuracy", "eval/sampled_accuracy"],
        out_file,
        seed_lines=True,
        marker="o",
        titles={
            "eval/accuracy": "held-out accuracy, greedy",
            "eval/sampled_accuracy": "held-out accuracy, one sample",
        },
        xlabel="GRPO step",
    )


if __name__ == "__main__":
    args = sys.argv[1:]
    if "--plot" in args:
        i = args.index("--plot")
        plot(args[:i] + args[i + 2 :], args[i + 1])
        args = args[:i] + args[i + 2 :]
    print(main(args))
