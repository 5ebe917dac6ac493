"""The scripts under docs/results/ that turn committed runs into the record's tables."""

from __future__ import annotations

import json
import runpy
from pathlib import Path

import numpy as np

RESULTS = Path(__file__).resolve().parents[1] / "docs" / "results"


def test_smollm2_arms_table_is_the_committed_runs():
    """arms.py's rows and paired differences come from each run's own files: the start and end
    accuracy of summary.json (a swapped arm or field fails), and the greedy difference over the
    same held-out prompts, recomputed here from the per-prompt rows."""
    arms = runpy.run_path(str(RESULTS / "smollm2_grpo" / "arms.py"))
    runs = [RESULTS / "smollm2_grpo" / "fp8ais", RESULTS / "smollm2_grpo" / "bf16"]
    table = arms["table"](runs)
    for run in runs:
        s = json.loads((run / "summary.json").read_text())
        assert (
            f"| {run.name} | {s['initial/eval/accuracy']:.1%} -> {s['eval/accuracy']:.1%}" in table
        )

    def greedy(run, step):
        (path,) = (run / "eval").glob(f"step{step}-heldout-k4-*.jsonl")
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        return {r["index"]: float(r["greedy"]["correct"]) for r in rows}

    a, b = greedy(runs[1], 40), greedy(runs[0], 40)
    d = np.array([a[i] - b[i] for i in sorted(a)])
    half = 1.969 * d.std(ddof=1) / np.sqrt(d.size)  # t quantile, 255 degrees of freedom
    row = f"| bf16 - fp8ais | {100 * d.mean():+.1f} | [{100 * (d.mean() - half):+.1f}, "
    assert row in arms["paired"](runs)
    assert d.size == 256 and d.std() > 0  # the arms differ on some prompts
