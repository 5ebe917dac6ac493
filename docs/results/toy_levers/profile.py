"""The FP8 mismatch a run trained under, from its metrics.jsonl: means over its RL steps.

    python docs/results/toy_levers/profile.py RUN_DIR [RUN_DIR ...]

One row per run (held-out greedy accuracy at start and end, from eval.jsonl; entropy; mean
|d|; k3; chi2 = 1 / ESS - 1 per step from the untruncated token ESS ratio; that ESS; the
sequence ESS ratio; the largest ratio of any step), then the mean over the runs. These are
the columns of docs/results.md's "Toward the paper's regime" table.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from ais_jax.analysis.plots import read_metrics

COLUMNS = ("start %", "end %", "entropy", "mean|d|", "k3", "chi2", "token ESS", "seq ESS", "max r")


def profile(run: Path) -> tuple[float, ...]:
    rows, evals = read_metrics(run / "metrics.jsonl"), read_metrics(run / "eval.jsonl")
    mean = lambda key: float(np.mean([r[key] for r in rows]))  # noqa: E731
    chi2 = float(np.mean([1 / r["mismatch/ess_ratio_raw"] - 1 for r in rows]))
    return (
        100 * evals[0]["eval/accuracy"],
        100 * evals[-1]["eval/accuracy"],
        mean("policy/entropy"),
        mean("mismatch/mean_abs"),
        mean("mismatch/k3"),
        chi2,
        mean("mismatch/ess_ratio_raw"),
        mean("mismatch/seq_ess_ratio_raw"),
        max(r["mismatch/ratio_max"] for r in rows),
    )


def main(runs: list[str]) -> str:
    table = [profile(Path(run)) for run in runs]
    fmt = ("{:.1f}", "{:.1f}", "{:.3f}", "{:.4f}", "{:.5f}", "{:.4f}", "{:.4f}", "{:.3f}", "{:.1f}")

    def row(name: str, values) -> str:
        cells = (f.format(v) for f, v in zip(fmt, values, strict=True))
        return f"| {name} | " + " | ".join(cells) + " |"

    lines = ["| run | " + " | ".join(COLUMNS) + " |", "|---" * (len(COLUMNS) + 1) + "|"]
    lines += [row(run, values) for run, values in zip(runs, table, strict=True)]
    if len(table) > 1:
        lines.append(row("mean", np.mean(table, axis=0)))
    return "\n".join(lines)


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    print(main(sys.argv[1:]))
