"""Is low-precision rollout more harmful late in training? Two comparisons, same arms and seeds:

    ais-jax compare --config configs/compare.yaml --seeds 5 --out runs/early \\
        --arms bf16,fp8,fp4,fp4+tis,fp4+ais,fp4+mis                 # from the SFT warm start
    ais-jax compare --config configs/compare.yaml --seeds 5 --out runs/late \\
        --arms bf16,fp8,fp4,fp4+tis,fp4+ais --start runs/early/bf16/seed0@150
    python docs/results/early_late.py runs/early runs/late

For every arm found in both, the harm of the arm is its final greedy accuracy minus the
reference arm's (bf16) on the same RL seed; this prints the harm from each start with its 95%
t-interval and the per-seed change of the harm from the early to the late start (late harm
minus early harm, paired by RL seed: same prompt order and rollout keys), with its interval,
the mean ESS, mismatch and entropy of each arm from each start, and paired contrasts between
the FP4 corrections from each start.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from ais_jax.analysis import stats


def _ci(e: stats.Estimate) -> str:
    return f"{100 * e.mean:+.1f} [{100 * e.low:+.1f}, {100 * e.high:+.1f}]"


def main(early_dir: str, late_dir: str) -> str:
    early, late = (
        json.loads((Path(d) / "results.json").read_text()) for d in (early_dir, late_dir)
    )
    ref = early["reference"]
    assert late["reference"] == ref and early["seeds"] == late["seeds"], "not the same design"
    arms = [a["name"] for a in early["arms"] if a["name"] in late["runs"] and a["name"] != ref]

    def harm(results, arm):
        return [
            a["final/accuracy"] - b["final/accuracy"]
            for a, b in zip(results["runs"][arm], results["runs"][ref], strict=True)
        ]

    def mean(results, arm, key):
        return sum(r[key] for r in results["runs"][arm]) / len(results["runs"][arm])

    lines = [
        f"| arm | harm from the early start (points vs {ref}) | harm from the late start "
        "| late − early | ESS early / late | mismatch early / late | entropy early / late |",
        "|---|---|---|---|---|---|---|",
    ]
    for arm in [ref, *arms]:
        if arm == ref:
            cells = ["reference", "reference", "—"]
        else:
            h_early, h_late = harm(early, arm), harm(late, arm)
            cells = [
                _ci(stats.mean_ci(h_early)),
                _ci(stats.mean_ci(h_late)),
                _ci(stats.paired_difference(h_late, h_early)),
            ]
        lines.append(
            f"| {arm} | "
            + " | ".join(cells)
            + " | "
            + " | ".join(
                f"{mean(early, arm, k):.{d}f} / {mean(late, arm, k):.{d}f}"
                for k, d in (("ess/mean", 4), ("mismatch/mean", 4), ("entropy/mean", 3))
            )
            + " |"
        )
    pairs = [("fp4+ais", "fp4+tis"), ("fp4+ais", "fp4"), ("fp4+tis", "fp4"), ("fp4+mis", "fp4")]
    lines += [
        "",
        "| contrast (final greedy, points) | early start | late start |",
        "|---|---|---|",
    ]
    for a, b in pairs:
        cells = []
        for results in (early, late):
            runs = results["runs"]
            if a in runs and b in runs:
                cells.append(
                    _ci(
                        stats.paired_difference(
                            [r["final/accuracy"] for r in runs[a]],
                            [r["final/accuracy"] for r in runs[b]],
                        )
                    )
                )
            else:
                cells.append("not run")
        lines.append(f"| {a} − {b} | {cells[0]} | {cells[1]} |")
    starts = [
        f"{name}: {100 * r['runs'][ref][0]['start/accuracy']:.1f}%"
        for name, r in (("early", early), ("late", late))
    ]
    lines += ["", f"Start accuracy (greedy) — {', '.join(starts)}; seeds {early['seeds']}."]
    return "\n".join(lines)


if __name__ == "__main__":
    print(main(*sys.argv[1:3]))
