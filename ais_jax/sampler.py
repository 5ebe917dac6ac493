"""The rollout engine: batched sampling with a KV cache, and trainer-side re-scoring.

`generate` left-pads a batch of prompts, runs one prefill over them, then decodes one token per
row per step inside a `lax.while_loop` until every row has emitted an end-of-sequence id or
`max_new_tokens` is reached. The whole thing is one jitted function: `temperature`, `top_k` and
`top_p` are runtime values, so changing them does not recompile. The params may be the BF16
trainer tree or its quantized rollout copy (`quant.quantize_fp8`): it is the same code, and
either may first go through `decode_params` once per weight sync (the loop's weight layout).
Tokens are drawn with a two-level Gumbel-max (`_draw`): exactly softmax(filtered logits), with
noise for V/128 + 128 ids per row rather than V.

Which log-prob goes into the importance ratio
---------------------------------------------
`Rollout` records two log-probs of every sampled token, both at sampling time from the logits the
sampler actually used (as an inference engine returns them):

- ``logp``: under the distribution actually sampled from (temperature, then top-k / top-p
  filtering and renormalisation). This is the exact behaviour probability.
- ``logp_plain``: ``log_softmax(logits / temperature)`` over the full vocabulary, unfiltered.

The rollout-vs-trainer ratio rho_rt = exp(logp_train - logp_rollout) must use **logp_plain**:
`token_logprobs` computes the trainer side as the same temperature-scaled, unfiltered
log-softmax, so the ratio then measures only the FP8-vs-BF16 difference. Using the filtered
``logp`` would add log(kept probability mass) to every token's log-ratio, a "mismatch" that is
really the top-p/top-k renormalisation (a known source of false mismatch in RL frameworks).
With the default full-vocabulary sampling (top_k=None, top_p=None) the two are identical.
"""

from __future__ import annotations

