"""ais_jax inside tunix (`ais_jax.integrations.tunix`): the ``"grpo_ais"`` policy loss against
tunix's own ``"grpo"`` loss, the Qwen3 name map against tunix's model, ais_jax's rollout against
tunix's sampler, and a few GRPO steps of tunix's learner with FP8 rollouts and AIS.

tunix (``google-tunix`` 0.1.7) is installed by the test command (the ``tunix`` extra, then the
package itself with ``--no-deps``: its ``safetensors<0.8`` pin conflicts with transformers 5.24's
``>=0.8``; README). The references here are tunix's code, which no one here wrote.
"""

from __future__ import annotations

import dataclasses
import functools
import random
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import XLA_DEFAULTS
from flax import nnx
from tunix.generate import sampler as tunix_sampler
from tunix.generate import tokenizer_adapter
from tunix.models.qwen3 import model as tunix_qwen3
from tunix.rl import common, function_registry
from tunix.rl import rl_cluster as rl_cluster_lib
from tunix.rl.grpo import grpo_learner
from tunix.rl.rollout import base_rollout
from tunix.sft import metrics_logger

from ais_jax import ais, init_params
from ais_jax.config import RolloutConfig
from ais_jax.integrations import tunix as ais_tunix
from ais_jax.models import forward
from ais_jax.rollout.sampler import generate
from ais_jax.tasks.arithmetic import Arithmetic
from ais_jax.tasks.tokenizer import CharTokenizer
from ais_jax.train.step import sync_rollout_params

README = Path(__file__).resolve().parents[1] / "README.md"
TOKENIZER = CharTokenizer()
SLOW = pytest.mark.slow  # each case compiles a model's loss and gradient twice
PAD, EOS = TOKENIZER.pad_id, TOKENIZER.eos_id


@pytest.fixture(autouse=True)
def _tunix_broadcasts():
    """tunix's own code broadcasts across ranks (e.g. its RoPE's ``positions[..., None] /
    timescale[None, None, :]`` against [B, T, N, H] inputs); the suite's strict rank promotion
    would reject tunix, not ais_jax, so this module allows it."""
    with jax.numpy_rank_promotion("allow"):
        yield


def _tunix_config(*, tied: bool, rope_theta: int = 1_000_000) -> tunix_qwen3.ModelConfig:
    return tunix_qwen3.ModelConfig(
        num_layers=2,
        vocab_size=TOKENIZER.vocab_size,
        embed_dim=32,
        hidden_dim=48,
        num_heads=4,
        head_dim=8,
        num_kv_heads=2,
        rope_theta=rope_theta,
        norm_eps=1e-6,
        use_tied_embedding=tied,
    )


def _mesh():
    auto = (jax.sharding.AxisType.Auto,) * 2  # tunix's gathers need automatic sharding
    return jax.make_mesh((1, 1), ("fsdp", "tp"), axis_types=auto)


def _random_model(config: tunix_qwen3.ModelConfig, seed: int = 0) -> tunix_qwen3.Qwen3:
    """A tunix Qwen3 holding ais_jax's random init (tunix initializes its linear weights to 0),
    norms 1 + 0.2 N(0, 1): written through `params_to_tunix`."""
    with jax.set_mesh(_mesh()):
        model = tunix_qwen3.Qwen3(config, rngs=nnx.Rngs(seed))
    c = ais_tunix.model_config(config)
    params = init_params(c, jax.random.key(seed))
    keys = iter(jax.random.split(jax.random.key(seed + 1), 16))
    for name in ("input_norm", "post_norm", "q_norm", "k_norm"):
        w = params["layers"][name]
        params["layers"][name] = 1 + 0.2 * jax.random.normal(next(keys), w.shape)
    params = jax.tree.map(lambda w: 10 * w if w.ndim > 1 else w, params)  # O(1) logits
    nnx.update(model, nnx.from_flat_state(ais_tunix.params_to_tunix(params, c)))
    return model


def _flat_params(model) -> dict:
    return ais_tunix._flat(nnx.state(model, nnx.Param))


# ----------------------------------------------------------------------------- the name map


