"""FP8 vs BF16 rollout on an NVIDIA Hopper GPU (H100/H200): HLO check and decode throughput.

1. Compiles `quant.linear` with an FP8 `QArray`, and each model's FP8 decode program, and counts
   the GEMMs XLA chose in the optimized HLO by kind: a cuBLASLt FP8 custom call
   (``__cublas$lt$matmul$f8``), an FP8 Triton or cuDNN GEMM fusion, a 16-bit cuBLAS GEMM, or FP8
   operands converted to a wider type before a GEMM (no FP8 tensor cores).
2. Decode tokens/s of `ais_jax.generate` with BF16 params and their FP8 (W8A8, per-tensor)
   copy, for Qwen3-1.7B- and Qwen3-8B-shaped random weights at batch 64 and 256 (prompt 128,
   128 new tokens, no EOS, full-vocabulary sampling at T=1), side by side in one run. Each
   program is compiled ahead of time and its compile time reported apart; the prefill (the
   same `forward_cached` over the prompts that `generate` starts with) is compiled and timed on
   its own, so decode tokens/s = batch x (new - 1) decode steps / (generate - prefill).
   ``--arms`` picks the FP8 forms beside BF16 (`ARMS`): ``fp8`` as `generate` runs it (its
   decode steps below `quant.FP8_GEMM_MIN_ROWS` rows multiply the codes as bfloat16,
   `quant.step_operands`), ``fp8-storage`` (FP8 GEMMs in the steps too), ``fp8-bf16ops`` and
   ``fp8-bf16ops-token`` (bfloat16 operands everywhere, per-tensor or per-token activation
   scales), ``bf16-fused`` and ``fp8-fused`` (q/k/v and gate/up as one matmul each,
   `model.fuse_projections`: the decode layout ``out_in_fused``).
3. The HBM-bandwidth bound of a decode step: the bytes it must read (every weight the step
   multiplies by, embedding table excluded when the LM head is separate, plus the whole
   fixed-size KV cache, which attention reads at every step) over the measured copy bandwidth;
   ``roofline_frac`` is that bound's time over the measured step time, and ``byte_ratio`` the
   BF16 step's bytes over the FP8 step's (the speed-up a purely bandwidth-bound decode could
   reach; about 1 on CPU, where the loop holds the FP8 codes as bfloat16, `quant.widen_codes`).

Run on the GPU machine (no grain needed):  python benchmarks/gpu_fp8.py [--quick]
On a machine without a GPU it says so and exits 0 without measuring anything; ``--smoke`` runs
the whole script on the tiny shape on any backend (what the test suite does on CPU).
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
import sys
import time
from collections import Counter
from pathlib import Path

import common
import jax
import jax.numpy as jnp

from ais_jax.models import forward_cached, init_cache, init_params
from ais_jax.models.qwen3 import ModelConfig
from ais_jax.nn.quant import (
    get_format,
    linear,
    map_qarrays,
    quantize_activation,
    quantize_fp8,
    quantize_weight,
    set_operand_dtype,
    tree_bytes,
)
from ais_jax.rollout.sampler import _generate_jit, decode_params, resolve_layout

GEMM_TARGETS = {  # kind: what marks it on its instruction's line of optimized HLO
    "cuBLAS GEMM": re.compile(r'custom_call_target="__cublas\$(lt\$matmul|gemm)'),
    "Triton GEMM": re.compile(r"__triton\w*gemm"),
    "cuDNN GEMM": re.compile(r"__cudnn\$fusion"),
}
GEMM_FUSIONS = ("Triton GEMM", "cuDNN GEMM")  # fusions whose called computation holds the dot
BF16, F32 = jnp.bfloat16, jnp.float32
_CALL = re.compile(r"\b(custom-call|fusion|dot|convert)\(([^)]*)\)")
_COMPUTATION = re.compile(r"^(?:ENTRY )?%([\w.-]+) .*\{$")  # a computation's first line


def gemm_counts(hlo: str) -> dict[str, int]:
    """How many GEMM instructions of each kind the optimized HLO text holds (a loop body's
    once each): cuBLAS custom calls, Triton and cuDNN GEMM fusions (the dot inside such a
    fusion is that GEMM, not another), other dots; each prefixed ``FP8`` when an operand is an
    FP8 value. And ``f8 converted``: converts that widen an FP8 value (FP8 operands multiplied
    without FP8 tensor cores; XLA:CPU does this)."""
    f8_values = set(re.findall(r"%([\w.-]+) = f8e\w+\[", hlo))
    lines = hlo.splitlines()
    gemm_bodies = {  # computations that a Triton or cuDNN GEMM fusion calls
        m.group(1)
        for line in lines
        if any(GEMM_TARGETS[kind].search(line) for kind in GEMM_FUSIONS)
        for m in [re.search(r"calls=%([\w.-]+)", line)]
        if m
    }
    counts: Counter[str] = Counter()
    computation = None
    for line in lines:
        if header := _COMPUTATION.match(line):
            computation = header.group(1)
        call = _CALL.search(line)
        if not call:
            continue
        op, operands = call.groups()
        on_f8 = any(name in f8_values for name in re.findall(r"%([\w.-]+)", operands))
        if op == "convert":
            counts["f8 converted"] += on_f8 and not re.search(r"= f8e\w+\[", line)
            continue
        if op == "dot":
            kind = "dot" if computation not in gemm_bodies else None
        else:
            kind = next((k for k, pattern in GEMM_TARGETS.items() if pattern.search(line)), None)
        if kind:
            counts[("FP8 " if on_f8 or "matmul$f8" in line else "") + kind] += 1
    return {k: v for k, v in counts.items() if v}


_LAUNCH = re.compile(r"= [^=]*? (fusion|custom-call|copy|sort|scatter)\((?:.*kind=(\w+))?")


def loop_launches(hlo: str) -> dict[str, int]:
    """What the body of the optimized HLO's first while loop (`generate`'s decode loop: one
    iteration per token) launches, by kind: fusions by their kind (``kLoop`` elementwise,
    ``kInput`` reductions, ``kCustom`` Triton GEMMs and other emitted fusions), custom calls
    by target (cuBLAS), copies, sorts, scatters; ``total``: their sum, the kernels of one
    decode step (XLA:GPU runs each fusion and custom call as at least one kernel)."""
    body = re.search(r" while\(.*?body=%([\w.-]+)", hlo)
    if body is None:
        return {"total": 0}
    lines = iter(hlo.splitlines())
    header = re.compile(rf"^%{re.escape(body.group(1))} .*\{{$")
    next(line for line in lines if header.match(line))
    counts: Counter[str] = Counter()
    for line in lines:
        if line.strip() == "}":
            break
        if m := _LAUNCH.search(line):
            op, kind = m.groups()
            if op == "custom-call":
                kind = re.search(r'custom_call_target="([^"]+)"', line).group(1)
            counts[f"{op}:{kind}" if kind else op] += 1
    return dict(sorted(counts.items())) | {"total": sum(counts.values())}


def check_linear_hlo(out: dict) -> None:
    x = jax.random.normal(jax.random.key(0), (256, 4096), jnp.bfloat16)
    w = quantize_weight(jax.random.normal(jax.random.key(1), (4096, 4096)) * 0.02)
    hlo = jax.jit(linear).lower(x, w).compile().as_text()
    out["linear_gemms"] = gemm_counts(hlo)
    out["linear_hlo_custom_calls"] = sorted(set(re.findall(r'custom_call_target="([^"]+)"', hlo)))


def hbm_bandwidth_gbs(elements: int = 1 << 28) -> float:
    """Measured HBM bandwidth of a large elementwise pass (GB/s, reads + writes counted)."""
    x = jnp.ones((elements,), jnp.float32)  # 1 GiB by default
    f = jax.jit(lambda a: a * 1.0001)
    f(x).block_until_ready()
    t0 = time.perf_counter()
    for _ in range(10):
        y = f(x)
    y.block_until_ready()
    return 2 * x.nbytes * 10 / (time.perf_counter() - t0) / 1e9


def decode_weight_bytes(params) -> int:
    """Bytes of weights one decode step reads: every leaf, less the embedding table when a
    separate LM head exists (the step gathers B rows of the table; a tied table is the head)."""
    total = tree_bytes(params)
    if "lm_head" in params:
        total -= tree_bytes(params["embed"])
    return total


def kv_cache_bytes(config: ModelConfig, batch: int, slots: int, dtype) -> int:
    """Bytes of the fixed-size KV cache `init_cache` makes (keys and values of every layer,
    ``slots`` positions), from its shapes: nothing is allocated."""
    cache = jax.eval_shape(lambda: init_cache(config, batch, slots, dtype))
    return tree_bytes((cache.k, cache.v))


def _prefill(params, config, prompt_BP, mask_BP, *, slots: int):
    """`generate`'s prefill: an empty cache of ``slots`` slots, then the prompts' forward."""
    cache = init_cache(config, prompt_BP.shape[0], slots, params["embed"].dtype)
    return forward_cached(params, config, prompt_BP, cache, mask_BP, last_only=True)


def compiled_programs(config, params, batch: int, prompt: int, new: int):
    """The generate and prefill programs for ``params`` at ``batch``, compiled ahead of time,
    with the seconds each compile took and the generate program's optimized HLO."""
    layout = resolve_layout("auto", params["embed"].dtype)
    prompts = jax.ShapeDtypeStruct((batch, prompt), jnp.int32)
    mask = jax.ShapeDtypeStruct((batch, prompt), jnp.bool_)
    t0 = time.perf_counter()
    gen = (
        _generate_jit()
        .lower(
            params,
            config,
            prompts,
            mask,
            jax.random.key(0),
            jnp.float32(1),
            jnp.int32(config.vocab_size),
            jnp.float32(1),
            max_new_tokens=new,
            eos_ids=(),
            pad_id=0,
            layout=layout,
        )
        .compile()
    )
    t1 = time.perf_counter()
    pre = (
        jax.jit(_prefill, static_argnames=("config", "slots"))
        .lower(params, config, prompts, mask, slots=prompt + new)
        .compile()
    )
    t2 = time.perf_counter()
    return gen, pre, {"generate": t1 - t0, "prefill": t2 - t1}


