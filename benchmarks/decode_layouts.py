"""Every decode layout of one dtype side by side: which one this host runs fastest.

`sampler.generate` compiled once per layout of `sampler.DECODE_LAYOUTS` (or those of
``--layouts``) for float32, bfloat16 or FP8 params (random weights of a benchmark shape, random
32-token prompts, ``--new-tokens`` new tokens at T = 1 over the whole vocabulary), all in this
one process, their calls alternating ``--rounds`` times (`alternating.alternate`). The report
gives each layout's median seconds per call and the default layout's time over it (above 1x:
faster than the default `sampler.default_layout` picks here).

    python benchmarks/decode_layouts.py                        # float32, tiny and small, b8, b32
    python benchmarks/decode_layouts.py --dtypes bfloat16 --batches 128 --group 8
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jax

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]  # alternating.py beside this file; ais_jax

from alternating import alternate, batch_sizes, grouped_prompts, names  # noqa: E402
from fused_projections import (  # noqa: E402
    CONFIGS,
    DTYPES,
    PROMPT_LEN,
    compile_generate,
    random_params,
)

from ais_jax import sampler  # noqa: E402
from ais_jax.provenance import cpu_model  # noqa: E402


def run(size: str, batch: int, dtype: str, layouts: list[str], args) -> dict:
    """Each layout's median seconds per call, alternating calls, and the default layout."""
    config = CONFIGS[size]()
    params = random_params(config, dtype)
    group, _, prompts = grouped_prompts(config.vocab_size, batch, args.group, PROMPT_LEN, low=1)
    programs = {
        layout: compile_generate(
            params, config, prompts, layout, new_tokens=args.new_tokens, group=group
        )
        for layout in layouts
    }
    _, median_s = alternate(programs, args.rounds)
    default = sampler.default_layout(dtype=params["embed"].dtype)
    return {"size": size, "batch": batch, "dtype": dtype, "default": default, "s": median_s}


def report(rows: list[dict], layouts: list[str]) -> str:
    head = ["size", "batch", "params", "default", *(f"{name} s" for name in layouts)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        cells = [row["size"], str(row["batch"]), row["dtype"], row["default"]]
        base = row["s"].get(row["default"])
        for name in layouts:
            ratio = f" ({base / row['s'][name]:.2f}x)" if base is not None else ""
            cells.append(f"{row['s'][name]:.3f}{ratio}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", default="tiny,small", help=f"comma list of {list(CONFIGS)}")
    p.add_argument("--batches", default="8,32", help="comma list of batch sizes (rows)")
    p.add_argument("--dtypes", default="float32", help=f"comma list of {list(DTYPES)}")
    p.add_argument("--layouts", default=",".join(sampler.DECODE_LAYOUTS))
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--group", type=int, default=1, help="rows per prompt (GRPO's G)")
    p.add_argument("--rounds", type=int, default=7)
    args = p.parse_args(argv)
    sizes = names(p, "--sizes", args.sizes, list(CONFIGS))
    dtypes = names(p, "--dtypes", args.dtypes, DTYPES)
    layouts = names(p, "--layouts", args.layouts, list(sampler.DECODE_LAYOUTS))
    batches = batch_sizes(p, args.batches)
    print(f"CPU: {cpu_model()}; jax {jax.__version__}; backend {jax.default_backend()}", flush=True)
    rows = []
    for size in sizes:
        for batch in batches:
            for dtype in dtypes:
                rows.append(run(size, batch, dtype, layouts, args))
                print(f"  [{size} b{batch} {dtype} done]", flush=True)
    print(
        f"\ngenerate, prompt {PROMPT_LEN}, {args.new_tokens} new tokens, groups of {args.group}, "
        f"median s of {args.rounds} alternating calls (default's time / layout's); {cpu_model()}"
    )
    print(report(rows, layouts))


if __name__ == "__main__":
    main()