@pytest.mark.parametrize("tied", [True, False])
def test_name_map_round_trips_both_ways(tied):
    config = _tunix_config(tied=tied)
    model = _random_model(config)
    c = ais_tunix.model_config(config)
    tunix_flat = _flat_params(model)
    params = ais_tunix.params_from_tunix(nnx.state(model, nnx.Param), c)
    back = ais_tunix.params_to_tunix(params, c)
    assert back.keys() == tunix_flat.keys()
    for path, w in tunix_flat.items():
        np.testing.assert_array_equal(back[path], w, err_msg=str(path))
    # and from ais_jax's side: its tree -> tunix -> its tree
    ref = init_params(c, jax.random.key(3))
    again = ais_tunix.params_from_tunix(ais_tunix.params_to_tunix(ref, c), c)
    jax.tree.map(np.testing.assert_array_equal, again, ref)
    assert ("lm_head" in params) == (not tied)


@pytest.mark.parametrize("tied", [True, False])
def test_mapped_params_give_tunix_logits(tied):
    """ais_jax's forward on the mapped weights equals tunix's Qwen3 forward (float32): a
    transposed or mis-split projection, or a wrong RoPE theta, fails."""
    config = _tunix_config(tied=tied, rope_theta=10_000)  # tunix rotates with 1e6 regardless
    model = _random_model(config, seed=1)
    c = ais_tunix.model_config(config)
    params = ais_tunix.params_from_tunix(nnx.state(model, nnx.Param), c)
    tokens = jax.random.randint(jax.random.key(0), (3, 9), 3, TOKENIZER.vocab_size)
    mask = jnp.ones((3, 9), bool).at[0, :3].set(False)  # a left-padded row
    ref, _ = model(
        tokens,
        positions=common.build_positions_from_mask(mask),
        cache=None,
        attention_mask=common.make_causal_attn_mask(mask),
    )
    got = forward(params, c, tokens, mask)
    assert float(jnp.abs(ref).max()) > 1.0  # logits of size, not near zero
    err = jnp.abs(got - ref)[mask]
    assert float(err.max()) < 1e-5 * max(1.0, float(jnp.abs(ref).max())), float(err.max())


def test_model_config_refuses_what_it_cannot_run():
    with pytest.raises(TypeError, match="tunix.models.qwen3"):
        ais_tunix.model_config(object())
    moe = _tunix_config(tied=True)
    moe = dataclasses.replace(moe, num_experts=4, num_experts_per_tok=2)
    with pytest.raises(NotImplementedError, match="num_experts=4"):
        ais_tunix.model_config(moe)


# ----------------------------------------------------------------------------- the loss


@pytest.fixture(scope="module")
def loss_case():
    """A model, a GRPO batch (left-padded prompts, a completion that ends early) and the
    trainer's log-probs of it, computed by tunix."""
    model = _random_model(_tunix_config(tied=True), seed=2)
    rng = np.random.default_rng(0)
    B, P, T = 4, 5, 6
    prompts = jnp.asarray(rng.integers(3, TOKENIZER.vocab_size, (B, P)), jnp.int32)
    prompts = prompts.at[0, :2].set(PAD)
    completions = jnp.asarray(rng.integers(3, TOKENIZER.vocab_size, (B, T)), jnp.int32)
    completions = completions.at[1, 4:].set(PAD)
    graphdef, state = nnx.split(model)
    score = lambda state: common.compute_per_token_logps(  # noqa: E731
        graphdef, state, prompt_tokens=prompts, completion_tokens=completions, pad_id=PAD,
        eos_id=EOS, stop_gradient=True,
    )  # fmt: skip
    logp = jax.jit(score, **XLA_DEFAULTS)(state)  # compiled as `_loss_and_grads` compiles
    example = ais_tunix.TrainExample(
        prompt_ids=prompts,
        prompt_mask=prompts != PAD,
        completion_ids=completions,
        completion_mask=completions != PAD,
        advantages=jnp.asarray(rng.normal(size=B), jnp.float32),
        ref_per_token_logps=None,
        old_per_token_logps=logp,
        rollout_per_token_logps=logp,
    )
    noise = jnp.asarray(rng.normal(size=(B, T)), jnp.float32)
    return model, example, noise