def bench(
    config, params, batch: int, prompt: int, new: int, repeats: int, hlo_path: Path | None = None
) -> dict:
    gen, pre, compile_s = compiled_programs(config, params, batch, prompt, new)
    hlo = gen.as_text()  # the optimized generate program (megabytes on the GPU shapes)
    if hlo_path is not None:  # saved, to read which GEMM is which
        hlo_path.parent.mkdir(parents=True, exist_ok=True)
        hlo_path.write_bytes(gzip.compress(hlo.encode()))
    prompts = jax.random.randint(jax.random.key(1), (batch, prompt), 0, config.vocab_size)
    mask = jnp.ones((batch, prompt), bool)
    one, vocab = jnp.float32(1), jnp.int32(config.vocab_size)

    def generate_call(r: int):
        return gen(params, prompts, mask, jax.random.key(r), one, vocab, one).tokens

    def prefill_call(r: int):
        return pre(params, prompts, mask)[0]

    # each after a first call (allocations, autotuning caches): the median of `repeats` calls
    seconds = {
        "generate": common.median_s(generate_call, repeats),
        "prefill": common.median_s(prefill_call, repeats),
    }
    decode_s = seconds["generate"] - seconds["prefill"]
    return {
        "compile_s": compile_s,
        "generate_s": seconds["generate"],
        "prefill_s": seconds["prefill"],
        "decode_s": decode_s,
        "decode_tokens_per_s": batch * (new - 1) / decode_s,
        "tokens_per_s": batch * new / seconds["generate"],
        "decode_gemms": gemm_counts(hlo),
        "loop_launches": loop_launches(hlo),
    }


