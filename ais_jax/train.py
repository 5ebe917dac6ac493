"""The GRPO + AIS training step as pure, jitted phase functions (SPEC.md section 4).

One step of training is four jitted calls and a little host work:

    sync     trainer params (float32 master) -> rollout copy: bf16, or FP8/FP6/FP4 `QArray`s
    rollout  `sampler.generate` with the rollout copy; keeps logp_rollout of every token
    (host)   decode responses, reward them, group-relative advantages
    score    logp_old = logp_train: the BF16 trainer's log-probs of the same tokens
    update   PPO epochs x minibatches of the GRPO loss; the correction (none | tis | ais | mis)
             is applied per minibatch inside the loss, so AIS's alpha is one scalar per
             minibatch, computed from detached values

Precision policy: master params and optimizer state are float32; every forward of the trainer
(score and update) runs in bfloat16 (`cast_params`); logits, log-softmax, log-probs, ratios and
losses are float32. A minibatch whose loss or gradient is not finite is skipped (params and
optimizer state unchanged) and counted in `train/skipped_steps`.

Nothing here touches files, logging or the command line: see `runner.py`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import struct

from ais_jax import ais, grpo
from ais_jax.config import CorrectionConfig, LossConfig, OptimConfig, RolloutConfig
from ais_jax.model import Params, cast_params
from ais_jax.model_config import ModelConfig
from ais_jax.quant import quantize_params
from ais_jax.sampler import token_logprobs

COMPUTE_DTYPE = jnp.bfloat16


@struct.dataclass
class TrainState:
    step: jax.Array  # int32 scalar: RL steps done
    params: Params  # float32 master weights
    opt_state: Any
    skipped: jax.Array  # int32 scalar: minibatch updates skipped as non-finite


@struct.dataclass
class Batch:
    """One rollout batch, N = prompts_per_step * group_size rows."""

    prompt_tokens: jax.Array  # [N, P]
    prompt_mask: jax.Array  # [N, P]
    tokens: jax.Array  # [N, T]
    mask: jax.Array  # [N, T]
    logp_rollout: jax.Array  # [N, T] float32, logp_plain of the rollout engine
    logp_old: jax.Array  # [N, T] float32, BF16 trainer (= logp_train)
    advantages: jax.Array  # [N] float32
    logp_ref: jax.Array | None = None  # [N, T] float32, frozen reference (kl_coef > 0)


def make_optimizer(cfg: OptimConfig, total_steps: int) -> optax.GradientTransformation:
    """AdamW with global-norm clipping and a warmup (+ optional cosine) schedule."""
    updates = max(1, total_steps * cfg.ppo_epochs * cfg.minibatches)
    warmup = cfg.warmup_steps * cfg.ppo_epochs * cfg.minibatches
    if cfg.schedule == "cosine":
        lr = optax.warmup_cosine_decay_schedule(
            0.0, cfg.learning_rate, max(warmup, 1), max(updates, warmup + 1)
        )
    elif warmup:
        lr = optax.join_schedules(
            [
                optax.linear_schedule(0.0, cfg.learning_rate, warmup),
                optax.constant_schedule(cfg.learning_rate),
            ],
            [warmup],
        )
    else:
        lr = cfg.learning_rate
    return optax.chain(
        optax.clip_by_global_norm(cfg.grad_clip),
        optax.adamw(lr, b1=cfg.b1, b2=cfg.b2, weight_decay=cfg.weight_decay),
    )


def make_correction(cfg: CorrectionConfig) -> Callable:
    """The correction callable of `ais.py` that ``cfg.method`` names."""
    if cfg.method == "none":
        return ais.uncorrected(clip=cfg.clip)
    if cfg.method == "tis":
        return ais.truncated(cfg.clip, level=cfg.level)
    if cfg.method == "ais":
        return ais.adaptive(
            clip=cfg.clip, delta=cfg.delta, gamma=cfg.gamma, beta_var=cfg.beta_var, eps=cfg.eps
        )
    return ais.masked(cfg.low, cfg.high, level=cfg.level)


def init_state(params: Params, optimizer: optax.GradientTransformation) -> TrainState:
    # a copy: `update` donates the state, which must never delete the caller's arrays
    params = jax.tree_util.tree_map(lambda x: jnp.array(x, jnp.float32, copy=True), params)
    return TrainState(
        step=jnp.zeros((), jnp.int32),
        params=params,
        opt_state=optimizer.init(params),
        skipped=jnp.zeros((), jnp.int32),
    )


@functools.partial(jax.jit, static_argnames=("cfg",))
def sync_rollout_params(params: Params, cfg: RolloutConfig) -> Params:
    """The rollout engine's copy of the trainer weights, made on device."""
    if cfg.format == "bf16":
        return cast_params(params, COMPUTE_DTYPE)
    return quantize_params(params, cfg.format, act_scaling=cfg.act_scaling, lm_head=cfg.fp8_lm_head)