def _loss_and_grads(loss_fn, model, example, algo_config):
    """(loss, aux, grads) of a tunix policy loss, jitted as tunix's trainer jits it, with XLA's
    default CPU options (as a user's run compiles): the suite's fast-compile flags (conftest)
    round the two programs below differently in the gradients' last bits, [B] advantages
    broadcast in one and a [B, T] array in the other (4e-6 of 1e-2 seen)."""

    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    @functools.partial(jax.jit, **XLA_DEFAULTS)
    def step(params, example):
        def loss(params):
            return loss_fn(nnx.merge(graphdef, params, rest), example, algo_config, PAD, EOS)

        (value, aux), grads = jax.value_and_grad(loss, has_aux=True)(params)
        return value, aux, grads

    return step(params, example)


def _config(**kwargs) -> ais_tunix.GRPOConfig:
    config = ais_tunix.GRPOConfig(num_generations=2, beta=0.0, **kwargs)
    config.temperature = 1.0  # the learner sets it from the rollout config
    return config


def _assert_same(a, b):
    jax.tree.map(np.testing.assert_array_equal, a, b)


@pytest.mark.parametrize(
    "correction, old_logps",
    [
        ("adaptive", "given"),
        ("adaptive", "computed in the loss"),
        *(
            pytest.param(name, old, marks=SLOW)
            for name in sorted(set(ais_tunix.CORRECTIONS) - {"adaptive"})
            for old in ("given", "computed in the loss")
        ),
    ],
)
def test_on_policy_loss_and_grads_equal_tunix_grpo_bit_for_bit(loss_case, correction, old_logps):
    """Identical rollout and trainer log-probs: every correction leaves the advantages as they
    are, so ``"grpo_ais"`` is tunix's ``"grpo"``, loss and gradient, to the bit. With the old
    log-probs absent (one iteration), the loss computes the trainer's own."""
    model, example, _ = loss_case
    if old_logps != "given":
        example = example.replace(old_per_token_logps=None)
    config = _config(correction=correction)
    grpo = function_registry.get_policy_loss_fn("grpo")
    loss, aux, grads = _loss_and_grads(grpo, model, example, config)
    ais_loss, ais_aux, ais_grads = _loss_and_grads(ais_tunix.grpo_ais_loss, model, example, config)
    _assert_same(ais_loss, loss)
    _assert_same(ais_grads, grads)
    assert float(ais_aux["mismatch/mean_abs"]) == 0.0
    assert {k: ais_aux[k] for k in aux}.keys() == aux.keys()
    assert float(jnp.abs(loss)) > 1e-3  # a loss of size: advantages and ratios are not zero


@pytest.mark.parametrize(
    "correction, kwargs",
    [
        ("adaptive", {}),
        pytest.param("adaptive", {"clip": 2.0, "delta": 0.5, "beta_var": 0.3}, marks=SLOW),
        pytest.param("truncated", {"clip": 1.5}, marks=SLOW),
        pytest.param("masked", {"low": 0.8, "high": 1.25}, marks=SLOW),
        pytest.param("uncorrected", {}, marks=SLOW),
    ],
)
def test_loss_is_tunix_grpo_on_the_advantages_ais_jax_corrects(loss_case, correction, kwargs):
    """A known mismatch: ``"grpo_ais"`` equals tunix's ``"grpo"`` on the advantages the
    `ais_jax.ais` factory makes by hand, loss and gradient to the bit, and its aux carries that
    call's metrics; every correction but "uncorrected" changes the loss."""
    model, example, noise = loss_case
    logp_train = example.old_per_token_logps
    example = example.replace(rollout_per_token_logps=logp_train + 0.4 * noise)
    by_hand = jax.jit(ais_tunix.CORRECTIONS[correction](**kwargs), **XLA_DEFAULTS)
    corrected, metrics = by_hand(
        example.advantages, logp_train, example.rollout_per_token_logps, example.completion_mask
    )
    grpo = function_registry.get_policy_loss_fn("grpo")
    config = _config(correction=correction, correction_kwargs=kwargs)
    want, _, want_grads = _loss_and_grads(
        grpo, model, example.replace(advantages=corrected), config
    )
    got, aux, got_grads = _loss_and_grads(ais_tunix.grpo_ais_loss, model, example, config)
    _assert_same(got, want)
    _assert_same(got_grads, want_grads)
    for key, value in metrics.items():
        np.testing.assert_array_equal(aux[key], value, err_msg=key)
    raw, _, _ = _loss_and_grads(grpo, model, example, config)
    assert (float(got) == float(raw)) == (correction == "uncorrected")