import functools
import numbers
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from ais_jax.model import Params, forward, forward_cached, init_cache, unstack_layers
from ais_jax.model_config import ModelConfig
from ais_jax.quant import LINEAR_WEIGHTS, InOut, QArray


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
    renormalised over the top-k) whose mass reaches ``top_p``; the rest become -inf.
    """
    sorted_BV = -jnp.sort(-logits_BV, axis=-1)
    rank_BV = jax.lax.broadcasted_iota(jnp.int32, sorted_BV.shape, sorted_BV.ndim - 1)
    sorted_BV = jnp.where(rank_BV < top_k, sorted_BV, -jnp.inf)
    probs_BV = jax.nn.softmax(sorted_BV, axis=-1)
    mass_before_BV = jnp.cumsum(probs_BV, axis=-1) - probs_BV
    keep_BV = (mass_before_BV < top_p) & (rank_BV < top_k)
    threshold_B1 = jnp.min(jnp.where(keep_BV, sorted_BV, jnp.inf), axis=-1, keepdims=True)
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


_BLOCK = 128  # vocabulary block of the two-level draw


def _draw(key: jax.Array, logits_BV: jax.Array) -> tuple[jax.Array, jax.Array]:
    """One token per row from ``softmax(logits_BV)`` and its log-prob, with Gumbel noise for
    ``V / 128 + 128`` values per row instead of ``V``.

    The vocabulary is cut into N blocks of C = 128 ids (the last one padded with -inf). A Gumbel-max
    draw over the log block masses picks a block with probability (its mass) / (total mass);
    a second one over the block's logits picks an id with probability (its weight) / (block
    mass): the product is exactly softmax(logits). The block masses are the sums of
    ``exp(logits - max)`` that the log-softmax needs anyway, so the pass over the vocabulary
    computes no noise at all; drawing noise for every id (`jax.random.categorical`) cost more
    than the rest of sampling on CPU.
    """
    B, V = logits_BV.shape
    nb = -(-V // _BLOCK)
    x_BNC = jnp.pad(logits_BV, ((0, 0), (0, nb * _BLOCK - V)), constant_values=-jnp.inf)
    x_BNC = x_BNC.reshape(B, nb, _BLOCK)
    max_B11 = jnp.max(x_BNC, axis=(1, 2), keepdims=True)
    mass_BN = jnp.sum(jnp.exp(x_BNC - max_B11), axis=-1)
    block_key, id_key = jax.random.split(key)
    block_B = _first_argmax(jnp.log(mass_BN) + jax.random.gumbel(block_key, (B, nb)))
    inner_BC = jnp.take_along_axis(x_BNC, block_B[:, None, None], axis=1)[:, 0]
    id_B = _first_argmax(inner_BC + jax.random.gumbel(id_key, (B, _BLOCK)))
    logit_B = jnp.take_along_axis(inner_BC, id_B[:, None], axis=-1)[:, 0]
    logp_B = logit_B - max_B11[:, 0, 0] - jnp.log(jnp.sum(mass_BN, axis=-1))
    return jnp.minimum(block_B * _BLOCK + id_B, V - 1), logp_B


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


def decode_params(params: Params) -> Params:
    """The params as the decode loop reads them: layers unstacked (`model.unstack_layers`) so
    no step slices the stacked arrays again, and on CPU every unquantized matmul weight (and the
    LM head, a copy when tied) transposed to `quant.InOut`, the layout XLA:CPU's few-row
    matmuls read fastest. Quantized weights keep the ``[out, in]`` layout of the FP8 GEMM.

    `generate` applies it to whatever it is given (inside its jit, before the loop); applied
    twice it changes nothing. Calling it yourself once per weight sync, as `quantize_fp8` is,
    saves that re-layout (a copy of the weights) on every later `generate` call with the same
    weights. It keeps one copy of the transposed weights alive.
    """
    params = unstack_layers(params)
    if jax.default_backend() != "cpu":
        return params
    to_in_out = lambda w: w if isinstance(w, QArray | InOut) else InOut.of(w)  # noqa: E731
    layers = [
        {name: to_in_out(w) if name in LINEAR_WEIGHTS else w for name, w in layer.items()}
        for layer in params["layers"]
    ]
    head = to_in_out(params.get("lm_head", params["embed"]))
    return {**params, "layers": layers, "lm_head": head}


def value_cache_dtype(dtype) -> jnp.dtype:
    """The value cache's dtype for a model computing in ``dtype``: the same, except float32 for
    16-bit floats on CPU, where XLA's float32 batched dots (attention's probs x values) are
    faster than bfloat16 ones and its float32 cache-slot writes are in place. The stored
    values are the same bfloat16 numbers (see `model.attention`); the keys stay in ``dtype``,
    which keeps the scores' dot the trainer's (a float32 one sums in another order and moved
    the BF16 rollout off the trainer's log-probs)."""
    dtype = jnp.dtype(dtype)
    if jax.default_backend() == "cpu" and dtype.itemsize < 4:
        return jnp.dtype(jnp.float32)
    return dtype


@functools.partial(jax.jit, static_argnames=("config", "max_new_tokens", "eos_ids", "pad_id"))
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
):
    B, P = prompt_BP.shape
    T = max_new_tokens
    params = decode_params(params)
    dtype = params["embed"].dtype
    cache = init_cache(config, B, P + T, dtype, value_dtype=value_cache_dtype(dtype))
    logits_B1V, cache = forward_cached(
        params, config, prompt_BP, cache, prompt_mask_BP, last_only=True
    )
    eos_E = jnp.asarray(eos_ids if eos_ids else (-1,), jnp.int32)

    def emit(state, t, logits_BV):
        tokens, mask, logp, logp_plain, done, _ = state
        token_B, lp_B, lpp_B = _sample(
            jax.random.fold_in(key, t), logits_BV, temperature, top_k, top_p
        )
        live_B = ~done
        token_B = jnp.where(live_B, token_B, pad_id)
        write = lambda buf, v: jax.lax.dynamic_update_slice(buf, v[:, None], (0, t))  # noqa: E731
        tokens = write(tokens, token_B)
        mask = write(mask, live_B)
        logp = write(logp, jnp.where(live_B, lp_B, 0.0))
        logp_plain = write(logp_plain, jnp.where(live_B, lpp_B, 0.0))
        done = done | (live_B & jnp.isin(token_B, eos_E))
        return (tokens, mask, logp, logp_plain, done, token_B)

    state = (
        jnp.full((B, T), pad_id, jnp.int32),
        jnp.zeros((B, T), bool),
        jnp.zeros((B, T), jnp.float32),
        jnp.zeros((B, T), jnp.float32),
        jnp.zeros((B,), bool),
        jnp.zeros((B,), jnp.int32),
    )
    state = emit(state, 0, logits_B1V[:, 0])

    def cond(carry):
        t, _, state = carry
        return (t < T) & ~jnp.all(state[4])

    def body(carry):
        t, cache, state = carry
        live_B1 = ~state[4][:, None]
        logits_B1V, cache = forward_cached(params, config, state[5][:, None], cache, live_B1)
        return t + 1, cache, emit(state, t, logits_B1V[:, 0])

    _, _, (tokens, mask, logp, logp_plain, done, _) = jax.lax.while_loop(
        cond, body, (jnp.asarray(1, jnp.int32), cache, state)
    )
    return Rollout(
        prompt_tokens=prompt_BP,
        prompt_mask=prompt_mask_BP,
        tokens=tokens,
        mask=mask,
        logp=logp,
        logp_plain=logp_plain,
        lengths=mask.sum(-1, dtype=jnp.int32),
        finished=done,
    )


