"""The diffusion rollout engine: LLaDA's semi-autoregressive sampler, and diffu-GRPO's scorer.

Generation (`generate`, after LLaDA's ``generate.py``)
-----------------------------------------------------
The response of T = ``gen_length`` positions starts fully masked (``config.mask_token_id``) after
the left-padded prompt. It is filled block by block (``block_length`` positions each, left to
right), ``steps / num_blocks`` denoising steps per block. At every step one bidirectional
`llada.forward` predicts every response position, and for each still-masked position::

    x0_t = argmax_v ( logits_tv + temperature * g_tv )    g ~ Gumbel(0, 1): a draw from
                                                          softmax(logits_t / temperature)
    c_t  = softmax(logits_t)[x0_t]      ("low_confidence" remasking)
         | u_t ~ U(0, 1)                ("random" remasking)

Positions after the current block, and positions already unmasked, get c_t = -inf; the
``n_j`` masked positions of highest c_t take their x0_t, all others stay masked. ``n_j`` is
LLaDA's ``get_num_transfer_tokens``: with m = block_length masked positions at the start of a
block and s steps per block, ``n_j = m // s + (j < m % s)`` (its first ``m % s`` steps transfer
one more). After the last step every position holds a token.

LLaDA computes the Gumbel-max draw as ``exp(logits) / (-log u)^temperature`` in float64; it is
the same argmax as ``logits + temperature * g`` with g = -log(-log u). We draw in float32 in
that additive form (no exp overflow for logits > 88; float32 Gumbel noise only moves an argmax
where two noisy logits agree to float32 rounding). Temperature 0 is the plain argmax. Ties in
the confidence ranking go to the leftmost position (``torch.topk``'s order is unspecified).
The mask token itself is never a prediction (its logit is -inf in the argmax, not in the
confidence's softmax): LLaDA would write [MASK] back and count the position as filled, which a
trained LLaDA never does but a random test model can.

`temperature`, the remasking choice and `p_mask_prompt` are runtime values of one jitted
function: changing them does not recompile. The loop is one ``lax.fori_loop`` over the
``steps`` denoising steps; ``gen_length``, ``block_length`` and ``steps`` fix the shapes and are
static. Params may be the BF16 tree or its FP8 W8A8 copy (`quant.quantize_fp8`): the same
`quant.linear` runs both. On CPU the loop reads the FP8 codes as bfloat16, widened once before
it (`quant.widen_codes`; XLA:CPU has no FP8 dot and otherwise widened every weight at every
step; the same tokens either way).
The rollout's log-probs after the loop (`one_step_logp`) take the params as given, so they
are the trainer-side estimator's on the same weights bit for bit.

End of sequence: LLaDA never stops early: every one of the T positions is filled (an instruct
model fills the tail with its EOS token), and the text is cut at the first EOS afterwards. The
`DiffusionRollout` does that cut: ``tokens`` keep the response up to and including its first EOS
id (``pad_id`` after it), ``mask`` marks those positions, ``finished`` says an EOS was produced.

Prompts are left padded; padding keys are invisible and positions count valid tokens, so a row's
rollout does not depend on its padding or its batch-mates (FP8's per-tensor activation scale,
shared by the batch, is the one exception, as in `sampler.py`). Only the response region is
filled: mask tokens inside a prompt stay as they are (LLaDA's ``generate`` would fill them too).

The one-step log-probability estimator (`one_step_logp`, diffu-GRPO, d1)
------------------------------------------------------------------------
A masked-diffusion model has no tractable sequence likelihood: the rollout's probability sums
over every unmasking order. diffu-GRPO (Zhao et al. 2025, arXiv 2504.12216) scores a response
y = (y_1..y_T) to prompt x by ONE forward pass on a corrupted input::

    m_p ~ Bernoulli(p_mask_prompt) for every valid prompt token       (p = 0.15 in d1)
    z   = (x with the tokens where m_p = 1 replaced by [MASK], then T x [MASK])
    logp_t(theta; m) = log softmax(f_theta(z)_{P+t})[y_t]           t = 1..T

a mean-field estimate: each response token's log-probability given the (partially masked)
prompt and a fully masked response, independently of the other response tokens. The random
prompt mask m is drawn from a key; d1 draws a new one per inner (mu) update.

What the ratio means. `one_step_logp` is deterministic given (params, inputs, key): the mask is
a function of the key and the prompt's ``[B, P]`` layout only (so both sides must pass the same
padded prompt array). For one key, logp_rollout = the FP8 rollout
params' estimate and logp_train = the BF16 trainer params' estimate are the same function of
the same input z evaluated by two numerical versions of the network, so

    rho_t = exp(logp_train_t - logp_rollout_t)

is exactly 1 when the weights and precision agree, and otherwise measures the precision mismatch
alone (on that masked input), not a difference of masks. It is NOT the ratio of the true
probabilities of the sampled sequence under the two sampling processes (intractable for any
masked-diffusion sampler; the rollout's actual behaviour also depends on the remasking order
and temperature, neither of which enters the estimator). It is the importance ratio between the
two *surrogate* token policies that diffu-GRPO's objective is written in, which is where the
AIS/TIS corrections of docs/design.md apply. With a new mask per inner update, logp_rollout has
to be evaluated with the rollout params on each update's key (d1 computes every iteration's old
log-probs when the rollout is made); `DiffusionRollout.logp` is the one for ``logp_key``. The
sampler's temperature is not part of the estimator (as in d1): logits are not scaled.

Dimensions: B rows, P prompt length (left padded), T response length (``gen_length``),
S = P + T, V vocabulary, M end-of-sequence ids.
"""