def test_loss_names_what_is_missing(loss_case):
    model, example, _ = loss_case
    with pytest.raises(ValueError, match="rollout_per_token_logps"):
        ais_tunix.grpo_ais_loss(
            model, example.replace(rollout_per_token_logps=None), _config(), PAD, EOS
        )


def test_config_checks_the_correction_eagerly():
    with pytest.raises(ValueError, match=r"correction='ais'; allowed: \['adaptive'"):
        ais_tunix.GRPOConfig(num_generations=2, correction="ais")
    with pytest.raises(ValueError, match="clip"):
        ais_tunix.GRPOConfig(num_generations=2, correction_kwargs={"clip": 0.5})
    with pytest.raises(ValueError, match="policy_loss_fn='grpo'"):
        ais_tunix.GRPOConfig(num_generations=2, policy_loss_fn="grpo")
    with pytest.raises(ValueError, match="loss_algo='gspo-token'"):
        ais_tunix.GRPOConfig(num_generations=2, loss_algo="gspo-token")


def test_metric_reductions_name_every_metric():
    one = jnp.ones((1, 3))
    _, metrics = ais.adaptive()(jnp.ones((1,)), one, one, one)
    reductions = ais_tunix.metric_reductions()
    assert reductions.keys() == metrics.keys()
    assert reductions["mismatch/ratio_max"] is np.max and reductions["ais/alpha"] is np.mean


# ----------------------------------------------------------------------------- the rollout


def _rollout_config(**kwargs) -> base_rollout.RolloutConfig:
    base = dict(
        max_tokens_to_generate=8,
        max_prompt_length=8,
        kv_cache_size=16,
        temperature=1.0,
        top_p=1.0,
        top_k=None,
        return_logprobs=True,
    )
    return base_rollout.RolloutConfig(**{**base, **kwargs})


def test_rollout_prompts_match_tunix_sampler_and_logprobs_score_the_samples():
    """ais_jax's rollout left-pads the prompts as tunix's own `Sampler` does; its completions
    are ais_jax's samples up to, not including, the first end-of-sequence id, with their
    log-probs; those are close to tunix's float32 trainer's (the FP8 mismatch) but not equal."""
    config = _tunix_config(tied=True)
    model = _random_model(config, seed=3)
    tokenizer = tokenizer_adapter.TokenizerAdapter(ais_tunix.Tokenizer(TOKENIZER))
    rollout = ais_tunix.Rollout(model, tokenizer, None, _rollout_config())
    prompts = ["12+7=", "12+7=", "3+45=", "3+45=", "123+4567=", "123+4567="]  # the last: > 8 ids
    out = rollout.generate(prompts, _rollout_config())
    reference = tunix_sampler.Sampler(
        model,
        tokenizer,
        tunix_sampler.CacheConfig(cache_size=64, num_layers=2, num_kv_heads=2, head_dim=8),
    )(prompts, max_generation_steps=2, max_prompt_length=8, temperature=1.0, top_p=1.0)
    np.testing.assert_array_equal(out.left_padded_prompt_tokens, reference.padded_prompt_tokens)
    assert out.left_padded_prompt_tokens.shape[1] == 16  # 11 ids -> the next power of two
    # completions stop before the first end-of-sequence id: with many of them, rows end early
    stops = tuple(range(3, 20))
    stopped = rollout.generate(prompts, _rollout_config(eos_tokens=list(stops)))
    sampled = generate(
        rollout.params, rollout.config, jnp.asarray(stopped.left_padded_prompt_tokens),
        jax.random.fold_in(jax.random.key(0), 1),  # the rollout's second call
        prompt_mask=stopped.left_padded_prompt_tokens != PAD, max_new_tokens=8, eos_ids=stops,
        pad_id=PAD, prompt_group=2,
    )  # fmt: skip
    assert any(len(t) < 8 for t in stopped.tokens)
    for i, t in enumerate(stopped.tokens):
        np.testing.assert_array_equal(t, sampled.tokens[i, : len(t)])
        assert not set(t.tolist()) & set(stops)
        assert len(t) == 8 or int(sampled.tokens[i, len(t)]) in stops
        np.testing.assert_array_equal(stopped.logprobs[i], sampled.logp_plain[i, : len(t)])
    assert [len(p) for p in out.logprobs] == [len(t) for t in out.tokens]
    assert out.text == [TOKENIZER.decode(t.tolist()) for t in out.tokens]
    # tunix's float32 trainer scores the same tokens: the BF16 copy's log-probs are close to
    # its, the FP8 copy's further off (both measured on this model: ~0.03 and ~0.4 nats)
    gaps = {}
    for fmt in ("bf16", "float8_e4m3fn"):
        copy = ais_tunix.Rollout(model, tokenizer, None, _rollout_config(), format=fmt)
        gaps[fmt] = _trainer_gap(copy, copy.generate(prompts, _rollout_config()))
    assert 1e-3 < gaps["bf16"] < 0.1 and gaps["float8_e4m3fn"] > 2 * gaps["bf16"], gaps


