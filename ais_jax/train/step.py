"""The GRPO + AIS step: pure functions, each jitted once as a phase (docs/design.md section 4).

One step of training is four jitted calls and a little host work:

    sync     trainer params (float32 master) -> rollout copy: bf16, or FP8/FP6/FP4 `QArray`s
    rollout  `sampler.generate` with the rollout copy; keeps logp_rollout of every token
    (host)   decode responses, reward them, group-relative advantages
    score    logp_old = logp_train: the BF16 trainer's log-probs of the same tokens
    update   PPO epochs x minibatches of the GRPO loss; the correction (none | tis | ais | mis)
             is applied per minibatch inside the loss, so AIS's alpha is one scalar per
             minibatch, computed from detached values

On-policy (`on_policy`: one epoch of one minibatch) the score phase is skipped: the update's
own forward runs on the pre-update params, so ``logp_old = stop_gradient(logp_new)`` there is
the score's value at no extra forward (``Batch.logp_old = None`` asks for it), and the update
logs the entropy the score would have (``policy/entropy``). The LM head and log-softmax of both
run a few response positions at a time (`logprobs.token_logprobs`): no phase holds ``[B, T, V]``
float32 logits, or their gradient, at once.

plus, before RL, the supervised warm start (`sft_step`). Precision policy: master params and
optimizer state are float32; every forward of the trainer (score, update, SFT) runs in
bfloat16 (`COMPUTE_DTYPE`, via `cast_params`); logits, log-softmax, log-probs, ratios and
losses are float32. A minibatch whose loss or gradient is not finite is skipped (params and
optimizer state unchanged) and counted in `train/skipped_steps`.

`make_phases` is the one place the phases are jitted: each with its ``in_shardings`` and
``out_shardings`` from `sharding.py`'s table (the trainer's state in the `TRAIN` layout, the
rollout copy in the `ROLLOUT` layout, the rows of every batch over data x fsdp) and with
donation of the state it replaces. Each phase is memoised on the hashable settings it depends
on -- the mesh, the model config and the config sections it reads -- so every `Run` with equal
settings (the arms and seeds of a comparison, a resumed run) gets the very same jitted callables
and compiles nothing again, and a phase a setting does not touch is shared across it (scoring
across corrections, the BF16 evaluation policy across rollout formats).

What differs between kinds of model is an `Estimator`: how to roll out (the generate phase),
score log-probs (the score phase, and the host code that makes the update's batch), the
update's loss and the SFT step. `AUTOREGRESSIVE` (below) trains every autoregressive family
through `ais_jax.models`' entry points (`param_shapes`, `forward`/`final_hidden` inside
`logprobs.token_logprobs`, `init_cache`/`forward_cached` inside `sampler.generate`), which
dispatch on the config's type; `diffusion.ESTIMATOR` is LLaDA's. init, sync, the update's jit
and SFT's are one code path for both.

Nothing here touches files, logging or the command line: see `run.py`.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import struct

from ais_jax import ais, grpo
from ais_jax.config import (
    CorrectionConfig,
    LossConfig,
    OptimConfig,
    RolloutConfig,
    SFTConfig,
    TrainConfig,
)
from ais_jax.models import Config, family_of, param_shapes
from ais_jax.nn.layers import Params, cast_params, check_prompt_group
from ais_jax.nn.quant import quantize_params
from ais_jax.parallel import sharding as shd
from ais_jax.rollout import sampler
from ais_jax.train import logprobs

# The trainer's compute dtype. The phases read it when they are built (it is part of their
# memo key), so a test may set it to float32 to compare sharded with unsharded math exactly.
COMPUTE_DTYPE = jnp.bfloat16
PHASE_MEMO = 64  # compiled phases kept per builder (least recently used dropped first)


@struct.dataclass
class TrainState:
    step: jax.Array  # int32 scalar: RL steps done
    params: Params  # float32 master weights
    opt_state: Any
    skipped: jax.Array  # int32 scalar: minibatch updates skipped as non-finite


@struct.dataclass
class Batch:
    """One rollout batch, B = prompts_per_step * group_size rows of T response tokens."""

    prompt_tokens: jax.Array  # [B, P]
    prompt_mask: jax.Array  # [B, P]
    tokens: jax.Array  # [B, T]
    mask: jax.Array  # [B, T]
    logp_rollout: jax.Array  # [B, T] float32, logp_plain of the rollout engine
    # [B, T] float32, BF16 trainer (= logp_train); None: computed inside an on-policy update
    logp_old: jax.Array | None
    advantages: jax.Array  # [B] float32
    logp_ref: jax.Array | None = None  # [B, T] float32, frozen reference (kl_coef > 0)
    # The rows come in groups of this many consecutive rows with the same prompt (`Run`'s
    # batches: group_size). An on-policy update then runs each prompt once
    # (`logprobs.token_logprobs`); 1 claims nothing.
    prompt_group: int = struct.field(pytree_node=False, default=1)


# ---- optimizers and the correction --------------------------------------------------------------


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
        optax.adamw(lr, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay),
    )


def make_sft_optimizer(cfg: SFTConfig) -> optax.GradientTransformation:
    """Adam for the SFT warm start: linear warmup over min(50, steps / 10) steps, then cosine
    decay to 5% of the learning rate at ``cfg.steps`` (its own state, discarded after SFT)."""
    warmup = max(1, min(50, cfg.steps // 10))
    return optax.adam(
        optax.warmup_cosine_decay_schedule(
            0.0,
            cfg.learning_rate,
            warmup,
            max(cfg.steps, warmup + 1),
            end_value=0.05 * cfg.learning_rate,
        )
    )


def make_correction(cfg: CorrectionConfig) -> ais.Correction:
    """The correction of `ais.py` that ``cfg.method`` names. Every method logs the AIS
    diagnostics with the configured ``clip``, ``delta``, ``gamma``, ``beta_var`` and ``eps``;
    ``level`` applies to the methods that weight by it (tis, mis)."""
    diagnostics = dict(
        clip=cfg.clip, delta=cfg.delta, gamma=cfg.gamma, beta_var=cfg.beta_var, eps=cfg.eps
    )
    if cfg.method == "none":
        return ais.uncorrected(**diagnostics)
    if cfg.method == "tis":
        return ais.truncated(level=cfg.level, **diagnostics)
    if cfg.method == "ais":
        return ais.adaptive(**diagnostics)
    return ais.masked(cfg.low, cfg.high, level=cfg.level, **diagnostics)


# ---- the pure phase functions -------------------------------------------------------------------


def init_state(params: Params, optimizer: optax.GradientTransformation) -> TrainState:
    # a copy: `update` donates the state, which must never delete the caller's arrays
    params = jax.tree_util.tree_map(lambda x: jnp.array(x, jnp.float32, copy=True), params)
    return TrainState(
        step=jnp.zeros((), jnp.int32),
        params=params,
        opt_state=optimizer.init(params),
        skipped=jnp.zeros((), jnp.int32),
    )


def sync_rollout_params(params: Params, cfg: RolloutConfig, *, dtype=None) -> Params:
    """The rollout engine's copy of the trainer weights: the trainer's compute dtype for
    ``cfg.format == "bf16"``, else quantized (`quant.quantize_params`)."""
    if cfg.format == "bf16":
        return cast_params(params, dtype or COMPUTE_DTYPE)
    return quantize_params(params, cfg.format, act_scaling=cfg.act_scaling, lm_head=cfg.fp8_lm_head)


def score(
    params: Params,
    config: Config,
    prompt_tokens,
    prompt_mask,
    tokens,
    mask,
    temperature,
    *,
    dtype=None,
):
    """logp_train ``[B, T]`` (trainer in its compute dtype, float32 log-softmax) and the entropy
    of the sampled tokens' distributions ``[B, T]``."""
    return logprobs.token_logprobs(
        cast_params(params, dtype or COMPUTE_DTYPE),
        config,
        prompt_tokens,
        prompt_mask,
        tokens,
        mask,
        temperature=temperature,
        return_entropy=True,
    )


