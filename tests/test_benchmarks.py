"""The benchmarks' shared plumbing still fits together (no timing is tested here).

`benchmarks/grpo_step.py` writes its checkpoint through `benchmarks/sampler.py`'s writer,
which session 7 changed to take a JSON shape; the step benchmark then failed before timing
anything. Here its checkpoint worker writes the tiny size and `load_hf` reads exactly that
shape back. Its report compares every row with the faster of its peers (TRL, tunix), each
peer's "step + score" adding the peer's own timed scoring pass.
"""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

from ais_jax.hf import load_hf

BENCHMARKS = Path(__file__).parent.parent / "benchmarks"


def _module(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_grpo_step_writes_the_checkpoint_it_times(tmp_path):
    grpo_step = _module("grpo_step")
    made = grpo_step.worker_ckpt(argparse.Namespace(size="tiny", seed=0, ckpt=str(tmp_path)))
    assert "error" not in made, made
    config, _ = load_hf(tmp_path)
    shape = grpo_step._sampler_bench().SIZES["tiny"]
    assert {k: getattr(config, k) for k in shape} == shape


def test_grpo_step_report_compares_with_the_faster_peer(capsys):
    grpo_step = _module("grpo_step")
    row = dict(rollout=0.5, score=0.25, update=1.0, peak_gib=1.0, cpu=2.0, steps_s=[1.0])
    results = {
        "ais_jax-bf16": row | {"step": 1.5, "score": 0.0, "version": "a"},
        "trl": row | {"step": 4.5, "version": "t"},
        "tunix": row | {"step": 3.0, "score": 0.5, "version": "x"},
        "ais_jax-fp8": {"error": "boom"},
    }
    grpo_step.report("tiny", results)
    lines = {
        line.split()[1]: line
        for line in capsys.readouterr().out.splitlines()
        if line.startswith("| ")
    }
    assert "2.00x" in lines["ais_jax-bf16"]  # tunix's 3.0 s over 1.5 s, not TRL's 4.5 s
    assert "4.75" in lines["trl"] and "3.50" in lines["tunix"]  # step + its own score pass
    assert "0.67x" in lines["trl"] and "error" in lines["ais_jax-fp8"]


def test_grpo_step_rounds_report_each_round_and_the_median(capsys):
    grpo_step = _module("grpo_step")
    row = dict(score=0.0, update=1.0, peak_gib=1.0, cpu=2.0, steps_s=[1.0], version="v")

    def round_(ais_step, ais_rollout, trl_step, trl_rollout):
        return {
            "ais_jax-bf16": row | {"step": ais_step, "rollout": ais_rollout},
            "trl": row | {"step": trl_step, "rollout": trl_rollout},
            "tunix": row | {"step": 9.0, "rollout": 9.0},
        }

    rounds = [round_(1.0, 0.5, 2.0, 1.0), round_(2.0, 0.5, 3.0, 0.5), round_(1.0, 1.0, 1.5, 1.5)]
    grpo_step.report_rounds("tiny", rounds)
    rows = [line.split("|")[1:-1] for line in capsys.readouterr().out.splitlines()]
    rows = {cells[0].strip(): [c.strip() for c in cells[1:]] for cells in rows if cells}
    assert rows["1"] == ["2.00x", "2.00x"]  # TRL (the faster peer) 2.0 s / 1.0 s; 1.0 / 0.5
    assert rows["2"] == ["1.50x", "1.00x"]
    assert rows["3"] == ["1.50x", "1.50x"]
    assert rows["median"] == ["1.50x", "1.50x"]
