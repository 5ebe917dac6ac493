"""FP8 rollouts on CPU with the weight codes as stored (FP8) and widened to bfloat16, side by side.

XLA:CPU has no FP8 dot: given FP8 operands it widens them to float32 first. In the decode loop,
which compiles without while-loop invariant code motion (`sampler.compiler_options`), that is
every weight at every step. `sampler.decode_params` therefore holds the codes as bfloat16 on CPU
(`quant.widen_codes`): the same numbers, converted once before the loop, and a bfloat16 dot.
This script times one FP8 `generate` (random weights of a benchmark shape, prompts of 32 tokens
in groups of ``--group`` rows as GRPO samples them, ``--new-tokens`` new tokens at T = 1 over
the whole vocabulary) both ways, and the BF16 rollout of the same weights for scale. Size
``llada-tiny`` times LLaDA's denoising loop instead (`diffusion_sampler.generate_arrays`,
``--new-tokens`` tokens in one block, one token per step, temperature 1, low-confidence
remasking), whose loop holds the codes the same way (`quant.widen_tree_codes`); its log-probs
are the one-step estimator's after the loop, on the params as given. All three programs are
compiled in this one process and the calls alternate, ``--rounds`` times; the report gives the
median seconds per call, the speed-up of widening, and whether the two FP8 rollouts drew the
same tokens (another summation order may flip a near-tie of the Gumbel draw, after which the
rows differ) and how far their first step's log-probs are apart.

    python benchmarks/fp8_codes.py                          # tiny and small, batch 128
    python benchmarks/fp8_codes.py --sizes tiny --batches 8,128 --rounds 10
    python benchmarks/fp8_codes.py --sizes llada-tiny --batches 64 --new-tokens 32
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]  # alternating.py beside this file; ais_jax

from alternating import alternate, grouped_prompts  # noqa: E402

from ais_jax import diffusion_sampler, llada, quant, sampler  # noqa: E402
from ais_jax.model import cast_params, init_params  # noqa: E402
from ais_jax.model_config import ModelConfig  # noqa: E402
from ais_jax.provenance import cpu_model  # noqa: E402

CONFIGS = {
    "tiny": ModelConfig.tiny,
    "small": ModelConfig.small,
    "qwen3-0.6b": ModelConfig.qwen3_0p6b,
    "llada-tiny": llada.LLaDAConfig.tiny,
}
PROMPT_LEN = 32
ARMS = ("fp8 codes stored", "fp8 codes widened", "bf16")


@contextlib.contextmanager
def _stored_codes():
    """The decode loops keeping the FP8 codes as stored while tracing (the library before
    `quant.widen_codes`), restored after."""
    saved = sampler.widen_codes, diffusion_sampler.widen_tree_codes
    sampler.widen_codes = lambda w: w
    diffusion_sampler.widen_tree_codes = lambda tree: tree
    try:
        yield
    finally:
        sampler.widen_codes, diffusion_sampler.widen_tree_codes = saved


def compile_generate(params, config, prompts, *, stored: bool, new_tokens: int, group: int):
    """One `generate` program for ``params`` (a fresh `jax.jit`, so each arm is traced on its
    own; LLaDA's `diffusion_sampler.generate_arrays` for a `llada.LLaDAConfig`), compiled, and
    its arguments."""
    mask = jnp.ones(prompts.shape, bool)
    if isinstance(config, llada.LLaDAConfig):
        static = dict(gen_length=new_tokens, block_length=new_tokens, steps=new_tokens)
        fn = jax.jit(
            lambda params, *args: diffusion_sampler.generate_arrays.__wrapped__(
                params, config, *args, **static, eos_ids=(), pad_id=config.pad_token_id
            )
        )
        args = (params, prompts, mask, jax.random.key(1), jax.random.key(2), jnp.float32(1.0))
        args += (jnp.int32(0), jnp.float32(0.15))  # low-confidence remasking
    else:
        layout = sampler.resolve_layout("auto", params["embed"].dtype)
        static = dict(max_new_tokens=new_tokens, eos_ids=(), pad_id=0, layout=layout)
        fn = jax.jit(
            lambda params, *args: sampler._generate(
                params, config, *args, **static, prompt_group=group
            ),
            compiler_options=sampler.compiler_options() or None,
        )
        args = (params, prompts, mask, jax.random.key(1), jnp.float32(1.0))
        args += (jnp.int32(config.vocab_size), jnp.float32(1.0))
    with _stored_codes() if stored else contextlib.nullcontext():
        compiled = fn.lower(*args).compile()
    return compiled, args


def run(size: str, batch: int, args) -> dict:
    """Median seconds per call of each arm, alternating calls, and the FP8 outputs' match."""
    config = CONFIGS[size]()
    is_llada = isinstance(config, llada.LLaDAConfig)
    params = (llada.init_params if is_llada else init_params)(config, jax.random.key(0))
    fp8 = quant.quantize_fp8(params)
    avoid = config.mask_token_id if is_llada else None  # no [MASK] in a prompt
    group, _, prompts = grouped_prompts(
        config.vocab_size, batch, args.group, PROMPT_LEN, avoid=avoid
    )
    trees = dict(zip(ARMS, (fp8, fp8, cast_params(params, jnp.bfloat16)), strict=True))
    programs = {
        arm: compile_generate(
            tree, config, prompts, stored=arm == ARMS[0], new_tokens=args.new_tokens, group=group
        )
        for arm, tree in trees.items()
    }
    outputs, median_s = alternate(programs, args.rounds)
    stored, widened = outputs[ARMS[0]], outputs[ARMS[1]]
    return {
        "size": size,
        "batch": batch,
        "median_s": median_s,
        "equal_tokens": bool(jnp.all(stored.tokens == widened.tokens)),
        "logp0_diff": float(jnp.max(jnp.abs(stored.logp_plain[:, 0] - widened.logp_plain[:, 0]))),
    }


def report(rows: list[dict]) -> str:
    head = ["size", "batch", *(f"{arm} s" for arm in ARMS)]
    head += ["stored / widened", "widened / bf16", "same tokens", "step-1 logp max diff"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        med = row["median_s"]
        cells = [row["size"], str(row["batch"]), *(f"{med[arm]:.3f}" for arm in ARMS)]
        cells += [f"{med[ARMS[0]] / med[ARMS[1]]:.2f}x", f"{med[ARMS[1]] / med[ARMS[2]]:.2f}x"]
        cells += [str(row["equal_tokens"]), f"{row['logp0_diff']:.2g}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", default="tiny,small", help=f"comma list of {list(CONFIGS)}")
    p.add_argument("--batches", default="128", help="comma list of batch sizes (rows)")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--group", type=int, default=8, help="rows per prompt (GRPO's G)")
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args(argv)
    sizes = args.sizes.split(",")
    bad = [s for s in sizes if s not in CONFIGS]
    if bad:
        p.error(f"unknown --sizes {bad}; choose from {list(CONFIGS)}")
    if jax.default_backend() != "cpu":
        p.error(f"this compares CPU programs; the default backend is {jax.default_backend()}")
    batches = [int(b) for b in args.batches.split(",")]
    print(f"CPU: {cpu_model()}; jax {jax.__version__}", flush=True)
    rows = []
    for size in sizes:
        for batch in batches:
            rows.append(run(size, batch, args))
            print(f"  [{size} b{batch} done]", flush=True)
    print(
        f"\nFP8 generate, prompt {PROMPT_LEN}, {args.new_tokens} new tokens, groups of "
        f"{args.group}, median of {args.rounds} alternating calls; {cpu_model()}"
    )
    print(report(rows))


if __name__ == "__main__":
    main()
