"""What the rollout-vs-trainer correction costs inside a GRPO update step.

design.md section 4: the AIS diagnostics are scalar reductions of values the step already has, so
their cost must be negligible next to the update itself (target: <= 1% of the step). This
script times, side by side in one process, four arms of the same jitted step:

    off    `grpo.make_loss(correction=None)`: no correction, no diagnostics (the floor)
    none   `ais.uncorrected()`: what the trainer's `correction.method: none` runs (A unchanged,
           every diagnostic computed and logged)
    tis    `ais.truncated()`
    ais    `ais.adaptive()`

and two steps per arm:

    loss   `jax.grad` of the GRPO loss with respect to logp_new alone (log-probs given)
    update the whole update of one minibatch: bf16 forward of prompt + response
           (`sampler.token_logprobs` over `model.forward`), the loss, the backward pass to
           the float32 master parameters, and an AdamW step with global-norm clipping (optax),
           built here from public pieces as the trainer's update phase does per minibatch

for the `tiny` and `small` model presets (`ais_jax.models.qwen3`). Repetitions interleave the
arms (in a rotating order) so drift and other load hit every arm alike (the loss alone is
timed over 20 calls back to back per repetition). The script prints, per arm and step, the
median and interquartile range, the ratio of medians against `off` and the median of
within-repetition ratios; XLA's cost analysis (flops, bytes accessed) of each compiled step
against `off`'s, a count that load on the machine cannot blur; and the correction's share of
the update step, (loss[arm] - loss[off]) / update[off]: the loss-alone difference is the
correction's own time, measured where it is not buried in the noise of a whole step.

    python benchmarks/ais_overhead.py                       # tiny and small, 3-6 minutes
    python benchmarks/ais_overhead.py --sizes tiny --reps 30

The machine it runs on matters: the CPU model, jax version and load average are printed.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import NamedTuple

import common
import jax
import jax.numpy as jnp
import numpy as np
import optax

from ais_jax import ais, grpo
from ais_jax.models import init_params
from ais_jax.models.qwen3 import ModelConfig
from ais_jax.nn.layers import cast_params
from ais_jax.train.logprobs import token_logprobs

ARMS = {
    "off": None,
    "none": ais.uncorrected,
    "tis": ais.truncated,
    "ais": ais.adaptive,
}
# rows x response tokens per size: tiny is the trainer's rollout batch (16 prompts x 8 samples)
# at 64 response tokens; small is cut to 4 rows to keep its run short on two CPU cores
SHAPES = {"tiny": (128, 64), "small": (4, 64)}
PROMPT_LEN, GROUP_SIZE = 12, 8
LOSS_CALLS = 20  # the loss alone is timed over this many calls back to back (sub-ms each)


class Minibatch(NamedTuple):
    prompt_tokens: jax.Array  # [B, P] int32
    prompt_mask: jax.Array  # [B, P]
    tokens: jax.Array  # [B, T] int32
    mask: jax.Array  # [B, T] float32, response lengths T/4 .. T
    logp_old: jax.Array  # [B, T] the bf16 trainer's log-probs of the tokens
    logp_rollout: jax.Array  # [B, T] logp_old + N(0, 0.05^2): an FP8-sized mismatch
    advantages: jax.Array  # [B] group-relative, groups of GROUP_SIZE


def make_minibatch(config: ModelConfig, params, rows: int, length: int, seed: int) -> Minibatch:
    rng = np.random.default_rng(seed)
    V = config.vocab_size
    prompt_tokens = jnp.asarray(rng.integers(0, V, (rows, PROMPT_LEN)), jnp.int32)
    prompt_mask = jnp.ones((rows, PROMPT_LEN), jnp.float32)
    tokens = jnp.asarray(rng.integers(0, V, (rows, length)), jnp.int32)
    lengths = rng.integers(length // 4, length + 1, size=(rows, 1))
    mask = jnp.asarray(np.arange(length)[None, :] < lengths, jnp.float32)
    score = jax.jit(token_logprobs, static_argnums=1)
    logp_old = score(
        cast_params(params, jnp.bfloat16), config, prompt_tokens, prompt_mask, tokens, mask
    )
    noise = jnp.asarray(0.05 * rng.standard_normal((rows, length)), jnp.float32)
    rewards = jnp.asarray(rng.integers(0, 2, rows), jnp.float32)
    advantages = grpo.group_advantages(rewards, min(GROUP_SIZE, rows))
    return Minibatch(
        prompt_tokens, prompt_mask, tokens, mask, logp_old, logp_old + noise, advantages
    )


def loss_step(correction):
    """jit(grad of the GRPO loss w.r.t. logp_new): the loss and its correction alone."""
    loss_fn = grpo.make_loss(correction=correction)

    @jax.jit
    def step(logp_new, mb: Minibatch):
        rollout = None if correction is None else mb.logp_rollout
        return jax.grad(loss_fn, has_aux=True)(
            logp_new, mb.logp_old, mb.advantages, mb.mask, logp_rollout_BT=rollout
        )

    return step


def update_step(config: ModelConfig, correction, optimizer: optax.GradientTransformation):
    """jit of one minibatch update: bf16 forward + loss + backward + AdamW, float32 master."""
    loss_fn = grpo.make_loss(correction=correction)

    def objective(params, mb: Minibatch):
        logp_new = token_logprobs(
            cast_params(params, jnp.bfloat16),
            config,
            mb.prompt_tokens,
            mb.prompt_mask,
            mb.tokens,
            mb.mask,
        )
        rollout = None if correction is None else mb.logp_rollout
        return loss_fn(logp_new, mb.logp_old, mb.advantages, mb.mask, logp_rollout_BT=rollout)

    @jax.jit
    def step(params, opt_state, mb: Minibatch):
        (loss, metrics), grads = jax.value_and_grad(objective, has_aux=True)(params, mb)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, metrics

    return step


def _timed(call, inner: int = 1) -> float:
    """Seconds per call, over `inner` calls back to back."""
    start = time.perf_counter()
    for _ in range(inner):
        out = call()
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / inner


def _cost(compiled) -> tuple[float, float]:
    """(flops, bytes accessed) of a compiled step by XLA's cost analysis: a count that load
    on the machine cannot blur."""
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list | tuple) else cost
    return float(cost.get("flops", np.nan)), float(cost.get("bytes accessed", np.nan))


def _summary(samples: list[float]) -> tuple[float, float, float]:
    q1, median, q3 = np.percentile(samples, [25, 50, 75])
    return float(median), float(q1), float(q3)


def run_size(size: str, rows: int, length: int, reps: int, warmup: int, seed: int) -> dict:
    config = ModelConfig.preset(size)
    params = jax.jit(init_params, static_argnums=0)(config, jax.random.key(seed))
    optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-4))
    opt_state = optimizer.init(params)
    mb = make_minibatch(config, params, rows, length, seed)
    logp_new = mb.logp_old + 0.02 * jax.random.normal(jax.random.key(seed + 1), mb.mask.shape)

    calls, costs = {}, {}
    compile_start = time.perf_counter()
    for arm, factory in ARMS.items():
        correction = None if factory is None else factory()
        for phase, step, args in (
            ("loss", loss_step(correction), (logp_new, mb)),
            ("update", update_step(config, correction, optimizer), (params, opt_state, mb)),
        ):
            compiled = step.lower(*args).compile()
            costs[arm, phase] = _cost(compiled)
            calls[arm, phase] = lambda compiled=compiled, args=args: compiled(*args)
            for _ in range(warmup):
                jax.block_until_ready(calls[arm, phase]())
    compile_s = time.perf_counter() - compile_start

    times: dict[tuple[str, str], list[float]] = {key: [] for key in calls}
    order = list(ARMS)
    for rep in range(reps):
        for arm in order[rep % len(order) :] + order[: rep % len(order)]:
            times[arm, "loss"].append(_timed(calls[arm, "loss"], LOSS_CALLS))
            times[arm, "update"].append(_timed(calls[arm, "update"]))
    paired = {
        (arm, phase): float(np.median(np.divide(times[arm, phase], times["off", phase])))
        for arm, phase in times
    }
    return dict(
        size=size,
        rows=rows,
        length=length,
        params=config.num_params,
        compile_s=compile_s,
        stats={key: _summary(samples) for key, samples in times.items()},
        paired=paired,
        costs=costs,
    )


def report(result: dict) -> None:
    stats, paired, costs = result["stats"], result["paired"], result["costs"]
    print(
        f"\n{result['size']}: {result['params'] / 1e6:.2f}M params, minibatch "
        f"{result['rows']} rows x ({PROMPT_LEN} prompt + {result['length']} response) tokens "
        f"(compilation and warm-up {result['compile_s']:.0f} s)"
    )
    print(
        f"{'arm':>5} {'phase':>7} {'median ms':>10} {'IQR ms':>19} {'/ off':>7} {'paired':>7} "
        f"{'+flops':>9} {'+bytes':>9} {'share':>8}"
    )
    update_off = stats["off", "update"][0]
    for phase in ("loss", "update"):
        base = stats["off", phase][0]
        flops_off, bytes_off = costs["off", phase]
        for arm in ARMS:
            median, q1, q3 = stats[arm, phase]
            flops, nbytes = costs[arm, phase]
            share = f"{(median - base) / update_off:+.3%}" if phase == "loss" else ""
            print(
                f"{arm:>5} {phase:>7} {median * 1e3:10.2f} {f'{q1 * 1e3:.2f}-{q3 * 1e3:.2f}':>19}"
                f" {median / base:7.3f} {paired[arm, phase]:7.3f} {flops / flops_off - 1:+9.3%}"
                f" {nbytes / bytes_off - 1:+9.3%} {share:>8}"
            )
    print(
        "/ off: ratio of medians; paired: median over repetitions of the ratio within one\n"
        "repetition; +flops, +bytes: XLA's cost analysis of the compiled step against off's;\n"
        "share: (loss[arm] - loss[off]) / update[off], the correction's own time as a fraction\n"
        "of the whole update step"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="tiny,small", help="comma-separated presets")
    parser.add_argument("--reps", type=int, default=7, help="timed repetitions per arm")
    parser.add_argument("--warmup", type=int, default=1, help="untimed calls per arm")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--shape",
        action="append",
        default=[],
        metavar="SIZE=ROWSxLENGTH",
        help="override a size's minibatch, e.g. small=16x64",
    )
    args = parser.parse_args()
    shapes = dict(SHAPES)
    for item in args.shape:
        size, _, shape = item.partition("=")
        rows, _, length = shape.partition("x")
        shapes[size] = (int(rows), int(length))

    print(
        f"{common.host_line(jax_version=True)} on {jax.devices()[0].device_kind} "
        f"({jax.default_backend()}); load average before {os.getloadavg()[0]:.2f}"
    )
    for size in args.sizes.split(","):
        rows, length = shapes[size]
        report(run_size(size, rows, length, args.reps, args.warmup, args.seed))
    print(f"\nload average after {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
