"""LLaDA's masked-diffusion training: the SFT loss (the supervised warm start) and diffu-GRPO,
as the `train.Estimator` `ESTIMATOR` that `train.make_phases` builds phases from and `Run`
drives, like the autoregressive one.

What differs from an autoregressive model is the estimator's part alone: how to roll out
(`generate_phase`: LLaDA's semi-autoregressive sampler), how to score log-probs (`score`: the
one-step estimates of d1 on J corrupted prompts, the section "diffu-GRPO" below has the step and
the batch layout), the update that learns from them (`grpo_update`) and the SFT loss
(`sft_loss`). They reuse `train.TrainState`, `train.Batch`, `train.make_optimizer`,
`train.make_correction`, the minibatch scan and `grpo.loss` as they are: the corrections never
learn that the model is a diffusion model.

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

import functools
from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import struct

from ais_jax import grpo
from ais_jax.config import RolloutConfig
from ais_jax.models import llada
from ais_jax.models.llada import LLaDAConfig
from ais_jax.nn.layers import Params, cast_params
from ais_jax.parallel import sharding as shd
from ais_jax.rollout import diffusion as ds
from ais_jax.train import step as train

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


# ---- diffu-GRPO: the RL phases ------------------------------------------------------------------
#
# One RL step of a diffusion model (`Run.step` drives it through `ESTIMATOR`; compare step.py's
# docstring):
#
#     sync      trainer params (float32) -> rollout copy (bf16, or FP8/FP4 `QArray`s)
#     generate  `diffusion_sampler.generate_arrays` with the rollout copy
#     (host)    decode, reward, group-relative advantages
#     score     for each of the J = ``optim.ppo_epochs`` inner updates (d1's mu), a prompt mask
#               from its own key: the corrupted prompt z_j, logp_rollout_j (the rollout copy's
#               `response_logp` on z_j) and logp_old_j (the BF16 trainer's, start-of-batch
#               params, on the same z_j)
#     update    inner update j = 1..J: ``minibatches`` shuffled minibatches of `grpo.loss` with
#               logp_new on z_j, logp_old_j and the correction (none/tis/ais/mis) on
#               logp_rollout_j: its ratio is a pure precision ratio (same input, two numerical
#               versions of the network; exactly 1 for a BF16 rollout of the same weights)
#
# The batch is a `train.Batch` whose fields carry the inner-update axis J after the rows:
# ``prompt_tokens`` [B, J, P] are the corrupted prompts z_j (mask tokens in place), and
# ``logp_rollout`` / ``logp_old`` are [B, J, T]; ``prompt_mask`` [B, P], ``tokens`` / ``mask``
# [B, T] and ``advantages`` [B] are those of `train.update`. Rows lead every field, so the batch
# shards over data x fsdp and a minibatch is a row selection, as in train.py. The loss and the
# corrections are grpo.py's and ais.py's, unchanged: they see [b, T] log-probs.


@struct.dataclass
class Scored:
    """The score phase's output: the corrupted prompts ``[B, J, P]``, logp_rollout and
    logp_old ``[B, J, T]`` (float32) and the trainer's entropy ``[B, T]`` on mask 0."""

    prompt_tokens: jax.Array
    logp_rollout: jax.Array
    logp_old: jax.Array
    entropy: jax.Array


def score(
    rollout_params: Params,
    params: Params,
    config: LLaDAConfig,
    prompt_tokens_BP,
    prompt_mask_BP,
    tokens_BT,
    mask_BT,
    mask_keys_J,
    p_mask_prompt,
    *,
    dtype=jnp.bfloat16,
) -> Scored:
    """Per inner update j (key ``mask_keys_J[j]``): z_j = `diffusion_sampler.corrupt_prompt`,
    logp_rollout_j under ``rollout_params`` and logp_old_j under ``params`` cast to ``dtype``,
    both `diffusion_sampler.response_logp` on z_j (module section above)."""
    trainer = cast_params(params, dtype)

    def one(key):
        z_BP = ds.corrupt_prompt(
            key, prompt_tokens_BP, prompt_mask_BP, p_mask_prompt, config.mask_token_id
        )
        lr_BT = ds.response_logp(rollout_params, config, z_BP, prompt_mask_BP, tokens_BT, mask_BT)
        lo_BT, h_BT = ds.response_logp(
            trainer, config, z_BP, prompt_mask_BP, tokens_BT, mask_BT, return_entropy=True
        )
        return z_BP, lr_BT, lo_BT, h_BT

    z_JBP, lr_JBT, lo_JBT, h_JBT = jax.lax.map(one, mask_keys_J)
    rows_first = lambda x: jnp.moveaxis(x, 0, 1)  # noqa: E731
    return Scored(
        prompt_tokens=rows_first(z_JBP),
        logp_rollout=rows_first(lr_JBT),
        logp_old=rows_first(lo_JBT),
        entropy=h_JBT[0],
    )