from __future__ import annotations

import functools
import numbers
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from ais_jax.models import llada
from ais_jax.models.llada import LLaDAConfig
from ais_jax.nn.layers import Params
from ais_jax.nn.quant import widen_tree_codes
from ais_jax.rollout.sampler import pad_prompts

REMASKING = ("low_confidence", "random")  # index = the runtime code passed to the loop
F32 = jnp.float32


@struct.dataclass
class DiffusionRollout:
    """A batch of generated responses, in `sampler.Rollout`'s fields. T = gen_length.

    tokens/mask ``[B, T]``: the response cut after its first EOS (EOS included, ``pad_id``
    after it; the whole T positions when no EOS); logp ``[B, T]`` float32 (0 under padding): the
    rollout params' `one_step_logp` on the prompt mask of ``logp_key``; logp_plain: the same
    array (no filtering here; kept so code written for `sampler.Rollout` works); lengths ``[B]``;
    finished ``[B]``: an EOS was produced; logp_key: the key of the estimator's prompt mask.
    """

    prompt_tokens: jax.Array
    prompt_mask: jax.Array
    tokens: jax.Array
    mask: jax.Array
    logp: jax.Array
    logp_plain: jax.Array
    lengths: jax.Array
    finished: jax.Array
    logp_key: jax.Array


# ---- the one-step estimator ---------------------------------------------------------------------


def masked_prompt(key: jax.Array, prompt_mask_BP: jax.Array, p_mask_prompt) -> jax.Array:
    """The estimator's random prompt mask ``[B, P]`` (bool): each valid prompt token is masked
    independently with probability ``p_mask_prompt``; padding never is."""
    u_BP = jax.random.uniform(key, prompt_mask_BP.shape, F32)
    return prompt_mask_BP.astype(bool) & (u_BP < p_mask_prompt)


def corrupt_prompt(
    key: jax.Array,
    prompt_tokens_BP: jax.Array,
    prompt_mask_BP: jax.Array,
    p_mask_prompt,
    mask_token_id: int,
) -> jax.Array:
    """The estimator's prompt input ``[B, P]`` (int32): the prompt with the tokens of
    `masked_prompt` (``key``, ``p_mask_prompt``) replaced by ``mask_token_id``."""
    hidden_BP = masked_prompt(key, prompt_mask_BP, p_mask_prompt)
    return jnp.where(hidden_BP, mask_token_id, prompt_tokens_BP).astype(jnp.int32)


