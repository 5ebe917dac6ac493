"""The chunked delta rule's unit-triangular systems: block inverse vs LAPACK triangular solve.

`qwen35.gated_delta_rule_chunked` needs, per chunk, ``(I + A)^-1 rhs`` for a strictly
lower-triangular ``A`` (``[B, Y, U, Z, Z]``) and ``rhs = [beta V, beta exp(G) K]``. It uses
`qwen35.unit_lower_inverse` (block inversion by batched matmuls) and one matmul. The
alternative, `jax.scipy.linalg.solve_triangular`, lowers on XLA:CPU to jaxlib's LAPACK `trsm`
custom call, which deadlocked the Qwen3.5 training step at batch >= 64 (jaxlib 0.10.2, 2 CPU
threads). This script times both solves side by side on the same inputs (interleaved, best of
``--repeats``) at a prefill's shape and checks they agree, so the replacement's speed is
measured, not assumed. At ``--batch 1`` the LAPACK path does not deadlock.

    python benchmarks/delta_rule.py                    # 1 x 2,048 tokens, 8 heads, Z = 64
    python benchmarks/delta_rule.py --tokens 512 --batch 4
"""

from __future__ import annotations

import argparse
import os
import time

import jax
import jax.numpy as jnp

from ais_jax import qwen35
from ais_jax.provenance import cpu_model


def inputs(batch: int, tokens: int, heads: int, head_dim: int, chunk: int):
    """A chunked rule's ``A`` (normalised keys, write strengths in (0, 1), decays <= 1) and
    its right-hand side, ``[B, Y, U, Z, Z]`` and ``[B, Y, U, Z, 2 * head_dim]``."""
    ks = jax.random.split(jax.random.key(0), 4)
    shape = (batch, tokens // chunk, heads, chunk)
    k = jax.random.normal(ks[0], (*shape, head_dim))
    k = k / jnp.linalg.norm(k, axis=-1, keepdims=True)
    beta = jax.random.uniform(ks[1], shape)
    G = jnp.cumsum(-0.1 * jax.random.uniform(ks[2], shape), axis=-1)
    strict = jnp.tril(jnp.ones((chunk, chunk), bool), -1)
    decay = jnp.where(strict, jnp.exp(jnp.where(strict, G[..., :, None] - G[..., None, :], 0)), 0)
    a = jnp.einsum("...zi,...xi->...zx", k * beta[..., None], k) * decay
    rhs = jax.random.normal(ks[3], (*shape, 2 * head_dim))
    return a, rhs


def block_inverse(a, rhs):
    return jnp.einsum("...zx,...xc->...zc", qwen35.unit_lower_inverse(a), rhs)


def lapack_solve(a, rhs):
    unit_lower = a + jnp.eye(a.shape[-1], dtype=a.dtype)
    return jax.scipy.linalg.solve_triangular(unit_lower, rhs, lower=True, unit_diagonal=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--chunk", type=int, default=64)
    p.add_argument("--repeats", type=int, default=7)
    args = p.parse_args()
    if args.tokens % args.chunk:
        p.error(f"--tokens ({args.tokens}) must be a multiple of --chunk ({args.chunk})")
    a, rhs = inputs(args.batch, args.tokens, args.heads, args.head_dim, args.chunk)
    arms = {"block inverse": jax.jit(block_inverse), "LAPACK trsm": jax.jit(lapack_solve)}
    out = {name: f(a, rhs).block_until_ready() for name, f in arms.items()}
    best = dict.fromkeys(arms, float("inf"))
    for _ in range(args.repeats):
        for name, f in arms.items():
            t0 = time.perf_counter()
            f(a, rhs).block_until_ready()
            best[name] = min(best[name], time.perf_counter() - t0)
    diff = float(jnp.abs(out["block inverse"] - out["LAPACK trsm"]).max())
    scale = float(jnp.abs(out["LAPACK trsm"]).max())
    print(
        f"CPU: {cpu_model()}, {os.cpu_count()} CPUs; jax {jax.__version__}; load "
        f"{os.getloadavg()[0]:.1f}; A {tuple(a.shape)}, rhs {tuple(rhs.shape)}"
    )
    print(f"max |block inverse - trsm| = {diff:.2e} (max |solution| {scale:.2e})")
    print(f"| solve | best of {args.repeats} | vs LAPACK trsm |\n|---|---|---|")
    for name, t in best.items():
        print(f"| {name} | {t * 1e3:.1f} ms | {t / best['LAPACK trsm']:.2f}x |")


if __name__ == "__main__":
    main()