def grpo_update(
    state: train.TrainState,
    batch: train.Batch,
    key: jax.Array,
    *,
    config: LLaDAConfig,
    optimizer: optax.GradientTransformation,
    optim,
    loss_cfg,
    correction,
    dtype=jnp.bfloat16,
) -> tuple[train.TrainState, dict[str, jax.Array]]:
    """d1's inner updates on one scored batch (module section above): for j = 1..J, a new
    shuffle (from ``key``) into ``optim.minibatches`` minibatches, each an AdamW step on
    `grpo.loss` with ``logp_new = response_logp(params, z_j)``, ``logp_old_j`` and the
    correction on ``logp_rollout_j``. U = J * minibatches metric values reduce to one per step
    by `ais.reduce_minibatch_metrics`; a non-finite loss or gradient skips its minibatch (the
    minibatch step and the scan are `train.apply_minibatch` and `train.scan_minibatches`)."""
    B, J = batch.logp_rollout.shape[:2]
    M = optim.minibatches
    idx_UM = train.minibatch_order(key, B, J, M)  # U = J * M
    j_U = jnp.repeat(jnp.arange(J), M)

    def loss_fn(params, mb: train.Batch):
        logp_new_BT = ds.response_logp(
            cast_params(params, dtype), config, mb.prompt_tokens, mb.prompt_mask, mb.tokens, mb.mask
        )
        return grpo.loss(
            logp_new_BT,
            mb.logp_old,
            mb.advantages,
            mb.mask,
            clip_low=loss_cfg.clip_low,
            clip_high=loss_cfg.clip_high,
            kl_coef=loss_cfg.kl_coef,
            aggregation=loss_cfg.aggregation,
            correction=correction,
            logp_rollout_BT=mb.logp_rollout,
        )

    def minibatch_step(carry, x):
        j, idx = x
        inner = lambda a: a[idx][:, j]  # noqa: E731  (rows, then inner update j)
        mb = train.Batch(
            prompt_tokens=inner(batch.prompt_tokens),
            prompt_mask=batch.prompt_mask[idx],
            tokens=batch.tokens[idx],
            mask=batch.mask[idx],
            logp_rollout=inner(batch.logp_rollout),
            logp_old=inner(batch.logp_old),
            advantages=batch.advantages[idx],
        )
        return train.apply_minibatch(carry, mb, loss_fn, optimizer)

    return train.scan_minibatches(state, minibatch_step, (j_U, idx_UM))


def masked_sft_step(
    params, opt_state, prompt_tokens, prompt_mask, tokens, mask, key, *, config, optimizer, dtype
):
    """One `sft_loss` step for the runner's SFT phase: ``(params, opt_state, loss)``."""

    def loss_fn(p):
        batch = dict(prompt_tokens=prompt_tokens, prompt_mask=prompt_mask, tokens=tokens, mask=mask)
        return sft_loss(cast_params(p, dtype), config, batch, key)[0]

    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss


# ---- the estimator: diffu-GRPO in `train.make_phases` and `Run` ----------------------------------


def mask_keys(key: jax.Array, passes: int) -> tuple[jax.Array, jax.Array]:
    """``(sampler key, [passes] prompt-mask keys)`` of a step's rollout ``key``: the sampler
    draws from the first half of ``split(key)``, the J = ``optim.ppo_epochs`` inner updates'
    prompt masks from ``split`` of the second."""
    sample_key, masks_key = jax.random.split(key)
    return sample_key, jax.random.split(masks_key, passes)


def update(state, batch, key, *, temperature, **kwargs):
    """`grpo_update` as the `train.Estimator` calls it. ``temperature`` is not read: the
    one-step estimates are the model's distribution at T = 1 whatever the sampling temperature
    (d1's diffu-GRPO)."""
    del temperature
    return grpo_update(state, batch, key, **kwargs)


def experience(phases, cfg, rollout_params, params, ref_params, ro, advantages, key):
    """The diffu-GRPO batch of rollout ``ro`` (layout in the section above): J prompt masks
    from the rollout ``key`` (`mask_keys`), per mask logp_rollout under the rollout copy and
    logp_old under the BF16 trainer on the same corrupted prompt; the entropy is the trainer's
    on mask 0. No reference policy (`config` rejects ``kl_coef > 0`` for LLaDA)."""
    del ref_params
    _, keys_J = mask_keys(key, cfg.optim.ppo_epochs)
    p_mask = jnp.float32(cfg.rollout.diffusion.p_mask_prompt)
    sampled = (ro.prompt_tokens, ro.prompt_mask, ro.tokens, ro.mask)
    scored = phases.score(rollout_params, params, *sampled, keys_J, p_mask)
    batch = train.Batch(
        prompt_tokens=scored.prompt_tokens,
        prompt_mask=ro.prompt_mask,
        tokens=ro.tokens,
        mask=ro.mask,
        logp_rollout=scored.logp_rollout,
        logp_old=scored.logp_old,
        advantages=advantages,
    )
    return batch, scored.entropy


