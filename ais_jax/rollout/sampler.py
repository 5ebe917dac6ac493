"""The autoregressive rollout engine: batched sampling with a KV cache.

`generate` left-pads a batch of prompts, runs one prefill over them, then decodes one token per
row per step until every row has emitted an end-of-sequence id or `max_new_tokens` is reached:
``lax.while_loop(cond, decode_step, state)`` over a `DecodeState`. The whole thing is one jitted
function: `temperature`, `top_k` and `top_p` are runtime values, so changing them does not
recompile. The params may be the BF16 trainer tree or its quantized rollout copy
(`quant.quantize_fp8`): it is the same code, and either may first go through `decode_params`
once per weight sync (the loop's weight layout). Tokens are drawn with a two-level Gumbel-max
(`_draw`): exactly softmax(filtered logits), with noise for N + C values per row, not V.

The model is any autoregressive family (`ais_jax.models`): `models.forward_cached` and
`models.init_cache` reach the config's family, and a Qwen3.5 cache carries, next to the KV
cache of its attention layers, each linear-attention layer's conv and float32 recurrent state
(`qwen35.HybridCache`): the prefill leaves them after the prompt (chunked delta rule), each
decode step advances them by one token, and padding and finished rows leave them untouched.

Dimensions: B rows, P prompt length (left padded), T response length (``max_new_tokens``),
S = P + T KV-cache slots, V vocabulary, N vocabulary blocks of C = 128 ids (`_draw`),
M end-of-sequence ids.

Decode layouts
--------------
How the loop holds the weights it reads at every step is a static, named choice, `DecodeLayout`
(``generate(..., layout=...)``; one compiled program per layout). It changes speed, not the
distribution: every layout holds the same numbers (a dot may sum them in another order).

- ``"out_in_columns"``: unquantized matmul weights (and the LM head) in the model's ``[out,
  in]`` layout, marked `quant.Columns`: a float32 product over at most
  `quant.COLUMNS_MAX_ROWS` rows (every decode step of a batch up to that size) runs as ``(w @
  x^T)^T``, which XLA:CPU's float32 GEMM runs faster than ``x @ w^T`` or a transposed
  ``[in, out]`` copy (docs/benchmarks.md). The default on CPU for float32 models.
- ``"out_in"``: the same weights, plain: every product is ``x @ w^T`` (the form of the FP8 GEMM
  and of cuBLAS / TPU matmuls). The default on GPU and TPU, and on CPU for 16-bit and FP8
  models (XLA:CPU's bfloat16 ``(w @ x^T)^T`` is much slower than its ``x @ w^T``).
- ``"out_in_columns_fused"``, ``"out_in_fused"``: either, with every Qwen3/Qwen2 layer's
  q/k/v and gate/up weights held as one weight each (`qwen3.fuse_projections`, a copy made
  before the loop): two matmuls per layer where there were five, with the same products.
  Never the default: on CPU they helped large-batch FP8 rollouts, left bf16 and float32 ones
  about even and slowed small batches (docs/benchmarks.md); on a GPU, where a decode
  step's time is largely kernel launches, `benchmarks/gpu_fp8.py`'s ``*-fused`` arms are still
  to be run.
  Qwen3.5 layers keep their projections apart.

``layout="auto"`` (the default) is resolved by `default_layout` from `jax.default_backend()`
and the model's compute dtype in Python, before anything is traced; every layout runs in the
CPU test suite. Under every layout, quantized weights keep the ``[out, in]`` layout of the FP8
GEMM, and on CPU, which has no FP8 dot, their codes are held as bfloat16 (`quant.widen_codes`:
the same numbers, converted once before the loop instead of at every step). On a GPU the prefill
multiplies FP8 operands, and decode steps of fewer than `quant.FP8_GEMM_MIN_ROWS` rows the same
codes as bfloat16 (`quant.step_operands`: cuBLASLt's FP8 GEMM was the slower at few rows).

On CPU the program compiles with `compiler_options`: without XLA's while-loop invariant code
motion, which hoisted a transposed copy of every ``[out, in]`` weight (and a float32 copy of the
embedding table) out of the decode loop, so that each step's few-row matmuls read the slow
layout (a Qwen3-0.6B-shaped bf16 decode took markedly longer; docs/benchmarks.md).

Which log-prob goes into the importance ratio
---------------------------------------------
`Rollout` records two log-probs of every sampled token, both at sampling time from the logits the
sampler actually used (as an inference engine returns them):

- ``logp``: under the distribution actually sampled from (temperature, then top-k / top-p
  filtering and renormalisation). This is the exact behaviour probability.
- ``logp_plain``: ``log_softmax(logits / temperature)`` over the full vocabulary, unfiltered.

The rollout-vs-trainer ratio rho_rt = exp(logp_train - logp_rollout) must use **logp_plain**:
`train.logprobs.token_logprobs` computes the trainer side as the same temperature-scaled,
unfiltered log-softmax, so the ratio then measures only the FP8-vs-BF16 difference. Using the
filtered ``logp`` would add log(kept probability mass) to every token's log-ratio, a "mismatch"
that is really the top-p/top-k renormalisation (a known source of false mismatch in RL frameworks).
With the default full-vocabulary sampling (top_k=None, top_p=None) the two are identical.
"""

