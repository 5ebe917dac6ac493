"""The central claim, at test scale: the default job's GRPO phase learns.

The embedded quickstart (`ais-jax train` with no arguments), shortened: a 1,500-step warm start
on the careless teacher's demonstrations, then 60 GRPO steps with FP8 rollouts and AIS. The
held-out prompts are fixed (the first 256 of the seed-independent eval stream, which no
training stream ever draws), so the start and end accuracies are paired on the same prompts.
The full default gains about 20 points in its first 100 steps (README, "The main job"); the
shortened one must gain at least 8, far outside what 256 paired prompts move by chance (a
net change of 21 prompts).
"""

from __future__ import annotations

import json

from ais_jax.cli import default_config_path
from ais_jax.config import load_config
from ais_jax.job import run_training

SHORTENED = [
    "sft.steps=1500",
    "steps=60",
    "eval_every=30",
    "checkpoint_every=60",
    "task.eval_examples=256",
]


def test_default_job_raises_greedy_held_out_accuracy(tmp_path):
    cfg = load_config(default_config_path(), SHORTENED)
    assert cfg.rollout.format == "float8_e4m3fn" and cfg.correction.method == "ais"
    summary = run_training(cfg, tmp_path, show_progress=False)
    start, end = summary["initial/eval/accuracy"], summary["eval/accuracy"]
    assert summary["eval/examples"] == summary["initial/eval/examples"] == 256
    assert end - start >= 0.08, (start, end)
    # the accuracy curve is on disk: step 0 (the start), every eval_every steps, and the end
    rows = [json.loads(line) for line in (tmp_path / "eval.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 30, 60]
    assert rows[0]["eval/accuracy"] == start and rows[-1]["eval/accuracy"] == end
    assert summary["provenance"]["versions"]["jax"]