def sft_responses(tokens_BT, mask_BT, eos_id):
    """LLaDA's SFT recipe: the response padded with EOS up to its full length and those EOS
    counted as answer tokens (so the model learns to fill the tail with EOS); nothing to trim."""
    return np.where(mask_BT, tokens_BT, eos_id), np.ones_like(mask_BT), False


def vocab_overrides(vocab_size: int, eos_id: int, pad_id: int) -> dict:
    """The tokenizer's ids and one more, the mask token, outside them; its end and padding ids."""
    return {
        "vocab_size": vocab_size + 1,
        "mask_token_id": vocab_size,
        "eos_token_id": eos_id,
        "pad_token_id": pad_id,
    }


def generate_phase(
    mesh, config: LLaDAConfig, rollout: RolloutConfig, *, dtype, cfg, eos_ids, pad_id
):
    """The generate phase in `train.Estimator`'s signature: LLaDA's semi-autoregressive sampler
    (``cfg.diffusion``'s block length, steps, remasking and prompt-mask probability) for
    ``cfg.max_new_tokens`` positions. ``key`` splits into the sampler's key and its
    ``logp_key``; ``top_k = 1`` is greedy (temperature 0, argmax); ``top_p`` and
    ``prompt_group`` do not apply (`config` rejects top-k/top-p for LLaDA)."""
    d = cfg.diffusion
    jitted = _generate_phase(
        mesh,
        config,
        rollout,
        dtype,
        gen_length=cfg.max_new_tokens,
        block_length=d.block_length,
        steps=d.steps,
        eos_ids=tuple(eos_ids),
        pad_id=pad_id,
    )
    remasking, p_mask = jnp.int32(ds.REMASKING.index(d.remasking)), jnp.float32(d.p_mask_prompt)

    def generate(params, prompts, prompt_mask, key, temperature, top_k, top_p, prompt_group=1):
        del top_p, prompt_group
        return jitted(params, prompts, prompt_mask, key, temperature, top_k, remasking, p_mask)

    return generate


@functools.lru_cache(maxsize=train.PHASE_MEMO)
def _generate_phase(mesh, config: LLaDAConfig, rollout: RolloutConfig, dtype, **decode) -> Callable:
    def rollout_fn(params, prompts, prompt_mask, key, temperature, top_k, remasking, p_mask):
        key, logp_key = jax.random.split(key)
        temperature = jnp.where(top_k == 1, 0.0, temperature)  # greedy: argmax
        return ds.generate_arrays(
            params,
            config,
            prompts,
            prompt_mask,
            key,
            logp_key,
            temperature,
            remasking,
            p_mask,
            **decode,
        )

    rows, rep = shd.batch_sharding(mesh), shd.replicated(mesh)
    copy = shd.param_shardings(train.rollout_copy(config, rollout, dtype), mesh, shd.ROLLOUT)
    out = ds.DiffusionRollout(*[rows] * 8, logp_key=rep)
    return jax.jit(
        rollout_fn,
        in_shardings=(copy, rows, rows, rep, rep, rep, rep, rep),
        out_shardings=out,
    )


@functools.lru_cache(maxsize=train.PHASE_MEMO)
def score_phase(mesh, config: LLaDAConfig, dtype, weights: RolloutConfig) -> Callable:
    """`score` jitted: ``score(rollout params, params, prompt_tokens, prompt_mask, tokens,
    mask, mask_keys_J, p_mask_prompt) -> Scored`` (the rollout copy ``weights`` describes, in
    the ROLLOUT layout, and the master params)."""
    rows, rep = shd.batch_sharding(mesh), shd.replicated(mesh)
    copy = shd.param_shardings(train.rollout_copy(config, weights, dtype), mesh, shd.ROLLOUT)
    master = shd.param_shardings(train.master_shapes(config), mesh, shd.TRAIN)

    def score_fn(rollout_params, params, *batch):
        return score(rollout_params, params, config, *batch, dtype=dtype)

    return jax.jit(
        score_fn,
        in_shardings=(copy, master, rows, rows, rows, rows, rep, rep),
        out_shardings=rows,
    )


def make_sft_optimizer(sft) -> optax.GradientTransformation:
    """`train.make_sft_optimizer` (Adam, warmup + cosine) after global-norm clipping at 1 (the
    Hugging Face Trainer default that LLaDA's and d1's SFT run with): the 1/p_b weights of
    `sft_loss` reach 1/eps = 1000 on a lightly masked row, and one such row's gradient would
    otherwise take a full Adam step."""
    return optax.chain(optax.clip_by_global_norm(1.0), train.make_sft_optimizer(sft))


ESTIMATOR = train.Estimator(
    kind="diffusion",
    generate_phase=generate_phase,
    score_phase=score_phase,
    update=update,
    sft_optimizer=make_sft_optimizer,
    sft_step=masked_sft_step,
    experience=experience,
    sft_responses=sft_responses,
    vocab_overrides=vocab_overrides,
    keeps_rollout_copy=True,
)