def on_policy(optim: OptimConfig) -> bool:
    """One PPO epoch of one minibatch: the only update, taken on the whole batch, starts from
    the params that would score it, so logp_old is the update's own detached logp_new."""
    return optim.ppo_epochs == 1 and optim.minibatches == 1


def all_finite(tree) -> jax.Array:
    """A bool scalar: every element of every leaf of ``tree`` is finite."""
    leaves = jax.tree_util.tree_leaves(tree)
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves]))


def minibatch_order(key: jax.Array, rows: int, passes: int, minibatches: int) -> jax.Array:
    """``[U, rows / minibatches]`` row indices, U = passes * minibatches: each pass (a PPO
    epoch, or a diffusion inner update) is a new permutation of the rows (its own key from
    ``split(key, passes)``) cut into ``minibatches`` equal minibatches."""
    perms = [jax.random.permutation(k, rows) for k in jax.random.split(key, passes)]
    return jnp.concatenate([p.reshape(minibatches, rows // minibatches) for p in perms])


def apply_minibatch(
    carry: tuple[Params, Any, jax.Array],
    mb: Batch,
    loss_fn: Callable,
    optimizer: optax.GradientTransformation,
) -> tuple[tuple[Params, Any, jax.Array], dict[str, jax.Array]]:
    """One optimizer step on minibatch ``mb``: ``carry = (params, opt_state, skipped)``,
    ``loss_fn(params, mb) -> (loss, metrics)``. A step whose loss or gradient is not finite
    leaves params and optimizer state unchanged and adds 1 to ``skipped``. Returns the new
    carry and ``metrics`` plus ``train/grad_norm`` and ``train/skipped`` (1.0 if skipped): the
    body of `scan_minibatches`' scan, shared by `update` and the diffusion trainer."""
    params, opt_state, skipped = carry
    (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, mb)
    updates, new_opt_state = optimizer.update(grads, opt_state, params)
    new_params = optax.apply_updates(params, updates)
    ok = jnp.isfinite(loss) & all_finite(grads)
    keep = lambda new, old: jax.tree_util.tree_map(  # noqa: E731
        lambda a, b: jnp.where(ok, a, b), new, old
    )
    metrics = {
        **metrics,
        "train/grad_norm": optax.tree_utils.tree_norm(grads),
        "train/skipped": (~ok).astype(jnp.float32),
    }
    carry = (
        keep(new_params, params),
        keep(new_opt_state, opt_state),
        skipped + (~ok).astype(jnp.int32),
    )
    return carry, metrics


def scan_minibatches(
    state: TrainState, minibatch_step: Callable, xs
) -> tuple[TrainState, dict[str, jax.Array]]:
    """``jax.lax.scan`` of ``minibatch_step(carry, x)`` (`apply_minibatch` on the minibatch
    ``x`` selects) over ``xs``, from ``state``: the next state (step + 1) and the U minibatches'
    metrics reduced to one value each by `ais.reduce_minibatch_metrics`, plus
    ``train/skipped_steps`` (the run's total of skipped minibatches)."""
    (params, opt_state, skipped), metrics_U = jax.lax.scan(
        minibatch_step, (state.params, state.opt_state, state.skipped), xs
    )
    metrics = ais.reduce_minibatch_metrics(metrics_U)
    metrics["train/skipped_steps"] = skipped.astype(jnp.float32)
    new_state = TrainState(step=state.step + 1, params=params, opt_state=opt_state, skipped=skipped)
    return new_state, metrics


def update(
    state: TrainState,
    batch: Batch,
    key: jax.Array,
    *,
    config: Config,
    optimizer: optax.GradientTransformation,
    optim: OptimConfig,
    loss_cfg: LossConfig,
    correction: ais.Correction,
    temperature: float,
    dtype=None,
) -> tuple[TrainState, dict[str, jax.Array]]:
    """``ppo_epochs`` passes over ``minibatches`` shuffled minibatches of the GRPO loss.

    The U = ppo_epochs * minibatches values of each metric reduce to one per step by
    `ais.reduce_minibatch_metrics`: maxima by max (``is/weight_max`` is the largest weight of
    the step, not a mean of minibatch maxima), the rest by mean.

    ``batch.logp_old = None`` (only `on_policy`): logp_old is ``stop_gradient(logp_new)`` of
    the update's forward, equal to the score phase's logp_train (same params, same dtype), and
    the metrics add ``policy/entropy``, the token mean of that forward's entropies
    (what the score phase returns): one forward per step instead of two.

    On-policy the minibatch is the whole batch in its own order (the loss does not depend on
    the order of its rows), so the groups of ``batch.prompt_group`` rows stay together and each
    prompt runs through the model once. Off-policy, minibatches take shuffled rows and every
    row runs its own prompt."""
    dtype = dtype or COMPUTE_DTYPE
    in_update = batch.logp_old is None
    if in_update and not on_policy(optim):
        raise ValueError(
            f"batch.logp_old=None with ppo_epochs={optim.ppo_epochs}, minibatches="
            f"{optim.minibatches}: logp_old is computed inside the update only on-policy "
            "(1 epoch, 1 minibatch); score the batch first (Phases.score)"
        )
    B = batch.tokens.shape[0]
    G = check_prompt_group(batch.prompt_group, B)
    if on_policy(optim):  # the one minibatch is the whole batch, in order: groups stay whole
        idx_UM = jnp.arange(B)[None]
    else:
        idx_UM, G = minibatch_order(key, B, optim.ppo_epochs, optim.minibatches), 1

    def loss_fn(params, mb: Batch):
        scored = logprobs.token_logprobs(
            cast_params(params, dtype),
            config,
            mb.prompt_tokens[::G],  # one prompt per group of G rows
            mb.prompt_mask[::G],
            mb.tokens,
            mb.mask,
            temperature=temperature,
            return_entropy=in_update,
            remat=optim.remat,
        )
        logp_new_BT, logp_old_BT, extra = scored, mb.logp_old, {}
        if in_update:
            logp_new_BT, entropy_BT = scored
            logp_old_BT = jax.lax.stop_gradient(logp_new_BT)
            mask_BT = mb.mask.astype(jnp.float32)
            entropy_sum = jnp.sum(jax.lax.stop_gradient(entropy_BT) * mask_BT)
            extra = {"policy/entropy": entropy_sum / jnp.maximum(mask_BT.sum(), 1)}
        loss, metrics = grpo.loss(
            logp_new_BT,
            logp_old_BT,
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
        return loss, {**metrics, **extra}

    def minibatch_step(carry, idx):
        mb = batch if on_policy(optim) else jax.tree_util.tree_map(lambda x: x[idx], batch)
        return apply_minibatch(carry, mb, loss_fn, optimizer)

    return scan_minibatches(state, minibatch_step, idx_UM)


def sft_step(
    params: Params,
    opt_state,
    prompt_tokens,
    prompt_mask,
    tokens,
    mask,
    key=None,
    *,
    config: Config,
    optimizer: optax.GradientTransformation,
    dtype=None,
):
    """One supervised step on prompt + demonstration: mean token cross-entropy of the response.
    ``key`` is unused (this loss draws nothing; the `Estimator` signature has it for the
    masked-diffusion loss, which draws its masks)."""

    def loss_fn(p):
        logp = logprobs.token_logprobs(
            cast_params(p, dtype or COMPUTE_DTYPE), config, prompt_tokens, prompt_mask, tokens, mask
        )
        return -jnp.sum(logp) / jnp.maximum(jnp.sum(mask), 1)

    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss


# ---- the estimator: what differs between an autoregressive and a diffusion model ---------------


@dataclasses.dataclass(frozen=True)
class Estimator:
    """How one kind of model (`Family.kind`) rolls out, scores log-probs and computes its
    losses: the part of training that differs between an autoregressive and a masked-diffusion
    model. `make_phases` builds every phase from it with the same shardings, memo and donation,
    and `Run` drives either through the same code. Two exist: `AUTOREGRESSIVE` (here) and
    `diffusion.ESTIMATOR` (LLaDA's diffu-GRPO); `run.ESTIMATORS` is the table by kind.

    kind                      the `Family.kind` it trains
    generate_phase(mesh, config, weights, *, dtype, cfg, eos_ids, pad_id)
        -> generate(params, prompts, prompt_mask, key, temperature, top_k, top_p,
                    prompt_group=1)           jitted; ``top_k = 1`` is greedy
    score_phase(mesh, config, dtype, weights) -> score (jitted; its own signature)
    update(state, batch, key, *, config, optimizer, optim, loss_cfg, correction,
           temperature, dtype) -> (state, metrics)          pure; jitted by `make_phases`
    sft_optimizer(sft) -> optax.GradientTransformation
    sft_step(params, opt_state, prompt_tokens, prompt_mask, tokens, mask, key, *, config,
             optimizer, dtype) -> (params, opt_state, loss)  pure; jitted by `make_phases`
    experience(phases, cfg, rollout_params, params, ref_params, rollout, advantages, key)
        -> (Batch, entropy_BT or None)         host code around the score phase: the batch
                                              the update learns from (``key``: the rollout's)
    sft_responses(tokens_BT, mask_BT, eos_id) -> (tokens_BT, mask_BT, trimmable)
                              the SFT targets from the encoded demonstrations, and whether
                              their padding columns may be dropped
    vocab_overrides(vocab_size, eos_id, pad_id) -> dict
                              the config fields that fit a preset model to a tokenizer of
                              ``vocab_size`` ids (the built-in character tokenizer)
    keeps_rollout_copy        ``experience`` reads the rollout copy (else a run frees it as
                              soon as the rollout is made)
    """

    kind: str
    generate_phase: Callable
    score_phase: Callable
    update: Callable
    sft_optimizer: Callable
    sft_step: Callable
    experience: Callable
    sft_responses: Callable
    vocab_overrides: Callable
    keeps_rollout_copy: bool = False


def experience(phases, cfg: TrainConfig, rollout_params, params, ref_params, ro, advantages, key):
    """The autoregressive batch of rollout ``ro``: logp_rollout is the sampler's, logp_old the
    score phase's (None on-policy: the update computes it, and the entropy, from its own
    forward) and logp_ref the reference policy's when ``loss.kl_coef > 0``. The rows come in
    groups of ``group_size`` with one prompt, each prompt scored once."""
    del rollout_params, key  # the sampler's log-probs are the rollout's; nothing is drawn
    G = cfg.rollout.group_size
    scored = (ro.prompt_tokens, ro.prompt_mask, ro.tokens, ro.mask)
    temperature = jnp.float32(cfg.rollout.temperature)
    logp_old = entropy = None
    if not on_policy(cfg.optim):
        logp_old, entropy = phases.score(params, *scored, temperature, G)
    logp_ref = None
    if cfg.loss.kl_coef > 0:
        logp_ref = phases.score(ref_params, *scored, temperature, G)[0]
    batch = Batch(
        prompt_tokens=ro.prompt_tokens,
        prompt_mask=ro.prompt_mask,
        tokens=ro.tokens,
        mask=ro.mask,
        logp_rollout=ro.logp_plain,
        logp_old=logp_old,
        advantages=advantages,
        logp_ref=logp_ref,
        prompt_group=G,
    )
    return batch, entropy


def sft_responses(tokens_BT, mask_BT, eos_id):
    """The demonstrations as encoded (EOS included, padding masked): padding may be trimmed."""
    return tokens_BT, mask_BT, True


def vocab_overrides(vocab_size: int, eos_id: int, pad_id: int) -> dict:
    """The logits' width is the tokenizer's (the end and padding ids are the tokenizer's own)."""
    del eos_id, pad_id
    return {"vocab_size": vocab_size}


# ---- the jitted phases --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Phases:
    """The jitted phases of one training setup (`make_phases`). Arrays in and out are global
    `jax.Array`s on the mesh; batches are ``[B, ...]`` with rows over data x fsdp.

    init(params) -> TrainState                       params placed shard by shard; moments
                                                     created sharded (no device holds it all)
    sync(params) -> rollout params                   ``rollout.format`` copy, ROLLOUT layout
    generate(rollout params, prompts, prompt_mask, key, temperature, top_k, top_p
             [, prompt_group]) -> rollout            prompt_group as in score; top_k = 1:
                                                     greedy
    sync_bf16, generate_bf16                         the same for the BF16 trainer policy
                                                     (held-out evaluation)
    score                                            the estimator's; autoregressive:
        score(params, prompt_tokens, prompt_mask, tokens, mask, temperature[, prompt_group])
        -> (logp, entropy)                           prompt_group (static, default 1): rows
                                                     in groups of that many with one prompt,
                                                     each prompt run once
    update(state, batch, key) -> (state, metrics)    donates ``state``; metrics replicated;
                                                     ``batch.logp_old = None`` on-policy:
                                                     computed inside (`update`)
    sft_init(params) -> opt_state                    the SFT optimizer's state
    sft_step(params, opt_state, prompt_tokens, prompt_mask, tokens, mask, key)
        -> (params, opt_state, loss)                 donates params and opt_state
    estimator                                        the `Estimator` they were built from
                                                     (its host parts: `Run` calls them)
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
    estimator: Estimator


def make_phases(
    mesh: jax.sharding.Mesh,
    cfg: TrainConfig,
    config: Config,
    *,
    eos_ids: tuple[int, ...] = (),
    pad_id: int = 0,
    compute_dtype=None,
    estimator: Estimator | None = None,
) -> Phases:
    """The phases of training ``config`` under ``cfg`` on ``mesh``, each memoised on what it
    reads (module docstring); ``eos_ids`` and ``pad_id`` are the tokenizer's, for decoding;
    ``compute_dtype`` is the trainer's (default `COMPUTE_DTYPE`); ``estimator`` is how the
    model generates and learns (default `AUTOREGRESSIVE`; a diffusion family's is
    `diffusion.ESTIMATOR`, `run.ESTIMATORS` has both). Sampling options are runtime arguments
    of ``generate``: changing them compiles nothing."""
    estimator = estimator or AUTOREGRESSIVE
    kind = family_of(config).kind
    if estimator.kind != kind:
        raise ValueError(
            f"make_phases: a {kind} model ({type(config).__name__}) with the {estimator.kind} "
            f"estimator; pass estimator=ais_jax.train.run.ESTIMATORS[{kind!r}]."
        )
    dtype = compute_dtype or COMPUTE_DTYPE
    r = cfg.rollout
    weights, bf16 = rollout_weights(r), RolloutConfig(format="bf16")
    generate = functools.partial(
        estimator.generate_phase, mesh, config, dtype=dtype, cfg=r, eos_ids=tuple(eos_ids)
    )
    return Phases(
        init=_init_phase(mesh, config, cfg.optim, cfg.steps),
        sync=_sync_phase(mesh, config, weights, dtype),
        generate=generate(weights, pad_id=pad_id),
        sync_bf16=_sync_phase(mesh, config, bf16, dtype),
        generate_bf16=generate(bf16, pad_id=pad_id),
        score=estimator.score_phase(mesh, config, dtype, weights),
        update=_update_phase(
            mesh,
            config,
            cfg.optim,
            cfg.steps,
            cfg.loss,
            cfg.correction,
            r.temperature,
            dtype,
            estimator,
        ),
        sft_init=_sft_init_phase(mesh, config, cfg.sft, estimator),
        sft_step=_sft_step_phase(mesh, config, cfg.sft, dtype, estimator),
        estimator=estimator,
    )


def rollout_weights(r: RolloutConfig) -> RolloutConfig:
    """The part of a rollout config that shapes the rollout copy of the weights (the rest at
    its defaults, so configs that differ elsewhere share the copy's phases)."""
    return RolloutConfig(format=r.format, act_scaling=r.act_scaling, fp8_lm_head=r.fp8_lm_head)


def master_shapes(config: Config) -> Params:
    """The float32 master params' shapes and dtypes."""
    return param_shapes(config, jnp.float32)


@functools.lru_cache(maxsize=PHASE_MEMO)
def rollout_copy(config: Config, rollout: RolloutConfig, dtype) -> Params:
    """The shapes and dtypes of `sync_rollout_params`'s copy (one trace per copy: `make_phases`
    and the sync and generate phases all read it; callers must not mutate it)."""
    return jax.eval_shape(
        functools.partial(sync_rollout_params, cfg=rollout, dtype=dtype), master_shapes(config)
    )


@functools.lru_cache(maxsize=PHASE_MEMO)
def _init_phase(mesh, config: Config, optim: OptimConfig, steps: int) -> Callable:
    init = functools.partial(init_state, optimizer=make_optimizer(optim, steps))
    shardings = shd.param_shardings(jax.eval_shape(init, master_shapes(config)), mesh, shd.TRAIN)
    jitted = jax.jit(init, out_shardings=shardings)

    def born_sharded(params: Params) -> TrainState:
        return jitted(jax.device_put(params, shardings.params))

    return born_sharded


@functools.lru_cache(maxsize=PHASE_MEMO)
def _sync_phase(mesh, config: Config, rollout: RolloutConfig, dtype) -> Callable:
    """Quantize (or cast) in the training layout, then let ``out_shardings`` gather the copy
    into the rollout layout (1-byte codes travel, not float32 weights), on device."""
    sync = functools.partial(sync_rollout_params, cfg=rollout, dtype=dtype)
    copy = rollout_copy(config, rollout, dtype)
    in_train = shd.param_shardings(copy, mesh, shd.TRAIN)

    def synced(params):
        return jax.lax.with_sharding_constraint(sync(params), in_train)

    return jax.jit(
        synced,
        in_shardings=(shd.param_shardings(master_shapes(config), mesh, shd.TRAIN),),
        out_shardings=shd.param_shardings(copy, mesh, shd.ROLLOUT),
    )


def generate_phase(
    mesh, config: Config, rollout: RolloutConfig, *, dtype, cfg: RolloutConfig, eos_ids, pad_id
) -> Callable:
    """The autoregressive generate phase of the copy ``rollout`` describes: `sampler.generate`
    for ``cfg.max_new_tokens`` tokens under ``cfg.decode_layout`` ("auto" resolved for the
    copy's compute dtype, so the phase is memoised on the layout itself)."""
    copy_dtype = rollout_copy(config, rollout, dtype)["embed"].dtype
    layout = sampler.resolve_layout(cfg.decode_layout, copy_dtype)
    return _generate_phase(
        mesh,
        config,
        rollout,
        dtype,
        max_new_tokens=cfg.max_new_tokens,
        eos_ids=eos_ids,
        pad_id=pad_id,
        layout=layout,
    )


@functools.lru_cache(maxsize=PHASE_MEMO)
def _generate_phase(
    mesh,
    config: Config,
    rollout: RolloutConfig,
    dtype,
    *,
    max_new_tokens,
    eos_ids,
    pad_id,
    layout: sampler.DecodeLayout,
) -> Callable:
    """`sampler.generate` with the rollout copy in the ROLLOUT layout and rows over data x fsdp,
    compiled with the sampler's `sampler.compiler_options`. Random draws do not depend on the
    mesh (threefry is partitionable), so a key gives the same tokens on any mesh; the KV cache,
    made inside, is sharded like its inputs by propagation."""
    copy = rollout_copy(config, rollout, dtype)

    def rollout_fn(params, prompts, prompt_mask, key, temperature, top_k, top_p, prompt_group=1):
        return sampler.generate(
            params,
            config,
            prompts,
            key,
            prompt_mask=prompt_mask,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            max_new_tokens=max_new_tokens,
            eos_ids=eos_ids,
            pad_id=pad_id,
            layout=layout,
            prompt_group=prompt_group,
        )

    rows, rep = shd.batch_sharding(mesh), shd.replicated(mesh)
    options = sampler.compiler_options()
    return jax.jit(
        rollout_fn,
        in_shardings=(shd.param_shardings(copy, mesh, shd.ROLLOUT), rows, rows, rep, rep, rep, rep),
        out_shardings=rows,
        static_argnums=7,  # prompt_group, given by position
        compiler_options=options or None,
    )


def score_phase(mesh, config: Config, dtype, weights: RolloutConfig | None = None) -> Callable:
    """The autoregressive score phase (`score`), one for every rollout format: ``weights``
    (the rollout copy) is not read, the sampler's log-probs are the rollout's."""
    return _score_phase(mesh, config, dtype)


@functools.lru_cache(maxsize=PHASE_MEMO)
def _score_phase(mesh, config: Config, dtype) -> Callable:

    def score_fn(params, prompt_tokens, prompt_mask, tokens, mask, temperature, prompt_group=1):
        G = check_prompt_group(prompt_group, tokens.shape[0])  # one prompt per group of G rows
        prompts = (prompt_tokens[::G], prompt_mask[::G])
        return score(params, config, *prompts, tokens, mask, temperature, dtype=dtype)

    rows = shd.batch_sharding(mesh)
    master = shd.param_shardings(master_shapes(config), mesh, shd.TRAIN)
    return jax.jit(
        score_fn,
        in_shardings=(master, rows, rows, rows, rows, shd.replicated(mesh)),
        out_shardings=rows,
        static_argnums=6,  # prompt_group, given by position
    )


@functools.lru_cache(maxsize=PHASE_MEMO)
def _update_phase(
    mesh,
    config: Config,
    optim: OptimConfig,
    steps: int,
    loss_cfg: LossConfig,
    correction: CorrectionConfig,
    temperature: float,
    dtype,
    estimator: Estimator,
) -> Callable:
    optimizer = make_optimizer(optim, steps)
    step = functools.partial(
        estimator.update,
        config=config,
        optimizer=optimizer,
        optim=optim,
        loss_cfg=loss_cfg,
        correction=make_correction(correction),
        temperature=temperature,
        dtype=dtype,
    )
    init = functools.partial(init_state, optimizer=optimizer)
    state = jax.eval_shape(init, master_shapes(config))
    state_sh, rep = shd.param_shardings(state, mesh, shd.TRAIN), shd.replicated(mesh)
    return jax.jit(
        step,
        in_shardings=(state_sh, shd.batch_sharding(mesh), rep),
        out_shardings=(state_sh, rep),
        donate_argnums=0,
    )


@functools.lru_cache(maxsize=PHASE_MEMO)
def _sft_init_phase(mesh, config: Config, sft: SFTConfig, estimator: Estimator) -> Callable:
    init = estimator.sft_optimizer(sft).init
    shardings = shd.param_shardings(jax.eval_shape(init, master_shapes(config)), mesh, shd.TRAIN)
    master = shd.param_shardings(master_shapes(config), mesh, shd.TRAIN)
    return jax.jit(init, in_shardings=(master,), out_shardings=shardings)


@functools.lru_cache(maxsize=PHASE_MEMO)
def _sft_step_phase(mesh, config: Config, sft: SFTConfig, dtype, estimator: Estimator) -> Callable:
    optimizer = estimator.sft_optimizer(sft)
    step = functools.partial(estimator.sft_step, config=config, optimizer=optimizer, dtype=dtype)
    master = shd.param_shardings(master_shapes(config), mesh, shd.TRAIN)
    opt_state = jax.eval_shape(optimizer.init, master_shapes(config))
    opt_sh = shd.param_shardings(opt_state, mesh, shd.TRAIN)
    rows, rep = shd.batch_sharding(mesh), shd.replicated(mesh)
    return jax.jit(
        step,
        in_shardings=(master, opt_sh, rows, rows, rows, rows, rep),
        out_shardings=(master, opt_sh, rep),
        donate_argnums=(0, 1),
    )


AUTOREGRESSIVE = Estimator(
    kind="autoregressive",
    generate_phase=generate_phase,
    score_phase=score_phase,
    update=update,
    sft_optimizer=make_sft_optimizer,
    sft_step=sft_step,
    experience=experience,
    sft_responses=sft_responses,
    vocab_overrides=vocab_overrides,
)
