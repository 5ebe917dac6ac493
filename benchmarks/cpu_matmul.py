"""Few-row matmuls on XLA:CPU: which weight layout the sampler's decode loop should read.

Times ``x[B, I] @ W`` for the weight shapes of a benchmark model (sampler.py's "small", or the
Qwen3-0.6B shape) in four forms, side by side in one process:

- ``[O,I] bf16-out``: the Hugging Face ``[out, in]`` layout, result requested in the operand
  dtype (``preferred_element_type`` = operand dtype; what `quant.linear` used to do);
- ``[O,I] f32-acc``: the same layout, float32 result, then cast (what `quant.linear` does; the
  ``out_in`` decode layout, the GPU/TPU default);
- ``[I,O] f32-acc``: the weight transposed once to ``[in, out]`` (the CPU float32 default
  until 2026-12-03, when it was dropped);
- ``columns``: ``(W[O,I] @ x^T)^T``, float32 result, then cast (`quant.columns_dot`, the
  ``out_in_columns`` decode layout, the CPU default for float32 models).

Each form runs over ``--copies`` distinct weights per call (default: the model's layer count),
so the weights stream from memory as in a decode step instead of sitting in cache; the time is
per matmul, and GB/s is the weight bytes read per second. Which form wins depends on XLA:CPU's
dot backend: jaxlib 0.10.2 runs dots as YNNPACK fusions by default, and
``XLA_FLAGS=--xla_cpu_experimental_ynn_fusion_type=`` runs them through Eigen instead.

    python benchmarks/cpu_matmul.py                               # small, B = 8 and 32
    python benchmarks/cpu_matmul.py --size qwen3-0.6b --batches 8 --dtypes f32
    XLA_FLAGS=--xla_cpu_experimental_ynn_fusion_type= python benchmarks/cpu_matmul.py
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp

from ais_jax import provenance, quant

SHAPES = {  # size -> (layer count, {name: (out, in)}); the LM head is one matrix per step
    "small": (
        8,
        {
            "q/o_proj": (512, 512),
            "gate/up_proj": (1536, 512),
            "down_proj": (512, 1536),
            "lm_head": (32_000, 512),
        },
    ),
    "qwen3-0.6b": (
        28,
        {
            "q_proj": (2048, 1024),
            "k/v_proj": (1024, 1024),
            "o_proj": (1024, 2048),
            "gate/up_proj": (3072, 1024),
            "down_proj": (1024, 3072),
            "lm_head": (151_936, 1024),
        },
    ),
}
DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16}


def oi_native(x, w_OI):
    return jnp.einsum("bi,oi->bo", x, w_OI, preferred_element_type=x.dtype)


def oi_f32_acc(x, w_OI):
    return jnp.einsum("bi,oi->bo", x, w_OI, preferred_element_type=jnp.float32).astype(x.dtype)


def io_f32_acc(x, w_IO):
    return jnp.einsum("bi,io->bo", x, w_IO, preferred_element_type=jnp.float32).astype(x.dtype)


def columns(x, w_OI):
    return quant.columns_dot(x, w_OI).astype(x.dtype)


def best_ms(matmul, x, weights, *, repeats: int) -> float:
    """Best-of-3 time per matmul (ms) of ``matmul(x, w)`` over every ``w`` of ``weights``."""
    fn = jax.jit(lambda x, ws: [matmul(x, w) for w in ws])
    jax.block_until_ready(fn(x, weights))
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(repeats):
            out = fn(x, weights)
        jax.block_until_ready(out)
        best = min(best, (time.perf_counter() - t0) / repeats / len(weights) * 1e3)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="small", choices=sorted(SHAPES))
    parser.add_argument("--batches", default="8,32")
    parser.add_argument("--dtypes", default="f32,bf16")
    parser.add_argument("--copies", type=int, default=0, help="weights per call (0: layers)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    layers, shapes = SHAPES[args.size]
    print(f"{provenance.cpu_model()}, jax {jax.__version__}, {jax.devices()[0].platform}")
    print("best ms per matmul (GB/s of weight read)")
    print(
        f"{'dtype':6} {'B':>3} {'weight':13} {'[O,I] bf16-out':>16} {'[O,I] f32-acc':>16} "
        f"{'[I,O] f32-acc':>16} {'columns':>16}"
    )
    for dtype in (DTYPES[d] for d in args.dtypes.split(",")):
        for batch in (int(b) for b in args.batches.split(",")):
            for name, (o, i) in shapes.items():
                copies = 1 if name == "lm_head" else args.copies or layers
                keys = jax.random.split(jax.random.key(1), copies)
                w_oi = [jax.random.normal(k, (o, i), dtype) for k in keys]
                w_io = [w.T.copy() for w in w_oi]
                x = jax.random.normal(jax.random.key(0), (batch, i), dtype)
                nbytes = o * i * jnp.dtype(dtype).itemsize
                times = [
                    best_ms(oi_native, x, w_oi, repeats=args.repeats),
                    best_ms(oi_f32_acc, x, w_oi, repeats=args.repeats),
                    best_ms(io_f32_acc, x, w_io, repeats=args.repeats),
                    best_ms(columns, x, w_oi, repeats=args.repeats),
                ]
                cells = " ".join(f"{t:8.3f} ({nbytes / t / 1e6:4.1f})" for t in times)
                print(f"{jnp.dtype(dtype).name:6} {batch:>3} {name:13} {cells}", flush=True)


if __name__ == "__main__":
    main()