def _trainer_gap(rollout, out) -> float:
    """Mean |trainer - rollout log-prob| over the completions of ``out`` that hold no pad id
    (tunix's scoring drops a sampled pad id from the attention: a different context after it)."""
    rows = [i for i, t in enumerate(out.tokens) if len(t) and PAD not in t]
    assert len(rows) >= 3, out.tokens
    T = max(len(t) for t in out.tokens)
    completions = np.full((len(rows), T), PAD, np.int32)
    rollout_logp = np.zeros((len(rows), T), np.float32)
    for r, i in enumerate(rows):
        completions[r, : len(out.tokens[i])], rollout_logp[r, : len(out.tokens[i])] = (
            out.tokens[i],
            out.logprobs[i],
        )
    prompts = jnp.asarray(out.left_padded_prompt_tokens[rows])
    trainer_logp = np.asarray(rollout.get_per_token_logps(prompts, jnp.asarray(completions)))
    return float(np.abs(trainer_logp - rollout_logp)[completions != PAD].mean())


def test_rollout_copy_follows_the_trainer_weights():
    """`update_params` (tunix's weight sync) makes the rollout copy of the new weights: equal
    to quantizing them directly, and different from the copy before."""
    config = _tunix_config(tied=False)
    model = _random_model(config, seed=4)
    tokenizer = tokenizer_adapter.TokenizerAdapter(ais_tunix.Tokenizer(TOKENIZER))
    rollout = ais_tunix.Rollout(model, tokenizer, None, _rollout_config())
    before = rollout.params
    newer = _random_model(config, seed=5)
    rollout.update_params(nnx.state(newer, nnx.Param))
    c = ais_tunix.model_config(config)
    want = sync_rollout_params(
        ais_tunix.params_from_tunix(nnx.state(newer, nnx.Param), c), RolloutConfig()
    )
    jax.tree.map(np.testing.assert_array_equal, rollout.params, want)
    assert not np.array_equal(
        np.asarray(before["layers"]["q_proj"].quant, np.float32),
        np.asarray(rollout.params["layers"]["q_proj"].quant, np.float32),
    )


# ----------------------------------------------------------------------------- the learner


def _cluster(model, rollout_engine, *, steps: int, log_dir, rollout_config=None):
    mesh = _mesh()
    return rl_cluster_lib.RLCluster(
        actor=model,
        tokenizer=ais_tunix.Tokenizer(TOKENIZER),
        cluster_config=rl_cluster_lib.ClusterConfig(
            role_to_mesh={role: mesh for role in rl_cluster_lib.Role},
            rollout_engine=rollout_engine,
            training_config=rl_cluster_lib.RLTrainingConfig(
                actor_optimizer=optax.adamw(3e-3, weight_decay=0.0),
                eval_every_n_steps=10**6,
                max_steps=steps,
                metrics_logging_options=metrics_logger.MetricsLoggerOptions(log_dir=str(log_dir)),
                pbar_description=None,
            ),
            rollout_config=rollout_config or _rollout_config(),
        ),
    )


def _dataset(steps: int, prompts: int = 4):
    task, rng = Arithmetic(ops=("+",), min_digits=1, max_digits=2), random.Random(0)
    batches = []
    for _ in range(steps):
        examples = [task.sample(rng) for _ in range(prompts)]
        batches.append({"prompts": np.array([e.prompt for e in examples])})
    return batches