def response_logp(
    params: Params,
    config: LLaDAConfig,
    input_prompt_BP: jax.Array,
    prompt_mask_BP: jax.Array,
    tokens_BT: jax.Array,
    mask_BT: jax.Array,
    *,
    return_entropy: bool = False,
):
    """``log softmax(f(z)_{P+t})[y_t]`` ``[B, T]`` (float32, 0 where ``mask_BT`` is 0) for
    z = (``input_prompt_BP``, T x [MASK]): `one_step_logp` on a prompt that is already
    corrupted (`corrupt_prompt`), so callers that hold the corrupted prompt (the diffusion
    trainer, one per inner update) score exactly the input their rollout logp saw. With
    ``return_entropy`` also the entropy ``-sum_v p_tv log p_tv`` ``[B, T]`` of each position."""
    B, P = input_prompt_BP.shape
    T = tokens_BT.shape[1]
    input_BS = jnp.concatenate(
        [input_prompt_BP.astype(jnp.int32), jnp.full((B, T), config.mask_token_id, jnp.int32)],
        axis=1,
    )
    valid_BS = jnp.concatenate([prompt_mask_BP.astype(bool), jnp.ones((B, T), bool)], axis=1)
    logits_BTV = llada.forward(params, config, input_BS, valid_BS)[:, P:]
    logp_BTV = jax.nn.log_softmax(logits_BTV.astype(F32), axis=-1)
    logp_BT = jnp.take_along_axis(logp_BTV, tokens_BT[..., None].astype(jnp.int32), axis=-1)
    logp_BT = jnp.where(mask_BT.astype(bool), logp_BT[..., 0], 0.0)
    if not return_entropy:
        return logp_BT
    entropy_BT = -jnp.sum(jnp.exp(logp_BTV) * logp_BTV, axis=-1)
    return logp_BT, jnp.where(mask_BT.astype(bool), entropy_BT, 0.0)


def one_step_logp(
    params: Params,
    config: LLaDAConfig,
    prompt_tokens_BP: jax.Array,
    prompt_mask_BP: jax.Array,
    tokens_BT: jax.Array,
    mask_BT: jax.Array,
    key: jax.Array,
    p_mask_prompt: float | jax.Array = 0.15,
) -> jax.Array:
    """diffu-GRPO's one-step mean-field log-probs ``[B, T]`` (float32, 0 where ``mask_BT`` is
    0) of the response ``tokens_BT``; see the module docstring for the estimator and the meaning
    of a ratio of two of them on the same ``key``. Every response position is a [MASK] input
    (including those after the EOS, as in d1); jit it, or the function calling it, yourself.
    Equal to `response_logp` on `corrupt_prompt` (``key``, ``p_mask_prompt``)."""
    input_BP = corrupt_prompt(
        key, prompt_tokens_BP, prompt_mask_BP, p_mask_prompt, config.mask_token_id
    )
    return response_logp(params, config, input_BP, prompt_mask_BP, tokens_BT, mask_BT)


# ---- generation -----------------------------------------------------------------------------


def transfer_schedule(block_length: int, steps_per_block: int) -> np.ndarray:
    """LLaDA's ``get_num_transfer_tokens`` for a fully masked block: ``[steps_per_block]``
    counts summing to ``block_length``, the first ``block_length % steps_per_block`` one
    larger."""
    base, extra = divmod(block_length, steps_per_block)
    return base + (np.arange(steps_per_block) < extra).astype(np.int32)


def step_keys(key: jax.Array, step: jax.Array | int) -> tuple[jax.Array, jax.Array]:
    """The (Gumbel noise, random-remasking) keys of denoising step ``step``."""
    gumbel_key, remask_key = jax.random.split(jax.random.fold_in(key, step))
    return gumbel_key, remask_key


def _cut_at_eos(x_BT: jax.Array, eos_ids: tuple[int, ...], pad_id: int):
    T = x_BT.shape[1]
    eos_M = jnp.asarray(eos_ids if eos_ids else (-1,), jnp.int32)
    is_eos_BT = jnp.any(x_BT[..., None] == eos_M[None, None], axis=-1)
    finished_B = jnp.any(is_eos_BT, axis=-1)
    first_B = jnp.where(finished_B, jnp.argmax(is_eos_BT, axis=-1), T - 1)
    mask_BT = jnp.arange(T)[None] <= first_B[:, None]
    return jnp.where(mask_BT, x_BT, pad_id), mask_BT, finished_B


