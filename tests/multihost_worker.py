"""Two JAX processes on one machine: the multi-host path of `sharding.py`, for real.

test_sharding.py starts ``python tests/multihost_worker.py PID PORT OUT_DIR`` for PID 0 and 1;
each process has 4 fake CPU devices, joins the job through `initialize_distributed`
(`jax.distributed.initialize`, gloo collectives on CPU) and sees a global mesh of 8 devices.
Each writes ``OUT_DIR/results_PID.json``: one entry per check.
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
)
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
from training_run import SHARDED_MODEL  # noqa: E402

from ais_jax import models as model
from ais_jax.config import DistributedConfig, MeshConfig, RolloutConfig, TrainConfig
from ais_jax.io.checkpoint import Checkpointer
from ais_jax.parallel import sharding as shd
from ais_jax.tasks import Arithmetic
from ais_jax.train import data
from ais_jax.train import step as train

train.COMPUTE_DTYPE = jax.numpy.float32  # as sharding_worker.py: see check_training_run

CONFIG = SHARDED_MODEL


def mesh(**sizes):
    return shd.make_mesh(MeshConfig(**{"data": 1, **sizes}))


def phases(m, rollout: RolloutConfig | None = None) -> train.Phases:
    """The production phases (`train.make_phases`) of a default run on mesh ``m``."""
    return train.make_phases(m, TrainConfig(rollout=rollout or RolloutConfig()), CONFIG)


def params():
    """The same random params on every process (same key), std 0.1."""
    p = model.init_params(CONFIG, jax.random.key(0))
    return jax.device_get(jax.tree.map(lambda x: 5 * x if x.ndim >= 2 else x, p))


def assert_shards_equal(global_tree, expected_tree):
    """Every shard this process holds equals the matching slice of the expected tree."""
    for x, e in zip(jax.tree.leaves(global_tree), jax.tree.leaves(expected_tree), strict=True):
        e = np.asarray(e)
        for s in x.addressable_shards:
            a = np.asarray(s.data)
            if a.dtype.itemsize == 1:  # fp8 codes: compare bits
                a, e_s = a.view(np.uint8), e[s.index].view(np.uint8)
            else:
                e_s = e[s.index]
            np.testing.assert_array_equal(a, e_s)


def check_topology(ctx):
    assert (jax.process_count(), jax.device_count(), jax.local_device_count()) == (2, 8, 4)
    assert jax.process_index() == ctx["pid"]


def check_per_host_data(ctx):
    """Host i reads global batches i, i + 2, ...: together the one-process batches of 2b."""
    b, pid = 3, ctx["pid"]
    per_host = data.prompt_dataset(Arithmetic(), seed=0, batch_size=b, num_examples=1000)
    mine = data.host_shard(per_host)  # default: grain.sharding.ShardByJaxProcess
    one = data.prompt_dataset(Arithmetic(), seed=0, batch_size=2 * b, num_examples=1000)
    for step in range(3):
        assert mine[step] == one[step][pid * b : (pid + 1) * b], step


def check_global_batch(ctx):
    """Per-host rows -> one global array (rows of process 0 first) and back."""
    m = mesh(data=2, fsdp=2, tensor=2)
    full = np.arange(8 * 3, dtype=np.float32).reshape(8, 3)
    local = full[ctx["pid"] * 4 : (ctx["pid"] + 1) * 4]
    g = shd.shard_batch(local, m)
    assert g.shape == (8, 3) and not g.is_fully_addressable
    np.testing.assert_array_equal(shd.host_rows(g), local)
    total = jax.jit(lambda x: x.sum(0), out_shardings=shd.replicated(m))(g)
    np.testing.assert_array_equal(np.asarray(total.addressable_shards[0].data), full.sum(0))


def check_fp8_sync_across_hosts(ctx):
    """The FP8 rollout copy made on a mesh spanning both hosts (global amax all-reduced
    across processes) equals the copy one device makes."""
    rollout = RolloutConfig(format="float8_e4m3fn")
    one = shd.make_mesh(MeshConfig(data=1), jax.local_devices()[:1])  # this process, one device
    ref = phases(one, rollout).sync(phases(one).init(ctx["params"]).params)
    m = mesh(data=2, fsdp=2, tensor=2)
    q = phases(m, rollout).sync(phases(m).init(ctx["params"]).params)
    assert_shards_equal(q, jax.device_get(ref))


def check_checkpoint_across_hosts(ctx):
    """Both processes save a state sharded 2 x 4 (fsdp x tensor) over the two hosts; both
    restore it onto fsdp = 8."""
    cfg = TrainConfig()
    state = phases(mesh(fsdp=2, tensor=4)).init(ctx["params"])
    expected = jax.device_get(
        train.init_state(ctx["params"], train.make_optimizer(cfg.optim, cfg.steps))
    )
    ckpt = Checkpointer(os.path.join(ctx["tmp"], "ckpt"))
    ckpt.save(3, {"train": state}, {"step": 3})
    target = mesh(fsdp=8)
    step, restored, record = ckpt.restore({"train": shd.abstract_state(expected, target)})
    assert step == 3 and record == {"step": 3}
    q = restored["train"].params["layers"]["q_proj"]
    assert q.sharding.mesh.shape == target.shape and q.sharding.spec == jax.P(
        None, "tensor", "fsdp"
    )
    assert_shards_equal(restored["train"], expected)


def check_training_run(ctx):
    """`run_training` across both processes: SFT, 3 RL steps, checkpoints and evaluation on a
    mesh spanning the two hosts (test_sharding compares it with the one-process run)."""
    from training_run import RUN

    from ais_jax.config import TrainConfig, from_dict
    from ais_jax.train.job import run_training

    cfg = from_dict(TrainConfig, RUN)
    summary = run_training(cfg, os.path.join(ctx["tmp"], "run_two_processes"), show_progress=False)
    assert summary["steps"] == 3, summary
    if ctx["pid"] != 0:  # only process 0 writes the run's files and the full summary
        assert "reward/first" not in summary, summary


CHECKS = [
    check_topology,
    check_per_host_data,
    check_global_batch,
    check_fp8_sync_across_hosts,
    check_checkpoint_across_hosts,
    check_training_run,
]


def main(pid: int, port: int, tmp: str) -> None:
    shd.initialize_distributed(
        DistributedConfig(
            enabled=True, coordinator_address=f"localhost:{port}", num_processes=2, process_id=pid
        )
    )
    ctx = {"pid": pid, "tmp": tmp, "params": params()}
    results = {}
    for check in CHECKS:  # every process runs every check: collectives need both
        t0 = time.perf_counter()
        try:
            check(ctx)
            results[check.__name__] = {"ok": True}
        except Exception:
            results[check.__name__] = {"ok": False, "error": traceback.format_exc()}
        results[check.__name__]["seconds"] = round(time.perf_counter() - t0, 2)
    with open(os.path.join(tmp, f"results_{pid}.json"), "w") as f:
        json.dump(results, f, indent=1)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