MODELS = {"qwen3-1.7b": ModelConfig.qwen3_1p7b, "qwen3-8b": ModelConfig.qwen3_8b}
ARMS = {  # decode arm: its params from (the bf16 params, their FP8 copy, the config)
    "bf16": lambda bf16, fp8, c: bf16,
    "fp8": lambda bf16, fp8, c: fp8,  # as `generate` runs it (`quant.step_operands`)
    "fp8-storage": lambda bf16, fp8, c: set_operand_dtype(fp8, "storage"),  # FP8 GEMMs throughout
    # the same codes multiplied as bfloat16 (`QArray.operand_dtype`), 1-byte weights read
    "fp8-bf16ops": lambda bf16, fp8, c: set_operand_dtype(fp8, "bfloat16"),
    "fp8-bf16ops-token": lambda bf16, fp8, c: set_operand_dtype(_per_token(fp8), "bfloat16"),
    # q/k/v and gate/up as one matmul each (`model.fuse_projections`; fewer kernels per step)
    "bf16-fused": lambda bf16, fp8, c: _fused(bf16, c),
    "fp8-fused": lambda bf16, fp8, c: _fused(fp8, c),
}


def _per_token(params):
    """``params`` with every `QArray` scaling its activations per row (token)."""
    return map_qarrays(lambda w: w.replace(act_scaling="token"), params)


