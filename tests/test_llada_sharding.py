"""LLaDA on the mesh presets: the parameters get `sharding.LOGICAL_AXES` by their names, and one
diffu-GRPO step (score on 2 prompt masks + 2 inner updates x 2 minibatches) on 8 fake CPU
devices (2 x 2 x 2) equals the 1-device step (diffusion_sharding_worker.py, a subprocess since
the device count is fixed when JAX starts)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import pytest
from jax.sharding import PartitionSpec as P

from ais_jax.models.llada import LLaDAConfig, init_params
from ais_jax.parallel import sharding as shd


def test_llada_params_take_the_logical_axes_of_model_py():
    shapes = jax.eval_shape(lambda k: init_params(LLaDAConfig.llada_8b(), k), jax.random.key(0))
    sizes = {"data": 1, "fsdp": 8, "tensor": 4}
    specs = shd.param_specs(shapes, shd.TRAIN, sizes)
    assert specs["embed"] == specs["lm_head"] == P("tensor", "fsdp")
    assert specs["layers"]["q_proj"] == P(None, "tensor", "fsdp")
    assert specs["layers"]["down_proj"] == P(None, "fsdp", "tensor")
    assert specs["layers"]["input_norm"] == P()
    rollout = shd.param_specs(shapes, shd.ROLLOUT, sizes)
    assert rollout["layers"]["gate_proj"] == P(None, "tensor", None)


@pytest.mark.slow
def test_one_diffusion_grpo_step_on_eight_devices_equals_one_device(tmp_path):
    out = tmp_path / "result.json"
    worker = Path(__file__).parent / "diffusion_sharding_worker.py"
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    argv = [sys.executable, str(worker), str(out)]
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600)
    assert out.is_file(), proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["ok"], result.get("error")
    assert result["devices"] == 8
