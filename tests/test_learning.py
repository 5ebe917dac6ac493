"""The central claim, at test scale: the default job's GRPO phase learns.

The embedded quickstart (`ais-jax train` with no config), shortened: a 1,500-step warm start on
the careless teacher's demonstrations, then 30 GRPO steps with FP8 rollouts and AIS. The
held-out prompts are fixed (the first 256 of the seed-independent eval stream, which no
training stream ever draws), so the start and end accuracies are paired on the same prompts.
The full default gains about 20 points, most of it in its first 50 steps (README, "The main
job"; measured for this shortened job: 52.3% at the start, 74.2% after 15 steps, 77.7% after
30); the shortened one must gain at least 8, far outside what 256 paired prompts move by chance
(a net change of 21 prompts).

The job runs as the README's first command does (the installed `ais-jax` script), compiled with
XLA's default compile options (`conftest.default_compile_env`): its 1,500 warm-start steps
are run time, not compile time.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from conftest import default_compile_env

from ais_jax.config import load_config

SHORTENED = [
    "sft.steps=1500",
    "steps=30",
    "eval_every=15",
    "checkpoint_every=30",
    "task.eval_examples=256",
]


def test_default_job_raises_greedy_held_out_accuracy(tmp_path):
    out = tmp_path / "run"
    overrides = [arg for setting in SHORTENED for arg in ("--set", setting)]
    script = Path(sys.executable).parent / "ais-jax"
    proc = subprocess.run(
        [str(script), "train", *overrides, "--out", str(out), "--no-progress"],
        env=default_compile_env(),
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    cfg = load_config(out / "config.yaml")  # the run's own record of what it ran
    assert cfg.rollout.format == "float8_e4m3fn" and cfg.correction.method == "ais"
    summary = json.loads((out / "summary.json").read_text())
    start, end = summary["initial/eval/accuracy"], summary["eval/accuracy"]
    assert summary["eval/examples"] == summary["initial/eval/examples"] == 256
    assert end - start >= 0.08, (start, end)
    # the accuracy curve is on disk: step 0 (the start), every eval_every steps, and the end
    rows = [json.loads(line) for line in (out / "eval.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 15, 30]
    assert rows[0]["eval/accuracy"] == start and rows[-1]["eval/accuracy"] == end
    assert summary["provenance"]["versions"]["jax"]
