"""Masked-diffusion SFT for LLaDA (the supervised warm start) and the jitted diffu-GRPO phases.

The RL phases (`make_phases`, `score`, `grpo_update`; the section "diffu-GRPO" below has the
step and the batch layout) reuse `train.TrainState`, `train.Batch`, `train.make_optimizer`,
`train.make_correction` and `grpo.loss` as they are: the corrections never learn that the
model is a diffusion model. diffusion_run.py drives them through runner.py's loop.

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

import dataclasses
import functools
from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp
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
# One RL step of a diffusion model (diffusion_run.py drives it; compare train.py's docstring):
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


# ---- the jitted phases --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class DiffusionPhases:
    """The jitted phases of a LLaDA run (`make_phases`), with `train.Phases`' conventions
    (global arrays on the mesh, rows over data x fsdp, the TRAIN / ROLLOUT layouts, donation).

    init(params) -> TrainState;  sync(params) -> rollout copy;  sync_bf16 (evaluation policy)
    generate(rollout params, prompts, prompt_mask, key, logp_key, temperature, remasking,
             p_mask_prompt) -> DiffusionRollout;  generate_bf16 (the same program)
    score(rollout params, params, prompt_tokens, prompt_mask, tokens, mask, mask_keys,
          p_mask_prompt) -> Scored
    update(state, batch, key) -> (state, metrics)        donates ``state``
    sft_init(params) -> opt_state
    sft_step(params, opt_state, prompt_tokens, prompt_mask, tokens, mask, key)
        -> (params, opt_state, loss)                     donates params and opt_state
    """

    init: Callable
    sync: Callable
    generate: Callable
    sync_bf16: Callable
    generate_bf16: Callable
    score: Callable
    update: Callable
    sft_init: Callable
    sft_step: Callable


def make_phases(
    mesh: jax.sharding.Mesh,
    cfg,
    config: LLaDAConfig,
    *,
    eos_ids: tuple[int, ...] = (),
    pad_id: int = 0,
    compute_dtype=None,
) -> DiffusionPhases:
    """The phases of training LLaDA ``config`` under ``cfg`` (a `config.TrainConfig`) on
    ``mesh``, memoised on what each reads like `train.make_phases` (arms and seeds of a
    comparison share them). Sampling options are runtime arguments: no recompiles."""
    dtype = compute_dtype or train.COMPUTE_DTYPE
    r = cfg.rollout
    weights = train.rollout_weights(r)
    bf16 = RolloutConfig(format="bf16")
    decode = dict(
        gen_length=r.max_new_tokens,
        block_length=r.diffusion.block_length,
        steps=r.diffusion.steps,
        eos_ids=tuple(eos_ids),
        pad_id=pad_id,
    )
    return DiffusionPhases(
        init=_init_phase(mesh, config, cfg.optim, cfg.steps),
        sync=_sync_phase(mesh, config, weights, dtype),
        generate=_generate_phase(mesh, config, weights, dtype, **decode),
        sync_bf16=_sync_phase(mesh, config, bf16, dtype),
        generate_bf16=_generate_phase(mesh, config, bf16, dtype, **decode),
        score=_score_phase(mesh, config, weights, dtype),
        update=_update_phase(mesh, config, cfg.optim, cfg.steps, cfg.loss, cfg.correction, dtype),
        sft_init=_sft_init_phase(mesh, config, cfg.sft),
        sft_step=_sft_step_phase(mesh, config, cfg.sft, dtype),
    )


def _master(config: LLaDAConfig) -> Params:
    return jax.eval_shape(lambda k: llada.init_params(config, k), jax.random.key(0))


def _copy(config: LLaDAConfig, rollout: RolloutConfig, dtype) -> Params:
    sync = functools.partial(train.sync_rollout_params, cfg=rollout, dtype=dtype)
    return jax.eval_shape(sync, _master(config))


@functools.lru_cache(maxsize=train.PHASE_MEMO)
def _init_phase(mesh, config: LLaDAConfig, optim, steps: int) -> Callable:
    init = functools.partial(train.init_state, optimizer=train.make_optimizer(optim, steps))
    shardings = shd.param_shardings(jax.eval_shape(init, _master(config)), mesh, shd.TRAIN)
    jitted = jax.jit(init, out_shardings=shardings)
    return lambda params: jitted(jax.device_put(params, shardings.params))


@functools.lru_cache(maxsize=train.PHASE_MEMO)
def _sync_phase(mesh, config: LLaDAConfig, rollout: RolloutConfig, dtype) -> Callable:
    sync = functools.partial(train.sync_rollout_params, cfg=rollout, dtype=dtype)
    in_train = shd.param_shardings(_copy(config, rollout, dtype), mesh, shd.TRAIN)
    return jax.jit(
        lambda params: jax.lax.with_sharding_constraint(sync(params), in_train),
        in_shardings=(shd.param_shardings(_master(config), mesh, shd.TRAIN),),
        out_shardings=shd.param_shardings(_copy(config, rollout, dtype), mesh, shd.ROLLOUT),
    )


@functools.lru_cache(maxsize=train.PHASE_MEMO)
def _generate_phase(mesh, config: LLaDAConfig, rollout: RolloutConfig, dtype, **decode) -> Callable:
    def rollout_fn(params, prompts, prompt_mask, key, logp_key, temperature, remasking, p_mask):
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
    copy = shd.param_shardings(_copy(config, rollout, dtype), mesh, shd.ROLLOUT)
    out = ds.DiffusionRollout(*[rows] * 8, logp_key=rep)
    return jax.jit(
        rollout_fn,
        in_shardings=(copy, rows, rows, rep, rep, rep, rep, rep),
        out_shardings=out,
    )


@functools.lru_cache(maxsize=train.PHASE_MEMO)
def _score_phase(mesh, config: LLaDAConfig, rollout: RolloutConfig, dtype) -> Callable:
    rows, rep = shd.batch_sharding(mesh), shd.replicated(mesh)
    copy = shd.param_shardings(_copy(config, rollout, dtype), mesh, shd.ROLLOUT)
    master = shd.param_shardings(_master(config), mesh, shd.TRAIN)

    def score_fn(rollout_params, params, *batch):
        return score(rollout_params, params, config, *batch, dtype=dtype)

    return jax.jit(
        score_fn,
        in_shardings=(copy, master, rows, rows, rows, rows, rep, rep),
        out_shardings=rows,
    )


@functools.lru_cache(maxsize=train.PHASE_MEMO)
def _update_phase(mesh, config: LLaDAConfig, optim, steps, loss_cfg, correction, dtype) -> Callable:
    optimizer = train.make_optimizer(optim, steps)
    step = functools.partial(
        grpo_update,
        config=config,
        optimizer=optimizer,
        optim=optim,
        loss_cfg=loss_cfg,
        correction=train.make_correction(correction),
        dtype=dtype,
    )
    init = functools.partial(train.init_state, optimizer=optimizer)
    state_sh = shd.param_shardings(jax.eval_shape(init, _master(config)), mesh, shd.TRAIN)
    rep = shd.replicated(mesh)
    return jax.jit(
        step,
        in_shardings=(state_sh, shd.batch_sharding(mesh), rep),
        out_shardings=(state_sh, rep),
        donate_argnums=0,
    )


def make_sft_optimizer(sft) -> optax.GradientTransformation:
    """`train.make_sft_optimizer` (Adam, warmup + cosine) after global-norm clipping at 1 (the
    Hugging Face Trainer default that LLaDA's and d1's SFT run with): the 1/p_b weights of
    `sft_loss` reach 1/eps = 1000 on a lightly masked row, and one such row's gradient would
    otherwise take a full Adam step."""
    return optax.chain(optax.clip_by_global_norm(1.0), train.make_sft_optimizer(sft))


@functools.lru_cache(maxsize=train.PHASE_MEMO)
def _sft_init_phase(mesh, config: LLaDAConfig, sft) -> Callable:
    init = make_sft_optimizer(sft).init
    shardings = shd.param_shardings(jax.eval_shape(init, _master(config)), mesh, shd.TRAIN)
    master = shd.param_shardings(_master(config), mesh, shd.TRAIN)
    return jax.jit(init, in_shardings=(master,), out_shardings=shardings)


@functools.lru_cache(maxsize=train.PHASE_MEMO)
def _sft_step_phase(mesh, config: LLaDAConfig, sft, dtype) -> Callable:
    optimizer = make_sft_optimizer(sft)
    step = functools.partial(masked_sft_step, config=config, optimizer=optimizer, dtype=dtype)
    master = shd.param_shardings(_master(config), mesh, shd.TRAIN)
    opt_sh = shd.param_shardings(jax.eval_shape(optimizer.init, _master(config)), mesh, shd.TRAIN)
    rows, rep = shd.batch_sharding(mesh), shd.replicated(mesh)
    return jax.jit(
        step,
        in_shardings=(master, opt_sh, rows, rows, rows, rows, rep),
        out_shardings=(master, opt_sh, rep),
        donate_argnums=(0, 1),
    )
