"""The training run of a masked-diffusion model (``model.family: llada``): `DiffusionRun`.

`DiffusionRun` is a `runner.Run` whose model, phases, SFT, sampling and experience collection
are LLaDA's; everything else -- the data streams, rewards, evaluation (greedy = temperature 0,
and sampled at the rollout temperature), checkpoints, resume, and, through
`job.run_training`, the metrics rows, TensorBoard events, plots and summary -- is the
autoregressive run's code. `job.make_run` picks it from the config.

One RL step (`diffusion_train`'s phase section has the equations):

    sync      rollout copy of the trainer weights (``rollout.format``: bf16, FP8, FP4 ...)
    generate  LLaDA's semi-autoregressive sampler (`rollout.diffusion`: block_length, steps,
              remasking) for ``rollout.max_new_tokens`` positions, cut at the first EOS
    (host)    decode, reward, group-relative advantages
    score     J = ``optim.ppo_epochs`` prompt masks (d1's mu inner updates, a new mask each):
              per mask, logp_rollout (rollout copy) and logp_old (BF16 trainer, start-of-batch
              params) on the same corrupted input, so the correction sees precision alone
    update    J inner updates x ``optim.minibatches`` of `grpo.loss` + the correction

Keys: step s draws ``rollout_key, update_key = split(fold_in(key(seed), s))`` as `Run.step`;
the rollout splits ``rollout_key`` into the sampler's key and the masks' key, whose J
``split``s are the inner updates' prompt masks (mask 0 is also the sampler's ``logp_key``), so
a resumed run repeats every draw.

The SFT warm start is LLaDA's masked-diffusion loss (`diffusion_train.sft_loss`) on the task's
demonstrations with the response padded by EOS up to ``max_new_tokens`` and those EOS counted
as answer tokens (LLaDA's SFT recipe, which teaches the model to fill the tail with EOS).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ais_jax.models.llada import LLaDAConfig, init_params
from ais_jax.parallel import sharding as shd
from ais_jax.rollout import diffusion as ds
from ais_jax.tasks import CharTokenizer
from ais_jax.train import data
from ais_jax.train import diffusion as diffusion_train
from ais_jax.train import step as train
from ais_jax.train.run import Run, timed

SFT_STREAM = 2**32 - 2  # the SFT masks' keys: fold_in(key(seed), SFT_STREAM), then the step


class DiffusionRun(Run):
    """`runner.Run` for a LLaDA model (module docstring); same interface and files."""

    def _model(self) -> tuple[LLaDAConfig, Any]:
        spec = self.cfg.model
        self.tokenizer = CharTokenizer()
        config = LLaDAConfig.preset(spec.preset, **spec.overrides())
        tok = self.tokenizer
        ids = {"eos_token_id": tok.eos_id, "pad_token_id": tok.pad_id}
        fits = config.mask_token_id >= tok.vocab_size  # the mask token is no character
        if not fits or any(getattr(config, k) != v for k, v in ids.items()):
            raise ValueError(
                f"model.preset={spec.preset!r} (mask id {config.mask_token_id}, eos/pad "
                f"{config.eos_token_id}/{config.pad_token_id}) does not fit the character "
                f"tokenizer (ids 0..{tok.vocab_size - 1}, eos {tok.eos_id}, pad {tok.pad_id}, "
                "and a mask id above them); use model.preset=tiny."
            )
        return config, init_params(config, jax.random.key(self.cfg.seed))

    def _phases(self) -> diffusion_train.DiffusionPhases:
        tok = self.tokenizer
        return diffusion_train.make_phases(
            self.mesh, self.cfg, self.model_config, eos_ids=tok.eos_ids, pad_id=tok.pad_id
        )

    def sft(self, progress=None) -> list[float]:
        """Masked-diffusion SFT warm start (its own Adam, discarded after); EOS-padded answers."""
        c, tok = self.cfg, self.tokenizer
        if c.sft.steps == 0:
            return []
        params = self.state.params
        opt_state = self.phases.sft_init(params)
        batches = self._batches(data.demonstration_batches, c.sft.batch_size)
        sft_key = jax.random.fold_in(self.key, SFT_STREAM)
        losses = []
        for i in range(c.sft.steps):
            examples = next(batches)
            pt, pm = self._encode_prompts(self.task, examples)
            answers = [e.demonstration for e in examples]
            rt, rm = data.encode_responses(tok, answers, c.rollout.max_new_tokens)
            rt, rm = np.where(rm, rt, tok.eos_id), np.ones_like(rm)  # EOS padding is answer
            batch = shd.shard_batch((pt, pm, rt, rm), self.mesh)
            key = jax.random.fold_in(sft_key, i)
            params, opt_state, loss = self.phases.sft_step(params, opt_state, *batch, key)
            if progress is not None and (i % 10 == 0 or i == c.sft.steps - 1):
                losses.append(float(loss))
                progress(i + 1, c.sft.steps, losses[-1])
        self.state = self.phases.init(params)
        return losses

    def _sample(
        self, generate, params, prompts, mask, key, *, greedy=False, temperature=None
    ) -> ds.DiffusionRollout:
        """``generate`` on this process's rows: temperature 0 (argmax) when ``greedy``, else
        ``temperature`` (default: the rollout's); the sampler's ``logp_key`` from ``key``."""
        r = self.cfg.rollout
        temperature = 0.0 if greedy else r.temperature if temperature is None else temperature
        key, logp_key = jax.random.split(key)
        return self._generate(generate, params, prompts, mask, key, logp_key, temperature)

    def _generate(self, generate, params, prompts, mask, key, logp_key, temperature):
        d = self.cfg.rollout.diffusion
        prompts, mask = shd.shard_batch((prompts, mask), self.mesh)
        remasking = jnp.int32(ds.REMASKING.index(d.remasking))
        return generate(
            params,
            prompts,
            mask,
            key,
            logp_key,
            jnp.float32(temperature),
            remasking,
            jnp.float32(d.p_mask_prompt),
        )

    def mask_keys(self, key: jax.Array) -> tuple[jax.Array, jax.Array]:
        """``(sampler key, [J] prompt-mask keys)`` of a step's rollout key."""
        sample_key, masks_key = jax.random.split(key)
        return sample_key, jax.random.split(masks_key, self.cfg.optim.ppo_epochs)

    def collect(self, key: jax.Array) -> tuple[train.Batch, dict[str, float]]:
        """Sync, rollout, reward, and score on J prompt masks: one batch of experience
        (`diffusion_train`'s layout, inner-update axis after the rows) and the step's metrics,
        as `Run.collect`. ``policy/entropy``: the BF16 trainer's mean-field token entropy on
        mask 0."""
        c, G = self.cfg, self.cfg.rollout.group_size
        times = {}
        with timed(times, "time/sync_s"):
            rollout_params = jax.block_until_ready(self.phases.sync(self.state.params))

        examples = [ex for ex in next(self.prompts) for _ in range(G)]
        prompts, prompt_mask = self._encode_prompts(self.task, examples)
        sample_key, mask_keys = self.mask_keys(key)
        with timed(times, "time/rollout_s"):
            ro = self._generate(
                self.phases.generate,
                rollout_params,
                prompts,
                prompt_mask,
                sample_key,
                mask_keys[0],
                c.rollout.temperature,
            )
            ro = jax.block_until_ready(ro)

        with timed(times, "time/reward_s"):
            rewards, advantages = self._advantages(examples, ro)

        with timed(times, "time/score_s"):
            p_mask = jnp.float32(c.rollout.diffusion.p_mask_prompt)
            scored = self.phases.score(
                rollout_params,
                self.state.params,
                ro.prompt_tokens,
                ro.prompt_mask,
                ro.tokens,
                ro.mask,
                mask_keys,
                p_mask,
            )
            scored = jax.block_until_ready(scored)
        del rollout_params

        batch = train.Batch(
            prompt_tokens=scored.prompt_tokens,
            prompt_mask=ro.prompt_mask,
            tokens=ro.tokens,
            mask=ro.mask,
            logp_rollout=scored.logp_rollout,
            logp_old=scored.logp_old,
            advantages=advantages,
        )
        return batch, {**self._rollout_metrics(rewards, ro, scored.entropy), **times}