@functools.partial(
    jax.jit,
    static_argnames=("config", "gen_length", "block_length", "steps", "eos_ids", "pad_id"),
)
def generate_arrays(
    params,
    config: LLaDAConfig,
    prompt_BP,
    prompt_mask_BP,
    key,
    logp_key,
    temperature,
    remasking,
    p_mask_prompt,
    *,
    gen_length: int,
    block_length: int,
    steps: int,
    eos_ids: tuple[int, ...],
    pad_id: int,
) -> DiffusionRollout:
    """The jitted core of `generate` for callers that checked their settings (the trainer's
    phases): ``[B, P]`` prompts and mask, scalar ``temperature`` (float32), ``remasking``
    (int32, the index in `REMASKING`) and ``p_mask_prompt`` (float32)."""
    B, P = prompt_BP.shape
    T = gen_length
    steps_per_block = steps // (gen_length // block_length)
    schedule = jnp.asarray(transfer_schedule(block_length, steps_per_block), jnp.int32)
    valid_BS = jnp.concatenate([prompt_mask_BP, jnp.ones((B, T), bool)], axis=1)
    t_T = jnp.arange(T)
    is_mask_V = jnp.arange(config.vocab_size) == config.mask_token_id
    loop_params = widen_tree_codes(params)  # FP8 codes as bfloat16 on CPU, once

    def step(i, carry):
        x_BT, masked_BT = carry
        block, j = i // steps_per_block, i % steps_per_block
        logits_BTV = llada.forward(
            loop_params, config, jnp.concatenate([prompt_BP, x_BT], axis=1), valid_BS
        )[:, P:]
        gumbel_key, remask_key = step_keys(key, i)
        noise_BTV = jax.random.gumbel(gumbel_key, logits_BTV.shape, F32)
        noisy_BTV = jnp.where(is_mask_V[None, None], -jnp.inf, logits_BTV + temperature * noise_BTV)
        x0_BT = jnp.argmax(noisy_BTV, axis=-1).astype(jnp.int32)
        logp_BTV = jax.nn.log_softmax(logits_BTV, axis=-1)
        p_x0_BT = jnp.exp(jnp.take_along_axis(logp_BTV, x0_BT[..., None], axis=-1)[..., 0])
        u_BT = jax.random.uniform(remask_key, (B, T), F32)
        confidence_BT = jnp.where(remasking == 0, p_x0_BT, u_BT)
        eligible_BT = masked_BT & (t_T < (block + 1) * block_length)[None]
        confidence_BT = jnp.where(eligible_BT, confidence_BT, -jnp.inf)
        order_BT = jnp.argsort(-confidence_BT, axis=-1, stable=True)  # leftmost first on ties
        rank_BT = jnp.argsort(order_BT, axis=-1)
        transfer_BT = (rank_BT < schedule[j]) & eligible_BT
        return jnp.where(transfer_BT, x0_BT, x_BT), masked_BT & ~transfer_BT

    x_BT = jnp.full((B, T), config.mask_token_id, jnp.int32)
    x_BT, _ = jax.lax.fori_loop(0, steps, step, (x_BT, jnp.ones((B, T), bool)))
    tokens_BT, mask_BT, finished_B = _cut_at_eos(x_BT, eos_ids, pad_id)
    logp_BT = one_step_logp(
        params, config, prompt_BP, prompt_mask_BP, tokens_BT, mask_BT, logp_key, p_mask_prompt
    )
    return DiffusionRollout(
        prompt_tokens=prompt_BP,
        prompt_mask=prompt_mask_BP,
        tokens=tokens_BT,
        mask=mask_BT,
        logp=logp_BT,
        logp_plain=logp_BT,
        lengths=mask_BT.sum(-1, dtype=jnp.int32),
        finished=finished_B,
        logp_key=logp_key,
    )


