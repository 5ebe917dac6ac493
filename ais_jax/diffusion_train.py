"""Masked-diffusion SFT for LLaDA: the supervised warm start before diffu-GRPO.

LLaDA's SFT objective (Nie et al. 2025, section 2.3 and the "SFT" section of LLaDA's
GUIDELINES.md) trains the mask predictor on (prompt, response) pairs. The prompt is never
masked; each response token is masked with one per-row probability::

    t_b ~ U(0, 1),   p_b = (1 - eps) t_b + eps                 (LLaDA's forward_process)
    m_bi ~ Bernoulli(p_b)  for every valid response position i  (padding never)
    z_b = (x_b, y_b with y_bi -> [MASK] where m_bi = 1)
    loss_b = 1 / (p_b n_b) * sum_{i: m_bi = 1} -log softmax(f_theta(z_b)_{P+i})[y_bi]
    loss   = mean of loss_b over the rows with n_b > 0

with n_b the row's number of valid response tokens ("answer length"). The ``1/p_b`` weight
makes the sum an unbiased estimate of the row's full response cross-entropy (E[m_bi] = p_b), the
masked-diffusion ELBO's weighting; dividing by ``n_b`` and averaging rows is the guidelines'
``sum(token_loss / answer_lengths) / batch_size``. LLaDA pads answers with EOS tokens that are
part of the answer (trained, counted in n_b); here padding is whatever ``mask`` marks 0: it is
neither attended to, masked, scored nor counted, and a row with no valid response token is left
out of the mean (LLaDA divides by the batch size; the two agree when every row has a response).
To train LLaDA's way, pad responses with EOS and mark those positions valid.

Batches use `diffusion_sampler`'s layout (the fields of `DiffusionRollout`): ``prompt_tokens``
``[B, P]`` left padded with ``prompt_mask``, ``tokens`` ``[B, T]`` with ``mask`` (response
padding on the right). Randomness: ``t_key, mask_key = jax.random.split(key)``; ``t_B`` is
``uniform(t_key, [B])`` and ``m_BT = valid_BT & (uniform(mask_key, [B, T]) < p_B)``; so the
draws depend on the key and the batch's shape only. Every log-probability, weight and the loss
are float32 whatever the parameters' dtype.

Dimensions: B rows, P prompt length, T response length, S = P + T, V vocabulary.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp
import optax

from ais_jax import llada
from ais_jax.llada import LLaDAConfig
from ais_jax.model import Params, cast_params

F32 = jnp.float32
BATCH_KEYS = ("prompt_tokens", "prompt_mask", "tokens", "mask")


def corrupt(
    key: jax.Array, mask_BT: jax.Array, eps: float = 1e-3, t_B: jax.Array | None = None
) -> tuple[jax.Array, jax.Array]:
    """LLaDA's forward process on the response: ``(p_B, masked_BT)`` with ``p_B = (1 - eps)
    t_B + eps`` (``t_B ~ U(0, 1)`` from the key unless given) and each valid position masked
    with probability ``p_B``. ``t_B = 1`` masks every valid position."""
    t_key, mask_key = jax.random.split(key)
    B, T = mask_BT.shape
    t_B = jax.random.uniform(t_key, (B,), F32) if t_B is None else jnp.asarray(t_B, F32)
    p_B = (1.0 - eps) * t_B + eps
    u_BT = jax.random.uniform(mask_key, (B, T), F32)
    return p_B, mask_BT.astype(bool) & (u_BT < p_B[:, None])


def sft_loss(
    params: Params,
    config: LLaDAConfig,
    batch: Mapping[str, jax.Array],
    key: jax.Array,
    *,
    eps: float = 1e-3,
    t_B: jax.Array | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """LLaDA's masked-diffusion SFT loss (module docstring) and its metrics, all float32:
    ``loss``; ``masked_ce`` (the unweighted mean cross-entropy over masked tokens);
    ``masked_fraction`` (masked / valid response tokens); ``p_mask`` (mean p_b);
    ``response_tokens``. ``t_B`` [B] overrides the sampled t (``1`` masks every response
    token, making the loss the plain mean per-row cross-entropy of a fully masked response)."""
    missing = [k for k in BATCH_KEYS if k not in batch]
    if missing:
        raise ValueError(f"SFT batch is missing {missing}; it needs {list(BATCH_KEYS)}.")
    if not 0 < eps < 1:
        raise ValueError(f"eps must be in (0, 1) (the smallest mask probability), got {eps!r}.")
    prompt_BP = jnp.asarray(batch["prompt_tokens"], jnp.int32)
    prompt_mask_BP = jnp.asarray(batch["prompt_mask"], bool)
    tokens_BT = jnp.asarray(batch["tokens"], jnp.int32)
    valid_BT = jnp.asarray(batch["mask"], bool)
    if prompt_BP.ndim != 2 or tokens_BT.ndim != 2 or prompt_BP.shape[0] != tokens_BT.shape[0]:
        raise ValueError(
            f"prompt_tokens {prompt_BP.shape} and tokens {tokens_BT.shape} must be [B, P] and "
            "[B, T] with the same B."
        )
    P = prompt_BP.shape[1]
    pad = config.pad_token_id  # padding inputs are invisible; ids there may be anything
    p_B, masked_BT = corrupt(key, valid_BT, eps, t_B)
    response_BT = jnp.where(masked_BT, config.mask_token_id, jnp.where(valid_BT, tokens_BT, pad))
    input_BS = jnp.concatenate([jnp.where(prompt_mask_BP, prompt_BP, pad), response_BT], axis=1)
    valid_BS = jnp.concatenate([prompt_mask_BP, valid_BT], axis=1)
    logits_BTV = llada.forward(params, config, input_BS, valid_BS)[:, P:].astype(F32)
    logp_BTV = jax.nn.log_softmax(logits_BTV, axis=-1)
    target_BT = jnp.where(valid_BT, tokens_BT, 0)[..., None]
    ce_BT = -jnp.take_along_axis(logp_BTV, target_BT, axis=-1)[..., 0]
    ce_BT = jnp.where(masked_BT, ce_BT, 0.0)
    n_B = valid_BT.sum(-1).astype(F32)
    has_response_B = n_B > 0
    row_loss_B = ce_BT.sum(-1) / (p_B * jnp.maximum(n_B, 1.0))
    rows = jnp.maximum(has_response_B.sum().astype(F32), 1.0)
    loss = jnp.where(has_response_B, row_loss_B, 0.0).sum() / rows
    masked = masked_BT.sum().astype(F32)
    metrics = {
        "loss": loss,
        "masked_ce": ce_BT.sum() / jnp.maximum(masked, 1.0),
        "masked_fraction": masked / jnp.maximum(n_B.sum(), 1.0),
        "p_mask": jnp.where(has_response_B, p_B, 0.0).sum() / rows,
        "response_tokens": n_B.sum(),
    }
    return loss, metrics


def sft_optimizer(
    learning_rate: float | optax.Schedule = 2.5e-5,
    *,
    weight_decay: float = 0.1,
    grad_clip: float = 1.0,
) -> optax.GradientTransformation:
    """AdamW (LLaDA's SFT: weight decay 0.1, peak learning rate 2.5e-5) after global-norm
    clipping."""
    return optax.chain(
        optax.clip_by_global_norm(grad_clip),
        optax.adamw(learning_rate, weight_decay=weight_decay),
    )


def make_sft_step(
    config: LLaDAConfig,
    optimizer: optax.GradientTransformation,
    *,
    eps: float = 1e-3,
    compute_dtype=None,
) -> Callable:
    """A jitted ``sft_step(params, opt_state, batch, key) -> (params, opt_state, metrics)``:
    one ``optimizer`` update on `sft_loss`'s gradient. ``params`` stay in their dtype (the
    float32 master); with ``compute_dtype`` (e.g. bfloat16) the forward runs on a cast copy.
    ``metrics`` are `sft_loss`'s (before the update) plus ``grad_norm``. Pass a new ``key``
    per step for new masks."""

    def sft_step(params, opt_state, batch, key):
        def loss_fn(p):
            p = p if compute_dtype is None else cast_params(p, compute_dtype)
            return sft_loss(p, config, batch, key, eps=eps)

        (_, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return params, opt_state, {**metrics, "grad_norm": optax.tree_utils.tree_norm(grads)}

    return jax.jit(sft_step)