def _fused(params, config):
    """``params`` prepared for the fused decode layout (`model.fuse_projections`), in one
    program."""
    return jax.jit(decode_params, static_argnums=(1, 2))(params, "out_in_fused", config)


def _linear_variants() -> dict:
    """``name -> f(x, w, q, xq)``: one layer's matmul as each variant runs it (``w`` the bf16
    weight, ``q`` its FP8 `QArray`, ``xq`` = (codes, scale) of ``x`` quantized once, outside)."""

    def scaled_dequant(x, w, q, xq):  # the dequantize-then-dot form of XLA's FP8 GEMM pattern
        codes, scale = quantize_activation(x, get_format(q.fmt))
        dq = lambda c, s: c.astype(BF16) * s.astype(BF16)  # noqa: E731
        return jnp.einsum("mi,oi->mo", dq(codes, scale), dq(q.quant, q.scale))

    return {
        "bf16": lambda x, w, q, xq: linear(x, w),
        "fp8-linear": lambda x, w, q, xq: linear(x, q),  # FP8 operands: the prefill's form
        "fp8-gemm-alone": lambda x, w, q, xq: jnp.einsum(
            "mi,oi->mo", xq[0], q.quant, preferred_element_type=F32
        ).astype(BF16),
        "fp8-scaled-dequant": scaled_dequant,
        # one scale per row: a row reduction XLA may fuse with the quantization, no global amax
        "fp8-linear-per-token": lambda x, w, q, xq: linear(x, q.replace(act_scaling="token")),
        # the same codes as bf16 operands (`QArray.operand_dtype`; a GPU decode step's form): a
        # 16-bit GEMM reading the 1-byte weight codes, with and without the quantization of x
        "fp8-linear-bf16-ops": lambda x, w, q, xq: linear(x, q.replace(operand_dtype="bfloat16")),
        "bf16-ops-gemm-alone": lambda x, w, q, xq: jnp.einsum(
            "mi,oi->mo", xq[0].astype(BF16), q.quant.astype(BF16), preferred_element_type=F32
        ).astype(BF16),
    }


CALLS = 10  # `bench_linears`: calls per timing, so a call's launch and wait are amortized


