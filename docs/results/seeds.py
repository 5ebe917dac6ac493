"""Tabulate `ais-jax train` runs of several seeds: held-out greedy accuracy before and after RL.

    for s in 0 1 2 3 4; do ais-jax train --set seed=$s --out runs/quickstart-seed$s; done
    python docs/results/seeds.py runs/quickstart-seed*

Prints a markdown table (one row per run, from its summary.json and eval.jsonl), the mean and
standard deviation of the start accuracy, the mean gain with its 95% t-interval, and the
versions, commit and CPU the first run recorded.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

from ais_jax import stats


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
    prov = json.loads((Path(run_dirs[0]) / "summary.json").read_text())["provenance"]
    v = prov["versions"]
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
            f"jax {v['jax']}, jaxlib {v['jaxlib']}, commit {prov['commit']}, CPU {prov['cpu']}.",
        ]
    )


if __name__ == "__main__":
    print(main(sys.argv[1:]))
