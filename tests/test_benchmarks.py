"""The benchmarks' shared plumbing still fits together (no timing is tested here).

`benchmarks/grpo_step.py` writes its checkpoint through `benchmarks/sampler.py`'s writer,
which session 7 changed to take a JSON shape; the step benchmark then failed before timing
anything. Here its checkpoint worker writes the tiny size and `load_hf` reads exactly that
shape back.
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