@functools.partial(jax.jit, static_argnames=("config",))
def score(
    params: Params, config: ModelConfig, prompt_tokens, prompt_mask, tokens, mask, temperature
):
    """logp_train (BF16 trainer, float32 log-softmax) and entropy of the sampled tokens."""
    return token_logprobs(
        cast_params(params, COMPUTE_DTYPE),
        config,
        prompt_tokens,
        prompt_mask,
        tokens,
        mask,
        temperature=temperature,
        return_entropy=True,
    )


def _all_finite(tree) -> jax.Array:
    leaves = jax.tree_util.tree_leaves(tree)
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves]))


@functools.partial(
    jax.jit,
    static_argnames=("config", "optimizer", "optim", "loss_cfg", "correction", "temperature"),
    donate_argnames=("state",),
)
def update(
    state: TrainState,
    batch: Batch,
    key: jax.Array,
    *,
    config: ModelConfig,
    optimizer: optax.GradientTransformation,
    optim: OptimConfig,
    loss_cfg: LossConfig,
    correction: Callable,
    temperature: float,
) -> tuple[TrainState, dict[str, jax.Array]]:
    """``ppo_epochs`` passes over ``minibatches`` shuffled minibatches of the GRPO loss."""
    N = batch.tokens.shape[0]
    M = optim.minibatches
    perms = [jax.random.permutation(k, N) for k in jax.random.split(key, optim.ppo_epochs)]
    idx_UM = jnp.concatenate([p.reshape(M, N // M) for p in perms])  # U = epochs * minibatches

    def loss_fn(params, mb: Batch):
        logp_new = token_logprobs(
            cast_params(params, COMPUTE_DTYPE),
            config,
            mb.prompt_tokens,
            mb.prompt_mask,
            mb.tokens,
            mb.mask,
            temperature=temperature,
        )
        return grpo.loss(
            logp_new,
            mb.logp_old,
            mb.advantages,
            mb.mask,
            logp_ref_BT=mb.logp_ref,
            clip_low=loss_cfg.clip_low,
            clip_high=loss_cfg.clip_high,
            kl_coef=loss_cfg.kl_coef,
            aggregation=loss_cfg.aggregation,
            correction=correction,
            logp_rollout_BT=mb.logp_rollout,
        )

    def minibatch_step(carry, idx):
        params, opt_state, skipped = carry
        mb = jax.tree_util.tree_map(lambda x: x[idx], batch)
        (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, mb)
        updates, new_opt_state = optimizer.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        ok = jnp.isfinite(loss) & _all_finite(grads)
        keep = lambda new, old: jax.tree_util.tree_map(  # noqa: E731
            lambda a, b: jnp.where(ok, a, b), new, old
        )
        metrics = dict(
            metrics,
            **{
                "train/grad_norm": optax.tree_utils.tree_norm(grads),
                "train/skipped": (~ok).astype(jnp.float32),
            },
        )
        return (
            keep(new_params, params),
            keep(new_opt_state, opt_state),
            skipped + (~ok).astype(jnp.int32),
        ), metrics

    (params, opt_state, skipped), metrics_U = jax.lax.scan(
        minibatch_step, (state.params, state.opt_state, state.skipped), idx_UM
    )
    metrics = {k: jnp.mean(v) for k, v in metrics_U.items()}
    metrics["train/skipped_steps"] = skipped.astype(jnp.float32)
    new_state = TrainState(step=state.step + 1, params=params, opt_state=opt_state, skipped=skipped)
    return new_state, metrics


@functools.partial(
    jax.jit, static_argnames=("config", "optimizer"), donate_argnames=("params", "opt_state")
)
def sft_step(
    params: Params,
    opt_state,
    prompt_tokens,
    prompt_mask,
    tokens,
    mask,
    *,
    config: ModelConfig,
    optimizer: optax.GradientTransformation,
):
    """One supervised step on prompt + demonstration: mean token cross-entropy of the response."""

    def loss_fn(p):
        logp = token_logprobs(
            cast_params(p, COMPUTE_DTYPE), config, prompt_tokens, prompt_mask, tokens, mask
        )
        return -jnp.sum(logp) / jnp.maximum(jnp.sum(mask), 1)

    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss
