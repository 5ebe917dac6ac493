"""FP8 vs BF16 rollout on an NVIDIA Hopper GPU (H100/H200): HLO check and decode throughput.

1. Compiles `quant.linear` with an FP8 `QArray` and reports which GEMM XLA chose: a cuBLASLt
   FP8 custom call (`__cublas$lt$matmul$f8`), an FP8 Triton GEMM, or a fallback that converts
   the FP8 operands (no FP8 tensor cores). The same check runs on the whole decode step.
2. Decode tokens/s of `ais_jax.generate` with BF16 params and their FP8 (W8A8, per-tensor)
   copy, for Qwen3-1.7B- and Qwen3-8B-shaped random weights at batch 64 and 256 (prompt 128,
   128 new tokens, no EOS), side by side in one run, with compile time reported separately and
   the fraction of the HBM-bandwidth bound reached (weight + KV bytes read per decode step).

Run on the GPU machine (no grain needed):  python benchmarks/gpu_fp8.py [--quick]
On a machine without a GPU it says so and exits 0 without measuring anything.
"""

from __future__ import annotations

import argparse
import json
import re
import time

import jax
import jax.numpy as jnp
import numpy as np

from ais_jax.model import init_params
from ais_jax.model_config import ModelConfig
from ais_jax.quant import linear, quantize_fp8, quantize_weight, tree_bytes
from ais_jax.sampler import _generate_jit, generate, resolve_layout

TRITON_FP8 = re.compile(r"__triton_gemm[^\n]*f8e4m3fn|f8e4m3fn[^\n]*__triton_gemm")


def gemm_kind(hlo: str) -> str:
    if "__cublas$lt$matmul$f8" in hlo:
        return "cuBLASLt FP8 GEMM"
    if TRITON_FP8.search(hlo):
        return "Triton FP8 GEMM"
    if "f8e4m3fn" in hlo:
        return "FP8 operands converted (no FP8 GEMM)"
    return "no FP8 in HLO"


def check_linear_hlo(out: dict) -> None:
    x = jax.random.normal(jax.random.key(0), (256, 4096), jnp.bfloat16)
    w = quantize_weight(jax.random.normal(jax.random.key(1), (4096, 4096)) * 0.02)
    hlo = jax.jit(linear).lower(x, w).compile().as_text()
    out["linear_gemm"] = gemm_kind(hlo)
    out["linear_hlo_custom_calls"] = sorted(set(re.findall(r'custom_call_target="([^"]+)"', hlo)))


def hbm_bandwidth_gbs() -> float:
    """Measured HBM bandwidth of a large elementwise pass (GB/s, reads + writes counted)."""
    x = jnp.ones((1 << 28,), jnp.float32)  # 1 GiB
    f = jax.jit(lambda a: a * 1.0001)
    f(x).block_until_ready()
    t0 = time.perf_counter()
    for _ in range(10):
        y = f(x)
    y.block_until_ready()
    return 2 * x.nbytes * 10 / (time.perf_counter() - t0) / 1e9


def bench(config: ModelConfig, params, batch: int, prompt: int, new: int, repeats: int) -> dict:
    prompts = jax.random.randint(jax.random.key(1), (batch, prompt), 0, config.vocab_size)
    kw = dict(max_new_tokens=new, eos_ids=(), prompt_mask=np.ones((batch, prompt), bool))
    t0 = time.perf_counter()
    jax.block_until_ready(generate(params, config, prompts, jax.random.key(0), **kw).tokens)
    first = time.perf_counter() - t0
    times = []
    for r in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(generate(params, config, prompts, jax.random.key(r), **kw).tokens)
        times.append(time.perf_counter() - t0)
    steady = float(np.median(times))
    return {"compile_s": first - steady, "step_s": steady, "tokens_per_s": batch * new / steady}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="1.7B shape, batch 64 only")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=128)
    args = ap.parse_args()
    if jax.default_backend() != "gpu":
        print(
            json.dumps({"skipped": f"no GPU (backend {jax.default_backend()!r}); nothing measured"})
        )
        return
    out: dict = {"device": str(jax.devices()[0]), "jax": jax.__version__}
    check_linear_hlo(out)
    out["hbm_gbs"] = hbm_bandwidth_gbs()
    print(json.dumps(out), flush=True)
    shapes = {"qwen3-1.7b": ModelConfig.qwen3_1p7b()}
    if not args.quick:
        shapes["qwen3-8b"] = ModelConfig.qwen3_8b()
    for name, config in shapes.items():
        bf16 = init_params(config, jax.random.key(0), jnp.bfloat16)
        fp8 = quantize_fp8(bf16)
        layout = resolve_layout("auto", fp8["embed"].dtype)
        lowered = _generate_jit().lower(
            fp8,
            config,
            jnp.zeros((64, args.prompt), jnp.int32),
            jnp.ones((64, args.prompt), bool),
            jax.random.key(0),
            jnp.float32(1),
            jnp.int32(config.vocab_size),
            jnp.float32(1),
            max_new_tokens=args.new,
            eos_ids=(),
            pad_id=0,
            layout=layout,
        )
        decode_gemm = gemm_kind(lowered.compile().as_text())
        for batch in (64,) if args.quick else (64, 256):
            row = {"model": name, "batch": batch, "decode_gemm_fp8": decode_gemm}
            kv_bytes = (
                2
                * config.num_layers
                * batch
                * (args.prompt + args.new / 2)
                * config.num_kv_heads
                * config.head_dim
                * 2
            )
            for label, params in (("bf16", bf16), ("fp8", fp8)):
                r = bench(config, params, batch, args.prompt, args.new, args.repeats)
                bytes_per_step = tree_bytes(params) + kv_bytes
                r["roofline_frac"] = (
                    bytes_per_step / (r["step_s"] / args.new) / (out["hbm_gbs"] * 1e9)
                )
                row[label] = r
            row["fp8_over_bf16"] = row["fp8"]["tokens_per_s"] / row["bf16"]["tokens_per_s"]
            print(json.dumps(row), flush=True)
        del bf16, fp8


if __name__ == "__main__":
    main()