def generate(
    params: Params,
    config: LLaDAConfig,
    prompts,
    key: jax.Array,
    *,
    gen_length: int,
    block_length: int,
    steps: int,
    temperature: float = 0.0,
    remasking: str = "low_confidence",
    eos_ids: Sequence[int] | None = None,
    pad_id: int | None = None,
    prompt_mask=None,
    logp_key: jax.Array | None = None,
    p_mask_prompt: float = 0.15,
) -> DiffusionRollout:
    """LLaDA's semi-autoregressive generation of ``gen_length`` tokens after each prompt (see
    the module docstring), and the response's `one_step_logp` under ``params`` on the prompt
    mask of ``logp_key`` (default: derived from ``key``).

    ``prompts`` is a list of token-id lists (left padded here with ``pad_id``, default
    ``config.pad_token_id``) or a ``[B, P]`` array with its ``prompt_mask``. ``eos_ids`` default
    to ``(config.eos_token_id,)``. ``gen_length`` must be a multiple of ``block_length`` and
    ``steps`` a multiple of the number of blocks, with at most one step per token. Changing
    ``temperature``, ``remasking`` or ``p_mask_prompt`` reuses the compiled program.

    >>> rollout = generate(params, config, [[5, 6, 7], [8]], jax.random.key(0), gen_length=64,
    ...                    block_length=32, steps=64, temperature=0.9)  # doctest: +SKIP
    """
    for name, value in (("gen_length", gen_length), ("block_length", block_length)):
        if not isinstance(value, int | np.integer) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}.")
    if gen_length % block_length:
        raise ValueError(
            f"gen_length ({gen_length}) must be a multiple of block_length ({block_length})."
        )
    num_blocks = gen_length // block_length
    if not isinstance(steps, int | np.integer) or steps < num_blocks or steps % num_blocks:
        raise ValueError(
            f"steps must be a positive multiple of the number of blocks ({num_blocks} = "
            f"gen_length / block_length), got {steps!r}."
        )
    if steps > gen_length:
        raise ValueError(f"steps ({steps}) must be at most gen_length ({gen_length}).")
    if remasking not in REMASKING:
        raise ValueError(f"remasking={remasking!r}; valid values: {list(REMASKING)}.")
    if isinstance(temperature, numbers.Real) and not temperature >= 0:
        raise ValueError(f"temperature must be >= 0 (0 = argmax), got {temperature!r}.")
    if isinstance(p_mask_prompt, numbers.Real) and not 0 <= p_mask_prompt <= 1:
        raise ValueError(f"p_mask_prompt must be in [0, 1], got {p_mask_prompt!r}.")
    pad_id = config.pad_token_id if pad_id is None else int(pad_id)
    eos_ids = (config.eos_token_id,) if eos_ids is None else tuple(int(e) for e in eos_ids)
    if prompt_mask is None:
        if isinstance(prompts, jax.Array | np.ndarray):
            prompt_mask = np.ones(np.shape(prompts), bool)
        else:
            prompts, prompt_mask = pad_prompts(prompts, pad_id)
    prompts = jnp.asarray(prompts, jnp.int32)
    if prompts.ndim != 2 or 0 in prompts.shape:
        raise ValueError(f"prompts must be a [B, P] array with B, P >= 1; got {prompts.shape}.")
    if prompts.shape[1] + gen_length > config.max_position_embeddings:
        raise ValueError(
            f"Prompt length {prompts.shape[1]} + gen_length {gen_length} exceeds the model's "
            f"context (max_position_embeddings={config.max_position_embeddings})."
        )
    if logp_key is None:
        key, logp_key = jax.random.split(key)
    return generate_arrays(
        params,
        config,
        prompts,
        jnp.asarray(prompt_mask, bool),
        key,
        logp_key,
        jnp.float32(temperature),
        jnp.int32(REMASKING.index(remasking)),
        jnp.float32(p_mask_prompt),
        gen_length=int(gen_length),
        block_length=int(block_length),
        steps=int(steps),
        eos_ids=eos_ids,
        pad_id=pad_id,
    )