from __future__ import annotations

import dataclasses
import functools
import numbers
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from ais_jax import models
from ais_jax.models import Config
from ais_jax.models.qwen3 import QKV_PROJ
from ais_jax.nn.cache import KVCache
from ais_jax.nn.layers import GATE_UP_PROJ, Params, check_prompt_group
from ais_jax.nn.quant import PROJECTIONS, Columns, QArray, step_operands, widen_codes

# The matmul weights `decode_params` lays out: a layer's own and `fuse_projections`' fused ones.
_MATMUL_WEIGHTS = (*PROJECTIONS, QKV_PROJ, GATE_UP_PROJ)


@struct.dataclass
class Rollout:
    """A batch of sampled responses. P prompt length (left padded), T = max_new_tokens.

    tokens/mask ``[B, T]``: the response (its end-of-sequence token included, then padding);
    logp/logp_plain ``[B, T]`` float32 (0 under padding): see the module docstring;
    lengths ``[B]``; finished ``[B]``: the row emitted an end-of-sequence id.
    """

    prompt_tokens: jax.Array
    prompt_mask: jax.Array
    tokens: jax.Array
    mask: jax.Array
    logp: jax.Array
    logp_plain: jax.Array
    lengths: jax.Array
    finished: jax.Array


def pad_prompts(
    prompts: Sequence[Sequence[int]], pad_id: int = 0, length: int | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Left-pad token lists to ``[B, P]`` (``P`` = ``length`` or the longest prompt)."""
    if len(prompts) == 0:
        raise ValueError("generate needs at least one prompt; got an empty batch.")
    longest = max(len(p) for p in prompts)
    if longest == 0 or min(len(p) for p in prompts) == 0:
        raise ValueError("Every prompt needs at least one token; got an empty prompt.")
    length = longest if length is None else length
    if longest > length:
        raise ValueError(f"A prompt has {longest} tokens, more than the padded length {length}.")
    tokens = np.full((len(prompts), length), pad_id, np.int32)
    mask = np.zeros((len(prompts), length), bool)
    for row, p in enumerate(prompts):
        tokens[row, length - len(p) :] = p
        mask[row, length - len(p) :] = True
    return tokens, mask


def filter_logits(logits_BV: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """Top-k then top-p (nucleus) filtering with traced ``top_k`` (int) and ``top_p`` (float).

    Keeps the ``top_k`` largest logits, then the smallest prefix of them (by probability,
    renormalised over the top-k) whose mass reaches ``top_p``; the rest become -inf. With
    ``top_k == 1`` (greedy) that is every logit equal to the row's maximum, computed without
    the sort (which costs seconds per token at a 151,936-id vocabulary on CPU).
    """
    return jax.lax.cond(
        top_k == 1,
        lambda: jnp.where(
            logits_BV >= jnp.max(logits_BV, axis=-1, keepdims=True), logits_BV, -jnp.inf
        ),
        lambda: _sort_filter(logits_BV, top_k, top_p),
    )


def _sort_filter(
    logits_BV: jax.Array, top_k: jax.Array, top_p: jax.Array, candidates: int = 1024
) -> jax.Array:
    """`filter_logits` for ``top_k > 1``: in descending order s_0 >= s_1 >= ..., rank i is kept
    iff i < top_k and sum_{j < i} p_j < top_p (always when ``top_p >= 1``, where float32
    masses may round up to 1 before the last rank), p_j = exp(s_j - s_0) / Z with Z the sum
    over the ``top_k`` ranks; every logit >= the smallest kept s_i stays (ties included).

    The kept ranks are a prefix, so they come from the ``candidates`` largest logits
    (`jax.lax.top_k`, C = min(V, candidates)) whenever every row's prefix ends inside them:
    ``top_k <= C`` (Z is then a sum over the C), or ``top_k = V`` (Z over the whole row) and
    the C largest hold at least ``top_p`` of the mass. Otherwise the whole vocabulary is sorted
    (`lax.cond`): at V = 151,936 on CPU a sort of the rows costs seconds, the top-C a tenth
    of a second. Both paths keep the same set (up to float rounding of the masses, summed in
    another order).
    """
    V = logits_BV.shape[-1]
    C = min(V, candidates)

    def threshold(sorted_BC, rank_BC, Z_B1):
        probs_BC = jnp.exp(sorted_BC - sorted_BC[:, :1]) / Z_B1
        cum_BC = jnp.cumsum(probs_BC, axis=-1)
        keep_BC = ((cum_BC - probs_BC < top_p) | (top_p >= 1.0)) & (rank_BC < top_k)
        threshold_B1 = jnp.min(jnp.where(keep_BC, sorted_BC, jnp.inf), axis=-1, keepdims=True)
        return threshold_B1, cum_BC[:, -1]

    def sorted_threshold():
        sorted_BV = -jnp.sort(-logits_BV, axis=-1)
        rank_BV = jax.lax.broadcasted_iota(jnp.int32, sorted_BV.shape, 1)
        sorted_BV = jnp.where(rank_BV < top_k, sorted_BV, -jnp.inf)
        Z_B1 = jnp.sum(jnp.exp(sorted_BV - sorted_BV[:, :1]), axis=-1, keepdims=True)
        return threshold(sorted_BV, rank_BV, Z_B1)[0]

    top_BC, _ = jax.lax.top_k(logits_BV, C)
    rank_BC = jax.lax.broadcasted_iota(jnp.int32, top_BC.shape, 1)
    top_BC = jnp.where(rank_BC < top_k, top_BC, -jnp.inf)
    all_B1 = jnp.sum(jnp.exp(logits_BV - top_BC[:, :1]), axis=-1, keepdims=True)
    within_B1 = jnp.sum(jnp.exp(top_BC - top_BC[:, :1]), axis=-1, keepdims=True)
    threshold_B1, mass_B = threshold(top_BC, rank_BC, jnp.where(top_k <= C, within_B1, all_B1))
    inside = (top_k <= C) | ((top_k >= V) & jnp.all(mass_B >= top_p))
    threshold_B1 = jax.lax.cond(inside, lambda: threshold_B1, sorted_threshold)
    return jnp.where(logits_BV >= threshold_B1, logits_BV, -jnp.inf)


def _first_argmax(x_BV: jax.Array) -> jax.Array:
    """``argmax`` over the last axis (first index of the maximum), as two one-operand reductions:
    XLA:CPU vectorizes a max and a min, but not the (value, index) pair reduction of
    ``jnp.argmax``, which dominated decode time at large vocabularies."""
    V = x_BV.shape[-1]
    max_B1 = jnp.max(x_BV, axis=-1, keepdims=True)
    index_BV = jax.lax.broadcasted_iota(jnp.int32, x_BV.shape, x_BV.ndim - 1)
    first_B = jnp.min(jnp.where(x_BV == max_B1, index_BV, V), axis=-1)
    return jnp.minimum(first_B, V - 1)  # a NaN row matches nothing: keep the id in range


_BLOCK = 128  # C: vocabulary ids per block of the two-level draw


def _draw(key: jax.Array, logits_BV: jax.Array) -> tuple[jax.Array, jax.Array]:
    """One token per row from ``softmax(logits_BV)`` and its log-prob, with Gumbel noise for
    ``N + C`` values per row instead of ``V``.

    The vocabulary is cut into N = ceil(V / C) blocks of C = 128 ids (the last one padded with
    -inf). A Gumbel-max draw over the log block masses picks a block with probability (its
    mass) / (total mass); a second one over the block's logits picks an id with probability
    (its weight) / (block mass): the product is exactly softmax(logits). The block masses are
    the sums of ``exp(logits - max)`` that the log-softmax needs anyway, so the pass over the
    vocabulary computes no noise at all; drawing noise for every id
    (`jax.random.categorical`) cost more than the rest of sampling on CPU.
    """
    B, V = logits_BV.shape
    C = _BLOCK
    N = -(-V // C)
    x_BNC = jnp.pad(logits_BV, ((0, 0), (0, N * C - V)), constant_values=-jnp.inf)
    x_BNC = x_BNC.reshape(B, N, C)
    max_B11 = jnp.max(x_BNC, axis=(1, 2), keepdims=True)
    mass_BN = jnp.sum(jnp.exp(x_BNC - max_B11), axis=-1)
    block_key, id_key = jax.random.split(key)
    block_B = _first_argmax(jnp.log(mass_BN) + jax.random.gumbel(block_key, (B, N)))
    inner_BC = jnp.take_along_axis(x_BNC, block_B[:, None, None], axis=1)[:, 0]
    id_B = _first_argmax(inner_BC + jax.random.gumbel(id_key, (B, C)))
    logit_B = jnp.take_along_axis(inner_BC, id_B[:, None], axis=-1)[:, 0]
    logp_B = logit_B - max_B11[:, 0, 0] - jnp.log(jnp.sum(mass_BN, axis=-1))
    return jnp.minimum(block_B * C + id_B, V - 1), logp_B


def _sample(key, logits_BV, temperature, top_k, top_p):
    """One token per row, with its filtered (sampled-from) and plain log-probs (`_draw` from
    the temperature-scaled logits, top-k / top-p filtered when either is active)."""
    scaled_BV = logits_BV.astype(jnp.float32) / temperature
    V = scaled_BV.shape[-1]

    def plain(scaled_BV):
        token_B, logp_B = _draw(key, scaled_BV)
        return token_B, logp_B, logp_B

    def filtered(scaled_BV):
        token_B, logp_B = _draw(key, filter_logits(scaled_BV, top_k, top_p))
        plain_BV = jax.nn.log_softmax(scaled_BV, axis=-1)
        return token_B, logp_B, jnp.take_along_axis(plain_BV, token_B[:, None], axis=-1)[:, 0]

    return jax.lax.cond((top_k < V) | (top_p < 1.0), filtered, plain, scaled_BV)


# ---- decode layouts -------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class DecodeLayout:
    """How the decode loop holds the weights it reads at every step (see the module docstring).

    ``columns``: unquantized matmul weights and the LM head as `quant.Columns` (the model's
    ``[out, in]`` arrays themselves, marked), whose float32 products over few rows run as
    ``(w @ x^T)^T``; otherwise plain ``[out, in]`` arrays. Quantized weights keep the ``[out,
    in]`` layout of the FP8 GEMM under either. ``fused``: each layer's q/k/v and gate/up
    weights held as one each (`qwen3.fuse_projections`). Hashable: `generate` compiles one
    program per layout.
    """

    name: str
    columns: bool
    fused: bool = False


DECODE_LAYOUTS: dict[str, DecodeLayout] = {
    layout.name: layout
    for layout in (
        DecodeLayout("out_in_columns", columns=True),
        DecodeLayout("out_in", columns=False),
        DecodeLayout("out_in_columns_fused", columns=True, fused=True),
        DecodeLayout("out_in_fused", columns=False, fused=True),
    )
}


def default_layout(backend: str | None = None, dtype=jnp.bfloat16) -> str:
    """The name of the layout ``"auto"`` picks for a model computing in ``dtype`` on ``backend``
    (default: `jax.default_backend()`): ``"out_in_columns"`` for float32 models on CPU, else
    ``"out_in"``."""
    backend = jax.default_backend() if backend is None else backend
    if backend == "cpu" and jnp.dtype(dtype) == jnp.float32:
        return "out_in_columns"
    return "out_in"


def resolve_layout(layout: str | DecodeLayout = "auto", dtype=jnp.bfloat16) -> DecodeLayout:
    """A `DecodeLayout` from a name of `DECODE_LAYOUTS`, ``"auto"`` (`default_layout` for a
    model computing in ``dtype``), or a `DecodeLayout` itself. Plain Python: call it before
    tracing, never on traced values."""
    if isinstance(layout, DecodeLayout):
        return layout
    name = default_layout(dtype=dtype) if isinstance(layout, str) and layout == "auto" else layout
    if not isinstance(name, str) or name not in DECODE_LAYOUTS:
        raise ValueError(
            f"Unknown decode layout {layout!r}; valid layouts: {['auto', *DECODE_LAYOUTS]} "
            f"(or a sampler.DecodeLayout)."
        )
    return DECODE_LAYOUTS[name]


def compiler_options(backend: str | None = None) -> dict[str, str]:
    """The XLA options the decode program compiles with on ``backend`` (default:
    `jax.default_backend()`); none off CPU. A caller that jits `generate` inside its own
    program passes them to its `jax.jit` (the outer program's options are the ones XLA uses).

    On CPU, XLA's while-loop invariant code motion is off. It hoisted a transposed copy of every
    ``[out, in]`` weight and a float32 copy of the embedding table out of the decode loop:
    slower steps (the few-row matmuls then read ``[in, out]``; docs/benchmarks.md), and the
    copies' memory on top of the weights.
    """
    backend = jax.default_backend() if backend is None else backend
    if backend != "cpu":
        return {}
    return {"xla_disable_hlo_passes": "while-loop-invariant-code-motion"}


def decode_params(
    params: Params,
    layout: str | DecodeLayout = "auto",
    config: Config | None = None,
) -> Params:
    """The params as the decode loop reads them under ``layout``: layers unstacked
    (`models.unstack_layers`; a Qwen3.5 tree, stacked per layer kind, needs its ``config``) so
    no step slices the stacked arrays again, and with ``columns`` every unquantized matmul
    weight (and the LM head, the embedding table itself when tied) marked `quant.Columns`;
    without it, `Columns` weights are plain arrays again. Quantized weights keep their ``[out,
    in]`` layout; on CPU their codes are held as bfloat16 (`quant.widen_codes`: the same
    numbers in a copy of 2 bytes per weight, made here once rather than converted at every
    step). A ``fused`` layout holds each Qwen3/Qwen2 layer's q/k/v and gate/up weights as one
    (the family's `Family.fuse_projections`, a copy; it needs ``config``), and fused layers
    stay fused under any layout (the model reads both forms). No other plain weight is copied.

    `generate` applies it to whatever it is given (inside its jit, before the loop); applied
    twice with one layout it changes nothing. Calling it yourself once per weight sync, as
    `quantize_fp8` is, saves unstacking the layers on every later `generate` call.
    """
    layout = resolve_layout(layout, params["embed"].dtype)
    columns = layout.columns
    params = models.unstack_layers(params, config)
    layers = [
        {name: _relayout(w, columns) if name in _MATMUL_WEIGHTS else w for name, w in layer.items()}
        for layer in params["layers"]
    ]
    apart = any("q_proj" in layer or "gate_proj" in layer for layer in layers)
    if layout.fused and config is None and apart:
        raise ValueError(f"decode layout {layout.name!r} fuses projections: pass the config.")
    fuse = None if config is None else models.family_of(config).fuse_projections
    if layout.fused and fuse is not None:  # a family without it (Qwen3.5) keeps them apart
        layers = [fuse(layer, config) for layer in layers]
    params = {**params, "layers": layers}
    if columns or "lm_head" in params:
        params["lm_head"] = _relayout(params.get("lm_head", params["embed"]), columns)
    return params


def _relayout(w, columns: bool):
    """A matmul weight as `quant.Columns` (``columns``) or as a plain ``[out, in]`` array;
    quantized weights (`QArray`) as `quant.widen_codes` holds them."""
    if isinstance(w, QArray):
        return widen_codes(w)
    if isinstance(w, Columns) == columns:
        return w
    return Columns(w) if columns else w.w_OI


# ---- the decode loop --------------------------------------------------------------------------


@struct.dataclass
class DecodeState:
    """The carry of the decode loop, after ``step`` response positions have been emitted.

    cache: the KV cache (S = P + T slots; for Qwen3.5 a `qwen35.HybridCache`, which adds
    each linear-attention layer's conv and recurrent state); key: the rollout key (step t draws with
    ``fold_in(key, t)``); last_B: the token emitted at step - 1, fed to the next forward;
    done_B: the row has emitted an end-of-sequence id; tokens_BT / mask_BT / logp_BT /
    logp_plain_BT: the `Rollout` fields, filled up to column ``step`` (pad_id / 0 beyond).
    """

    step: jax.Array
    cache: KVCache
    key: jax.Array
    last_B: jax.Array
    done_B: jax.Array
    tokens_BT: jax.Array
    mask_BT: jax.Array
    logp_BT: jax.Array
    logp_plain_BT: jax.Array


def _generate(
    params,
    config,
    prompt_BP,
    prompt_mask_BP,
    key,
    temperature,
    top_k,
    top_p,
    *,
    max_new_tokens,
    eos_ids,
    pad_id,
    layout: str | DecodeLayout = "auto",
    prompt_group: int = 1,
):
    B, P = prompt_BP.shape
    T, G = max_new_tokens, prompt_group
    params = decode_params(params, layout, config)  # `generate` passes the layout resolved
    dtype = params["embed"].dtype
    # the prefill: each distinct prompt once (the first row of its group), then every row's copy
    cache = models.init_cache(config, B // G, P + T, dtype)
    logits_B1V, cache = models.forward_cached(
        params, config, prompt_BP[::G], cache, prompt_mask_BP[::G], last_only=True
    )
    if G > 1:  # every cache array but the slot index has rows first
        share = lambda x: jnp.repeat(x, G, axis=0) if x.ndim else x  # noqa: E731
        logits_B1V, cache = share(logits_B1V), jax.tree.map(share, cache)
    eos_M = jnp.asarray(eos_ids if eos_ids else (-1,), jnp.int32)

    def emit(state: DecodeState, logits_BV: jax.Array) -> DecodeState:
        """Sample response position ``state.step`` from ``logits_BV`` (pad_id in done rows)."""
        t = state.step
        token_B, logp_B, logp_plain_B = _sample(
            jax.random.fold_in(state.key, t), logits_BV, temperature, top_k, top_p
        )
        live_B = ~state.done_B
        token_B = jnp.where(live_B, token_B, pad_id)
        write = lambda x_BT, x_B: jax.lax.dynamic_update_slice(x_BT, x_B[:, None], (0, t))  # noqa: E731
        return state.replace(
            step=t + 1,
            last_B=token_B,
            done_B=state.done_B | (live_B & jnp.isin(token_B, eos_M)),
            tokens_BT=write(state.tokens_BT, token_B),
            mask_BT=write(state.mask_BT, live_B),
            logp_BT=write(state.logp_BT, jnp.where(live_B, logp_B, 0.0)),
            logp_plain_BT=write(state.logp_plain_BT, jnp.where(live_B, logp_plain_B, 0.0)),
        )

    def cond(state: DecodeState) -> jax.Array:
        return (state.step < T) & ~jnp.all(state.done_B)

    step_params = step_operands(params, B)  # B-row matmuls: FP8 codes as bf16 on a GPU

    def decode_step(state: DecodeState) -> DecodeState:
        """One token per row: a forward of the last tokens (done rows masked) over the cache."""
        logits_B1V, cache = models.forward_cached(
            step_params, config, state.last_B[:, None], state.cache, ~state.done_B[:, None]
        )
        return emit(state.replace(cache=cache), logits_B1V[:, 0])

    start = DecodeState(
        step=jnp.zeros((), jnp.int32),
        cache=cache,
        key=key,
        last_B=jnp.zeros((B,), jnp.int32),
        done_B=jnp.zeros((B,), bool),
        tokens_BT=jnp.full((B, T), pad_id, jnp.int32),
        mask_BT=jnp.zeros((B, T), bool),
        logp_BT=jnp.zeros((B, T), jnp.float32),
        logp_plain_BT=jnp.zeros((B, T), jnp.float32),
    )
    state = jax.lax.while_loop(cond, decode_step, emit(start, logits_B1V[:, 0]))
    return Rollout(
        prompt_tokens=prompt_BP,
        prompt_mask=prompt_mask_BP,
        tokens=state.tokens_BT,
        mask=state.mask_BT,
        logp=state.logp_BT,
        logp_plain=state.logp_plain_BT,
        lengths=state.mask_BT.sum(-1, dtype=jnp.int32),
        finished=state.done_B,
    )


_STATIC = ("config", "max_new_tokens", "eos_ids", "pad_id", "layout", "prompt_group")


def _generate_jit(traced: bool = False) -> Callable:
    """`_generate` jitted with the `compiler_options` of the default backend (one jitted
    function, and so one compile cache, per set of options); with none when ``traced`` (inside
    another transform's trace, where only the outermost `jax.jit` may carry options)."""
    options = {} if traced else compiler_options()
    return _jit_with(tuple(sorted(options.items())))


@functools.cache
def _jit_with(options: tuple[tuple[str, str], ...]) -> Callable:
    return jax.jit(_generate, static_argnames=_STATIC, compiler_options=dict(options) or None)


def generate(
    params: Params,
    config: Config,
    prompts,
    key: jax.Array,
    *,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_ids: Sequence[int] = (),
    pad_id: int = 0,
    prompt_mask=None,
    layout: str | DecodeLayout = "auto",
    prompt_group: int = 1,
) -> Rollout:
    """Sample up to ``max_new_tokens`` tokens after each prompt.

    ``prompts`` is a list of token-id lists (left-padded here) or a ``[B, P]`` array with its
    ``prompt_mask``. Deterministic for a given ``key``. Changing ``temperature``, ``top_k`` or
    ``top_p`` between calls reuses the compiled program. ``layout`` is the decode loop's
    `DecodeLayout` (a name of `DECODE_LAYOUTS`, or ``"auto"``: `default_layout` for the backend
    and the params' compute dtype); it changes the speed, not the distribution, and each layout
    compiles its own program (with `compiler_options`; jitting `generate` inside your own
    program, pass them to your `jax.jit`).
    ``prompt_group`` G > 1 says the rows come in groups of G consecutive rows with the same
    prompt (GRPO's G samples of a prompt: ``np.repeat(prompts, G, axis=0)``): the prefill then
    runs each prompt once and copies its cache to the group, with the same result (an FP8
    activation scale's amax over the distinct prompts is the amax over all rows).

    >>> rollout = generate(params, config, [[1, 2, 3], [4]], jax.random.key(0),
    ...                    max_new_tokens=16, eos_ids=(2,))  # doctest: +SKIP
    """
    if not isinstance(max_new_tokens, int | np.integer) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}.")
    _check_sampling(temperature, top_k, top_p, config.vocab_size)
    dtype = params["embed"].dtype
    layout = resolve_layout(layout, dtype)
    if prompt_mask is None:
        if isinstance(prompts, jax.Array | np.ndarray):
            prompt_mask = np.ones(prompts.shape, bool)
        else:
            prompts, prompt_mask = pad_prompts(prompts, pad_id)
    prompts = jnp.asarray(prompts, jnp.int32)
    if prompts.ndim != 2 or 0 in prompts.shape:
        raise ValueError(
            f"prompts must be a [B, P] array with B, P >= 1; got shape "
            f"{prompts.shape} (an empty batch or an empty prompt)."
        )
    _check_prompt_group(prompts, prompt_mask, prompt_group)
    if prompts.shape[1] + max_new_tokens > config.max_position_embeddings:
        raise ValueError(
            f"Prompt length {prompts.shape[1]} + max_new_tokens {max_new_tokens} exceeds the "
            f"model's context (max_position_embeddings={config.max_position_embeddings})."
        )
    traced = any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves((params, prompts, key)))
    return _generate_jit(traced)(
        params,
        config,
        prompts,
        jnp.asarray(prompt_mask, bool),
        key,
        jnp.float32(temperature),
        jnp.int32(config.vocab_size if top_k is None else top_k),
        jnp.float32(1.0 if top_p is None else top_p),
        max_new_tokens=int(max_new_tokens),
        eos_ids=tuple(int(e) for e in eos_ids),
        pad_id=int(pad_id),
        layout=layout,
        prompt_group=int(prompt_group),
    )


def _check_prompt_group(prompts_BP, prompt_mask_BP, group) -> None:
    """``group`` divides the rows and, where this process holds the prompts' values (not traced,
    not spread over hosts), every row of a group holds its group's prompt."""
    B = prompts_BP.shape[0]
    check_prompt_group(group, B)
    for name, a in (("prompts", prompts_BP), ("prompt_mask", prompt_mask_BP)):
        known = not isinstance(a, jax.core.Tracer) and getattr(a, "is_fully_addressable", True)
        if group > 1 and known:
            a = np.asarray(a)
            groups = a.reshape(B // group, group, *a.shape[1:])
            differ = np.flatnonzero(
                np.any(groups != groups[:, :1], axis=tuple(range(1, a.ndim + 1)))
            )
            if differ.size:
                raise ValueError(
                    f"prompt_group={group}: the {name} of rows {differ[0] * group}.."
                    f"{differ[0] * group + group - 1} differ (each group of {group} consecutive "
                    "rows must repeat one prompt)"
                )


def _check_sampling(temperature, top_k, top_p, vocab_size):
    # numbers.Real / Integral also cover NumPy scalars (np.float32, np.int64); traced values
    # (jax.Array) are not checked.
    if isinstance(temperature, numbers.Real) and not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature!r}.")
    if top_k is not None and isinstance(top_k, numbers.Integral) and not 1 <= top_k <= vocab_size:
        raise ValueError(f"top_k must be in [1, vocab_size={vocab_size}] or None, got {top_k!r}.")
    if top_p is not None and isinstance(top_p, numbers.Real) and not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1] or None, got {top_p!r}.")