def _digits_reward(prompts, completions, **_):
    """A dense reward (the share of digits in the completion), so advantages are not all 0."""
    return [sum(ch.isdigit() for ch in c) / 8 for c in completions]


def _history(cluster, key):
    return cluster.actor_trainer.metrics_logger.get_metric_history("actor", key, "train")


def _readme_example():
    """The README's "Inside tunix" example, as written."""
    text = README.read_text()
    section = text[text.index("### Inside tunix") :]
    namespace: dict = {}
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    exec(compile(code, str(README), "exec"), namespace)  # noqa: S102 - our own README
    return namespace["train_fp8_ais"]


@pytest.mark.slow
def test_tunix_grpo_trains_with_fp8_rollouts_and_ais(tmp_path):
    """Three GRPO steps of tunix's learner on a tiny Qwen3 as the README's example runs them,
    sampling from ais_jax's FP8 copy and corrected by AIS: the weights change, the rollout copy
    is re-made from them at each sync, and the correction's metrics reach tunix's metric
    logger, showing the FP8 mismatch."""
    steps = 3
    model = _random_model(_tunix_config(tied=True), seed=6)
    before = jax.tree.map(np.asarray, _flat_params(model))
    cluster = _readme_example()(
        model,
        ais_tunix.Tokenizer(TOKENIZER),
        _dataset(steps),
        _digits_reward,
        steps=steps,
        mesh=_mesh(),
        log_dir=str(tmp_path),
    )
    after = _flat_params(cluster.actor_trainer.model)
    assert all(not np.array_equal(before[k], after[k]) for k in before)
    c = ais_tunix.model_config(model.config)
    want = sync_rollout_params(ais_tunix.params_from_tunix(after, c), RolloutConfig())
    jax.tree.map(np.testing.assert_array_equal, cluster.rollout.params, want)
    alpha, mismatch = _history(cluster, "ais/alpha"), _history(cluster, "mismatch/mean_abs")
    ess = _history(cluster, "ais/ess_ratio_truncated")
    assert len(alpha) == len(mismatch) == len(ess) == steps
    assert np.all((mismatch > 1e-3) & (mismatch < 0.5)), mismatch  # FP8 vs float32: real, small
    assert np.all(alpha > 0) and np.all(ess < 1), (alpha, ess)


@pytest.mark.slow
def test_vanilla_rollout_with_logprobs_has_no_mismatch(tmp_path):
    """The learner also carries tunix's own sampler's log-probs: on the trainer's weights in the
    trainer's precision the mismatch AIS sees is float32 rounding, and AIS leaves it alone."""
    model = _random_model(_tunix_config(tied=True), seed=7)
    cluster = _cluster(model, "vanilla", steps=1, log_dir=tmp_path)
    learner = ais_tunix.GRPOLearner(
        rl_cluster=cluster,
        algo_config=ais_tunix.GRPOConfig(num_generations=4, beta=0.0),
        reward_fns=_digits_reward,
    )
    learner.train(_dataset(1))
    assert float(_history(cluster, "mismatch/mean_abs")[0]) < 1e-5
    assert float(_history(cluster, "ais/alpha")[0]) < 1e-3  # alpha_mis = mismatch / delta


def test_learner_asks_for_logprobs_and_its_config(tmp_path):
    model = _random_model(_tunix_config(tied=True), seed=8)
    cluster = _cluster(
        model, "vanilla", steps=1, log_dir=tmp_path,
        rollout_config=_rollout_config(return_logprobs=False),
    )  # fmt: skip
    with pytest.raises(TypeError, match="ais_jax.integrations.tunix.GRPOConfig"):
        ais_tunix.GRPOLearner(
            rl_cluster=cluster,
            algo_config=grpo_learner.GRPOConfig(num_generations=4),
            reward_fns=_digits_reward,
        )
    learner = ais_tunix.GRPOLearner(
        rl_cluster=cluster,
        algo_config=ais_tunix.GRPOConfig(num_generations=4, beta=0.0),
        reward_fns=_digits_reward,
    )
    with pytest.raises(ValueError, match="return_logprobs=True"):
        learner.train(_dataset(1))