def generate(
    params: Params,
    config: ModelConfig,
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
) -> Rollout:
    """Sample up to ``max_new_tokens`` tokens after each prompt.

    ``prompts`` is a list of token-id lists (left-padded here) or a ``[B, P]`` array with its
    ``prompt_mask``. Deterministic for a given ``key``. Changing ``temperature``, ``top_k`` or
    ``top_p`` between calls reuses the compiled program.

    >>> rollout = generate(params, config, [[1, 2, 3], [4]], jax.random.key(0),
    ...                    max_new_tokens=16, eos_ids=(2,))  # doctest: +SKIP
    """
    if not isinstance(max_new_tokens, int | np.integer) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}.")
    _check_sampling(temperature, top_k, top_p, config.vocab_size)
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
    if prompts.shape[1] + max_new_tokens > config.max_position_embeddings:
        raise ValueError(
            f"Prompt length {prompts.shape[1]} + max_new_tokens {max_new_tokens} exceeds the "
            f"model's context (max_position_embeddings={config.max_position_embeddings})."
        )
    return _generate(
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


# ---- trainer-side scoring ---------------------------------------------------------------------


def token_logprobs(
    params: Params,
    config: ModelConfig,
    prompt_tokens_BP,
    prompt_mask_BP,
    tokens_BT,
    mask_BT,
    *,
    temperature: float | jax.Array = 1.0,
    return_entropy: bool = False,
):
    """Log-probs ``[B, T]`` (float32) of given response tokens under a full-sequence forward.

    This is logp_train of SPEC.md: ``log_softmax(logits / temperature)`` over the full
    vocabulary, 0 where ``mask_BT`` is 0. With ``return_entropy`` also the per-token entropy of
    that distribution. Jit it (or the function that calls it) yourself.
    """
    P = prompt_tokens_BP.shape[1]
    T = tokens_BT.shape[1]
    seq_BS = jnp.concatenate([prompt_tokens_BP, tokens_BT], axis=1)
    seq_mask_BS = jnp.concatenate([prompt_mask_BP, mask_BT], axis=1).astype(bool)
    logits_BSV = forward(params, config, seq_BS, seq_mask_BS)
    # the logits at position s predict the token at s + 1
    logits_BTV = jax.lax.dynamic_slice_in_dim(logits_BSV, P - 1, T, axis=1)
    logp_BTV = jax.nn.log_softmax(logits_BTV.astype(jnp.float32) / temperature, axis=-1)
    logp_BT = jnp.take_along_axis(logp_BTV, tokens_BT[..., None], axis=-1)[..., 0]
    logp_BT = jnp.where(mask_BT, logp_BT, 0.0)
    if not return_entropy:
        return logp_BT
    entropy_BT = -jnp.sum(jnp.exp(logp_BTV) * logp_BTV, axis=-1)
    return logp_BT, jnp.where(mask_BT, entropy_BT, 0.0)
