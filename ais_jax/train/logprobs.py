"""Trainer-side scoring: the log-probs (and entropies) of given response tokens.

`token_logprobs` is logp_train of docs/design.md, the same temperature-scaled, unfiltered
log-softmax that the sampler records as ``logp_plain`` (`ais_jax.rollout.sampler`), so the
rollout-vs-trainer ratio measures the number formats alone. It runs on any autoregressive
family (`ais_jax.models`); the LM head and log-softmax run a few response positions at a time,
so no caller holds ``[B, T, V]`` float32 logits (or their gradient) at once.

Dimensions: docs/design.md's key (B rows, N prompts, G = B / N rows per prompt, P prompt
length, T response length, C response positions per chunk, D model, V vocabulary).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ais_jax import models
from ais_jax.models import Config
from ais_jax.nn.layers import Params, head_logits, rows_per_prompt
from ais_jax.nn.quant import QArray

# Logits one chunk of `token_logprobs` may hold: B x C x V float32 values (64 MiB). The small
# benchmark model's update (B 128, V 32k) then takes C = 4 response positions at a time.
LOGITS_CHUNK = 1 << 24


def token_logprobs(
    params: Params,
    config: Config,
    prompt_tokens_NP,
    prompt_mask_NP,
    tokens_BT,
    mask_BT,
    *,
    temperature: float | jax.Array = 1.0,
    return_entropy: bool = False,
    chunk_logits: int = LOGITS_CHUNK,
    remat: bool = False,
):
    """Log-probs ``[B, T]`` (float32) of given response tokens under a full-sequence forward.

    This is logp_train of docs/design.md: ``log_softmax(logits / temperature)`` over the full
    vocabulary, 0 where ``mask_BT`` is 0. With ``return_entropy`` also the per-token entropy
    ``-sum_v p_v log p_v`` of that distribution. Jit it (or the function that calls it)
    yourself.

    The prompts are one per row (N = B) or one per group of G = B / N > 1 consecutive rows
    (the G responses GRPO samples for each prompt): a Qwen3 model with unquantized weights
    then runs each prompt once and broadcasts its keys/values to its group
    (`qwen3.response_hidden`), with the values of running every row's ``[prompt, response]``
    through the model (float32: to rounding; bfloat16: to bfloat16 rounding). Other models
    (Qwen3.5, quantized weights: their activation scales span the whole sequence) run the
    rows in full, with each prompt repeated for its group; so do one-prompt-per-row calls
    (see `qwen3.response_hidden` for why).

    The LM head runs on the T response positions only, C at a time (the fused
    linear-cross-entropy idea): for each chunk ``logits_BCV = head(hidden_BCD)``, its
    log-softmax, the chosen token's log-prob and the entropy, under `jax.checkpoint`, so
    neither the forward nor the backward ever holds more than one chunk's ``[B, C, V]``
    float32 logits (the backward recomputes them from the saved ``hidden_BCD``). C is the
    largest count with ``B * C * V <= chunk_logits`` (at least 1); T is padded up to a
    multiple of C. The values are those of ``log_softmax(forward(...))``: each position's
    logits are the same dot. A quantized LM head (`QArray`) takes one dynamic activation
    scale over every valid position of the sequence, so it keeps the unchunked path.

    ``remat``: under a gradient, each decoder layer's activations are recomputed in the
    backward pass instead of kept (`layers.recompute_layer`).
    """
    N, P = prompt_tokens_NP.shape
    B, T = tokens_BT.shape
    G = rows_per_prompt(N, B)
    if G > 1 and _shares_prompts(params, config):
        hidden_BTD = models.response_hidden(
            params, config, prompt_tokens_NP, prompt_mask_NP, tokens_BT, mask_BT, remat=remat
        )
        logp_BT, entropy_BT = _chunked_logp_entropy(
            params, hidden_BTD, tokens_BT, temperature, chunk_logits
        )
    else:
        prompt_tokens_BP, prompt_mask_BP = (
            jnp.repeat(a, G, axis=0) for a in (prompt_tokens_NP, prompt_mask_NP)
        )
        seq_BS = jnp.concatenate([prompt_tokens_BP, tokens_BT], axis=1)
        seq_mask_BS = jnp.concatenate([prompt_mask_BP, mask_BT], axis=1).astype(bool)
        if isinstance(params.get("lm_head", params["embed"]), QArray):
            logits_BSV = models.forward(params, config, seq_BS, seq_mask_BS, remat=remat)
            # the logits at position s predict the token at s + 1
            logits_BTV = jax.lax.dynamic_slice_in_dim(logits_BSV, P - 1, T, axis=1)
            logp_BT, entropy_BT = _logp_entropy(logits_BTV, tokens_BT, temperature)
        else:
            hidden_BSD = models.final_hidden(params, config, seq_BS, seq_mask_BS, remat=remat)
            hidden_BTD = jax.lax.dynamic_slice_in_dim(hidden_BSD, P - 1, T, axis=1)
            logp_BT, entropy_BT = _chunked_logp_entropy(
                params, hidden_BTD, tokens_BT, temperature, chunk_logits
            )
    logp_BT = jnp.where(mask_BT, logp_BT, 0.0)
    if not return_entropy:
        return logp_BT
    return logp_BT, jnp.where(mask_BT, entropy_BT, 0.0)


def _shares_prompts(params: Params, config: Config) -> bool:
    """Whether `token_logprobs` runs each prompt once (`models.response_hidden`): a family
    that has it (`Family.response_hidden`; Qwen3's), with no quantized weight (a quantized
    linear's activation scale spans the whole sequence)."""
    is_q = lambda x: isinstance(x, QArray)  # noqa: E731
    quantized = any(is_q(leaf) for leaf in jax.tree_util.tree_leaves(params, is_leaf=is_q))
    return not quantized and models.family_of(config).response_hidden is not None


def _logp_entropy(logits_BTV, tokens_BT, temperature):
    """The chosen tokens' log-probs and the entropies ``[B, T]`` of ``softmax(logits / temp)``."""
    logp_BTV = jax.nn.log_softmax(logits_BTV.astype(jnp.float32) / temperature, axis=-1)
    logp_BT = jnp.take_along_axis(logp_BTV, tokens_BT[..., None], axis=-1)[..., 0]
    return logp_BT, -jnp.sum(jnp.exp(logp_BTV) * logp_BTV, axis=-1)


def _chunked_logp_entropy(params, hidden_BTD, tokens_BT, temperature, chunk_logits):
    """`_logp_entropy` of ``head_logits(params, hidden_BTD)``, C positions at a time."""
    B, T, D = hidden_BTD.shape
    V = params.get("lm_head", params["embed"]).shape[0]
    if chunk_logits < 1:
        raise ValueError(f"chunk_logits={chunk_logits}: must be a positive number of logits")
    C = max(1, min(T, chunk_logits // (B * V)))
    N = -(-T // C)
    pad = N * C - T
    hidden_NBCD = jnp.pad(hidden_BTD, ((0, 0), (0, pad), (0, 0)))
    hidden_NBCD = hidden_NBCD.reshape(B, N, C, D).transpose(1, 0, 2, 3)
    tokens_NBC = jnp.pad(tokens_BT, ((0, 0), (0, pad))).reshape(B, N, C).transpose(1, 0, 2)

    @jax.checkpoint
    def chunk(args):
        hidden_BCD, tokens_BC = args
        return _logp_entropy(head_logits(params, hidden_BCD), tokens_BC, temperature)

    if N == 1:  # one chunk: no loop (and nothing to recompute: its logits are the only ones)
        return _logp_entropy(head_logits(params, hidden_BTD), tokens_BT, temperature)
    logp_NBC, entropy_NBC = jax.lax.map(chunk, (hidden_NBCD, tokens_NBC))
    unchunk = lambda x_NBC: x_NBC.transpose(1, 0, 2).reshape(B, N * C)[:, :T]  # noqa: E731
    return unchunk(logp_NBC), unchunk(entropy_NBC)
