"""Specification of `sharding.py` and `plan.py`.

In this process (one device): mesh configuration and its errors, the logical-axis table of both
presets on real parameter shapes, per-host data sharding with grain, the distributed wrapper,
and `ais-jax plan` against hand arithmetic for Qwen3-8B.

On 8 fake CPU devices (a subprocess, `sharding_worker.py`, since the device count is fixed
when JAX starts): a sharded train step, scoring, generation and the FP8 sync + forward equal
their one-device results; the step does not recompile; a checkpoint saved on one mesh restores
onto two others.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import grain
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from training_run import SHARDED_MODEL

from ais_jax.cli import plan
from ais_jax.config import CorrectionConfig, DistributedConfig, MeshConfig
from ais_jax.models import init_cache, param_shapes
from ais_jax.models.llada import LLaDAConfig
from ais_jax.models.qwen3 import ModelConfig
from ais_jax.nn.quant import quantize_fp8
from ais_jax.parallel import sharding as shd
from ais_jax.tasks import Arithmetic
from ais_jax.train import data

TINY = SHARDED_MODEL
SIZES = {"data": 2, "fsdp": 2, "tensor": 2}


# ---- mesh configuration ---------------------------------------------------------------------


def test_mesh_config_resolves_fill_and_names_bad_values():
    assert MeshConfig().sizes(8) == {"data": 8, "fsdp": 1, "tensor": 1}
    assert MeshConfig(data=2, fsdp=-1, tensor=2).sizes(16) == {
        "data": 2,
        "fsdp": 4,
        "tensor": 2,
    }
    assert MeshConfig.parse("data=1, fsdp=8,tensor=1") == MeshConfig(data=1, fsdp=8)
    with pytest.raises(ValueError, match=r"mesh.tensor=0"):
        MeshConfig(tensor=0)
    with pytest.raises(ValueError, match="at most one axis may be -1"):
        MeshConfig(data=-1, fsdp=-1)
    with pytest.raises(
        ValueError,
        match=r"product of the fixed axis sizes \(3\) does not divide"
        r" the device count 8",
    ):
        MeshConfig(fsdp=3).sizes(8)
    with pytest.raises(ValueError, match=r"\(4\) is not the device count 8"):
        MeshConfig(data=2, fsdp=2).sizes(8)
    with pytest.raises(ValueError, match="'pipeline=2' must look like AXIS=INT"):
        MeshConfig.parse("pipeline=2")


def test_sharding_module_imports_nothing_of_the_package():
    """The mesh, the table and the row helpers depend on JAX alone (anywhere in the file, not
    only at its top), so every module of the package may import them without a cycle."""
    import ast

    tree = ast.parse(Path(shd.__file__).read_text())
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert not [m for m in imported if m.split(".")[0] == "ais_jax"], imported


def test_make_mesh_on_one_device():
    mesh = shd.make_mesh(MeshConfig())
    assert dict(mesh.shape) == {"data": 1, "fsdp": 1, "tensor": 1}
    assert set(mesh.axis_types) == {jax.sharding.AxisType.Auto}


# ---- the logical-axis table -----------------------------------------------------------------


def test_train_preset_is_fsdp_times_tensor():
    specs = shd.param_specs(param_shapes(TINY), shd.TRAIN, SIZES)
    layers = specs["layers"]
    assert specs["embed"] == specs["lm_head"] == P("tensor", "fsdp")
    for name in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"):
        assert layers[name] == P(None, "tensor", "fsdp"), name
    for name in ("o_proj", "down_proj"):
        assert layers[name] == P(None, "fsdp", "tensor"), name
    for name in ("input_norm", "post_norm", "q_norm", "k_norm"):
        assert layers[name] == P(), name
    assert specs["final_norm"] == P(None)


def test_rollout_preset_is_tensor_parallel_and_quantized_weights_follow_their_table_row():
    shapes = jax.eval_shape(quantize_fp8, param_shapes(TINY, jnp.float32))
    specs = shd.param_specs(shapes, shd.ROLLOUT, SIZES)
    q = specs["layers"]["q_proj"]
    assert q.quant == P(None, "tensor", None) and q.scale == P()
    assert specs["layers"]["down_proj"].quant == P(None, None, "tensor")
    assert specs["embed"] == P("tensor", None)


def test_optimizer_moments_shard_like_their_params():
    from ais_jax.config import OptimConfig
    from ais_jax.train.step import init_state, make_optimizer

    state = jax.eval_shape(
        lambda p: init_state(p, make_optimizer(OptimConfig(), 1)), param_shapes(TINY, jnp.float32)
    )
    specs = shd.param_specs(state, shd.TRAIN, SIZES)
    adam = specs.opt_state[1][0]
    assert adam.mu == adam.nu == specs.params
    assert adam.count == P() and specs.step == P()


def test_kv_cache_rows_over_data_fsdp_and_heads_over_tensor():
    cache = jax.eval_shape(lambda: init_cache(TINY, 8, 32))
    specs = shd.param_specs(cache, shd.ROLLOUT, SIZES)
    assert len(specs.k) == len(specs.v) == TINY.num_layers
    rows, heads = ("data", "fsdp"), "tensor"
    assert all(k == P(rows, heads, None, None) for k in specs.k)  # [B, K, T, E]
    assert all(v == P(rows, heads, None, None) for v in specs.v)  # [B, K, E, T]
    assert specs.valid == P(("data", "fsdp"), None) and specs.index == P()


def test_a_dimension_the_mesh_does_not_divide_stays_unsharded_on_that_axis():
    odd = ModelConfig(
        vocab_size=63,
        hidden_size=64,
        num_layers=1,
        num_heads=4,
        num_kv_heads=1,
        head_dim=16,
        intermediate_size=96,
        tie_embeddings=True,
    )
    specs = shd.param_specs(param_shapes(odd), shd.TRAIN, {"data": 1, "fsdp": 4, "tensor": 32})
    assert specs["embed"] == P(None, "fsdp")  # 63 % 32 != 0
    assert specs["layers"]["k_proj"] == P(None, None, "fsdp")  # K*E = 16 < 32
    assert specs["layers"]["gate_proj"] == P(None, "tensor", "fsdp")  # 96 % 32 == 0
    cache = jax.eval_shape(lambda: init_cache(odd, 6, 8))
    assert shd.param_specs(cache, shd.ROLLOUT, {"data": 2, "fsdp": 2, "tensor": 1}).k == (
        P("data", "tensor", None, None),
    )  # 6 rows: data (2) divides, data x fsdp (4) not


# ---- multi-host -----------------------------------------------------------------------------


def test_host_shards_of_per_host_batches_reassemble_the_one_process_batches():
    """n hosts with batches of b read, together, what one process with batches of n*b reads."""
    n, b = 4, 2
    one = data.prompt_dataset(Arithmetic(), seed=0, batch_size=n * b, num_examples=1000)
    per_host = data.prompt_dataset(Arithmetic(), seed=0, batch_size=b, num_examples=1000)
    hosts = [data.host_shard(per_host, grain.sharding.ShardOptions(i, n)) for i in range(n)]
    for step in range(3):
        assert sum((hosts[i][step] for i in range(n)), ()) == one[step]
    assert data.host_shard(per_host)[5] == per_host[5]  # one process: everything


def test_host_shard_drop_remainder_keeps_hosts_in_step():
    finite = data.prompt_dataset(
        Arithmetic(), seed=0, batch_size=3, num_examples=30, num_epochs=1
    )  # 10 batches
    lengths = [
        len(data.host_shard(finite, grain.sharding.ShardOptions(i, 4, drop_remainder=True)))
        for i in range(4)
    ]
    assert lengths == [2, 2, 2, 2]


def test_initialize_distributed_only_when_enabled(monkeypatch):
    calls = []
    monkeypatch.setattr(jax.distributed, "initialize", lambda **kw: calls.append(kw))
    shd.initialize_distributed(DistributedConfig())
    assert calls == []
    shd.initialize_distributed(
        DistributedConfig(
            enabled=True, coordinator_address="h0:1234", num_processes=2, process_id=1
        )
    )
    assert calls == [{"coordinator_address": "h0:1234", "num_processes": 2, "process_id": 1}]


def test_shard_batch_on_one_device_is_a_device_put():
    mesh = shd.make_mesh(MeshConfig())
    batch = {"tokens": np.arange(12, dtype=np.int32).reshape(4, 3)}
    out = shd.shard_batch(batch, mesh)
    np.testing.assert_array_equal(np.asarray(out["tokens"]), batch["tokens"])
    assert out["tokens"].sharding.spec == P(("data", "fsdp"))


# ---- plan -----------------------------------------------------------------------------------

# Qwen3-8B by hand: L=36, D=4096, H*E=4096, K*E=1024, F=12288, V=151936, untied head.
L, D, HE, KE, F, V = 36, 4096, 4096, 1024, 12288, 151_936
LAYER_MATRICES = L * (2 * HE * D + 2 * KE * D + 3 * F * D)
MATRICES = LAYER_MATRICES + 2 * V * D  # + embed and lm_head
NORMS = L * (2 * D + 2 * 128) + D  # input/post norms, q/k norms, final norm: replicated


def _rows(mesh: str, batch=64, seq=2048):
    sizes = {k: int(v) for k, v in (item.split("=") for item in mesh.split(","))}
    return plan.plan_memory(ModelConfig.qwen3_8b(), sizes, batch=batch, seq=seq)


def test_plan_qwen3_8b_fsdp8_matches_hand_arithmetic():
    assert MATRICES + NORMS == ModelConfig.qwen3_8b().num_params  # 8.19e9
    rows = _rows("data=1,fsdp=8,tensor=1")
    master = 4 * (MATRICES // 8 + NORMS)
    assert rows["params"].device_bytes == rows["gradients"].device_bytes == master
    assert rows["params"].total_bytes == 4 * (MATRICES + NORMS)
    assert 0 <= rows["optimizer"].device_bytes - 2 * master <= 16  # + AdamW's step counters
    assert rows["bf16"].device_bytes == master // 2
    # rollout layout is replicated over fsdp: with tensor=1 every device holds the whole copy
    fp8 = LAYER_MATRICES + 2 * (2 * V * D + NORMS) + 4 * 7 * L  # codes, bf16 rest, scales
    assert rows["fp8"].device_bytes == rows["fp8"].total_bytes == fp8
    kv = 2 * L * 64 * 2048 * KE * 2  # k and v, bf16
    assert rows["kv_cache"].device_bytes == kv // 8 + 64 * 2048 // 8 + 4 * 64 // 8 + 4
    assert round(rows["params"].device_bytes / plan.GIB, 2) == 3.82


def test_plan_tensor_parallel_divides_rollout_copy_and_kv_heads():
    rows = _rows("data=2,fsdp=2,tensor=2")
    assert rows["params"].device_bytes == 4 * (MATRICES // 4 + NORMS)
    fp8 = LAYER_MATRICES // 2 + 2 * (2 * V * D // 2 + NORMS) + 4 * 7 * L
    assert rows["fp8"].device_bytes == fp8
    kv = 2 * L * 64 * 2048 * KE * 2
    assert rows["kv_cache"].device_bytes == kv // 8 + 64 * 2048 // 4 + 4 * 64 // 4 + 4


def test_plan_allocates_nothing_and_cli_prints_a_table(capsys):
    before = len(jax.live_arrays())
    args = argparse.Namespace(model="qwen3-8b", mesh="data=1,fsdp=8,tensor=1", batch=64, seq=2048)
    assert plan.main(args) == 0
    assert len(jax.live_arrays()) == before
    out = capsys.readouterr().out
    assert "qwen3-8b (8.19B parameters)" in out and "params (float32 master)" in out
    assert "3.82" in out  # 8.19e9 * 4 bytes / 8 devices in GiB


def test_plan_errors_name_the_value():
    with pytest.raises(ValueError, match=r"batch=60 is not divisible by mesh data x fsdp = 8"):
        _rows("data=1,fsdp=8,tensor=1", batch=60)
    args = argparse.Namespace(model="qwen3-8b", mesh="data=-1", batch=64, seq=2048)
    with pytest.raises(ValueError, match="data=-1 needs a device count"):
        plan.main(args)


# LLaDA-8B by hand: L=32, D=4096, H=K=32 heads of E=128 (H*E = K*E = 4096), F=12288, V=126464,
# untied head, no q/k norms. Its rollout has no KV cache: the row is one forward's activations.
LL, LD, LHE, LF, LV = 32, 4096, 4096, 12288, 126_464
LLADA_LAYER_MATRICES = LL * (4 * LHE * LD + 3 * LF * LD)
LLADA_MATRICES = LLADA_LAYER_MATRICES + 2 * LV * LD
LLADA_NORMS = LL * 2 * LD + LD


def _llada_rows(mesh: str, batch=8, seq=1024):
    sizes = {k: int(v) for k, v in (item.split("=") for item in mesh.split(","))}
    return plan.plan_memory(plan.resolve_model("llada-8b"), sizes, batch=batch, seq=seq)


def test_plan_llada_8b_params_and_copies_match_hand_arithmetic():
    assert LLADA_MATRICES + LLADA_NORMS == 8_015_581_184 == LLaDAConfig.llada_8b().num_params
    rows = _llada_rows("data=1,fsdp=8,tensor=1")
    assert "kv_cache" not in rows
    master = 4 * (LLADA_MATRICES // 8 + LLADA_NORMS)
    assert rows["params"].device_bytes == rows["gradients"].device_bytes == master
    assert rows["params"].total_bytes == 4 * (LLADA_MATRICES + LLADA_NORMS)
    assert 0 <= rows["optimizer"].device_bytes - 2 * master <= 16
    assert rows["bf16"].device_bytes == master // 2
    fp8 = LLADA_LAYER_MATRICES + 2 * (2 * LV * LD + LLADA_NORMS) + 4 * 7 * LL
    assert rows["fp8"].device_bytes == rows["fp8"].total_bytes == fp8
    tp = _llada_rows("data=2,fsdp=2,tensor=2")
    assert tp["params"].device_bytes == 4 * (LLADA_MATRICES // 4 + LLADA_NORMS)
    fp8 = LLADA_LAYER_MATRICES // 2 + 2 * (2 * LV * LD // 2 + LLADA_NORMS) + 4 * 7 * LL
    assert tp["fp8"].device_bytes == fp8


def test_plan_llada_8b_activations_are_one_forward_by_hand():
    # 8 rows x 1024 positions on fsdp=8: one row per device; the head's float32 logits and
    # three float32 temporaries [b, T, V] (T = S by default) dominate the attention scores
    rows = _llada_rows("data=1,fsdp=8,tensor=1", batch=8, seq=1024)
    head = 1024 * LD * 2 + 4 * 1024 * LV * 4
    attention = 1024 * LD * 2 + 3 * 1024 * LHE * 2 + 32 * 1024 * 1024 * (4 + 2)
    assert head > attention
    assert rows["activations"].device_bytes == head == 2_080_374_784
    assert rows["activations"].total_bytes == 8 * head
    sizes = {"data": 1, "fsdp": 8, "tensor": 1}
    rows = plan.plan_memory(LLaDAConfig.llada_8b(), sizes, batch=8, seq=1024, gen_length=256)
    assert rows["activations"].device_bytes == 1024 * LD * 2 + (1024 + 3 * 256) * LV * 4
    # 8192 positions, 1024 of them the response: the [b, H, S, S] scores (float32 + bf16
    # probs) take over; tensor=2 halves heads and vocab, not the replicated [b, S, D] stream
    sizes = {"data": 1, "fsdp": 4, "tensor": 2}
    rows = plan.plan_memory(LLaDAConfig.llada_8b(), sizes, batch=4, seq=8192, gen_length=1024)
    S, T = 8192, 1024
    attention = S * LD * 2 + 3 * S * (LHE // 2) * 2 + 16 * S * S * 6
    head = S * LD * 2 + (S + 3 * T) * (LV // 2) * 4
    assert attention > head
    assert rows["activations"].device_bytes == attention
    # no steps factor: the denoising steps run one after another
    parts = plan.diffusion_activation_bytes(LLaDAConfig.llada_8b(), 1, S, 2, gen_length=T)
    assert parts["peak"] == attention and parts["head"] == head
    with pytest.raises(ValueError, match=r"gen_length=9000 must be in \[1, seq=8192\]"):
        plan.diffusion_activation_bytes(LLaDAConfig.llada_8b(), 1, S, gen_length=9000)


def test_plan_cli_prints_the_llada_table(capsys):
    before = len(jax.live_arrays())
    args = argparse.Namespace(model="llada-8b", mesh="data=1,fsdp=8,tensor=1", batch=8, seq=1024)
    assert plan.main(args) == 0
    assert len(jax.live_arrays()) == before
    out = capsys.readouterr().out
    assert "llada-8b (8.02B parameters)" in out and "(prompt + gen_length)" in out
    assert "activations (1 forward, 8 x 1024)" in out and "no KV cache" in out
    master_gib = 4 * (LLADA_MATRICES // 8 + LLADA_NORMS) / plan.GIB
    assert f"{master_gib:17.2f}" in out and "KV cache (" not in out
    args.model = "llada-9t"
    with pytest.raises(ValueError, match=r"Unknown model preset 'llada-9t'.*qwen3-8b.*llada-8b"):
        plan.main(args)


# ---- 8 fake devices, and two processes (subprocesses) ------------------------------------------

CHECKS = [
    "check_layouts",
    "check_train_step",
    "check_grouped_train_step",
    "check_remat_train_step",
    "check_no_recompile",
    "check_score",
    "check_score_bf16",
    "check_train_step_bf16",
    "check_qwen35_train_step",
    "check_llama_train_step_and_fp8_generate",
    "check_generate",
    "check_fp8",
    "check_fp8_generate",
    "check_checkpoint",
    "check_runner",
    "check_training_run_reference",
]
MULTIHOST_CHECKS = [
    "check_topology",
    "check_per_host_data",
    "check_global_batch",
    "check_fp8_sync_across_hosts",
    "check_checkpoint_across_hosts",
    "check_training_run",
]
TIMEOUT_S = 600


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _run_workers(out: Path) -> dict:
    """Run sharding_worker.py (8 CPU devices) and the two multihost_worker.py processes side by
    side (their start-up and compilation overlap); their per-check results."""
    here = Path(__file__).parent
    env = dict(os.environ, JAX_PLATFORMS="cpu")  # each worker appends its device count flag
    out.mkdir(parents=True, exist_ok=True)
    port = str(_free_port())
    commands = {
        "eight": [str(here / "sharding_worker.py"), str(out / "results.json"), str(out)],
        **{f"host{i}": [str(here / "multihost_worker.py"), str(i), port, str(out)] for i in (0, 1)},
    }
    procs = {
        name: subprocess.Popen(
            [sys.executable, *cmd],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for name, cmd in commands.items()
    }
    logs = {}
    try:
        for name, proc in procs.items():
            logs[name] = proc.communicate(timeout=TIMEOUT_S)[0]
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
    results = {}
    for name, file in [
        ("eight", "results.json"),
        ("host0", "results_0.json"),
        ("host1", "results_1.json"),
    ]:
        path = out / file
        crashed = {"ok": False, "error": logs.get(name, "")[-4000:], "seconds": None}
        results[name] = json.loads(path.read_text()) if path.exists() else {"crashed": crashed}
    results["out"] = str(out)
    return results


@pytest.fixture(scope="module")
def workers(tmp_path_factory):
    """The workers' results, computed once per session even under pytest-xdist."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        return _run_workers(tmp_path_factory.mktemp("workers"))
    shared = tmp_path_factory.getbasetemp().parent  # this session's, shared by xdist workers
    with open(shared / "sharding_workers.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        done = shared / "sharding_workers.json"
        if not done.exists():
            done.write_text(json.dumps(_run_workers(shared / "sharding_workers")))
        return json.loads(done.read_text())


@pytest.mark.slow
@pytest.mark.parametrize("check", CHECKS)
def test_on_eight_devices(workers, check):
    results = workers["eight"]
    assert "crashed" in results or sorted(results) == sorted(CHECKS), "CHECKS is out of date"
    result = results.get(check, results.get("crashed"))
    assert result["ok"], f"{check} ({result['seconds']} s):\n{result.get('error')}"
    if result.get("skipped"):
        pytest.skip(result["skipped"])


@pytest.mark.slow
@pytest.mark.parametrize("check", MULTIHOST_CHECKS)
@pytest.mark.parametrize("host", ["host0", "host1"])
def test_on_two_processes(workers, host, check):
    results = workers[host]
    assert "crashed" in results or sorted(results) == sorted(MULTIHOST_CHECKS)
    result = results.get(check, results.get("crashed"))
    assert result["ok"], f"{host} {check} ({result['seconds']} s):\n{result.get('error')}"


@pytest.mark.slow
def test_two_processes_train_exactly_like_one(workers):
    """The same run (tests/training_run.py) on one 8-device mesh, spanning two processes or one:
    the same global batches (each host reads its share), so the same metrics; process 0 alone
    wrote the files."""
    for name in ("host0", "host1"):
        assert workers[name].get("check_training_run", {}).get("ok"), workers[name]
    assert workers["eight"].get("check_training_run_reference", {}).get("ok"), workers["eight"]
    out = Path(workers["out"])
    two, one = out / "run_two_processes", out / "run_one_process"
    rows_two = [json.loads(x) for x in (two / "metrics.jsonl").read_text().splitlines()]
    rows_one = [json.loads(x) for x in (one / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows_two] == [1, 2, 3]  # one writer: no duplicated rows
    # Cross-process reductions sum in another order: the log-probs agree to float32 rounding,
    # so the mismatch (a mean of their differences, ~3e-3) to ~1e-7 absolute. alpha_mis =
    # mismatch / delta (and alpha, its multiple) carry that error times 1 / delta.
    alpha_abs = 1e-6 / CorrectionConfig().delta  # the run keeps the default delta
    for r2, r1 in zip(rows_two, rows_one, strict=True):
        for key, value in r1.items():
            if key.startswith("time/"):
                continue
            tol = alpha_abs if key in ("ais/alpha", "ais/alpha_mis") else 1e-6
            assert r2[key] == pytest.approx(value, rel=1e-5, abs=tol), (r1["step"], key)
    s2, s1 = (json.loads((d / "summary.json").read_text()) for d in (two, one))
    for key in ("eval/accuracy", "eval/sampled_accuracy", "initial/eval/accuracy"):
        assert s2[key] == s1[key], key
    assert (two / "config.yaml").exists() and list((two / "tb").iterdir())
    assert sorted(int(p.name) for p in (two / "checkpoints").iterdir() if p.name.isdigit()) == [
        0,
        2,
        3,
    ]
