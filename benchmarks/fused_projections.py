"""Rollouts with each layer's q/k/v and gate/up fused (two matmuls) or apart (five), side by side.

`sampler.generate` under a decode layout and under its ``*_fused`` twin
(`sampler.DECODE_LAYOUTS`, `model.fuse_projections`), for float32, bfloat16 and FP8 params
(random weights of a benchmark shape, prompts of 32 tokens in groups of ``--group`` rows as
GRPO samples them, ``--new-tokens`` new tokens at T = 1 over the whole vocabulary). Each arm's
two programs are compiled in this one process and their calls alternate, ``--rounds`` times;
the report gives the median seconds per call, the speed-up of fusing, how many rows the two
rollouts drew alike (the fused products are the same numbers, but XLA may sum a dot in another
order, and a flipped near-tie of the draw changes the row from there on), how many first tokens
(drawn from the prefill's logits) and the largest difference of those tokens' log-probs.

    python benchmarks/fused_projections.py                      # tiny and small, batch 128
    python benchmarks/fused_projections.py --sizes tiny --batches 8,128 --rounds 9
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]  # alternating.py beside this file; ais_jax

from alternating import alternate, batch_sizes, grouped_prompts, names  # noqa: E402

from ais_jax import quant, sampler  # noqa: E402
from ais_jax.model import cast_params, init_params  # noqa: E402
from ais_jax.model_config import ModelConfig  # noqa: E402
from ais_jax.provenance import cpu_model  # noqa: E402

CONFIGS = {
    "tiny": ModelConfig.tiny,
    "small": ModelConfig.small,
    "qwen3-0.6b": ModelConfig.qwen3_0p6b,
}
DTYPES = ("float32", "bfloat16", "fp8")
PROMPT_LEN = 32


def compile_generate(params, config, prompts, layout: str, *, new_tokens: int, group: int):
    """`generate`'s program for ``params`` under ``layout``, compiled, and its arguments."""
    args = (params, config, prompts, jnp.ones(prompts.shape, bool), jax.random.key(1))
    args += (jnp.float32(1.0), jnp.int32(config.vocab_size), jnp.float32(1.0))
    static = dict(max_new_tokens=new_tokens, eos_ids=(), pad_id=0, prompt_group=group)
    lowered = sampler._generate_jit().lower(*args, **static, layout=sampler.resolve_layout(layout))
    return lowered.compile(), (args[0], *args[2:])  # the config is static: not an argument


def random_params(config: ModelConfig, dtype: str):
    """Random weights of ``config`` in ``dtype`` (one of `DTYPES`; FP8: from bfloat16)."""
    params = init_params(config, jax.random.key(0))
    if dtype == "fp8":
        return quant.quantize_fp8(cast_params(params, jnp.bfloat16))
    return cast_params(params, jnp.dtype(dtype))


def run(size: str, batch: int, dtype: str, args) -> dict:
    """Median seconds per call, apart and fused, alternating calls, and the outputs' match."""
    config = CONFIGS[size]()
    params = random_params(config, dtype)
    apart = sampler.default_layout(dtype=params["embed"].dtype)
    layouts = (apart, f"{apart}_fused")
    group, _, prompts = grouped_prompts(config.vocab_size, batch, args.group, PROMPT_LEN, low=1)
    programs = {
        layout: compile_generate(
            params, config, prompts, layout, new_tokens=args.new_tokens, group=group
        )
        for layout in layouts
    }
    outputs, median_s = alternate(programs, args.rounds)
    a, f = (outputs[layout] for layout in layouts)
    first_same = np.asarray(a.tokens[:, 0] == f.tokens[:, 0])
    logp0_diff = np.abs(np.asarray(a.logp_plain[:, 0] - f.logp_plain[:, 0]))[first_same]
    return {
        "size": size,
        "batch": batch,
        "dtype": dtype,
        "layout": apart,
        "median_s": [median_s[layout] for layout in layouts],
        "equal_rows": int(np.all(np.asarray(a.tokens == f.tokens), axis=1).sum()),
        "first_same": int(first_same.sum()),
        "logp0_diff": float(logp0_diff.max(initial=0.0)),
    }


def report(rows: list[dict]) -> str:
    head = ["size", "batch", "params", "layout", "apart s", "fused s", "apart / fused"]
    head += ["rows the same", "first tokens the same", "their log-prob max diff"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        apart, fused = row["median_s"]
        cells = [row["size"], str(row["batch"]), row["dtype"], row["layout"]]
        cells += [f"{apart:.3f}", f"{fused:.3f}", f"{apart / fused:.2f}x"]
        cells += [f"{row['equal_rows']}/{row['batch']}", f"{row['first_same']}/{row['batch']}"]
        cells.append(f"{row['logp0_diff']:.2g}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", default="tiny,small", help=f"comma list of {list(CONFIGS)}")
    p.add_argument("--batches", default="128", help="comma list of batch sizes (rows)")
    p.add_argument("--dtypes", default=",".join(DTYPES), help=f"comma list of {list(DTYPES)}")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--group", type=int, default=8, help="rows per prompt (GRPO's G)")
    p.add_argument("--rounds", type=int, default=7)
    args = p.parse_args(argv)
    sizes = names(p, "--sizes", args.sizes, list(CONFIGS))
    dtypes = names(p, "--dtypes", args.dtypes, DTYPES)
    batches = batch_sizes(p, args.batches)
    print(f"CPU: {cpu_model()}; jax {jax.__version__}; backend {jax.default_backend()}", flush=True)
    rows = []
    for size in sizes:
        for batch in batches:
            for dtype in dtypes:
                rows.append(run(size, batch, dtype, args))
                print(f"  [{size} b{batch} {dtype} done]", flush=True)
    print(
        f"\ngenerate, prompt {PROMPT_LEN}, {args.new_tokens} new tokens, groups of {args.group}, "
        f"median of {args.rounds} alternating calls; {cpu_model()}"
    )
    print(report(rows))


if __name__ == "__main__":
    main()