def bench_linears(config: ModelConfig, batches, repeats: int, variants) -> list[dict]:
    """Each `_linear_variants` variant over the decode step's matmul shapes: one program runs
    the variant once per layer, over ``num_layers`` distinct weights (as a decode step does,
    so no call is hoisted or cached), summing the outputs; microseconds per matmul (the median
    of ``repeats`` timings of `CALLS` calls) and the weight bytes read per second."""
    D, F = config.hidden_size, config.intermediate_size
    HE = config.num_heads * config.head_dim
    L = config.num_layers
    rows = []
    for label, (out_dim, in_dim) in {"qkv/o": (HE, D), "gate/up": (F, D), "down": (D, F)}.items():
        keys = jax.random.split(jax.random.key(2), L)
        ws = [(0.02 * jax.random.normal(k, (out_dim, in_dim))).astype(BF16) for k in keys]
        qs = [quantize_weight(w) for w in ws]
        for batch in batches:
            x = jax.random.normal(jax.random.key(3), (batch, in_dim), BF16)
            xq = quantize_activation(x, get_format("float8_e4m3fn"))
            row: dict = {"matmul": label, "shape": [out_dim, in_dim], "batch": batch}
            for name, f in _linear_variants().items():
                if name not in variants:
                    continue

                def layers(x, ws, qs, xq, f=f):
                    ys = [f(x, w, q, xq) for w, q in zip(ws, qs, strict=True)]
                    return sum(y.astype(jnp.float32) for y in ys)

                compiled = jax.jit(layers).lower(x, ws, qs, xq).compile()

                def run(_, compiled=compiled, args=(x, ws, qs, xq)):
                    return compiled(*args)

                # CALLS calls queued back to back, one wait, after a first call
                per_matmul = common.median_s(run, repeats, calls=CALLS) / L
                wbytes = out_dim * in_dim * (2 if name == "bf16" else 1)
                row[name] = {
                    "us": per_matmul * 1e6,
                    "weight_gbs": wbytes / per_matmul / 1e9,
                    "gemms": gemm_counts(compiled.as_text()),
                }
            rows.append(row)
    return rows


