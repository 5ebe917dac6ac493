"""bf16 rollouts under two choices of `quant.CPU_FLOAT32_DOT_MIN_ROWS`, side by side.

On CPU `quant.linear` multiplies bfloat16 operands as float32 copies of the same values from
`quant.CPU_FLOAT32_DOT_MIN_ROWS` rows on (`quant.dot_dtype`): the products are exact in
float32 and the sums float32 either way, so only the summation order changes. Which is faster
depends on the rows: a decode step of batch B multiplies B rows by every weight, and with few
rows the step is bound by reading the weights, which bfloat16 halves. This script times one
bf16 `generate` (random weights of a benchmark shape, prompts of 32 tokens in groups of
``--group`` rows as GRPO samples them, ``--new-tokens`` new tokens at T = 1 over the whole
vocabulary) under each threshold of ``--min-rows``. Every program is compiled in this one
process and the calls alternate, ``--rounds`` times; the report gives the median seconds per
call and each threshold's speed-up over the first. It also says whether the sampled tokens
came out equal (another summation order may flip a near-tie of the Gumbel draw, after which
the rows differ), how far the first step's log-probs moved, and, per threshold, how far the
rollout's log-probs are from the trainer's re-score of its own tokens under that threshold
(`sampler.token_logprobs` with one prompt per group, the update's path): 0 means the BF16
rollout is the trainer's policy bit for bit. ``--excess-precision off`` compiles both programs
with XLA's ``xla_allow_excess_precision`` off, so no fusion skips a bfloat16 rounding between
elementwise ops (on by default in XLA; docs/benchmarks.md, "Where the float32 GEMMs
differ").

The library keeps 4096: below a GRPO batch's decode rows the rollout and the trainer's
re-score run different kernels and the BF16 arm stops being on-policy bit for bit
(docs/benchmarks.md, "Float32 operands from 128 rows").

    python benchmarks/dot_dtype.py                                       # tiny and small, b128
    python benchmarks/dot_dtype.py --sizes qwen3-0.6b --batches 8,32,128 --new-tokens 32 --rounds 2
    python benchmarks/dot_dtype.py --sizes tiny --new-tokens 16 --excess-precision off
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]  # alternating.py beside this file; ais_jax

from alternating import alternate, grouped_prompts  # noqa: E402

from ais_jax import quant, sampler  # noqa: E402
from ais_jax.model import init_params  # noqa: E402
from ais_jax.model_config import ModelConfig  # noqa: E402
from ais_jax.provenance import cpu_model  # noqa: E402

CONFIGS = {
    "tiny": ModelConfig.tiny,
    "small": ModelConfig.small,
    "qwen3-0.6b": ModelConfig.qwen3_0p6b,
}
PROMPT_LEN = 32


@contextlib.contextmanager
def _threshold(min_rows: int):
    """``quant.CPU_FLOAT32_DOT_MIN_ROWS = min_rows`` while tracing, restored after."""
    saved = quant.CPU_FLOAT32_DOT_MIN_ROWS
    quant.CPU_FLOAT32_DOT_MIN_ROWS = min_rows
    try:
        yield
    finally:
        quant.CPU_FLOAT32_DOT_MIN_ROWS = saved


def xla_options(excess_precision: str) -> dict[str, bool]:
    """The XLA options both programs compile with: none for ``"on"`` (XLA's default)."""
    return {} if excess_precision == "on" else {"xla_allow_excess_precision": False}


def lower_generate(
    params, config, prompts, min_rows: int, *, new_tokens: int, group: int, extra=None
):
    """One bf16 `generate` program lowered with ``quant.CPU_FLOAT32_DOT_MIN_ROWS = min_rows``
    (read at trace time, so each threshold gets its own `jax.jit`), and its arguments;
    ``extra`` XLA options on top of the sampler's."""
    layout = sampler.resolve_layout("auto", jnp.bfloat16)
    options = {**sampler.compiler_options(), **(extra or {})}
    static = dict(max_new_tokens=new_tokens, eos_ids=(), pad_id=0, layout=layout)
    fn = jax.jit(
        lambda params, *args: sampler._generate(
            params, config, *args, **static, prompt_group=group
        ),
        compiler_options=options or None,
    )
    decode_params = jax.block_until_ready(sampler.decode_params(params, layout, config))
    mask = jnp.ones(prompts.shape, bool)
    args = (decode_params, prompts, mask, jax.random.key(1), jnp.float32(1.0))
    args += (jnp.int32(config.vocab_size), jnp.float32(1.0))
    with _threshold(min_rows):
        lowered = fn.lower(*args)
    return lowered, args


def rescore_gap(
    params, config, prompts_NP, rollout, min_rows: int, extra=None
) -> tuple[float, float]:
    """Max and mean |rollout log-prob - the trainer's re-score| over the sampled tokens, with the
    re-score traced under ``quant.CPU_FLOAT32_DOT_MIN_ROWS = min_rows`` (a fresh `jax.jit`,
    compiled with the XLA options ``extra``)."""
    rescore = jax.jit(
        lambda params, *args: sampler.token_logprobs(params, config, *args),
        compiler_options=extra or None,
    )
    args = (params, prompts_NP, jnp.ones(prompts_NP.shape, bool), rollout.tokens, rollout.mask)
    with _threshold(min_rows):
        lowered = rescore.lower(*args)
    logp = lowered.compile()(*args)
    gap = jnp.where(rollout.mask, jnp.abs(logp - rollout.logp_plain), 0.0)
    return float(jnp.max(gap)), float(jnp.sum(gap) / jnp.sum(rollout.mask))


def run(size: str, batch: int, args) -> dict:
    """Median seconds per call for each threshold, alternating calls, and the outputs' match."""
    config = CONFIGS[size]()
    params = jax.tree.map(
        lambda x: x.astype(jnp.bfloat16), init_params(config, jax.random.key(0), jnp.float32)
    )
    group, prompts_NP, prompts = grouped_prompts(config.vocab_size, batch, args.group, PROMPT_LEN)
    programs = {}
    extra = xla_options(args.excess_precision)
    for min_rows in args.min_rows:
        lowered, call_args = lower_generate(
            params, config, prompts, min_rows, new_tokens=args.new_tokens, group=group, extra=extra
        )
        programs[min_rows] = lowered.compile(), call_args
    outputs, median_s = alternate(programs, args.rounds)
    first = args.min_rows[0]
    base = outputs[first]
    row = {"size": size, "batch": batch, "median_s": {}, "equal_tokens": {}, "logp0_diff": {}}
    row["rescore_gap"] = {
        m: rescore_gap(params, config, jnp.asarray(prompts_NP, jnp.int32), outputs[m], m, extra)
        for m in programs
    }
    for m in programs:
        row["median_s"][m] = median_s[m]
        row["equal_tokens"][m] = bool(jnp.all(outputs[m].tokens == base.tokens))
        diff = jnp.abs(outputs[m].logp_plain[:, 0] - base.logp_plain[:, 0])
        row["logp0_diff"][m] = float(jnp.max(diff))
    return row


def report(rows: list[dict], min_rows: list[int]) -> str:
    first = min_rows[0]
    head = ["size", "batch"] + [f"from {m} rows s" for m in min_rows]
    head += [f"{first} / {m}" for m in min_rows[1:]] + ["same tokens", "step-1 logp max diff"]
    head += ["rollout vs re-score max / mean diff"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        med = row["median_s"]
        cells = [row["size"], str(row["batch"])] + [f"{med[m]:.3f}" for m in min_rows]
        cells += [f"{med[first] / med[m]:.2f}x" for m in min_rows[1:]]
        cells.append(", ".join(str(row["equal_tokens"][m]) for m in min_rows[1:]))
        cells.append(", ".join(f"{row['logp0_diff'][m]:.2g}" for m in min_rows[1:]))
        cells.append(", ".join("{:.2g} / {:.2g}".format(*row["rescore_gap"][m]) for m in min_rows))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", default="tiny,small", help=f"comma list of {list(CONFIGS)}")
    p.add_argument("--batches", default="128", help="comma list of batch sizes (rows)")
    p.add_argument("--min-rows", default="4096,128", help="thresholds compared; first = base")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--group", type=int, default=8, help="rows per prompt (GRPO's G)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument(
        "--excess-precision",
        choices=("on", "off"),
        default="on",
        help="XLA's xla_allow_excess_precision for both programs (on: XLA's default)",
    )
    args = p.parse_args(argv)
    sizes = args.sizes.split(",")
    bad = [s for s in sizes if s not in CONFIGS]
    if bad:
        p.error(f"unknown --sizes {bad}; choose from {list(CONFIGS)}")
    args.min_rows = [int(m) for m in args.min_rows.split(",")]
    if len(args.min_rows) < 2 or min(args.min_rows) < 1:
        p.error(f"--min-rows needs two or more positive thresholds, got {args.min_rows}")
    batches = [int(b) for b in args.batches.split(",")]
    print(
        f"CPU: {cpu_model()}, {os.cpu_count()} CPUs; jax {jax.__version__}; bf16 generate, "
        f"prompt {PROMPT_LEN}, {args.new_tokens} new tokens, groups of {args.group}, "
        f"{args.rounds} rounds, XLA excess precision {args.excess_precision}",
        flush=True,
    )
    rows = []
    for size in sizes:
        for batch in batches:
            rows.append(run(size, batch, args))
            print(f"  [{size} b{batch} done]", flush=True)
    print(report(rows, args.min_rows))


if __name__ == "__main__":
    main()
