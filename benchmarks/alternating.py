"""What the side-by-side `generate` benchmarks share (`fp8_codes.py`, `dot_dtype.py`,
`fused_projections.py`, `decode_layouts.py`): prompts drawn in GRPO groups, and compiled
programs timed by alternating their calls, so that a shared machine's drift hits every arm
alike."""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Hashable, Sequence

import jax
import jax.numpy as jnp
import numpy as np


def grouped_prompts(
    vocab_size: int, batch: int, group: int, length: int, *, low: int = 0, avoid=None
) -> tuple[int, np.ndarray, jax.Array]:
    """``batch`` rows of random prompts of ``length`` ids in ``[low, vocab_size)``, each of
    ``batch // group`` prompts repeated for its ``group`` consecutive rows (``group`` capped at
    the batch; id ``avoid`` replaced by 0). Returns the group, the distinct prompts ``[N, P]``
    and the rows ``[B, P]`` (int32)."""
    group = min(group, batch)
    if batch % group:
        raise ValueError(f"--group {group} must divide the batch {batch}")
    prompts_NP = np.random.default_rng(0).integers(low, vocab_size, (batch // group, length))
    if avoid is not None:
        prompts_NP = np.where(prompts_NP == avoid, 0, prompts_NP)
    return group, prompts_NP, jnp.asarray(np.repeat(prompts_NP, group, axis=0), jnp.int32)


def alternate(
    programs: dict[Hashable, tuple[Callable, tuple]], rounds: int
) -> tuple[dict[Hashable, object], dict[Hashable, float]]:
    """Each ``name -> (compiled, args)`` called once (warm-up; its output kept), then all of
    them ``rounds`` times, every other round in reverse order. Returns the warm-up outputs and
    each program's median seconds per call."""
    outputs = {name: jax.block_until_ready(fn(*args)) for name, (fn, args) in programs.items()}
    times: dict[Hashable, list[float]] = {name: [] for name in programs}
    for r in range(rounds):
        for name in list(programs)[:: -1 if r % 2 else 1]:
            fn, args = programs[name]
            t = time.perf_counter()
            jax.block_until_ready(fn(*args))
            times[name].append(time.perf_counter() - t)
    return outputs, {name: statistics.median(t) for name, t in times.items()}


def names(parser: argparse.ArgumentParser, option: str, text: str, allowed: Sequence[str]):
    """The comma-separated names of ``option``; the parser exits naming any not in ``allowed``."""
    chosen = text.split(",")
    if bad := [name for name in chosen if name not in allowed]:
        parser.error(f"unknown {option} {bad}; choose from {list(allowed)}")
    return chosen


def batch_sizes(parser: argparse.ArgumentParser, text: str) -> list[int]:
    """``--batches``: comma-separated positive integers, or the parser exits naming the text."""
    if not all(b.isdigit() and int(b) > 0 for b in text.split(",")):
        parser.error(f"--batches {text!r}: positive integers separated by commas")
    return [int(b) for b in text.split(",")]