def shapes(args) -> dict[str, tuple[ModelConfig, tuple[int, ...]]]:
    if args.smoke:
        return {"tiny": (ModelConfig.tiny(), (4,))}
    if args.quick:
        return {"qwen3-1.7b": (ModelConfig.qwen3_1p7b(), (64,))}
    return {name: (MODELS[name](), args.batches) for name in args.models}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="1.7B shape, batch 64 only")
    ap.add_argument("--smoke", action="store_true", help="tiny shape, batch 4, any backend")
    ap.add_argument("--models", default=",".join(MODELS), help=f"of {', '.join(MODELS)}")
    ap.add_argument("--batches", default="64,256")
    ap.add_argument(
        "--linears",
        action="store_true",
        help="also time one decode step's matmuls alone, per variant (`_linear_variants`: "
        f"{', '.join(_linear_variants())}), on the first model's shapes",
    )
    ap.add_argument("--hlo-dir", type=Path, help="save each generate program's optimized HLO")
    ap.add_argument(
        "--decode",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the decode throughput rows (--no-decode: only the HLO check and --linears)",
    )
    ap.add_argument(
        "--arms",
        default="bf16,fp8",
        help=f"the decode arms, bf16 first, of {', '.join(ARMS)} (`ARMS`)",
    )
    ap.add_argument(
        "--linear-variants",
        help=f"the --linears variants to run (default all): of {', '.join(_linear_variants())}",
    )
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=128)
    args = ap.parse_args(argv)
    if not all(b.strip().isdigit() and int(b) > 0 for b in args.batches.split(",")):
        ap.error(f"--batches {args.batches!r}: positive integers separated by commas, e.g. 64,256")
    args.batches = tuple(int(b) for b in args.batches.split(","))
    args.models = args.models.split(",")
    args.arms = args.arms.split(",")
    if args.arms[0] != "bf16" or len(args.arms) < 2 or not set(args.arms) <= set(ARMS):
        ap.error(f"--arms {','.join(args.arms)}: bf16, then one or more of {', '.join(ARMS)}")
    variants = _linear_variants()
    args.linear_variants = (args.linear_variants or ",".join(variants)).split(",")
    if unknown := [v for v in args.linear_variants if v not in variants]:
        ap.error(f"--linear-variants: unknown {unknown}; known: {', '.join(variants)}")
    if unknown := [m for m in args.models if m not in MODELS]:
        ap.error(f"--models: unknown {unknown}; known: {', '.join(MODELS)}")
    if args.smoke:
        args.prompt, args.new, args.repeats = min(args.prompt, 8), min(args.new, 4), 1
    elif jax.default_backend() != "gpu":
        skipped = f"no GPU (backend {jax.default_backend()!r}); nothing measured"
        print(json.dumps({"skipped": skipped}))
        return
    out: dict = {"device": str(jax.devices()[0]), "jax": jax.__version__}
    out["device_kind"] = jax.devices()[0].device_kind
    check_linear_hlo(out)
    out["hbm_gbs"] = hbm_bandwidth_gbs(1 << 20 if args.smoke else 1 << 28)
    print(json.dumps(out), flush=True)
    if args.linears:
        config, batches = next(iter(shapes(args).values()))
        for row in bench_linears(config, batches, args.repeats, args.linear_variants):
            print(json.dumps(row), flush=True)
    slots = args.prompt + args.new
    for name, (config, batches) in shapes(args).items() if args.decode else ():
        t0 = time.perf_counter()
        # one program each (eager, every layer's slice would compile its own)
        stacked = jax.jit(init_params, static_argnums=(0, 2))(config, jax.random.key(0), BF16)
        # the rollout copies as a weight sync leaves them: quantized, layers unstacked
        unstack = jax.jit(decode_params, static_argnums=(1, 2))
        fp8 = unstack(jax.jit(quantize_fp8)(stacked), "auto", config)
        bf16 = unstack(stacked, "auto", config)
        del stacked
        jax.block_until_ready((bf16, fp8))
        print(json.dumps({"model": name, "params_s": time.perf_counter() - t0}), flush=True)
        for batch in batches:
            row: dict = {"model": name, "batch": batch, "prompt": args.prompt, "new": args.new}
            kv = kv_cache_bytes(config, batch, slots, jnp.bfloat16)
            step_bytes = {}
            arms = {label: ARMS[label](bf16, fp8, config) for label in args.arms}
            for label, params in arms.items():
                hlo = args.hlo_dir and args.hlo_dir / f"{name}_b{batch}_{label}.hlo.txt.gz"
                r = bench(config, params, batch, args.prompt, args.new, args.repeats, hlo)
                step_bytes[label] = decode_weight_bytes(params) + kv
                step_s = r["decode_s"] / (args.new - 1)
                r["step_gb"] = step_bytes[label] / 1e9
                r["roofline_frac"] = step_bytes[label] / step_s / (out["hbm_gbs"] * 1e9)
                row[label] = r
                tok_s = r["decode_tokens_per_s"]
                print(f"{name} b{batch} {label}: {tok_s:.0f} decode tok/s", file=sys.stderr)
            for label in list(arms)[1:]:
                key = label.replace("-", "_")
                row[f"{key}_over_bf16_decode"] = (
                    row[label]["decode_tokens_per_s"] / row["bf16"]["decode_tokens_per_s"]
                )
                row[f"{key}_over_bf16_generate"] = (
                    row[label]["tokens_per_s"] / row["bf16"]["tokens_per_s"]
                )
            row["byte_ratio"] = step_bytes["bf16"] / step_bytes[list(arms)[1]]
            print(json.dumps(row), flush=True)
        del bf16, fp8


if __name__ == "__main__":
    main()
