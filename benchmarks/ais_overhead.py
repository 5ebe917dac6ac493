"""Wall-clock overhead of the AIS correction inside a jitted GRPO loss + grad step.

SPEC section 4: the AIS diagnostics are scalar reductions of values the step already has, so
their overhead must be negligible. This script times `jax.grad` of `grpo.loss` (w.r.t.
logp_new) on random log-probs with `adaptive`, `truncated` and `uncorrected` corrections, plus
a `no_correction` arm (correction=None: no diagnostics at all, the floor). The arms are
interleaved within each repetition so drift (thermal, other load) hits all of them alike; the
script prints each arm's median time and its ratios. Every correction, `uncorrected` included,
computes the same AIS diagnostics, so `adaptive / uncorrected` is the cost of applying alpha and
`uncorrected / no_correction` the cost of the diagnostics themselves.

    python benchmarks/ais_overhead.py --batch 512 --length 1024 --reps 30

The step here is only the loss; in training it sits behind a full model forward and backward,
so the relative overhead there is far smaller than the ratio printed.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from ais_jax import ais, grpo


def _inputs(batch: int, length: int, seed: int):
    rng = np.random.default_rng(seed)
    logp_old = -rng.exponential(1.0, size=(batch, length)).astype(np.float32)
    logp_rollout = logp_old + 0.05 * rng.normal(size=(batch, length)).astype(np.float32)
    logp_new = logp_old + 0.02 * rng.normal(size=(batch, length)).astype(np.float32)
    lengths = rng.integers(length // 4, length + 1, size=(batch, 1))
    mask = (np.arange(length)[None, :] < lengths).astype(np.float32)
    advantages = rng.normal(size=(batch,)).astype(np.float32)
    return [jnp.asarray(x) for x in (logp_new, logp_old, advantages, mask, logp_rollout)]


def _step(correction):
    loss_fn = grpo.make_loss(correction=correction)

    @jax.jit
    def step(logp_new, logp_old, advantages, mask, logp_rollout):
        rollout = None if correction is None else logp_rollout
        return jax.grad(loss_fn, has_aux=True)(
            logp_new, logp_old, advantages, mask, logp_rollout_BT=rollout
        )

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=512, help="sequences B")
    parser.add_argument("--length", type=int, default=1024, help="response tokens T")
    parser.add_argument("--reps", type=int, default=30, help="timed repetitions per arm")
    parser.add_argument("--warmup", type=int, default=3, help="untimed calls per arm")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    arms = {
        "no_correction": _step(None),
        "uncorrected": _step(ais.uncorrected()),
        "truncated": _step(ais.truncated()),
        "adaptive": _step(ais.adaptive()),
    }
    inputs = _inputs(args.batch, args.length, args.seed)
    for step in arms.values():
        for _ in range(args.warmup):
            jax.block_until_ready(step(*inputs))
    times: dict[str, list[float]] = {name: [] for name in arms}
    for _ in range(args.reps):
        for name, step in arms.items():
            start = time.perf_counter()
            jax.block_until_ready(step(*inputs))
            times[name].append(time.perf_counter() - start)

    print(f"device={jax.devices()[0]} B={args.batch} T={args.length} reps={args.reps}")
    bare, base = statistics.median(times["no_correction"]), statistics.median(times["uncorrected"])
    for name, samples in times.items():
        median = statistics.median(samples)
        print(
            f"{name:>13}: median {median * 1e3:8.3f} ms   ratio vs uncorrected "
            f"{median / base:.3f}   vs no_correction {median / bare:.3f}"
        )


if __name__ == "__main__":
    main()
