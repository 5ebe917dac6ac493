"""Why the sampler's CPU decode path lays weights out as it does: few-row matmuls on XLA:CPU.

Times ``x[B, I] @ W`` for the weight shapes of the "small" benchmark model (sampler.py) in
three forms, side by side in one process:

- ``[O,I] bf16-out``: the Hugging Face ``[out, in]`` layout, result requested in the operand
  dtype (``preferred_element_type`` = operand dtype; what `quant.linear` used to do);
- ``[O,I] f32-acc``: the same layout, float32 result, then cast (what `quant.linear` does now);
- ``[I,O] f32-acc``: the weight transposed once to ``[in, out]`` (`quant.InOut`, the sampler's
  CPU decode layout).

    python benchmarks/cpu_matmul.py                 # B = 8 and 32, f32 and bf16
    python benchmarks/cpu_matmul.py --batches 8 --repeats 400
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp

SHAPES = {  # (out, in) of the small model's matmuls
    "q/o_proj": (512, 512),
    "gate/up_proj": (1536, 512),
    "down_proj": (512, 1536),
    "lm_head": (32_000, 512),
}


def oi_native(x, w_OI):
    return jnp.einsum("bi,oi->bo", x, w_OI, preferred_element_type=x.dtype)


def oi_f32_acc(x, w_OI):
    return jnp.einsum("bi,oi->bo", x, w_OI, preferred_element_type=jnp.float32).astype(x.dtype)


def io_f32_acc(x, w_IO):
    return jnp.einsum("bi,io->bo", x, w_IO, preferred_element_type=jnp.float32).astype(x.dtype)


def best_ms(fn, *args, repeats: int) -> float:
    fn = jax.jit(fn)
    fn(*args).block_until_ready()
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(repeats):
            out = fn(*args)
        out.block_until_ready()
        best = min(best, (time.perf_counter() - t0) / repeats * 1e3)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="8,32")
    parser.add_argument("--repeats", type=int, default=100)
    args = parser.parse_args()
    print(f"jax {jax.__version__}, {jax.devices()[0].platform}; best ms per matmul")
    print(
        f"{'dtype':6} {'B':>3} {'weight':14} {'[O,I] bf16-out':>15} {'[O,I] f32-acc':>14} "
        f"{'[I,O] f32-acc':>14} {'speed-up':>9}"
    )
    for dtype in (jnp.float32, jnp.bfloat16):
        for batch in (int(b) for b in args.batches.split(",")):
            for name, (o, i) in SHAPES.items():
                x = jax.random.normal(jax.random.key(0), (batch, i), dtype)
                w_oi = jax.random.normal(jax.random.key(1), (o, i), dtype)
                w_io = w_oi.T.copy()
                native = best_ms(oi_native, x, w_oi, repeats=args.repeats)
                acc = best_ms(oi_f32_acc, x, w_oi, repeats=args.repeats)
                in_out = best_ms(io_f32_acc, x, w_io, repeats=args.repeats)
                print(
                    f"{jnp.dtype(dtype).name:6} {batch:>3} {name:14} {native:15.3f} "
                    f"{acc:14.3f} {in_out:14.3f} {native / in_out:8.2f}x"
                )


if __name__ == "__main__":
    main()
