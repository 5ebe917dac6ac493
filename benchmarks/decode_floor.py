"""How far a `generate` call sits above its weight matmuls alone (CPU; issue 16 item 4).

For a preset model shape (default Qwen3-0.6B, random weights), a batch of B prompts of P ids
and N new tokens, one process times in turn, ``--rounds`` times:

1. the whole `sampler.generate` call, on weights prepared once by `sampler.decode_params` (as
   benchmarks/sampler.py times it: the prefill and N - 1 decode steps);
2. the prefill's weight matmuls alone: B x P rows through every layer's q, k, v, o, gate, up
   and down projections;
3. one decode step's weight matmuls alone: B rows through the same, plus the LM head over the
   whole vocabulary.

(2) and (3) are each one jitted program of independent `quant.linear` products on ``[out,
in]`` weights of the model's dtype, held as the default decode layout holds them
(`quant.Columns` for float32 on CPU, so each product takes the decode loop's form for its row
count), compiled with the decode program's own options (`sampler.compiler_options`). Their
sum, (2) + (N - 1) x (3), is the *floor*: what the call would take if everything else
(attention, norms, rope, the draw, cache writes) were free. A call must come in at ``peer_s /
R`` to be R x a peer that takes ``peer_s``; if the floor is above that, no change outside the
matmuls reaches R.

    python benchmarks/decode_floor.py                      # Qwen3-0.6B, b32, f32, 32 new tokens
    python benchmarks/decode_floor.py --batch 8 --dtype bf16
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import common


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="qwen3_0p6b", help="a `ModelConfig` preset")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--prompt", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--dtype", choices=("f32", "bf16"), default="f32")
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args()

    import jax
    import jax.numpy as jnp
    import numpy as np

    from ais_jax.models import init_params
    from ais_jax.models.qwen3 import ModelConfig
    from ais_jax.nn.quant import Columns, linear
    from ais_jax.rollout import sampler

    if not hasattr(ModelConfig, a.preset):
        raise SystemExit(f"--preset {a.preset!r}: not a ModelConfig preset (e.g. qwen3_0p6b)")
    cfg = getattr(ModelConfig, a.preset)()
    dtype = jnp.float32 if a.dtype == "f32" else jnp.bfloat16
    B, P, N, V = a.batch, a.prompt, a.new_tokens, cfg.vocab_size
    D, F = cfg.hidden_size, cfg.intermediate_size
    Q, KV = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    shapes = [(D, Q), (D, KV), (D, KV), (Q, D), (D, F), (D, F), (F, D)]  # q k v o gate up down
    layout = sampler.resolve_layout("auto", dtype)
    options = sampler.compiler_options() or None

    def weight(i, shape):  # [out, in], as the layout holds it
        w = jax.random.normal(jax.random.key(i), shape[::-1], jnp.float32) * 0.02
        return Columns(w.astype(dtype)) if layout.columns else w.astype(dtype)

    weights = [[weight(7 * i + j, s) for j, s in enumerate(shapes)] for i in range(cfg.num_layers)]
    head = weight(-1, (D, V))

    def matmuls(weights, head, x, x_q, x_f, with_head):
        out = []
        for w in weights:
            xs = (x, x, x, x_q, x, x, x_f)
            out += [
                linear(x_in, w_j, out_dtype=jnp.float32) for x_in, w_j in zip(xs, w, strict=True)
            ]
        if with_head:
            out.append(linear(x[:B], head, out_dtype=jnp.float32))
        return [o.sum() for o in out]  # every dot runs; only scalars come back

    matmuls = jax.jit(matmuls, static_argnums=5, compiler_options=options)

    def rows(m):
        keys = (jax.random.key(10_000 + m + i) for i in range(3))
        return [jax.random.normal(k, (m, n), dtype) for k, n in zip(keys, (D, Q, F), strict=True)]

    decode_rows, prefill_rows = rows(B), rows(B * P)
    params = init_params(cfg, jax.random.key(0), jnp.float32)
    params = jax.tree.map(lambda x: x.astype(dtype), params)
    params = jax.block_until_ready(sampler.decode_params(params, layout, cfg))
    prompts = common.prompt_ids(V, (B, P), 0, low=0)
    call = functools.partial(
        sampler.generate,
        params,
        cfg,
        prompts,
        jax.random.key(0),
        max_new_tokens=N,
        prompt_mask=np.ones((B, P), bool),
        temperature=1.0,
    )
    programs = {
        "call": call,
        "prefill": lambda: matmuls(weights, head, *prefill_rows, False),
        "decode step": lambda: matmuls(weights, head, *decode_rows, True),
    }
    for fn in programs.values():  # compile and first run
        jax.block_until_ready(fn())
    times = {name: [] for name in programs}
    for _ in range(a.rounds):
        for name, fn in programs.items():
            start = time.perf_counter()
            jax.block_until_ready(fn())
            times[name].append(time.perf_counter() - start)
    s = {name: statistics.median(v) for name, v in times.items()}
    per_layer = sum(i * o for i, o in shapes)
    flops_prefill = 2 * B * P * cfg.num_layers * per_layer
    flops_step = 2 * B * (cfg.num_layers * per_layer + D * V)
    floor = s["prefill"] + (N - 1) * s["decode step"]
    print(f"{common.host_line(jax_version=True)}; layout {layout.name}, compiler options {options}")
    print(f"{a.preset} {a.dtype}, batch {B}, prompt {P}, {N} new tokens; medians of {a.rounds}:")
    prefill, step = s["prefill"], s["decode step"]
    print(f"  prefill matmuls     {prefill:.4g} s  ({flops_prefill / prefill / 1e9:.1f} GFLOP/s)")
    print(f"  decode-step matmuls {step:.4g} s  ({flops_step / step / 1e9:.1f} GFLOP/s)")
    print(f"  floor: prefill + {N - 1} steps {floor:.4g} s")
    print(f"  whole call          {s['call']:.4g} s  (floor / call {floor / s['call']:.2f})")
    print(f"  each round's call: {[round(t, 3) for t in times['call']]}")


if __name__ == "__main__":
    main()
