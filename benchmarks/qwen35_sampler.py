"""Qwen3.5 sampling speed on CPU: `ais_jax.generate` vs transformers' `generate` on the same
random Qwen3.5-shaped checkpoint, and a 2,048-token prefill of Qwen3.5 vs the same-size Qwen3
(#17 item 6).

One run does both, each engine in its own subprocess (`common.run_child`; transformers runs
sampler.py's `worker_hf` under ``--hf-python``, default this interpreter, as in sampler.py):

1. **Decode.** A random `Qwen3_5ForCausalLM` (float32 weights, `save_pretrained`) of the
   ``--size`` shape is sampled by ``ais_jax`` (`load_hf` + `decode_params` once, then
   `generate`: one jitted prefill + `lax.while_loop` decode carrying the KV cache of the
   attention layers and each Gated DeltaNet layer's conv + recurrent state) and by ``hf``
   (transformers `generate`: do_sample, T=1, top_k=0, top_p=1, exactly ``--new-tokens``
   tokens, use_cache; its Gated DeltaNet runs the torch fallback kernels when
   flash-linear-attention is not installed, as here). Prompts: ``--batch`` rows of 32 random
   ids. Reported: first call (compile + run), best / median steady call, decode tokens/s =
   batch * new_tokens / best call, and the ratio ais_jax / hf (the issue's target: >= 1.5x).
2. **Prefill.** ais_jax's prefill (`model.forward_cached` into an empty cache, last-position
   logits, as `generate` runs it) of ``--prefill-batch`` x ``--prefill-len`` (2,048) tokens,
   for the Qwen3.5 shape and a Qwen3 of the same D, L, H, K, E, F, V; the ratio Qwen3.5 /
   Qwen3 (target <= 3x). The Qwen3.5 prefill is the chunked delta rule (chunks of 64 tokens).

    python benchmarks/qwen35_sampler.py                   # small, batch 8, 64 tokens, f32
    python benchmarks/qwen35_sampler.py --size tiny --new-tokens 32 --repeats 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

import common
import sampler

# Qwen3 shapes of the benchmarks' `common.SIZES`, plus the Gated DeltaNet heads of the Qwen3.5
# shape: every 4th layer full attention (Qwen3.5's pattern), linear heads of the attention's
# head dim, J = K key heads and U = H value heads.
SHAPES = common.SIZES


def qwen35_hf_config(s: dict) -> dict:
    """The `Qwen3_5TextConfig` fields of a shape (tied embeddings, as sampler.py's Qwen3)."""
    return dict(
        **common.hf_shape(s),
        layer_types=[
            "full_attention" if (i + 1) % 4 == 0 else "linear_attention"
            for i in range(s["num_layers"])
        ],
        linear_num_key_heads=s["num_kv_heads"],
        linear_num_value_heads=s["num_heads"],
        linear_key_head_dim=s["head_dim"],
        linear_value_head_dim=s["head_dim"],
        tie_word_embeddings=True,
        max_position_embeddings=4096,
    )


def worker_ckpt(a) -> dict:
    import torch
    import transformers

    torch.manual_seed(a.seed)
    cfg = transformers.Qwen3_5TextConfig(**qwen35_hf_config(json.loads(a.shape)))
    model = transformers.Qwen3_5ForCausalLM(cfg).to(torch.float32)
    model.save_pretrained(a.ckpt)
    n = sum(p.numel() for p in model.parameters())
    return {"params": n, "transformers": transformers.__version__, "torch": torch.__version__}


def worker_ais_jax(a) -> dict:
    import functools

    import jax
    import jax.numpy as jnp

    from ais_jax.io.hf import load_hf
    from ais_jax.rollout.sampler import decode_params

    dtype = jnp.float32 if a.dtype == "f32" else jnp.bfloat16
    config, params = load_hf(a.ckpt, dtype=dtype)
    prepare = jax.jit(functools.partial(decode_params, config=config))  # once per weight sync
    params = jax.block_until_ready(prepare(params))
    # sampler.py's timing of `generate`: its prompts, T=1, exactly --new-tokens tokens
    return {**sampler.timed_generate(params, config, a), "version": f"jax {jax.__version__}"}


def worker_prefill(a) -> dict:
    """ais_jax's prefill of ``--prefill-batch`` x ``--prefill-len`` random tokens for the
    Qwen3.5 shape (``--family qwen3.5``) or the same-size Qwen3: best of ``--repeats``."""
    import dataclasses

    import jax
    import jax.numpy as jnp

    from ais_jax import models as model
    from ais_jax.models import qwen35
    from ais_jax.models.qwen3 import ModelConfig

    s = json.loads(a.shape)
    dtype = jnp.float32 if a.dtype == "f32" else jnp.bfloat16
    S = a.prefill_len
    if a.family == "qwen3.5":
        hf = qwen35_hf_config(s) | {"model_type": "qwen3_5_text", "max_position_embeddings": S}
        config = qwen35.Qwen35Config.from_hf_dict(hf)
    else:
        config = dataclasses.replace(ModelConfig.tiny(), max_position_embeddings=S, **s)
    params = model.init_params(config, jax.random.key(a.seed), dtype)
    tokens = jnp.asarray(common.prompt_ids(s["vocab_size"], (a.batch, S), a.seed))

    @jax.jit
    def prefill(params, tokens_BS):
        cache = model.init_cache(config, tokens_BS.shape[0], S, dtype)
        logits, cache = model.forward_cached(params, config, tokens_BS, cache, last_only=True)
        return logits, cache

    def call(i):
        jax.block_until_ready(prefill(params, tokens))
        return S

    return {**common.timed_calls(call, a.repeats), "params": config.num_params}


WORKERS = {
    "ckpt": worker_ckpt,
    "ais_jax": worker_ais_jax,
    "hf": sampler.worker_hf,
    "prefill": worker_prefill,
}


def spawn(args, worker: str, *, ckpt: str = "", batch: int = 1, family: str = "") -> dict:
    python = args.hf_python if worker in ("hf", "ckpt") else sys.executable
    cmd = [python, os.path.abspath(__file__), "--worker", worker, "--ckpt", ckpt]
    cmd += ["--shape", json.dumps(SHAPES[args.size]), "--dtype", args.dtype]
    cmd += ["--batch", str(batch), "--new-tokens", str(args.new_tokens)]
    cmd += ["--repeats", str(args.repeats), "--seed", str(args.seed)]
    cmd += ["--threads", str(args.threads), "--family", family]
    cmd += ["--prefill-len", str(args.prefill_len)]
    env = common.child_env(common.REPO)
    return common.run_child(cmd, env, timeout=args.timeout, verbose=args.verbose)


def _summary(r: dict) -> str:
    """First call, best and median steady call, and the best call's process CPU time (other
    load on a shared machine inflates wall time, hardly CPU time)."""
    if "error" in r:
        return f"ERROR {r['error']}"
    best, median = min(r["steady_s"]), statistics.median(r["steady_s"])
    return (
        f"first {r['first_s']:7.2f} s   best {best:7.3f} s   median {median:7.3f} s   "
        f"cpu {min(r['cpu_s']):7.3f} s"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", default="small", choices=sorted(SHAPES))
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--dtype", default="f32", choices=("f32", "bf16"))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--prefill-len", type=int, default=2048)
    p.add_argument("--prefill-batch", type=int, default=1)
    p.add_argument("--hf-python", default=os.environ.get("AIS_BENCH_HF_PYTHON", sys.executable))
    p.add_argument("--threads", type=int, default=0, help="torch threads for hf (0: default)")
    p.add_argument("--timeout", type=int, default=1800, help="seconds per worker")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--verbose", action="store_true")
    p.add_argument("--worker", choices=sorted(WORKERS), help=argparse.SUPPRESS)
    p.add_argument("--ckpt", help=argparse.SUPPRESS)
    p.add_argument("--shape", help=argparse.SUPPRESS)
    p.add_argument("--family", default="", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return common.run_worker(WORKERS[args.worker], args)

    print(f"{common.host_line()}; load {os.getloadavg()[0]:.1f}")
    print(f"shape {args.size}: {SHAPES[args.size]}, dtype {args.dtype}")
    with tempfile.TemporaryDirectory() as tmp:
        made = spawn(args, "ckpt", ckpt=tmp)
        if "error" in made:
            sys.exit(f"checkpoint: {made['error']}")
        print(f"checkpoint: Qwen3.5 {made['params'] / 1e6:.1f}M parameters ({made})")
        decode = {e: spawn(args, e, ckpt=tmp, batch=args.batch) for e in ("ais_jax", "hf")}
    n = args.batch * args.new_tokens
    print(f"\ndecode: batch {args.batch} x {args.new_tokens} new tokens (32-token prompts)")
    rates = {}
    for engine, r in decode.items():
        rates[engine] = n / min(r["steady_s"]) if "error" not in r else float("nan")
        print(f"  {engine:8} {_summary(r)}   {rates[engine]:9.1f} tok/s   {r.get('version', '')}")
    print(f"  ais_jax / hf: {rates['ais_jax'] / rates['hf']:.2f}x (target >= 1.5x)")

    print(f"\nprefill: {args.prefill_batch} x {args.prefill_len} tokens, ais_jax")
    best = {}
    for family in ("qwen3.5", "qwen3"):
        r = spawn(args, "prefill", batch=args.prefill_batch, family=family)
        best[family] = min(r["steady_s"]) if "error" not in r else float("nan")
        params = f"{r.get('params', 0) / 1e6:.1f}M params"
        print(f"  {family:8} {_summary(r)}   {params}")
    print(f"  qwen3.5 / qwen3: {best['qwen3.5'] / best['qwen3']:.2f}x (target <= 3x)")


if __name__ == "__main__":
    main()
